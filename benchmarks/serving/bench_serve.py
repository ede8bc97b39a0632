"""Packed inference (packing.serve) against one request at a time and padded batching.

Same requests, same weights, one run. Arms (each a `packing.serve.Engine`, the runner a
careful user writes: static shapes, no host sync, schedule tables on the device):

- ``alone/graphs``: one request at a time, each in a pack shaped to fit it exactly (one
  shape per request length: no padding), blocks compiled, the step in a CUDA graph;
  ``alone/eager`` and ``alone/compiled`` (only with ``--only``) without graphs / compile;
- ``padded/graphs@B``: static batches of B requests, each padded to the mix's longest (the
  cost of padding everything to one length: an upper bound, not a fair baseline);
- ``padded_bucketed/graphs@B``: the fair padded baseline: requests in ``--buckets`` length
  buckets, a static batch of B requests of one bucket, each padded to its bucket's longest;
- ``packed/graphs@C``: continuous batching, at most C requests in flight, one pack shape of
  C x the mean request + 15% (``/drop33``: the middle third of every context dropped, ~33%
  fewer tokens);
- ``packed_shapes/graphs@C``: the same with ``--buckets`` pack shapes from C x the mean to
  the one above (the engine runs each pack in the smallest that holds it): packing given as
  many shapes as bucketed padding, so neither arm pays for one shape's slack;
- ``open``: the packed engine under an open loop, Poisson arrivals at fractions of its
  closed-loop capacity: offered rate against p50/p99 (`benchmarks/serving/loops.py`).

Closed loop at concurrency C over ``--requests`` requests an arm (>= 200 on the GPU, so
p99 is not the maximum): requests/s over the steady window, p50/p99 latency, and the compute
bound: model FLOPs of the real tokens (`benchmarks/harness/flops.py`) at 790 TFLOP/s (the
H200's measured bf16 matmul peak), with the fraction reached. Then engine steps of Poisson
arrivals checked for host syncs (``torch.cuda.set_sync_debug_mode``) and for blocking
host-to-device copies from pageable memory (the profiler's memcpy records), each check with
a control it must see (`benchmarks/serving/checks.py`), and recompiles (dynamo's graph
count). bf16 packed vs alone: cosine per request. The context cache is measured by
`benchmarks/serving/bench_cache.py` (its engines sized for generated frames, robots whose
chunks continue an episode) and `benchmarks/serving/robots.py --context-cache`, not here:
these requests are each a fresh episode, their shapes hold the whole context.

    python benchmarks/serving/bench_serve.py --configs small --requests 200   # H200
    python benchmarks/serving/bench_serve.py --quick --device cpu   # smoke (CPU, tiny, eager)
"""

from __future__ import annotations

import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.harness import (
    MEASURED_PEAK_TFLOPS,
    base_parser,
    dit_flops,
    dynamo_counters,
    markdown_table,
    write_json,
)
from benchmarks.serving.checks import pageable_copies, sync_debug_count
from benchmarks.serving.loops import closed_loop, open_loop
from packing.model import DiT, DiTConfig, text_tokens
from packing.serve import Engine, EngineConfig, FlowScheduler, PackShape, Request

MIXES = {"short": (14, 22), "long": (60, 185)}  # context frames: ~500-800 / ~2K-6K tokens
GEN_FRAMES, ACTIONS = 2, 16


def model_config(name: str, quick: bool) -> DiTConfig:
    if quick:
        return DiTConfig.tiny(latent_channels=8, latent_hw=(4, 8), action_dim=6)
    base = DiTConfig.wan_2_2_5b if name == "5b" else DiTConfig.wan_1_3b
    return base(depth=30, attention="flex")


