"""Packed inference (packing.serve) against one request at a time and padded batching.

Same requests, same weights, one run. Arms (each a `packing.serve.Engine`, the runner a
careful user writes: static shapes, no host sync, schedule tables on the device):

- ``alone/eager``, ``alone/compiled``, ``alone/graphs``: one request at a time in a pack of
  one request sized for the longest request (blocks eager, compiled with ``block.compile()``,
  compiled and the whole step captured in a CUDA graph);
- ``padded/graphs@B``: static batches of B requests, each padded to the mix's longest;
- ``packed/graphs@C``: continuous batching, at most C requests in flight (``/drop33``: the
  middle third of every context dropped, ~33% fewer tokens).

Closed loop at concurrency C (C requests always in the system): requests/s over the steady
window, p50/p99 latency, and the compute bound: model FLOPs of the real tokens at
790 TFLOP/s (the H200's measured bf16 matmul peak), with the fraction reached. Then 1,000+
engine steps of Poisson arrivals with host syncs counted (``torch.cuda.set_sync_debug_mode``)
and recompiles (dynamo's graph count). bf16 packed vs alone: cosine per request.

    python benchmarks/bench_serve.py                  # H200: the run in docs/inference.md
    python benchmarks/bench_serve.py --quick --device cpu   # smoke (CPU, tiny, eager)
"""

from __future__ import annotations

import math
import random
import sys
import time
import warnings
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
from packing.model import DiT, DiTConfig
from packing.model._dit import text_tokens
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


class Clock:
    """Time stamps in the GPU's stream order (CUDA events: the host never waits for the GPU
    while the loop runs, as a server would not), or perf_counter on the CPU."""

    def __init__(self, dev: torch.device) -> None:
        self.cuda = dev.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> int:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def seconds(self) -> list[float]:
        """Every mark, in seconds since the first (synchronizes once, at the end)."""
        if not self.cuda:
            return [t - self.marks[0] for t in self.marks]
        torch.cuda.synchronize()
        return [self.marks[0].elapsed_time(e) / 1e3 for e in self.marks]


def closed_loop(engine: Engine, reqs: list[Request], C: int, dev: torch.device,
                batch: int = 0) -> dict[str, Any]:  # fmt: skip
    """C requests always in the system (``batch``: static batches of that many instead).
    A request's latency runs from the stream position where it was submitted to the end of
    the step that finished it."""
    clock = Clock(dev)
    arrive: dict[int, int] = {}
    finish: dict[int, int] = {}
    queue = list(reqs)
    index: dict[int, int] = {}
    outputs: dict[int, Any] = {}

    def submit() -> None:
        rid = engine.submit(queue.pop(0))
        index[rid] = len(reqs) - len(queue) - 1
        arrive[rid] = clock.mark()

    for _ in range(min(C, len(queue))):
        submit()
    while engine.active or engine.waiting:
        finished = engine.step()
        mark = clock.mark()
        for r in finished:
            finish[r.request_id] = mark
            outputs[index[r.request_id]] = r
        if batch:  # a static batch: the next one starts when the whole batch is done
            if not (engine.active or engine.waiting):
                for _ in range(min(batch, len(queue))):
                    submit()
        else:
            for _ in finished:
                if queue:
                    submit()
    t = clock.seconds()
    done = sorted(t[m] for m in finish.values())
    n = len(done)
    lo, hi = (n // 4, n - n // 4 - 1) if n >= 8 else (0, n - 1)  # the steady middle half
    # Requests finishing in the same step share a time: count those after done[lo] up to
    # done[hi] (the first H200 run divided hi - lo by the window and under-counted packs).
    count = sum(1 for x in done if done[lo] < x <= done[hi])
    rate = count / (done[hi] - done[lo]) if done[hi] > done[lo] else n / done[-1]
    lat = sorted(t[finish[r]] - t[arrive[r]] for r in finish)
    return {"req_per_s": rate, "p50_ms": 1e3 * lat[len(lat) // 2],
            "p99_ms": 1e3 * lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)],
            "requests": n, "engine_steps": engine.clock, "outputs": outputs}  # fmt: skip


