"""What the engines do on the device to stay robust: static buffers allocated (and bounded)
at construction, host-to-device copies from pinned memory, and the quarantine of a request
whose state is no longer finite, all without a host sync in the step; and a result's read
back that waits for no later model call."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from packing._validate import check_sequence

__all__ = ["allocate", "bounded", "pinned", "quarantine", "to_host"]

S = TypeVar("S")  # the pack shape type
B = TypeVar("B")  # an engine's static buffers


def pinned(src: Tensor, device: torch.device) -> Tensor:
    """``src`` (host) ready for a ``non_blocking`` copy to ``device``: pinned when the device
    is CUDA, because from pageable memory a "non-blocking" copy may first wait for the stream
    (every kernel queued before it; CUDA: "might be synchronous", the driver's choice, e.g. by
    size), which is a host sync in all but name; from pinned memory it never does."""
    return src.pin_memory() if device.type == "cuda" else src


def to_host(t: Tensor) -> Tensor:
    """A `Result`'s tensor on the host. On CUDA the copy runs on a side stream: on the
    engine's stream it would first wait for the model call the engine has queued after the
    result (it keeps the next call queued), a whole pack's call added to every reply. Safe
    because a result is handed out only once the event queued after its copy has completed
    (`Engine._ran`); nothing then remains for the side stream to wait for."""
    if not isinstance(t, Tensor):
        raise TypeError(f"to_host(t) takes a Result's tensor, got t={type(t).__name__}")
    if t.device.type != "cuda":
        return t.cpu()
    with torch.cuda.stream(torch.cuda.Stream(t.device)):
        return t.cpu()


def quarantine(bad_K: Tensor, states: Sequence[tuple[Tensor, Tensor]]) -> None:
    """Flag every request whose state holds a NaN or inf and zero its rows, on the device and
    without a host sync (it runs inside the step, so inside a captured CUDA graph).

    ``states``: ``(x, slot_T)`` pairs, ``x`` rows first, ``slot_T`` each row's request (-1:
    context or padding, not state). Zeroed, a failed request can no longer reach the other
    requests of the next model call (a masked-out NaN still gives 0 * NaN = NaN in attention);
    ``bad_K`` ``(R,)`` tells the host which failed::

        slot_T   0 0 1 1 -1        bad_K   [False, True]
        finite   y y n y  n   ->   x rows 2 and 3 set to 0, row 4 (padding) left as it is
    """
    _check_quarantine(bad_K, states)
    R = bad_K.shape[0]
    ids_R = torch.arange(R, device=bad_K.device)
    bad = torch.zeros(R, dtype=torch.bool, device=bad_K.device)
    for x, slot in states:
        row_bad = ~torch.isfinite(x.reshape(x.shape[0], math.prod(x.shape[1:]))).all(dim=1)
        bad |= ((slot[:, None] == ids_R[None, :]) & row_bad[:, None]).any(dim=0)
    bad_K.copy_(bad)
    bad_R1 = torch.cat([bad, bad.new_zeros(1)])  # row R: not a request
    for x, slot in states:
        hit = bad_R1[torch.where(slot >= 0, slot, R)].reshape(-1, *[1] * (x.dim() - 1))
        x.copy_(torch.where(hit, 0.0, x))


def _check_quarantine(bad_K: Any, states: Any) -> None:
    """The arguments' types and sizes (host checks only: no sync, so a captured step may too)."""
    if not isinstance(bad_K, Tensor) or bad_K.dtype != torch.bool or bad_K.dim() != 1:
        got = f"{bad_K.dtype} {tuple(bad_K.shape)}" if isinstance(bad_K, Tensor) else bad_K
        raise TypeError(f"quarantine's bad_K must be an (R,) bool tensor, got {got!r}")
    for i, pair in enumerate(check_sequence("states", states)):
        ok = isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(t, Tensor) for t in pair)
        if not ok or pair[1].dtype != torch.int64 or pair[1].shape != pair[0].shape[:1]:
            raise TypeError(
                f"quarantine's states[{i}] must be an (x, slot_T) pair: x rows first, slot_T an "
                "int64 tensor of one request slot per row (-1: not state)"
            )


def allocate(
    shapes: Sequence[S], build: Callable[[S, torch.device], B], device: torch.device, steps: str
) -> dict[S, B]:
    """Every shape's static buffers, allocated now, so a shape or a ``max_steps`` too large
    for the device fails at construction, never inside a step.

    The bound: the buffers' bytes (counted on the meta device first) must fit the device's
    free memory now (CUDA: ``torch.cuda.mem_get_info``; CPU: ``MemAvailable``). The model's
    activations come on top and are not counted. ``steps`` names the max_steps argument."""
    try:
        need = {s: _nbytes(vars(build(s, torch.device("meta")))) for s in shapes}
    except RuntimeError as err:  # a size past int64 (e.g. frames=10**18)
        raise ValueError(f"a pack shape is too large to describe ({err}); lower it") from err
    free = _free_bytes(device)
    if sum(need.values()) > free:
        s = max(need, key=lambda k: need[k])
        meta = build(s, torch.device("meta"))
        tables = _nbytes([meta.t_table, meta.coef])  # type: ignore[attr-defined]
        field = steps if 2 * tables > need[s] else f"{s!r}'s sizes"
        raise ValueError(
            f"the engine's static buffers need {_gib(sum(need.values()))} on {device}, more "
            f"than the {_gib(free)} free ({s!r} alone: {_gib(need[s])}, of which {_gib(tables)} "
            f"the requests x {steps} schedule tables); lower {field}"
        )
    try:
        return {s: build(s, device) for s in shapes}
    except (RuntimeError, MemoryError) as err:  # what the allocator raises when it cannot
        raise ValueError(
            f"allocating the engine's static buffers on {device} failed ({err}); lower the pack "
            f"shapes or {steps}"
        ) from err


def bounded(build: Callable[[torch.device], B], device: torch.device, what: str, field: str) -> B:
    """``build(device)``, once its tensors (counted on the meta device first) fit the
    device's free memory; else a ValueError naming their bytes and ``field`` to lower,
    instead of the allocator's error (or the host's OOM killer) inside torch."""
    need = _nbytes(vars(build(torch.device("meta"))))
    free = _free_bytes(device)
    if need > free:
        raise ValueError(
            f"{what} needs {_gib(need)} on {device}, more than the {_gib(free)} free; lower {field}"
        )
    try:
        return build(device)
    except (RuntimeError, MemoryError) as err:  # what the allocator raises when it cannot
        raise ValueError(f"allocating {what} on {device} failed ({err}); lower {field}") from err


def _nbytes(value: Any) -> int:
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, tuple | list):
        return sum(_nbytes(v) for v in value)
    return 0


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024
    except (OSError, StopIteration):  # not Linux: no bound known, the allocator decides
        return 2**63


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"