def make_requests(n: int, mix: tuple[int, int], cfg: DiTConfig, steps: int, seed: int,
                  drop: bool = False) -> list[Request]:  # fmt: skip
    rng = random.Random(seed)
    frame = (cfg.latent_channels, *cfg.latent_hw)
    out = []
    for i in range(n):
        f = rng.randint(*mix)
        keep = None
        if drop:  # the middle third of the context dropped: the note's drop_middle
            third = f // 3
            keep = tuple(range(third)) + tuple(range(f - third, f))
        g = torch.Generator().manual_seed(seed * 10_000 + i)
        out.append(Request(context=torch.randn(f, *frame, generator=g), frames=GEN_FRAMES,
                           actions=ACTIONS, task=f"task {i % 24}", seed=i, steps=steps,
                           keep_frames=keep))  # fmt: skip
    return out


def request_flops(cfg: DiTConfig, r: Request) -> float:
    """Model FLOPs of one denoising step of ``r`` on its real tokens (one forward,
    `harness.flops.dit_flops`): context + generated frames, actions, the task's text."""
    video = (len(r.kept) + r.frames) * cfg.tokens_per_frame
    text = text_tokens(r.task, cfg.text_len).shape[0]
    return dit_flops(cfg, [(video, r.actions, text)], backward=False).model


def padded(r: Request, frames: int) -> Request:
    """``r`` with zero context frames in front up to ``frames`` in all (compute of padding)."""
    n = frames - (len(r.kept) + r.frames)
    ctx = torch.cat([torch.zeros(n, *r.context.shape[1:]), r.context[list(r.kept)]])
    return Request(context=ctx, frames=r.frames, actions=r.actions, task=r.task, seed=r.seed,
                   steps=r.steps)  # fmt: skip


def engine_for(model: DiT, shapes: list[PackShape], graphs: bool, steps: int) -> Engine:
    config = EngineConfig(shapes=tuple(shapes), scheduler=FlowScheduler(solver="multistep2",
                          shift=5.0), max_steps=steps, cuda_graphs=graphs)  # fmt: skip
    return Engine(model, config)


def frames_of(r: Request) -> int:
    return len(r.kept) + r.frames


def shapes_for(reqs: list[Request], C: int, fracs: tuple[float, ...] = (1.0,)) -> list[PackShape]:
    """Budgets for up to C requests: ``fracs`` of C x the mean request (+15%), each at least
    the longest request. One shape is one compile per arm; the sync check uses two."""
    fmax = max(frames_of(r) for r in reqs)
    fmean = sum(frames_of(r) for r in reqs) / len(reqs)
    top = math.ceil(C * fmean * 1.15) if C > 1 else fmax
    return [PackShape(frames=max(fmax, math.ceil(top * f)), actions=C * ACTIONS, requests=C)
            for f in fracs]  # fmt: skip


def exact_shapes(reqs: list[Request]) -> list[PackShape]:
    """One request a pack, one shape per request length: each request runs unpadded."""
    return [PackShape(frames=f, actions=ACTIONS, requests=1)
            for f in sorted({frames_of(r) for r in reqs})]  # fmt: skip


def length_buckets(reqs: list[Request], buckets: int) -> list[int]:
    """Upper frame edges of ``buckets`` buckets holding about equal numbers of requests."""
    fs = sorted(frames_of(r) for r in reqs)
    edges = {
        fs[min(len(fs) - 1, math.ceil((i + 1) * len(fs) / buckets) - 1)] for i in range(buckets)
    }
    return sorted(edges)


def bucketed_batches(reqs: list[Request], B: int, edges: list[int],
                     seed: int) -> tuple[list[Request], list[PackShape]]:  # fmt: skip
    """The padded-bucketed arm's queue and shapes: each request padded to its bucket's edge,
    the queue a shuffled sequence of B-request batches of one bucket each."""
    by: dict[int, list[Request]] = {}
    for r in reqs:
        edge = next(e for e in edges if e >= frames_of(r))
        by.setdefault(edge, []).append(padded(r, edge))
    chunks = [items[i : i + B] for items in by.values() for i in range(0, len(items), B)]
    random.Random(seed).shuffle(chunks)
    shapes = [PackShape(frames=B * e, actions=B * ACTIONS, requests=B) for e in sorted(by)]
    return [r for c in chunks for r in c], shapes


