"""The policy server (issue 33): many robots in one pack, episodes, limits, and every fault of
the issue, each bounded in time (client timeouts, bounded waits) and stopping by itself.

Every socket is on 127.0.0.1. The openpi-client run is in tests/test_serve_openpi.py."""

from __future__ import annotations

import http.client
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("websockets", reason="needs packing[serve]")
from serve_robots import (
    ADAPTER,
    CrashEngine,
    GateEngine,
    SlowEngine,
    assert_alone,
    engine,
    log_line,
    observation,
    start_packing_serve,
    wait_until,
)
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from packing.server import DiTAdapter, PolicyClient, PolicyServer, ServerConfig, ServerError
from packing.server._wire import encode

pytestmark = pytest.mark.usefixtures("one_thread")
T = 20.0  # every client call's time limit


def server(e=None, **config) -> PolicyServer:
    config = {"drain_s": 5.0, **config}
    return PolicyServer(e if e is not None else engine(), ADAPTER,
                        ServerConfig(port=0, **config))  # fmt: skip


def robots(address, observations, **kw) -> list:
    """One thread (one connection) per observation list, all at once; their replies."""
    out: list = [None] * len(observations)

    def run(i: int) -> None:
        with PolicyClient(*address, timeout_s=T, **kw) as c:
            out[i] = [c.infer(o) for o in observations[i]]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(observations))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * T)
    assert all(o is not None for o in out), "a robot did not finish"
    return out


def one(address, obs, **kw) -> dict:
    """One robot, one observation, in this thread: its reply (or the ServerError)."""
    with PolicyClient(*address, timeout_s=T, **kw) as c:
        return c.infer(obs)


def test_robots_share_model_calls_and_each_gets_its_own_answer():
    e = GateEngine(*_engine_args())  # the first model call waits until all four are queued
    srv = server(e)
    obs = [[observation(10 * r + k) for k in range(2)] for r in range(4)]
    with srv.running() as address:
        opener = threading.Thread(target=lambda: (wait_until(lambda: srv.summary()["queued"] == 4),
                                                  e.gate.set()))  # fmt: skip
        opener.start()
        replies = robots(address, obs)
        opener.join(T)
    for mine, theirs in zip(obs, replies, strict=True):
        for o, reply in zip(mine, theirs, strict=True):
            assert_alone(o, reply)
            assert reply["server_timing"]["infer_ms"] > 0
    s = srv.summary()
    assert s["answered"] == 8 and s["failed"] == 0
    assert s["max_requests_per_call"] >= 2, s  # packed: robots shared model calls


def test_metadata_on_connect_and_healthz():
    srv = server(metadata={"model": "tiny", "actions": 4})
    with srv.running() as (host, port), PolicyClient(host, port, timeout_s=T) as c:
        assert c.metadata == {"model": "tiny", "actions": 4}
        h = http.client.HTTPConnection(host, port, timeout=T)
        h.request("GET", "/healthz")
        r = h.getresponse()
        assert (r.status, r.read()) == (200, b"OK\n")


def test_off_loopback_needs_an_api_key():
    with pytest.raises(ValueError, match="needs an API key"):
        ServerConfig(host="0.0.0.0")
    ServerConfig(host="0.0.0.0", api_key="k3y")  # with one it starts


def test_a_wrong_or_missing_key_is_refused_at_the_handshake():
    srv = server(api_key="s3cret")
    with srv.running() as address:
        for key in (None, "wrong", "s3cre", "S3CRET"):
            with pytest.raises(InvalidStatus, match="401"):
                PolicyClient(*address, api_key=key, timeout_s=T)
        reply = one(address, observation(1), api_key="s3cret")
        assert_alone(observation(1), reply)


