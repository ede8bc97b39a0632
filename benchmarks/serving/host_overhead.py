"""The serving path's host side, with a model call that costs nothing or a set time (CPU).

Part 1, ``engine``: the engine alone, its model call a no-op, 8 requests in the system (a new
one submitted as one finishes, so the members sit at different steps): host ms per engine
step and per request, by phase (admission: the request's noise and tokens, the pack's
layout and copies; the call; the bookkeeping after it, the results' copies; the flag reads).
``one_at_a_time`` has one 1-request shape, ``packed`` shapes of 1, 2, 4 and 8 requests.

Part 2, ``served``: the policy server end to end (websockets, adapter, engine thread), N
robots as in `benchmarks/serving/robots.py`, with the model call on a stand-in device
(`Device`): a queue on the host clock where each call takes the time the H200 run measured
for its shape (``step_costs`` of ``--costs``; shapes it did not measure interpolated
linearly), flag events that complete when the queue gets there, and a reply whose read
waits for the queue when the real one would. Per arm: chunks/s, p50/p99, requests per call,
pack fill and the device's busy fraction, for

- ``before`` (40b14ba): the host never waits for the device, so it queues every member's
  remaining calls at once, and a reply's ``.cpu()`` on the engine's stream waits for every
  call queued after it;
- ``after``: the host stays one call ahead (``Engine._in_flight``) and a reply is
  read on a side stream (`packing.serve._device.to_host`), waiting for no later call;

and the packed arm twice: shapes of 1, 2, 4, 8 requests (``packed``) and one shape per
request count 1..8 (``packed_every``: no padded request slot).

    python benchmarks/serving/host_overhead.py                 # both parts, ~4 minutes
    python benchmarks/serving/host_overhead.py --quick         # smoke
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
import packing.serve._engine as engine_module
from benchmarks.harness import RESULTS_DIR, base_parser, markdown_table, summarize, write_json
from benchmarks.serving.robots import longest_context, observation, run_robots
from packing.model import DiT, DiTConfig
from packing.serve import Engine, EngineConfig, FlowScheduler, PackShape, Result
from packing.serve._step import Buffers
from packing.server import DiTAdapter, PolicyClient, PolicyServer, ServerConfig

PHASE_COLUMNS = ["noise_tokens_ms", "layout_ms", "state_copies_ms", "admit_other_ms", "call_ms",
                 "results_ms", "flags_ms", "other_ms"]  # fmt: skip
TIMED = ("_admit", "_member", "_recompose", "_run", "_ran", "_result", "_copy_flags",
         "_read_flags")  # fmt: skip


class Device:
    """A GPU stand-in: calls queue up and each takes its time; an event completes when the
    queue reaches it; ``drain`` waits for everything queued (a read on the engine's stream)."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy: list[tuple[float, float]] = []  # (start, end) of every call
        self.lock = threading.Lock()

    def launch(self, seconds: float) -> None:
        with self.lock:
            start = max(time.monotonic(), self.free_at)
            self.free_at = start + seconds
            self.busy.append((start, self.free_at))

    def event(self) -> _Event:
        return _Event(self.free_at)

    def drain(self) -> None:
        _Event(self.free_at).synchronize()

    def busy_fraction(self, t0: float, t1: float) -> float:
        return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in self.busy) / (t1 - t0)


class _Event:
    def __init__(self, at: float) -> None:
        self.at = at

    def query(self) -> bool:
        return time.monotonic() >= self.at

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.at - time.monotonic()))