def run_arm(name: str, model: DiT, cfg: DiTConfig, reqs: list[Request], C: int,
            dev: torch.device, graphs: bool, steps: int, batch: int = 0,
            buckets: int = 0, packed_shapes: int = 0) -> dict[str, Any]:  # fmt: skip
    """Warm up (compile, capture) each shape, then the closed loop over ``reqs``."""
    graphs = graphs and dev.type == "cuda"
    real = reqs
    if batch and buckets:
        reqs, shapes = bucketed_batches(reqs, batch, length_buckets(reqs, buckets), seed=0)
    elif batch:
        fmax = max(frames_of(r) for r in reqs)
        reqs = [padded(r, fmax) for r in reqs]
        shapes = [PackShape(frames=batch * fmax, actions=batch * ACTIONS, requests=batch)]
    elif C == 1:
        shapes = exact_shapes(reqs)
    elif packed_shapes > 1:  # from C x the mean (1 / 1.15 of the top) up to the top
        lo = 1 / 1.15
        fracs = tuple(lo + (1 - lo) * i / (packed_shapes - 1) for i in range(packed_shapes))
        shapes = list({s.frames: s for s in shapes_for(reqs, C, fracs)}.values())  # distinct
    else:
        shapes = shapes_for(reqs, C)
    engine = engine_for(model, shapes, graphs, steps)
    t0 = time.perf_counter()
    warm(engine, shapes, reqs)
    warm_s = time.perf_counter() - t0
    row = closed_loop(engine, reqs, batch or C, dev, batch=batch)
    flops = sum(request_flops(cfg, r) for r in reqs) / len(reqs) * steps  # what it computes
    useful = sum(request_flops(cfg, r) for r in real) / len(real) * steps  # the real tokens
    bound_s = flops / (MEASURED_PEAK_TFLOPS * 1e12)  # the bound names its peak: 790
    row.update(arm=name, C=batch or C, warmup_s=warm_s, shapes=len(shapes),
               gflop_per_req=flops / 1e9, bound_req_per_s=1 / bound_s,
               fraction_of_bound=row["req_per_s"] * bound_s,
               fraction_of_useful_bound=row["req_per_s"] * useful / (MEASURED_PEAK_TFLOPS * 1e12),
               peak="measured 790 TFLOP/s",
               tokens_mean=sum(frames_of(r) * cfg.tokens_per_frame + r.actions
                               for r in reqs) / len(reqs))  # fmt: skip
    return row


def run_open(model: DiT, reqs: list[Request], C: int, dev: torch.device, steps: int,
             capacity: float, fractions: list[float], max_s: float) -> list[dict[str, Any]]:  # fmt: skip
    """The packed engine (at most C in flight) under Poisson arrivals at ``fractions`` of
    its closed-loop ``capacity`` (requests/s): one row per offered rate."""
    graphs = dev.type == "cuda"
    shapes = shapes_for(reqs, C)
    engine = engine_for(model, shapes, graphs, steps)
    warm(engine, shapes, reqs)
    rows = []
    for i, f in enumerate(fractions):
        got = open_loop(engine, reqs, capacity * f, dev, seed=i, max_s=max_s)
        rows.append({"arm": "open", "C": C, "load": f, **got})
        print(rows[-1], flush=True)
        if got["cut"]:
            engine = engine_for(model, shapes, graphs, steps)  # the cut one holds a queue
            warm(engine, shapes, reqs)
    return rows


def warm(engine: Engine, shapes: list[PackShape], reqs: list[Request]) -> None:
    """Run each shape once (compile, capture): fill it, longest requests first, as far as
    they fit, so the engine picks that shape."""
    for s in shapes:
        chosen: list[Request] = []
        for r in sorted(reqs, key=lambda r: -frames_of(r)):
            if s.fits([*chosen, r]):
                chosen.append(r)
        for r in chosen:
            engine.submit(r)
        engine.run()


