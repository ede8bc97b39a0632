"""Block classification from document boundaries: which (q block, kv block) tiles may attend.

The engine behind `packing.attention._masks.make_block_mask`; nothing here is public API (`BlockRule`,
the type of a rule passed to `packing.attention._masks.with_block_rule`, is exported from
`packing.attention._masks`).

FlexAttention cuts the ``(T_q, T_kv)`` mask into tiles of ``q_block x kv_block`` tokens and
wants to know, for every tile, whether it is *empty* (skip it), *full* (every pair attends: skip
the mask_mod) or *partial* (evaluate the mask_mod pair by pair). ``torch``'s
``create_block_mask`` finds out by evaluating the mask_mod on all ``T_q x T_kv`` pairs. Here the
answer comes from the document boundaries alone, in ``O(T + R x C)`` tensor work (R q tiles, C
kv tiles) with no host-device sync:

* documents are contiguous runs in increasing id order, so a q tile and a kv tile share at most
  two *boundary* documents (the largest of their first ids, ``lo``, and the smallest of their
  last ids, ``hi``) plus documents strictly between ``lo`` and ``hi``, which lie *whole* inside
  both tiles; whether any of those has a true pair is a prefix-sum lookup;
* a boundary document is clipped to the tile and handed, in episode-local coordinates, to the
  inner mask's ``block_rule(a, b, c, d) -> (any, all)`` (q rows ``a..b``, kv columns ``c..d``).

Three episodes of lengths ``[5, 2, 4]`` + 1 pad, self-attention, tiles of 4 (``#`` full,
``+`` partial, ``.`` empty; the last kv tile is partial because it holds episode 2 and the pad)::

    doc_ids  0 0 0 0 | 0 1 1 2 | 2 2 2 -1        kv tile 0  1  2
                                            q tile 0     #  +  .
                                                   1     +  +  +
                                                   2     .  +  +

Legend (``docs/index.md`` has the package's whole table)::

    T_q, T_kv  tokens on the query / key side       K   documents (doc ids 0..K-1, -1 padding)
    R, C       q tiles (rows), kv tiles (columns)    B   tiles of one side (R or C)
    _T per token, _B per tile of one side, _RC per (q tile, kv tile) pair
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from packing._layout_math import ceil_div

__all__ = [
    "BlockRule",
    "BlockTables",
    "DocSide",
    "block_tables",
    "classify_blocks",
    "doc_side",
    "document_rule",
    "evaluate_tiles",
    "tables_from_flags",
    "unknown_rule",
]

# (a, b, c, d) -> (may any pair be true, are all pairs true), for q rows a..b and kv columns
# c..d (inclusive, episode-local, one episode). Elementwise over broadcast int64 tensors.
BlockRule = Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]

# Larger than any document id; stands for "no real token here".
_NO_DOC = torch.iinfo(torch.int64).max


@dataclass(frozen=True)
class DocSide:
    """One side (queries or keys) of the attention, described per token and per tile."""

    doc_T: Tensor  # int64 (T,), -1 on padding
    block: int
    first_B: Tensor  # int64 (B,), smallest document id in the tile, _NO_DOC if none
    last_B: Tensor  # int64 (B,), largest document id in the tile, -1 if none
    all_real_B: Tensor  # bool (B,), every slot of the block-wide tile holds a real token
    start_B: Tensor  # int64 (B,), first token of the tile
    stop_B: Tensor  # int64 (B,), one past the last token of the tile (clipped to T)


def doc_side(doc_ids_T: Tensor, block: int) -> DocSide:
    """Describe one side of the attention; ``doc_ids_T`` is int (T,) with -1 on padding."""
    doc_T = doc_ids_T.to(torch.int64)
    T = doc_T.shape[0]
    n = ceil_div(T, block)
    # Pad to whole tiles with -1: slots past T are never real, so the last ragged tile is never
    # full (the same convention as create_block_mask, which pads its dense mask with False).
    tiles = torch.nn.functional.pad(doc_T, (0, n * block - T), value=-1).view(n, block)
    real = tiles >= 0
    start_B = torch.arange(n, device=doc_T.device, dtype=torch.int64) * block
    return DocSide(
        doc_T=doc_T,
        block=block,
        first_B=torch.where(real, tiles, _NO_DOC).amin(1),
        last_B=tiles.amax(1),
        all_real_B=real.all(1),
        start_B=start_B,
        stop_B=(start_B + block).clamp_max(T),
    )


class _Spans:
    """Where any document starts and stops on one side, found with ``searchsorted``.

    The document ids with padding filled from the left (``ffill``) and from the right
    (``bfill``) are both sorted, so no sync is needed. Only inner masks need spans.
    """

    def __init__(self, doc_T: Tensor) -> None:
        real_T = doc_T >= 0
        self.ffill_T = torch.where(real_T, doc_T, -1).cummax(0).values
        no_doc = torch.full_like(doc_T, _NO_DOC)
        self.bfill_T = torch.where(real_T, doc_T, no_doc).flip(0).cummin(0).values.flip(0)

    def __call__(self, doc: Tensor) -> tuple[Tensor, Tensor]:
        """``[start, stop)`` of each document in ``doc``; ``stop <= start`` when absent."""
        start = torch.searchsorted(self.ffill_T, doc, side="left")
        stop = torch.searchsorted(self.bfill_T, doc, side="right")
        return start, stop


def document_rule(a: Tensor, b: Tensor, c: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
    """The document mask alone: inside one document every pair attends."""
    true = torch.ones_like(a, dtype=torch.bool)
    return true, true


def classify_blocks(q: DocSide, kv: DocSide, rule: BlockRule) -> tuple[Tensor, Tensor]:
    """``(any_RC, all_RC)`` bool: does the tile hold a true pair / are all its pairs true.

    With an exact ``rule`` the tiles are exact (the same as ``create_block_mask``'s); a looser
    ``any`` only lists tiles that turn out empty and a stricter ``all`` only leaves full tiles
    partial, so the attention stays exact either way. Padding attends to nothing, so a tile
    of padding alone is never listed.
    """
    q_first, q_last = q.first_B[:, None], q.last_B[:, None]
    k_first, k_last = kv.first_B[None, :], kv.last_B[None, :]
    lo = torch.maximum(q_first, k_first)  # the shared documents are ids lo..hi (if lo <= hi)
    hi = torch.minimum(q_last, k_last)
    shared = lo <= hi
    one_doc_q = q.all_real_B & (q.first_B == q.last_B)
    one_doc_k = kv.all_real_B & (kv.first_B == kv.last_B)
    same_one_doc = one_doc_q[:, None] & one_doc_k[None, :] & (q_first == k_first)
    if rule is document_rule:
        # Each tile holds every document between its first and last id, so lo (when <= hi)
        # lies in both tiles: sharing a document is the whole test. No spans needed.
        return shared, same_one_doc

    # Both boundary documents at once (leading dim 2: lo, hi), clipped to the tile and shifted
    # to episode-local coordinates.
    q_span = _Spans(q.doc_T)
    kv_span = q_span if kv.doc_T is q.doc_T else _Spans(kv.doc_T)
    d = torch.stack([lo, hi])
    qs, qe = q_span(d)
    ks, ke = kv_span(d)
    a = torch.maximum(qs, q.start_B[:, None]) - qs
    b = torch.minimum(qe, q.stop_B[:, None]) - 1 - qs
    c = torch.maximum(ks, kv.start_B[None, :]) - ks
    e = torch.minimum(ke, kv.stop_B[None, :]) - 1 - ks
    r_any, r_all = rule(a, b, c, e)
    hit = (a <= b) & (c <= e) & r_any
    any_RC = shared & (hit[0] | hit[1])

    # Documents strictly between lo and hi lie whole in both tiles: count those with a true
    # pair through a prefix sum over their first q tokens.
    qe_lo, qs_hi = qe[0], qs[1]
    count_T1 = _prefix(_first_token_nonempty(q.doc_T, q_span, kv_span, rule))
    inner_any = (lo < hi) & (count_T1[qs_hi] > count_T1[torch.minimum(qe_lo, qs_hi)])
    any_RC = any_RC | inner_any
    return any_RC, same_one_doc & r_all[0] & any_RC


def _first_token_nonempty(
    doc_T: Tensor, q_span: _Spans, kv_span: _Spans, rule: BlockRule
) -> Tensor:
    """int64 (T_q,): 1 on the first q token of each document that has a true pair at all."""
    T = doc_T.shape[0]
    qs, qe = q_span(doc_T)
    ks, ke = kv_span(doc_T)
    first = (doc_T >= 0) & (qs == torch.arange(T, device=qs.device))
    zero = torch.zeros_like(qs)
    r_any, _ = rule(zero, qe - qs - 1, zero, ke - ks - 1)
    return (first & (ke > ks) & r_any).to(torch.int64)


def _prefix(x_T: Tensor) -> Tensor:
    """(T+1,) exclusive prefix sum: ``out[j] - out[i]`` sums ``x[i:j]``."""
    return torch.nn.functional.pad(x_T.cumsum(0), (1, 0))


class BlockTables(NamedTuple):
    """The eight tensors of a FlexAttention ``BlockMask`` (batch and head dims of size 1).

    ``kv_num_blocks[0, 0, i]`` partial kv tiles of q tile ``i``, listed first (ascending) in
    ``kv_indices[0, 0, i]``; the ``full_`` pair lists the full tiles; the ``q_`` pairs are the
    same tiles seen from the kv side (the backward pass walks them).
    """

    kv_num_blocks: Tensor
    kv_indices: Tensor
    full_kv_num_blocks: Tensor
    full_kv_indices: Tensor
    q_num_blocks: Tensor
    q_indices: Tensor
    full_q_num_blocks: Tensor
    full_q_indices: Tensor


def block_tables(
    q_doc_T: Tensor,
    kv_doc_T: Tensor,
    rule: BlockRule,
    q_block: int,
    kv_block: int,
    self_attention: bool,
) -> BlockTables:
    """Doc ids -> BlockMask tensors. Pure tensor code with static shapes: safe to compile."""
    q = doc_side(q_doc_T, q_block)
    kv = q if self_attention and q_block == kv_block else doc_side(kv_doc_T, kv_block)
    any_RC, all_RC = classify_blocks(q, kv, rule)
    return tables_from_flags(any_RC, all_RC)


def tables_from_flags(any_RC: Tensor, all_RC: Tensor) -> BlockTables:
    """Tile flags -> the eight BlockMask tensors (partial = any and not all)."""
    flags = torch.stack([any_RC & ~all_RC, all_RC])  # (2, R, C): partial, full
    kv_num, kv_idx = _ordered(flags)
    # Contiguous, not a transposed view: Flex's backward kernel indexes q_indices as if
    # contiguous (its template says so); a view would walk the wrong tiles and give right
    # outputs with wrong gradients.
    q_num, q_idx = _ordered(flags.transpose(1, 2).contiguous())
    per_side = (kv_num[0], kv_idx[0], kv_num[1], kv_idx[1], q_num[0], q_idx[0], q_num[1], q_idx[1])
    return BlockTables(*(t[None, None].contiguous() for t in per_side))


def _ordered(flags_RC: Tensor) -> tuple[Tensor, Tensor]:
    """(num (..., R), indices (..., R, C)) int32: row ``r`` lists its flagged columns first,
    ascending, then the others (a stable descending argsort; a scan + scatter formulation
    did not lower through Inductor on CUDA at 512 x 512 tiles)."""
    flags = flags_RC.to(torch.int32)
    num = flags.sum(-1, dtype=torch.int32)
    idx = torch.argsort(flags, dim=-1, descending=True, stable=True).to(torch.int32)
    return num, idx


def evaluate_tiles(
    mask_mod: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor],
    candidate_RC: Tensor,
    T_q: int,
    T_kv: int,
    bq: int,
    bkv: int,
) -> tuple[Tensor, Tensor]:
    """Evaluate ``mask_mod`` on every pair of the candidate tiles (this is the sync)."""
    dev = candidate_RC.device
    tiles = candidate_RC.nonzero()  # host-device sync: the number of candidates
    any_RC = torch.zeros_like(candidate_RC)
    all_RC = torch.zeros_like(candidate_RC)
    rq = torch.arange(bq, device=dev)
    rk = torch.arange(bkv, device=dev)
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    chunk = max(1, (1 << 22) // (bq * bkv))  # ~4M pairs per step bounds the memory
    for s in range(0, tiles.shape[0], chunk):
        i, j = tiles[s : s + chunk].unbind(1)
        q = (i[:, None] * bq + rq)[:, :, None]  # (n, bq, 1)
        kv = (j[:, None] * bkv + rk)[:, None, :]  # (n, 1, bkv)
        inside = (q < T_q) & (kv < T_kv)
        pairs = mask_mod(zero, zero, q.clamp_max(T_q - 1), kv.clamp_max(T_kv - 1)) & inside
        any_RC[i, j] = pairs.flatten(1).any(1)
        all_RC[i, j] = pairs.flatten(1).all(1)  # slots past T count as False: never full
    return any_RC, all_RC


def unknown_rule(a: Tensor, b: Tensor, c: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
    """No knowledge of the inner mask: any pair may be true, none is known to be."""
    return torch.ones_like(a, dtype=torch.bool), torch.zeros_like(a, dtype=torch.bool)
