"""One engine, one thread: the loop that steps it for every connection of the server.

The websocket handlers live on an asyncio loop; the engine lives here. They meet in a `Job`:
the handler offers one (`EngineLoop.offer`, refused at once when ``max_queue`` requests are
already outstanding), and awaits its future; this thread submits it, steps the engine, and
resolves the future on the handler's loop (``call_soon_threadsafe``)::

    handler (asyncio)    offer(job) ---> inbox --> submit --> engine.step() ... --> Result
         ^                                                                        |
         +---------------- job.future  <---  call_soon_threadsafe  <--------------+

Nothing a request does stops the loop: an error at submit, a `Result` with ``error``, an
exception from ``engine.step()`` (logged with its traceback; that step's requests fail with
one line, the rest go on) and a passed deadline (``engine.cancel``) each end only their jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["EngineLoop", "Job", "Outcome"]

log = logging.getLogger("packing.serve")


@dataclass(frozen=True)
class Outcome:
    """What a job's future holds: a result (``error`` None) or one line saying why not."""

    result: Any = None
    error: str | None = None
    timing: dict[str, float] = field(default_factory=dict)


@dataclass(eq=False)
class Job:
    request: Any
    future: asyncio.Future[Outcome]
    loop: asyncio.AbstractEventLoop
    received: float  # time.monotonic() when the message arrived
    deadline: float
    rid: int | None = None
    admitted: float | None = None