def test_bad_messages_get_one_line_and_the_connection_goes_on():
    """Garbage, text frames, lying array headers (the old wire read a float64 body as
    float32 bytes and served frame 0 of a [-1, C, H, W] shape), NaN, unknown keys."""
    ctx = observation(3)["context"]
    lying = [
        {b"__ndarray__": True, b"data": ctx.tobytes(), b"dtype": "<f8", b"shape": list(ctx.shape)},
        {b"__ndarray__": True, b"data": ctx.tobytes(), b"dtype": "<f4", b"shape": [-1, 8, 4, 8]},
        {b"__ndarray__": True, b"data": b"\x80\x03", b"dtype": "|O", b"shape": [1]},
        {b"__ndarray__": True, b"data": b"", b"dtype": "<f4", b"shape": [2**40, 8]},
    ]
    nan = ctx.copy()
    nan[1, 2, 3, 4] = np.nan
    bad = [b"\xc1\xff garbage", "a text frame", encode([1, 2]), encode({"context": nan}),
           encode({"context": ctx, "step": 3}), encode({"context": ctx, "episode": "pause"}),
           encode({"context": ctx[:, :3]})]  # fmt: skip
    bad += [encode({"context": x}) for x in lying]
    want = ["not msgpack", "text frame", "one msgpack map", "NaN or inf", "unknown observation",
            "episode", "the model takes", "header says", "give at most", "not accepted",
            "max_array_bytes"]  # fmt: skip
    with server().running() as address, connect(_uri(address), open_timeout=T) as ws:
        ws.recv(timeout=T)  # metadata
        for data, words in zip(bad, want, strict=True):
            ws.send(data)
            reply = ws.recv(timeout=T)
            assert isinstance(reply, str) and "\n" not in reply and words in reply, reply
        ws.send(encode(observation(3)))  # the same connection still works
        assert_alone(observation(3), PolicyClient._recv(_Wrap(ws)))


class _Wrap:  # PolicyClient._recv on a raw connection
    def __init__(self, ws) -> None:
        self._ws, self.timeout_s, self.max_message_bytes = ws, T, 2**30


def test_a_nan_request_does_not_touch_a_good_one_in_the_same_pack():
    e = GateEngine(*_engine_args())
    with server(e).running() as address:
        good = threading.Thread(target=lambda: out.append(one(address, observation(5))))
        out: list = []
        good.start()
        wait_until(lambda: e.waiting + e.active == 1)
        nan = observation(6)
        nan["context"][0, 0, 0, 0] = np.inf
        with pytest.raises(ServerError, match="NaN or inf"):
            one(address, nan)
        e.gate.set()
        good.join(T)
    assert_alone(observation(5), out[0])


def _engine_args():
    base = engine()
    return base.model, base.config


def test_full_queue_answers_busy_at_once_and_never_waits():
    e = GateEngine(*_engine_args())
    with server(e, max_queue=1).running() as address:
        first = threading.Thread(target=lambda: one(address, observation(1)))
        first.start()
        wait_until(lambda: e.waiting + e.active == 1)
        # the gate holds the first request until after this reply: a server that waited for
        # room in the queue would not answer before the client's time limit
        with pytest.raises(ServerError, match="busy"):
            one(address, observation(2))
        e.gate.set()
        first.join(T)


def test_a_request_past_its_deadline_is_cancelled_and_says_so():
    """The engine loop expires a request past ``deadline_s`` between steps; the server goes
    on. Load only slows the first request (it cannot finish first); the second has the whole
    deadline for two steps of a tiny model (it had 50 ms of slack once, and failed under
    load)."""
    e = SlowEngine(*_engine_args())
    e.delay_s = 0.25
    with server(e, deadline_s=4.0).running() as address:
        with pytest.raises(ServerError, match="deadline: no result after"):
            one(address, observation(1, steps=40))  # 40 x 250 ms: 10 s, the deadline 4 s
        wait_until(lambda: e.active + e.waiting == 0)  # cancelled in the engine too
        e.delay_s = 0.0  # the model is quick again
        reply = one(address, observation(2, steps=2))  # still serving
    assert reply["actions"].shape == (4, 6)


