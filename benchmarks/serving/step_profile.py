"""One cached engine step alone, by requests in the pack and pages in the pool: time and profile.

The engine's step with a context cache (`packing.serve.ContextCache`), no server: each
request keeps ``--context-frames`` frames (prefilled once), generates ``--frames`` frames and
``--actions`` actions; the step's median over ``--steps`` calls after the first (admission and
prefill). ``--profile``: the CUDA (or CPU) kernels of a few steps of each row, by total time,
written next to the JSON; what explained a one-request step ten times a two-request one.

    python benchmarks/serving/step_profile.py --quick                       # CPU, tiny DiT
    python benchmarks/serving/step_profile.py --device cuda --config 5b --cuda-graphs \\
        --requests 1,2,8 --pages 32,512 --profile
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.harness import base_parser, markdown_table, summarize, write_json
from packing.model import DiT, DiTConfig
from packing.serve import ContextCache, Engine, EngineConfig, FlowScheduler, PackShape, Request


def model_config(name: str) -> DiTConfig:
    if name == "tiny":
        return DiTConfig.tiny(latent_channels=8, latent_hw=(4, 8), action_dim=6,
                              frame_causal=True, attention="sdpa")  # fmt: skip
    base = DiTConfig.wan_2_2_5b if name == "5b" else DiTConfig.wan_1_3b
    return base(depth=30, attention="flex", frame_causal=True)


def engine_for(model: DiT, args: Any, n: int, pages: int) -> Engine:
    window = None if args.whole_pool else args.context_frames  # None: attend over the pool
    cache = ContextCache(pages=pages, page_frames=args.page_frames, context_frames=window)
    shape = PackShape(frames=n * args.frames, actions=n * args.actions, requests=n)
    config = EngineConfig(shapes=(shape,), max_steps=args.steps, cuda_graphs=args.cuda_graphs,
                          scheduler=FlowScheduler(solver="multistep2", shift=5.0),
                          context_cache=cache)  # fmt: skip
    engine = Engine(model, config)
    engine.warm_up()
    return engine


def requests(cfg: DiTConfig, args: Any, n: int) -> list[Request]:
    g = torch.Generator().manual_seed(0)
    return [
        Request(context=torch.randn(args.context_frames, cfg.latent_channels, *cfg.latent_hw,
                                    generator=g),
                frames=args.frames, actions=args.actions, steps=args.steps, seed=k,
                task=f"robot {k}", session=f"robot {k}")
        for k in range(n)
    ]  # fmt: skip


def timed_steps(engine: Engine, reqs: list[Request], cuda: bool) -> list[float]:
    """Every step of one chunk of ``reqs`` packed together, in ms (the first: admission)."""
    for r in reqs:
        engine.submit(r)
    times = []
    while engine.active or engine.waiting:
        t0 = time.perf_counter()
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return times


def profile(engine: Engine, reqs: list[Request], cuda: bool, path: Path) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=acts) as prof:
        timed_steps(engine, reqs, cuda)
    key = "cuda_time_total" if cuda else "cpu_time_total"
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=90))


def main() -> None:
    p = base_parser(__doc__.split("\n")[0])
    p.add_argument("--config", default="tiny", choices=["tiny", "small", "5b"])
    p.add_argument("--requests", default="1,2")
    p.add_argument("--pages", default="32,512")
    p.add_argument("--page-frames", type=int, default=4)
    p.add_argument("--context-frames", type=int, default=None, help="tiny: 6, else 22")
    p.add_argument("--frames", type=int, default=2)
    p.add_argument("--actions", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--chunks", type=int, default=3, help="chunks timed per row")
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument("--whole-pool", action="store_true",
                   help="the control: every step attends over the whole pool (no window)")  # fmt: skip
    p.add_argument("--profile", action="store_true", help="a kernel table per row")
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU default 1)")
    args = p.parse_args()
    if args.quick:
        args.config = "tiny"
    dev = torch.device(args.device)
    if dev.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    if args.context_frames is None:
        args.context_frames = 6 if args.config == "tiny" else 22
    cfg = model_config(args.config)
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    with torch.device(dev):
        model = DiT(cfg).to(dtype).eval()
    cuda = dev.type == "cuda"
    out_dir = Path(args.out).parent if getattr(args, "out", None) else Path("benchmarks/results")
    rows = []
    for pages in (int(x) for x in args.pages.split(",")):
        for n in (int(x) for x in args.requests.split(",")):
            engine = engine_for(model, args, n, pages)
            reqs = requests(cfg, args, n)
            times: list[float] = []
            for _ in range(args.chunks):  # later chunks reuse the cached context: steps only
                times += timed_steps(engine, reqs, cuda)[1:]
            s = summarize(times)
            row = {"pages": pages, "requests": n, "window": not args.whole_pool,
                   "step_ms": s.median_ms,
                   "step_min_ms": min(times), "step_max_ms": max(times),
                   "warm_up": engine.warm_stats}  # fmt: skip
            if args.profile:
                name = f"step_profile_{args.config}_{dev.type}_r{n}_p{pages}.txt"
                profile(engine, reqs, cuda, out_dir / name)
                row["profile"] = name
            rows.append(row)
            print(row, flush=True)
    print(markdown_table(rows, ["pages", "requests", "window", "step_ms", "step_min_ms",
                                "step_max_ms"]))  # fmt: skip
    write_json("serving_step_profile", args, {"rows": rows, "config": args.config}, device=dev)


if __name__ == "__main__":
    main()
