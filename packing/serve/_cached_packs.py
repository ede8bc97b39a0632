"""The reference DiT with its context in a paged pool: each request's context computed once.

``Engine(model, EngineConfig(..., context_cache=ContextCache(pages=...)))`` serves through
these packs. A joining request claims its pages (reusing a session's cached frames whose
hashes match, `packing.serve._cache`), the frames not cached yet are prefilled in passes of
``prefill_frames`` sizes, and the pack lays out the generated tokens only; every step then
runs those over the pack's window of pages (`packing.serve._cached_step`)::

    admission   request 9 (session "arm-2", 20 frames, 18 cached)  -> prefill frames 18, 19
    step        q: generated frames + actions of requests 4, 6, 9  -> k/v: their pages ++ q
    finished    request 4 (no session): its pages are free again

Exact, not approximate, because a frame-causal model's context never attends to generated
tokens: its keys and values are the same at every step. A model that is not frame-causal is
refused (its context attends to the generated tokens).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from packing.attention import InnerMask
from packing.model import DiT
from packing.serve._cache import CachedShape, Key, PagePool, frame_hashes, pages_for
from packing.serve._cached_step import DevicePool, PrefillBlock, cached_step, prefill_step
from packing.serve._config import EngineConfig
from packing.serve._device import bounded
from packing.serve._packs import DiTPacks, _label
from packing.serve._request import Request

__all__ = ["CachedDiTPacks"]

_log = logging.getLogger("packing.serve")  # the engine's log: a request's traceback


@dataclass
class _Pages:
    """A request's record in the cache: its key (session, or its own id), frame hashes and
    pages."""

    key: Key
    hashes: list[bytes]
    pages: list[int]


class CachedDiTPacks(DiTPacks):
    """`DiTPacks` with ``config.context_cache``; ``stats`` counts the context frames
    prefilled and reused, hash mismatches (a session's frame changed) and evictions."""

    packs_context = False

    def __init__(self, model: DiT, config: EngineConfig, device: torch.device) -> None:
        cc = config.context_cache
        assert cc is not None
        if not model.config.frame_causal:
            raise ValueError(
                "EngineConfig.context_cache needs a frame-causal model: with "
                "DiTConfig.frame_causal=False every context token attends to the generated "
                "frames and actions, so its keys and values change at every step and cannot be "
                "cached; build the model with frame_causal=True or pass context_cache=None"
            )
        super().__init__(model, config, device)
        shapes = self.shapes
        self.shapes = [
            CachedShape(frames=s.frames, actions=s.actions, requests=s.requests,
                        window_pages=cc.window_pages(s.requests), page_frames=cc.page_frames)
            for s in shapes
        ]  # fmt: skip
        # The buffers `DiTPacks` allocated, under the cached shapes (same sizes, same order).
        self.buffers = {c: self.buffers[s] for c, s in zip(self.shapes, shapes, strict=True)}
        tpf = model.config.tokens_per_frame
        tail = max([s.frames * tpf + s.actions for s in self.shapes] + [cc.pass_sizes[-1] * tpf])
        self.cache = cc
        self.pages = PagePool(cc.pages, cc.page_frames)
        self.pool = bounded(lambda dev: DevicePool(model, cc, tail, dev), device,
                            "the context cache's pool", "ContextCache.pages")  # fmt: skip
        self.cache_stats = {"prefilled_frames": 0, "reused_frames": 0, "prefill_passes": 0}

    @property
    def stats(self) -> dict[str, int]:
        """``cache_stats`` with the pool's mismatches and evictions."""
        return {**self.cache_stats, "mismatches": self.pages.mismatches,
                "evictions": self.pages.evicted}  # fmt: skip

    def warm_keys(self) -> list[tuple[str, Callable[[], None]]]:
        """Every shape's step, and every prefill pass in every shape (its text and window)."""
        keys = super().warm_keys()
        for s in self.shapes:
            for n, block in self.pool.prefill.items():
                label = f"{_label(s)}: prefill {n} frames"
                keys.append((label, partial(self._run_prefill, s, block)))
        return keys

    def check_fits(self, r: Request) -> None:
        s, cc = self.shapes[-1], self.cache
        if cc.context_frames is not None and len(r.kept) > cc.context_frames:
            raise ValueError(
                f"the request keeps {len(r.kept)} context frames, more than "
                f"ContextCache.context_frames={cc.context_frames}; raise context_frames or "
                "drop context frames (keep_frames=)"
            )
        if pages_for(r, cc.page_frames) > cc.pages:
            raise ValueError(
                f"the request keeps {len(r.kept)} context frames, {pages_for(r, cc.page_frames)} "
                f"pages of {cc.page_frames} frames, more than the pool's {cc.pages}; raise "
                "ContextCache.pages or drop context frames (keep_frames=)"
            )
        if r.frames > s.frames or r.actions > s.actions:
            raise ValueError(
                f"the request generates {r.frames} frames and {r.actions} actions, more than "
                f"the largest PackShape (frames={s.frames}, actions={s.actions}; with a context "
                "cache a shape's frames are the generated ones); add a larger shape"
            )

    # -- the cache's hooks ------------------------------------------------------------------
    def member(self, rid: int, r: Request) -> _Pages:
        return _Pages(r.session if r.session is not None else rid, frame_hashes(r), [])

    def left(self, m: Any, *, finished: bool) -> None:
        """A finished chunk of a session keeps its pages for the next; any other frees them."""
        self.pages.release(m.record.key, m.rid, keep=finished and m.request.session is not None)

    def end_session(self, session: str) -> None:
        """Free ``session``'s pages (when its request in the pack, if any, leaves)."""
        self.pages.end(session)

    def sweep(self, live: set[int]) -> None:
        self.pages.sweep(live)

    def joined(self, shape: Any, members: Sequence[Any], first: int) -> list[tuple[Any, str]]:
        """The joining members claim their pages, the window is loaded, the frames not
        cached are prefilled; returns the members whose own prefill raised."""
        prefill: list[tuple[int, Any, int]] = []
        for k, m in enumerate(members[first:], start=first):
            rejoins = m.saved is not None  # after a failed call: its pages are still held
            m.record.pages, reuse = self.pages.claim(m.record.key, m.record.hashes, m.rid)
            prefill.append((k, m, reuse))
            if not rejoins:
                self.cache_stats["reused_frames"] += reuse
                self.cache_stats["prefilled_frames"] += len(m.record.hashes) - reuse
        pf = self.cache.page_frames
        window = [(p, k, j * pf, min(pf, len(m.record.hashes) - j * pf))
                  for k, m in enumerate(members) for j, p in enumerate(m.record.pages)]  # fmt: skip
        self.pool.clear(self.pages.take_released())  # before any prefill writes them again
        self.pool.load_window(window)
        return self._prefill(shape, prefill)

    def _prefill(self, shape: Any, todo: list[tuple[int, Any, int]]) -> list[tuple[Any, str]]:
        """Prefill the joining requests together; if a pass raises, each one alone, and a
        request whose own prefill raises fails alone, the others go on."""
        try:
            self._prefill_frames(shape, todo)
            return []
        except Exception:
            failed = []
            for one in todo:
                try:
                    self._prefill_frames(shape, [one])
                except Exception as err:
                    why = f"prefilling its context raised {type(err).__name__}: {err}"
                    _log.error("request %d: %s", one[1].rid, why, exc_info=err)
                    failed.append((one[1], why))
            return failed

    def _prefill_frames(self, shape: Any, todo: Sequence[tuple[int, Any, int]]) -> None:
        """The frames ``reuse..`` of each of ``todo``, in passes of the cache's sizes."""
        cfg, tpf, pf = self.model.config, self.model.config.tokens_per_frame, self.cache.page_frames
        frames = [(k, m, j) for k, m, reuse in todo for j in range(reuse, len(m.record.hashes))]
        gh, gw = cfg.grid
        hw = torch.stack(torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij"), -1)
        hw, s = hw.reshape(tpf, 2), torch.arange(tpf)
        while frames:
            size = self.cache.pass_size(len(frames))
            part, frames = frames[:size], frames[size:]
            Q, n = size * tpf, len(part) * tpf
            x = torch.zeros(Q, cfg.patch_features)
            doc, pos = torch.full((Q,), -1, dtype=torch.int64), torch.zeros(Q, dtype=torch.int64)
            thw, rows = torch.zeros(Q, 3, dtype=torch.int64), self.pool.N + torch.arange(Q)
            ctx = torch.stack([m.request.context[m.request.kept[j]] for _, m, j in part])
            x[:n] = self.model.patchify(ctx.float().cpu())
            for i, (k, m, j) in enumerate(part):
                t = slice(i * tpf, (i + 1) * tpf)
                doc[t], pos[t] = k, j * tpf + s
                thw[t, 0], thw[t, 1:] = m.request.kept[j], hw
                rows[t] = m.record.pages[j // pf] * self.pool.page_tokens + (j % pf) * tpf + s
            block = self.pool.prefill[size]
            block.load(*(t.to(self.device, non_blocking=True) for t in (x, doc, pos, thw, rows)))
            self._run_prefill(shape, block)
            self.cache_stats["prefill_passes"] += 1

    def _run_prefill(self, shape: Any, block: PrefillBlock) -> None:
        b, W = self.buffers[shape], shape.window_pages

        def fn() -> None:
            prefill_step(self.model, self.pool, W, block, b, backend=self.backend,
                         inner=self._inner, document_mask=self.model.config.document_mask)  # fmt: skip

        self.steps.run((shape, block.x.shape[0]), fn, block)

    def step(self, shape: Any) -> None:
        b, W = self.buffers[shape], shape.window_pages

        def fn() -> None:
            cached_step(self.model, b, self.pool, W, backend=self.backend, inner=self._inner,
                        document_mask=self.model.config.document_mask)  # fmt: skip

        self.steps.run(shape, fn, b)

    @property
    def _inner(self) -> InnerMask:  # frame-causal (the constructor refused other models)
        assert self.inner is not None
        return self.inner