def sync_and_recompile_check(model: DiT, reqs: list[Request], C: int, dev: torch.device,
                             steps_total: int, steps: int) -> dict[str, Any]:  # fmt: skip
    """Poisson arrivals (mean 60% of what C slots serve) for ``steps_total`` steps after
    warm-up, two pack shapes switching: host syncs torch flags, blocking copies from
    pageable memory the profiler records (on a slice of the steps), and graphs compiled."""
    graphs = dev.type == "cuda"
    shapes = shapes_for(reqs, C, (0.5, 1.0))
    engine = engine_for(model, shapes, graphs, steps)
    warm(engine, shapes, reqs)
    rng = random.Random(1)
    before = dynamo_counters()["unique_graphs"]
    state = {"i": 0}

    def run(n: int) -> None:
        for _ in range(n):
            for _ in range(_poisson(rng, 0.6 * C / steps)):
                engine.submit(reqs[state["i"] % len(reqs)])
                state["i"] += 1
            engine.step()
            if engine.waiting > 4 * C:  # bounded queue: an overloaded server sheds load
                break

    syncs = sync_debug_count(lambda: run(steps_total), dev)
    copies = pageable_copies(lambda: run(min(50, steps_total)), dev)
    return {"check": "syncs_copies_recompiles", "engine_steps": engine.clock, **syncs,
            "pageable_copies": copies,
            "recompiles": dynamo_counters()["unique_graphs"] - before,
            "submitted": state["i"]}  # fmt: skip


def _poisson(rng: random.Random, lam: float) -> int:
    k, p, L = 0, 1.0, math.exp(-lam)
    while True:
        p *= rng.random()
        if p <= L:
            return k
        k += 1


def cosines(packed: dict[int, Any], alone: dict[int, Any]) -> list[float]:
    """Each request packed with others vs the same request alone (same seed), cosine."""
    cos = []
    for i in sorted(set(packed) & set(alone)):
        a = torch.cat([packed[i].latents.flatten(), packed[i].action.flatten()]).double()
        b = torch.cat([alone[i].latents.flatten(), alone[i].action.flatten()]).double()
        cos.append(float(a @ b / (a.norm() * b.norm())))
    return cos


def main() -> None:
    p = base_parser(__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="same as --quick")
    p.add_argument("--configs", default="small,5b")
    p.add_argument("--concurrency", default="1,8,16,32")
    p.add_argument(
        "--requests",
        type=int,
        default=200,
        help="requests an arm (>= 200: p99 is then not the maximum)",
    )
    p.add_argument(
        "--long-requests",
        type=int,
        default=0,
        help="requests an arm on the long mix (default --requests): its rows are "
        "about rates, at 2-3 requests/s",
    )
    p.add_argument(
        "--buckets",
        type=int,
        default=3,
        help="length buckets of padded_bucketed, pack shapes of packed_shapes",
    )
    p.add_argument(
        "--loads",
        default="0.3,0.5,0.7,0.85,1.0,1.2",
        help="open loop: offered rates as fractions of packed@8's closed-loop rate",
    )
    p.add_argument("--open-max-s", type=float, default=20.0, help="seconds an offered rate runs")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--sync-steps", type=int, default=1000)
    p.add_argument("--deadline-s", type=float, default=1e9, help="start no arm after this")
    p.add_argument("--only", default="", help="run only these arms, e.g. 'packed/graphs@4/short'")
    args = p.parse_args()
    args.quick = args.quick or args.smoke
    dev = torch.device(args.device)
    t_start = time.perf_counter()
    torch._dynamo.config.recompile_limit = 64  # one graph per pack shape, many shapes here
    torch._dynamo.config.accumulated_recompile_limit = 4096
    conc = [int(c) for c in args.concurrency.split(",")]
    if args.quick:
        conc, args.steps, args.sync_steps = [1, 2, 4], 3, 30
        args.requests, args.open_max_s, args.loads = min(args.requests, 12), 4.0, "0.5,1.0"
        args.long_requests = min(args.long_requests, 12) if args.long_requests else 0
    rows: list[dict[str, Any]] = []
    extra: dict[str, Any] = {"skipped": [], "cosine": {}, "open_loop": []}
    configs = args.configs.split(",")

    def out(row: dict[str, Any]) -> None:
        rows.append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        write_json("serve", args, {"rows": rows, **extra}, device=dev, partial=True)

    for ci, name in enumerate(configs):
        # each config may start arms until its share of the deadline (the first gets 55%)
        until = args.deadline_s * (0.55 if ci == 0 and len(configs) > 1 else 1.0)

        def late(what: str, until: float = until) -> bool:
            if time.perf_counter() - t_start > until:
                extra["skipped"].append(what)
                return True
            return False

        run_config(name, args, dev, conc, out, late, extra)
        torch._dynamo.reset()  # the next config compiles its own blocks from scratch
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    cols = ["config", "mix", "arm", "C", "requests", "shapes", "tokens_mean", "req_per_s",
            "p50_ms", "p99_ms", "max_ms", "bound_req_per_s", "fraction_of_bound",
            "fraction_of_useful_bound", "warmup_s"]  # fmt: skip
    print(markdown_table([r for r in rows if "error" not in r], cols))
    if extra["open_loop"]:
        print(markdown_table(extra["open_loop"], ["config", "load", "offered_req_per_s",
                                                  "served_req_per_s", "served", "p50_ms",
                                                  "p99_ms", "max_ms", "cut"]))  # fmt: skip
    errs = [r for r in rows if "error" in r]
    if errs:
        print("errors:", errs)
    write_json("serve", args, {"rows": rows, **extra}, device=dev)


