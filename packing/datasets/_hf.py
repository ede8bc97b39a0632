"""Whole episodes from a plain Hugging Face ``datasets.Dataset`` with an episode column.

For users outside LeRobot: rows are frames, one column names the episode of each row, and
item ``i`` of :class:`HFEpisodes` is the ``i``-th episode (sorted by id) with every requested
column stacked on a leading sequence axis. Three episodes of lengths ``[2, 4, 3]``::

    row            0 1 2 3 4 5 6 7 8
    episode_index  0 0 1 1 1 1 2 2 2
    item 1 = {"action": rows 2..5 -> (4, A), "episode_index": 1, "task": "..."}

Rows of an episode need not be contiguous, nor in time order: with a ``frame_index`` column
(``frame_column``) an episode's frames are served in ``frame_index`` order, whatever the row
order (``ds.shuffle()`` interleaves and reverses them), and a repeated or missing frame index
is refused; without one, in row order (refused after a shuffle: the order is lost). They are gathered with one Arrow ``take`` (rows already contiguous
and in order are one zero-copy slice). Declared dtypes are kept (a float16
column stays float16). A boolean ``{key}_is_pad`` column becomes ``{key}_loss_mask =
~{key}_is_pad`` (see `packing.datasets._arrow.plan_columns`), so padded targets never enter a loss by
mistake. The Arrow-to-tensor conversion (`packing.datasets._arrow`) is shared with `packing.datasets._lerobot`;
``datasets`` is imported only when an ``HFEpisodes`` is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from packing._lazy import require
from packing._validate import check_bool, check_finite, check_int, check_sequence
from packing.datasets import _arrow

__all__ = ["HFEpisodes"]


def _int_column(dataset: Any, column: str, what: str, fix: str) -> np.ndarray:
    """One integer per row of ``column``, read as numpy, or a TypeError naming it."""
    values = _arrow.arrow_to_numpy(
        dataset.select_columns([column]).with_format("arrow")[column], key=column
    )
    if values.ndim != 1 or values.dtype.kind not in "iu":
        raise TypeError(
            f"{what} {column!r} must be one integer per row, got {values.dtype} of shape "
            f"{values.shape[1:]}{fix}"
        )
    return values


def group_rows(
    episode_ids: np.ndarray, frames: np.ndarray | None = None, frame_column: str = "frame_index"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows grouped by episode: ``(ids_E, offsets_E1, order_N)``, ids sorted ascending.

    Episode ``ids_E[j]`` owns rows ``order_N[offsets_E1[j]:offsets_E1[j + 1]]``, in row order,
    or in ``frames`` order when given (a shuffled dataset's rows are out of time order)::

        episode_ids [1, 0, 1, 2, 0]  ->  ids [0, 1, 2], offsets [0, 2, 4, 5],
                                         order [1, 4, 0, 2, 3]
        frames      [1, 1, 0, 0, 0]  ->  order [4, 1, 2, 0, 3]
    """
    if frames is None:
        order = np.argsort(episode_ids, kind="stable")
    else:
        order = np.lexsort((frames, episode_ids))
        same = (np.diff(episode_ids[order]) == 0) & (np.diff(frames[order]) == 0)
        if same.any():
            r = order[int(np.flatnonzero(same)[0]) + 1]
            raise ValueError(
                f"episode {episode_ids[r]} has {frame_column} {frames[r]} twice (row {r} "
                "repeats it): frames would be served in an arbitrary order; deduplicate the "
                "rows, or pass frame_column=None to keep row order"
            )
    ids, starts = np.unique(episode_ids[order], return_index=True)
    offsets = np.append(starts, len(order)).astype(np.int64)
    return ids, offsets, order.astype(np.int64)


_DEFAULT_FRAME = "frame_index"  # LeRobot's column: used when there, not required


def _reordered(dataset: Any) -> bool:
    """Whether ``dataset`` serves its rows in another order than stored (``shuffle``,
    ``sort``, a ``select`` out of order); a ``filter`` keeps the order."""
    indices = getattr(dataset, "_indices", None)  # datasets' row mapping, None if identity
    if indices is None:
        return False
    rows = np.asarray(indices.column(0).to_numpy()).astype(np.int64)  # uint64: diff wraps
    return bool((np.diff(rows) < 0).any())


def _served_rows(dataset: Any) -> np.ndarray | None:
    """The stored rows a ``select``/``shuffle``/``filter``-ed dataset serves (None: all)."""
    indices = getattr(dataset, "_indices", None)
    return None if indices is None else indices.column(0).to_numpy().astype(np.int64)


