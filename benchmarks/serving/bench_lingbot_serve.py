"""LingBot-VA served to many robots: LeRobot's policy one robot at a time vs the packed server.

LeRobot's ``LingBotVAPolicy`` keeps one robot's KV cache inside its transformer, so a GPU
serves robots one chunk at a time; `LingBotVAEngine` packs every robot's denoising steps
into one model call (each robot's cache a region of its pool). Both run the same random-init
transformer at Wan2.2-5B widths (24 heads x 128, FFN 14336, 30 blocks, bf16), LIBERO's
geometry (two 128x128 cameras: 8 x 16 latents, 4 latent frames and 16 actions a chunk) and
LingBot-VA's schedule: 20 video steps with guidance (the unconditional row in the pack) then
50 action steps; and ``video_exec_step`` shortened (``--exec-step``). The VAE and the text
encoder are not timed (they run once per observation / per prompt, outside the packed steps,
in both systems alike).

Rows: one robot alone through LeRobot (``predict_action_chunk`` chunk after chunk: its
chunk time; N robots served one at a time then wait up to N chunk times, derived as such),
optionally the same with LeRobot's blocks compiled (``--compiled-baseline``: what a careful
user adds), and the packed engine with N = 1, 4, 8, 16 robots in a closed loop (each robot
asks for its next chunk as soon as it has the last): chunk latency p50/p99 (submit to
result), chunks/s over all robots, peak memory; robots an H200 serves within
``--budget-ms`` p99; the issue's two goals at 8 robots. Robot 0 of every packed run is the
alone arms' episode with their seeds, so each run also reports how far its actions are
from LeRobot's (``agreement``; the noise is drawn alike on any device).

    python benchmarks/serving/bench_lingbot_serve.py --smoke          # CPU, tiny, seconds
    # one H200, two calls (each meant to fit a 10-minute call; rows are checkpointed as
    # they finish; lerobot and transformers travel as wheels):
    python benchmarks/serving/bench_lingbot_serve.py --schedules own --cuda-graphs \
        --compiled-baseline --out bench_lingbot_serve_own_h200.json
    python benchmarks/serving/bench_lingbot_serve.py --schedules short --cuda-graphs \
        --out bench_lingbot_serve_short_h200.json
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness.results import base_parser, markdown_table, write_json
from benchmarks.harness.timing import sync

WAN_5B = dict(num_attention_heads=24, attention_head_dim=128, ffn_dim=14336, num_layers=30,
              text_dim=4096, freq_dim=256, action_dim=30)  # fmt: skip
LIBERO = dict(height=128, width=128, frame_chunk_size=4, action_per_frame=4, attn_window=30,
              num_inference_steps=20, action_num_inference_steps=50, guidance_scale=5.0)  # fmt: skip
SMOKE = dict(num_inference_steps=2, action_num_inference_steps=3, frame_chunk_size=2,
             action_per_frame=2, attn_window=4)  # fmt: skip


def build_policy(smoke: bool, exec_step: int, device: str, dtype: str = "bfloat16") -> Any:
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.lingbot_va.configuration_lingbot_va import LingBotVAConfig
    from lerobot.policies.lingbot_va.modeling_lingbot_va import LingBotVAPolicy

    if smoke:
        from packing.integrations.lingbot_va.testing import tiny_policy

        torch.manual_seed(0)
        return tiny_policy(attn_mode="torch", video_exec_step=exec_step, **SMOKE)
    cams = ["observation.images.image", "observation.images.image2"]
    visual = PolicyFeature(type=FeatureType.VISUAL, shape=(3, 128, 128))
    cfg = LingBotVAConfig(**WAN_5B, **LIBERO, attn_mode="torch", dtype=dtype,
                          video_exec_step=exec_step, obs_cam_keys=cams, device=device,
                          input_features={k: visual for k in cams})  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):  # 5B parameters initialised where they run, not on the host
        return LingBotVAPolicy(cfg).eval()


def _episode(
    policy: Any, robot: int, chunks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg, (H, W) = policy.config, policy._latent_hw
    g = torch.Generator().manual_seed(robot)
    frames = torch.randn(1 + chunks * cfg.frame_chunk_size, 48, H, W, generator=g)
    text = torch.randn(cfg.max_sequence_length, cfg.text_dim, generator=g)
    return frames, text, torch.zeros(cfg.max_sequence_length, cfg.text_dim)


def lerobot_alone(
    policy: Any, chunks: int, device: str, *, compiled: bool
) -> tuple[list[float], list[torch.Tensor]]:
    """One robot through LeRobot's policy, chunk after chunk: each chunk's milliseconds and
    its actions. ``compiled``: each transformer block under ``torch.compile(dynamic=True)``
    first, what a careful user adds (LeRobot's attention syncs to gather its cache's valid
    rows, so the blocks break there and the key length varies)."""
    from packing.integrations.lingbot_va._serve_reference import ReferenceRobot

    if compiled:
        torch._dynamo.config.recompile_limit = max(64, torch._dynamo.config.recompile_limit)
        for block in policy.transformer.blocks:
            block.compile(dynamic=True)
    F_ = policy.config.frame_chunk_size
    frames, text, neg = _episode(policy, 0, chunks)
    robot = ReferenceRobot(policy, text.to(device), neg.to(device))
    ms, actions = [], []
    try:
        for k in range(chunks):
            fb = frames[:1] if k == 0 else frames[(k - 1) * F_ : k * F_]
            sync(device)
            t0 = time.perf_counter()
            _, _, act = robot.chunk(fb.to(device), None, k)  # (steps, used channels)
            sync(device)
            ms.append((time.perf_counter() - t0) * 1e3)
            actions.append(act.float().cpu())
    finally:
        for block in policy.transformer.blocks:  # the next arm runs the same blocks eager
            block._compiled_call_impl = None
    return ms, actions


PACKS = {
    "phase": "phase_shapes, the engine's default",
    "loops": "each loop alone and one mixed shape (2026-12-05's default)",
    "mixed": "one mixed shape (the first GPU run, 2026-12-05)",
}


def pack_shapes(packs: str, robots: int) -> list[Any] | None:
    """The shapes of a ``packs`` choice (`PACKS`) for ``robots`` robots (None: the default)."""
    from packing.integrations.lingbot_va._serve_packs import LingShape

    if packs not in PACKS:
        raise ValueError(f"packs={packs!r}; use one of {sorted(PACKS)}")
    n = robots
    return {"phase": None, "mixed": [LingShape(video=n, action=n)],
            "loops": [LingShape(video=n, action=0), LingShape(video=0, action=n),
                      LingShape(video=n, action=n)]}[packs]  # fmt: skip


def packed(policy: Any, robots: int, chunks: int, warm: int, cuda_graphs: bool,
           packs: str = "phase", stagger: bool = False) -> dict[str, Any]:  # fmt: skip
    """``robots`` robots in a closed loop through `LingBotVAEngine`; the first ``warm``
    chunks of each robot are not timed. Robot 0's episode and seeds are the alone arms'.
    ``packs``: a key of `PACKS` (`pack_shapes`). ``stagger``:
    robot r joins after r/robots of a chunk's steps, so the robots stay out of step (some in
    their video loop while others are in their action loop) instead of in lockstep."""
    from packing.integrations.lingbot_va._serve import LingBotVAEngine
    from packing.integrations.lingbot_va._serve_request import ChunkRequest

    F_ = policy.config.frame_chunk_size
    engine = LingBotVAEngine(policy, robots=robots, shapes=pack_shapes(packs, robots),
                             cuda_graphs=cuda_graphs)  # fmt: skip
    t0 = time.perf_counter()
    warm_stats = engine.warm_up()
    warm_s = time.perf_counter() - t0
    eps = [_episode(policy, r, chunks + warm) for r in range(robots)]
    nxt, sent, lat_ms, robot0 = [0] * robots, {}, [], []
    t_start: float | None = None
    done = warm_done = 0

    def submit(r: int) -> None:
        frames, text, neg = eps[r]
        k = nxt[r]
        req = ChunkRequest(session=f"robot{r}", frames=frames[: max(1, k * F_)], actions=None,
                           prompt=text, negative=neg, seed=k)  # fmt: skip
        sent[engine.submit(req)] = (r, time.perf_counter())

    c = policy.config
    video = c.num_inference_steps if c.video_exec_step == -1 else c.video_exec_step
    spacing = (video + c.action_num_inference_steps) // robots if stagger else 0
    joined = 0
    while joined < robots or engine.active or engine.waiting:
        while joined < robots and (
            engine.clock >= joined * spacing  # engine steps, not clocks
            or not (engine.active or engine.waiting)
        ):
            submit(joined)
            joined += 1
        for res in engine.step():
            r, t0 = sent.pop(res.request_id)
            if res.error is not None:
                raise RuntimeError(f"robot {r}: {res.error}")
            if r == 0:
                robot0.append(res.action.float().cpu())
            if nxt[r] >= warm:
                lat_ms.append((time.perf_counter() - t0) * 1e3)
                done += 1
            else:
                warm_done += 1
                if warm_done == robots * warm:  # chunks/s counts from here
                    t_start = time.perf_counter()
            nxt[r] += 1
            if nxt[r] < chunks + warm:
                submit(r)
    wall = time.perf_counter() - (t_start or time.perf_counter())
    return {"latency_ms": lat_ms, "chunks": done, "wall_s": wall, "warm_up": warm_stats,
            "warm_up_s": warm_s, "stats": engine.stats, "robot0_actions": robot0}  # fmt: skip


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def alone_rows(label: str, server: str, ms: list[float], robots: list[int]) -> list[dict]:
    """One robot at a time: one robot's measured chunk times (always a row, the base of
    every ratio); N robots wait up to N of them (derived, as the server runs one chunk after
    another)."""
    t = percentile(ms, 0.5)
    return [{"schedule": label, "server": server, "robots": n, "p50_ms": t * n,
             "p99_ms": percentile(ms, 0.99) * n, "chunks_per_s": 1e3 / t, "derived": n > 1}
            for n in sorted({1, *robots})]  # fmt: skip


def differs(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest |difference| of two robots' action chunks, chunk by chunk."""
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=False))