def engine_for(model: DiT, shapes: list[PackShape], graphs: bool, steps: int) -> Engine:
    config = EngineConfig(shapes=tuple(shapes), scheduler=FlowScheduler(solver="multistep2",
                          shift=5.0), max_steps=steps, cuda_graphs=graphs)  # fmt: skip
    return Engine(model, config)


def shapes_for(reqs: list[Request], C: int, fracs: tuple[float, ...] = (1.0,)) -> list[PackShape]:
    """Budgets for up to C requests: ``fracs`` of C x the mean request (+15%), each at least
    the longest request. One shape is one compile per arm; the sync check uses two."""
    fmax = max(len(r.kept) + r.frames for r in reqs)
    fmean = sum(len(r.kept) + r.frames for r in reqs) / len(reqs)
    top = math.ceil(C * fmean * 1.15) if C > 1 else fmax
    return [PackShape(frames=max(fmax, math.ceil(top * f)), actions=C * ACTIONS, requests=C)
            for f in fracs]  # fmt: skip


def run_arm(name: str, model: DiT, cfg: DiTConfig, reqs: list[Request], C: int,
            dev: torch.device, graphs: bool, steps: int, batch: int = 0) -> dict[str, Any]:  # fmt: skip
    """Warm up (compile, capture) on a few requests, then the closed loop over ``reqs``."""
    graphs = graphs and dev.type == "cuda"
    if batch:
        fmax = max(len(r.kept) + r.frames for r in reqs)
        reqs = [padded(r, fmax) for r in reqs]
        shapes = [PackShape(frames=batch * fmax, actions=batch * ACTIONS, requests=batch)]
    else:
        shapes = shapes_for(reqs, C)
    engine = engine_for(model, shapes, graphs, steps)
    t0 = time.perf_counter()
    warm(engine, shapes, reqs)
    warm_s = time.perf_counter() - t0
    row = closed_loop(engine, reqs, batch or C, dev, batch=batch)
    flops = sum(request_flops(cfg, r) for r in reqs) / len(reqs) * steps
    bound_s = flops / (MEASURED_PEAK_TFLOPS * 1e12)  # the bound names its peak: 790
    row.update(arm=name, C=batch or C, warmup_s=warm_s, gflop_per_req=flops / 1e9,
               bound_req_per_s=1 / bound_s, fraction_of_bound=row["req_per_s"] * bound_s,
               tokens_mean=sum((len(r.kept) + r.frames) * cfg.tokens_per_frame + r.actions
                               for r in reqs) / len(reqs))  # fmt: skip
    return row


def warm(engine: Engine, shapes: list[PackShape], reqs: list[Request]) -> None:
    """Run each shape once (compile, capture): fill it, longest requests first, as far as
    they fit, so the engine picks that shape."""
    for s in shapes:
        chosen: list[Request] = []
        for r in sorted(reqs, key=lambda r: -len(r.kept)):
            if s.fits([*chosen, r]):
                chosen.append(r)
        for r in chosen:
            engine.submit(r)
        engine.run()


