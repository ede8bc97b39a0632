"""Episodes longer than the token budget, cut into windows on step boundaries.

A *piece* is ``(episode, start, stop, loss_start)`` in steps (latent frames, action chunks):
the window ``[start, stop)`` of the episode, whose steps before ``loss_start`` are context the
previous window already trained on. One episode of 10 steps, windows of at most 4, cuts on
multiples of 2, an overlap of 2::

    steps      0 1 2 3 4 5 6 7 8 9
    piece 0    L L L L                     (0, 4, 0)
    piece 1        c c L L                 (2, 6, 4)     c: context, no loss
    piece 2            c c L L             (4, 8, 6)     L: loss
    piece 3                c c L L         (6, 10, 8)

Every step carries loss exactly once; the last window ends where the episode ends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from packing._validate import check_int, check_sequence

__all__ = ["pieces_of", "slice_piece", "split_windows"]


def split_windows(
    num_steps: int, max_steps: int, *, multiple: int = 1, overlap: int = 0
) -> list[tuple[int, int, int]]:
    """Cut ``num_steps`` steps into windows ``(start, stop, loss_start)`` of at most ``max_steps``.

    Cuts fall on multiples of ``multiple`` (a latent frame, an action chunk); each window after
    the first starts ``overlap`` steps before the previous one stopped, and those steps are
    context only (``loss_start`` = previous stop), so every step carries loss exactly once.
    The last window stops at ``num_steps``: no step is invented to round it up::

        split_windows(10, 4, multiple=2, overlap=2)
        -> [(0, 4, 0), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    """
    check_int("num_steps", num_steps, min=1, max=2**31, hint="steps of one episode")
    check_int("max_steps", max_steps, min=1)
    check_int("multiple", multiple, min=1)
    check_int("overlap", overlap, min=0, hint="a negative overlap would leave steps out")
    width = (max_steps // multiple) * multiple
    if width < multiple or overlap % multiple or overlap >= width:
        raise ValueError(
            f"cannot split {num_steps} steps into windows of <= {max_steps} steps cut on "
            f"multiples of {multiple} with overlap {overlap}: need overlap a multiple of "
            f"{multiple} and below {width}; raise token_budget or lower split_overlap"
        )
    out = [(0, min(width, num_steps), 0)]
    while out[-1][1] < num_steps:
        prev = out[-1][1]
        start = prev - overlap
        out.append((start, min(start + width, num_steps), prev))
    return out


def slice_piece(
    episode: Mapping[str, Any], piece: Sequence[int], *, rows_per_step: Mapping[str, int]
) -> dict[str, Any]:
    """The window of ``episode`` that a split-plan item names, ready for the collator.

    ``piece = (episode, start, stop, loss_start)`` in steps; ``rows_per_step`` says how many
    rows of each step-level stream one step holds (a latent frame: 1; its 4 actions: 4).
    Other values are copied. ``loss_start`` is returned in steps relative to the window: the
    loss gives zero weight to steps before it (context already trained on)::

        piece (7, 2, 6, 4), rows_per_step {"latents": 1, "action": 4}
        -> latents[2:6], action[8:24], loss_start 2   (steps 2, 3 are context)
    """
    values = check_sequence("piece", piece)
    if len(values) != 4:
        raise ValueError(f"piece={piece!r} must be (episode, start, stop, loss_start)")
    _, start, stop, loss_start = (check_int(f"piece[{i}]", v, min=0) for i, v in enumerate(values))
    if not start <= loss_start <= stop:
        raise ValueError(f"piece={piece!r} needs start <= loss_start <= stop")
    out = dict(episode)
    for key, rows in rows_per_step.items():
        check_int(f"rows_per_step[{key!r}]", rows, min=1)
        if key not in episode:
            raise KeyError(f"rows_per_step names {key!r}, which the episode does not have")
        out[key] = episode[key][start * rows : stop * rows]
    out["loss_start"] = loss_start - start
    return out


def pieces_of(
    lengths_N: np.ndarray, budget: int, tps: int, fixed: int, multiple: int, overlap: int
) -> np.ndarray:
    """Pieces ``(I, 4)`` of all episodes: row ``e`` is episode ``e``'s first (or only) window,
    further windows of split episodes follow. ``tps`` tokens per step, ``fixed`` per piece."""
    steps_N, rem = np.divmod(lengths_N - fixed, tps)
    if (rem != 0).any() or (steps_N < 1).any():
        e = int(np.flatnonzero((rem != 0) | (steps_N < 1))[0])
        raise ValueError(
            f"episode {e} has {int(lengths_N[e]):,} tokens, not fixed_tokens + steps * "
            f"tokens_per_step ({fixed} + k * {tps}); oversize='split' needs the token count "
            f"of a step: pass tokens_per_step and fixed_tokens that match frames_to_tokens"
        )
    max_steps = (budget - fixed) // tps
    rows = [(e, 0, int(s), 0) for e, s in enumerate(steps_N.tolist())]
    for e in np.flatnonzero(lengths_N > budget).tolist():
        wins = split_windows(int(steps_N[e]), max_steps, multiple=multiple, overlap=overlap)
        rows[e] = (e, *wins[0])
        rows.extend((e, *w) for w in wins[1:])
    return np.asarray(rows, dtype=np.int64).reshape(-1, 4)