def run_config(name: str, args: Any, dev: torch.device, conc: list[int], out: Any, late: Any,
               extra: dict[str, Any]) -> None:  # fmt: skip
    cfg = model_config(name, args.quick)
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = DiT(cfg).to(dev, dtype).eval()
    mix = MIXES["short"] if not args.quick else (2, 4)
    n = lambda C: max(args.requests, 3 * C)  # noqa: E731
    reqs = make_requests(n(max(conc)), mix, cfg, args.steps, args.seed)
    outputs: dict[str, dict[int, Any]] = {}
    rates: dict[str, float] = {}
    compiled = False
    plan = run_plan(name, conc, args.quick, with_slow="alone/eager" in args.only or
                    "alone/compiled" in args.only)  # fmt: skip
    if args.only:
        keep = set(args.only.split(","))
        plan = [p for p in plan if f"{p[0]}@{p[1]}/{p[4]}" in keep or p[0] in keep]
    for arm, C, graphs, want_compiled, kind in plan:
        if arm in ("syncs", "open") and late(f"{name} {arm}"):
            continue
        if arm == "syncs":
            try:
                chk = sync_and_recompile_check(model, reqs[: n(C)], C, dev, args.sync_steps,
                                               args.steps)  # fmt: skip
                extra["sync_check"] = {"config": name, **chk}
                print(chk, flush=True)
            except Exception as e:
                extra["sync_check"] = {"error": f"{type(e).__name__}: {e}"}
            continue
        if arm == "open":
            capacity = rates.get(f"packed/graphs@{C}/short")
            if capacity is None:
                extra["skipped"].append(f"{name} open: no packed@{C} rate to scale the loads")
                continue
            try:
                loads = [float(x) for x in args.loads.split(",")]
                got = run_open(model, reqs[: n(C)], C, dev, args.steps, capacity, loads,
                               args.open_max_s)  # fmt: skip
                extra["open_loop"] += [{"config": name, **r} for r in got]
            except Exception as e:
                extra["open_loop"].append({"config": name, "error": f"{type(e).__name__}: {e}"})
            continue
        if late(f"{name} {arm}@{C} {kind}"):
            continue
        if want_compiled and not compiled and dev.type == "cuda":
            for block in model.blocks:
                block.compile(dynamic=False)  # regional: one graph per shape, all 30 blocks
            compiled = True
        try:
            if kind == "long":
                lm = MIXES["long"] if not args.quick else (5, 9)
                rq = make_requests(args.long_requests or n(C), lm, cfg, args.steps, args.seed + 1)
            elif kind == "drop":
                rq = make_requests(n(C), mix, cfg, args.steps, args.seed, drop=True)
            else:
                rq = reqs[: n(C)]
            batch = C if arm.startswith("padded") else 0
            buckets = args.buckets if arm.startswith("padded_bucketed") else 0
            shapes = args.buckets if arm.startswith("packed_shapes") else 0
            row = run_arm(arm, model, cfg, rq, 1 if arm.startswith("alone") else C, dev,
                          graphs, args.steps, batch=batch, buckets=buckets,
                          packed_shapes=shapes)  # fmt: skip
            outputs[f"{arm}@{C}/{kind}"] = row.pop("outputs")
            rates[f"{arm}@{C}/{kind}"] = row["req_per_s"]
            row.update(config=name, mix=kind, compiled=compiled, dtype=str(dtype))
            out(row)
        except Exception as e:  # one failing arm must not lose the others
            out({"config": name, "arm": arm, "C": C, "mix": kind,
                 "error": f"{type(e).__name__}: {e}"[:2000]})  # fmt: skip
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    alone = outputs.get("alone/graphs@1/short") or outputs.get("alone/eager@1/short")
    packed = outputs.get(f"packed/graphs@{8 if not args.quick else 2}/short")
    if alone and packed:
        cs = cosines(packed, alone)
        extra["cosine"][name] = {"min": min(cs), "n": len(cs), "values": cs,
                                 "what": "packed/graphs@8 vs alone/graphs, per request"}  # fmt: skip
        print("cosine packed vs alone: min", min(cs), flush=True)
    shaped = outputs.get(f"packed_shapes/graphs@{8 if not args.quick else 2}/short")
    if alone and shaped:
        cs = cosines(shaped, alone)
        extra["cosine"][f"{name} packed_shapes"] = {
            "min": min(cs), "n": len(cs), "values": cs,
            "what": "packed_shapes/graphs@8 vs alone/graphs, per request"}  # fmt: skip


