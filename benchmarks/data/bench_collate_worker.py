"""Packs/s through DataLoader(num_workers=1): the pack built in shared memory vs ordinary memory.

In a worker, PackedCollator allocates its output in shared memory (as default_collate does),
so handing the batch to the main process skips a second copy. ``old`` patches that out.

    python benchmarks/data/bench_collate_worker.py --repeats 6    # alternates old/new, prints medians
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
import packing.data._collate as pc
from benchmarks import harness
from benchmarks.data import bench_collate as bc


def run(mode: str, budget: int, packs_n: int, passes: int) -> float:
    """ms per pack through one worker, after the worker's first batch."""
    original = pc._output_buffer
    if mode == "old":
        pc._output_buffer = lambda like, shape, pin: torch.empty(
            shape, dtype=like.dtype, pin_memory=pin
        )
    try:
        rng = torch.Generator().manual_seed(0)
        packs = [bc.make_episodes(rng, budget, 4608, 10752, torch.bfloat16) for _ in range(packs_n)]
        flat = [e for p in packs for e in p]
        offsets, i = [], 0
        for p in packs:
            offsets.append(list(range(i, i + len(p))))
            i += len(p)
        col = pc.PackedCollator(
            [pc.Stream("latents", grid=(4, 8), budget=budget), pc.Stream("action")]
        )
        dl = DataLoader(flat, batch_sampler=offsets * passes, collate_fn=col, num_workers=1)
        it = iter(dl)
        next(it)
        t0, n = time.perf_counter(), 0
        for _ in it:
            n += 1
        return (time.perf_counter() - t0) / n * 1e3
    finally:
        pc._output_buffer = original


def main() -> None:
    p = harness.base_parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=6)
    args = p.parse_args()
    torch.set_num_threads(1)
    budget, packs_n, passes = (4096, 2, 3) if args.quick else (65536, 6, 12)
    if args.quick:
        args.repeats = 1
    ms: dict[str, list[float]] = {"old": [], "new": []}
    for _ in range(args.repeats):
        for mode in ("old", "new"):
            ms[mode].append(run(mode, budget, packs_n, passes))
    rows = [
        {"method": m, "median ms/pack": statistics.median(v), "runs": len(v)} for m, v in ms.items()
    ]
    rows[1]["vs old"] = rows[0]["median ms/pack"] / rows[1]["median ms/pack"]
    print(harness.markdown_table(rows, ["method", "median ms/pack", "runs", "vs old"]))
    harness.write_json("collate_worker", args, {"rows": rows, "ms": ms}, device="cpu")


if __name__ == "__main__":
    main()
