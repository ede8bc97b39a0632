"""Warm-up: an engine runs every shape and prefill pass before its first request, a server
answers /healthz 503 until its engines have, and in service nothing compiles or captures
(counted), while a shape that was not warmed is an error, not a silent slow path."""

from __future__ import annotations

import http.client
import threading
from typing import Any

import pytest
import torch

from packing.model import DiT, DiTConfig
from packing.serve import ContextCache, Engine, EngineConfig, FlowScheduler, PackShape, Request

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models, 2 busy cores


def _model() -> DiT:
    torch.manual_seed(0)
    cfg = DiTConfig.tiny(latent_channels=8, latent_hw=(4, 8), action_dim=6, frame_causal=True,
                         attention="sdpa")  # fmt: skip
    return DiT(cfg).eval()


def _config(cache: bool) -> EngineConfig:
    return EngineConfig(
        shapes=(PackShape(frames=2, actions=6, requests=2),
                PackShape(frames=4 if cache else 12, actions=12, requests=4)),
        scheduler=FlowScheduler(solver="multistep2", shift=3.0), max_steps=4,
        context_cache=ContextCache(pages=8, page_frames=2, prefill_frames=(1, 3),
                                   context_frames=4) if cache else None,
    )  # fmt: skip


def _request(i: int, frames: int = 3) -> Request:
    g = torch.Generator().manual_seed(i)
    return Request(context=torch.randn(frames, 8, 4, 8, generator=g), frames=1, actions=3,
                   steps=3, seed=i, session=f"s{i}")  # fmt: skip


@pytest.mark.parametrize("cache", [False, True])
def test_warm_up_runs_every_shape_and_then_nothing_compiles(cache):
    model = _model()
    for block in model.blocks:  # dynamo counts the graphs; the eager backend keeps it fast
        block.compile(backend="eager", dynamic=False)
    engine = Engine(model, _config(cache))
    seen: list[tuple[int, int, str]] = []
    stats = engine.warm_up(progress=lambda done, total, label: seen.append((done, total, label)))
    want = 2 * (1 + 2) if cache else 2  # each shape's step (and each of its 2 prefill passes)
    assert [d for d, _, _ in seen] == list(range(1, want + 1)) and {t for _, t, _ in seen} == {want}
    assert seen[0][2] == "pack 2 frames, 6 actions, 2 requests"
    assert stats["shapes"] == want and stats["compiles"] > 0  # not vacuous: it compiled here
    for i in range(5):  # both shapes used, sessions continuing, prefills of 1 and 3 frames
        engine.submit(_request(i % 3, frames=2 + i % 3))
    assert all(r.error is None for r in engine.run())
    assert {2, 4} <= {engine.shape.requests} | {s.requests for s in engine.shapes}
    assert engine.compiles_after_warm_up == 0 and engine.captures_after_warm_up == 0
    assert engine.warm_up() is stats  # once: the shapes are fixed at construction


def test_a_shape_that_was_not_warmed_is_an_error_not_a_slow_path(caplog):
    engine = Engine(_model(), _config(cache=False))
    assert engine.compiles_after_warm_up is None  # not warmed: nothing to count from
    engine.warm_up()
    small = engine.shapes[0]
    engine.packs.steps.keys.discard(small)  # as if the warm-up had missed this shape
    engine.submit(_request(0, frames=1))  # 1 context + 1 generated frame: the small shape
    (r,) = engine.run()
    assert r.error is not None and "was not warmed up" in r.error, r.error
    assert "not warmed up" in caplog.text  # the operator's log has it too
    control = Engine(_model(), _config(cache=False))  # never warmed: runs any shape
    control.submit(_request(0, frames=1))
    assert control.run()[0].error is None and control.shape == small


def test_healthz_says_warming_up_until_the_engines_are_warm_then_ok():
    pytest.importorskip("websockets", reason="needs packing[serve]")
    from serve_robots import ADAPTER, observation
    from websockets.exceptions import InvalidStatus

    from packing.server import PolicyClient, PolicyServer, ServerConfig

    gate, started = threading.Event(), threading.Event()

    class Gated(Engine):
        def warm_up(self, progress: Any = None) -> dict[str, Any]:
            started.set()
            gate.wait(30)
            return super().warm_up(progress)

    model = DiTConfig.tiny(latent_channels=8, latent_hw=(4, 8), action_dim=6, attention="sdpa")
    torch.manual_seed(0)
    engine = Gated(DiT(model).eval(), EngineConfig(shapes=(PackShape(frames=6, actions=8,
                                                                     requests=2),), max_steps=4))  # fmt: skip
    srv = PolicyServer(engine, ADAPTER, ServerConfig(port=0, drain_s=5.0))

    def healthz(host: str, port: int) -> tuple[int, bytes]:
        h = http.client.HTTPConnection(host, port, timeout=10)
        h.request("GET", "/healthz")
        r = h.getresponse()
        return r.status, r.read()

    with srv.running(warm=False) as (host, port):
        assert started.wait(10)
        status, body = healthz(host, port)
        assert status == 503 and body.startswith(b"warming up: engine 0 0 of 0"), body
        with pytest.raises(InvalidStatus, match="503"):
            PolicyClient(host, port, timeout_s=10)
        gate.set()
        srv._warm.wait(30)
        assert healthz(host, port) == (200, b"OK\n")
        with PolicyClient(host, port, timeout_s=30) as c:
            assert c.infer(observation(1))["actions"].shape == (4, 6)
        s = srv.summary()
    assert s["answered"] == 1
    assert s["compiles_after_warm_up"] == 0 and s["captures_after_warm_up"] == 0
