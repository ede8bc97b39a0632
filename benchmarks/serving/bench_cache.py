"""The context cache (issue 34): model FLOPs per chunk and requests/s, cached vs uncached.

Part 1, FLOPs (analytic, from the model's shapes): a 10-step chunk of the short (14-22 context
frames) and long (60-185) mixes, 2 generated frames + 16 actions, for a request's first chunk
(its whole context prefilled) and a session's next chunk (2 new frames prefilled), uncached
(every step runs context + generated tokens) vs cached (prefill once, then the generated
tokens over the pool). Cross-checked against ``torch.utils.flop_counter.FlopCounterMode`` on a
small config, pass by pass, with the padded shapes the engine really runs.

Part 2, a closed loop of C robots: each robot sends its chunks in order (context = the last
chunk's + 2 new frames; an episode runs to the mix's longest context, then the robot ends the
session and starts a new one), the next chunk as soon as the last one came back. Both engines
get the same requests; requests/s over the steady middle half, p50/p99 chunk latency from
submission to the end of the step that finished it (CUDA events on the GPU: the loop never
syncs). Rows are written to the JSON as they finish; no arm starts after ``--deadline-s``.

    python benchmarks/serving/bench_cache.py --device cpu                 # CPU, 1 thread
    python benchmarks/serving/bench_cache.py --device cuda --config 5b --blocks 30 --cuda-graphs
"""

from __future__ import annotations

import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.harness import base_parser, markdown_table, write_json
from benchmarks.serving.loops import Clock
from packing.model import DiT, DiTConfig, text_tokens
from packing.serve import (
    ContextCache,
    Engine,
    EngineConfig,
    FlowScheduler,
    PackShape,
    Request,
)

MIXES = {"short": (14, 22), "long": (60, 185)}
GEN, ACTIONS, NEW = 2, 16, 2  # generated frames, actions, frames a next chunk observes
TASK = "pick up the red block"


def model_config(name: str, blocks: int) -> DiTConfig:
    fc = dict(frame_causal=True)
    if name == "5b":
        return DiTConfig.wan_2_2_5b(depth=blocks, **fc)
    if name == "1.3b":
        return DiTConfig.wan_1_3b(depth=blocks, **fc)
    # CPU, one thread: narrow, shallow and 8 tokens a frame (SDPA's dense mask on the CPU
    # makes an uncached pack of 8 robots at 32 tokens a frame a minute a chunk)
    return DiTConfig(dim=128, heads=2, depth=blocks, ffn_dim=512, freq_dim=64, latent_channels=16,
                     latent_hw=(4, 8), action_dim=14, attention="sdpa", **fc)  # fmt: skip


# -- part 1: FLOPs ------------------------------------------------------------------------------
def pass_flops(cfg: DiTConfig, *, video: int, action: int, text: int, self_pairs: float,
               cross_pairs: float, rows: int) -> float:  # fmt: skip
    """Forward FLOPs of one model call: ``video``/``action`` tokens through every block,
    ``text`` text rows (embedded and projected to keys/values), ``self_pairs``/
    ``cross_pairs`` (query, key) pairs attended, ``rows`` timestep rows. Matmuls and attention
    (2 FLOPs a multiply-add); norms and elementwise work are not counted."""
    d, f, L = cfg.dim, cfg.ffn_dim, cfg.depth
    per_token = 2 * (3 * d * d + d * d + d * d + d * d + 2 * d * f)  # qkv, out, cross q/out, FFN
    blocks = L * (
        (video + action) * per_token + text * 2 * 2 * d * d + 4 * d * (self_pairs + cross_pairs)
    )
    P, A = cfg.patch_features, cfg.action_dim
    edges = (
        2 * 2 * (video * P * d + action * A * d) + text * 2 * 2 * d * d
    )  # embed, heads, text MLP
    time_mlp = rows * 2 * (cfg.freq_dim * d + d * d + 6 * d * d)
    return float(blocks + edges + time_mlp)