def goals(rows: list[dict], label: str) -> dict[str, Any]:
    """The issue's goals at 8 robots on ``label``'s schedule, from the rows."""

    def row(server: str, n: int) -> dict | None:
        return next((r for r in rows if r["schedule"] == label and r["server"] == server
                     and r["robots"] == n), None)  # fmt: skip

    base, fast, apart = row(EAGER, 1), row(PACKED, 8), row(PACKED_STAGGERED, 8)
    if base is None or fast is None:
        return {}
    ratio = fast["chunks_per_s"] / base["chunks_per_s"]
    out = {"packed_x_lerobot_at_8": ratio, "met_4x": ratio >= 4.0,
           "packed_p99_ms_at_8": fast["p99_ms"], "lerobot_alone_p99_ms": base["p99_ms"],
           "met_p99": fast["p99_ms"] <= base["p99_ms"]}  # fmt: skip
    if apart is not None:  # the same goals with the robots out of step
        out |= {"out_of_step_x_lerobot_at_8": apart["chunks_per_s"] / base["chunks_per_s"],
                "out_of_step_p99_ms_at_8": apart["p99_ms"]}  # fmt: skip
    return out


EAGER, COMPILED, PACKED, PACKED_MIXED, PACKED_STAGGERED = (
    "LeRobot, one robot at a time",
    "LeRobot blocks compiled, one robot at a time",
    "packed (LingBotVAEngine)",
    "packed, one mixed pack shape",
    "packed, robots out of step",
)


