"""How far the engine's host runs ahead of the device: one model call, no more.

Each step launches its model call and then waits for the call before it, so the device always
has the next call queued while the host admits, and a request that arrives joins the pack
within two calls. A host that never waits would queue every member's remaining calls at once
(a step on the host takes ~1 ms, on a GPU 15-100 ms): a request arriving meanwhile could join
only after all of them, and each result would come back only when the whole queue had run
(part of what the H200 robots run lost: benchmarks/reports/2026-12-02_serve_host_overhead.md).

The device is played by flag events that complete only when the host waits for them (a GPU
far behind the host), so the tests see every wait the host makes, on the CPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from late_flags import LateEvent, flags_arrive_late
from serve_robots import engine as tiny_engine

from packing.serve import Engine, Request, Result

pytestmark = pytest.mark.usefixtures("one_thread")

FRAME = (8, 4, 8)  # the tiny DiT's latent (C, H, W)


def _request(i: int) -> Request:
    ctx = torch.randn(1 + i % 2, *FRAME, generator=torch.Generator().manual_seed(i))
    return Request(context=ctx, frames=1, actions=4, seed=i, steps=2 + i % 3)


@pytest.fixture
def behind(monkeypatch: pytest.MonkeyPatch) -> list[LateEvent]:
    """Every model call's flags come with a `LateEvent`, listed in call order."""
    return flags_arrive_late(monkeypatch)


def _serve(engine: Any, events: list[LateEvent]) -> tuple[list[Result], list[int]]:
    """A request submitted before each of the first steps, then steps until idle; returns
    what came back and, after each step, the model calls launched and not waited for."""
    out: list[Result] = []
    unread: list[int] = []
    for i in range(30):
        if i < 6:
            engine.submit(_request(i))
        elif not (engine.active or engine.waiting):
            break
        new = engine.step()
        unread.append(sum(not e.done for e in events))
        for r in new:  # finished at call r.finished, handed out after the next one
            assert engine.clock - r.finished <= 2, "a result came back more than a call late"
        out += new
    assert not (engine.active or engine.waiting)
    return out, unread


def test_a_step_waits_for_the_call_before_its_own_and_no_further(behind):
    engine = tiny_engine(requests=4)
    out, unread = _serve(engine, behind)
    assert unread[:-1] == [1] * (len(unread) - 1)  # its own call still runs: it never waited
    assert unread[-1] == 0  # idle: nothing left to overlap, every result handed out
    assert sorted(r.request_id for r in out) == list(range(6))
    assert all(r.error is None for r in out)


def test_control_a_host_that_never_waits_fails_the_check(behind, monkeypatch):
    monkeypatch.setattr(Engine, "_in_flight", 10**9)
    with pytest.raises(AssertionError, match="more than a call late"):
        _serve(tiny_engine(requests=4), behind)


def test_a_results_copies_are_queued_before_the_flags_that_hand_it_out(monkeypatch):
    """`to_host` reads a handed-out result on a side stream, waiting for nothing: right only
    if the flag event that released it was queued after the result's own copies."""
    log: list[tuple[str, int]] = []
    engine = tiny_engine(requests=4)
    result, copy = type(engine)._result, Engine._copy_flags

    def logged_result(self: Any, m: Any) -> Result:
        log.append(("result", self.clock))
        return result(self, m)

    def logged_copy(self: Any, flags: torch.Tensor) -> Any:
        log.append(("flags", self.clock))
        return copy(self, flags)

    monkeypatch.setattr(type(engine), "_result", logged_result)
    monkeypatch.setattr(Engine, "_copy_flags", logged_copy)
    for i in range(4):
        engine.submit(_request(i))
    assert len(engine.run()) == 4
    finished = [c for kind, c in log if kind == "result"]
    assert finished
    for c in finished:
        assert log.index(("result", c)) < log.index(("flags", c))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a side stream needs a GPU")
def test_to_host_reads_a_result_without_waiting_for_the_calls_queued_after_it():
    from packing.serve._device import to_host

    x = torch.randn(64, 6, device="cuda")
    want = x.cpu()
    torch.cuda._sleep(2_000_000_000)  # cycles, about a second: the next model call, queued
    got = to_host(x)
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy, "to_host waited for the work queued on the engine's stream after the result"
    assert torch.equal(got, want)
    torch.cuda._sleep(2_000_000_000)  # the control: .cpu() on the engine's stream waits
    assert torch.equal(x.cpu(), want)
    assert torch.cuda.current_stream().query()
