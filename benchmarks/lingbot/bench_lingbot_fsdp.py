"""LingBot-VA under FSDP2 on 2 or 8 GPUs: packed vs LeRobot's path vs the best per-episode loop.

LeRobot's LingBot-VA transformer (`bench_lingbot.py`'s model, arms and episodes), every block
its own ``fully_shard`` unit plus the root, bf16 parameters, activation checkpointing on
every block; each rank trains its own episodes (the seed regime, one ``--budget`` of model
tokens a rank a step), the same on every arm:

* ``lerobot``: one episode per micro-step, accumulation, FSDP2's defaults (parameters
  resharded after every forward and backward, gradients reduce-scattered every micro-step).
* ``lean``: one episode per micro-step, the compiled lean loop, no resharding and no gradient
  sync between micro-steps (``set_reshard_after_backward(False)``,
  ``set_requires_gradient_sync(False)`` until the last): the best an unpacked loop does.
* ``packed``: the rank's episodes in one pack, one forward and backward a step.

Reported per arm (rank 0 prints, every rank measures): seconds a step (median), tokens/s per
GPU, MFU on the counted FLOPs, collective calls a step (all-gather, reduce-scatter,
all-reduce, counted at ``torch.distributed``), peak memory, the first step's loss (the
all-reduced mean over ranks; the same on every arm up to bf16 noise).

    torchrun --nproc-per-node 8 benchmarks/lingbot/bench_lingbot_fsdp.py --out /tmp/fsdp8
    torchrun --nproc-per-node 2 benchmarks/lingbot/bench_lingbot_fsdp.py --smoke   # CPU, gloo
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import harness
from benchmarks.harness import LingbotEpisode, lingbot_flops
from benchmarks.lingbot import bench_lingbot as bl
from benchmarks.lingbot import common as lb

COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
CALLS: Counter[str] = Counter()


def count_collectives() -> None:
    """Count every call FSDP2 (and the loss) makes through ``torch.distributed``."""
    for name in COLLECTIVES:
        fn = getattr(dist, name)

        def counted(*a: Any, _fn: Any = fn, _name: str = name, **k: Any) -> Any:
            CALLS[_name] += 1
            return _fn(*a, **k)

        setattr(dist, name, counted)


def shard(arm: bl.Arm, dev: torch.device) -> None:
    """FSDP2 over the arm's model: each block a unit, then the root (the module whose
    ``forward`` the step calls: the transformer for LeRobot's path, the loss module or the
    integration's `PackedLingBotVA` otherwise); a fresh optimizer over the sharded parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in arm.model.blocks:
        fully_shard(blk, mp_policy=mp)
    arm.root = fully_shard(getattr(arm, "loss_module", arm.model), mp_policy=mp)
    arm.opt = torch.optim.AdamW(arm.model.parameters(), lr=1e-5, fused=dev.type == "cuda")


class LeanNoReshard(bl.LeanArm):
    name = "lean"

    def before_episode(self, *, last: bool) -> None:
        # accumulate locally; sync gradients and reshard only after the last episode
        self.root.set_requires_gradient_sync(last)
        self.root.set_reshard_after_backward(last)


def make(name: str, args: Any, state: dict[str, Any], blocks: int, dev: torch.device,
         hw: tuple[int, int], budget: int, max_docs: int) -> bl.Arm:  # fmt: skip
    cfg = lb.TINY if args.smoke else lb.WAN_5B
    model = lb.build_model(cfg, blocks, dev, args.seed)
    model.load_state_dict(state)
    arm: bl.Arm
    if name == "lerobot":
        arm = bl.LeRobotArm(args, model, dev, hw)
    elif name == "lean":
        arm = LeanNoReshard(args, model, dev, hw)
    elif name == "packed":
        arm = bl.PackedLingbotArm(args, model, dev, hw, budget=budget, max_docs=max_docs)
    else:
        arm = bl.PackedBenchArm(args, model, dev, hw, budget=budget, max_docs=max_docs)
    shard(arm, dev)
    return arm


def run(arm: bl.Arm, steps: list[list[lb.Episode]], warmup: int) -> dict[str, Any]:
    dev = arm.dev
    prepared = [arm.prepare(eps) for eps in steps]
    ms, losses, calls = [], [], []
    for s, eps in enumerate(steps):
        if s == warmup and dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        CALLS.clear()
        harness.sync(dev)
        t0 = time.perf_counter()
        loss = arm.step(eps, prepared[s])
        arm.finish()
        harness.sync(dev)
        dist.barrier()
        if s >= warmup:
            ms.append((time.perf_counter() - t0) * 1e3)
            calls.append(dict(CALLS))
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
    return {"ms": ms, "losses": losses, "calls": calls[-1] if calls else {},
            "peak GB": torch.cuda.max_memory_allocated() / 1e9 if dev.type == "cuda" else 0.0}  # fmt: skip


