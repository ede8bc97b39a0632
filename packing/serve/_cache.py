"""The context cache's host side: its configuration, the pool's pages, sessions and hashes.

A frame-causal model's clean context (t = 0) never attends to the tokens being generated, so
its keys and values at every layer are the same at every denoising step and for the robot's
next chunk. The engine computes them once (a prefill) into a static pool of fixed-size pages,
shared by all requests; each step then runs only the generated tokens over it. Pool of 6
pages of 2 frames (``page_frames=2``), three requests' contexts and a free page::

    page      0      1      2      3      4      5
    frames   a0 a1  b0 b1  a2 a3  b2 .  free   c0 c1      a: 4 frames, b: 3, c: 2
    table    a -> [0, 2]   b -> [1, 3]   c -> [5]          (page 3 half used: b has 3 frames)

A request's pages are its **session's** (``Request.session``, one robot episode): its next
chunk, whose context is the previous one plus new frames, finds the frames it already sent
cached and prefills only the new ones. Never stale: each kept frame has a chained content
hash (the frame's bytes, its place in the episode, the task, and the hash of the frame before
it, which is what its keys depend on), and only the longest run of frames whose hashes match
the cached ones is reused; the rest is prefilled again. When the free pages run out, the
least recently used session with no request in the pack is evicted (all its pages); a
session's pages are freed at ``end_session``, a request without a session frees its own when
it finishes, and a cancelled request its session's.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from packing._validate import check_int
from packing.serve._limits import MAX_FRAMES, MAX_REQUESTS
from packing.serve._pack import PackShape
from packing.serve._request import Request

__all__ = ["CachedShape", "ContextCache", "Key", "PagePool", "frame_hashes", "pages_for"]

Key = str | int  # a session's name, or the id of a request without a session


@dataclass(frozen=True, kw_only=True)
class ContextCache:
    """``EngineConfig(context_cache=ContextCache(pages=..., page_frames=...))``: a pool of
    ``pages`` pages of ``page_frames`` latent frames each (per layer, keys and values), fixed at
    construction; ``prefill_frames``: the sizes, in context frames, of a prefill pass (each
    one static shape, compiled and captured once; a pass takes the smallest size that holds
    the frames left to prefill, else the largest, so a session's two new frames do not pay for
    a 32-frame pass and a fresh 80-frame context takes three).

    With a cache, a `PackShape`'s ``frames`` count the pack's **generated** frames only (its
    context is in the pool), and the pool must hold the largest shape's requests: the engine
    checks it. A page of ``page_frames * tokens_per_frame`` tokens is 128 tokens (one
    FlexAttention tile) at 4 frames of 32 tokens.

    ``context_frames``: the most context frames one request keeps (a longer one is refused at
    submit). A pack's step attends over a static window of its own requests' pages, ``requests
    x ceil(context_frames / page_frames)`` pages (at most ``pages``), gathered from the pool,
    so a step costs what its pack uses whatever the pool's size; ``None``: the window is the
    whole pool (a step then costs the pool)."""

    pages: int
    page_frames: int = 4
    prefill_frames: int | tuple[int, ...] = (4, 32)
    context_frames: int | None = None

    def __post_init__(self) -> None:
        for name, top in (("pages", 1 << 24), ("page_frames", MAX_FRAMES)):
            v = check_int(f"ContextCache.{name}", getattr(self, name), min=1, max=top)
            object.__setattr__(self, name, v)
        sizes = self.prefill_frames
        sizes = (sizes,) if not isinstance(sizes, tuple | list) else tuple(sizes)
        if not sizes:
            raise ValueError("ContextCache.prefill_frames=(); give one or more pass sizes")
        sizes = tuple(
            sorted(
                {check_int("ContextCache.prefill_frames", n, min=1, max=MAX_FRAMES) for n in sizes}
            )
        )
        object.__setattr__(self, "prefill_frames", sizes)
        if self.context_frames is not None:
            n = check_int("ContextCache.context_frames", self.context_frames, min=1, max=MAX_FRAMES)
            object.__setattr__(self, "context_frames", n)

    def window_pages(self, requests: int) -> int:
        """The pages a pack of ``requests`` requests attends over: ``requests`` times one
        request's most pages, at most the pool (``pages=256, page_frames=4,
        context_frames=22``: 6 pages a request, 48 for 8 requests)."""
        requests = check_int("requests", requests, min=1, max=MAX_REQUESTS)
        if self.context_frames is None:
            return self.pages
        return min(self.pages, requests * -(-self.context_frames // self.page_frames))

    @property
    def pass_sizes(self) -> tuple[int, ...]:
        """``prefill_frames`` as an ascending tuple."""
        assert isinstance(self.prefill_frames, tuple)
        return self.prefill_frames

    def pass_size(self, frames: int) -> int:
        """The prefill pass for ``frames`` frames still to prefill: the smallest that holds
        them, else the largest (``(4, 32)``: 2 -> 4, 20 -> 32, 80 -> 32)."""
        frames = check_int("frames", frames, min=1, max=MAX_FRAMES, hint="frames still to prefill")
        return next((n for n in self.pass_sizes if n >= frames), self.pass_sizes[-1])


def pages_for(r: Request, page_frames: int) -> int:
    """Pages the kept context of ``r`` takes (a partly used last page counts)."""
    return -(-len(r.kept) // page_frames)


@dataclass(frozen=True, kw_only=True)
class CachedShape(PackShape):
    """A `PackShape` of the cached engine: ``frames`` are generated frames, and the pack's
    contexts must fit its window of the pool (``window_pages`` of ``page_frames``, see
    `ContextCache.window_pages`). Two chunks of one session never share a pack: the second
    waits for the first (its pages are being read)."""

    window_pages: int
    page_frames: int

    def fits(self, requests: Sequence[Request]) -> bool:
        frames = sum(r.frames for r in requests)
        actions = sum(r.actions for r in requests)
        pages = sum(pages_for(r, self.page_frames) for r in requests)
        sessions = [r.session for r in requests if r.session is not None]
        return (
            len(requests) <= self.requests
            and frames <= self.frames
            and actions <= self.actions
            and pages <= self.window_pages
            and len(sessions) == len(set(sessions))
        )


def frame_hashes(r: Request) -> list[bytes]:
    """The chained content hash of each kept context frame of ``r``, on the host.

    ``h_i = blake2b(h_{i-1}, task, episode index of frame i, its dtype, shape and bytes)``: a
    frame's keys depend on itself, its RoPE position, the task (cross-attention) and every
    kept frame before it (frame-causal attention), and so does its hash. Reads the context's
    values (a CPU request costs no device sync)."""
    frames = r.context.detach()
    if frames.device.type != "cpu":
        frames = frames.cpu()
    task = r.task.encode("utf-8")
    out, prev = [], b""
    for i in r.kept:
        f = frames[i].contiguous()
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(len(task).to_bytes(8, "little") + task + i.to_bytes(8, "little"))
        h.update(f"{f.dtype}{tuple(f.shape)}".encode())
        h.update(f.view(-1).view(torch.uint8).numpy().tobytes())
        prev = h.digest()
        out.append(prev)
    return out


@dataclass
class _Entry:
    """A session's cached frames (their hashes, in order) and the pages holding them."""

    hashes: list[bytes] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    running: bool = False
    ended: bool = False
    owner: int = -1  # the request that claimed it last


