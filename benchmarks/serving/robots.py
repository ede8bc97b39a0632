"""Simulated robots against the policy server, end to end: one request at a time vs packed.

N robots, each on its own websocket connection (`packing.server.PolicyClient`, a thread) with
its own control rate, run the real-time loop: ask for the next chunk as the last one runs
out, wait for it (the robot stands still: idle), execute it (chunk duration = actions /
its rate), ask again. Both arms are the same `PolicyServer` over the same weights:

- ``one_at_a_time``: an engine whose only pack shape holds ONE request, so the server answers
  one request at a time (what openpi's server does);
- ``packed``: an engine with shapes for 1, 2, 4, ... min(N, ``--max-pack``) requests
  (``--pack-shapes every``: one for each request count up to it); the continuous batcher
  packs the waiting robots' requests into each model call. A pack costs its shape's call,
  empty request slots included: where a call's cost grows about linearly with its requests
  (5B widths on an H200), 3 requests in a 4-request shape cost more than one at a time.

Per arm and N: chunks/s (all robots), p50/p99 chunk latency (request sent to reply read), and
robot idle time (latency over latency + execution). The robots' chunk durations are spread
over ``--chunk-x`` x [0.75, 1.25] x one request's latency alone (measured first), so one robot
alone idles ~1 / (1 + chunk_x) of the time.

A robot's episode is ``--episode-chunks`` chunks: the first sends ``--context-frames``
frames, each next one the previous context + ``--frames`` new frames (what it observed while
the last chunk ran), the last one ends the episode (``"episode": "end"``). ``--context-cache
PAGES`` serves BOTH arms through the engine's context cache (a frame-causal model; a chunk
prefills only its new frames); the JSON records it and each row's cache counters.

    python benchmarks/serving/robots.py --quick --max-pack 4    # CPU, tiny DiT, < 3 minutes
    python benchmarks/serving/robots.py --device cuda --config 5b --compile --cuda-graphs
    python benchmarks/serving/robots.py --quick --context-cache 64    # both arms cached
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.harness import base_parser, markdown_table, summarize, write_json
from packing.model import DiT, DiTConfig
from packing.serve import ContextCache, Engine, EngineConfig, FlowScheduler, PackShape
from packing.server import DiTAdapter, PolicyClient, PolicyServer, ServerConfig


def model_config(name: str, frame_causal: bool) -> DiTConfig:
    if name == "tiny":
        return DiTConfig.tiny(latent_channels=8, latent_hw=(4, 8), action_dim=6,
                              frame_causal=frame_causal)  # fmt: skip
    base = DiTConfig.wan_2_2_5b if name == "5b" else DiTConfig.wan_1_3b
    return base(depth=30, attention="flex", frame_causal=frame_causal)


def longest_context(args: Any) -> int:
    return args.context_frames + (args.episode_chunks - 1) * args.frames


def build_engine(model: DiT, args: Any, requests: list[int]) -> Engine:
    """The engine of one arm, warmed up (every shape and prefill pass compiled and captured)
    before any robot is timed; its warm-up stats are kept on it (``warm_stats``)."""
    cache = None
    per = longest_context(args) + args.frames  # uncached: a shape holds context + generated
    if args.context_cache is not None:  # cached: generated frames only, contexts in the pool
        cache = ContextCache(pages=args.context_cache, page_frames=args.page_frames,
                             context_frames=longest_context(args))  # fmt: skip
        per = args.frames
    shapes = tuple(PackShape(frames=n * per, actions=n * args.actions, requests=n)
                   for n in requests)  # fmt: skip
    config = EngineConfig(shapes=shapes, max_steps=args.steps, cuda_graphs=args.cuda_graphs,
                          scheduler=FlowScheduler(solver="multistep2", shift=5.0),
                          context_cache=cache)  # fmt: skip
    engine = Engine(model, config)
    engine.warm_up(progress=lambda done, total, label: print(
        f"warming {done} of {total} shapes ({label})", flush=True))  # fmt: skip
    print({"warm_up": engine.warm_stats}, flush=True)
    return engine


def observation(robot: int, args: Any, cfg: DiTConfig, chunk: int = 0,
                episode: int = 0) -> dict[str, Any]:  # fmt: skip
    """Chunk ``chunk`` of the robot's episode ``episode``: its first ``--context-frames`` +
    ``chunk * --frames`` frames (the previous chunk's context and the frames since)."""
    rng = np.random.default_rng([robot, episode])
    frames = rng.standard_normal((longest_context(args), cfg.latent_channels, *cfg.latent_hw))
    seen = args.context_frames + chunk * args.frames
    obs = {"context": frames[:seen].astype(np.float32), "seed": robot, "prompt": f"robot {robot}"}
    if chunk == args.episode_chunks - 1:
        obs["episode"] = "end"  # the episode ends after this chunk: its pages are free
    return obs


def step_costs(
    engine: Engine, args: Any, cfg: DiTConfig, counts: list[int]
) -> list[dict[str, Any]]:
    """The engine alone, no server: one model call's time with n requests in the pack (n up
    to the most robots; the median of a chunk's ``--steps`` calls, their contexts cached by
    a first chunk), and for one request a whole chunk (a fresh context prefilled, then its
    steps: what one robot alone asks the server for)."""
    adapter = DiTAdapter(frames=args.frames, actions=args.actions, steps=args.steps)
    cuda = next(engine.model.parameters()).is_cuda
    out = []
    for n in (k for k in (1, 2, 4, 8, 16, 32, 64) if k <= max(counts)):
        times = []
        for chunk in range(2):  # the first prefills each session's context, the second reuses
            for k in range(n):
                obs = observation(k, args, cfg, args.episode_chunks - 1 if chunk else 0)
                obs.pop("episode", None)
                engine.submit(adapter.request(obs, session=f"cost {n} {k}"))
            while engine.active or engine.waiting:
                t0 = time.perf_counter()
                engine.step()
                if cuda:
                    torch.cuda.synchronize()
                times.append(1e3 * (time.perf_counter() - t0))
        for k in range(n):
            engine.end_session(f"cost {n} {k}")
        step_ms = summarize(times[len(times) // 2 + 1 :]).median_ms  # the second chunk's steps
        row = {"requests": n, "step_ms": step_ms, "per_request_ms": step_ms / n}
        if n == 1:  # a whole chunk alone, fresh context each time (as the lone robot below)
            chunk = []
            for i in range(4):
                r = adapter.request({**observation(0, args, cfg), "seed": i}, session=f"alone {i}")
                t0 = time.perf_counter()
                engine.submit(r)
                engine.run()
                if cuda:
                    torch.cuda.synchronize()
                chunk.append(1e3 * (time.perf_counter() - t0))
                engine.end_session(f"alone {i}")
            row["chunk_ms"] = summarize(chunk[1:]).median_ms
        out.append(row)
        print(out[-1], flush=True)
    return out


def pack_sizes(top: int, rule: str) -> list[int]:
    """The packed arm's shapes, in requests: powers of two up to ``top`` and ``top``, or
    (``every``) each count 1..top (more shapes to compile and capture, no empty slot)."""
    if rule == "every":
        return list(range(1, top + 1))
    return [k for k in (1, 2, 4, 8, 16, 32, 64) if k < top] + [top]


def run_robots(address: tuple[str, int], n: int, chunk_s: float, args: Any,
               cfg: DiTConfig) -> dict[str, Any]:  # fmt: skip
    """N robots for ``--warmup-s`` + ``--duration-s``; chunks that start in the timed window."""
    start = time.monotonic() + args.warmup_s
    stop = start + args.duration_s
    records: list[list[tuple[float, float, float]]] = [[] for _ in range(n)]

    def robot(i: int) -> None:
        duration = chunk_s * (0.75 + 0.5 * i / max(n - 1, 1))  # its own control rate
        sent = 0
        with PolicyClient(*address, timeout_s=600) as policy:
            while time.monotonic() < stop:
                episode, chunk = divmod(sent, args.episode_chunks)
                obs = observation(i, args, cfg, chunk, episode)
                sent += 1
                t0 = time.monotonic()
                policy.infer(obs)
                latency = time.monotonic() - t0
                records[i].append((t0, latency, duration))
                time.sleep(duration)  # executing the chunk; the next request as it runs out

    threads = [threading.Thread(target=robot, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    timed = [(lat, dur) for rec in records for t0, lat, dur in rec if start <= t0 < stop]
    lat_ms = [1e3 * lat for lat, _ in timed]
    s = summarize(lat_ms) if lat_ms else None
    return {
        "chunks": len(timed),
        "chunks_per_s": len(timed) / args.duration_s,
        "p50_ms": s.median_ms if s else None,
        "p99_ms": float(np.percentile(lat_ms, 99)) if lat_ms else None,
        "idle": sum(lat for lat, _ in timed) / max(sum(lat + dur for lat, dur in timed), 1e-9),
    }


def main() -> None:
    p = base_parser(__doc__.split("\n")[0])
    p.add_argument("--config", default="tiny", choices=["tiny", "small", "5b"])
    p.add_argument("--robots", default="1,4,8,16")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--context-frames", type=int, default=None, help="tiny: 2, else 16")
    p.add_argument("--frames", type=int, default=2)
    p.add_argument("--actions", type=int, default=16)
    p.add_argument("--chunk-x", type=float, default=4.0, help="chunk duration / lone latency")
    p.add_argument("--duration-s", type=float, default=None, help="timed window per run")
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument("--max-pack", type=int, default=16, help="most requests in a packed call")
    p.add_argument("--pack-shapes", default="pow2", choices=["pow2", "every"],
                   help="the packed arm's shapes: 1, 2, 4, ... requests, or every count")  # fmt: skip
    p.add_argument("--compile", action="store_true")
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU default 1)")
    p.add_argument("--episode-chunks", type=int, default=4, help="chunks an episode (1: none "
                   "continues, every chunk the same --context-frames)")  # fmt: skip
    p.add_argument(
        "--context-cache",
        type=int,
        default=None,
        metavar="PAGES",
        help="both arms through the engine's context cache, a pool of PAGES pages",
    )
    p.add_argument("--page-frames", type=int, default=4, help="with --context-cache (4)")
    p.add_argument(
        "--frame-causal",
        action="store_true",
        help="a frame-causal model without the cache (the uncached comparison)",
    )
    args = p.parse_args()
    if args.episode_chunks < 1:
        raise SystemExit(f"--episode-chunks {args.episode_chunks}: give 1 or more")
    if args.quick:
        args.config = "tiny"
    dev = torch.device(args.device)
    if args.context_frames is None:
        args.context_frames = 2 if args.config == "tiny" else 16
    if args.duration_s is None:
        args.duration_s = 6.0 if dev.type == "cpu" else 20.0
    if dev.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    counts = [int(n) for n in args.robots.split(",")]
    cfg = model_config(args.config, args.frame_causal or args.context_cache is not None)
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = DiT(cfg).to(dev, dtype).eval()
    if args.compile:
        if args.pack_shapes == "every":  # a compiled block sees every shape: no eager fallback
            limit = torch._dynamo.config.recompile_limit
            torch._dynamo.config.recompile_limit = max(limit, 2 * args.max_pack)
        for block in model.blocks:
            block.compile(dynamic=False)
    top = min(max(counts), args.max_pack)
    engines = {"one_at_a_time": build_engine(model, args, [1]),
               "packed": build_engine(model, args, pack_sizes(top, args.pack_shapes))}  # fmt: skip
    costs = step_costs(engines["packed"], args, cfg, counts)
    rows: list[dict[str, Any]] = []
    lone_s = None
    for n in counts:  # the arms side by side at each N: a shared machine drifts less between
        for arm in ("one_at_a_time", "packed"):
            engine = engines[arm]
            server = PolicyServer(engine, DiTAdapter(frames=args.frames, actions=args.actions,
                                                     steps=args.steps),
                                  ServerConfig(port=0, max_queue=4 * max(counts), deadline_s=600))  # fmt: skip
            with server.running() as address:
                if lone_s is None:  # one request alone through the server: the time unit
                    with PolicyClient(*address) as c:  # a whole context each time
                        obs = {**observation(0, args, cfg), "episode": "end"}
                        c.infer(obs)
                        t = time.monotonic()
                        for _ in range(3):
                            c.infer(obs)
                        lone_s = (time.monotonic() - t) / 3
                row = run_robots(address, n, args.chunk_x * lone_s, args, cfg)
            s = server.summary()
            row.update(arm=arm, robots=n, lone_ms=1e3 * lone_s, warm_up=engine.warm_stats,
                       requests_per_call=s["requests_per_call"], pack_fill=s["pack_fill"],
                       compiles_after_warm_up=s["compiles_after_warm_up"],
                       captures_after_warm_up=s["captures_after_warm_up"],
                       context_cache=args.context_cache, cache_stats=engine.stats)  # fmt: skip
            rows.append(row)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()},
                  flush=True)  # fmt: skip
            write_json("serving_robots", args, {"rows": rows, "step_costs": costs}, device=dev,
                       partial=True)  # fmt: skip
    cols = ["arm", "robots", "chunks_per_s", "p50_ms", "p99_ms", "idle", "requests_per_call",
            "lone_ms", "compiles_after_warm_up", "captures_after_warm_up"]  # fmt: skip
    print(markdown_table(rows, cols))
    load = os.getloadavg() if hasattr(os, "getloadavg") else None  # a shared machine says so
    print(markdown_table(costs, ["requests", "step_ms", "per_request_ms", "chunk_ms"]))
    write_json("serving_robots", args, {"rows": rows, "step_costs": costs, "config": args.config,
                                        "context_cache": args.context_cache,
                                        "frame_causal": cfg.frame_causal,
                                        "load_average_after": load}, device=dev)  # fmt: skip


if __name__ == "__main__":
    main()