def test_clients_that_vanish_after_sending_lose_nobody_else_anything():
    """The old server died with OSError for everyone when a client left after sending."""
    e = SlowEngine(*_engine_args())
    e.delay_s = 0.01
    with server(e).running() as address:
        done: list = []
        steady = threading.Thread(
            target=lambda: done.append(robots(address, [[observation(k) for k in range(6)]]))
        )
        steady.start()
        for k in range(8):  # send, then vanish before the reply
            with connect(_uri(address), open_timeout=T) as ws:
                ws.recv(timeout=T)
                ws.send(encode(observation(100 + k, steps=20)))
        steady.join(3 * T)
        wait_until(lambda: e.active + e.waiting == 0)  # their requests were dropped
        assert len(done) == 1
    for k, reply in enumerate(done[0][0]):
        assert_alone(observation(k), reply)


def test_disconnect_mid_frame_slow_clients_and_raw_garbage():
    """A frame header announcing 2^62 bytes (the old wire reserved ~1 GiB per connection),
    a frame cut off in the middle, a client that trickles bytes, TCP garbage before any
    handshake: each costs its own connection only."""
    with server(max_message_bytes=2**20).running() as address:
        huge = _raw_ws(address)
        huge.sendall(b"\x82\xff" + (2**62).to_bytes(8, "big") + b"\0\0\0\0")
        assert _closed_by_server(huge)  # 1009 before reading a payload byte
        huge.close()
        cut = _raw_ws(address)
        cut.sendall(b"\x82\xfe\x10\x00\0\0\0\0" + b"x" * 100)  # 4,096 announced, 100 sent
        cut.close()
        slow = _raw_ws(address)
        slow.sendall(b"\x82")  # one byte; the rest never comes
        junk = socket.create_connection(address, timeout=T)
        junk.sendall(b"\x00\xffnot http at all\r\n\r\n")
        # held up by the slow one, this would wait for slow.close() below: past its time limit
        reply = one(address, observation(9))
        assert_alone(observation(9), reply)
        slow.close()
        junk.close()


def _raw_ws(address) -> socket.socket:
    """A websocket handshake by hand, then the metadata frame read: the socket is open."""
    s = socket.create_connection(address, timeout=T)
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")  # fmt: skip
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += s.recv(4096)
    assert buf.startswith(b"HTTP/1.1 101")
    return s


def _closed_by_server(s: socket.socket) -> bool:
    end = time.monotonic() + T
    while time.monotonic() < end:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return True
        if not chunk:
            return True
        if b"\x88" in chunk:  # a close frame
            return True
    return False


def test_a_crash_inside_one_request_fails_it_alone(caplog):
    e = CrashEngine(*_engine_args())
    with caplog.at_level(logging.ERROR, "packing.serve"), server(e).running() as address:
        # the engine isolates the request whose model call raises (Result.error, one line)
        with pytest.raises(ServerError, match="the model call raised RuntimeError") as crash:
            one(address, observation(1, prompt="crash"))
        assert "\n" not in str(crash.value) and "Traceback" not in str(crash.value)
        with pytest.raises(ServerError, match="non-finite"):
            one(address, observation(2, prompt="fail"))
        reply = one(address, observation(3))
    assert "boom inside the model" in caplog.text  # the traceback is in the server log
    assert_alone(observation(3), reply)


def test_episodes_are_sessions_and_end_on_disconnect():
    e = SlowEngine(*_engine_args())
    with server(e).running() as address, PolicyClient(*address, timeout_s=T) as c:
        c.infer(observation(1))
        c.infer(observation(2))
        assert c.end_episode()["episode"] == "end"
        c.infer(observation(3, episode="start"))
        c.infer(observation(4, episode="end"))
        c.infer(observation(5))
    wait_until(lambda: len(e.ended) == 3)
    rid = e.sessions[0].split("/")[0]
    assert e.sessions == [f"{rid}/0", f"{rid}/0", f"{rid}/1", f"{rid}/1", f"{rid}/2"]
    assert e.ended == [f"{rid}/0", f"{rid}/1", f"{rid}/2"]  # the last one at disconnect


