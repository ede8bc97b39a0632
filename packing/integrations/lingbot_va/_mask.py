"""LingBot-VA's attention rule as composable, named mask_mods over `DualStreamTokens`.

LeRobot's ``FlexAttnFunc._get_mask_mod`` ORs three copy-to-copy rules and ANDs a window, on
``frame_ids`` = chunk id * 2 + kind (``chunk_J`` here), with one ``chunk_size`` and
``window_size`` for the whole call. Packed, both are per episode (gathered to tokens), and
the document mask replaces LeRobot's ``seq_ids`` term (`packing.attention.make_block_mask`
ANDs it). One episode, 2 latent frames of 1 token + 1 action each, chunk_size 1::

    kv ->        noisy lat  clean lat  noisy act  clean act     chunk_J: lat 0 2, act 1 3
    q  noisy lat   # .        . .        . .        . .
                   . #        # .        . .        # .        noise -> clean: earlier chunks
       clean lat   . .        # .        . .        . .
                   . .        # #        . .        # .        clean -> clean: chunk <= own
       noisy act   . .        # .        # .        . .        noise -> noise: own chunk
                   . .        # #        . #        # .
       clean act   . .        # .        . .        # .
                   . .        # #        . .        # #

``chunk_window``: ``|chunk_q - chunk_kv| <= window[doc]``. Every rule carries a tile rule
(`packing.attention.with_tile_rule`) from per-tile ranges of ``chunk_J`` per copy, so the
block mask is built from boundaries and tile summaries, never from the ``J x J`` pairs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import and_masks, or_masks

from packing._layout_math import ceil_div
from packing._validate import check_bool
from packing.attention import with_tile_rule
from packing.integrations.lingbot_va._tokens import DualStreamTokens

__all__ = ["chunk_window", "clean_to_clean", "lingbot_va_mask", "noise_to_clean", "noise_to_noise"]

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
_BIG = 1 << 40


def clean_to_clean(tok: DualStreamTokens) -> MaskMod:
    """A clean token sees clean tokens of its own and earlier chunks (block-causal)."""
    copy, chunk = tok.copy_J, tok.chunk_J

    def clean_to_clean(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (copy[q] == 1) & (copy[kv] == 1) & (chunk[kv] <= chunk[q])

    return with_tile_rule(clean_to_clean, _copy_rule(tok, 1, 1, "le", window=False))


def noise_to_clean(tok: DualStreamTokens) -> MaskMod:
    """A noisy token sees clean tokens of strictly earlier chunks (never its own chunk)."""
    copy, chunk = tok.copy_J, tok.chunk_J

    def noise_to_clean(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (copy[q] == 0) & (copy[kv] == 1) & (chunk[kv] < chunk[q])

    return with_tile_rule(noise_to_clean, _copy_rule(tok, 0, 1, "lt", window=False))


def noise_to_noise(tok: DualStreamTokens) -> MaskMod:
    """A noisy token sees the noisy tokens of its own chunk (latent and action chunks differ)."""
    copy, chunk = tok.copy_J, tok.chunk_J

    def noise_to_noise(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (copy[q] == 0) & (copy[kv] == 0) & (chunk[kv] == chunk[q])

    return with_tile_rule(noise_to_noise, _copy_rule(tok, 0, 0, "eq", window=False))


def chunk_window(tok: DualStreamTokens) -> MaskMod:
    """``|chunk_q - chunk_kv| <= window`` of the query's episode (LeRobot's window)."""
    chunk, window = tok.chunk_J, tok.window_J

    def chunk_window(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (chunk[q] - chunk[kv]).abs() <= window[q]

    def rule(bq: int, bkv: int) -> tuple[Tensor, Tensor]:
        q, k = _TileRange(tok, bq, None), _TileRange(tok, bkv, None)
        return _window(q, k)

    return with_tile_rule(chunk_window, rule)


def lingbot_va_mask(tok: DualStreamTokens, *, window: bool = True) -> MaskMod:
    """LingBot-VA's rule: ``(clean_to_clean | noise_to_clean | noise_to_noise) & chunk_window``,
    named ``lingbot_va``; AND it with the document mask through ``make_block_mask(...,
    mask_mod=)`` / ``prepare_attention(..., mask_mod=)``. ``window=False`` drops the window
    (a negative control: verify must then fail). Its tile rule applies the window to each
    copy pair's own chunk ranges (tighter than AND-ing the two rules' tiles)."""
    check_bool("window", window)
    copies = or_masks(clean_to_clean(tok), noise_to_clean(tok), noise_to_noise(tok))
    pairs = [(1, 1, "le"), (0, 1, "lt"), (0, 0, "eq")]
    rules = [_copy_rule(tok, qc, kc, rel, window=window) for qc, kc, rel in pairs]

    def rule(bq: int, bkv: int) -> tuple[Tensor, Tensor]:
        flags = [r(bq, bkv) for r in rules]
        # A tile may hold a true pair if any copy pair may; it is full if one pair fills it.
        return flags[0][0] | flags[1][0] | flags[2][0], flags[0][1] | flags[1][1] | flags[2][1]

    if not window:
        return with_tile_rule(copies, rule, "lingbot_va_no_window")
    return with_tile_rule(and_masks(copies, chunk_window(tok)), rule, "lingbot_va")


def _copy_rule(
    tok: DualStreamTokens, q_copy: int, kv_copy: int, relation: str, *, window: bool
) -> Callable[[int, int], tuple[Tensor, Tensor]]:
    """Tiles of "a q token of ``q_copy`` sees a kv token of ``kv_copy`` whose chunk is
    ``relation`` (le, lt, eq) its own" (and, with ``window``, within the window), from each
    tile's chunk ranges per (copy, kind): latent chunks are even and action chunks odd, so
    ``eq`` pairs a kind with itself alone. Exact for a tile of one copy, kind and episode."""

    def rule(bq: int, bkv: int) -> tuple[Tensor, Tensor]:
        any_ = all_ = None
        for qk in (0, 1):
            q = _TileRange(tok, bq, q_copy, qk)
            for kk in (0, 1) if relation != "eq" else (qk,):
                k = _TileRange(tok, bkv, kv_copy, kk)
                a, f = _relation(q, k, relation)
                if window:
                    w_any, w_all = _window(q, k)
                    a, f = a & w_any, f & w_all
                any_ = a if any_ is None else any_ | a
                all_ = f if all_ is None else all_ | f
        assert any_ is not None and all_ is not None
        return any_, all_

    return rule


def _relation(q: _TileRange, k: _TileRange, relation: str) -> tuple[Tensor, Tensor]:
    qlo, qhi, klo, khi = q.lo[:, None], q.hi[:, None], k.lo[None], k.hi[None]
    if relation == "le":
        any_, all_ = klo <= qhi, khi <= qlo
    elif relation == "lt":
        any_, all_ = klo < qhi, khi < qlo
    else:
        any_ = (klo <= qhi) & (qlo <= khi)
        all_ = (qlo == qhi) & (klo == khi) & (qlo == klo)
    return any_ & q.has[:, None] & k.has[None], all_ & q.only[:, None] & k.only[None]


def _window(q: _TileRange, k: _TileRange) -> tuple[Tensor, Tensor]:
    """May some pair lie within the window (the chunk ranges' gap), do all (their span)."""
    qlo, qhi, klo, khi = q.lo[:, None], q.hi[:, None], k.lo[None], k.hi[None]
    gap = torch.maximum(klo - qhi, qlo - khi).clamp_min(0)
    span = torch.maximum(qhi - klo, khi - qlo)
    return gap <= q.w_hi[:, None], span <= q.w_lo[:, None]


class _TileRange:
    """Per tile of one side: does it hold tokens of the copy (and kind), only those, and the
    range of their ``chunk_J`` (and of the real tokens' windows)."""

    def __init__(
        self, tok: DualStreamTokens, block: int, copy: int | None, kind: int | None = None
    ) -> None:
        n = ceil_div(tok.chunk_J.shape[0], block)
        pad = n * block - tok.chunk_J.shape[0]

        def tiles(x: Tensor, fill: int) -> Tensor:
            return torch.nn.functional.pad(x.long(), (0, pad), value=fill).view(n, block)

        c = tiles(tok.copy_J, -1)
        real = c >= 0
        sel = real if copy is None else c == copy
        if kind is not None:
            sel = sel & (tiles(tok.kind_J, -1) == kind)
        chunk = tiles(tok.chunk_J, 0)
        self.has = sel.any(1)
        self.only = sel.all(1)
        self.lo = torch.where(sel, chunk, _BIG).amin(1)
        self.hi = torch.where(sel, chunk, -_BIG).amax(1)
        w = tiles(tok.window_J, 0)
        self.w_lo = torch.where(real, w, _BIG).amin(1)
        self.w_hi = torch.where(real, w, -_BIG).amax(1)
