"""Layout arithmetic, one home each: rounding up, positions inside documents, and the check
that each document is one run (`check_doc_runs`, shared by the masks and the losses).

Legend (the package's shape letters; ``docs/index.md`` has the whole table)::

    T   tokens of a stream, padding included     K   documents (episodes) in a pack
    K1  K + 1 document boundaries                 S   steps of a stream (frames, actions)

Three documents of lengths ``[2, 4, 3]`` padded to ``T = 12``::

    lengths_K           [2, 4, 3]
    doc_ids_T           0 0 1 1 1 1 2 2 2 -1 -1 -1
    doc_starts(doc_ids) 0 0 2 2 2 2 6 6 6  9  9  9     (padding runs start too)
    local_positions     0 1 0 1 2 3 0 1 2  0  0  0     (0 on padding)
    positions_from_lengths([2, 4, 3])  ->  0 1 0 1 2 3 0 1 2     (real tokens only)

Two ways in, because the inputs live in two places: the collate knows the lengths as host
ints (`positions_from_lengths`, numpy, no per-token Python); masks and losses see only the
doc ids on the device (`doc_starts`, `local_positions`, torch, no host-device sync). Tests
check both against a per-document ``arange``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "LayoutArrays",
    "ceil_div",
    "doc_starts",
    "layout_arrays",
    "local_positions",
    "padded_length",
    "positions_from_lengths",
    "round_up",
    "thw_from_lengths",
]


def ceil_div(n: int, d: int) -> int:
    """``ceil(n / d)`` in integers (no float rounding at any size): ``ceil_div(9, 4) == 3``."""
    return -(-n // d)


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= n``: ``round_up(9, 4) == 12``."""
    return ceil_div(n, multiple) * multiple


def padded_length(tokens: int, multiple: int) -> int:
    """A stream's padded length without a budget: ``tokens`` rounded up to ``multiple``, and
    at least one ``multiple`` so an empty pack still has a (padding) row to compute on.

    ``padded_length(9, 4) == 12``, ``padded_length(0, 4) == 4``. `PackedCollator` pads every
    stream without a budget this way; ``pack_text`` and ``pack_text_embeddings`` go through it.
    """
    return max(1, ceil_div(tokens, multiple)) * multiple


def positions_from_lengths(lengths_K: Sequence[int], out: np.ndarray | None = None) -> np.ndarray:
    """int32 ``(sum(lengths_K),)``: each token's position inside its document.

    ``[2, 4, 3] -> [0 1 0 1 2 3 0 1 2]``. Each document's positions are the first ``n`` rows
    of one cached ``arange``, joined by one ``np.concatenate`` (written into ``out`` when
    given), so this costs a few numpy calls however many tokens there are.
    """
    tpl = _template(max(lengths_K, default=0), None)
    return _join([tpl.pos[:n] for n in lengths_K], (0,), out)


def thw_from_lengths(
    lengths_K: Sequence[int], grid: tuple[int, int], out: np.ndarray | None = None
) -> np.ndarray:
    """int32 ``(sum(lengths_K), 3)``: each token's ``(t, h, w)`` inside its document, for a
    stream of ``grid = (h, w)`` tokens per step in row-major order.

    ``grid=(1, 2)``, lengths ``[4, 2]`` -> ``(0,0,0) (0,0,1) (1,0,0) (1,0,1) | (0,0,0) (0,0,1)``.
    """
    tpl = _template(max(lengths_K, default=0), grid)
    return _join([tpl.thw[:n] for n in lengths_K], (0, 3), out)


class LayoutArrays(NamedTuple):
    """One stream's layout as fresh int32 numpy arrays (see `layout_arrays`)."""

    doc_ids_T: np.ndarray
    position_ids_T: np.ndarray
    thw_T3: np.ndarray | None
    cu_seqlens_K1: np.ndarray


def layout_arrays(
    lengths_K: Sequence[int],
    padded: int,
    grid: tuple[int, int] | None = None,
    num_docs: int | None = None,
) -> LayoutArrays:
    """A stream's whole layout from its documents' token counts, padding included::

        layout_arrays([2, 4, 3], 12, num_docs=5)
        doc_ids_T       0 0 1 1 1 1 2 2 2 -1 -1 -1
        position_ids_T  0 1 0 1 2 3 0 1 2  0  0  0
        cu_seqlens_K1   [0, 2, 6, 9, 9, 9]       (num_docs + 1 entries; the sum repeats)

    ``thw_T3`` (for a ``grid``) is each token's ``(t, h, w)``, 0 on padding. Each array is
    made by one numpy call over the whole stream, padding tail included: doc ids by one
    ``np.repeat`` of ``[0, 1, ..., K - 1, -1]``, positions and ``thw`` by one
    ``np.concatenate`` of K prefixes of a cached template and a slice of cached zeros. The
    arrays are new (never views of a cache), writable and contiguous. Requires
    ``sum(lengths_K) <= padded`` and ``num_docs >= len(lengths_K)`` (callers check).
    """
    lengths = list(lengths_K)
    k = len(lengths)
    cu = list(accumulate(lengths, initial=0))
    tail = padded - cu[-1]
    tpl = _template(max(lengths, default=0), grid)
    pad = _zeros(tail)
    doc = np.repeat(_doc_values(k), [*lengths, tail])
    pos = np.concatenate([tpl.pos[:n] for n in lengths] + [pad.pos[:tail]])
    thw = None
    if grid is not None:
        thw = np.concatenate([tpl.thw[:n] for n in lengths] + [pad.thw[:tail]])
    extra = (k if num_docs is None else num_docs) - k
    cu_K1 = np.array(cu + [cu[-1]] * extra if extra > 0 else cu, dtype=np.int32)
    return LayoutArrays(doc, pos, thw, cu_K1)