def causal_pairs(F: int, q_frames: range, actions: int, video_frames: int) -> int:
    """Frame-causal (query, key) pairs of a document: video queries of frames ``q_frames``
    (each sees the frames up to its own), then ``actions`` action queries (each sees all
    ``video_frames`` frames and the actions of its chunk of F and the chunks before)."""
    video = sum(F * (i + 1) * F for i in q_frames)
    acts = sum(video_frames * F + min(actions, (j // F + 1) * F) for j in range(actions))
    return video + acts


def chunk_flops(cfg: DiTConfig, ctx: int, new: int, steps: int, cached: bool) -> float:
    """Model FLOPs of one chunk of a request with ``ctx`` context frames of which ``new`` are
    not cached yet (``new = ctx``: a first chunk), real tokens only."""
    F, X = cfg.tokens_per_frame, text_tokens(TASK, cfg.text_len).shape[0]
    frames = ctx + GEN
    if not cached:
        J = frames * F + ACTIONS
        pairs = causal_pairs(F, range(frames), ACTIONS, frames)
        return steps * pass_flops(cfg, video=frames * F, action=ACTIONS, text=X, self_pairs=pairs,
                                  cross_pairs=J * X, rows=2)  # fmt: skip
    pre = pass_flops(cfg, video=new * F, action=0, text=X, rows=1, cross_pairs=new * F * X,
                     self_pairs=causal_pairs(F, range(ctx - new, ctx), 0, 0))  # fmt: skip
    q = GEN * F + ACTIONS
    step = pass_flops(cfg, video=GEN * F, action=ACTIONS, text=X, cross_pairs=q * X, rows=2,
                      self_pairs=causal_pairs(F, range(ctx, frames), ACTIONS, frames))  # fmt: skip
    return pre + steps * step


def flops_rows(cfgs: dict[str, DiTConfig], steps: int) -> list[dict[str, Any]]:
    rows = []
    for name, cfg in cfgs.items():
        for mix, (lo, hi) in MIXES.items():
            mean = (lo + hi) / 2
            for case, new in (("first chunk", None), ("next chunk", NEW)):
                un = sum(chunk_flops(cfg, c, c, steps, False) for c in range(lo, hi + 1))
                ca = sum(chunk_flops(cfg, c, new or c, steps, True) for c in range(lo, hi + 1))
                n = hi - lo + 1
                rows.append(dict(config=name, mix=mix, case=case, ctx_frames_mean=mean,
                                 uncached_tflop=un / n / 1e12, cached_tflop=ca / n / 1e12,
                                 ratio=un / ca))  # fmt: skip
    return rows


def flop_counter_check(seed: int) -> list[dict[str, Any]]:
    """Every model call of a cached and an uncached engine on a small config, counted by
    FlopCounterMode, against `pass_flops` of the same padded shapes with SDPA's dense pairs
    (SDPA computes every (query, key) pair; the mask only zeroes them)."""
    torch.manual_seed(seed)
    cfg = DiTConfig(dim=64, heads=2, depth=2, ffn_dim=160, freq_dim=32, latent_channels=8,
                    latent_hw=(4, 8), action_dim=6, text_len=16, frame_causal=True,
                    attention="sdpa")  # fmt: skip
    model, F, X = DiT(cfg).eval(), cfg.tokens_per_frame, cfg.text_len
    ctx = torch.randn(5, 8, 4, 8)
    r = Request(context=ctx, frames=1, actions=4, task=TASK, steps=1)
    out = []
    shape = PackShape(frames=6, actions=4, requests=1)
    for cached in (False, True):
        cc = ContextCache(pages=3, page_frames=2, prefill_frames=8) if cached else None
        gen_shape = PackShape(frames=1, actions=4, requests=1) if cached else shape
        engine = Engine(model, EngineConfig(shapes=(gen_shape,), max_steps=1, context_cache=cc))
        engine.submit(r)
        with FlopCounterMode(display=False) as counter:
            engine.run()
        counted = counter.get_total_flops()
        if not cached:
            J = 6 * F + 4
            want = pass_flops(cfg, video=6 * F, action=4, text=X, self_pairs=J * J,
                              cross_pairs=J * X, rows=2)  # fmt: skip
        else:
            N, Q, J = 3 * 2 * F, 8 * F, F + 4
            want = pass_flops(cfg, video=Q, action=0, text=X, self_pairs=Q * N, cross_pairs=Q * X,
                              rows=1)  # fmt: skip
            want += pass_flops(cfg, video=F, action=4, text=X, self_pairs=J * (N + J),
                               cross_pairs=J * X, rows=2)  # fmt: skip
        out.append(dict(engine="cached" if cached else "uncached", counted=counted,
                        analytic=want, ratio=counted / want))  # fmt: skip
    return out


# -- part 2: robots in a closed loop ------------------------------------------------------------
def robot_chunks(robots: int, chunks: int, mix: tuple[int, int], cfg: DiTConfig, steps: int,
                 seed: int, name: str = "robot") -> list[list[Request]]:  # fmt: skip
    """Per robot, its chunks in order: episodes whose context grows by NEW frames a chunk."""
    rng = random.Random(seed)
    lo, hi = mix
    frame = (cfg.latent_channels, *cfg.latent_hw)
    out: list[list[Request]] = []
    for rb in range(robots):
        mine: list[Request] = []
        episode, c, frames = 0, rng.randint(lo, hi), torch.empty(0)
        while len(mine) < chunks:
            if c > hi or not frames.numel():  # a new episode
                episode += 1
                c = rng.randint(lo, lo + (hi - lo) // 2) if frames.numel() else c
                g = torch.Generator().manual_seed(seed * 100_000 + rb * 1_000 + episode)
                frames = torch.randn(hi + 1, *frame, generator=g)
            mine.append(Request(context=frames[:c], frames=GEN, actions=ACTIONS, task=TASK,
                                seed=len(mine), steps=steps,
                                session=f"{name} {rb} episode {episode}"))  # fmt: skip
            c += NEW
        out.append(mine)
    return out


def closed_loop(engine: Engine, robots: list[list[Request]], dev: torch.device) -> dict[str, Any]:
    clock, queue, first_step = Clock(dev), [list(rs) for rs in robots], engine.clock
    arrive, finish, owner = {}, {}, {}
    outputs: dict[tuple[int, int], Any] = {}

    def submit(rb: int) -> None:
        r = queue[rb].pop(0)
        rid = engine.submit(r)
        owner[rid] = (rb, len(robots[rb]) - len(queue[rb]) - 1)
        arrive[rid] = clock.mark()

    for rb in range(len(robots)):
        submit(rb)
    while True:
        # On CUDA a finished request comes back once its last non-finite flag reached the
        # host, a step or two later; when nothing runs, run() waits for those still on the way.
        busy = engine.active or engine.waiting
        done = engine.step() if busy else engine.run()
        if not busy and not done:
            break
        mark = clock.mark()
        for res in done:
            rb, i = owner[res.request_id]
            finish[res.request_id], outputs[(rb, i)] = mark, res
            nxt = queue[rb][0] if queue[rb] else None
            if nxt is None or nxt.session != robots[rb][i].session:
                engine.end_session(robots[rb][i].session)  # type: ignore[arg-type]
            if nxt is not None:
                submit(rb)
    t = clock.seconds()
    ends = sorted(t[m] for m in finish.values())
    n = len(ends)
    lo, hi = (n // 4, n - n // 4 - 1) if n >= 8 else (0, n - 1)
    count = sum(1 for x in ends if ends[lo] < x <= ends[hi])
    rate = count / (ends[hi] - ends[lo]) if ends[hi] > ends[lo] else n / ends[-1]
    lat = sorted(t[finish[r]] - t[arrive[r]] for r in finish)
    # After the first round: the loop starts with every robot's first chunk at once (all C
    # contexts prefilled in one admission), which later rounds, their episodes out of step,
    # do not see again; both are reported.
    later = sorted(t[finish[r]] - t[arrive[r]] for r in finish if owner[r][1] > 0)
    return {"req_per_s": rate, "p50_ms": 1e3 * lat[n // 2], "p99_ms": 1e3 * _p99(lat),
            "p99_after_first_round_ms": 1e3 * _p99(later) if later else None, "requests": n,
            "engine_steps": engine.clock - first_step, "outputs": outputs}  # fmt: skip


def _p99(xs: list[float]) -> float:
    return xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)]


def make_engine(model: DiT, cfg: DiTConfig, robots: list[list[Request]], C: int, cached: bool,
                graphs: bool, steps: int) -> Engine:  # fmt: skip
    sched = FlowScheduler(solver="multistep2", shift=5.0)
    reqs = [r for rs in robots for r in rs]
    fmax = max(len(r.kept) + r.frames for r in reqs)
    if not cached:  # the uncached packed engine as benchmarks/bench_serve.py sizes it
        fmean = sum(len(r.kept) + r.frames for r in reqs) / len(reqs)
        frames = max(fmax, math.ceil(C * fmean * 1.15)) if C > 1 else fmax
        shape = PackShape(frames=frames, actions=C * ACTIONS, requests=C)
        return Engine(model, EngineConfig(shapes=(shape,), scheduler=sched, max_steps=steps,
                                          cuda_graphs=graphs))  # fmt: skip
    pf = 4
    pages = 2 * C * -(-(fmax - GEN) // pf)  # the pack's contexts twice over: sessions keep theirs
    cc = ContextCache(pages=pages, page_frames=pf, prefill_frames=(2 * C, 8 * C))
    shape = PackShape(frames=C * GEN, actions=C * ACTIONS, requests=C)
    return Engine(model, EngineConfig(shapes=(shape,), scheduler=sched, max_steps=steps,
                                      cuda_graphs=graphs, context_cache=cc))  # fmt: skip


def warm(engine: Engine, cfg: DiTConfig, mix: tuple[int, int], C: int, steps: int) -> float:
    """Compile and capture every graph the run will use: each prefill size alone, then (on
    the GPU) a round of C first chunks and their next chunks. Returns the seconds it took."""
    t0 = time.perf_counter()
    cache = engine.config.context_cache
    frame = (cfg.latent_channels, *cfg.latent_hw)
    for n in cache.pass_sizes if cache else ():
        engine.submit(Request(context=torch.randn(n, *frame), frames=GEN, actions=ACTIONS,
                              task=TASK, steps=steps))  # fmt: skip
        engine.run()
    warm_robots = robot_chunks(C, 2 if engine.device.type == "cuda" else 1, mix, cfg, steps,
                               seed=999, name="warm-up robot")  # fmt: skip
    for i in range(len(warm_robots[0])):  # round by round: a robot's chunks in order
        for rs in warm_robots:
            engine.submit(rs[i])
        engine.run()
    for r in {r.session for rs in warm_robots for r in rs}:
        engine.end_session(r)  # type: ignore[arg-type]
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    p = base_parser(__doc__.split("\n")[0])
    p.add_argument("--config", default="cpu", choices=["cpu", "1.3b", "5b"])
    p.add_argument("--blocks", type=int, default=None, help="depth (default 2 cpu, 30 GPU)")
    p.add_argument("--cuda-graphs", action="store_true", help="capture each step (CUDA)")
    p.add_argument("--concurrency", default=None, help="robots, e.g. 8,16 (cpu: 1,8)")
    p.add_argument("--chunks", type=int, default=None, help="chunks per robot (cpu 3, GPU 6)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--mix", default="short", choices=sorted(MIXES))
    p.add_argument("--deadline-s", type=float, default=270.0, help="start no arm after this")
    args = p.parse_args()
    t_start, dev = time.perf_counter(), torch.device(args.device)
    gpu = dev.type == "cuda"
    if not gpu:
        torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 4096
    blocks = args.blocks or (30 if gpu else 2)
    conc = [int(c) for c in (args.concurrency or ("8,16" if gpu else "1,8")).split(",")]
    chunks = args.chunks or (6 if gpu else 3)
    if args.quick:
        conc, chunks, args.steps = [2], 2, 2
    payload: dict[str, Any] = {"flops": [], "flop_counter": [], "rows": [], "skipped": []}

    def save(partial: bool = True) -> None:
        write_json("serve_cache", args, payload, device=dev, partial=partial)

    cfgs = {"small (1.3B widths)": model_config("1.3b", 30), "5B": model_config("5b", 30)}
    payload["flops"] = flops_rows(cfgs, args.steps)
    payload["flop_counter"] = flop_counter_check(args.seed)
    print(markdown_table(payload["flops"], ["config", "mix", "case", "ctx_frames_mean",
                                            "uncached_tflop", "cached_tflop", "ratio"]))  # fmt: skip
    print(markdown_table(payload["flop_counter"], ["engine", "counted", "analytic", "ratio"]))
    save()
    cfg = model_config(args.config, blocks)
    torch.manual_seed(args.seed)
    with torch.device(dev):  # built where it runs: a 5B-width model is slow to init on CPU
        model = DiT(cfg).to(torch.bfloat16 if gpu else torch.float32).eval()
    if gpu:
        for block in model.blocks:
            block.compile(dynamic=False)
    mix = MIXES[args.mix] if not args.quick else (3, 6)
    for C in conc:
        robots = robot_chunks(C, chunks, mix, cfg, args.steps, args.seed)
        outs = {}
        for cached in (False, True):
            arm = f"{'cached' if cached else 'uncached'}@{C}"
            if time.perf_counter() - t_start > args.deadline_s:
                payload["skipped"].append(arm)
                continue
            engine = None
            try:
                engine = make_engine(model, cfg, robots, C, cached, args.cuda_graphs, args.steps)
                warm_s = warm(engine, cfg, mix, C, args.steps)
                row = closed_loop(engine, robots, dev)
                outs[cached] = row.pop("outputs")
                row.update(arm=arm, C=C, cached=cached, config=args.config, blocks=blocks,
                           mix=args.mix, warmup_s=warm_s, graphs=args.cuda_graphs,
                           cache_stats=getattr(engine, "stats", None))  # fmt: skip
            except Exception as e:  # one failing arm must not lose the others
                row = dict(arm=arm, C=C, error=f"{type(e).__name__}: {e}"[:2000])
            payload["rows"].append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()},
                  flush=True)  # fmt: skip
            save()
            del engine
            if gpu:
                torch.cuda.empty_cache()
        if len(outs) == 2:  # the same requests both ways: how close (bf16 on the GPU)
            errs = [_rel(outs[True][k], outs[False][k]) for k in outs[False]]
            payload.setdefault("cached_vs_uncached_max_rel", {})[C] = max(errs)
    print(markdown_table([r for r in payload["rows"] if "error" not in r],
                         ["arm", "C", "requests", "req_per_s", "p50_ms", "p99_ms",
                          "p99_after_first_round_ms", "warmup_s"]))  # fmt: skip
    save(partial=False)


def _rel(a: Any, b: Any) -> float:
    err = 0.0
    for x, y in ((a.latents, b.latents), (a.action, b.action)):
        d = float((x.float() - y.float()).abs().max() / y.float().abs().max())
        err = max(err, d if d == d else math.inf)  # NaN is no match (max() would drop it)
    return err


if __name__ == "__main__":
    main()