def _refuse_gaps(
    episode_ids: np.ndarray, frames: np.ndarray, order: np.ndarray, frame_column: str
) -> None:
    """Frames of an episode are consecutive: a ``filter()`` that dropped frame 3 of 0..5
    would otherwise serve frames 2 and 4 as neighbours."""
    e, f = episode_ids[order], frames[order]
    gap = (np.diff(e) == 0) & (np.diff(f) != 1)
    if gap.any():
        j = int(np.flatnonzero(gap)[0])
        raise ValueError(
            f"episode {e[j]} has no {frame_column} {f[j] + 1} (frames {f[j]} and {f[j + 1]} "
            "would be served as neighbours): rows of this episode are missing, e.g. after a "
            "filter() on frames; filter whole episodes (HFEpisodes(..., episodes=[...])), or "
            "pass frame_column=None to serve the rows as they are"
        )


def _refuse_duplicates(wanted: list[int]) -> None:
    """Two items of one episode would share its noise and timestep keys: refused."""
    seen: set[int] = set()
    for e in wanted:
        if e in seen:
            raise ValueError(
                f"episodes lists episode {e} twice; each episode is served once (its "
                "episode_index keys its noise and timesteps): remove the duplicate"
            )
        seen.add(e)


def _check_dataset(
    dataset: Any, episode_column: Any, task_column: Any, frame_column: Any
) -> list[str]:
    """A non-empty ``datasets.Dataset`` holding the named columns; returns its columns."""
    datasets = require("datasets", extra="hf")
    for name, col in (
        ("episode_column", episode_column),
        ("task_column", task_column),
        ("frame_column", frame_column),
    ):
        if (col is not None or name == "episode_column") and not isinstance(col, str):
            raise TypeError(f"{name}={col!r} must be a column name (str)")
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(
            f"expected a datasets.Dataset, got {type(dataset).__name__}"
            + ("; pick a split, e.g. ds['train']" if isinstance(dataset, dict) else "")
        )
    if len(dataset) == 0:
        raise ValueError(
            "the dataset has no rows (an empty split, or a filter() that kept nothing); "
            "pass a dataset with at least one episode"
        )
    columns = list(dataset.column_names)
    for name, col in (
        ("episode_column", episode_column),
        ("task_column", task_column),
        ("frame_column", None if frame_column == _DEFAULT_FRAME else frame_column),
    ):
        if col is not None and col not in columns:
            raise KeyError(f"{name}={col!r} is not a column; available columns: {columns}")
    return columns


def _frames(dataset: Any, frame_column: str | None, columns: list[str]) -> np.ndarray | None:
    """Each row's frame number, or None (row order); refused when rows were reordered and
    nothing says the time order."""
    if frame_column is not None and frame_column in columns:
        fix = "; pass frame_column=None to serve rows in row order"
        return _int_column(dataset, frame_column, "frame column", fix)
    if frame_column is not None and _reordered(dataset):
        raise ValueError(
            f"the dataset's rows were reordered (shuffle/select/sort) and it has no "
            f"{frame_column!r} column to put an episode's frames back in time order; "
            f"pass frame_column= naming the frame-number column (columns: {columns}), "
            "build HFEpisodes before shuffling (the sampler shuffles episodes), or pass "
            "frame_column=None if the row order is the time order"
        )
    return None


def _selection(ids: np.ndarray, episodes: Sequence[int] | None, column: str) -> np.ndarray:
    """Positions in ``ids`` of the ``episodes`` to serve (all, in order, by default)."""
    if episodes is None:
        return np.arange(len(ids), dtype=np.int64)
    wanted = [
        check_int(f"episodes[{i}]", e) for i, e in enumerate(check_sequence("episodes", episodes))
    ]
    if not wanted:
        raise ValueError("episodes=[] selects no episode; pass None for all of them")
    _refuse_duplicates(wanted)
    pos = {int(e): j for j, e in enumerate(ids)}
    missing = [e for e in wanted if e not in pos]
    if missing:
        raise KeyError(
            f"episodes {missing[:10]} not found in column {column!r} "
            f"({len(ids)} episodes, ids {ids.min()}..{ids.max()})"
        )
    return np.array([pos[e] for e in wanted], dtype=np.int64)


