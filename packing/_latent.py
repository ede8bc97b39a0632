"""Latent frames of a causal video VAE: which video frames each covers, which row stores it.

A Wan-style VAE keeps the first frame alone and compresses each later group of ``tc = 4``
frames into one latent frame, so latent ``j >= 1`` covers video frames ``4j-3 .. 4j`` and
depends on no later frame (the encoder is causal). A latent dataset (``packing encode``) keeps
one row per *video* frame, so actions and states stay as recorded, and stores latent ``j`` on
the row of the last frame it covers; the other rows of a latent column hold zeros and are
never served::

    video frame   0 | 1 2 3 4 | 5 6 7 8        F = 9 = 1 + 4*2 frames
    latent        0 |    1    |    2           L = 1 + (F-1)/4 = 3
    stored on row 0 |       4 |       8        rows min(4j, F-1)

An episode of ``F = 1 + 4k + r`` frames (``0 < r < 4``) has no exact encoding: diffusers'
encoder would silently drop the last ``r`` frames. ``packing encode`` refuses it unless asked
to pad (``--pad-frames``): the last frame is repeated ``4 - r`` times, the extra latent
``k + 1`` covers frames ``4k+1 .. F-1`` (and the copies) and is stored on row ``F-1``. The
feature's ``meta/info.json`` entry records the rule under ``"latent"`` (docs/encode.md), so
a reader cannot get the alignment wrong.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "ENCODE_STAGING",
    "LATENT_KEY",
    "latent_count",
    "latent_rows",
    "latent_spans",
    "latent_spec",
]

LATENT_KEY = "latent"  # the key of a feature's info.json entry that makes it a latent feature
ENCODE_STAGING = ".packing-encode"  # an unfinished packing encode's folder in its destination


def latent_count(frames: int, tc: int, *, pad: bool) -> int:
    """Latent frames for ``frames`` video frames: ``1 + (F-1)/tc``, rounded up when padded.

    ``latent_count(9, 4, pad=False) -> 3``; ``latent_count(10, 4, pad=True) -> 4``;
    ``latent_count(10, 4, pad=False)`` raises (10 is not 1 + 4k).
    """
    if frames < 1:
        raise ValueError(f"an episode of {frames} frames has no latent frame")
    extra = (frames - 1) % tc
    if extra and not pad:
        lo, hi = frames - extra, frames - extra + tc
        raise ValueError(
            f"{frames} frames is not 1 + {tc}k (the VAE encodes the first frame alone, then "
            f"groups of {tc}; {lo} or {hi} would be): the last {extra} would be dropped"
        )
    return 1 + -(-(frames - 1) // tc)


def latent_rows(frames: int, tc: int, *, pad: bool) -> np.ndarray:
    """Row (video frame) of an episode that stores each latent frame: ``min(tc*j, F-1)``.

    ``latent_rows(9, 4, pad=False) -> [0, 4, 8]``; ``latent_rows(10, 4, pad=True) ->
    [0, 4, 8, 9]``.
    """
    n = latent_count(frames, tc, pad=pad)
    return np.minimum(np.arange(n, dtype=np.int64) * tc, frames - 1)


def latent_spans(frames: int, tc: int, *, pad: bool) -> np.ndarray:
    """``(L, 2)`` first and last real video frame each latent frame covers.

    ``latent_spans(9, 4, pad=False) -> [[0, 0], [1, 4], [5, 8]]``.
    """
    last = latent_rows(frames, tc, pad=pad)
    first = np.concatenate([[0], last[:-1] + 1]).astype(np.int64)
    return np.stack([first, last], axis=1)


def latent_spec(feature: dict[str, Any], key: str) -> tuple[int, bool] | None:
    """``(temporal_compression, padded)`` of a latent feature's info.json entry, or None for an
    ordinary feature; a malformed entry is refused, naming the feature."""
    spec = feature.get(LATENT_KEY)
    if spec is None:
        return None
    fields = ("temporal_compression", "pad_frames")
    tc, pad = (spec.get(k) if isinstance(spec, dict) else None for k in fields)
    if not isinstance(tc, int) or isinstance(tc, bool) or tc < 1 or not isinstance(pad, bool):
        raise ValueError(
            f"feature {key!r} has a malformed {LATENT_KEY!r} entry in meta/info.json ({spec!r}); "
            "expected {'temporal_compression': int >= 1, 'pad_frames': bool, ...} as packing "
            "encode writes it: re-encode the dataset"
        )
    return tc, pad
