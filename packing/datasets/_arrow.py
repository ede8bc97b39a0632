"""Arrow columns of frames -> numpy/torch, shared by the dataset adapters (`packing.datasets._hf`,
`packing.datasets._lerobot`); pyarrow (a core dependency) is imported on first use.

An episode's rows become one tensor per served feature, sequence axis first, in the stored
dtype; a boolean ``{key}_is_pad`` column is served inverted as ``{key}_loss_mask``::

    column "action" (Array1D(14), float32), 4 rows   ->  "action"           (4, 14) float32
    column "action_is_pad" (bool), 4 rows            ->  "action_loss_mask" (4,)    bool
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from packing._lazy import require

__all__ = [
    "MASK_SUFFIX",
    "PAD_SUFFIX",
    "RESERVED",
    "arrow_to_numpy",
    "check_numeric",
    "check_rows_alike",
    "plan_columns",
    "table_to_episode",
]

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


def check_rows_alike(column: Any, *, key: str, rows: np.ndarray | None = None) -> None:
    """Every served row (``rows`` of the column; all by default) has the same outer length
    and is not null, checked once when the dataset is opened (one pass over the row
    lengths, not the values, chunk by chunk: nothing the size of the column is copied): a
    ragged or null column is refused then, not when an item that holds it is read. Inner
    levels of nested lists are checked per item (`arrow_to_numpy`)."""
    pa = require("pyarrow", extra=None)
    pc = require("pyarrow.compute", extra=None)
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    nulls, lens = [], []
    for arr in chunks:
        if isinstance(arr, pa.ExtensionArray):
            arr = arr.storage
        nulls.append(arr.is_null().to_numpy(zero_copy_only=False))
        if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
            lens.append(pc.list_value_length(arr).to_numpy(zero_copy_only=False))
    null = np.concatenate(nulls) if nulls else np.zeros(0, dtype=bool)
    if rows is not None:
        null = null[rows]
    if null.any():
        raise ValueError(f"column {key!r} has {int(null.sum())} null values; fill them first")
    if not lens:
        return
    length = np.concatenate(lens)
    if rows is not None:
        length = length[rows]
    if len(length) and (length != length[0]).any():
        raise ValueError(
            f"column {key!r} is ragged (rows of {length.min()} to {length.max()} values); only "
            "fixed-shape numeric features can be stacked into a sequence: pad or split it"
        )


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
