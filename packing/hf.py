"""Whole episodes from a plain Hugging Face ``datasets.Dataset`` with an episode column.

For users outside LeRobot: rows are frames, one column names the episode of each row, and
item ``i`` of :class:`HFEpisodes` is the ``i``-th episode (sorted by id) with every requested
column stacked on a leading sequence axis. Three episodes of lengths ``[2, 4, 3]``::

    row            0 1 2 3 4 5 6 7 8
    episode_index  0 0 1 1 1 1 2 2 2
    item 1 = {"action": rows 2..5 -> (4, A), "episode_index": 1, "task": "..."}

Rows of an episode need not be contiguous: they are gathered in row order with one Arrow
``take`` (contiguous episodes are one zero-copy slice). Declared dtypes are kept (a float16
column stays float16). A boolean ``{key}_is_pad`` column becomes ``{key}_loss_mask =
~{key}_is_pad`` (see :func:`plan_columns`), so padded targets never enter a loss by mistake.

The Arrow-to-tensor conversion here (:func:`arrow_to_numpy`) is also what
:mod:`packing.lerobot` uses; ``datasets`` is imported only when an ``HFEpisodes`` is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from packing._lazy import require

__all__ = ["HFEpisodes", "arrow_to_numpy", "check_numeric", "plan_columns"]

PAD_SUFFIX = "_is_pad"
MASK_SUFFIX = "_loss_mask"
# Per-episode values every item carries; requesting them as per-frame keys would collide.
RESERVED = ("episode_index", "task")


def arrow_to_numpy(column: Any, *, key: str) -> np.ndarray:
    """Arrow column of ``N`` rows -> ndarray ``(N, *shape)`` in the stored dtype.

    Nested fixed or variable lists become trailing axes (``Array3D(48, 8, 16)`` of float16 ->
    ``(N, 48, 8, 16)`` float16); a scalar column becomes ``(N,)``. Rows must all have the same
    shape and no nulls; the error names ``key`` otherwise. One copy, into writable memory.
    """
    pa = require("pyarrow", extra=None)
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    n = len(arr)
    shape: list[int] = []
    while True:
        if isinstance(arr, pa.ExtensionArray):  # datasets' ArrayNDExtensionType wraps lists
            arr = arr.storage
        if arr.null_count:
            raise ValueError(f"column {key!r} has {arr.null_count} null values; fill them first")
        t = arr.type
        if pa.types.is_fixed_size_list(t):
            dim = t.list_size
        elif pa.types.is_list(t) or pa.types.is_large_list(t):
            lens = require("pyarrow.compute", extra=None).list_value_length(arr).to_numpy()
            if len(lens) == 0 or (lens != lens[0]).any():
                raise ValueError(
                    f"column {key!r} is ragged (inner lengths {sorted(set(lens.tolist()))[:5]}); "
                    "only fixed-shape numeric features can be stacked into a sequence"
                )
            dim = int(lens[0])
        else:
            break
        shape.append(dim)
        arr = arr.flatten()  # respects slice offsets, unlike .values
    check_numeric(t, key=key)
    values = arr.to_numpy(zero_copy_only=False, writable=True)
    return values.reshape(n, *shape)


def check_numeric(arrow_type: Any, *, key: str) -> None:
    """Raise ``TypeError`` unless ``arrow_type`` is numbers or booleans, possibly nested in lists."""
    pa = require("pyarrow", extra=None)
    t = arrow_type
    while True:
        if isinstance(t, pa.ExtensionType):
            t = t.storage_type
        elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            t = t.value_type
        else:
            break
    if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
        raise TypeError(
            f"column {key!r} holds {t}, not numbers; only numeric or boolean features are "
            "served as tensors (pre-encode images or video to latents as a numeric feature)"
        )


def plan_columns(keys: Sequence[str], available: Sequence[str]) -> list[tuple[str, str, bool]]:
    """Which columns to read for ``keys``: ``[(output_name, column, invert), ...]``.

    A ``{key}_is_pad`` column is served inverted, as ``{key}_loss_mask`` (True = real target),
    whether it is requested itself or found next to a requested ``key``::

        keys ["latents", "action"], columns has "action_is_pad"
        -> [("latents", "latents", False), ("action", "action", False),
            ("action_loss_mask", "action_is_pad", True)]
    """
    avail = list(available)
    for k in keys:
        if k in RESERVED:
            raise ValueError(
                f"key {k!r} is always returned as a per-episode value; remove it from keys"
            )
        if k not in avail:
            raise KeyError(f"unknown key {k!r}; available features: {avail}")
    plan: list[tuple[str, str, bool]] = []
    for k in keys:
        if k.endswith(PAD_SUFFIX):
            plan.append((k[: -len(PAD_SUFFIX)] + MASK_SUFFIX, k, True))
            continue
        plan.append((k, k, False))
        pad = k + PAD_SUFFIX
        if pad in avail and pad not in keys:
            plan.append((k + MASK_SUFFIX, pad, True))
    return plan


def table_to_episode(table: Any, plan: list[tuple[str, str, bool]]) -> dict[str, torch.Tensor]:
    """One episode's Arrow rows -> ``{output_name: tensor (F, ...)}`` following ``plan``."""
    out: dict[str, torch.Tensor] = {}
    for name, column, invert in plan:
        values = arrow_to_numpy(table.column(column), key=column)
        if invert:
            if values.dtype != np.bool_:
                raise TypeError(
                    f"{column!r} is {values.dtype}, but a {PAD_SUFFIX!r} column must be boolean "
                    f"(True = padded frame) to become {name!r}"
                )
            values = ~values
        out[name] = torch.from_numpy(values)
    return out