class StandInEngine(Engine):
    """`Engine` with its model call on a `Device` (``costs``: seconds per shape's requests);
    every other line of the engine runs as it is. ``costs=None``: the call is a no-op."""

    stand_in: Device
    costs: dict[int, float] | None = None

    def _run(self, shape: PackShape) -> None:
        self.packs.buffers[shape].step_K.add_(1)  # what the step changes that the host reads
        if self.costs is not None:
            self.stand_in.launch(self.costs[shape.requests])

    def _copy_flags(self, flags: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if self.costs is None:
            return super()._copy_flags(flags)
        return flags.clone(), self.stand_in.event()


class StandInAdapter:
    """`DiTAdapter`, its reply read waiting for the device's queue when ``drains``."""

    def __init__(self, inner: DiTAdapter, device: Device, drains: bool) -> None:
        self.inner, self.device, self.drains = inner, device, drains

    def request(self, observation: dict[str, Any], session: str) -> Any:
        return self.inner.request(observation, session)

    def reply(self, result: Result) -> dict[str, Any]:
        if self.drains:
            self.device.drain()
        return self.inner.reply(result)


def sizes(arm: str, top: int) -> list[int]:
    if arm == "one_at_a_time":
        return [1]
    if arm == "packed_every":
        return list(range(1, top + 1))
    return [k for k in (1, 2, 4, 8, 16, 32, 64) if k < top] + [top]


def engine_for(model: DiT, args: Any, counts: list[int], variant: str) -> StandInEngine:
    per = longest_context(args) + args.frames
    shapes = tuple(PackShape(frames=n * per, actions=n * args.actions, requests=n)
                   for n in counts)  # fmt: skip
    config = EngineConfig(shapes=shapes, max_steps=args.steps,
                          scheduler=FlowScheduler(solver="multistep2", shift=5.0))  # fmt: skip
    engine = StandInEngine(model, config)
    if variant == "before":
        engine._in_flight = 10**9  # the host never waits: the engine of 40b14ba
    return engine


def _timer(fn: Any, name: str, totals: dict[str, float]) -> Any:
    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            totals[name] += time.perf_counter() - t0

    return wrapper


@contextlib.contextmanager
def timed(engine: Any, totals: dict[str, float]) -> Iterator[None]:
    """Sum the time of the engine's phases (instance attributes shadow the methods) and of
    the state copies of a recomposition (device work on a GPU, host work here)."""
    for name in TIMED:
        setattr(engine, name, _timer(getattr(engine, name), name, totals))
    carry, load = engine_module._carry, Buffers.load
    engine_module._carry = _timer(carry, "_carry", totals)  # type: ignore[assignment]
    Buffers.load = _timer(load, "_load", totals)  # type: ignore[method-assign]
    try:
        yield
    finally:
        engine_module._carry, Buffers.load = carry, load  # type: ignore[method-assign]


def engine_part(model: DiT, args: Any) -> list[dict[str, Any]]:
    adapter = DiTAdapter(frames=args.frames, actions=args.actions, steps=args.steps)
    rows = []
    for arm in ("one_at_a_time", "packed"):
        engine = engine_for(model, args, sizes(arm, 8), "after")
        reqs = [adapter.request(observation(k % 8, args, model.config, k % args.episode_chunks),
                                session=None) for k in range(args.requests)]  # fmt: skip
        totals: dict[str, float] = defaultdict(float)
        steps, nxt, t0 = 0, 0, time.perf_counter()
        with timed(engine, totals):
            while nxt < len(reqs) or engine.active or engine.waiting:
                if nxt < len(reqs) and engine.active + engine.waiting < 8:
                    engine.submit(reqs[nxt])  # one a step: the members sit at different steps
                    nxt += 1
                engine.step()
                steps += 1
        total = time.perf_counter() - t0
        ms = {k.strip("_"): 1e3 * v / steps for k, v in totals.items()}
        phases = {  # exclusive host ms per engine step
            "noise_tokens": ms["member"],  # the joining requests' noise, patchified
            "layout": ms["recompose"] - ms["carry"] - ms["load"],  # build_pack, rows, tables
            "state_copies": ms["carry"] + ms["load"],  # device work on a GPU (async there)
            "admit_other": ms["admit"] - ms["member"] - ms["recompose"],
            "call": ms["run"],  # the stand-in: nothing
            "results": ms["result"],
            "flags": ms["copy_flags"] + ms["read_flags"],
        }
        timed_ms = sum(ms[k] for k in ("admit", "run", "result", "copy_flags", "read_flags"))
        phases["other"] = 1e3 * total / steps - timed_ms  # the step's bookkeeping, the loop
        row = {"arm": arm, "steps": steps, "requests": len(reqs),
               "requests_per_step": args.steps * len(reqs) / steps,
               "step_ms": 1e3 * total / steps, "request_ms": 1e3 * total / len(reqs),
               **{f"{k}_ms": v for k, v in phases.items()}}  # fmt: skip
        rows.append(row)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return rows


def served_part(model: DiT, args: Any, costs: dict[int, float]) -> list[dict[str, Any]]:
    cfg, rows = model.config, []
    for n in [int(x) for x in args.robots.split(",")]:
        for arm in ("one_at_a_time", "packed", "packed_every"):
            for variant in ("before", "after"):
                engine = engine_for(model, args, sizes(arm, min(n, 8)), variant)
                engine.stand_in, engine.costs = Device(), costs
                adapter = StandInAdapter(
                    DiTAdapter(frames=args.frames, actions=args.actions, steps=args.steps),
                    engine.stand_in,
                    drains=variant == "before",
                )
                server = PolicyServer(engine, adapter, ServerConfig(port=0, max_queue=64,
                                                                    deadline_s=600))  # fmt: skip
                with server.running() as address:
                    start = time.monotonic() + args.warmup_s  # run_robots' timed window
                    row = run_robots(address, n, args.chunk_s, args, cfg)
                s = server.summary()
                row.update(arm=arm, variant=variant, robots=n,
                           requests_per_call=s["requests_per_call"], pack_fill=s["pack_fill"],
                           device_busy=engine.stand_in.busy_fraction(start,
                                                                     start + args.duration_s))  # fmt: skip
                rows.append(row)
                print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()},
                      flush=True)  # fmt: skip
    return rows


