"""The packed inference engine: one continuous-batching loop for every served model.

Requests wait in a FIFO queue on the host. Between steps, finished requests leave and waiting
ones join (FIFO, while they fit the largest shape); the pack takes the smallest shape that
holds them. Each `Engine.step` is one model call over the pack with every request at its own
step, then each request's solver update. A pack of three requests at three steps::

    engine step 12 | request 4: step 9/10 | request 6: step 2/10 | request 7: step 0/6 | pad
                   |  t = 0.10            |  t = 0.80            |  t = 1.00            |
    after it       request 4 finishes (its Result is returned), request 8 joins at step 0

What a pack is (its buffers, its layout, its step, its cache) is the model's `Packs`
(`packing.serve.protocol`): the reference DiT, the DiT with its context in a paged pool, any
`VideoModel` and LeRobot's LingBot-VA are four of them (`Engine.from_packs` serves yours);
admission, the carry of each request's state from one pack to the next, failure isolation
and the non-finite flags are this loop's, once.

Nothing here reads a device value: the host mirrors every request's step count, so it knows
when one finishes; it waits only for the model call before the one it just launched, so the
GPU always has the next call queued while the host admits, and an arriving request joins
within two calls. A `Result` holds device tensors (the policy server reads them on a side
stream, `packing.serve._device.to_host`).

A request's fault stays the request's (docs/inference.md, "When a request fails"): everything
a step needs is checked at ``submit``; host work for one request that raises fails that
request alone; a model call that raises is re-run with the pack split in halves until the
culprits are alone; a request whose state becomes NaN or inf is zeroed inside the step and
leaves with ``Result.error``. Every submitted request comes back exactly once (unless
cancelled), good or with its error.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from packing._validate import check_int, is_int
from packing.attention._compile import FLEX_KERNELS
from packing.model import DiT
from packing.serve._config import EngineConfig
from packing.serve._device import pinned
from packing.serve._limits import MAX_STEPS
from packing.serve._packs import DiTPacks, Packs, Spans
from packing.serve._request import Result
from packing.serve._schedulers import FlowScheduler, check_scheduler
from packing.serve._step import Steps

__all__ = ["Engine"]

# A failed request's traceback goes here (a server's log), its one-line reason to its client.
_log = logging.getLogger("packing.serve")


@dataclass
class _Member:
    rid: int
    request: Any
    admitted: int
    step: int = 0
    spans: Spans = ()  # its (first row, rows) in each state group of the pack
    fresh: tuple[Tensor, ...] | None = None  # host state rows to join with
    saved: tuple[Tensor, ...] | None = None  # (x, v_prev) per group, to rejoin after a fault
    record: Any = None  # the model's own record, `Packs.member` (a cache: session, pages)


@dataclass
class _Flags:
    """One model call's non-finite flags on their way to the host (pinned, on CUDA)."""

    host: Tensor  # (R,) bool
    event: Any  # a recorded torch.cuda.Event, or None: already on the host
    ran: list[tuple[_Member, int]]  # (member, the step it ran) in slot order
    seq: int


