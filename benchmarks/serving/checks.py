"""Does the engine's step make the host wait for the GPU? Two checks that could say yes.

1. ``torch.cuda.set_sync_debug_mode("warn")`` around the steps: torch flags every call that
   synchronizes (``.item()``, ``float(t)``, a blocking copy). A deliberate ``float(t)`` must
   be seen (the control), or the count means nothing.
2. The profiler's memcpy records: a host-to-device copy from *pageable* memory is staged by
   the driver and blocks the host even with ``non_blocking=True`` -- and the debug mode of
   (1) does not always see it. CUPTI names each copy by its memory kinds ("Memcpy HtoD
   (Pageable -> Device)"); the check counts those over the profiled steps, with a deliberate
   pageable ``non_blocking`` copy as its control.

Both run on CUDA only; on the CPU the rows say so.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch


def sync_debug_count(run_steps: Callable[[], None], dev: torch.device) -> dict[str, Any]:
    """Syncs torch flags while ``run_steps()`` runs, and whether a deliberate one is seen."""
    if dev.type != "cuda":
        run_steps()
        return {"host_syncs": None, "control_sync_seen": None, "note": "CUDA only"}
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_steps()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message)[:160] for w in caught if "synchroniz" in str(w.message).lower()]
    with warnings.catch_warnings(record=True) as control:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            float(torch.ones(1, device=dev).sum())
        finally:
            torch.cuda.set_sync_debug_mode(0)
    seen = sum(1 for w in control if "synchroniz" in str(w.message).lower())
    return {"host_syncs": len(syncs), "first_syncs": syncs[:5], "control_sync_seen": seen}


def pageable_copies(run_steps: Callable[[], None], dev: torch.device) -> dict[str, Any]:
    """Host-to-device copies from pageable memory in ``run_steps()``, from the profiler's
    memcpy records, and the same count for a control that makes exactly one."""
    if dev.type != "cuda":
        run_steps()
        return {"pageable_h2d": None, "control_seen": None, "note": "CUDA only"}
    from torch.profiler import ProfilerActivity, profile

    def count(fn: Callable[[], None]) -> tuple[int, int, list[str]]:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if "memcpy" in e.name.lower()]
        pageable = [n for n in names if "pageable" in n.lower() and "htod" in n.lower()]
        return len(pageable), len(names), sorted(set(names))[:8]

    def control() -> None:
        torch.ones(4096).to(dev, non_blocking=True)  # pageable source: a blocking copy

    n, total, kinds = count(run_steps)
    seen, _, _ = count(control)
    return {"pageable_h2d": n, "memcpy_total": total, "memcpy_kinds": kinds, "control_seen": seen}
