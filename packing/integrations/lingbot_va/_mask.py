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

    def rule(bq: int, bkv: int) -> tuple[Tensor, Tensor]:
        q, k = _tiles(tok, bq, 1), _tiles(tok, bkv, 1)
        any_ = q.has[:, None] & k.has[None] & (k.lo[None] <= q.hi[:, None])
        return any_, q.only[:, None] & k.only[None] & (k.hi[None] <= q.lo[:, None])

    return with_tile_rule(clean_to_clean, rule)


def noise_to_clean(tok: DualStreamTokens) -> MaskMod:
    """A noisy token sees clean tokens of strictly earlier chunks (never its own chunk)."""
    copy, chunk = tok.copy_J, tok.chunk_J

    def noise_to_clean(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (copy[q] == 0) & (copy[kv] == 1) & (chunk[kv] < chunk[q])

    def rule(bq: int, bkv: int) -> tuple[Tensor, Tensor]:
        q, k = _tiles(tok, bq, 0), _tiles(tok, bkv, 1)
        any_ = q.has[:, None] & k.has[None] & (k.lo[None] < q.hi[:, None])
        return any_, q.only[:, None] & k.only[None] & (k.hi[None] < q.lo[:, None])

    return with_tile_rule(noise_to_clean, rule)


def noise_to_noise(tok: DualStreamTokens) -> MaskMod:
    """A noisy token sees the noisy tokens of its own chunk (latent and action chunks differ)."""
    copy, chunk = tok.copy_J, tok.chunk_J

    def noise_to_noise(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (copy[q] == 0) & (copy[kv] == 0) & (chunk[kv] == chunk[q])

    def rule(bq: int, bkv: int) -> tuple[Tensor, Tensor]:
        q, k = _tiles(tok, bq, 0), _tiles(tok, bkv, 0)
        overlap = (k.lo[None] <= q.hi[:, None]) & (q.lo[:, None] <= k.hi[None])
        one = (q.lo == q.hi)[:, None] & (k.lo == k.hi)[None] & (q.lo[:, None] == k.lo[None])
        return q.has[:, None] & k.has[None] & overlap, q.only[:, None] & k.only[None] & one

    return with_tile_rule(noise_to_noise, rule)


def chunk_window(tok: DualStreamTokens) -> MaskMod:
    """``|chunk_q - chunk_kv| <= window`` of the query's episode (LeRobot's window)."""
    chunk, window = tok.chunk_J, tok.window_J

    def chunk_window(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (chunk[q] - chunk[kv]).abs() <= window[q]

    def rule(bq: int, bkv: int) -> tuple[Tensor, Tensor]:
        q, k = _tiles(tok, bq, None), _tiles(tok, bkv, None)
        gap = torch.maximum(k.lo[None] - q.hi[:, None], q.lo[:, None] - k.hi[None]).clamp_min(0)
        span = torch.maximum(q.hi[:, None] - k.lo[None], k.hi[None] - q.lo[:, None])
        return gap <= q.w_hi[:, None], span <= q.w_lo[:, None]

    return with_tile_rule(chunk_window, rule)


def lingbot_va_mask(
    tok: DualStreamTokens, *, window: bool = True, rules: tuple[str, ...] = ()
) -> MaskMod:
    """LingBot-VA's rule: ``(clean_to_clean | noise_to_clean | noise_to_noise) & chunk_window``,
    named ``lingbot_va``; AND it with the document mask through ``make_block_mask(...,
    mask_mod=)`` / ``prepare_attention(..., mask_mod=)``. ``window=False`` drops the window
    (a negative control: verify must then fail)."""
    parts = [clean_to_clean(tok), noise_to_clean(tok), noise_to_noise(tok)]
    copies = or_masks(*parts)
    rules_ = [p.tile_rule for p in parts]  # type: ignore[attr-defined]

    def copies_rule(bq: int, bkv: int) -> tuple[Tensor, Tensor]:
        flags = [r(bq, bkv) for r in rules_]
        # OR of rules: any is exact-or-over; all of an OR is at least any part's all.
        return _or(f[0] for f in flags), _or(f[1] for f in flags)

    if not window:
        return with_tile_rule(copies, copies_rule, "lingbot_va_no_window")
    win = chunk_window(tok)
    win_rule = win.tile_rule  # type: ignore[attr-defined]

    def rule(bq: int, bkv: int) -> tuple[Tensor, Tensor]:
        (a1, l1), (a2, l2) = copies_rule(bq, bkv), win_rule(bq, bkv)
        return a1 & a2, l1 & l2

    return with_tile_rule(and_masks(copies, win), rule, "lingbot_va")


def _or(xs: object) -> Tensor:
    out = None
    for x in xs:  # type: ignore[attr-defined]
        out = x if out is None else out | x
    assert out is not None
    return out


class _TileRange:
    """Per tile of one side: does it hold tokens of the copy, only those, and the range of
    their ``chunk_J`` (and of the real tokens' windows)."""

    def __init__(self, tok: DualStreamTokens, block: int, copy: int | None) -> None:
        n = ceil_div(tok.chunk_J.shape[0], block)
        pad = n * block - tok.chunk_J.shape[0]

        def tiles(x: Tensor, fill: int) -> Tensor:
            return torch.nn.functional.pad(x.long(), (0, pad), value=fill).view(n, block)

        c = tiles(tok.copy_J, -1)
        sel = c >= 0 if copy is None else c == copy
        chunk = tiles(tok.chunk_J, 0)
        self.has = sel.any(1)
        self.only = sel.all(1)
        self.lo = torch.where(sel, chunk, _BIG).amin(1)
        self.hi = torch.where(sel, chunk, -_BIG).amax(1)
        w = tiles(tok.window_J, 0)
        real = c >= 0
        self.w_lo = torch.where(real, w, _BIG).amin(1)
        self.w_hi = torch.where(real, w, -_BIG).amax(1)


def _tiles(tok: DualStreamTokens, block: int, copy: int | None) -> _TileRange:
    return _TileRange(tok, block, copy)