def row(name: str, arm: bl.Arm, res: dict[str, Any], steps: list[list[lb.Episode]], warmup: int,
        blocks: int, hw: tuple[int, int]) -> dict[str, Any]:  # fmt: skip
    world = dist.get_world_size()
    timed = steps[warmup:]
    tokens = torch.tensor(float(sum(lb.tokens_of(eps, hw) for eps in timed)))
    flops_local = lingbot_flops({**arm.cfg, "num_layers": blocks},
                                [LingbotEpisode(**s) for eps in timed
                                 for s in lb.useful_shapes(eps, hw)]).model  # fmt: skip
    both = torch.tensor([float(tokens), flops_local], dtype=torch.float64)
    dist.all_reduce(both)
    t = harness.summarize(res["ms"])
    seconds = sum(res["ms"]) * 1e-3
    return {
        "gpus": world, "blocks": blocks, "arm": name,
        "micro-steps/step": 1.0 if name.startswith("packed") else len(timed[0]),
        "s/step": t.median_ms / 1e3,
        "p10-p90 s": f"{t.p10_ms / 1e3:.2f}-{t.p90_ms / 1e3:.2f}",
        "tokens/s per GPU": float(both[0]) / seconds / world,
        **harness.mfu(float(both[1]), seconds, gpus=world),
        "collectives/step": sum(res["calls"].values()),
        "collective calls": res["calls"],
        "peak GB": res["peak GB"],
        "first loss": res["losses"][0],
        "losses": res["losses"],
    }  # fmt: skip


def main() -> None:
    p = harness.base_parser(__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, CPU, gloo")
    p.add_argument("--blocks", type=int, default=30)
    p.add_argument(
        "--arms",
        default="packed,lerobot,lean",
        help="packed (the integration), packed_bench, lerobot, lean",
    )
    p.add_argument("--budget", type=int, default=73728, help="model tokens a rank a step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args()
    if args.smoke:
        args.device, args.quick, args.blocks, args.steps, args.warmup = "cpu", True, 2, 2, 1
    if args.out and not args.out.endswith(".json"):
        args.out = str(Path(args.out) / "lingbot_va_fsdp.json")
    on_gpu = args.device == "cuda"
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if on_gpu
        else torch.device("cpu")
    )
    if on_gpu:
        torch.cuda.set_device(dev)
    count_collectives()
    hw = lb.TINY_HW if args.smoke else lb.LATENT_HW
    cfg = lb.TINY if args.smoke else lb.WAN_5B
    budget, max_docs = bl.regime_sizes(args, "seed") if not args.smoke else (384, 4)
    args.seed_rank = args.seed + 1000 * rank  # each rank its own episodes
    draw_args = type("A", (), {"seed": args.seed_rank, "smoke": args.smoke})()
    steps = bl.draw_steps(
        draw_args, "seed", cfg, hw, args.warmup + args.steps, budget, max_docs, dev
    )
    # every rank runs the same number of micro-steps (FSDP's collectives pair up across ranks)
    counts = torch.tensor([len(eps) for eps in steps], dtype=torch.int64)
    dist.all_reduce(counts, op=dist.ReduceOp.MIN)
    steps = [eps[: int(n)] for eps, n in zip(steps, counts, strict=True)]
    state = bl._initial_state(cfg, args.blocks, dev, args.seed)  # the same weights everywhere
    args.seed = args.seed_rank  # the seed this rank's episodes were drawn with (the draws' key)
    rows = []
    for name in args.arms.split(","):
        try:
            arm = make(name, args, state, args.blocks, dev, hw, budget, max_docs)
            if isinstance(arm, bl.LeanArm):
                arm.probe(steps)
            res = run(arm, steps, args.warmup)
            rows.append(row(arm.name, arm, res, steps, args.warmup, args.blocks, hw))
            del arm
        except Exception as e:  # one failed arm must not lose the others
            if rank == 0:
                traceback.print_exc()
            rows.append(
                {"gpus": world, "arm": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            )
        bl._free(dev)
    for r in rows:
        base = next((b for b in rows if b["arm"] == "lerobot" and "error" not in b), None)
        if base and "error" not in r:
            r["vs lerobot"] = r["tokens/s per GPU"] / base["tokens/s per GPU"]
            r["loss rel diff"] = abs(r["first loss"] - base["first loss"]) / abs(base["first loss"])
    if rank == 0:
        cols = ["gpus", "blocks", "arm", "micro-steps/step", "s/step", "p10-p90 s",
                "tokens/s per GPU", "vs lerobot", "MFU of measured 790", "collectives/step",
                "peak GB", "first loss", "loss rel diff", "error"]  # fmt: skip
        table = harness.markdown_table(rows, cols)
        print(table)
        path = harness.write_json("lingbot_va_fsdp", args, {"rows": rows}, device=dev)
        path.with_suffix(".md").write_text(table + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
