"""Planner benchmark: episodes/s and pack efficiency, against naive greedy and padding.

    python benchmarks/data/bench_planner.py                            # 10K, 100K, 1M (~5 min, 1 core)
    python benchmarks/data/bench_planner.py --sizes 10000,100000       # quick look

Pinned to one CPU core. Fixed seeds; one warm-up call per algorithm; the median, p90 and best
of ``--repeats`` timed calls of ``plan_packs`` (validation, packing and the CSR plan included).
Goal for the default (lookahead): >= 1M episodes/s at every size, p90 within 1.3x the median
(no GC-dependent outliers). Efficiency = real tokens / (packs * token_budget). Measured in
the same run: ``lookahead (before)``, the item-by-item lookahead this release replaced (kept
as the tests' reference, identical plans; up to 100K episodes), ``next_fit`` (greedy in data
order, what most packers do), ``bfd``/``ffd``, and ``pad_to_longest`` (one episode per row
padded to the longest: mean / max, no planning). Prints markdown tables and writes the raw
numbers, machine and versions to benchmarks/results/planner.json.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from packing.planning import _plan as plan_module
from packing.planning import frames_to_tokens, plan_packs

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from reference import best_fit_lookahead_reference

from benchmarks import harness

ALGORITHMS = ["lookahead", "lookahead (before)", "bfd", "ffd", "next_fit"]


def lookahead_before(lengths: np.ndarray, budget: int, max_docs: int | None = None) -> np.ndarray:
    """``lookahead`` as it was: the better of two item-by-item runs (the tests' reference)."""
    a = best_fit_lookahead_reference(lengths, budget, max_docs, opener=0.5)
    b = best_fit_lookahead_reference(lengths, budget, max_docs, opener=0.65)
    return b if len(b) and b.max() < a.max() else a


plan_module._ALGORITHMS["lookahead (before)"] = lookahead_before  # type: ignore[assignment]


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
    plan_packs(lengths[:1000], budget, algorithm=algorithm)  # type: ignore[arg-type]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = plan_packs(lengths, budget, algorithm=algorithm)  # type: ignore[arg-type]
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    p90 = float(np.quantile(times, 0.9))
    return {
        "seconds_median": med,
        "seconds_p90": p90,
        "seconds_min": min(times),
        "seconds_max": max(times),
        "p90_over_median": p90 / med,
        "episodes_per_s": len(lengths) / med,
        "episodes_per_s_best": len(lengths) / min(times),
        "packs": len(plan),
        "efficiency": plan.efficiency,
        "mean_docs_per_pack": float(plan.num_docs_P.mean()),
    }


def replan_rows(n: int) -> list[dict]:
    """Fill of a plan re-made every epoch in shuffled windows, against the fixed plan."""
    from packing.planning import PackedBatchSampler

    rows = []
    for kind in ["seed_like", "uniform_tokens", "long_tailed"]:
        all_lengths = lengths_for(kind, n)
        median = float(np.median(all_lengths))
        for mult in (4, 8):
            budget = int(-(-mult * median // 128) * 128)
            lengths = np.minimum(all_lengths, budget)
            fixed = plan_packs(lengths, budget).efficiency
            for window in (16_384, 4_096):
                s = PackedBatchSampler(lengths, budget, replan=True, replan_window=window)
                effs, secs = [], []
                for epoch in range(3):
                    t0 = time.perf_counter()
                    packs = s.replan_packs(epoch)
                    secs.append(time.perf_counter() - t0)
                    effs.append(float(lengths.sum()) / (len(packs) * budget))
                rows.append({"lengths": kind, "budget": budget, "x_median": mult, "n": n,
                             "window": window, "fixed_efficiency": fixed,
                             "replan_efficiency": float(np.mean(effs)),
                             "replan_efficiency_per_epoch": effs,
                             "seconds_per_epoch": statistics.median(secs)})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,100000,1000000", help="episode counts")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--ffd-n", type=int, default=200_000, help="FFD scans all packs per run")
    ap.add_argument("--before-n", type=int, default=100_000, help="largest n for 'before'")
    ap.add_argument("--sweep-n", type=int, default=100_000, help="episodes in the budget sweep")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "planner.json"))
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    rows = []
    for n_all in sizes:
        for kind in ["seed_like", "uniform_tokens", "long_tailed"]:
            all_lengths = lengths_for(kind, n_all)
            median = float(np.median(all_lengths))
            for mult in (4, 8):
                budget = int(-(-mult * median // 128) * 128)  # >= mult x median, multiple of 128
                lengths = np.minimum(all_lengths, budget)  # long tail: clip, this is packing
                for algorithm in ALGORITHMS:
                    if algorithm == "ffd" and n_all > args.ffd_n:
                        continue
                    if algorithm == "lookahead (before)" and n_all > args.before_n:
                        continue
                    r = time_plan(lengths, budget, algorithm, args.repeats)
                    rows.append({"lengths": kind, "budget": budget, "x_median": mult,
                                 "n": n_all, "algorithm": algorithm, **r})  # fmt: skip
                pad = float(lengths.mean() / lengths.max())
                rows.append({"lengths": kind, "budget": budget, "x_median": mult, "n": n_all,
                             "algorithm": "pad_to_longest", "efficiency": pad,
                             "episodes_per_s": None, "packs": None})  # fmt: skip
    print(
        "| episodes | lengths | budget (x median) | algorithm | M episodes/s (median, best) "
        "| p90 / median | efficiency | packs | vs before |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        speed = (
            "—"
            if r["episodes_per_s"] is None
            else f"{r['episodes_per_s'] / 1e6:.2f}, {r['episodes_per_s_best'] / 1e6:.2f}"
        )
        packs = "—" if r["packs"] is None else f"{r['packs']:,}"
        spread = "—" if r["episodes_per_s"] is None else f"{r['p90_over_median']:.2f}"
        before = next((b for b in rows if b["algorithm"] == "lookahead (before)" and
                       (b["lengths"], b["x_median"], b["n"]) ==
                       (r["lengths"], r["x_median"], r["n"])), None)  # fmt: skip
        vs = (
            f"{r['episodes_per_s'] / before['episodes_per_s']:.2f}x"
            if before is not None and r["algorithm"] == "lookahead"
            else ""
        )
        print(f"| {r['n']:,} | {r['lengths']} | {r['budget']:,} ({r['x_median']}x) | "
              f"{r['algorithm']} | {speed} | {spread} | {100 * r['efficiency']:.2f}% | {packs} "
              f"| {vs} |")  # fmt: skip
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
    replan = replan_rows(args.sweep_n)
    print(f"\nRe-planning every epoch (PackedBatchSampler(replan=True)), {args.sweep_n:,} "
          "episodes, epochs 0-2:\n")  # fmt: skip
    print("| lengths | budget (x median) | fixed plan | window | re-planned (mean of 3 epochs) "
          "| fill cost | s per epoch |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in replan:
        print(f"| {r['lengths']} | {r['budget']:,} ({r['x_median']}x) | "
              f"{100 * r['fixed_efficiency']:.2f}% | {r['window']:,} | "
              f"{100 * r['replan_efficiency']:.2f}% | "
              f"{100 * (r['fixed_efficiency'] - r['replan_efficiency']):.2f} pt | "
              f"{r['seconds_per_epoch']:.2f} |")  # fmt: skip
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
        "replan": replan,
    }
    harness.write_doc(args.out, result)
    print(f"\nwrote {args.out}  ({result['machine']}, numpy {np.__version__}, {result['date']})")


if __name__ == "__main__":
    main()
