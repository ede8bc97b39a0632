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
"""

from __future__ import annotations

from collections import deque
from typing import Any, Generic, TypeVar

import torch

from packing._validate import check_int
from packing.serve._request import Result
from packing.serve._schedulers import FlowScheduler

__all__ = ["ContinuousBatcher"]

R = TypeVar("R")  # the request type
S = TypeVar("S")  # the pack shape type


class ContinuousBatcher(Generic[R, S]):
    """The queue and the bookkeeping; subclasses give ``_check``, ``_member``,
    ``_recompose``, ``_run`` and ``_result``, and set ``shapes``, ``scheduler``,
    ``max_steps`` before calling ``_start()``."""

    shapes: list[Any]
    scheduler: FlowScheduler
    max_steps: int

    def _start(self) -> None:
        self._waiting: deque[tuple[int, R]] = deque()
        self._members: list[Any] = []
        self._shape: S | None = None
        self._next_id = 0
        self._left = False  # a request finished since the last recomposition
        self.clock = 0  # engine steps run
        self.last_pack: tuple[tuple[int, int], ...] = ()  # (request id, its step) last step

    # -- the public calls -------------------------------------------------------------------
    def submit(self, request: R) -> int:
        """Queue ``request``; returns its id. Checked here, so a bad one never enters a pack."""
        self._check(request)
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
        """Admit, run one model call over the pack, return the requests that finished."""
        self._admit()
        if not self._members:
            return []
        assert self._shape is not None
        self.last_pack = tuple((m.rid, m.step) for m in self._members)
        self._run(self._shape)
        self.clock += 1
        done = []
        for m in self._members:
            m.step += 1
            if m.step == m.request.steps:
                done.append(self._result(m))
        if done:
            finished = {r.request_id for r in done}
            self._members = [m for m in self._members if m.rid not in finished]
            self._left = True
        return done

    def cancel(self, request_id: int) -> bool:
        """Drop a request, waiting or in the pack (its client left, or its deadline passed);
        True if it was still there. A member's rows leave at the next recomposition."""
        rid = check_int("request_id", request_id, min=0)
        for i, (wid, _) in enumerate(self._waiting):
            if wid == rid:
                del self._waiting[i]
                return True
        kept = [m for m in self._members if m.rid != rid]
        if len(kept) == len(self._members):
            return False
        self._members, self._left = kept, True
        return True

    def end_session(self, session: str) -> None:
        """The robot episode ``session`` ended: free what the engine keeps for it. An engine
        without a context cache keeps nothing between requests, so there is nothing to free."""
        if not isinstance(session, str):
            raise TypeError(f"session must be a str, got {type(session).__name__}")

    def run(self) -> list[Result]:
        """Step until nothing waits or runs; the results in the order they finished."""
        out: list[Result] = []
        while self._members or self._waiting:
            out += self.step()
        return out

    # -- shared internals -------------------------------------------------------------------
    def _admit(self) -> None:
        """Recompose the pack when a request left or a waiting one fits (FIFO)."""
        joining: list[Any] = []
        reqs = [m.request for m in self._members]
        while self._waiting and self.shapes[-1].fits([*reqs, self._waiting[0][1]]):
            rid, r = self._waiting.popleft()
            joining.append(self._member(rid, r))
            reqs.append(r)
        if not joining and not self._left:
            return
        self._left = False
        shape = next(s for s in self.shapes if s.fits(reqs))
        self._recompose(shape, self._members, joining)
        self.last_pack = tuple((m.rid, m.step) for m in self._members)

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
    def _check(self, request: R) -> None:
        raise NotImplementedError

    def _member(self, rid: int, request: R) -> Any:
        raise NotImplementedError

    def _recompose(self, shape: S, staying: list[Any], joining: list[Any]) -> None:
        raise NotImplementedError

    def _run(self, shape: S) -> None:
        raise NotImplementedError

    def _result(self, member: Any) -> Result:
        raise NotImplementedError
