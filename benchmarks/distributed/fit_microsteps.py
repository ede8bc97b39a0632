"""Fit §6's per-micro-step cost from bench_fsdp.py runs and re-predict 4 and 8 GPUs.

    python benchmarks/distributed/fit_microsteps.py SWEEP.json REGIME.json [--out fit.json]

SWEEP.json: ``bench_fsdp.py --sweep 1,2,4,8`` (the same episodes in exactly M packs, gradient
reduce-scatter on every micro-step): least squares of ``step = a + M * x`` gives ``x``, what a
micro-step costs beyond its compute under FSDP. REGIME.json: a run with the ``unpacked_sync``
and ``packed`` rows (same episodes, same weights). With E = 16 episodes per GPU per step::

    unpacked_sync(N) = E * c * s(N) + E * x_N        s(N): the wait for the slowest of N ranks'
    packed(N)        = E * c / g   + M * x_N          episodes, E[max of N] / E[mean] of the
                                                      regime's lengths (Monte Carlo), 1 packed
c (compute per episode) and g (packing's compute gain) come from the 2-GPU rows; ``x_N`` is
either the measured x (NVLink collectives inside one host, bandwidth-bound: nearly flat in N)
or x scaled by the ring factor ((N - 1) / N) / (1 / 2), both printed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import harness

REGIMES = {"seed": (144, 336), "short": (10, 79)}


def straggler(regime: str, n: int, draws: int = 20000) -> float:
    """E[max of n episode lengths] / E[length] for the regime's uniform frame counts."""
    lo, hi = REGIMES[regime]
    rng = random.Random(0)
    mean = (lo + hi) / 2
    return sum(max(rng.randint(lo, hi) for _ in range(n)) for _ in range(draws)) / draws / mean


def fit_x(sweep: dict) -> tuple[float, float, list[tuple[int, float]]]:
    pts = [(int(r["micro-steps"]), r["s/step"]) for r in sweep["rows"]
           if "s/step" in r and str(r["variant"]).startswith("packed M=")]  # fmt: skip
    if len(pts) < 2:
        raise SystemExit(f"need >= 2 sweep rows with s/step, got {pts}")
    a = torch.tensor([[1.0, m] for m, _ in pts], dtype=torch.float64)
    y = torch.tensor([[t] for _, t in pts], dtype=torch.float64)
    a0, x = torch.linalg.lstsq(a, y).solution[:, 0].tolist()
    return a0, x, pts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sweep")
    p.add_argument("regime_run")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    sweep = json.loads(Path(args.sweep).read_text())
    run = json.loads(Path(args.regime_run).read_text())
    a0, x, pts = fit_x(sweep)
    rows = {r["variant"]: r for r in run["rows"] if "s/step" in r}
    regime, w = run["args"]["regime"], run["world_size"]
    e = run["args"]["episodes_per_gpu"]
    u, pk = rows["unpacked_sync"], rows["packed"]
    c = (u["s/step"] - e * x) / (e * straggler(regime, w))
    c_g = (pk["s/step"] - pk["micro-steps"] * x) / e
    print(f"fit over M = {[m for m, _ in pts]}: step = {a0:.3f} s + M x {x:.3f} s")
    print(f"{regime}, {w} GPUs: c = {c:.3f} s/episode, g = {c / c_g:.2f}")
    out = {"command": " ".join(["python", *sys.argv]), "inputs": [args.sweep, args.regime_run],
           "a": a0, "x": x, "points": pts, "c": c, "g": c / c_g, "predictions": []}  # fmt: skip
    print("| GPUs | x model | unpacked_sync s | packed s | packed gain |\n|---|---|---|---|---|")
    for n in (2, 4, 8):
        for name, xn in (("flat", x), ("ring", x * ((n - 1) / n) / 0.5)):
            tu = e * c * straggler(regime, n) + e * xn
            tp = e * c_g + pk["micro-steps"] * xn
            out["predictions"].append({"gpus": n, "x": name, "unpacked": tu, "packed": tp})
            print(f"| {n} | {name} ({xn:.3f} s) | {tu:.2f} | {tp:.2f} | {tu / tp:.2f}x |")
    if args.out:
        harness.write_doc(args.out, out)


if __name__ == "__main__":
    main()