class Engine:
    """Serve `Request`s with one model call per step over a pack of them.

    ``engine.submit(req) -> id``; ``engine.step() -> [Result, ...]`` (those that finished);
    ``engine.run()`` steps until every submitted request is done; ``engine.warm_up()`` runs
    (compiles, captures) every pack shape and prefill pass once, after which none is new.
    ``model`` is the reference `packing.model.DiT` (or anything with its ``config``,
    ``patchify``/``unpatchify`` and ``velocity``); compile its blocks first
    (``block.compile()``) for compiled kernels. ``config.context_cache`` keeps each
    request's context in a paged pool (`packing.serve._cached_packs`). Any other model:
    ``Engine.from_packs(packs)`` with its `packing.serve.protocol.Packs`.
    """

    # Model calls whose flags the host leaves unread, still running on the device: after
    # launching call k, step() waits for call k - 1. Unbounded, the host would queue every
    # member's remaining calls at once (a step on the host takes ~1 ms, on the GPU 15-100 ms)
    # and a request arriving meanwhile could join only after all of them: static batching.
    _in_flight = 1

    model: Any  # the served model (a DiT; a VideoModel in `VideoEngine`)
    config: Any  # its EngineConfig (None in `VideoEngine`)

    def __init__(
        self, model: DiT, config: EngineConfig, *, device: torch.device | str | None = None
    ) -> None:
        dev = torch.device(device) if device is not None else next(model.parameters()).device
        packs: Packs[Any, Any]
        if getattr(config, "context_cache", None) is None:
            packs = DiTPacks(model, config, dev)
        else:
            from packing.serve._cached_packs import CachedDiTPacks

            packs = CachedDiTPacks(model, config, dev)
        self.model, self.config = model, config
        self._serve(packs, config.scheduler, config.max_steps)

    @classmethod
    def from_packs(
        cls, packs: Packs[Any, Any], *, scheduler: FlowScheduler | None = None
    ) -> Engine:
        """An engine serving your own model through its ``packs`` (a subclass of
        `packing.serve.protocol.Packs`; docs/serving-your-model.md). ``scheduler`` gives each
        request's times and solver coefficients, the ``tables`` `Packs.layout` receives
        (default: Euler, ``FlowScheduler()``). ``engine.model`` is ``packs``."""
        if not isinstance(packs, Packs):
            raise TypeError(
                f"Engine.from_packs takes packs=, a packing.serve.protocol.Packs subclass, got "
                f"{type(packs).__name__}; serve the reference DiT with Engine(model, config)"
            )
        _check_packs(packs)
        sched = FlowScheduler() if scheduler is None else check_scheduler("scheduler", scheduler)
        engine = cls.__new__(cls)
        engine.model, engine.config = packs, None
        engine._serve(packs, sched, packs.max_steps)
        return engine

    def _serve(self, packs: Packs[Any, Any], scheduler: Any, max_steps: int) -> None:
        self.packs, self.scheduler, self.max_steps = packs, scheduler, max_steps
        self.device, self.shapes = packs.device, packs.shapes
        self._waiting: deque[tuple[int, Any]] = deque()
        self._members: list[_Member] = []
        self._shape: Any = None
        self._next_id = 0
        self._left = False  # a request left since the last recomposition
        self.clock = 0  # engine steps run
        self.last_pack: tuple[tuple[int, int], ...] = ()  # (request id, its step) last step
        self._out: list[Result] = []  # the next step()'s results
        self._copies: deque[_Flags] = deque()  # flags not read yet
        self._seq = self._read = 0  # flag copies made, read
        self._finishing: dict[int, tuple[Result, int]] = {}  # rid -> result, its last copy
        self.warm_stats: dict[str, Any] = {}  # what warm_up() did (empty until it ran)

    # -- the public calls -------------------------------------------------------------------
    def submit(self, request: Any) -> int:
        """Queue ``request``; returns its id. Checked here, so a bad one never enters a pack,
        and copied (its tensors detached, on the host), so changing it afterwards changes
        nothing."""
        request = self.packs.check(request)
        steps: Any = getattr(request, "steps", None)  # the protocol's one field the loop reads
        if not is_int(steps) or not 1 <= steps <= self.max_steps:
            raise ValueError(
                f"{type(self.packs).__name__}.check returned a {type(request).__name__} with "
                f"steps={steps!r}, not an int in [1, max_steps={self.max_steps}]; refuse such a "
                "request in check, naming its field"
            )
        rid = self._next_id
        self._next_id += 1
        self._waiting.append((rid, request))
        return rid

    @property
    def active(self) -> int:
        return len(self._members)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def shape(self) -> Any:
        """The pack shape the last step ran in."""
        return self._shape

    @property
    def stats(self) -> dict[str, int]:
        """The model's counters (a context cache: frames prefilled and reused, ...)."""
        return self.packs.stats

    def step(self) -> list[Result]:
        """Admit, run one model call over the pack, return the requests that finished (and
        those that failed: ``Result.error`` set). Never raises for a request's fault.

        On CUDA a step launches its model call and then waits for the call before it
        (``_in_flight``), so a finished request comes back one step after its last (once
        that call's non-finite flags reached the host), except that a step that leaves
        nothing active or waiting waits for every flag: a loop ``while engine.active or
        engine.waiting: engine.step()`` gets every result."""
        with torch.no_grad():
            self._admit()
            if self._members:
                self.last_pack = tuple((m.rid, m.step) for m in self._members)
                self._advance(list(self._members))
                self.clock += 1
            # Nothing left to run: wait for the last flags (there is no GPU work to overlap),
            # so an engine with no active or waiting request has handed out every result.
            self._read_flags(wait=not (self._members or self._waiting))
        out, self._out = self._out, []
        return out

    def cancel(self, request_id: int) -> bool:
        """Drop a request, waiting or in the pack (its client left, or its deadline passed);
        True if it was still there. A member's rows leave at the next recomposition."""
        rid = check_int("request_id", request_id, min=0)
        if self._finishing.pop(rid, None) is not None:
            return True
        for i, (wid, _) in enumerate(self._waiting):
            if wid == rid:
                del self._waiting[i]
                return True
        return self._drop(rid)

    def end_session(self, session: str) -> None:
        """The robot episode ``session`` ended: free what the model keeps for it (a context
        cache: its pages, now or when its request in the pack leaves)."""
        if not isinstance(session, str):
            raise TypeError(f"session must be a str, got {type(session).__name__}")
        self.packs.end_session(session)

    def run(self) -> list[Result]:
        """Step until nothing waits or runs; every request submitted and not cancelled comes
        back exactly once, in the order they finished (or failed). The one wait for the device
        is at the end, for the last steps' non-finite flags."""
        out: list[Result] = []
        while self._members or self._waiting:
            out += self.step()
        self._read_flags(wait=True)
        out, self._out = out + self._out, []
        return out

    def warm_up(self, progress: Callable[[int, int, str], None] | None = None) -> dict[str, Any]:
        """Run every pack shape's step and every prefill pass once on empty packs (compiling
        and capturing what the model and ``cuda_graphs`` compile and capture), then seal: in
        service a step or pass not run here raises instead of compiling or capturing.
        ``progress(done, total, label)`` after each; returns (and keeps as ``warm_stats``)
        the shapes warmed, the seconds, and the compiles and captures it made."""
        if self.warm_stats:
            return self.warm_stats  # warmed already: the shapes are fixed at construction
        if self._members or self._waiting:
            raise RuntimeError("warm_up() runs before any request: this engine has some")
        keys = self.packs.warm_keys()
        if self.device.type == "cuda":  # a static FlexAttention kernel for each key's self-
            FLEX_KERNELS.reserve(2 * len(keys))  # and cross-attention: not the slower dynamic one
        compiles, captures, t0 = _compiles(), self.packs.steps.captures, time.perf_counter()
        with torch.no_grad():
            for s in self.shapes:  # an empty pack in each: every row padding
                self.packs.layout(s, [], self._tables([], s.requests))
            for i, (label, run) in enumerate(keys):
                run()
                if progress is not None:
                    progress(i + 1, len(keys), label)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.packs.steps.seal()
        self.warm_stats = {
            "shapes": len(keys), "seconds": round(time.perf_counter() - t0, 3),
            "compiles": _compiles() - compiles, "captures": self.packs.steps.captures - captures,
        }  # fmt: skip
        self._warm_marks = (_compiles(), self.packs.steps.captures)
        return self.warm_stats

    @property
    def compiles_after_warm_up(self) -> int | None:
        """Graphs dynamo compiled in this process since `warm_up`; None before it. The count
        is dynamo's, per process: another engine warmed later in the same process adds to it."""
        marks = getattr(self, "_warm_marks", None)
        return None if marks is None else _compiles() - marks[0]

    @property
    def captures_after_warm_up(self) -> int | None:
        """CUDA graphs this engine captured since `warm_up` (0: sealed); None before it."""
        marks = getattr(self, "_warm_marks", None)
        return None if marks is None else self.packs.steps.captures - marks[1]

    # -- admission and the pack's state -------------------------------------------------------
    def _admit(self) -> None:
        """Recompose the pack when a request left or a waiting one fits (FIFO)."""
        joining: list[_Member] = []
        reqs = [m.request for m in self._members]
        while self._waiting and self.packs.fits(self.shapes[-1], [*reqs, self._waiting[0][1]]):
            rid, r = self._waiting.popleft()
            try:
                member = self._member(rid, r)
            except Exception as err:  # this request's own host work (noise, patchify)
                why = f"preparing it for the pack raised {type(err).__name__}: {err}"
                _log.error("request %d failed: %s", rid, why, exc_info=err)
                self._out.append(self._failed(rid, self.clock, why))
                continue
            joining.append(member)
            reqs.append(r)
        if not joining and not self._left:
            return
        self._left = False
        shape = next(s for s in self.shapes if self.packs.fits(s, reqs))
        self._recompose(shape, self._members, joining)
        self.last_pack = tuple((m.rid, m.step) for m in self._members)

    def _member(self, rid: int, r: Any) -> _Member:
        """The request's host work at admission: its initial state and the model's record."""
        return _Member(rid, r, admitted=self.clock, fresh=self.packs.fresh(r),
                       record=self.packs.member(rid, r))  # fmt: skip

    def _recompose(self, shape: Any, staying: list[_Member], joining: list[_Member]) -> None:
        """Lay the members out in ``shape``; the ``staying`` ones carry their state over (in
        place: a captured graph keeps reading the same buffers), the joining ones start from
        their fresh rows or, after a failed call, their saved state."""
        members, first = staying + joining, len(staying)
        tables = self._tables(members, shape.requests)
        spans = self.packs.layout(shape, [m.request for m in members], tables)
        old = self.packs.state(self._shape) if self._shape is not None else None
        dev = self.device
        for g, (x, vp) in enumerate(self.packs.state(shape)):
            take = torch.full((x.shape[0],), -1, dtype=torch.int64)
            for m, new in zip(staying, spans, strict=False):
                (o0, n), (n0, _) = m.spans[g], new[g]
                take[n0 : n0 + n] = torch.arange(o0, o0 + n)
            _carry(x, vp, old[g] if old else None, pinned(take, dev).to(dev, non_blocking=True))
            rows = [torch.arange(s[g][0], s[g][0] + s[g][1]) for m, s in
                    zip(joining, spans[first:], strict=True) if m.fresh is not None]  # fmt: skip
            if rows:
                fresh = torch.cat([m.fresh[g] for m in joining if m.fresh is not None])
                x.index_copy_(0, pinned(torch.cat(rows), dev).to(dev, non_blocking=True),
                              pinned(fresh, dev).to(dev, non_blocking=True))  # fmt: skip
            for m, s in zip(joining, spans[first:], strict=True):
                if m.saved is not None:  # rejoins after a failed model call (`_isolate`)
                    lo, n = s[g]
                    x[lo : lo + n], vp[lo : lo + n] = m.saved[2 * g], m.saved[2 * g + 1]
        for m, s in zip(members, spans, strict=True):
            m.spans = s
        for m in joining:
            m.fresh = None
        self._members, self._shape = members, shape
        for m, why in self.packs.joined(shape, members, first):
            _log.error("request %d failed: %s", m.rid, why)
            self._out.append(self._failed(m.rid, m.admitted, why))
            self._drop(m.rid)  # its rows leave at the next step

    def _save(self, m: _Member) -> None:
        """Its state, (x, v_prev) per group, to rejoin another pack (`_isolate`)."""
        state = self.packs.state(self._shape)
        m.saved = tuple(t[lo : lo + n].clone()
                        for (lo, n), (x, vp) in zip(m.spans, state, strict=True)
                        for t in (x, vp))  # fmt: skip

    def _tables(self, members: list[_Member], requests: int) -> tuple[Tensor, Tensor, Tensor]:
        """Per-request times, solver coefficients and current steps on the host:
        ``(R, max_steps)``, ``(R, max_steps, 2)``, ``(R,)``; rows past the members are 0."""
        N = self.max_steps
        t = torch.zeros(requests, N, dtype=torch.float64)
        coef = torch.zeros(requests, N, 2, dtype=torch.float64)
        for k, m in enumerate(members):
            n = m.request.steps
            t[k, :n] = torch.tensor(self.scheduler.sigmas(n)[:n], dtype=torch.float64)
            coef[k, :n] = torch.tensor(self.scheduler.coefficients(n), dtype=torch.float64)
        steps = [m.step for m in members] + [0] * (requests - len(members))
        return t.float(), coef.float(), torch.tensor(steps, dtype=torch.int64)

    def _run(self, shape: Any) -> None:
        self.packs.step(shape)

    def _result(self, m: _Member) -> Result:
        lat, act = self.packs.result(self._shape, m.request, m.spans)
        return Result(m.rid, lat, act, admitted=m.admitted, finished=self.clock)

    # -- one model call, and its faults -------------------------------------------------------
    def _advance(self, members: list[_Member]) -> None:
        """One model call over ``members`` (the pack), or its isolation if it raises."""
        try:
            self._run(self._shape)
        except Exception as err:  # the update runs after the model call: the state is intact
            self._isolate(members, err)
        else:
            self._ran(members)

    def _isolate(self, members: list[_Member], err: Exception) -> None:
        """Find the requests the model call fails on and fail only them.

        The pack is split in halves, each half run in the smallest shape that holds it
        (from the members' saved state), a half that raises split again, down to one
        request: with one culprit among N members that is about 2 log2(N) extra model calls.
        Every other member steps once, as in a step that did not fail, then all rejoin one
        pack."""
        for m in members:
            self._save(m)
        failed: set[int] = set()
        raised = deque([(members, err)])  # groups whose model call raised, and the error
        while raised:
            group, why = raised.popleft()
            if len(group) == 1:
                failed.add(group[0].rid)
                _log.error("request %d failed: the model call raised with it alone",
                           group[0].rid, exc_info=why)  # fmt: skip
                self._out.append(self._failed(group[0].rid, group[0].admitted,
                                              _raised(group[0], why, self.clock)))  # fmt: skip
                continue
            for half in (group[: len(group) // 2], group[len(group) // 2 :]):
                self._place(half)
                try:
                    self._run(self._shape)
                except Exception as e:
                    raised.append((half, e))
                    continue
                self._ran(half)
                for m in half:
                    if m.step < m.request.steps:
                        self._save(m)  # the next half's pack may overwrite these rows
        self._place([m for m in members if m.rid not in failed and m.step < m.request.steps])
        for m in members:
            m.saved = None
        self._left = True
        # the failed ones are in no pack; a next phase (`Packs.then`) waits in the queue
        self.packs.sweep({m.rid for m in self._members} | {rid for rid, _ in self._waiting})

    def _place(self, group: list[_Member]) -> None:
        """Lay ``group`` out alone, every member joining from its saved state."""
        shape = next(s for s in self.shapes if self.packs.fits(s, [m.request for m in group]))
        self._recompose(shape, [], group)

    def _ran(self, ran: list[_Member]) -> None:
        """After a model call over ``ran``: steps counted, the finished ones read back (their
        last flag still to come), then the call's flags on their way."""
        ran_at = [(m, m.step) for m in ran]
        for m in ran:
            m.step += 1
            if m.step == m.request.steps:
                try:
                    result = self._result(m)
                    nxt = None if result.error else self.packs.then(m.request, result.latents,
                                                                    result.action)  # fmt: skip
                except Exception as err:  # this request's own host work
                    why = f"reading its result back raised {type(err).__name__}: {err}"
                    _log.error("request %d failed: %s", m.rid, why, exc_info=err)
                    result, nxt = self._failed(m.rid, m.admitted, why), None
                if nxt is not None:  # its next phase rejoins first, under the same id
                    self._drop(m.rid)
                    self._waiting.appendleft((m.rid, nxt))
                    continue
                self._finishing[m.rid] = (result, self._seq)
                self._drop(m.rid)
        # Queued after the results' copies: when its event has completed, so have they, and a
        # reader on another stream (`packing.serve._device.to_host`) waits for nothing more.
        host, event = self._copy_flags(self.packs.flags(self._shape))
        self._copies.append(_Flags(host, event, ran_at, self._seq))
        self._seq += 1

    def _copy_flags(self, flags: Tensor) -> tuple[Tensor, Any]:
        """The flags on their way to the host: a pinned copy and the event after it (CUDA),
        or a clone and None (already there)."""
        if flags.device.type != "cuda":
            return flags.clone(), None
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _read_flags(self, *, wait: bool) -> None:
        """Read the flag copies that have arrived (all of them if ``wait``), fail the
        requests they flag, and hand out the finished results whose last flag is read."""
        while self._copies and (wait or len(self._copies) > self._in_flight
                                or self._copies[0].event is None
                                or self._copies[0].event.query()):  # fmt: skip
            c = self._copies.popleft()
            if c.event is not None:
                c.event.synchronize()  # a no-op unless ``wait``
            for k, bad in enumerate(c.host.tolist()[: len(c.ran)]):
                if bad:
                    self._nonfinite(*c.ran[k])
            self._read = c.seq + 1
        for rid, (result, seq) in list(self._finishing.items()):
            if seq < self._read:
                del self._finishing[rid]
                self._out.append(result)

    def _nonfinite(self, m: _Member, step: int) -> None:
        why = (
            f"non-finite state at step {step + 1} of {m.request.steps} (engine step "
            f"{self.clock}): the model's velocity for this request held NaN or inf; its rows "
            "were zeroed before the next model call, the other requests went on"
        )
        if m.rid in self._finishing:  # handed out after its own last flag; the first fault wins
            result, seq = self._finishing[m.rid]
            if result.error is None:
                self._finishing[m.rid] = (self._failed(m.rid, m.admitted, why), seq)
            self.packs.left(m, finished=False)  # a finished one's pages were kept: free them
        elif self._drop(m.rid) or self._unqueue(m.rid, m.request):
            self._out.append(self._failed(m.rid, m.admitted, why))

    def _unqueue(self, rid: int, request: Any) -> bool:
        """A phase whose last step's flag came late: its next phase (`Packs.then`) waits in
        the queue; it fails there, its model record freed."""
        for i, (wid, _) in enumerate(self._waiting):
            if wid == rid:
                del self._waiting[i]
                self.packs.left(_Member(rid, request, admitted=self.clock), finished=False)
                return True
        return False

    def _drop(self, rid: int) -> bool:
        """A member leaves (finished, cancelled, failed); the model frees or keeps what it
        holds for it (a finished chunk of a session keeps its pages for the next)."""
        m = next((m for m in self._members if m.rid == rid), None)
        if m is None:
            return False
        self._members, self._left = [k for k in self._members if k.rid != rid], True
        self.packs.left(m, finished=m.step >= m.request.steps)
        return True

    def _failed(self, rid: int, admitted: int, error: str) -> Result:
        empty = torch.zeros(0, device=self.device)
        return Result(rid, empty, empty, admitted=admitted, finished=self.clock, error=error)


def _check_packs(packs: Packs[Any, Any]) -> None:
    """The attributes the engine reads from ``packs``, each one line if it is wrong."""
    name = type(packs).__name__
    shapes = getattr(packs, "shapes", None)
    if not isinstance(shapes, list) or not shapes:
        raise ValueError(f"{name}.shapes={shapes!r}; set a non-empty list of pack shapes, "
                         "smallest first")  # fmt: skip
    if not isinstance(getattr(packs, "device", None), torch.device):
        raise TypeError(
            f"{name}.device must be a torch.device, got {getattr(packs, 'device', None)!r}"
        )
    if not isinstance(getattr(packs, "steps", None), Steps):
        raise TypeError(
            f"{name}.steps must be a packing.serve.protocol.Steps (Steps(cuda_graphs=False))"
        )
    max_steps: Any = getattr(packs, "max_steps", None)
    if not is_int(max_steps) or not 1 <= max_steps <= MAX_STEPS:
        raise ValueError(f"{name}.max_steps={max_steps!r}; set an int in [1, {MAX_STEPS}], the "
                         "columns of the schedule tables its buffers hold")  # fmt: skip


def _carry(x: Tensor, vp: Tensor, old: Sequence[Tensor] | None, take: Tensor) -> None:
    """``x[i] = old_x[take[i]]`` where ``take >= 0``, else 0 (same for ``vp``); in place, so
    a captured graph keeps reading the same buffers. Gathers first: ``old`` may be ``x``.
    An ``old`` of no rows (a shape without this stream) carries nothing."""
    if old is None or old[0].shape[0] == 0:
        x.zero_()
        vp.zero_()
        return
    keep = (take >= 0).reshape(-1, *[1] * (x.dim() - 1))
    idx = take.clamp(min=0)
    gx, gvp = old[0].index_select(0, idx), old[1].index_select(0, idx)
    x.copy_(torch.where(keep, gx, 0.0))
    vp.copy_(torch.where(keep, gvp, 0.0))


def _compiles() -> int:
    """Graphs dynamo has compiled in this process (a recompile is a new graph)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


def _raised(m: _Member, err: Exception, clock: int) -> str:
    return (
        f"the model call raised {type(err).__name__}: {err} with this request in the pack, "
        f"and again with it alone (its step {m.step + 1} of {m.request.steps}, engine step "
        f"{clock}); the other requests went on"
    )
