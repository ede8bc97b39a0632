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
    call (mean, max) and pack fill (requests over the shape's slots), queue length."""
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
        "connections": connections,
        "engines": len(loops),
    }
