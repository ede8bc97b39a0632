"""Continuous batching, shared by `Engine` (the reference DiT) and `VideoEngine` (any
`VideoModel`): a FIFO queue, the members of the current pack and their denoising steps.

Each engine step admits, runs one model call over the pack, and returns the requests that
finished::

    clock    0      1      2      3
    pack     a0 b0  a1 b1  a2 c0  c1 d0     a: 3 steps, b: 2, c joins when b leaves
    results         -      b      a

Admission is FIFO while the largest shape holds the pack; the pack then takes the smallest
shape that fits, and the requests that stay carry their state over in place. What a pack is
(its buffers, how a step runs, how a result is read back) is the engine's.

A request's fault stays the request's (docs/inference.md, "When a request fails"): everything
a step needs is checked at ``submit``; host work for one request (its noise, its result)
that raises fails that request alone; a model call that raises is re-run with the pack split
in halves until the culprits are alone; a request whose state becomes NaN or inf is zeroed
inside the step (so it never enters the next model call) and leaves with ``Result.error``.
Every submitted request comes back exactly once (unless cancelled), good or with its error.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor

from packing._validate import check_int
from packing.serve._request import Result
from packing.serve._schedulers import FlowScheduler

__all__ = ["ContinuousBatcher"]

# A failed request's traceback goes here (a server's log), its one-line reason to its client.
_log = logging.getLogger("packing.serve")

R = TypeVar("R")  # the request type
S = TypeVar("S")  # the pack shape type


@dataclass
class _Flags:
    """One model call's non-finite flags on their way to the host (pinned, on CUDA)."""

    host: Tensor  # (R,) bool
    event: Any  # a recorded torch.cuda.Event, or None: already on the host
    ran: list[tuple[Any, int]]  # (member, the step it ran) in slot order
    seq: int


