"""Timing: warm-up (compilation lands there), CUDA events around each timed call, the median
and the spread of many calls; compile counters and peak memory."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call: median and spread over ``n`` timed calls."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    mean_ms: float
    std_ms: float
    n: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.median_ms:.3f} ms [p10 {self.p10_ms:.3f}, p90 {self.p90_ms:.3f}]"


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(samples_ms: Sequence[float]) -> Timing:
    xs = list(samples_ms)
    return Timing(
        median_ms=statistics.median(xs),
        p10_ms=_quantile(xs, 0.1),
        p90_ms=_quantile(xs, 0.9),
        min_ms=min(xs),
        mean_ms=statistics.fmean(xs),
        std_ms=statistics.pstdev(xs) if len(xs) > 1 else 0.0,
        n=len(xs),
    )


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_fn(
    fn: Callable[[], Any],
    *,
    device: torch.device | str,
    warmup: int = 3,
    iters: int = 20,
    min_time_s: float = 0.0,
) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls (compilation lands here), then ``iters`` timed
    ones, each bracketed by CUDA events on a GPU (perf_counter after a sync on CPU).

    Each call is timed on its own so the spread is real; ``min_time_s`` keeps timing past
    ``iters`` until that much time was spent (for very fast calls).
    """
    dev = torch.device(device)
    for _ in range(warmup):
        fn()
    sync(dev)
    samples: list[float] = []
    t_start = time.perf_counter()
    while len(samples) < iters or (time.perf_counter() - t_start) < min_time_s:
        if dev.type == "cuda":
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        if len(samples) >= 10 * max(iters, 1):
            break
    return summarize(samples)


def time_paired(
    fn_a: Callable[[], Any],
    fn_b: Callable[[], Any],
    *,
    device: torch.device | str,
    warmup: int = 3,
    iters: int = 40,
) -> dict[str, float]:
    """``fn_a`` against ``fn_b``, called alternately (A B B A A B ...), each timed on its own:
    the median and p10/p90 of the per-pair ratio ``time(b) / time(a)`` (> 1: A is faster).

    Two blocks of calls timed one after the other drift apart with the clocks and whatever
    else the machine does (the same kernel read 4-14% apart in one run); a pair shares its
    moment, so a few-percent gap shows in the ratio's spread instead of hiding in it.
    """
    for _ in range(warmup):
        fn_a()
        fn_b()
    pairs: list[tuple[float, float]] = []
    for i in range(iters):
        order = (0, 1) if i % 2 == 0 else (1, 0)  # alternate who goes first
        took = [0.0, 0.0]
        for who in order:
            took[who] = time_fn((fn_a, fn_b)[who], device=device, warmup=0, iters=1).median_ms
        pairs.append((took[0], took[1]))
    ratios = [b / a for a, b in pairs]
    return {
        "ratio b/a median": statistics.median(ratios),
        "ratio p10": _quantile(ratios, 0.1),
        "ratio p90": _quantile(ratios, 0.9),
        "a median ms": statistics.median(a for a, _ in pairs),
        "b median ms": statistics.median(b for _, b in pairs),
        "pairs": float(len(pairs)),
    }


def time_host(fn: Callable[[], Any], *, warmup: int = 3, iters: int = 50) -> Timing:
    """Wall time of host-side work (no device sync): collate, mask build launch cost."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return summarize(samples)


def dynamo_counters() -> dict[str, int]:
    """Graphs compiled so far. A recompile (new shapes, new guards) compiles a new graph, so
    the growth of ``unique_graphs`` after warm-up is the recompile count."""
    from torch._dynamo.utils import counters

    return {
        "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
        "frames_ok": int(counters["frames"].get("ok", 0)),
        "frames_total": int(counters["frames"].get("total", 0)),
    }


def mem_gb(device: torch.device | str) -> float:
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated() / 1e9
    return 0.0


def mark(device: torch.device) -> Any:
    """A point in time on ``device``'s stream (a recorded CUDA event) or the host's clock; two
    marks give the time between them with `elapsed_ms`, with no sync in between."""
    if device.type == "cuda":
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e
    return time.perf_counter()


def elapsed_ms(device: torch.device, a: Any, b: Any) -> float:
    """Milliseconds between two `mark`s (a CUDA pair needs ``b`` to have completed)."""
    return float(a.elapsed_time(b)) if device.type == "cuda" else (b - a) * 1e3
