"""The policy server: robots speak openpi's websocket protocol, one continuous batcher packs them.

::

    robot 0 --\\    ws://host:port                +------------------------------------+
    robot 1 ---+-- (openpi-client, or           --| asyncio: handshake (key, limits),    |
    robot 2 --/    packing.server.PolicyClient)    | decode + validate, adapter, await    |
                                                  +----------------+-------------------+
                                                                   | Job (thread-safe future)
                                                    EngineLoop per engine: submit, step, reply

A connection is one robot: it gets the server's metadata on connect, then sends an
observation and waits for its reply, so its requests stay in order; ``"episode": "start"`` /
``"end"`` in an observation (or alone) start and end its episode, the engine's session
(`Request.session` is ``"<connection>/<episode>"``), which also ends when it disconnects.
With several engines (one per GPU) a robot sticks to the least-loaded one at connect.

Safe by default (`ServerConfig`): binds 127.0.0.1; any other address needs an API key
(``Authorization: Api-Key <key>``, compared in constant time); message size, connections and
queued requests are bounded and checked before anything is allocated; a bad message gets one
line back (a text frame: openpi-client raises it) and the server goes on; tracebacks stay in
the log. SIGINT/SIGTERM (`serve_forever`) or `stop` drains: ``/healthz`` answers 503 and
new connections and messages are refused, every reply owed (a message already received) is
sent, within ``drain_s``, then the connections close. At construction the server refuses
an engine listed twice and an engine that refuses the adapter's default request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import http
import itertools
import logging
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from packing.serve import Engine
from packing.server._adapter import Adapter, DiTAdapter, episode_control
from packing.server._config import ServerConfig
from packing.server._extra import serve_extra
from packing.server._stats import summary
from packing.server._wire import WireError, decode, encode
from packing.server._worker import EngineLoop, Job, Outcome, _one_line

__all__ = ["PolicyServer"]

log = logging.getLogger("packing.serve")


def _websockets() -> Any:
    return serve_extra("websockets.asyncio.server")


@dataclass
class _Robot:
    """One connection: which engine it sticks to and its current episode (session)."""

    id: int
    loop: EngineLoop
    adapter: Any = None  # told too, if it keeps a session's state (``end_session``)
    episode: int = 0
    used: bool = False  # the current session has had a request (so there is one to end)

    @property
    def session(self) -> str:
        return f"{self.id}/{self.episode}"

    def next_episode(self) -> None:
        """End the current session if it had a request (the next request starts a new one):
        the engine frees its cache, the adapter what it keeps for the episode."""
        if self.used:
            self.loop.end_session(self.session)
            self._tell_adapter("end_session")
            self.episode, self.used = self.episode + 1, False

    def unserved(self) -> None:
        """The request just built for this robot was not served: the adapter undoes what it
        recorded for it (``adapter.unserved``, if it keeps state), so the robot may retry."""
        self._tell_adapter("unserved")

    def _tell_adapter(self, hook: str) -> None:
        """``adapter.<hook>(session)``, if the adapter keeps state per episode and so has it."""
        call = getattr(self.adapter, hook, None)
        if call is not None:
            try:
                call(self.session)
            except Exception:  # the adapter's own fault: logged, the robot goes on
                log.exception("robot %d: adapter.%s failed", self.id, hook)


class PolicyServer:
    """``PolicyServer(engine_or_engines, adapter=None, config=ServerConfig())``.

    ``engines``: one `Engine`/`VideoEngine`, or one per GPU (a robot sticks to one);
    ``adapter``: observations to requests and results to replies (default `DiTAdapter()`
    for `Engine`s; a `VideoEngine` needs e.g. `WanAdapter`). ``serve_forever()`` runs until
    SIGINT/SIGTERM; ``with server.running() as (host, port):`` runs it on a thread.
    """

    def __init__(
        self, engines: Any, adapter: Adapter | None = None, config: ServerConfig | None = None
    ) -> None:
        self.config = config if config is not None else ServerConfig()
        if not isinstance(self.config, ServerConfig):
            raise TypeError(f"PolicyServer config must be a ServerConfig, got "
                            f"{type(self.config).__name__}")  # fmt: skip
        listed = list(engines) if isinstance(engines, Sequence) else [engines]
        if not listed:
            raise ValueError("PolicyServer engines=[]: give at least one engine")
        for i, e in enumerate(listed):
            if not all(hasattr(e, n) for n in ("submit", "step", "cancel", "end_session")):
                raise TypeError(f"PolicyServer engines: a {type(e).__name__} is not an engine "
                                "(an Engine or VideoEngine, or a list of them)")  # fmt: skip
            if any(e is other for other in listed[:i]):  # two loops would step one engine
                raise ValueError(
                    f"PolicyServer engines: engine {i} is engine "
                    f"{next(j for j, o in enumerate(listed) if o is e)} again ([engine] * 2?); "
                    "an engine serves one slot: build one engine per GPU"
                )
        if adapter is None:
            if not all(isinstance(e, Engine) for e in listed):
                raise ValueError("a VideoEngine needs an adapter: pass adapter=WanAdapter(...)")
            adapter = DiTAdapter()
        if not (hasattr(adapter, "request") and hasattr(adapter, "reply")):
            raise TypeError(f"PolicyServer adapter: a {type(adapter).__name__} has no request() "
                            "and reply(); pass DiTAdapter(...), WanAdapter(...) or your own")  # fmt: skip
        try:  # every robot gets it on connect: a value msgpack cannot send fails here, once
            encode(self.config.metadata)
        except (TypeError, ValueError) as e:
            raise TypeError(f"ServerConfig.metadata cannot be sent: {e}") from None
        for i, engine in enumerate(listed):
            _check_default_request(adapter, engine, i)
        self.adapter = adapter
        self.engines = listed
        self.loops = [EngineLoop(e, name=f"engine {i}", max_queue=self.config.max_queue)
                      for i, e in enumerate(listed)]  # fmt: skip
        self.address: tuple[str, int] | None = None
        self._ids = itertools.count()
        self._open = 0
        self._draining = False
        self._owed = 0  # messages received and not yet answered (their reply not sent)
        self._settled: asyncio.Event | None = None  # set while nothing is owed
        self._ready = threading.Event()  # listening
        self._warm = threading.Event()  # every engine's warm-up ended (well or not)
        self._serving = False  # every engine warmed up: robots are accepted
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._started = time.monotonic()

    # -- running it -------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Serve until SIGINT or SIGTERM, then drain and close (the listener first)."""
        asyncio.run(self._main(signals=True))

    @contextmanager
    def running(self, timeout_s: float = 30.0, *, warm: bool = True) -> Iterator[tuple[str, int]]:
        """Serve on a background thread; yields ``(host, port)`` once listening (within
        ``timeout_s``) and, with ``warm``, once every engine has warmed up (however long
        that takes); drains and stops on exit."""
        errors: list[BaseException] = []

        def run() -> None:
            try:
                asyncio.run(self._main(signals=False))
            except BaseException as e:
                errors.append(e)
                self._ready.set()
                self._warm.set()

        thread = threading.Thread(target=run, name="packing-server", daemon=True)
        thread.start()
        if not self._ready.wait(timeout_s) or errors:
            raise RuntimeError(f"the server did not start: {errors[0] if errors else 'timeout'}")
        if warm:
            self._warm.wait()
            if errors:
                raise RuntimeError(f"the server did not start: {errors[0]}")
        assert self.address is not None
        try:
            yield self.address
        finally:
            self.stop()
            thread.join(self.config.drain_s + 30)  # the drain, then the engines' stop (10 s)

    def stop(self) -> None:
        """Drain and stop (thread-safe; what SIGINT/SIGTERM do)."""
        if self._aloop is not None and self._stopping is not None:
            with contextlib.suppress(RuntimeError):  # already stopped
                self._aloop.call_soon_threadsafe(self._stopping.set)

    def summary(self) -> dict[str, Any]:
        """Requests answered and failed, requests/s, latency p50/p99, requests per model call
        and pack fill, queue length, connections, compiles and CUDA graph captures since the
        warm-up (what the periodic log line prints)."""
        return summary(self.loops, time.monotonic() - self._started, self._open)

    async def _main(self, signals: bool) -> None:
        ws = _websockets()
        cfg = self.config
        self._aloop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
        self._settled = asyncio.Event()
        self._settled.set()
        for loop in self.loops:
            loop.start()
        try:
            server = await ws.serve(
                self._handle, cfg.host, cfg.port, process_request=self._process_request,
                max_size=cfg.max_message_bytes, max_queue=2, compression=None,
                open_timeout=cfg.handshake_timeout_s, ping_interval=20, ping_timeout=20,
                close_timeout=2,
            )  # fmt: skip
            self.address = server.sockets[0].getsockname()[:2]
            if signals:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    self._aloop.add_signal_handler(sig, self._stopping.set)
            log.info("listening on ws://%s:%d; /healthz says 503 until %d engines warmed up",
                     *self.address, len(self.loops))  # fmt: skip
            self._ready.set()
            await self._warm_up()
            ticker = asyncio.create_task(self._summaries())
            await self._stopping.wait()
            ticker.cancel()
            await self._drain(server)
        finally:
            for loop in self.loops:
                loop.stop()
        log.info("stopped: %s", self.summary())

    async def _warm_up(self) -> None:
        """Wait for every engine's warm-up (its thread compiles and captures each shape; until
        then /healthz says 503 and robots are turned away); one that failed stops the server."""
        await asyncio.gather(*(asyncio.to_thread(loop.warmed.wait) for loop in self.loops))
        bad = next((loop for loop in self.loops if loop.warm_error is not None), None)
        if bad is not None:  # `running` hears it from the thread that runs this
            raise RuntimeError(f"{bad.name} failed to warm up ({type(bad.warm_error).__name__}: "
                               f"{bad.warm_error}); see the log")  # fmt: skip
        self._serving = True
        self._warm.set()
        assert self.address is not None
        log.info("serving on ws://%s:%d (%d engines; %s)", *self.address, len(self.loops),
                 self._warming())  # fmt: skip

    def _warming(self) -> str:
        return ", ".join(f"{loop.name} {loop.warming[0]} of {loop.warming[1]} shapes warmed"
                         for loop in self.loops)  # fmt: skip

    async def _drain(self, server: Any) -> None:
        """Refuse new work, send every reply owed, then close.

        While draining the listener stays open: ``/healthz`` answers 503, a new connection is
        refused in its handshake (503) and a new message gets one line ("shutting down").
        The replies owed are those of the messages already received: the drain waits for
        each to be sent (not for a clock), at most ``drain_s``; then the engines stop, which
        answers what is left with one line, and the connections close."""
        self._draining = True
        assert self._settled is not None
        try:
            await asyncio.wait_for(self._settled.wait(), self.config.drain_s)
        except TimeoutError:
            log.warning("drain_s=%s passed with %d replies owed; stopping the engines",
                        self.config.drain_s, self._owed)  # fmt: skip
            for loop in self.loops:  # answers their requests: "the server stopped ..."
                await asyncio.to_thread(loop.stop)
            with contextlib.suppress(TimeoutError):  # those lines leave their handlers
                await asyncio.wait_for(self._settled.wait(), 5.0)
        server.close(close_connections=True, reason="server shutting down")
        await server.wait_closed()

    def _owe(self, n: int) -> None:
        """Count a reply owed (+1, a message received) or sent (-1)."""
        assert self._settled is not None
        self._owed += n
        if self._owed:
            self._settled.clear()
        else:
            self._settled.set()

    async def _summaries(self) -> None:
        while True:
            await asyncio.sleep(self.config.summary_every_s)
            log.info("summary: %s", self.summary())

    # -- one connection ---------------------------------------------------------------------
    def _process_request(self, connection: Any, request: Any) -> Any:
        """The handshake: /healthz, the API key, the connection limit (before any frame)."""
        if request.path == "/healthz":
            if self._draining:
                return connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE, "draining\n")
            if not self._serving:
                return connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE,
                                          f"warming up: {self._warming()}\n")  # fmt: skip
            return connection.respond(http.HTTPStatus.OK, "OK\n")
        key = self.config.api_key
        if key is not None:
            got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(got, f"Api-Key {key}".encode()):
                log.warning("refused %s: missing or wrong API key", connection.remote_address)
                return connection.respond(http.HTTPStatus.UNAUTHORIZED, "missing or wrong API "
                                          "key: send 'Authorization: Api-Key <key>'\n")  # fmt: skip
        unavailable = http.HTTPStatus.SERVICE_UNAVAILABLE
        if self._draining:
            return connection.respond(unavailable, "busy: shutting down\n")
        if not self._serving:
            return connection.respond(unavailable, f"busy: warming up ({self._warming()}); "
                                      "retry when /healthz says OK\n")  # fmt: skip
        if self._open >= (n := self.config.max_connections):
            return connection.respond(
                unavailable, f"busy: {n} connections open (max_connections)\n"
            )
        return None

    async def _handle(self, ws: Any) -> None:
        if self._open >= self.config.max_connections:  # two handshakes raced for the last slot
            await ws.close(1013, "too many connections")
            return
        self._open += 1
        loop = min(self.loops, key=lambda e: (e.connections, e.outstanding))
        loop.connections += 1
        robot = _Robot(next(self._ids), loop, self.adapter)
        log.info("robot %d connected from %s (%s)", robot.id, ws.remote_address, loop.name)
        closed = asyncio.ensure_future(ws.wait_closed())
        try:
            await ws.send(encode(self.config.metadata))
            while True:
                data = await ws.recv()
                self._owe(+1)
                try:
                    reply = await self._answer(robot, data, closed)
                    if reply is None:
                        break  # the client left while its request ran
                    await asyncio.wait_for(ws.send(reply), self.config.send_timeout_s)
                finally:
                    self._owe(-1)
        except Exception as e:  # closed, a send timeout: this connection only
            if not _closed_error(e):
                log.warning("robot %d: %s: %s", robot.id, type(e).__name__, e)
        finally:
            closed.cancel()
            robot.next_episode()
            loop.connections -= 1
            self._open -= 1
            log.info("robot %d disconnected after %d episodes", robot.id, robot.episode)

    async def _answer(self, robot: _Robot, data: Any, closed: asyncio.Future[Any]) -> Any:
        """The reply to one message: msgpack bytes, or one line (str) saying why not."""
        received = time.monotonic()
        if self._draining:
            return "the server is shutting down; reconnect (to another server)"
        try:
            obs = decode(data, max_array_bytes=self.config.max_message_bytes)
            control = episode_control(obs)
            if control == "start":
                robot.next_episode()
            if set(obs) == {"episode"}:  # control only: acknowledge
                if control == "end":
                    robot.next_episode()
                return encode({"episode": control, "session": robot.session})
            request = await asyncio.to_thread(self.adapter.request, obs, robot.session)
        except (WireError, ValueError, TypeError) as e:  # the observation's fault: say why
            return _one_line(e)
        except Exception as e:  # the adapter's or the encoder's own failure: the log says where
            log.exception("robot %d: adapter.request failed", robot.id)
            return f"the observation could not be made a request ({type(e).__name__}); see the server log"
        robot.used = True
        job = Job(request, asyncio.get_running_loop().create_future(), asyncio.get_running_loop(),
                  received=received, deadline=received + self.config.deadline_s)  # fmt: skip
        if not robot.loop.offer(job):
            robot.unserved()
            return (f"busy: {robot.loop.max_queue} requests are already queued "
                    f"(max_queue={robot.loop.max_queue}); retry shortly")  # fmt: skip
        # the engine loop answers or expires it; the backstop covers a model call that hangs
        backstop = self.config.deadline_s + 5.0
        done, _ = await asyncio.wait({job.future, closed}, timeout=backstop,
                                     return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        if job.future not in done:
            robot.loop.cancel(job)
            robot.unserved()
            return None if closed in done else "deadline: no result (the model call hangs)"
        outcome: Outcome = job.future.result()
        if outcome.error is not None:
            robot.unserved()
            return outcome.error
        try:
            reply = await asyncio.to_thread(self.adapter.reply, outcome.result)
        except Exception as e:
            log.exception("robot %d: adapter.reply failed", robot.id)
            return f"the reply could not be built ({type(e).__name__}); see the server log"
        total = (time.monotonic() - received) * 1e3
        reply["server_timing"] = {**outcome.timing, "total_ms": total}
        if control == "end":
            robot.next_episode()
        return encode(reply)


def _check_default_request(adapter: Any, engine: Any, i: int) -> None:
    """Refuse to start when engine ``i`` refuses the adapter's default request (an adapter
    with ``default_request``, an engine with packing's ``submit`` checks): every observation
    that does not override the defaults would be refused, one error reply at a time."""
    build = getattr(adapter, "default_request", None)
    check = getattr(getattr(engine, "packs", None), "check", None)  # what submit checks
    if build is None or check is None:
        return
    try:
        check(build(engine))
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"engine {i} refuses the adapter's default request, so every observation without "
            f"its own values would be refused: {_one_line(e)} (fix the adapter's defaults or "
            "the engine; packing serve: --frames, --actions, --steps, --shape, --max-steps)"
        ) from None


def _closed_error(e: BaseException) -> bool:
    from websockets.exceptions import ConnectionClosed

    return isinstance(e, ConnectionClosed)