def test_two_engines_each_robot_sticks_to_one():
    engines = [SlowEngine(*_engine_args()), SlowEngine(*_engine_args())]
    srv = PolicyServer(engines, ADAPTER, ServerConfig(port=0))
    obs = [[observation(10 * r + k) for k in range(3)] for r in range(4)]
    with srv.running() as address:
        replies = robots(address, obs)
    for mine, theirs in zip(obs, replies, strict=True):
        for o, reply in zip(mine, theirs, strict=True):
            assert_alone(o, reply)
    for e in engines:
        robots_here = {s.split("/")[0] for s in e.sessions}
        assert len(e.sessions) == 6 and len(robots_here) == 2  # 2 robots, all their requests


def test_stop_drains_in_flight_requests_then_refuses_connections():
    """Deterministic under load: the request is held in its model call by a gate (an event,
    not a clock) while the server drains, and drain_s is far longer than any wait here."""
    e = GateEngine(*_engine_args())
    stepping = threading.Event()
    step = e.step
    e.step = lambda: (stepping.set(), step())[1]  # type: ignore[method-assign]
    srv = server(e, drain_s=T)
    out: list = []
    with srv.running() as address:
        t = threading.Thread(target=lambda: out.append(one(address, observation(1, steps=30))))
        t.start()
        assert stepping.wait(T)  # in the engine, its model call held by the gate
        srv.stop()
        wait_until(lambda: _status(address) == 503, T)  # draining: /healthz says so
        with pytest.raises(InvalidStatus, match="503"):
            PolicyClient(*address, timeout_s=T)  # refused while draining
        e.gate.set()  # now the request may finish: it is answered although stop came first
    t.join(T)
    assert_alone(observation(1, steps=30), out[0])
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(address, timeout=T)


def _status(address) -> int:
    h = http.client.HTTPConnection(*address, timeout=T)
    h.request("GET", "/healthz")
    return h.getresponse().status


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_packing_serve_runs_until_a_signal_drains_and_closes_the_port(sig):
    proc, lines, port = start_packing_serve("serve_robots:cli_engine")
    try:
        with PolicyClient("127.0.0.1", port, timeout_s=T) as c:
            assert c.metadata["model"] == "serve_robots:cli_engine"
            obs = observation(1, steps=20)
            assert_alone(obs, c.infer(obs))
            log_line(lines, r"summary: .*'answered': 1")  # the periodic summary
            c._ws.send(encode(obs))  # in flight when the signal comes
            time.sleep(0.05)
            proc.send_signal(sig)
            assert_alone(obs, c._recv())  # drained: answered after the signal
        assert proc.wait(timeout=T) == 0
    finally:
        proc.kill()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=T)


