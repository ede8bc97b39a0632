"""The context cache's device side: the K/V pool, its masks, the prefill and the cached step.

The pool holds, for every block, the keys and values of ``N = pages * page_frames *
tokens_per_frame`` context tokens, then a tail of scratch rows where a pass writes its own
tokens' keys and values. A step's queries are the pack's generated tokens only; its keys are
the pool ++ those tokens, and the mask is the document + frame-causal rule in each request's
own positions (``pos``: the token's place in its whole document, context first)::

    keys   page 0   page 1   page 2   page 3 | tail: the step's generated tokens
    doc     a a a    b b b    a a .    - - -  | a a a a   b b b
    q a     # # #    . . .    # # .    . . .  | frame-causal over a's own tokens
    q b     . . .    # # #    . . .    . . .  | . . . .   frame-causal

Every context frame comes before a request's generated frames and actions, so a generated
token sees all of its request's cached frames; a context token (prefill) sees its request's
frames up to its own, written into the pool at every layer just before that layer's
attention. The page tables (which request and which of its frames a page holds) are small
tensors copied in at admission; each pool key's document and position are computed from them
on the device inside the step, so a captured graph replays for any composition, with no host
sync. On CPU the mask is dense for SDPA; on CUDA the same rule is a FlexAttention block mask
whose tiles are classified from the dense mask (``Jq x (N + Jq)`` booleans, static shapes).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from packing.attention import AttentionMask, InnerMask
from packing.attention._block_tables import tables_from_flags
from packing.model import DiT, KVCache, PackInputs
from packing.serve._cache import ContextCache
from packing.serve._device import pinned
from packing.serve._step import FLEX_KERNEL_OPTIONS, Buffers, cross_mask, schedule, velocity_update

__all__ = ["DevicePool", "PrefillBlock", "cached_step", "pool_mask", "prefill_step"]

_TILE = 128  # FlexAttention's block


class PrefillBlock:
    """The static buffers of one prefill pass of ``Q`` context tokens: their patches, request
    (pack document; -1 padding), position in it, RoPE (t, h, w), pool row (padding: a tail
    row, never read) and conditioning row (0: the t = 0 row; -1 padding)."""

    def __init__(self, Q: int, features: int, first_tail_row: int, device: torch.device) -> None:
        i64: dict[str, Any] = dict(dtype=torch.int64, device=device)
        self.x = torch.zeros(Q, features, dtype=torch.float32, device=device)
        self.doc, self.row = torch.full((Q,), -1, **i64), torch.full((Q,), -1, **i64)
        self.pos, self.thw = torch.zeros(Q, **i64), torch.zeros(Q, 3, **i64)
        self.rows = first_tail_row + torch.arange(Q, **i64)
        self.index = torch.arange(Q, **i64)

    def state(self) -> tuple[Tensor, ...]:
        return ()  # a prefill only writes pool rows, the same values on every replay

    def load(self, x: Tensor, doc: Tensor, pos: Tensor, thw: Tensor, rows: Tensor) -> None:
        row = torch.where(doc >= 0, 0, -1)
        for dst, src in ((self.x, x), (self.doc, doc), (self.pos, pos), (self.thw, thw),
                         (self.rows, rows), (self.row, row)):  # fmt: skip
            dst.copy_(src, non_blocking=True)


class DevicePool:
    """The static device tensors of the cache: the pool ``(depth, (P + 1) * page_tokens +
    tail, H, D)`` of keys and of values (zeros, so a masked key never holds a NaN; page ``P``
    is never handed out and stays zero: a window's unused slots point at it), the window's
    page tables and one `PrefillBlock` per prefill size.

    A pack attends over a **window**: the pages of its own requests, gathered in order into
    ``W`` static slots (``W``: the shape's `ContextCache.window_pages`), so a step's keys,
    mask and attention grow with the pages the pack uses, not with the pool::

        pool pages   0    1    2    3    4    5   ...  255  | zero page | tail
        window       a:0  b:0  a:1  zero zero                   (W = 5: requests a, b)
    """

    def __init__(self, model: DiT, cache: ContextCache, tail: int, device: torch.device) -> None:
        cfg = model.config
        tpf, P = cfg.tokens_per_frame, cache.pages
        self.tpf, self.page_tokens, self.zero_page = tpf, cache.page_frames * tpf, P
        self.N = (P + 1) * self.page_tokens  # the pool's rows, its zero page included
        dtype = next(model.parameters()).dtype
        size = (cfg.depth, self.N + tail, cfg.heads, cfg.head_dim)
        self.k = torch.zeros(size, dtype=dtype, device=device)
        self.v = torch.zeros(size, dtype=dtype, device=device)
        i64: dict[str, Any] = dict(dtype=torch.int64, device=device)
        W = P  # slots: every shape's window is at most the pool
        self.page_W = torch.full((W,), P, **i64)  # the pool page in each window slot
        self.doc_W = torch.full((W,), -1, **i64)  # the request (pack doc) holding it
        self.frame_W = torch.zeros(W, **i64)  # its first frame's index in that context
        self.fill_W = torch.zeros(W, **i64)  # frames of the page in use
        slot = torch.arange(self.page_tokens, **i64)
        self.slot_frame, self.slot_token = slot // tpf, slot % tpf
        self.tail_rows = self.N + torch.arange(tail, **i64)
        self.prefill = {
            n: PrefillBlock(n * tpf, cfg.patch_features, self.N, device) for n in cache.pass_sizes
        }
        self.no_actions = (torch.zeros(0, cfg.action_dim, dtype=dtype, device=device),
                           torch.zeros(0, **i64))  # fmt: skip

    @property
    def window_slots(self) -> int:
        return self.page_W.shape[0]

    def load_window(self, pages: list[tuple[int, int, int, int]]) -> None:
        """The window's slots in order: ``(pool page, request, first frame, frames used)``
        each; the slots after them point at the zero page, used by no request."""
        W = self.window_slots
        if len(pages) > W:
            raise AssertionError(f"{len(pages)} pages in a window of {W}")
        cols = [torch.tensor(c, dtype=torch.int64) for c in zip(*pages, strict=True)] or [
            torch.zeros(0, dtype=torch.int64)
        ] * 4
        pads = (self.zero_page, -1, 0, 0)
        for dst, col, pad in zip((self.page_W, self.doc_W, self.frame_W, self.fill_W), cols,
                                 pads, strict=True):  # fmt: skip
            full = torch.full((W,), pad, dtype=torch.int64)
            full[: col.shape[0]] = col
            dst.copy_(pinned(full, dst.device), non_blocking=True)

    def clear(self, pages: list[int]) -> None:
        """Zero ``pages`` in every layer (freed pages: see `PagePool.take_released`)."""
        if not pages:
            return
        rows = torch.tensor(pages, dtype=torch.int64)[:, None] * self.page_tokens
        rows = (rows + torch.arange(self.page_tokens)).flatten()
        rows = pinned(rows, self.k.device).to(self.k.device, non_blocking=True)
        self.k.index_fill_(1, rows, 0)
        self.v.index_fill_(1, rows, 0)

    def keys(self, W: int | None = None) -> tuple[Tensor, Tensor]:
        """Document and position of the first ``W`` window slots' keys ``(W * page_tokens,)``
        (all slots by default), from the window's tables (device work, no sync): slot w's
        token s is frame ``frame_W[w] + s // tpf`` of request ``doc_W[w]``, in use while that
        frame is below ``fill_W[w]``; -1 elsewhere."""
        W = self.window_slots if W is None else W
        used = self.slot_frame[None, :] < self.fill_W[:W, None]
        doc = torch.where(used, self.doc_W[:W, None], -1).flatten()
        frame = self.frame_W[:W, None] + self.slot_frame[None, :]
        return doc, (frame * self.tpf + self.slot_token[None, :]).flatten()

    def rows(self, W: int) -> Tensor:
        """The pool rows of the first ``W`` window slots, ``(W * page_tokens,)``."""
        slot = torch.arange(self.page_tokens, device=self.page_W.device)
        return (self.page_W[:W, None] * self.page_tokens + slot[None, :]).flatten()

    def layers(self, write: Tensor, read: Tensor) -> list[KVCache]:
        """One `KVCache` a block: write these tokens at rows ``write``, attend over ``read``."""
        return [KVCache(self.k[i], self.v[i], write, read) for i in range(self.k.shape[0])]


def pool_mask(
    q_doc: Tensor,
    q_pos: Tensor,
    kv_doc: Tensor,
    kv_pos: Tensor,
    *,
    backend: str,
    inner: InnerMask,
    document_mask: bool,
) -> AttentionMask:
    """Self-attention of queries ``(q_doc, q_pos)`` over keys ``(kv_doc, kv_pos)``: same
    document (>= 0) and ``inner`` on the positions, the uncached rule written for keys that
    are not one contiguous run per document. ``document_mask=False``: the broken control."""
    if not document_mask:
        q_doc, kv_doc = torch.where(q_doc >= 0, 0, -1), torch.where(kv_doc >= 0, 0, -1)

    def pool_document(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        # A tiled kernel may call this on the padding of a ragged last tile: flash-attn-4's
        # (flex_flash) evaluates it before masking rows >= Tq and columns >= Tk. Redirected
        # to index 0, such a pair reads inside the four id tensors and is False; as it was, it
        # read past their ends (the pool's keys and the pack's queries are rarely a multiple
        # of the tile). `where`, not `clamp`: the CuTe mask codegen has no minimum.
        q_in, kv_in = q < q_doc.shape[0], kv < kv_doc.shape[0]
        q, kv = torch.where(q_in, q, 0), torch.where(kv_in, kv, 0)
        same = (q_doc[q] == kv_doc[kv]) & (q_doc[q] >= 0) & q_in & kv_in
        return same & inner(b, h, q_pos[q], kv_pos[kv])

    pool_document.__name__ = f"pool_document_{getattr(inner, '__name__', 'inner')}"
    Tq, Tk = q_doc.shape[0], kv_doc.shape[0]
    dev = q_doc.device
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    q_i, kv_i = torch.arange(Tq, device=dev)[:, None], torch.arange(Tk, device=dev)[None, :]
    dense = pool_document(zero, zero, q_i, kv_i)
    common: dict[str, Any] = dict(
        backend=backend, kernel=backend, reason="packing.serve cached step", q_len=Tq,
        kv_len=Tk, inner=inner, cross=False,
    )  # fmt: skip
    if backend == "sdpa":
        has_key = dense.any(dim=1)  # a pad query: no key (NaN in SDPA), opened, then read 0
        return AttentionMask(**common, dense_TT=dense | ~has_key[:, None], keep_T=has_key)
    R, C = -(-Tq // _TILE), -(-Tk // _TILE)
    tiles = F.pad(dense, (0, C * _TILE - Tk, 0, R * _TILE - Tq)).view(R, _TILE, C, _TILE)
    tables = tables_from_flags(tiles.any(3).any(1), tiles.all(3).all(1))
    block_mask = BlockMask(
        seq_lengths=(Tq, Tk), **tables._asdict(), BLOCK_SIZE=(_TILE, _TILE),
        mask_mod=pool_document,
    )  # fmt: skip
    return AttentionMask(
        **common, block_mask=block_mask, kernel_options=FLEX_KERNEL_OPTIONS[backend]
    )


def cached_step(
    model: DiT, b: Buffers, pool: DevicePool, W: int, *, backend: str, inner: InnerMask,
    document_mask: bool,
) -> None:  # fmt: skip
    """One denoising step of the pack's generated tokens over its window of ``W`` pages, in
    place on ``b``: each block writes their keys and values to the pool's tail and attends
    over ``window ++ tail``."""
    t_R, ab_K2 = schedule(b)
    J = b.doc_J.shape[0]
    doc_N, pos_N = pool.keys(W)
    kv_doc, kv_pos = torch.cat([doc_N, b.doc_J]), torch.cat([pos_N, b.pos_J])
    self_mask = pool_mask(b.doc_J, b.pos_J, kv_doc, kv_pos, backend=backend, inner=inner,
                          document_mask=document_mask)  # fmt: skip
    cross = cross_mask(b.doc_J, b.text_doc_X, backend=backend, document_mask=document_mask)
    pack = PackInputs(b.src_index_J, b.latents_dest_T, b.action_dest_T, b.thw_J3, b.text_X,
                      self_mask, cross)  # fmt: skip
    read = torch.cat([pool.rows(W), pool.tail_rows[:J]])
    velocity_update(model, b, t_R, ab_K2, pack, pool.layers(pool.tail_rows[:J], read))


def prefill_step(
    model: DiT, pool: DevicePool, W: int, p: PrefillBlock, b: Buffers, *, backend: str,
    inner: InnerMask, document_mask: bool,
) -> None:  # fmt: skip
    """One prefill pass: block ``p``'s context tokens (clean, t = 0) through every block,
    their keys and values written to their pool rows (padding writes the tail) and attended
    over the pack's window of ``W`` pages (which holds those rows). ``b`` holds the pack's
    text (the requests' tasks)."""
    doc_N, pos_N = pool.keys(W)
    self_mask = pool_mask(p.doc, p.pos, doc_N, pos_N, backend=backend, inner=inner,
                          document_mask=document_mask)  # fmt: skip
    cross = cross_mask(p.doc, b.text_doc_X, backend=backend, document_mask=document_mask)
    no_act, no_rows = pool.no_actions
    pack = PackInputs(p.index, p.index, no_rows, p.thw, b.text_X, self_mask, cross)
    tokens = {"latents": p.x.to(no_act.dtype), "action": no_act}
    t_R = p.x.new_zeros(1)  # every context token at t = 0
    model.velocity(tokens, t_R, p.row, pack, pool.layers(p.rows, pool.rows(W)))
