"""How requests reach the engine in the serving benchmark: a closed loop and an open loop.

* closed loop, concurrency C: C requests always in the system (or static batches of B); a
  new request enters when one finishes. Its rate is the engine's capacity at C; its latency
  says nothing about a server under a given load.
* open loop, rate λ: requests arrive on a Poisson clock whatever the engine is doing, the
  way users do. A request that arrives while a step runs waits for the next step boundary;
  its latency is counted from its *arrival*, not from when the loop got to it (no coordinated
  omission). Each step ends with a device sync, as a server that returns results must.

Latency percentiles come from at least as many requests as the caller passes (≥ 200 in the
GPU run): with 6 requests a "p99" is the maximum.
"""

from __future__ import annotations

import math
import random
import time
from typing import Any

import torch


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


def percentile(sorted_xs: list[float], q: float) -> float:
    """The nearest-rank percentile of sorted values (q in [0, 1])."""
    return sorted_xs[min(len(sorted_xs) - 1, max(0, math.ceil(q * len(sorted_xs)) - 1))]


def closed_loop(engine: Any, reqs: list[Any], C: int, dev: torch.device,
                batch: int = 0) -> dict[str, Any]:  # fmt: skip
    """C requests always in the system (``batch``: static batches of that many instead, the
    next batch when the whole batch is done). Latency runs from the stream position where a
    request was submitted to the end of the step that finished it."""
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
        if batch:
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
    return {"req_per_s": rate, "p50_ms": 1e3 * percentile(lat, 0.5),
            "p99_ms": 1e3 * percentile(lat, 0.99), "max_ms": 1e3 * lat[-1],
            "requests": n, "engine_steps": engine.clock, "outputs": outputs}  # fmt: skip


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """``n`` arrival times (seconds from 0) of a Poisson process of ``rate`` per second."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def open_loop(engine: Any, reqs: list[Any], rate: float, dev: torch.device, seed: int = 0,
              max_s: float = 60.0) -> dict[str, Any]:  # fmt: skip
    """Requests arrive at ``rate`` per second (Poisson), whatever the engine is doing.

    The loop: submit every request whose arrival time has passed, run one engine step, sync
    (the server hands results back), stamp the finished ones with the host clock. An idle
    engine sleeps until the next arrival. ``max_s``: stop admitting after that long (an
    overloaded engine's queue only grows); requests still unfinished count as not served."""
    times = poisson_arrivals(len(reqs), rate, seed)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    arrive: dict[int, float] = {}
    latency: list[float] = []
    nxt = 0
    t0 = time.perf_counter()
    while nxt < len(reqs) or engine.active or engine.waiting:
        now = time.perf_counter() - t0
        if now > max_s and nxt < len(reqs):
            break
        while nxt < len(reqs) and times[nxt] <= now:
            arrive[engine.submit(reqs[nxt])] = times[nxt]
            nxt += 1
        if not (engine.active or engine.waiting):
            time.sleep(max(0.0, times[nxt] - now))
            continue
        finished = engine.step()
        sync()
        end = time.perf_counter() - t0
        latency += [end - arrive[r.request_id] for r in finished]
    wall = time.perf_counter() - t0
    lat = sorted(latency)
    served = len(lat)
    return {
        "offered_req_per_s": rate,
        "served_req_per_s": served / wall if wall > 0 else 0.0,
        "requests": len(reqs),
        "served": served,
        "p50_ms": 1e3 * percentile(lat, 0.5) if lat else None,
        "p99_ms": 1e3 * percentile(lat, 0.99) if lat else None,
        "max_ms": 1e3 * lat[-1] if lat else None,
        "cut": nxt < len(reqs),
    }
