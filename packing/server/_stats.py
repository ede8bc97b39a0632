"""The server's summary: what the periodic log line and `PolicyServer.summary` report."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from packing.server._worker import EngineLoop

__all__ = ["summary"]


def summary(loops: Sequence[EngineLoop], elapsed_s: float, connections: int) -> dict[str, Any]:
    """Over every engine: requests answered/failed, requests/s since the start, latency p50
    and p99 (message in to result out, the recent 4,096), model calls, requests per model
    call (mean, max) and pack fill (requests over the shape's slots), queue length, and the
    compiles and CUDA graph captures since the engines' warm-up."""
    lat = [x for loop in loops for x in loop.latencies_ms]
    packs = [x for loop in loops for x in loop.packs]
    fill = [x for loop in loops for x in loop.fill]
    answered = sum(loop.answered for loop in loops)
    return {
        "answered": answered,
        "failed": sum(loop.failed for loop in loops),
        "requests_per_s": round(answered / elapsed_s, 3) if elapsed_s > 0 else 0.0,
        "p50_ms": round(float(np.percentile(lat, 50)), 2) if lat else None,
        "p99_ms": round(float(np.percentile(lat, 99)), 2) if lat else None,
        "model_calls": sum(loop.model_calls for loop in loops),
        "requests_per_call": round(float(np.mean(packs)), 3) if packs else None,
        "max_requests_per_call": max(packs) if packs else 0,
        "pack_fill": round(float(np.mean(fill)), 3) if fill else None,
        "queued": sum(loop.outstanding for loop in loops),
        # What the engines compiled and captured since their warm-up: 0 and 0 in service.
        "compiles_after_warm_up": _after(loops, "compiles_after_warm_up"),
        "captures_after_warm_up": _after(loops, "captures_after_warm_up"),
        "connections": connections,
        "engines": len(loops),
    }


def _after(loops: Sequence[EngineLoop], name: str) -> int | None:
    """The sum over the engines of ``name``; None while one has not warmed up."""
    counts = [getattr(loop.engine, name, 0) for loop in loops]
    return None if any(c is None for c in counts) else sum(counts)