class HFEpisodes(Dataset):
    """Episode-level dataset over a ``datasets.Dataset`` whose rows are frames.

    Args:
        dataset: a ``datasets.Dataset`` (after ``select``/``shuffle``/``filter`` too).
        keys: columns to serve, each as a tensor ``(F, *shape)`` in its stored dtype.
        episode_column: the integer column that names each row's episode.
        episodes: episode ids to serve, in this order (default: all, sorted).
        task_column: a string column; its value (constant within an episode) becomes
            ``item["task"]`` (a missing task, None, is refused). Without it, items carry no
            ``"task"``.
        frame_column: the integer column giving each row's frame (time) in its episode:
            frames are served in its order and must be consecutive (a gap is refused, naming
            the episode and the frame). The default, LeRobot's ``frame_index``, is used when
            the dataset has it; without it rows keep their order, which is refused when the
            rows were reordered (``shuffle``). Another name must be a column. ``None``: row
            order always.
        check_finite: refuse an item whose float values hold NaN or inf, naming the episode,
            the key and the first bad index.

    ``.lengths`` (frames per item) comes from the episode column alone.
    """

    def __init__(
        self,
        dataset: Any,
        keys: Sequence[str],
        *,
        episode_column: str = "episode_index",
        episodes: Sequence[int] | None = None,
        task_column: str | None = None,
        frame_column: str | None = "frame_index",
        check_finite: bool = False,
    ) -> None:
        keys = check_sequence("keys", keys, of=str)
        if not keys:
            raise ValueError(
                "keys=[] requests no column: items would hold only episode_index (and task); "
                "name the columns to serve, e.g. keys=['observation.state', 'action']"
            )
        self.check_finite = check_bool("check_finite", check_finite)
        columns = _check_dataset(dataset, episode_column, task_column, frame_column)
        self.keys = tuple(keys)
        self._plan = _arrow.plan_columns(self.keys, [c for c in columns if c != episode_column])
        self.task_column = task_column
        ep_ids = _int_column(dataset, episode_column, "episode column", "")
        served = _served_rows(dataset)
        for _, col, _ in self._plan:  # validate early, not in a DataLoader worker
            _arrow.check_numeric(dataset.data.schema.field(col).type, key=col)
            _arrow.check_rows_alike(dataset.data.column(col), key=col, rows=served)
        frames = _frames(dataset, frame_column, columns)
        ids, offsets, self._order = group_rows(ep_ids, frames, frame_column or "")
        if frames is not None:
            _refuse_gaps(ep_ids, frames, self._order, frame_column or "")
        # "arrow" format: indexing returns pyarrow Tables and honours select/shuffle indices;
        # selecting columns first keeps a gather of scattered rows to the columns we serve.
        read = sorted({col for _, col, _ in self._plan} | ({task_column} if task_column else set()))
        self._rows = dataset.select_columns(read).with_format("arrow")
        sel = _selection(ids, episodes, episode_column)
        self.episode_ids = ids[sel].astype(np.int64)
        self._starts = offsets[sel]
        self.lengths = (offsets[sel + 1] - offsets[sel]).astype(np.int64)

    def __len__(self) -> int:
        return len(self.episode_ids)

    def _episode_rows(self, i: int) -> Any:
        rows = self._order[self._starts[i] : self._starts[i] + self.lengths[i]]
        if (np.diff(rows) == 1).all():  # contiguous and in order: one zero-copy slice
            return self._rows[int(rows[0]) : int(rows[-1]) + 1]
        return self._rows[rows.tolist()]

    def __getitem__(self, i: int) -> dict[str, Any]:
        i = check_int("i", i, hint="an episode position; numpy ints too, not bools")
        if not -len(self) <= i < len(self):
            raise IndexError(f"episode position {i} out of range for {len(self)} episodes")
        i = i % len(self)
        table = self._episode_rows(i)
        item: dict[str, Any] = _arrow.table_to_episode(table, self._plan)
        item["episode_index"] = int(self.episode_ids[i])
        if self.check_finite:
            for key in self.keys:
                check_finite(f"episode {item['episode_index']}", key, item[key])
        if self.task_column is not None:
            tasks = table.column(self.task_column).unique().to_pylist()
            if len(tasks) != 1:
                raise ValueError(
                    f"episode {item['episode_index']} has {len(tasks)} values in task column "
                    f"{self.task_column!r} ({tasks[:3]}); a task must be constant per episode"
                )
            if not isinstance(tasks[0], str):  # None is a missing task, never the prompt 'None'
                raise ValueError(
                    f"episode {item['episode_index']} has task {tasks[0]!r} in task column "
                    f"{self.task_column!r}, not a string; fill the missing tasks (ds.map), "
                    "or pass task_column=None to serve items without a task"
                )
            item["task"] = tasks[0]
        return item