class ContinuousBatcher(Generic[R, S]):
    """The queue and the bookkeeping; subclasses give ``_check`` (returns the request to
    keep), ``_member`` (its host work), ``_recompose`` (a joining member with ``saved`` set
    joins with that state), ``_run``, ``_flags``, ``_save`` and ``_result``, and set
    ``shapes``, ``scheduler``, ``max_steps``, ``device`` before calling ``_start()``."""

    # Model calls whose flags the host leaves unread, still running on the device: after
    # launching call k, step() waits for call k - 1. Unbounded, the host would queue every
    # member's remaining calls at once (a step on the host takes ~1 ms, on the GPU 15-100 ms)
    # and a request arriving meanwhile could join only after all of them: static batching.
    _in_flight = 1

    shapes: list[Any]
    scheduler: FlowScheduler
    max_steps: int
    device: torch.device

    def _start(self) -> None:
        self._waiting: deque[tuple[int, R]] = deque()
        self._members: list[Any] = []
        self._shape: S | None = None
        self._next_id = 0
        self._left = False  # a request left since the last recomposition
        self.clock = 0  # engine steps run
        self.last_pack: tuple[tuple[int, int], ...] = ()  # (request id, its step) last step
        self._out: list[Result] = []  # the next step()'s results
        self._copies: deque[_Flags] = deque()  # flags not read yet
        self._seq = self._read = 0  # flag copies made, read
        self._finishing: dict[int, tuple[Result, int]] = {}  # rid -> result, its last copy

    # -- the public calls -------------------------------------------------------------------
    def submit(self, request: R) -> int:
        """Queue ``request``; returns its id. Checked here, so a bad one never enters a pack,
        and copied (its tensors detached, on the host), so changing it afterwards changes
        nothing."""
        request = self._check(request)
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
    def shape(self) -> S | None:
        """The pack shape the last step ran in."""
        return self._shape

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
        """The robot episode ``session`` ended: free what the engine keeps for it. An engine
        without a context cache keeps nothing between requests, so there is nothing to free."""
        if not isinstance(session, str):
            raise TypeError(f"session must be a str, got {type(session).__name__}")

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

    # -- shared internals -------------------------------------------------------------------
    def _admit(self) -> None:
        """Recompose the pack when a request left or a waiting one fits (FIFO)."""
        joining: list[Any] = []
        reqs = [m.request for m in self._members]
        while self._waiting and self.shapes[-1].fits([*reqs, self._waiting[0][1]]):
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
        shape = next(s for s in self.shapes if s.fits(reqs))
        self._recompose(shape, self._members, joining)
        self.last_pack = tuple((m.rid, m.step) for m in self._members)

    def _advance(self, members: list[Any]) -> None:
        """One model call over ``members`` (the pack), or its isolation if it raises."""
        assert self._shape is not None
        try:
            self._run(self._shape)
        except Exception as err:  # the update runs after the model call: the state is intact
            self._isolate(members, err)
        else:
            self._ran(members)

    def _isolate(self, members: list[Any], err: Exception) -> None:
        """Find the requests the model call fails on and fail only them.

        The pack is split in halves, each half run in the smallest shape that holds it
        (from the members' saved state), a half that raises split again, down to one
        request: with one culprit among N members that is about 2 log2(N) extra model calls
        (and a graph capture for each shape not captured yet). Every other member steps once,
        as in a step that did not fail, then all rejoin one pack."""
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
                assert self._shape is not None
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

    def _place(self, group: list[Any]) -> None:
        """Lay ``group`` out alone, every member joining from its saved state."""
        shape = next(s for s in self.shapes if s.fits([m.request for m in group]))
        self._recompose(shape, [], group)

    def _ran(self, ran: list[Any]) -> None:
        """After a model call over ``ran``: steps counted, the finished ones read back (their
        last flag still to come), then the call's flags on their way."""
        ran_at = [(m, m.step) for m in ran]
        for m in ran:
            m.step += 1
            if m.step == m.request.steps:
                try:
                    result = self._result(m)
                except Exception as err:  # this request's own host work
                    why = f"reading its result back raised {type(err).__name__}: {err}"
                    _log.error("request %d failed: %s", m.rid, why, exc_info=err)
                    result = self._failed(m.rid, m.admitted, why)
                self._finishing[m.rid] = (result, self._seq)
                self._drop(m.rid)
        # Queued after the results' copies: when its event has completed, so have they, and a
        # reader on another stream (`packing.serve._device.to_host`) waits for nothing more.
        host, event = self._copy_flags(self._flags(self._shape))  # type: ignore[arg-type]
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

    def _nonfinite(self, m: Any, step: int) -> None:
        why = (
            f"non-finite state at step {step + 1} of {m.request.steps} (engine step "
            f"{self.clock}): the model's velocity for this request held NaN or inf; its rows "
            "were zeroed before the next model call, the other requests went on"
        )
        if m.rid in self._finishing:  # handed out after its own last flag; the first fault wins
            result, seq = self._finishing[m.rid]
            if result.error is None:
                self._finishing[m.rid] = (self._failed(m.rid, m.admitted, why), seq)
        elif self._drop(m.rid):
            self._out.append(self._failed(m.rid, m.admitted, why))

    def _drop(self, rid: int) -> bool:
        kept = [m for m in self._members if m.rid != rid]
        if len(kept) == len(self._members):
            return False
        self._members, self._left = kept, True
        return True

    def _failed(self, rid: int, admitted: int, error: str) -> Result:
        empty = torch.zeros(0, device=self.device)
        return Result(rid, empty, empty, admitted=admitted, finished=self.clock, error=error)

    def _tables(
        self, members: list[Any], requests: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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

    # -- what an engine gives -----------------------------------------------------------------
    def _check(self, request: R) -> R:
        raise NotImplementedError

    def _member(self, rid: int, request: R) -> Any:
        raise NotImplementedError

    def _recompose(self, shape: S, staying: list[Any], joining: list[Any]) -> None:
        raise NotImplementedError

    def _run(self, shape: S) -> None:
        raise NotImplementedError

    def _flags(self, shape: S) -> Tensor:
        raise NotImplementedError

    def _save(self, member: Any) -> None:
        raise NotImplementedError

    def _result(self, member: Any) -> Result:
        raise NotImplementedError


def _raised(m: Any, err: Exception, clock: int) -> str:
    return (
        f"the model call raised {type(err).__name__}: {err} with this request in the pack, "
        f"and again with it alone (its step {m.step + 1} of {m.request.steps}, engine step "
        f"{clock}); the other requests went on"
    )