def test_the_example_robots_get_what_each_request_gives_alone(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import policy_server

    demo = policy_server.run_demo(clients=3, rounds=2)
    assert sorted((c, r) for c, r, *_ in demo["exchanges"]) == [(c, r) for c in range(3)
                                                                for r in range(2)]  # fmt: skip
    for _, _, obs, latents, actions in demo["exchanges"]:
        assert_alone(obs, {"latents": latents, "actions": actions})
    assert demo["summary"]["answered"] == 6
    assert policy_server.main(["--clients", "0"]) == 2
    assert "give 1 or more robots" in capsys.readouterr().err


def _uri(address) -> str:
    return f"ws://{address[0]}:{address[1]}"


def test_packing_serve_imports_without_the_serve_extra():
    """websockets and msgpack are optional: the engine works without them, and the server
    says which extra to install."""
    code = (
        "import sys; sys.modules['msgpack'] = None; sys.modules['websockets'] = None\n"
        "import packing.serve, packing.server as s\n"
        "try:\n    s._wire.encode({})\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install -e '.[serve]'" in out.stdout, out.stderr


def test_a_diffusers_wan_behind_the_server_with_wan_adapter():
    """A VideoEngine (ServedWan) served to robots: each reply equals the same VideoRequest
    alone through the engine; a NaN in one robot's context is refused, the other served."""
    pytest.importorskip("diffusers")
    import torch

    from packing.integrations.diffusers import ServedWan, install
    from packing.integrations.diffusers.testing import tiny_wan
    from packing.serve import VideoEngine, VideoShape
    from packing.server import WanAdapter

    def wan_engine() -> VideoEngine:
        torch.manual_seed(0)
        served = ServedWan(install(tiny_wan("2.2"), latent_hw=(4, 6)))
        return VideoEngine(served, [VideoShape(frames=8, text=16, requests=4)], max_steps=4)

    def text_encoder(prompt: str) -> torch.Tensor:  # a stand-in: (L, 24) from the words
        g = torch.Generator().manual_seed(sum(map(ord, prompt)))
        return torch.randn(len(prompt.split()), 24, generator=g)

    adapter = WanAdapter(text_encoder=text_encoder, frames=2, steps=3)
    rng = np.random.default_rng(0)
    obs = [{"context": rng.standard_normal((1, 48, 4, 6)).astype(np.float32), "seed": k,
            "prompt": "pick up the cup" if k else "open"} for k in range(3)]  # fmt: skip
    nan = {**obs[0], "context": obs[0]["context"].copy()}
    nan["context"][0, 5, 1, 1] = np.nan
    served, gate = wan_engine(), threading.Event()  # its model calls wait for the gate
    step = served.step
    served.step = lambda: (gate.wait(T), step())[1]  # type: ignore[method-assign]
    srv = PolicyServer(served, adapter, ServerConfig(port=0))
    with srv.running() as address:
        with pytest.raises(ServerError, match="NaN or inf"):
            one(address, nan)  # refused at submit: no model call
        opener = threading.Thread(target=lambda: (
            wait_until(lambda: srv.summary()["queued"] == 3), gate.set()))  # fmt: skip
        opener.start()  # the first call waits until all three robots are queued
        replies = robots(address, [[o] for o in obs])
        opener.join(T)
    for o, (reply,) in zip(obs, replies, strict=True):
        e = wan_engine()
        e.submit(adapter.request(o, session="alone"))
        (ref,) = e.run()
        assert set(reply) == {"latents", "server_timing"}
        np.testing.assert_allclose(reply["latents"], ref.latents.numpy(), rtol=0, atol=1e-5)
    assert srv.summary()["max_requests_per_call"] >= 2


def test_the_connection_limit_is_checked_in_the_handshake():
    srv = server(max_connections=2)
    with srv.running() as address:
        with (
            PolicyClient(*address, timeout_s=T),
            PolicyClient(*address, timeout_s=T),
            pytest.raises(InvalidStatus, match="503"),
        ):
            PolicyClient(*address, timeout_s=T)
        wait_until(lambda: srv.summary()["connections"] == 0)
        assert one(address, observation(1))["actions"].shape == (4, 6)  # a slot is free again


def test_metadata_msgpack_cannot_send_is_refused_at_construction():
    with pytest.raises(TypeError, match="metadata cannot be sent"):
        server(metadata={"shape": object()})


def test_an_encoder_that_crashes_fails_its_observation_only(caplog):
    def encoder(images):
        raise RuntimeError("camera driver fell over")

    srv = PolicyServer(engine(), DiTAdapter(actions=4, steps=4, encoder=encoder),
                       ServerConfig(port=0))  # fmt: skip
    images = np.zeros((1, 4, 4, 3), np.uint8)
    with caplog.at_level(logging.ERROR, "packing.serve"), srv.running() as address:
        c = PolicyClient(*address, timeout_s=T)
        with pytest.raises(ServerError, match=r"could not be made a request \(RuntimeError\)"):
            c.infer({"images": images})
        assert_alone(observation(2), c.infer(observation(2)))  # the connection goes on
        c.close()
    assert "camera driver fell over" in caplog.text