def group_rows(episode_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows grouped by episode: ``(ids_E, offsets_E1, order_N)``, ids sorted ascending.

    Episode ``ids_E[j]`` owns rows ``order_N[offsets_E1[j]:offsets_E1[j + 1]]``, in row order::

        episode_ids [1, 0, 1, 2, 0]  ->  ids [0, 1, 2], offsets [0, 2, 4, 5],
                                         order [1, 4, 0, 2, 3]
    """
    order = np.argsort(episode_ids, kind="stable")
    ids, starts = np.unique(episode_ids[order], return_index=True)
    offsets = np.append(starts, len(order)).astype(np.int64)
    return ids, offsets, order.astype(np.int64)


class HFEpisodes(Dataset):
    """Episode-level dataset over a ``datasets.Dataset`` whose rows are frames.

    Args:
        dataset: a ``datasets.Dataset`` (after ``select``/``shuffle``/``filter`` too).
        keys: columns to serve, each as a tensor ``(F, *shape)`` in its stored dtype.
        episode_column: the integer column that names each row's episode.
        episodes: episode ids to serve, in this order (default: all, sorted).
        task_column: a string column; its value (constant within an episode) becomes
            ``item["task"]``. Without it, items carry no ``"task"``.

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
    ) -> None:
        datasets = require("datasets", extra="hf")
        if not isinstance(dataset, datasets.Dataset):
            raise TypeError(
                f"expected a datasets.Dataset, got {type(dataset).__name__}"
                + ("; pick a split, e.g. ds['train']" if isinstance(dataset, dict) else "")
            )
        columns = list(dataset.column_names)
        for col in (episode_column, task_column):
            if col is not None and col not in columns:
                raise KeyError(f"unknown column {col!r}; available columns: {columns}")
        self.keys = tuple(keys)
        self._plan = plan_columns(self.keys, [c for c in columns if c != episode_column])
        self.task_column = task_column
        ep_ids = arrow_to_numpy(
            dataset.select_columns([episode_column]).with_format("arrow")[episode_column],
            key=episode_column,
        )
        if ep_ids.ndim != 1 or ep_ids.dtype.kind not in "iu":
            raise TypeError(
                f"episode column {episode_column!r} must be one integer per row, "
                f"got {ep_ids.dtype} of shape {ep_ids.shape[1:]}"
            )
        schema = dataset.data.schema  # validate early, not in a DataLoader worker
        for _, col, _ in self._plan:
            check_numeric(schema.field(col).type, key=col)
        ids, offsets, self._order = group_rows(ep_ids)
        # "arrow" format: indexing returns pyarrow Tables and honours select/shuffle indices;
        # selecting columns first keeps a gather of scattered rows to the columns we serve.
        read = sorted({col for _, col, _ in self._plan} | ({task_column} if task_column else set()))
        self._rows = dataset.select_columns(read).with_format("arrow")
        pos = {int(e): j for j, e in enumerate(ids)}
        wanted = ids.tolist() if episodes is None else [int(e) for e in episodes]
        missing = [e for e in wanted if e not in pos]
        if missing:
            raise KeyError(
                f"episodes {missing[:10]} not found in column {episode_column!r} "
                f"({len(ids)} episodes, ids {ids.min()}..{ids.max()})"
            )
        sel = np.array([pos[e] for e in wanted], dtype=np.int64)
        self.episode_ids = np.array(wanted, dtype=np.int64)
        self._starts = offsets[sel]
        self.lengths = (offsets[sel + 1] - offsets[sel]).astype(np.int64)

    def __len__(self) -> int:
        return len(self.episode_ids)

    def _episode_rows(self, i: int) -> Any:
        rows = self._order[self._starts[i] : self._starts[i] + self.lengths[i]]
        if rows[-1] - rows[0] + 1 == len(rows):  # contiguous: one zero-copy slice
            return self._rows[int(rows[0]) : int(rows[-1]) + 1]
        return self._rows[rows.tolist()]

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"episode position {i} out of range for {len(self)} episodes")
        i = i % len(self)
        table = self._episode_rows(i)
        item: dict[str, Any] = table_to_episode(table, self._plan)
        item["episode_index"] = int(self.episode_ids[i])
        if self.task_column is not None:
            tasks = table.column(self.task_column).unique().to_pylist()
            if len(tasks) != 1:
                raise ValueError(
                    f"episode {item['episode_index']} has {len(tasks)} values in task column "
                    f"{self.task_column!r} ({tasks[:3]}); a task must be constant per episode"
                )
            item["task"] = str(tasks[0])
        return item
