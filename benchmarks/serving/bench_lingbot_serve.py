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
and the packed engine with N = 1, 4, 8, 16 robots in a closed loop (each robot asks for its
next chunk as soon as it has the last): chunk latency p50/p99 (submit to result) and
chunks/s over all robots; robots an H200 serves within ``--budget-ms`` p99.

    python benchmarks/serving/bench_lingbot_serve.py                  # one H200 (not run yet)
    python benchmarks/serving/bench_lingbot_serve.py --smoke          # CPU, tiny, seconds
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


def build_policy(smoke: bool, exec_step: int, device: str) -> Any:
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.lingbot_va.configuration_lingbot_va import LingBotVAConfig
    from lerobot.policies.lingbot_va.modeling_lingbot_va import LingBotVAPolicy

    if smoke:
        from packing.integrations.lingbot_va.testing import tiny_policy

        torch.manual_seed(0)
        return tiny_policy(attn_mode="torch", video_exec_step=exec_step, **SMOKE)
    cams = ["observation.images.image", "observation.images.image2"]
    visual = PolicyFeature(type=FeatureType.VISUAL, shape=(3, 128, 128))
    cfg = LingBotVAConfig(**WAN_5B, **LIBERO, attn_mode="torch", dtype="bfloat16",
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


def lerobot_alone(policy: Any, chunks: int, device: str) -> list[float]:
    """One robot through LeRobot's policy, chunk after chunk: each chunk's milliseconds."""
    from packing.integrations.lingbot_va._serve_reference import ReferenceRobot

    F_ = policy.config.frame_chunk_size
    frames, text, neg = _episode(policy, 0, chunks)
    robot = ReferenceRobot(policy, text.to(device), neg.to(device))
    out = []
    for k in range(chunks):
        fb = frames[:1] if k == 0 else frames[(k - 1) * F_ : k * F_]
        sync(device)
        t0 = time.perf_counter()
        robot.chunk(fb.to(device), None, k)
        sync(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def packed(policy: Any, robots: int, chunks: int, warm: int, cuda_graphs: bool) -> dict[str, Any]:
    """``robots`` robots in a closed loop through `LingBotVAEngine`; the first ``warm``
    chunks of each robot are not timed."""
    from packing.integrations.lingbot_va._serve import LingBotVAEngine
    from packing.integrations.lingbot_va._serve_packs import LingShape
    from packing.integrations.lingbot_va._serve_request import ChunkRequest

    F_ = policy.config.frame_chunk_size
    engine = LingBotVAEngine(policy, robots=robots, shapes=[LingShape(video=robots, action=robots)],
                             cuda_graphs=cuda_graphs)  # fmt: skip
    warm_stats = engine.warm_up()
    eps = [_episode(policy, r, chunks + warm) for r in range(robots)]
    nxt, sent, lat_ms = [0] * robots, {}, []
    t_start: float | None = None
    done = warm_done = 0

    def submit(r: int) -> None:
        frames, text, neg = eps[r]
        k = nxt[r]
        req = ChunkRequest(session=f"robot{r}", frames=frames[: max(1, k * F_)], actions=None,
                           prompt=text, negative=neg, seed=k)  # fmt: skip
        sent[engine.submit(req)] = (r, time.perf_counter())

    for r in range(robots):
        submit(r)
    while engine.active or engine.waiting:
        for res in engine.step():
            r, t0 = sent.pop(res.request_id)
            if res.error is not None:
                raise RuntimeError(f"robot {r}: {res.error}")
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
            "stats": engine.stats}  # fmt: skip


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny LeRobot policy, seconds")
    p.add_argument("--robots", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--chunks", type=int, default=8, help="timed chunks a robot")
    p.add_argument("--warm", type=int, default=2, help="untimed chunks a robot first")
    p.add_argument("--exec-step", type=int, default=5,
                   help="the shortened video_exec_step row (LingBot-VA's config option)")  # fmt: skip
    p.add_argument("--budget-ms", type=float, default=1000.0, help="p99 control budget")
    p.add_argument("--cuda-graphs", action="store_true", help="capture the packed steps")
    args = p.parse_args(argv)
    if args.smoke:
        args.quick, args.device = True, "cpu"
        args.robots, args.chunks, args.warm = [1, 2], 2, 1
    rows = []
    for exec_step in (-1, args.exec_step):
        policy = build_policy(args.smoke, exec_step, args.device)
        c = policy.config
        video = f"{c.num_inference_steps}+1" if exec_step == -1 else f"exec_step {exec_step}"
        label = f"video {video}, action {c.action_num_inference_steps}"
        alone = lerobot_alone(policy, args.chunks + args.warm, args.device)[args.warm :]
        t = sorted(alone)[len(alone) // 2]
        for n in args.robots:
            rows.append({"schedule": label, "server": "LeRobot, one robot at a time", "robots": n,
                         "p50_ms": t * n, "p99_ms": percentile(alone, 0.99) * n,
                         "chunks_per_s": 1e3 / t, "derived": n > 1})  # fmt: skip
        for n in args.robots:
            run = packed(policy, n, args.chunks, args.warm, args.cuda_graphs)
            lat = run["latency_ms"]
            rows.append({"schedule": label, "server": "packed (LingBotVAEngine)", "robots": n,
                         "p50_ms": percentile(lat, 0.5), "p99_ms": percentile(lat, 0.99),
                         "chunks_per_s": run["chunks"] / max(run["wall_s"], 1e-9),
                         "derived": False, "warm_up": run["warm_up"], "stats": run["stats"]})  # fmt: skip
    for r in rows:
        base = next(b for b in rows if b["schedule"] == r["schedule"] and b["robots"] == 1
                    and b["server"].startswith("LeRobot"))  # fmt: skip
        r["x_lerobot"] = r["chunks_per_s"] / base["chunks_per_s"]
    cols = ["schedule", "server", "robots", "p50_ms", "p99_ms", "chunks_per_s", "x_lerobot",
            "derived"]  # fmt: skip
    print(markdown_table(rows, cols))
    fits = {s: max([r["robots"] for r in rows if r["schedule"] == s and "packed" in r["server"]
                    and r["p99_ms"] <= args.budget_ms], default=0)
            for s in {r["schedule"] for r in rows}}  # fmt: skip
    print(f"robots within p99 <= {args.budget_ms:.0f} ms (packed): {fits}")
    payload = {"rows": rows, "robots_within_budget": fits,
               "note": "derived rows: one robot's measured chunk time times the robots waiting"}  # fmt: skip
    write_json("bench_lingbot_serve", args, payload, device=args.device)
    return payload


if __name__ == "__main__":
    main()
