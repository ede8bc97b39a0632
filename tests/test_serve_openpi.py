"""The REAL client (issue 33): the unmodified openpi-client 0.1.2 in its own venv (numpy < 2;
scripts/dev.sh makes it and exports PACKING_OPENPI_PYTHON) talks to packing's server over
127.0.0.1. Eight robot processes are packed together and each one's actions equal the same
request run alone through the engine; a wrong or missing key is refused at the handshake.

In CI (CI=true) a missing openpi venv fails these tests; elsewhere they skip, saying why."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("websockets", reason="needs packing[serve]")
from serve_robots import ADAPTER, GateEngine, alone, engine, log_line, start_packing_serve

from packing.server import PolicyServer, ServerConfig

ROOT = Path(__file__).resolve().parents[1]
ROBOT = Path(__file__).with_name("openpi_robot.py")
pytestmark = pytest.mark.usefixtures("one_thread")


def openpi_python() -> str:
    given = os.environ.get("PACKING_OPENPI_PYTHON")
    path = given or str(ROOT / ".venv-openpi" / "bin" / "python")
    if given and not Path(path).is_file():
        pytest.fail(f"PACKING_OPENPI_PYTHON={given} does not exist")
    if not Path(path).is_file():
        why = (f"no openpi-client venv at {path} (scripts/dev.sh makes it; or set "
               "PACKING_OPENPI_PYTHON)")  # fmt: skip
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(why)  # CI must run the real client, never skip it
        pytest.skip(why)
    return path


def launch(python: str, address, seed: int, folder: Path, key: str | None = None, *extra: str):
    args = [python, str(ROBOT), address[0], str(address[1]), str(seed), str(folder)]
    return subprocess.Popen([*args, key or "-", *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={"PATH": os.environ["PATH"]})  # fmt: skip


def test_eight_openpi_robots_packed_together_each_get_their_own_actions(tmp_path):
    python = openpi_python()
    e = GateEngine(*_engine_args())  # holds the first model call until all 8 have sent
    srv = PolicyServer(e, ADAPTER, ServerConfig(port=0, metadata={"model": "tiny DiT"}))
    with srv.running() as address:
        procs = [launch(python, address, s, tmp_path) for s in range(8)]
        try:
            _wait(lambda: all((tmp_path / f"ready{s}").exists() for s in range(8)), procs)
            (tmp_path / "go").write_text("")
            _wait(lambda: srv.summary()["queued"] == 8, procs)  # every first request is in
            e.gate.set()
            for p in procs:
                out, _ = p.communicate(timeout=60)
                assert p.returncode == 0, out
        finally:
            for p in procs:
                p.kill()
    summary = srv.summary()
    assert summary["answered"] == 16 and summary["max_requests_per_call"] >= 4, summary
    for s in range(8):
        assert json.loads((tmp_path / f"ready{s}").read_text()) == {"model": "tiny DiT"}
        got = np.load(tmp_path / f"robot{s}.npz", allow_pickle=False)
        for k in range(2):
            obs = {"context": got[f"context{k}"], "seed": 10 * s + k, "prompt": f"robot {s}"}
            ref = alone(obs)
            np.testing.assert_allclose(got[f"actions{k}"], ref.action.numpy(), rtol=0, atol=1e-5)
            np.testing.assert_allclose(got[f"latents{k}"], ref.latents.numpy(), rtol=0, atol=1e-5)
            assert got[f"infer_ms{k}"] > 0


def test_openpi_robot_without_the_right_key_is_refused(tmp_path):
    python = openpi_python()
    srv = PolicyServer(engine(), ADAPTER, ServerConfig(port=0, api_key="s3cret"))
    with srv.running() as address:
        for key in (None, "wrong"):
            p = launch(python, address, 0, tmp_path, key)
            out, _ = p.communicate(timeout=60)
            assert p.returncode == 3 and "401" in out, out
        p = launch(python, address, 0, tmp_path, "s3cret")
        try:
            _wait(lambda: (tmp_path / "ready0").exists(), [p])
        finally:
            p.kill()
    assert srv.summary()["failed"] == 0


def test_openpi_robot_gets_a_one_line_error_and_goes_on(tmp_path):
    """A NaN observation: openpi-client raises the server's line (no traceback), and the same
    connection then gets its actions."""
    python = openpi_python()
    with PolicyServer(engine(), ADAPTER, ServerConfig(port=0)).running() as address:
        (tmp_path / "go").write_text("")
        p = launch(python, address, 3, tmp_path, None, "nan")
        out, _ = p.communicate(timeout=60)
    assert p.returncode == 0, out
    error = (tmp_path / "error3").read_text()
    assert error == "Error in inference server:\n'context' holds NaN or inf; send finite values"
    got = np.load(tmp_path / "robot3.npz", allow_pickle=False)
    ref = alone({"context": got["context0"], "seed": 30, "prompt": "robot 3"})
    np.testing.assert_allclose(got["actions0"], ref.action.numpy(), rtol=0, atol=1e-5)


def _engine_args():
    base = engine()
    return base.model, base.config


def _wait(predicate, procs, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        dead = [p for p in procs if p.poll() not in (None, 0)]
        if dead:
            raise AssertionError(f"a robot exited: {dead[0].communicate()[0]}")
        if time.monotonic() > end:
            raise AssertionError(f"not true within {timeout_s} s")
        time.sleep(0.02)


def test_eight_openpi_robots_against_packing_serve_on_the_command_line(tmp_path):
    """What a robot fleet runs: ``packing serve`` as its own process, the unmodified client
    in eight others; each robot's actions equal its request run alone, and model calls held
    several robots' requests (the periodic summary says how many at most)."""
    python = openpi_python()
    server, lines, port = start_packing_serve("serve_robots:cli_engine8")
    procs: list[subprocess.Popen] = []
    try:
        procs = [launch(python, ("127.0.0.1", port), s, tmp_path) for s in range(8)]
        _wait(lambda: all((tmp_path / f"ready{s}").exists() for s in range(8)), procs)
        (tmp_path / "go").write_text("")
        for p in procs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out
        most = int(log_line(lines, r"summary: .*'answered': 16.*'max_requests_per_call': (\d+)")
                   .group(1))  # fmt: skip
        assert most >= 2, most  # the robots shared model calls
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    finally:
        for p in [*procs, server]:
            p.kill()
    for s in range(8):
        got = np.load(tmp_path / f"robot{s}.npz", allow_pickle=False)
        for k in range(2):
            obs = {"context": got[f"context{k}"], "seed": 10 * s + k, "prompt": f"robot {s}"}
            ref = alone(obs)
            np.testing.assert_allclose(got[f"actions{k}"], ref.action.numpy(), rtol=0, atol=1e-5)