class PagePool:
    """Which pages are free and which session holds which (host bookkeeping only; the
    keys and values live in `packing.serve._cached_step.DevicePool`).

    ``claim(key, hashes)`` when a request joins: it reuses the session's longest matching
    prefix of frames and returns its pages and how many frames are reused (the rest must be
    prefilled); ``release(key, keep)`` when it leaves. ``check_hashes=False`` is a test
    hook: frames are reused by position alone, the stale cache the proof must catch."""

    def __init__(self, pages: int, page_frames: int) -> None:
        self.page_frames = page_frames
        self.free = list(range(pages - 1, -1, -1))  # pop() hands out page 0 first
        self.entries: OrderedDict[Key, _Entry] = OrderedDict()  # least recently used first
        self.check_hashes = True
        self.evicted = 0  # sessions evicted to make room
        self.mismatches = 0  # claims whose cached frames differed from the request's
        self.released: list[int] = []  # freed since take_released()

    def claim(self, key: Key, hashes: list[bytes], owner: int) -> tuple[list[int], int]:
        """(the pages of ``key``'s frames, how many frames are reused), for request
        ``owner``; a request that claims again (rejoining after a failed call) reuses all."""
        e = self.entries.setdefault(key, _Entry())
        self.entries.move_to_end(key)
        reuse = 0
        for old, new in zip(e.hashes, hashes, strict=False):
            if old != new and self.check_hashes:
                self.mismatches += 1
                break
            reuse += 1
        need = -(-len(hashes) // self.page_frames)
        while len(e.pages) > need:
            self._free([e.pages.pop()])
        if len(e.pages) < need:
            self._make_room(need - len(e.pages), keep=key)
            e.pages += [self.free.pop() for _ in range(need - len(e.pages))]
        e.hashes, e.running, e.ended, e.owner = list(hashes), True, False, owner
        return list(e.pages), reuse

    def sweep(self, live: set[int]) -> None:
        """Drop every running entry whose request is not in ``live`` (request ids): a
        request that left by any path (a failed model call) leaves no pages held."""
        for key in [k for k, e in self.entries.items() if e.running and e.owner not in live]:
            self._drop(key)

    def release(self, key: Key, owner: int, keep: bool) -> None:
        """Request ``owner`` of ``key`` left the pack; ``keep``: its session may send more
        (a later chunk of the session that claimed since is left alone)."""
        e = self.entries.get(key)
        if e is None or e.owner != owner:
            return
        e.running = False
        if not keep or e.ended:
            self._drop(key)

    def end(self, key: Key) -> None:
        """The session ended: free its pages now, or when its running request leaves."""
        e = self.entries.get(key)
        if e is None:
            return
        if e.running:
            e.ended = True
        else:
            self._drop(key)

    def take_released(self) -> list[int]:
        """The pages freed since the last call: the engine zeroes them on the device, since
        every pool key, free or not, is in each step's keys (masked), and a masked key must
        hold no NaN (a failed request's), which SDPA's ``0 * NaN`` would spread."""
        out, self.released = self.released, []
        return out

    def _free(self, pages: list[int]) -> None:
        self.free += pages
        self.released += pages

    def _drop(self, key: Key) -> None:
        self._free(self.entries.pop(key).pages)

    def _make_room(self, n: int, keep: Key) -> None:
        for key in [k for k, e in self.entries.items() if not e.running and k != keep]:
            if len(self.free) >= n:
                return
            self._drop(key)
            self.evicted += 1
        if len(self.free) < n:  # CachedShape.fits keeps a pack inside the pool
            raise AssertionError(f"pool exhausted: {n} pages needed, {len(self.free)} free")