@lru_cache(maxsize=256)
def _doc_values(k: int) -> np.ndarray:
    """``[0, 1, ..., k - 1, -1]``: the doc id of each document, then of the padding tail."""
    out = np.append(np.arange(k, dtype=np.int32), np.int32(-1))
    out.flags.writeable = False
    return out


def _join(parts: list[np.ndarray], empty: tuple[int, ...], out: np.ndarray | None) -> np.ndarray:
    if not parts:
        return np.zeros(empty, dtype=np.int32) if out is None else out
    if out is None:
        return np.concatenate(parts)
    return np.concatenate(parts, out=out)


def doc_starts(doc_ids_T: Tensor) -> Tensor:
    """int64 ``(T,)``: the index of the first token of each token's run of equal doc ids.

    ``doc_ids [0 0 1 1 1 -1 -1] -> [0 0 2 2 2 5 5]``. Documents are contiguous runs, so a
    token's document starts at the last run start at or before it: a running max, with no
    host-device sync. A run of padding (-1) has a start too; callers mask it.
    """
    doc_T = doc_ids_T.to(torch.int64)
    t_T = torch.arange(doc_T.shape[0], device=doc_T.device)
    new_T = torch.ones_like(doc_T, dtype=torch.bool)  # a run starts here
    new_T[1:] = doc_T[1:] != doc_T[:-1]
    return torch.where(new_T, t_T, 0).cummax(0).values


def local_positions(doc_ids_T: Tensor) -> Tensor:
    """int32 ``(T,)`` position of each token inside its document, 0 on padding.

    ``doc_ids [0 0 1 1 1 -1] -> [0 1 0 1 2 0]``: ``t - doc_starts(doc_ids)[t]``. What inner
    masks (causal, frame-causal, window) see as ``q`` and ``kv``; the same values as a
    layout's ``position_ids_T``, which the collate built from the lengths.
    """
    doc_T = doc_ids_T.to(torch.int64)
    t_T = torch.arange(doc_T.shape[0], device=doc_T.device)
    return torch.where(doc_T >= 0, t_T - doc_starts(doc_T), 0).to(torch.int32)


@dataclass(frozen=True)
class _Template:
    """``pos = [0, 1, 2, ...]`` and, for a grid, ``thw`` = (t, h, w) of the same tokens."""

    pos: np.ndarray
    thw: np.ndarray


_TEMPLATES: dict[tuple[int, int] | None, _Template] = {}
_ZEROS: list[_Template] = []


def _template(n: int, grid: tuple[int, int] | None) -> _Template:
    """The layout of one document of at least ``n`` tokens, built once per grid and grown by
    doubling; every document's positions are a prefix of it (read-only, never handed out)."""
    tpl = _TEMPLATES.get(grid)
    if tpl is not None and len(tpl.pos) >= n:
        return tpl
    size = max(n, 2 * len(tpl.pos) if tpl is not None else 4096)
    pos = np.arange(size, dtype=np.int32)
    thw: np.ndarray = np.zeros((0, 3), dtype=np.int32)
    if grid is not None:
        h, w = grid
        thw = np.stack([pos // (h * w), (pos % (h * w)) // w, pos % w], axis=1)
    pos.flags.writeable = False
    thw.flags.writeable = False
    tpl = _Template(pos, thw)
    _TEMPLATES[grid] = tpl
    return tpl


def _zeros(n: int) -> _Template:
    """At least ``n`` zeros, 1-D (``pos``) and ``(n, 3)`` (``thw``): the padding tail of a
    layout, grown by doubling (read-only, never handed out)."""
    if _ZEROS and len(_ZEROS[0].pos) >= n:
        return _ZEROS[0]
    size = max(n, 2 * len(_ZEROS[0].pos) if _ZEROS else 4096)
    pos, thw = np.zeros(size, dtype=np.int32), np.zeros((size, 3), dtype=np.int32)
    pos.flags.writeable = False
    thw.flags.writeable = False
    _ZEROS[:] = [_Template(pos, thw)]
    return _ZEROS[0]


def check_doc_runs(t: Tensor, name: str) -> None:
    """Raise unless ids are >= -1, each document one contiguous run, ids increasing."""
    ids = t.detach().to("cpu", torch.int64)
    if ids.min() < -1:
        pos = int((ids < -1).nonzero()[0])
        raise ValueError(f"{name}[{pos}] = {int(ids[pos])}; ids are >= 0, or -1 for padding")
    real = ids >= 0
    prev = torch.cat([ids.new_full((1,), -2), ids[:-1]])
    run_start = (real & (ids != prev)).nonzero().flatten()  # first token of each run
    run_ids = ids[run_start]
    bad = (run_ids[1:] <= run_ids[:-1]).nonzero().flatten()
    if bad.numel():
        k = int(bad[0])
        raise ValueError(
            f"{name}: document {int(run_ids[k + 1])} at position {int(run_start[k + 1])} follows "
            f"document {int(run_ids[k])}; each document must be one contiguous run and ids must "
            "increase along the sequence (padding -1 may sit between documents); pack with "
            "PackedCollator or renumber the documents in order"
        )
