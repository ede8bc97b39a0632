"""The context cache behind the policy server: a robot's chunks of one episode reuse the
frames it already sent, each reply equals the same request through an UNCACHED engine, and
the episode's end (or a disconnect) gives its pages back; ``packing serve --context-cache``.

fp32 CPU, every socket on 127.0.0.1, every client call bounded (``T``)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

pytest.importorskip("websockets", reason="needs packing[serve]")
from serve_robots import ADAPTER, FRAME, model, wait_until

from packing.cli import _serve as _serve_command
from packing.cli import build_parser, main
from packing.serve import ContextCache, Engine, EngineConfig, FlowScheduler, PackShape
from packing.server import PolicyClient, PolicyServer, ServerConfig

pytestmark = pytest.mark.usefixtures("one_thread")
T = 20.0
PAGES = 8
SCHED = FlowScheduler(solver="multistep2")


def cached_engine() -> Engine:
    """Shapes count generated frames only (ADAPTER: 1 frame, 4 actions a chunk)."""
    cc = ContextCache(pages=PAGES, page_frames=2, prefill_frames=(1, 2))
    shapes = (
        PackShape(frames=1, actions=4, requests=1),
        PackShape(frames=2, actions=8, requests=2),
    )
    return Engine(model(), EngineConfig(shapes=shapes, scheduler=SCHED, context_cache=cc))


def uncached(obs: dict[str, Any]) -> dict[str, np.ndarray]:
    """The same observation's request alone through an engine without a cache."""
    e = Engine(model(), EngineConfig(shapes=(PackShape(frames=8, actions=4, requests=1),),
                                     scheduler=SCHED))  # fmt: skip
    e.submit(ADAPTER.request(dict(obs), session="alone"))
    (r,) = e.run()
    return {"actions": r.action.numpy(), "latents": r.latents.numpy()}


def rel(reply: dict[str, Any], ref: dict[str, np.ndarray]) -> float:
    return max(float(np.abs(reply[k] - ref[k]).max() / np.abs(ref[k]).max())
               for k in ("actions", "latents"))  # fmt: skip


def chunk(frames: np.ndarray, seen: int, **extra: Any) -> dict[str, Any]:
    return {"context": frames[:seen].copy(), "prompt": "pick", "seed": 3, **extra}


def test_an_episodes_next_chunk_reuses_its_cached_frames_and_equals_uncached():
    engine = cached_engine()
    frames = np.random.default_rng(0).standard_normal((6, *FRAME)).astype(np.float32)
    server = PolicyServer(engine, ADAPTER, ServerConfig(port=0, drain_s=5.0))
    with server.running() as address, PolicyClient(*address, timeout_s=T) as robot:
        deltas = []
        for obs in (chunk(frames, 2), chunk(frames, 4)):  # the second: 2 new frames observed
            before = dict(engine.stats)
            reply = robot.infer(obs)
            assert rel(reply, uncached(obs)) <= 1e-5
            deltas.append({k: engine.stats[k] - before[k] for k in before})
        assert deltas[0]["prefilled_frames"] == 2 and deltas[0]["reused_frames"] == 0
        assert deltas[1]["prefilled_frames"] == 2 and deltas[1]["reused_frames"] == 2
        assert len(engine.packs.pages.free) == PAGES - 2  # the episode keeps its 4 frames' pages
        assert robot.end_episode()["episode"] == "end"
        wait_until(lambda: len(engine.packs.pages.free) == PAGES and not engine.packs.pages.entries)
        obs = chunk(frames, 4)  # a new episode: nothing of the last one is reused
        before = dict(engine.stats)
        assert rel(robot.infer(obs), uncached(obs)) <= 1e-5
        assert engine.stats["reused_frames"] == before["reused_frames"]
    wait_until(lambda: len(engine.packs.pages.free) == PAGES)  # the disconnect ended it


@pytest.mark.parametrize("check_hashes", [True, False])
def test_a_changed_earlier_frame_is_prefilled_again_not_reused(check_hashes):
    """A robot resends its episode with frame 1 changed: it is prefilled again and the reply
    equals uncached. The control (the pool's test hook: reuse by position, no hash check)
    serves the OLD frame 1's keys, i.e. exactly the unchanged episode's answer."""
    engine = cached_engine()
    engine.packs.pages.check_hashes = check_hashes
    frames = np.random.default_rng(1).standard_normal((6, *FRAME)).astype(np.float32)
    changed = frames.copy()
    changed[1] += 0.5
    server = PolicyServer(engine, ADAPTER, ServerConfig(port=0, drain_s=5.0))
    with server.running() as address, PolicyClient(*address, timeout_s=T) as robot:
        robot.infer(chunk(frames, 2))
        before = dict(engine.stats)
        obs = chunk(changed, 4)
        reply = robot.infer(obs)
        d = {k: engine.stats[k] - before[k] for k in before}
    right, stale = uncached(obs), uncached(chunk(frames, 4))
    assert rel(right, stale) > 1e-3  # the change matters to the answer
    if check_hashes:
        assert d["mismatches"] == 1 and d["reused_frames"] == 1 and d["prefilled_frames"] == 3
        assert rel(reply, right) <= 1e-5
    else:
        assert d["reused_frames"] == 2 and rel(reply, stale) <= 1e-5 < rel(reply, right)


def test_packing_serve_context_cache_builds_the_cached_engine():
    args = build_parser().parse_args(["serve", "--mask", "frame-causal", "--context-cache", "32",
                                      "--page-frames", "2", "--prefill-frames", "8",
                                      "--frames", "2", "--actions", "8"])  # fmt: skip
    engine, _ = _serve_command._build(args, "cpu")
    assert engine.config.context_cache == ContextCache(
        pages=32, page_frames=2, prefill_frames=8, context_frames=4
    )  # --context-frames
    # the default shapes: 1, 2, 4, 8 requests of generated frames only (no room for context)
    assert [(s.frames, s.actions, s.requests) for s in engine.shapes] == [
        (2, 8, 1), (4, 16, 2), (8, 32, 4), (16, 64, 8)]  # fmt: skip
    plain, _ = _serve_command._build(build_parser().parse_args(["serve", "--frames", "2"]), "cpu")
    assert plain.config.context_cache is None and plain.shapes[0].frames == 4 + 2


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--context-cache", "16"], r"frame-causal model.*--mask frame-causal"),
        (["--page-frames", "2"], r"--page-frames sizes the context cache; add --context-cache"),
        (["--prefill-frames", "4"], r"--prefill-frames sizes the context cache"),
        (["--context-cache", "0", "--mask", "frame-causal"], r"--context-cache: 0 is below 1"),
        (["--context-cache", "4", "--model", "serve_robots:cli_engine"], r"a factory builds"),
    ],
)
def test_packing_serve_refuses_what_it_cannot_cache_in_one_line(argv, words, capsys):
    assert main(["serve", "--port", "0", *argv]) == 2  # refused before it listens
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("packing serve: error:")
    assert re.search(words, err), err