class EngineLoop:
    """Steps ``engine`` on its own thread for every job offered to it (`start`, `stop`)."""

    def __init__(self, engine: Any, *, name: str, max_queue: int) -> None:
        self.engine, self.name, self.max_queue = engine, name, max_queue
        self._cv = threading.Condition()
        self._inbox: list[Job] = []
        self._cancelled: list[Job] = []
        self._ended: list[str] = []
        self._jobs: dict[int, Job] = {}  # request id -> job, for the requests in the engine
        self._stop = False
        self.outstanding = 0  # offered and not yet resolved (guarded by _cv)
        self.connections = 0  # robots sticking to this engine (the asyncio side counts)
        self.model_calls = 0
        self.packs: deque[int] = deque(maxlen=4096)  # requests in each recent model call
        self.fill: deque[float] = deque(maxlen=4096)  # ... over the shape's request slots
        self.latencies_ms: deque[float] = deque(maxlen=4096)
        self.answered = self.failed = 0
        self.warmed = threading.Event()  # set when the warm-up ended (see warm_error)
        self.warm_error: BaseException | None = None
        self.warming = (0, 0)  # shapes warmed, of how many
        self._thread = threading.Thread(target=self._run, name=f"packing-{name}", daemon=True)

    # -- called from the asyncio side -------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def offer(self, job: Job) -> bool:
        """Queue ``job``; False (at once) when ``max_queue`` jobs are outstanding."""
        with self._cv:
            if self.outstanding >= self.max_queue:
                return False
            self.outstanding += 1
            self._inbox.append(job)
            self._cv.notify()
            return True

    def cancel(self, job: Job) -> None:
        """The job's client left: drop its request (waiting or in the pack)."""
        with self._cv:
            if job in self._inbox:
                self._inbox.remove(job)
                self.outstanding -= 1
            else:
                self._cancelled.append(job)
            self._cv.notify()

    def end_session(self, session: str) -> None:
        with self._cv:
            self._ended.append(session)
            self._cv.notify()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # -- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        model = getattr(self.engine, "model", None)  # a VideoEngine's device is its model's
        device = getattr(self.engine, "device", None) or getattr(model, "device", None)
        if isinstance(device, torch.device) and device.type == "cuda":
            torch.cuda.set_device(device)  # this thread's graphs and streams on the engine's GPU
        if not self._warm_up():
            return
        while True:
            with self._cv:
                while not (self._inbox or self._cancelled or self._ended or self._stop
                           or self._jobs):  # fmt: skip
                    self._cv.wait()
                if self._stop:
                    break
                inbox, self._inbox = self._inbox, []
                cancelled, self._cancelled = self._cancelled, []
                ended, self._ended = self._ended, []
            for job in inbox:
                self._submit(job)
            for job in cancelled:
                if job.rid is not None and self._jobs.pop(job.rid, None) is not None:
                    self.engine.cancel(job.rid)
                    self._resolve(job, Outcome(error="the client left"))
            for session in ended:
                try:
                    self.engine.end_session(session)
                except Exception:
                    log.exception("%s: end_session(%r) failed", self.name, session)
            self._expire(time.monotonic())
            if self._jobs:
                self._step()
            if self._jobs and not (self.engine.active or self.engine.waiting):
                self._lost()
        for job in [*self._jobs.values(), *self._inbox]:  # stopped: nothing is left hanging
            self._resolve(job, Outcome(error="the server stopped before this request finished"))

    def _warm_up(self) -> bool:
        """Compile and capture every shape the engine can meet before any robot is served
        (an engine without ``warm_up`` is taken as warm); False if it failed (logged)."""
        warm = getattr(self.engine, "warm_up", None)
        try:
            if warm is not None and not getattr(self.engine, "warm_stats", None):
                stats = warm(progress=self._progress)
                log.info("%s: warm: %s", self.name, stats)
        except Exception as e:
            log.exception("%s: warm-up failed", self.name)
            self.warm_error = e
            return False
        finally:
            self.warmed.set()
        return True

    def _progress(self, done: int, total: int, label: str) -> None:
        self.warming = (done, total)
        log.info("%s: warming %d of %d shapes (%s)", self.name, done, total, label)

    def _submit(self, job: Job) -> None:
        try:
            job.rid = self.engine.submit(job.request)
        except (ValueError, TypeError) as e:  # a bad request: its client hears why
            self._resolve(job, Outcome(error=_one_line(e)))
            return
        except Exception as e:
            log.exception("%s: submit failed", self.name)
            self._resolve(job, Outcome(error=f"the server failed to queue this request "
                                             f"({type(e).__name__}); see the server log"))  # fmt: skip
            return
        self._jobs[job.rid] = job

    def _expire(self, now: float) -> None:
        for rid, job in list(self._jobs.items()):
            if now > job.deadline:
                self.engine.cancel(rid)
                del self._jobs[rid]
                waited = (now - job.received) * 1e3
                self._resolve(job, Outcome(error=f"deadline: no result after {waited:.0f} ms "
                                                 "(the server's deadline_s); the request was "
                                                 "cancelled, retry or raise deadline_s"))  # fmt: skip

    def _step(self) -> None:
        start = time.monotonic()
        try:
            results = self.engine.step()
        except Exception as e:
            log.exception("%s: engine.step() failed; failing that step's requests", self.name)
            for rid, _ in self.engine.last_pack:
                job = self._jobs.pop(rid, None)
                if job is not None:
                    self.engine.cancel(rid)
                    self._resolve(job, Outcome(error=f"the model call failed "
                                                     f"({type(e).__name__}); see the server log; "
                                                     "the request was dropped, retry"))  # fmt: skip
            return
        pack = self.engine.last_pack
        self.model_calls += 1
        self.packs.append(len(pack))
        shape = self.engine.shape
        if shape is not None:
            self.fill.append(len(pack) / shape.requests)
        for rid, step in pack:
            job = self._jobs.get(rid)
            if job is not None and job.admitted is None and step == 0:
                job.admitted = start
        end = time.monotonic()
        for r in results:
            job = self._jobs.pop(r.request_id, None)
            if job is None:
                continue  # cancelled meanwhile
            admitted = job.admitted if job.admitted is not None else start
            timing = {"queue_ms": (admitted - job.received) * 1e3,
                      "infer_ms": (end - admitted) * 1e3}  # fmt: skip
            err = getattr(r, "error", None)
            if err is not None:
                self._resolve(job, Outcome(error=f"the request failed: {_one_line(err)}"))
            else:
                self.latencies_ms.append((end - job.received) * 1e3)
                self._resolve(job, Outcome(result=r, timing=timing))

    def _lost(self) -> None:
        """Jobs the engine no longer holds (a failure inside its admission lost them): fail
        them now rather than leave their robots waiting for the deadline."""
        log.error("%s: %d requests lost by the engine after a failure", self.name, len(self._jobs))
        for job in self._jobs.values():
            self._resolve(job, Outcome(error="the request was lost after a server failure "
                                             "(see the server log); retry"))  # fmt: skip
        self._jobs.clear()

    def _resolve(self, job: Job, outcome: Outcome) -> None:
        with self._cv:
            self.outstanding -= 1
            if outcome.error is None:
                self.answered += 1
            else:
                self.failed += 1
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            job.loop.call_soon_threadsafe(_set, job.future, outcome)


def _set(future: asyncio.Future[Outcome], outcome: Outcome) -> None:
    if not future.done():
        future.set_result(outcome)


def _one_line(e: object) -> str:
    return " ".join(str(e).split()) or type(e).__name__
