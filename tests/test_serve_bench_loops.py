"""The serving benchmark's loops (benchmarks/serving/loops.py) measure what they claim.

A fake engine with a known service time stands in for `packing.serve.Engine`: an open loop
must count latency from each request's arrival (a loop that counted from when it got round to
submitting would hide the queue: coordinated omission), and p99 over 200 requests is not the
maximum.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.serving.loops import closed_loop, open_loop, percentile, poisson_arrivals

CPU = torch.device("cpu")


class FakeEngine:
    """Serves at most ``slots`` requests a step; a step takes ``step_s``; a request needs
    ``steps`` steps. The `Engine` surface the loops use: submit, step, active, waiting, clock."""

    def __init__(self, slots: int, step_s: float, steps: int = 1) -> None:
        self.slots, self.step_s, self.steps = slots, step_s, steps
        self.queue: list[int] = []
        self.running: dict[int, int] = {}
        self.clock = 0
        self.next_id = 0

    def submit(self, request: object) -> int:
        self.next_id += 1
        self.queue.append(self.next_id)
        return self.next_id

    @property
    def active(self) -> int:
        return len(self.running)

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def step(self) -> list[SimpleNamespace]:
        while self.queue and len(self.running) < self.slots:
            self.running[self.queue.pop(0)] = 0
        start = time.perf_counter()
        time.sleep(self.step_s)
        self.longest_s = max(getattr(self, "longest_s", 0.0), time.perf_counter() - start)
        self.clock += 1
        done = []
        for rid in list(self.running):
            self.running[rid] += 1
            if self.running[rid] == self.steps:
                del self.running[rid]
                done.append(SimpleNamespace(request_id=rid))
        return done


def test_open_loop_latency_runs_from_arrival_not_from_submission() -> None:
    # 20 requests offered at 10x the capacity (one request a 20 ms step): they all arrive in
    # ~0.1 s and the last waits for ~19 steps. Counted from arrival its latency is ~0.3 s;
    # counted from submission, as a closed loop does, every latency would be one step.
    got = open_loop(FakeEngine(1, 0.02), list(range(20)), rate=500.0, dev=CPU, seed=0)
    assert got["served"] == 20 and not got["cut"]
    assert got["max_ms"] > 250 and got["p50_ms"] > 100, got
    assert got["served_req_per_s"] < 60  # the engine's capacity (50/s), not the offered rate


def test_open_loop_under_capacity_sees_one_step_of_latency() -> None:
    engine = FakeEngine(4, 0.01)
    got = open_loop(engine, list(range(20)), rate=20.0, dev=CPU, seed=1)
    # Under capacity a request waits at most for the step in progress, then runs its one step:
    # two steps, of however long this (busy) machine made a 10 ms sleep take.
    assert got["served"] == 20 and got["p50_ms"] <= 1e3 * 2 * engine.longest_s + 5, got


def test_p99_over_200_requests_is_not_the_maximum() -> None:
    xs = [float(i) for i in range(1, 201)]
    assert percentile(xs, 0.99) == 198.0 and percentile(xs, 0.5) == 100.0
    assert percentile(xs[:6], 0.99) == 6.0  # six requests: the "p99" is the maximum


def test_poisson_arrivals_have_the_offered_rate() -> None:
    t = poisson_arrivals(4000, 50.0, seed=0)
    assert t == sorted(t) and 45 < len(t) / t[-1] < 55


def test_closed_loop_keeps_c_in_flight_and_reports_percentiles() -> None:
    got = closed_loop(FakeEngine(2, 0.005, steps=3), list(range(12)), 2, CPU)
    assert got["requests"] == 12 and got["engine_steps"] == 18  # 12 requests x 3 steps / 2 slots
    assert got["p50_ms"] <= got["p99_ms"] <= got["max_ms"]
