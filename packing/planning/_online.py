"""Packing a stream: a buffer of N episodes, a full pack emitted whenever the buffer is full.

For iterable datasets, where lengths are not known in advance. Three episodes of ``[5, 3, 4]``
tokens, budget 8, buffer 2::

    read 5, 3        buffer full -> emit [5, 3] (5 is over half the budget: it opens)
    read 4, end      flush with best-fit decreasing -> emit [4]

Each emitted pack opens with the middle buffered episode (the longest if it is over half the
budget), adds the longest ones that still leave room for the shortest, and closes with the best
fit, as ``plan_packs``' default does. Awkward episodes can wait in the buffer for a while
(on 20K seed-like episodes with a buffer of 64: median wait 10 episodes, p99 ~750), so the
stream's order is kept only loosely; the buffer bounds memory, not waiting. At the end of the
stream the buffer is planned with ``plan_packs`` so nothing is lost. Episodes over the budget
follow ``oversize``: ``"error"`` or ``"drop"`` (counted in ``num_dropped`` and warned about);
split long episodes upstream with ``packing.planning._pieces.split_windows`` if they must be kept.
"""

from __future__ import annotations

import warnings
from bisect import bisect_right, insort
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, Literal, TypeVar

from packing._validate import check_int, check_optional_int
from packing.planning._binpack import opener_index
from packing.planning._plan import plan_packs

__all__ = ["BufferedPacker"]

T = TypeVar("T")


class BufferedPacker(Generic[T]):
    """``packer(stream)`` yields lists of episodes whose ``length(episode)`` sum to at most
    ``token_budget``. Counters (``num_episodes``, ``num_tokens``, ``num_packs``,
    ``num_dropped``) accumulate over calls, so efficiency is
    ``num_tokens / (num_packs * token_budget)``."""

    def __init__(
        self,
        token_budget: int,
        *,
        length: Callable[[T], int] = len,  # type: ignore[assignment]
        buffer_size: int = 64,
        max_docs: int | None = None,
        oversize: Literal["error", "drop"] = "error",
    ) -> None:
        token_budget = check_int("token_budget", token_budget, min=1, hint="tokens per pack")
        buffer_size = check_int("buffer_size", buffer_size, min=1, hint="episodes buffered")
        max_docs = check_optional_int("max_docs", max_docs, min=1, hint="episodes per pack")
        if not callable(length):
            raise TypeError(f"length={length!r} must be a function episode -> tokens")
        if oversize not in ("error", "drop"):
            raise ValueError(
                f"oversize={oversize!r}; the stream packer supports 'error' or 'drop' "
                f"(split long episodes upstream with packing.planning._pieces.split_windows)"
            )
        self.token_budget, self.length, self.buffer_size = token_budget, length, buffer_size
        self.max_docs, self.oversize = max_docs, oversize
        self.num_episodes = self.num_tokens = self.num_packs = self.num_dropped = 0

    @property
    def efficiency(self) -> float:
        return self.num_tokens / max(self.num_packs * self.token_budget, 1)

    def __call__(self, stream: Iterable[T]) -> Iterator[list[T]]:
        # The buffer is a list of (length, arrival, episode) sorted by (length, arrival).
        buf: list[tuple[int, int, T]] = []
        for arrival, ep in enumerate(stream):
            # A float length (3.7) is refused, not truncated: it would overfill a pack.
            n = check_int(f"length(episode {arrival} of the stream)", self.length(ep))
            if n < 1 or n > self.token_budget:
                self._oversize(arrival, n)
                continue
            insort(buf, (n, arrival, ep), key=lambda x: (x[0], x[1]))
            if len(buf) >= self.buffer_size:
                yield self._emit(self._fill(buf))
        if buf:
            plan = plan_packs([n for n, _, _ in buf], self.token_budget, max_docs=self.max_docs)
            for pack in plan.packs:
                yield self._emit([buf[i] for i in pack])

    def _fill(self, buf: list[tuple[int, int, T]]) -> list[tuple[int, int, T]]:
        # Same opener as plan_packs' "lookahead": the longest if over half the budget, else the
        # middle of the buffer, so short episodes are not all spent as fillers.
        pack = [buf.pop(opener_index(len(buf), buf[-1][0], self.token_budget))]
        room = self.token_budget - pack[0][0]
        while buf and (self.max_docs is None or len(pack) < self.max_docs):
            j = bisect_right(buf, room, key=lambda x: x[0]) - 1  # best fit: largest that fits
            if j < 0:
                break
            if buf[j][0] < room and (self.max_docs is None or len(pack) + 1 < self.max_docs):
                # Look ahead: rather than leave a gap no buffered episode can fill, take the
                # largest episode that leaves room for the shortest one.
                k = bisect_right(buf, room - buf[0][0], key=lambda x: x[0]) - 1
                if k > 0 or (k == 0 and len(buf) > 1):
                    j = k
            room -= buf[j][0]
            pack.append(buf.pop(j))
        return pack

    def _emit(self, pack: list[tuple[int, int, T]]) -> list[T]:
        self.num_packs += 1
        self.num_episodes += len(pack)
        self.num_tokens += sum(n for n, _, _ in pack)
        return [ep for _, _, ep in sorted(pack, key=lambda x: x[1])]

    def _oversize(self, arrival: int, n: int) -> None:
        if n < 1:
            raise ValueError(f"episode {arrival} of the stream has {n} tokens; drop empty episodes")
        if self.oversize == "error":
            raise ValueError(
                f"episode {arrival} of the stream has {n:,} tokens > token_budget="
                f"{self.token_budget:,}; raise token_budget or pass oversize='drop'"
            )
        self.num_dropped += 1
        warnings.warn(
            f"oversize='drop': episode {arrival} of the stream ({n:,} tokens > token_budget="
            f"{self.token_budget:,}) left out; {self.num_dropped} dropped so far (num_dropped)",
            stacklevel=3,
        )