def sync_and_recompile_check(model: DiT, reqs: list[Request], C: int, dev: torch.device,
                             steps_total: int, steps: int) -> dict[str, Any]:  # fmt: skip
    """Poisson arrivals (mean one per engine step) for ``steps_total`` steps after warm-up:
    host syncs flagged by torch and dynamo graphs compiled during them."""
    graphs = dev.type == "cuda"
    shapes = shapes_for(reqs, C, (0.5, 1.0))
    engine = engine_for(model, shapes, graphs, steps)
    warm(engine, shapes, reqs)
    rng = random.Random(1)
    before = dynamo_counters()["unique_graphs"]
    syncs = 0
    if graphs:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        i = 0
        for _ in range(steps_total):
            k = _poisson(rng, 0.6 * C / steps)  # 60% of what C slots serve: a stable queue
            for _ in range(k):
                engine.submit(reqs[i % len(reqs)])
                i += 1
            engine.step()
            if engine.waiting > 4 * C:  # bounded queue: an overloaded server sheds load
                break
    syncs = sum(1 for w in caught if "synchroniz" in str(w.message).lower())
    with warnings.catch_warnings(record=True) as control:  # the counter can see a sync
        warnings.simplefilter("always")
        if graphs:
            float(torch.ones(1, device=dev).sum())
    if graphs:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    seen = sum(1 for w in control if "synchroniz" in str(w.message).lower())
    return {"check": "syncs_recompiles", "engine_steps": engine.clock, "host_syncs": syncs,
            "control_sync_seen": seen,
            "recompiles": dynamo_counters()["unique_graphs"] - before,
            "submitted": i}  # fmt: skip


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
    p.add_argument("--concurrency", default="1,4,8,16,32")
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
    rows: list[dict[str, Any]] = []
    extra: dict[str, Any] = {"skipped": [], "cosine": {}}
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
    cols = ["config", "mix", "arm", "C", "tokens_mean", "req_per_s", "p50_ms", "p99_ms",
            "bound_req_per_s", "fraction_of_bound", "warmup_s"]  # fmt: skip
    print(markdown_table([r for r in rows if "error" not in r], cols))
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
    n = lambda C: max(3 * C, 6)  # noqa: E731
    reqs = make_requests(n(max(conc)), mix, cfg, args.steps, args.seed)
    outputs: dict[str, dict[int, Any]] = {}
    compiled = False
    plan = run_plan(name, conc, args.quick)
    if args.only:
        keep = set(args.only.split(","))
        plan = [p for p in plan if f"{p[0]}@{p[1]}/{p[4]}" in keep or p[0] in keep]
    for arm, C, graphs, want_compiled, kind in plan:
        if arm == "syncs":
            if not late(f"{name} syncs"):
                try:
                    chk = sync_and_recompile_check(model, reqs[: n(C)], C, dev, args.sync_steps,
                                                   args.steps)  # fmt: skip
                    extra["sync_check"] = {"config": name, **chk}
                    print(chk, flush=True)
                except Exception as e:
                    extra["sync_check"] = {"error": f"{type(e).__name__}: {e}"}
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
                rq = make_requests(n(C), lm, cfg, args.steps, args.seed + 1)
            elif kind == "drop":
                rq = make_requests(n(C), mix, cfg, args.steps, args.seed, drop=True)
            else:
                rq = reqs[: n(C)]
            batch = C if arm.startswith("padded") else 0
            row = run_arm(arm, model, cfg, rq, 1 if arm.startswith("alone") else C, dev,
                          graphs, args.steps, batch=batch)  # fmt: skip
            outputs[f"{arm}@{C}/{kind}"] = row.pop("outputs")
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


def run_plan(name: str, conc: list[int], quick: bool) -> list[tuple[str, int, bool, bool, str]]:
    """(arm, C, graphs, compiled, mix) by priority; eager arms before compiling the blocks."""
    c8 = 8 if not quick else 2
    cs = [c for c in conc if c > 1]
    alone = [("alone/eager", 1, False, False, "short"), ("alone/compiled", 1, False, True, "short"),
             ("alone/graphs", 1, True, True, "short")]  # fmt: skip
    if name == "small" or quick:
        first = [c for c in cs if c in (c8, max(cs))]
        return [
            *alone,
            *[("packed/graphs", c, True, True, "short") for c in first],
            ("syncs", c8, True, True, "short"),
            ("packed/graphs/drop33", c8, True, True, "drop"),
            ("padded/graphs", c8, True, True, "short"),
            ("packed/graphs", c8, True, True, "long"),
            ("padded/graphs", c8, True, True, "long"),
            *[("packed/graphs", c, True, True, "short") for c in cs if c not in first],
            ("packed/compiled", c8, False, True, "short"),
        ]
    return [
        alone[2],
        ("packed/graphs", 8, True, True, "short"),
        ("padded/graphs", 8, True, True, "short"),
        ("packed/graphs/drop33", 8, True, True, "drop"),
        ("packed/graphs", 16, True, True, "short"),
        ("packed/graphs", 32, True, True, "short"),
        *[("packed/graphs", c, True, True, "short") for c in cs if c not in (8, 16, 32)],
    ]


if __name__ == "__main__":
    main()
