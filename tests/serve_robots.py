"""Shared by the policy-server tests: the tiny engine, engines that misbehave on purpose,
observations, and the reference (the same request alone through a fresh engine)."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from packing.model import DiT, DiTConfig
from packing.serve import Engine, EngineConfig, FlowScheduler, PackShape, Request, Result
from packing.server import DiTAdapter

FRAME = (8, 4, 8)  # (C, H, W) latents of the tiny model
ADAPTER = DiTAdapter(frames=1, actions=4, steps=4)


def model() -> DiT:
    torch.manual_seed(0)
    cfg = DiTConfig.tiny(latent_channels=8, latent_hw=(4, 8), action_dim=6, frame_causal=True)
    return DiT(cfg).eval()


def engine(requests: int = 8, cls: type[Engine] = Engine, **kw: Any) -> Engine:
    shapes = (PackShape(frames=3 * requests, actions=4 * requests, requests=requests),)
    config = EngineConfig(shapes=shapes, scheduler=FlowScheduler(solver="multistep2"))
    return cls(model(), config, **kw)


def observation(seed: int, context_frames: int = 2, **extra: Any) -> dict[str, Any]:
    ctx = np.random.default_rng(seed).standard_normal((context_frames, *FRAME))
    return {"context": ctx.astype(np.float32), "seed": seed, "prompt": f"robot {seed}", **extra}


def alone(obs: dict[str, Any], adapter: DiTAdapter = ADAPTER) -> Result:
    """The same observation's request run alone through a fresh engine (same weights)."""
    e = engine(requests=1)
    e.submit(adapter.request(dict(obs), session="alone"))
    (result,) = e.run()
    return result


def assert_alone(obs: dict[str, Any], reply: dict[str, Any]) -> None:
    ref = alone(obs)
    np.testing.assert_allclose(reply["actions"], ref.action.numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(reply["latents"], ref.latents.numpy(), rtol=0, atol=1e-5)


class SlowEngine(Engine):
    """Each step takes at least ``delay_s`` (a model on a busy GPU); records sessions."""

    delay_s = 0.0

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.ended: list[str] = []
        self.sessions: list[str | None] = []

    def submit(self, request: Request) -> int:  # type: ignore[override]
        self.sessions.append(request.session)
        return super().submit(request)

    def end_session(self, session: str) -> None:
        self.ended.append(session)
        super().end_session(session)

    def step(self) -> list[Result]:
        time.sleep(self.delay_s)
        return super().step()


class GateEngine(SlowEngine):
    """Steps only while ``gate`` is set (a model call that takes as long as a test wants)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.gate = threading.Event()

    def step(self) -> list[Result]:
        self.gate.wait(30)
        return super().step()


class CrashEngine(SlowEngine):
    """A model call over a pack holding a request with task ``"crash"`` raises; a request
    with task ``"fail"`` comes back as a failed `Result` (what the faults helper's engines
    return for a request whose state went bad), the others unchanged."""

    def _run(self, shape: PackShape) -> None:
        if any(m.request.task == "crash" for m in self._members):
            raise RuntimeError("boom inside the model")
        super()._run(shape)

    def _result(self, m: Any) -> Result:
        r = super()._result(m)
        if m.request.task == "fail":
            return Result(r.request_id, r.latents[:0], r.action[:0], r.admitted, r.finished,
                          error="its state became non-finite")  # fmt: skip
        return r


def wait_until(predicate: Any, timeout_s: float = 10.0) -> None:
    """Poll ``predicate`` (bounded); fail the test if it never holds."""
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"not true within {timeout_s} s: {predicate}")
        time.sleep(0.01)


def cli_engine8(device: str) -> tuple[Engine, DiTAdapter]:
    """``packing serve --model serve_robots:cli_engine8``: packs of up to 8 robots."""
    return engine(requests=8, device=device), ADAPTER


def cli_engine(device: str) -> tuple[Engine, DiTAdapter]:
    """``packing serve --model serve_robots:cli_engine``: the tiny engine for the CLI test."""
    return engine(requests=2, device=device), ADAPTER


def log_line(lines: Any, pattern: str, timeout_s: float = 90.0) -> re.Match:
    """The first line from the queue ``lines`` (a server's stderr, read by a thread) that
    matches ``pattern``; an AssertionError naming it after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            m = re.search(pattern, lines.get(timeout=1))
        except queue.Empty:
            continue
        if m:
            return m
    raise AssertionError(f"no log line matching {pattern!r}")


def start_packing_serve(model: str) -> tuple[subprocess.Popen, queue.Queue, int]:
    """``packing serve --model MODEL`` (a ``serve_robots`` factory) as its own process on a
    free port: the process, a queue of its stderr lines (read by a thread) and the port."""
    cmd = [sys.executable, "-m", "packing", "serve", "--port", "0", "--model", model,
           "--summary-every-s", "0.2"]  # fmt: skip
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), str(here)])}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()
    try:
        port = int(log_line(lines, r"serving on ws://127\.0\.0\.1:(\d+)").group(1))
    except BaseException:
        proc.kill()
        raise
    return proc, lines, port


def run_without_host_sync(engine: Any) -> list[Result]:
    """``engine.run()`` with torch's sync debug mode at "error": a host-device sync in a step
    (a blocking copy included) raises. CUDA only; capture and warm-up must come before."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return engine.run()
    finally:
        torch.cuda.set_sync_debug_mode(0)