def run_schedule(args: Any, exec_step: int, rows: list[dict], checks: dict) -> None:
    """Every arm on one schedule (``exec_step`` -1: LingBot-VA's own), rows appended as they
    finish (and checkpointed: a run cut at its limit keeps them)."""
    policy = build_policy(args.smoke, exec_step, args.device, args.dtype)
    c = policy.config
    video = f"{c.num_inference_steps}+1" if exec_step == -1 else f"exec_step {exec_step}"
    label = f"video {video}, action {c.action_num_inference_steps}"
    n = args.chunks + args.warm
    ms, alone = lerobot_alone(policy, n, args.device, compiled=False)
    rows += alone_rows(label, EAGER, ms[args.warm :], args.robots)
    _checkpoint(args, rows, checks)
    arms = [(PACKED, args.packs, False, r, "") for r in args.robots]
    arms += [(PACKED_STAGGERED, "phase", True, r, "out_of_step_") for r in args.stagger_robots]
    arms += [(PACKED_MIXED, "mixed", False, r, "mixed_") for r in args.mixed_robots]
    for server, packs, stagger, robots, tag in arms:
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        run = packed(policy, robots, args.chunks, args.warm, args.cuda_graphs, packs, stagger)
        lat = run["latency_ms"]
        rows.append({"schedule": label, "server": server, "robots": robots, "packs": packs,
                     "p50_ms": percentile(lat, 0.5), "p99_ms": percentile(lat, 0.99),
                     "chunks_per_s": run["chunks"] / max(run["wall_s"], 1e-9), "derived": False,
                     "warm_up": run["warm_up"], "warm_up_s": run["warm_up_s"],
                     "stats": run["stats"], "peak_gib": _peak_gib(args.device)})  # fmt: skip
        # robot 0 is the alone arms' episode with their seeds: the same chunks, packed
        checks.setdefault(label, {})[f"robot0_vs_lerobot_{tag}at_{robots}"] = differs(
            run["robot0_actions"], alone
        )
        _checkpoint(args, rows, checks)
    if args.compiled_baseline:
        t0 = time.perf_counter()
        ms_c, compiled = lerobot_alone(policy, n, args.device, compiled=True)
        rows += alone_rows(label, COMPILED, ms_c[args.warm :], args.robots)
        checks[label]["compiled_vs_eager_lerobot"] = differs(compiled, alone)
        checks[label]["compiled_arm_s"] = time.perf_counter() - t0
        _checkpoint(args, rows, checks)
    del policy
    if args.device == "cuda":
        torch.cuda.empty_cache()


