"""Document masks for packed sequences: FlexAttention mask_mods, a dense reference, a BlockMask.

A pack holds K episodes back to back; ``doc_ids_T`` names the episode of each token (-1 on
padding). A token attends only inside its own episode, and an optional *inner* mask (causal,
frame-causal, sliding window) is applied in episode-local positions, as if the episode were
alone. Three episodes of lengths ``[3, 2, 3]`` padded to 9, ``document_mask_mod`` with no inner
mask (``#`` attends, ``.`` does not; the pad token attends to nothing)::

    kv ->      0 0 0 1 1 2 2 2 -
    q  0       # # # . . . . . .
       0       # # # . . . . . .
       0       # # # . . . . . .
       1       . . . # # . . . .
       1       . . . # # . . . .
       2       . . . . . # # # .
       2       . . . . . # # # .
       2       . . . . . # # # .
       -1      . . . . . . . . .

Padding rule, self- and cross-attention alike: a padding query attends to nothing (every
backend of `packing.attention._packed` returns exactly 0 for it) and a padding key is never attended.
So no tile holds padding work: a pack's attention costs the same whatever its empty tail.

Layout requirement: each document is one contiguous run and ids increase along the sequence
(padding -1 may sit between documents and at the tail), which is what ``PackedCollator``
emits. It is checked for CPU tensors; on an accelerator it is trusted, because checking would
need a host-device sync (call :func:`validate_doc_ids` yourself if in doubt).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from packing._layout_math import ceil_div, check_doc_runs, local_positions
from packing._validate import check_bool, check_int, is_int
from packing.attention._block_tables import (
    BlockRule,
    BlockTables,
    block_tables,
    classify_blocks,
    doc_side,
    document_rule,
    evaluate_tiles,
    tables_from_flags,
    unknown_rule,
)
from packing.attention._compile import BLOCK_MASK_GRAPHS, check_torch_version

__all__ = [
    "BlockRule",
    "InnerMask",
    "MaskMod",
    "TileRule",
    "causal",
    "dense_mask",
    "document_mask_mod",
    "frame_causal",
    "make_block_mask",
    "sliding_window",
    "validate_doc_ids",
    "with_block_rule",
    "with_tile_rule",
]

# inner(b, h, q_local, kv_local) -> bool tensor, positions inside the episode.
InnerMask = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
# tile_rule(q_block, kv_block) -> (any_RC, all_RC): an extra mask_mod's tiles, bool (R, C).
TileRule = Callable[[int, int], tuple[Tensor, Tensor]]


# --------------------------------------------------------------------------- inner masks


def with_block_rule(inner: InnerMask, rule: BlockRule, name: str | None = None) -> InnerMask:
    """Attach a block rule to an inner mask so ``make_block_mask`` needs no pair evaluation.

    ``rule(a, b, c, d) -> (any, all)`` answers, for q rows ``a..b`` and kv columns ``c..d`` of
    one episode (inclusive, episode-local, elementwise over int64 tensors): may any pair be
    true, and is every pair true. ``any`` may over-approximate and ``all`` under-approximate
    (the attention stays exact; only sparsity is lost), but the rules shipped here are exact.
    """
    takes = "with_block_rule takes a mask function inner(b, h, q, kv) and a rule(a, b, c, d)"
    return _attach(inner, "block_rule", rule, name, takes)


def with_tile_rule(mask_mod: MaskMod, rule: TileRule, name: str | None = None) -> MaskMod:
    """Attach a tile rule to an *extra* mask_mod so ``make_block_mask`` builds it sync-free.

    An extra mask_mod sees global token indices ``(b, h, q, kv)`` and reads per-token
    attributes it closes over (a stream id, a chunk id, a per-episode window gathered to
    tokens); ``make_block_mask(..., mask_mod=m)`` ANDs it with the document mask.
    ``rule(q_block, kv_block) -> (any_RC, all_RC)`` answers, for every (q tile, kv tile): may
    any pair be true, and is every pair true (bool ``(R, C)``, from per-tile summaries of the
    attributes, never from the ``T x T`` pairs). ``any`` may over-approximate and ``all``
    under-approximate: the attention stays exact, only sparsity is lost.
    """
    takes = "with_tile_rule takes a mask_mod(b, h, q, kv) and a rule(q_block, kv_block)"
    return _attach(mask_mod, "tile_rule", rule, name, takes)


def _attach(fn: MaskMod, attr: str, rule: Any, name: str | None, takes: str) -> MaskMod:
    """``fn`` with ``rule`` as its ``attr`` (and ``name`` as its ``__name__``), checked."""
    if not callable(fn) or not callable(rule):
        raise TypeError(f"{takes}; got {type(fn).__name__} and {type(rule).__name__}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name={name!r} must be a str")
    setattr(fn, attr, rule)
    if name is not None:
        fn.__name__ = name
    return fn


def _band_rule(lo: int, hi: int | None) -> BlockRule:
    """Rule for ``lo <= q - kv <= hi`` (``hi=None``: no upper bound): over a rectangle of rows
    ``a..b`` and columns ``c..d``, ``q - kv`` takes every value in ``[a - d, b - c]``."""

    def rule(a: Tensor, b: Tensor, c: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
        if hi is None:  # integer compares only: a float bound would promote to float32
            return b - c >= lo, a - d >= lo
        return (b - c >= lo) & (a - d <= hi), (a - d >= lo) & (b - c <= hi)

    return rule


# Cached so that the same arguments give the same object: torch.compile guards on the mask
# function, and a fresh closure per step would look like a new function.
@functools.cache
def causal() -> InnerMask:
    """``q_local >= kv_local``: each token sees its episode's past and itself."""

    def causal_mask(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return q >= kv

    return with_block_rule(causal_mask, _band_rule(0, None), "causal")


def frame_causal(tokens_per_frame: int, kv_tokens_per_frame: int | None = None) -> InnerMask:
    """``q_local // F >= kv_local // F``: a token sees its whole frame and every earlier frame.

    ``kv_tokens_per_frame`` (default ``tokens_per_frame``) lets cross-attention relate streams
    of different frame sizes, e.g. 32 video tokens per frame querying 1 action per step.
    With ``tokens_per_frame=2`` on one episode of 6 tokens::

        # # . . . .
        # # . . . .
        # # # # . .
        # # # # . .
        # # # # # #
        # # # # # #
    """
    fq = _positive_int("tokens_per_frame", tokens_per_frame)
    fk = (
        fq
        if kv_tokens_per_frame is None
        else _positive_int("kv_tokens_per_frame", kv_tokens_per_frame)
    )
    return _frame_causal(fq, fk)


# Checked first, cached after: an unhashable argument gets our error, not functools'.
@functools.cache
def _frame_causal(fq: int, fk: int) -> InnerMask:
    def frame_causal_mask(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return q // fq >= kv // fk

    def rule(a: Tensor, b: Tensor, c: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
        # Floor division is monotone: the extreme frames sit at the rectangle's corners.
        return b // fq >= c // fk, a // fq >= d // fk

    name = f"frame_causal_{fq}" if fk == fq else f"frame_causal_{fq}x{fk}"
    return with_block_rule(frame_causal_mask, rule, name)


def sliding_window(window: int, *, causal: bool = False) -> InnerMask:
    """Token window inside the episode, counted in tokens of episode-local position.

    ``causal=False``: ``|q_local - kv_local| <= window``, the token itself plus ``window``
    tokens on each side (up to ``2 * window + 1`` keys). ``causal=True``:
    ``0 <= q_local - kv_local <= window``, itself plus the ``window`` previous tokens (the
    attention-gym sliding window). The window never crosses into another episode. ``window=1``
    on one episode of 5 tokens, bidirectional::

        # # . . .
        # # # . .
        . # # # .
        . . # # #
        . . . # #
    """
    return _sliding_window(_non_negative_int("window", window), check_bool("causal", causal))


@functools.cache
def _sliding_window(w: int, causal: bool) -> InnerMask:
    if causal:

        def causal_sliding_window_mask(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
            return (q >= kv) & (q - kv <= w)

        return with_block_rule(
            causal_sliding_window_mask, _band_rule(0, w), f"causal_sliding_window_{w}"
        )

    def sliding_window_mask(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (q - kv <= w) & (kv - q <= w)

    return with_block_rule(sliding_window_mask, _band_rule(-w, w), f"sliding_window_{w}")


# --------------------------------------------------------------------------- document mask


def document_mask_mod(
    doc_ids: Tensor,
    kv_doc_ids: Tensor | None = None,
    inner: InnerMask | None = None,
    mask_mod: MaskMod | None = None,
) -> MaskMod:
    """FlexAttention mask_mod: ``doc_id[q] == doc_id[kv]``, then ``inner`` in episode-local terms.

    ``inner(b, h, q_local, kv_local)`` sees ``q - start[doc[q]]`` and ``kv - start[doc[kv]]``
    (precomputed per token, so the closure is pure tensor indexing and traces under vmap and
    torch.compile). ``kv_doc_ids`` (length may differ) gives packed cross-attention: queries of
    one stream attend to the same episode's keys of another. Padding: see the module docstring;
    a pair past the ids (``q >= T_q`` or ``kv >= T_kv``, a ragged last tile's padding) is False.
    The closure is named e.g. ``document_causal`` or ``cross_document_frame_causal_32``.
    ``mask_mod`` (global indices, e.g. a rule on per-token attributes) is AND-ed on top:
    ``document_and_<its name>``.
    """
    q_doc, kv_doc, self_attention = _check_pair(doc_ids, kv_doc_ids)
    # The ids keep their own dtype: narrowing int64 to int32 would make ids 0 and 2**32 one
    # document. PackedCollator's ids are already int32 (half the bytes per gather).
    q_doc_T = q_doc
    kv_doc_T = q_doc_T if self_attention else kv_doc

    if inner is None:  # no positions needed: a document mask reads doc ids only

        def same_doc(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
            q, kv, inside = _in_range(q, kv, q_doc_T, kv_doc_T)
            return (q_doc_T[q] == kv_doc_T[kv]) & (q_doc_T[q] >= 0) & inside

    else:
        inner_fn = inner
        q_pos_T = local_positions(q_doc)
        kv_pos_T = q_pos_T if self_attention else local_positions(kv_doc)

        def same_doc(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
            q, kv, inside = _in_range(q, kv, q_doc_T, kv_doc_T)
            same = (q_doc_T[q] == kv_doc_T[kv]) & (q_doc_T[q] >= 0) & inside
            return same & inner_fn(b, h, q_pos_T[q], kv_pos_T[kv])

    prefix = "document" if self_attention else "cross_document"
    same_doc.__name__ = prefix if inner is None else f"{prefix}_{_name(inner)}"
    if mask_mod is None:
        return same_doc
    _check_mask_mod(mask_mod)
    extra = mask_mod

    def same_doc_and_extra(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        q, kv, _ = _in_range(q, kv, q_doc_T, kv_doc_T)
        return same_doc(b, h, q, kv) & extra(b, h, q, kv)

    same_doc_and_extra.__name__ = f"{same_doc.__name__}_and_{_name(extra)}"
    return same_doc_and_extra


def _in_range(
    q: Tensor, kv: Tensor, q_doc: Tensor, kv_doc: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(q, kv, inside)``: indices past the ids redirected to 0, and which pairs were inside.

    A tiled kernel may evaluate a mask_mod on the padding of a ragged last tile: flash-attn-4's
    (``flex_flash``) does, before it masks rows >= T_q and columns >= T_kv, and reads the ids
    there unchecked. Such a pair must read inside the id tensors and be False. ``where``,
    not ``clamp``: Inductor's CuTe mask codegen has no ``minimum``."""
    q_in, kv_in = q < q_doc.shape[0], kv < kv_doc.shape[0]
    return torch.where(q_in, q, 0), torch.where(kv_in, kv, 0), q_in & kv_in


def dense_mask(
    doc_ids: Tensor,
    kv_doc_ids: Tensor | None = None,
    inner: InnerMask | None = None,
    mask_mod: MaskMod | None = None,
) -> Tensor:
    """bool ``(T_q, T_kv)``: the mask ``document_mask_mod`` describes, by broadcasting it.

    The reference for tests and the mask an SDPA backend passes as ``attn_mask`` (True =
    attend). ``O(T_q x T_kv)`` memory: for checking and small packs, not for 64K tokens.
    """
    mask_mod = document_mask_mod(doc_ids, kv_doc_ids, inner, mask_mod)
    T_q = doc_ids.shape[0]
    T_kv = T_q if kv_doc_ids is None else kv_doc_ids.shape[0]
    dev = doc_ids.device
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    q = torch.arange(T_q, device=dev)[:, None]
    kv = torch.arange(T_kv, device=dev)[None, :]
    return mask_mod(zero, zero, q, kv).expand(T_q, T_kv).contiguous()


# --------------------------------------------------------------------------- block mask


def make_block_mask(
    doc_ids: Tensor,
    kv_doc_ids: Tensor | None = None,
    inner: InnerMask | None = None,
    block_size: int | tuple[int, int] = 128,
    *,
    mask_mod: MaskMod | None = None,
    inner_fallback: Literal["evaluate", "partial", "error"] = "evaluate",
    compile: bool | Literal["cuda_graph"] = False,
) -> BlockMask:
    """FlexAttention ``BlockMask`` for ``document_mask_mod(doc_ids, kv_doc_ids, inner, mask_mod)``.

    Built from the document boundaries on the tensors' device, never from the ``T x T`` pairs:
    ``O(T + R x C)`` tensor work (R q tiles, C kv tiles), no host-device sync, shapes fixed by
    ``(T_q, T_kv, block_size)`` alone, so a compiled model sees the same shapes every step.
    Tiles where every pair attends are *full* (Flex skips the mask_mod there), tiles without a
    true pair are not listed, the rest are *partial* (a tile spanning episodes is partial when
    any attends; the last ragged tile is never full, as with ``create_block_mask``).

    Three episodes ``[5, 2, 4]`` + 1 pad, ``block_size=4`` (``#`` full, ``+`` partial)::

        doc_ids  0 0 0 0 | 0 1 1 2 | 2 2 2 -1
        document             causal
          # + .                + . .
          + + +                + + .
          . + +                . + +

    ``inner`` with a ``block_rule`` (``causal``, ``frame_causal``, ``sliding_window``, or your
    own through :func:`with_block_rule`) is classified tile by tile without a sync.
    ``mask_mod`` is an *extra* rule on global indices (per-token attributes, per-episode
    parameters gathered to tokens), AND-ed with the document mask; with a ``tile_rule``
    (:func:`with_tile_rule`) its tiles come from per-tile summaries, sync-free, and are
    AND-ed with the document's (eager: ``compile`` applies to the document part alone).
    An inner mask or extra mask_mod *without* a rule is handled as ``inner_fallback`` says:

    ``"evaluate"`` (default) evaluates the full mask_mod on the pairs of the *candidate* tiles
    (those the documents allow): exact tiles, one host-device sync; ``"partial"`` lists every
    candidate tile as partial (no sync, no full tiles); ``"error"`` raises (sync-free paths).

    ``block_size`` is an int or ``(q_block, kv_block)``. ``compile=True`` runs the tile
    classification through ``torch.compile`` (static shapes, one graph per ``(T_q, T_kv,
    block_size, inner)``, so reuse the same (cached) inner object); eager it is ~140 small
    kernels, launch overhead on a GPU. ``compile="cuda_graph"`` (CUDA only) replays that graph
    as a CUDA graph per shape: three launches a call, the tables the caller's own; each shape
    keeps its graph and pool (tens of MB at 64K tokens) until ``BLOCK_MASK_GRAPHS.reset()``.
    """
    q_doc, kv_doc, self_attention = _check_pair(doc_ids, kv_doc_ids)
    bq, bkv = _block_sizes(block_size)
    _check_build_options(inner_fallback, compile)
    full_mod = document_mask_mod(doc_ids, kv_doc_ids, inner, mask_mod)
    rule: BlockRule | None = document_rule if inner is None else getattr(inner, "block_rule", None)
    tile_rule: TileRule | None = getattr(mask_mod, "tile_rule", None)
    unruled = inner if rule is None else mask_mod if tile_rule is None else None
    if unruled is not None:
        what = "block_rule" if unruled is inner else "tile_rule"
        _check_fallback(unruled, what, inner_fallback, compile)
    if unruled is not None or mask_mod is not None:
        rules = (rule, tile_rule, unruled is None)
        tables = _flag_tables(q_doc, kv_doc, rules, full_mod, (bq, bkv), inner_fallback)
    elif not compile and _num_tiles(q_doc, kv_doc, bq, bkv) > _CHUNK_TILES:
        tables = _chunked_block_tables(q_doc, kv_doc, rule, bq, bkv, self_attention)  # type: ignore[arg-type]
    else:
        build: Callable[..., BlockTables] = (
            BLOCK_MASK_GRAPHS
            if compile == "cuda_graph"
            else _compiled_block_tables()
            if compile
            else block_tables
        )
        tables = build(q_doc, kv_doc, rule, bq, bkv, self_attention)
    # The constructor, not from_kv_blocks: the q-side tables are already built (from the
    # transposed tile flags), which saves a scatter and two vmaps per call.
    return BlockMask(
        seq_lengths=(q_doc.shape[0], kv_doc.shape[0]),
        **tables._asdict(),
        BLOCK_SIZE=(bq, bkv),
        mask_mod=full_mod,
    )


def _check_build_options(inner_fallback: str, compile: Any) -> None:
    if inner_fallback not in ("evaluate", "partial", "error"):
        raise ValueError(f"inner_fallback={inner_fallback!r}; use 'evaluate', 'partial' or 'error'")
    if not (isinstance(compile, bool) or (isinstance(compile, str) and compile == "cuda_graph")):
        raise ValueError(f"compile={compile!r}; use False, True or 'cuda_graph'")


def _check_fallback(
    unruled: Callable[..., Any], what: str, inner_fallback: str, compile: Any
) -> None:
    """Refuse what a mask without a rule (``what``) cannot do sync-free, naming the fix."""
    if inner_fallback == "error":
        raise ValueError(
            f"mask {_name(unruled)!r} has no {what} and inner_fallback='error'; "
            "attach one with packing.attention.with_block_rule (inner) or with_tile_rule "
            "(mask_mod), or pass inner_fallback='evaluate' (one sync) or 'partial' (no full tiles)"
        )
    if compile == "cuda_graph":
        raise ValueError(
            f"compile='cuda_graph' needs an inner mask with a block_rule (a mask_mod with a "
            f"tile_rule); {_name(unruled)!r} has none (attach one with packing.attention."
            "with_block_rule / with_tile_rule, or use compile=True)"
        )


def _flag_tables(
    q_doc: Tensor,
    kv_doc: Tensor,
    rules: tuple[BlockRule | None, TileRule | None, bool],
    full_mod: MaskMod,
    blocks: tuple[int, int],
    inner_fallback: str,
) -> BlockTables:
    """Eager tile flags: the document (and inner) classification AND the extra mask's tile
    rule; a mask without a rule is unknown inside the candidate tiles, then evaluated there
    (``"evaluate"``, the one sync) or left partial (``"partial"``)."""
    (rule, tile_rule, exact), (bq, bkv) = rules, blocks
    q_side = doc_side(q_doc, bq)
    kv_side = q_side if kv_doc is q_doc and bq == bkv else doc_side(kv_doc, bkv)
    any_RC, all_RC = classify_blocks(q_side, kv_side, rule or unknown_rule)
    if tile_rule is not None:
        t_any, t_all = tile_rule(bq, bkv)
        any_RC, all_RC = any_RC & t_any, all_RC & t_all
    if not exact:
        all_RC = torch.zeros_like(all_RC)
        if inner_fallback == "evaluate":
            T_q, T_kv = q_doc.shape[0], kv_doc.shape[0]
            any_RC, all_RC = evaluate_tiles(full_mod, any_RC, T_q, T_kv, bq, bkv)
    return tables_from_flags(any_RC, all_RC)


# Tiles classified per chunk on the eager path. Unchunked, the classification holds about a
# dozen int64 (R, C) intermediates at once: 13.8 GB of host memory at 1M tokens (8,192 x 8,192
# tiles), 13x the tables themselves (1.07 GB); a chunk of 1M tiles needs ~200 MB.
_CHUNK_TILES = 1 << 20


def _num_tiles(q_doc: Tensor, kv_doc: Tensor, bq: int, bkv: int) -> int:
    return ceil_div(q_doc.shape[0], bq) * ceil_div(kv_doc.shape[0], bkv)


def _chunked_block_tables(
    q_doc_T: Tensor,
    kv_doc_T: Tensor,
    rule: BlockRule,
    bq: int,
    bkv: int,
    self_attention: bool,
) -> BlockTables:
    """`block_tables` in row chunks of ``_CHUNK_TILES`` tiles: the same tables, built with
    peak memory a small multiple of the tables' own (the tile flags are 2 bytes a tile, the
    tables 16). Rows of q tiles are classified chunk by chunk, then each side's tables are
    ordered chunk by chunk (kv side over q-tile rows, q side over kv-tile rows)."""
    q = doc_side(q_doc_T, bq)
    kv = q if self_attention and bq == bkv else doc_side(kv_doc_T, bkv)
    R, C = q.first_B.shape[0], kv.first_B.shape[0]
    any_RC = torch.empty((R, C), dtype=torch.bool, device=q_doc_T.device)
    all_RC = torch.empty_like(any_RC)
    rows = max(1, _CHUNK_TILES // max(C, 1))
    for lo in range(0, R, rows):
        part = dataclasses.replace(
            q,
            first_B=q.first_B[lo : lo + rows],
            last_B=q.last_B[lo : lo + rows],
            all_real_B=q.all_real_B[lo : lo + rows],
            start_B=q.start_B[lo : lo + rows],
            stop_B=q.stop_B[lo : lo + rows],
        )
        any_RC[lo : lo + rows], all_RC[lo : lo + rows] = classify_blocks(part, kv, rule)
    kv_num, kv_idx, full_kv_num, full_kv_idx = _side_tables(any_RC, all_RC)
    q_num, q_idx, full_q_num, full_q_idx = _side_tables(
        any_RC.t().contiguous(), all_RC.t().contiguous()
    )
    return BlockTables(
        kv_num, kv_idx, full_kv_num, full_kv_idx, q_num, q_idx, full_q_num, full_q_idx
    )


def _side_tables(any_RC: Tensor, all_RC: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The row side's (num, indices, full num, full indices), ``tables_from_flags`` applied
    to chunks of rows (its column side, for a chunk, is not needed and is dropped)."""
    R, C = any_RC.shape
    num = torch.empty((1, 1, R), dtype=torch.int32, device=any_RC.device)
    idx = torch.empty((1, 1, R, C), dtype=torch.int32, device=any_RC.device)
    full_num, full_idx = torch.empty_like(num), torch.empty_like(idx)
    rows = max(1, _CHUNK_TILES // max(C, 1))
    for lo in range(0, R, rows):
        t = tables_from_flags(any_RC[lo : lo + rows], all_RC[lo : lo + rows])
        num[..., lo : lo + rows], idx[..., lo : lo + rows, :] = t.kv_num_blocks, t.kv_indices
        full_num[..., lo : lo + rows] = t.full_kv_num_blocks
        full_idx[..., lo : lo + rows, :] = t.full_kv_indices
    return num, idx, full_num, full_idx


@functools.cache
def _compiled_block_tables() -> Callable[..., BlockTables]:
    # Static shapes (dynamic=False): one graph per (T_q, T_kv, block, inner), reused for every
    # document layout. fullgraph=True: a graph break would mean a sync crept in.
    check_torch_version()
    return torch.compile(block_tables, dynamic=False, fullgraph=True)


# --------------------------------------------------------------------------- validation


def validate_doc_ids(doc_ids: Tensor, name: str = "doc_ids") -> None:
    """Raise if ``doc_ids`` is not int (T,) of contiguous runs in increasing id order.

    Reads the values, so on an accelerator it syncs; the mask builders call it for CPU tensors.
    """
    _check_tensor(doc_ids, name)
    check_doc_runs(doc_ids, name)


def _check_tensor(t: Tensor, name: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of document ids, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(
            f"{name} must be an integer tensor (int32 or int64) of document ids, got {t.dtype}; "
            "use batch['doc_ids'] from PackedCollator"
        )
    if t.ndim != 1:
        raise ValueError(
            f"{name} must be 1-D (T,), one packed sequence, got shape {tuple(t.shape)}; "
            "build one mask per pack"
        )
    if t.shape[0] == 0:
        raise ValueError(f"{name} is empty; a pack needs at least one token")


def _check_pair(doc_ids: Tensor, kv_doc_ids: Tensor | None) -> tuple[Tensor, Tensor, bool]:
    _check_tensor(doc_ids, "doc_ids")
    if kv_doc_ids is None:
        if doc_ids.device.type == "cpu":
            check_doc_runs(doc_ids, "doc_ids")
        return doc_ids, doc_ids, True
    _check_tensor(kv_doc_ids, "kv_doc_ids")
    if kv_doc_ids.device != doc_ids.device:
        raise ValueError(
            f"doc_ids is on {doc_ids.device} but kv_doc_ids on {kv_doc_ids.device}; "
            "move both to the attention's device"
        )
    if doc_ids.device.type == "cpu":
        check_doc_runs(doc_ids, "doc_ids")
        check_doc_runs(kv_doc_ids, "kv_doc_ids")
    return doc_ids, kv_doc_ids, False


def _block_sizes(block_size: int | tuple[int, int]) -> tuple[int, int]:
    sizes: Any = (block_size, block_size) if is_int(block_size) else block_size
    ok = isinstance(sizes, tuple | list) and len(sizes) == 2
    if not ok or not all(is_int(s) and s > 0 for s in sizes):
        raise ValueError(
            f"block_size={block_size!r}; use a positive int or a (q_block, kv_block) pair of "
            "positive ints (FlexAttention kernels want multiples of 16, default 128)"
        )
    return check_int("block_size", sizes[0]), check_int("block_size", sizes[1])


# ValueError for a wrong type too (not TypeError): these messages are pinned by tests and docs.
def _positive_int(name: str, v: int) -> int:
    if not is_int(v) or v <= 0:
        raise ValueError(f"{name}={v!r}; use a positive int (tokens)")
    return check_int(name, v)


def _non_negative_int(name: str, v: int) -> int:
    if not is_int(v) or v < 0:
        raise ValueError(f"{name}={v!r}; use an int >= 0 (tokens on each side)")
    return check_int(name, v)


def _check_mask_mod(mask_mod: Any) -> None:
    if not callable(mask_mod):
        raise TypeError(
            f"mask_mod must be a FlexAttention mask_mod(b, h, q, kv) -> bool tensor, got "
            f"{type(mask_mod).__name__}"
        )


def _name(inner: Any) -> str:
    return getattr(inner, "__name__", type(inner).__name__)