def round_trip(model: DiT, args: Any) -> list[dict[str, Any]]:
    """One robot, one request at a time, the model call free: the server's own time for a
    chunk (decode, adapter, hand-offs to and from the engine thread, the engine's host work
    for its steps, reply), the median of ``--requests``."""
    cfg, rows = model.config, []
    for arm in ("one_at_a_time", "packed"):
        engine = engine_for(model, args, sizes(arm, 8), "after")
        engine.stand_in, engine.costs = Device(), dict.fromkeys(range(1, 9), 0.0)
        adapter = DiTAdapter(frames=args.frames, actions=args.actions, steps=args.steps)
        server = PolicyServer(engine, adapter, ServerConfig(port=0))
        times = []
        with server.running() as address, PolicyClient(*address) as client:
            for k in range(args.requests + 2):
                obs = observation(0, args, cfg, k % args.episode_chunks)
                t0 = time.perf_counter()
                client.infer(obs)
                times.append(1e3 * (time.perf_counter() - t0))
        rows.append({"arm": arm, "round_trip_ms": summarize(times[2:]).median_ms})
        print(rows[-1], flush=True)
    return rows


def load_costs(path: Path) -> dict[int, float]:
    """Seconds per model call by requests in the shape, 1..8; between two measured shapes
    linear in the requests (the H200's cost is close to linear at these widths)."""
    measured = {
        r["requests"]: r["step_ms"] / 1e3 for r in json.loads(path.read_text())["step_costs"]
    }
    keys = sorted(measured)
    return {n: float(np.interp(n, keys, [measured[k] for k in keys])) for n in range(1, 9)}


def main() -> None:
    p = base_parser(__doc__.split("\n")[0])
    p.add_argument("--parts", default="engine,served")
    p.add_argument("--robots", default="8")
    p.add_argument("--requests", type=int, default=64, help="engine part: requests an arm")
    p.add_argument("--costs", default=str(RESULTS_DIR / "serving_robots_h200.json"),
                   help="a robots.py result JSON: its step_costs are the call times")  # fmt: skip
    p.add_argument("--duration-s", type=float, default=12.0)
    p.add_argument("--warmup-s", type=float, default=1.0)
    args = p.parse_args()
    # The H200 run's request: 16 context frames (+2 a chunk, 4 chunks an episode), 2 frames
    # and 16 actions generated in 10 steps, its latents 48 x 8 x 16 (32 tokens a frame).
    args.context_frames, args.frames, args.actions, args.steps = 16, 2, 16, 10
    args.episode_chunks = 4
    args.chunk_s = 4.0 * 0.157  # --chunk-x 4 times the H200 run's lone request (157 ms)
    if args.quick:
        args.requests, args.duration_s, args.warmup_s, args.robots = 16, 2.0, 0.5, "4"
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    latent = dict(latent_channels=8, latent_hw=(4, 8)) if args.quick else {}
    model = DiT(DiTConfig.tiny(depth=1, frame_causal=True, **latent)).eval()  # never called
    parts = args.parts.split(",")
    costs = load_costs(Path(args.costs))
    rows: list[dict[str, Any]] = []  # each with its part: engine, round_trip, served
    if "engine" in parts:
        engine_rows = [{"part": "engine", **r} for r in engine_part(model, args)]
        print(markdown_table(engine_rows, ["arm", "requests_per_step", "step_ms", "request_ms",
                                           *PHASE_COLUMNS]))  # fmt: skip
        rows += engine_rows
    if "served" in parts:
        trips = [{"part": "round_trip", **r} for r in round_trip(model, args)]
        print(markdown_table(trips, ["arm", "round_trip_ms"]))
        served = [{"part": "served", **r} for r in served_part(model, args, costs)]
        print(markdown_table(served, ["arm", "variant", "robots", "chunks_per_s", "p50_ms",
                                      "p99_ms", "requests_per_call", "pack_fill",
                                      "device_busy"]))  # fmt: skip
        rows += trips + served
    write_json("serving_host_overhead", args, {"rows": rows, "costs_s": costs}, device="cpu")


if __name__ == "__main__":
    main()