def _peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def _checkpoint(args: Any, rows: list[dict], checks: dict) -> None:
    write_json("bench_lingbot_serve", args, {"rows": rows, "agreement": checks},
               device=args.device, partial=True)  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true",
                   help="CPU, tiny LeRobot policy, seconds (--quick too; CUDA graphs off)")  # fmt: skip
    p.add_argument("--robots", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--chunks", type=int, default=8, help="timed chunks a robot")
    p.add_argument("--warm", type=int, default=2, help="untimed chunks a robot first")
    p.add_argument("--exec-step", type=int, default=5,
                   help="the shortened video_exec_step row (LingBot-VA's config option)")  # fmt: skip
    p.add_argument("--schedules", choices=["both", "own", "short"], default="both",
                   help="LingBot-VA's own schedule, the shortened one, or both (two calls)")  # fmt: skip
    p.add_argument("--budget-ms", type=float, default=1000.0, help="p99 control budget")
    p.add_argument("--cuda-graphs", action="store_true", help="capture the packed steps")
    p.add_argument("--mixed-robots", type=int, nargs="*", default=[],
                   help="also these robot counts with one mixed pack shape (the A/B)")  # fmt: skip
    p.add_argument("--stagger-robots", type=int, nargs="*", default=[],
                   help="also these robot counts out of step: robot r joins r/N of a chunk's "
                        "steps after robot 0 (default packs)")  # fmt: skip
    p.add_argument("--packs", choices=sorted(PACKS), default="phase",
                   help="the engine's pack shapes: " + "; ".join(f"{k}: {v}" for k, v in
                                                                 PACKS.items()))  # fmt: skip
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="the 5B model's dtype (float32: robot 0's agreement with LeRobot at "
                        "full precision)")  # fmt: skip
    p.add_argument("--compiled-baseline", action="store_true",
                   help="also LeRobot's policy with its blocks compiled, one robot at a time")  # fmt: skip
    args = p.parse_args(argv)
    if args.smoke or args.quick:  # --quick (benchmarks/gpu.sh QUICK=1) is the smoke run
        if args.cuda_graphs:
            print("--smoke runs on the CPU: --cuda-graphs is dropped")
        args.smoke, args.quick, args.device, args.cuda_graphs = True, True, "cpu", False
        args.robots, args.chunks, args.warm = [1, 2], 2, 1
        args.stagger_robots = [2] if args.stagger_robots else []
    if min(args.robots) < 1 or args.chunks < 1 or args.warm < 0:
        p.error("--robots >= 1, --chunks >= 1 and --warm >= 0")
    rows: list[dict] = []
    checks: dict[str, Any] = {}
    for exec_step in {"both": (-1, args.exec_step), "own": (-1,), "short": (args.exec_step,)}[
        args.schedules
    ]:
        run_schedule(args, exec_step, rows, checks)
    for r in rows:
        base = next(b for b in rows if b["schedule"] == r["schedule"] and b["robots"] == 1
                    and b["server"] == EAGER)  # fmt: skip
        r["x_lerobot"] = r["chunks_per_s"] / base["chunks_per_s"]
    cols = ["schedule", "server", "robots", "p50_ms", "p99_ms", "chunks_per_s", "x_lerobot",
            "derived"]  # fmt: skip
    print(markdown_table(rows, cols))
    labels = sorted({r["schedule"] for r in rows})
    fits = {s: max([r["robots"] for r in rows if r["schedule"] == s and r["server"] == PACKED
                    and r["p99_ms"] <= args.budget_ms], default=0) for s in labels}  # fmt: skip
    print(f"robots within p99 <= {args.budget_ms:.0f} ms (packed): {fits}")
    print(f"agreement (max |action| difference, robot 0 vs LeRobot alone): {checks}")
    payload = {"rows": rows, "robots_within_budget": fits, "agreement": checks,
               "goals": {s: goals(rows, s) for s in labels},
               "note": "derived rows: one robot's measured chunk time times the robots waiting"}  # fmt: skip
    write_json("bench_lingbot_serve", args, payload, device=args.device)
    return payload


if __name__ == "__main__":
    main()
