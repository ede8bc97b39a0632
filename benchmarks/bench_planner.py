"""Planner benchmark: episodes/s and pack efficiency, against naive greedy and padding.

    python benchmarks/bench_planner.py                 # 1M episodes, ~2 minutes on one core
    python benchmarks/bench_planner.py --n 100000      # quick look

Pinned to one CPU core. Fixed seeds; one warm-up call per algorithm; the median and spread of
``--repeats`` timed calls (and the best: on a shared machine it is the least disturbed) of ``plan_packs`` (validation, packing and the CSR plan included).
Efficiency = real tokens / (packs * token_budget). Baselines measured in the same run:
``next_fit`` (greedy in data order, what most packers do) and ``pad_to_longest`` (one episode
per row padded to the longest episode: mean / max, no planning at all). Prints one markdown
table and writes the raw numbers, machine and versions to benchmarks/results/planner.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from packing.plan import frames_to_tokens, plan_packs

ALGORITHMS = ["bfd", "lookahead", "ffd", "next_fit"]


def lengths_for(kind: str, n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    if kind == "seed_like":  # 115-284 latent frames x (32 video + 4 action) + 512 text tokens
        frames = rng.integers(115, 285, size=n)
        return frames_to_tokens(frames, action_tokens_per_frame=4, text_tokens=512)
    if kind == "uniform_tokens":  # any integer in the seed range, no frame quantisation
        return rng.integers(4600, 10701, size=n)
    if kind == "long_tailed":  # lognormal, median 2,000 tokens, sigma 1
        return np.maximum(rng.lognormal(np.log(2000), 1.0, size=n).astype(np.int64), 16)
    raise ValueError(kind)


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(
            line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line
        )
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def time_plan(lengths: np.ndarray, budget: int, algorithm: str, repeats: int) -> dict:
    plan_packs(lengths[:1000], budget, algorithm=algorithm)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = plan_packs(lengths, budget, algorithm=algorithm)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {
        "seconds_median": med,
        "seconds_min": min(times),
        "seconds_max": max(times),
        "episodes_per_s": len(lengths) / med,
        "episodes_per_s_best": len(lengths) / min(times),
        "packs": len(plan),
        "efficiency": plan.efficiency,
        "mean_docs_per_pack": float(plan.num_docs_P.mean()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--ffd-n", type=int, default=200_000, help="FFD scans all packs per run")
    ap.add_argument("--sweep-n", type=int, default=100_000, help="episodes in the budget sweep")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "planner.json"))
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    rows = []
    for kind in ["seed_like", "uniform_tokens", "long_tailed"]:
        all_lengths = lengths_for(kind, args.n)
        median = float(np.median(all_lengths))
        for mult in (4, 8):
            budget = int(-(-mult * median // 128) * 128)  # >= mult x median, a multiple of 128
            lengths = np.minimum(all_lengths, budget)  # long tail: clip, this is about packing
            for algorithm in ALGORITHMS:
                n = min(args.n, args.ffd_n) if algorithm == "ffd" else args.n
                r = time_plan(lengths[:n], budget, algorithm, args.repeats)
                rows.append({"lengths": kind, "budget": budget, "x_median": mult, "n": n,
                             "algorithm": algorithm, **r})  # fmt: skip
            pad = float(lengths.mean() / lengths.max())
            rows.append({"lengths": kind, "budget": budget, "x_median": mult, "n": args.n,
                         "algorithm": "pad_to_longest", "efficiency": pad,
                         "episodes_per_s": None, "packs": None})  # fmt: skip
    print(
        "| lengths | budget (x median) | algorithm | episodes | M episodes/s (median, best) "
        "| efficiency | packs |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        speed = (
            "—"
            if r["episodes_per_s"] is None
            else f"{r['episodes_per_s'] / 1e6:.2f}, {r['episodes_per_s_best'] / 1e6:.2f}"
        )
        packs = "—" if r["packs"] is None else f"{r['packs']:,}"
        print(f"| {r['lengths']} | {r['budget']:,} ({r['x_median']}x) | {r['algorithm']} | {r['n']:,} | "
              f"{speed} | {100 * r['efficiency']:.2f}% | {packs} |")  # fmt: skip
    # Efficiency is not monotone in the budget (how many episodes fit changes in steps), so
    # the claim ">= 99% at >= 4x the median" is checked over a sweep of budgets, not two points.
    sweep = []
    mults = [4 + 0.25 * i for i in range(17)]
    for kind in ["seed_like", "uniform_tokens", "long_tailed"]:
        all_lengths = lengths_for(kind, args.sweep_n)
        median = float(np.median(all_lengths))
        for algorithm in ["lookahead", "bfd", "next_fit"]:
            effs = []
            for mult in mults:
                budget = int(mult * median)
                lengths = np.minimum(all_lengths, budget)
                effs.append(plan_packs(lengths, budget, algorithm=algorithm).efficiency)
            worst = int(np.argmin(effs))
            sweep.append({"lengths": kind, "algorithm": algorithm, "n": args.sweep_n,
                          "x_median": mults, "efficiency": effs,
                          "min": effs[worst], "min_at_x_median": mults[worst],
                          "mean": float(np.mean(effs))})  # fmt: skip
    print(f"\nEfficiency over budgets 4x, 4.25x, ..., 8x the median ({args.sweep_n:,} episodes):\n")
    print("| lengths | algorithm | min (at) | mean |")
    print("|---|---|---|---|")
    for r in sweep:
        print(f"| {r['lengths']} | {r['algorithm']} | {100 * r['min']:.2f}% "
              f"({r['min_at_x_median']}x) | {100 * r['mean']:.2f}% |")  # fmt: skip
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "cores_used": 1,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "rows": rows,
        "sweep": sweep,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out}  ({result['machine']}, numpy {np.__version__}, {result['date']})")


if __name__ == "__main__":
    main()