def run_plan(name: str, conc: list[int], quick: bool,
             with_slow: bool = False) -> list[tuple[str, int, bool, bool, str]]:  # fmt: skip
    """(arm, C, graphs, compiled, mix) by priority: the contested comparisons first (one at a
    time in its own shape, packed, padded to the mix's longest, padded by length bucket, the
    checks), the long mix against bucketed padding, the open loop, then the rest. ``alone/eager`` and
    ``alone/compiled`` (200 requests at 0.7 / 0.17 s each) only by ``--only``: they would
    run after the blocks are compiled, so they come first when asked for."""
    c8 = 8 if not quick else 2
    cs = [c for c in conc if c > 1]
    slow = [("alone/eager", 1, False, False, "short"), ("alone/compiled", 1, False, True, "short")]
    slow = slow if with_slow else []
    short = [
        ("alone/graphs", 1, True, True, "short"),
        ("packed/graphs", c8, True, True, "short"),
        ("padded/graphs", c8, True, True, "short"),
        ("padded_bucketed/graphs", c8, True, True, "short"),
        ("packed_shapes/graphs", c8, True, True, "short"),
        ("syncs", c8, True, True, "short"),
    ]
    if name == "small" or quick:
        return [
            *slow,
            *short,
            ("packed/graphs", c8, True, True, "long"),
            ("padded_bucketed/graphs", c8, True, True, "long"),
            ("packed_shapes/graphs", c8, True, True, "long"),
            ("open", c8, True, True, "short"),
            ("padded/graphs", c8, True, True, "long"),
            ("packed/graphs/drop33", c8, True, True, "drop"),
            *[("packed/graphs", c, True, True, "short") for c in cs if c != c8],
            ("packed/compiled", c8, False, True, "short"),
        ]
    return [
        *short[:5],
        ("packed/graphs/drop33", 8, True, True, "drop"),
        *[("packed/graphs", c, True, True, "short") for c in cs if c != 8],
    ]


if __name__ == "__main__":
    main()
