"""Each robot's KV cache as LeRobot keeps it, in a pool the served model owns.

LeRobot's ``WanAttention`` keeps one cache per layer: ``capacity`` slots
(``attn_window // 2`` chunks of latent and action tokens), a valid mask, a write id per slot,
an ``is_pred`` flag. Every transformer call writes its keys into free slots and attends over
every valid slot plus its own; ``update_cache=0`` frees them again, ``1`` keeps them as
predicted (cleared before the next feedback), ``2`` keeps them as observed. A full cache
evicts the oldest ids first (its sliding window). One chunk of a robot, in slot terms::

    feedback   clear pred | keyframes (L, keep) | executed actions (A, keep)
    video      L slots, written by every step, kept (pred) after the last
    action     A slots, written by every step (the last one's keys are never read again)

`SlotAllocator` replays exactly those operations on the host (same tensors, same argsort), so
the slots every call writes and the slots it attends are known before the call: the device
step reads them as index tensors (no ``nonzero``, no host sync), and the pool holds a
session's slots as one region of ``capacity`` rows per guidance row (conditional,
unconditional). The allocation sequence depends on the token counts only, never on
values, so replaying a history gives the same slots as LeRobot's run of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["CallPlan", "ChunkPlan", "RegionPool", "Session", "SlotAllocator", "TextPool"]


class SlotAllocator:
    """LeRobot's ``allocate_slots`` / ``update_cache`` / ``restore_cache`` /
    ``clear_pred_cache`` on one layer's bookkeeping (every layer does the same)."""

    def __init__(self, capacity: int) -> None:
        self.mask = torch.zeros(capacity, dtype=torch.bool)
        self.ids = torch.full((capacity,), -1, dtype=torch.int64)
        self.is_pred = torch.zeros(capacity, dtype=torch.bool)
        self.evicted = 0  # slots freed to make room (LeRobot's window)

    def alloc(self, n: int, *, keep: bool, pred: bool) -> tuple[Tensor, Tensor]:
        """One call writing ``n`` keys: its slots and the slots it attends (valid + its own)."""
        mask, ids = self.mask, self.ids
        free = (~mask).nonzero(as_tuple=False).squeeze(-1)
        if free.numel() < n:
            used = mask.nonzero(as_tuple=False).squeeze(-1)
            order = torch.argsort(ids[used])  # LeRobot's (unstable) sort, on the CPU
            to_free = used[order[: n - free.numel()]]
            mask[to_free] = False
            ids[to_free] = -1
            self.evicted += to_free.numel()
            free = (~mask).nonzero(as_tuple=False).squeeze(-1)
        if free.numel() < n:
            raise ValueError(f"a call writes {n} keys, more than the cache's {mask.numel()} slots")
        slots = free[:n]
        new_id = ids[mask].max() + 1 if bool(mask.any()) else torch.tensor(0)
        ids[slots] = new_id
        mask[slots] = True
        self.is_pred[slots] = pred
        attend = mask.clone()
        if not keep:
            mask[slots] = False  # restore_cache
        return slots, attend

    def clear_pred(self) -> None:
        self.mask[self.is_pred] = False


@dataclass
class CallPlan:
    """One kind of call of one robot: the slots it writes and the slots it attends."""

    slots: Tensor  # (n,) int64
    attend: Tensor  # (capacity,) bool


def repeated(alloc: SlotAllocator, n: int, calls: int) -> CallPlan:
    """``calls`` calls of one loop (the last keeps its keys as predicted): after the first
    (which may evict), each finds the same free slots, so one plan serves them all."""
    plans = [alloc.alloc(n, keep=i == calls - 1, pred=True) for i in range(calls)]
    slots, attend = plans[0]
    assert all(torch.equal(s, slots) and torch.equal(a, attend) for s, a in plans)
    return CallPlan(slots, attend)


@dataclass
class ChunkPlan:
    """A chunk's calls: the feedback to prefill (chunk j, keyframes plan, actions plan),
    then its video and action loops."""

    index: int
    feedback: list[tuple[int, CallPlan, CallPlan]]
    video: CallPlan
    action: CallPlan


@dataclass
class Session:
    """One robot episode: its regions of the pool, its slot bookkeeping, what it absorbed."""

    key: str
    regions: list[int]  # one per guidance row (conditional, unconditional)
    capacity: int
    alloc: SlotAllocator = field(init=False)
    prefix: bytes = b""  # digest of (conditioning frame, prompt, negative)
    absorbed: list[bytes] = field(default_factory=list)  # chunk j's feedback digest, j < len
    predicted: int | None = None  # the chunk whose prediction's slots the allocator holds
    text: list[int] = field(default_factory=list)  # text pool slots (conditional, uncond.)
    plan: ChunkPlan | None = None  # the chunk in flight
    executed: list[Tensor] = field(default_factory=list)  # its predicted chunks (model space)
    busy: bool = False
    rid: int = -1  # the engine request of the chunk in flight
    ending: bool = False  # end_session came while a chunk was in flight: free it after
    dirty: bool = False  # a chunk failed midway: rebuild from the history next time

    def __post_init__(self) -> None:
        self.alloc = SlotAllocator(self.capacity)

    def reset(self, prefix: bytes) -> None:
        self.alloc, self.prefix = SlotAllocator(self.capacity), prefix
        self.absorbed, self.predicted, self.dirty = [], None, False


class RegionPool:
    """``regions`` slots of the pool, each a session's cache for one guidance row."""

    def __init__(self, regions: int) -> None:
        self.free = list(range(regions))
        self.size = regions

    def claim(self, n: int, session: str, sessions: int) -> list[int]:
        if len(self.free) < n:
            raise ValueError(
                f"session {session!r} needs {n} cache regions but the pool's {self.size} are "
                f"held by {sessions} other robots; raise robots= (the pool), or end an episode "
                "(engine.end_session) before starting this one"
            )
        out, self.free = self.free[:n], self.free[n:]
        return out

    def release(self, regions: list[int]) -> None:
        self.free = sorted(self.free + regions)


class TextPool:
    """Text slots (the text encoder's output, projected, and each layer's cross-attention
    keys and values), shared by content: every robot's unconditional prompt is one slot."""

    def __init__(self, slots: int) -> None:
        self.free = list(range(slots))
        self.owners: dict[bytes, tuple[int, int]] = {}  # digest -> (slot, references)

    def claim(self, digest: bytes) -> tuple[int, bool]:
        """The slot for ``digest`` and whether it is new (to be filled)."""
        if digest in self.owners:
            slot, refs = self.owners[digest]
            self.owners[digest] = (slot, refs + 1)
            return slot, False
        if not self.free:
            raise ValueError("the text pool is full; raise robots= (each robot holds two slots)")
        slot = self.free.pop(0)
        self.owners[digest] = (slot, 1)
        return slot, True

    def release(self, slot: int) -> None:
        for d, (s, refs) in list(self.owners.items()):
            if s == slot:
                if refs > 1:
                    self.owners[d] = (s, refs - 1)
                else:
                    del self.owners[d]
                    self.free.append(s)
                return
