"""How full a step's packs are over an epoch, by what defines the step (planner only, CPU).

The seed and short length distributions of bench_step (episodes of 144-336 / 10-79 frames,
33 joint tokens a frame: 32 video + 1 action), one epoch of ``--episodes`` episodes:

* ``fixed count``: K episodes a step (16 seed, 64 short) in a static budget that holds the
  longest K-step of the epoch (first-fit into as few budget-sized packs as it takes): the way
  a step is defined without packing in mind. Its empty tail is what the dense layers pay for.
* ``composed, episode count``: `compose_steps(episodes_per_step=K)`: one budget from
  ``K * mean``, packs kept >= 97% full, the count per step varies.
* ``composed, time budget``: `compose_steps(step_seconds=S)` with a linear cost model
  (``--seconds-per-token``, ``--seconds-per-pair``); S is the fixed-count step's expected time.
* ``composed, token budget``: `compose_steps(token_budget=B)` with bench_step's budgets.
* ``sampler, episode count, replan``: `PackedBatchSampler(episodes_per_step=K, replan=True)`,
  two epochs, what a training loop gets.

Reported per row: packs, episodes per step (mean, min, max), mean fill, the lowest fill but
the epoch's last pack, and the fraction of packs >= 97% full.

    python benchmarks/step/bench_step_fill.py              # ~10 s
    python benchmarks/step/bench_step_fill.py --quick
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import harness
from packing.planning import PackedBatchSampler, compose_steps, pack_fill

TOKENS_PER_FRAME = 33  # 32 video tokens (4 x 8 grid) + 1 action
REGIMES = {  # frames min, max; episodes a step; bench_step's token budget
    "seed": (144, 336, 16, 65536),
    "short": (10, 79, 64, 49152),
}


def row(regime: str, how: str, packs: list[list[int]], lengths: np.ndarray,
        budget: int, windows: int = 1) -> dict[str, Any]:  # fmt: skip
    fill = pack_fill(packs, lengths, budget)
    eps = np.fromiter(map(len, packs), dtype=np.int64, count=len(packs))
    body = np.sort(fill)[windows:]  # all but the last pack of each planned window
    return {
        "regime": regime,
        "step defined by": how,
        "token budget": budget,
        "packs": len(packs),
        "episodes/step": float(eps.mean()),
        "eps min-max": f"{eps.min()}-{eps.max()}",
        "fill mean": float(fill.mean()),
        "fill min (but last)": float(body.min()) if len(body) else 1.0,
        "packs >= 97%": float((fill >= 0.97).mean()),
        "episodes": int(eps.sum()),
    }


def fixed_count(lengths: np.ndarray, k: int, rng: np.random.Generator) -> tuple[list, int]:
    """K shuffled episodes a step; the static budget holds the epoch's heaviest step."""
    order = rng.permutation(len(lengths))
    steps = [order[i : i + k] for i in range(0, len(order), k)]
    budget = -(-int(max(lengths[s].sum() for s in steps)) // 128) * 128
    return [s.tolist() for s in steps], budget


def main() -> None:
    p = harness.base_parser(__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=20_000, help="episodes in the epoch")
    p.add_argument("--seconds-per-token", type=float, default=1 / 135_000,
                   help="cost model: a lean 4-block loop's ~135K tokens/s")  # fmt: skip
    p.add_argument("--seconds-per-pair", type=float, default=0.0)
    args = p.parse_args()
    n = 2_000 if args.quick else args.episodes
    rows: list[dict[str, Any]] = []
    for regime, (fmin, fmax, k, budget) in REGIMES.items():
        rng = np.random.default_rng([args.seed, len(regime)])
        lengths = rng.integers(fmin, fmax + 1, n) * TOKENS_PER_FRAME
        steps, fixed_budget = fixed_count(lengths, k, rng)
        rows.append(row(regime, f"fixed count {k}", steps, lengths, fixed_budget))
        plan = compose_steps(lengths, episodes_per_step=k)
        rows.append(row(regime, f"composed, {k} episodes", plan.packs, lengths, plan.token_budget))
        seconds = fixed_budget * args.seconds_per_token  # the fixed-count step's time
        plan = compose_steps(lengths, step_seconds=seconds,
                             seconds_per_token=args.seconds_per_token,
                             seconds_per_pair=args.seconds_per_pair)  # fmt: skip
        rows.append(row(regime, f"composed, {seconds:.3f} s", plan.packs, lengths,
                        plan.token_budget))  # fmt: skip
        plan = compose_steps(lengths, token_budget=budget)
        rows.append(row(regime, f"composed, {budget} tokens", plan.packs, lengths, budget))
        window = 4096
        sampler = PackedBatchSampler(lengths, episodes_per_step=k, replan=True,
                                     replan_window=window, seed=args.seed)  # fmt: skip
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            got = list(sampler)
            assert sorted(i for q in got for i in q) == list(range(n))  # exactly once
            rows.append(row(regime, f"sampler, {k} episodes, replan, epoch {epoch}", got,
                            lengths, sampler.plan.token_budget, windows=-(-n // window)))  # fmt: skip
        for r in rows[-6:]:
            print(r, flush=True)
    cols = ["regime", "step defined by", "token budget", "packs", "episodes/step",
            "eps min-max", "fill mean", "fill min (but last)", "packs >= 97%"]  # fmt: skip
    print(harness.markdown_table(rows, cols))
    harness.write_json("step_fill", args, {"rows": rows, "episodes": n})


if __name__ == "__main__":
    main()
