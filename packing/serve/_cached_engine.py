"""The engine with a context cache: each request's context computed once, at admission.

``Engine(model, EngineConfig(..., context_cache=ContextCache(pages=...)))`` builds this
engine. Admission claims the joining requests' pages (reusing a session's cached frames whose
hashes match, `packing.serve._cache`), prefills the frames not cached yet, in passes of
``prefill_frames`` sizes, and lays out the pack's generated tokens only; every step then
runs those over the pool (`packing.serve._cached_step`)::

    admission   request 9 (session "arm-2", 20 frames, 18 cached)  -> prefill frames 18, 19
    step        q: generated frames + actions of requests 4, 6, 9  -> k/v: their pages ++ q
    finished    request 4 (no session): its pages are free again

Exact, not approximate, because a frame-causal model's context never attends to generated
tokens: its keys and values are the same at every step. A model that is not frame-causal is
refused (its context attends to the generated tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from packing.attention import InnerMask
from packing.model import DiT
from packing.serve._batching import _log
from packing.serve._cache import CachedShape, Key, PagePool, frame_hashes, pages_for
from packing.serve._cached_step import DevicePool, PrefillBlock, cached_step, prefill_step
from packing.serve._engine import Engine, EngineConfig, _Member
from packing.serve._pack import PackShape
from packing.serve._request import Request
from packing.serve._step import Buffers, GraphedStep

__all__ = ["CachedEngine"]


@dataclass
class _CachedMember(_Member):
    key: Key = 0  # its session, or its own id
    hashes: list[bytes] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)


class CachedEngine(Engine):
    """`Engine` with ``config.context_cache``; ``cache_stats`` counts the context frames
    prefilled and reused, hash mismatches (a session's frame changed) and evictions."""

    _packs_context = False

    def __init__(
        self, model: DiT, config: EngineConfig, *, device: torch.device | str | None = None
    ) -> None:
        cc = config.context_cache
        assert cc is not None
        if not model.config.frame_causal:
            raise ValueError(
                "EngineConfig.context_cache needs a frame-causal model: with "
                "DiTConfig.frame_causal=False every context token attends to the generated "
                "frames and actions, so its keys and values change at every step and cannot be "
                "cached; build the model with frame_causal=True or pass context_cache=None"
            )
        super().__init__(model, config, device=device)
        shapes = self.shapes
        self.shapes = [
            CachedShape(frames=s.frames, actions=s.actions, requests=s.requests,
                        window_pages=cc.window_pages(s.requests), page_frames=cc.page_frames)
            for s in self.shapes
        ]  # fmt: skip
        # The buffers `Engine` allocated, under the cached shapes (same sizes, same order).
        self._buffers = {c: self._buffers[s] for c, s in zip(self.shapes, shapes, strict=True)}
        tpf = model.config.tokens_per_frame
        tail = max([s.frames * tpf + s.actions for s in self.shapes] + [cc.pass_sizes[-1] * tpf])
        self.cache = cc
        self.pages = PagePool(cc.pages, cc.page_frames)
        self.pool = DevicePool(model, cc, tail, self.device)
        self._prefill_graphs: dict[object, GraphedStep] = {}  # (shape, pass tokens)
        self.cache_stats = {"prefilled_frames": 0, "reused_frames": 0, "prefill_passes": 0}

    @property
    def stats(self) -> dict[str, int]:
        """``cache_stats`` with the pool's mismatches and evictions."""
        return {**self.cache_stats, "mismatches": self.pages.mismatches,
                "evictions": self.pages.evicted}  # fmt: skip

    # -- the public call it changes, and where a request leaves -----------------------------
    def end_session(self, session: str) -> None:
        """Free ``session``'s pages (when its request in the pack, if any, leaves)."""
        super().end_session(session)
        self.pages.end(session)

    # -- internals --------------------------------------------------------------------------
    def _check_fits(self, r: Request) -> None:
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

    def _drop(self, rid: int) -> bool:
        """A member leaves (finished, cancelled, non-finite): a finished chunk of a session
        keeps its pages for the next; any other frees them."""
        m = next((m for m in self._members if m.rid == rid), None)
        dropped = super()._drop(rid)
        if dropped and isinstance(m, _CachedMember):
            done = m.step >= m.request.steps and m.request.session is not None
            self.pages.release(m.key, m.rid, keep=done)
        return dropped

    def _nonfinite(self, m: _Member, step: int) -> None:
        super()._nonfinite(m, step)  # a finished one's pages were kept: free them now
        if isinstance(m, _CachedMember):
            self.pages.release(m.key, m.rid, keep=False)

    def _isolate(self, members: list, err: Exception) -> None:
        super()._isolate(members, err)  # the requests it failed are in no pack now
        self.pages.sweep({m.rid for m in self._members})

    def _member(self, rid: int, request: Request) -> _CachedMember:
        m = super()._member(rid, request)  # its tokens: generated ones only (no context)
        key: Key = request.session if request.session is not None else rid
        return _CachedMember(**vars(m), key=key, hashes=frame_hashes(request))

    def _recompose(self, shape: PackShape, staying: list, joining: list) -> None:
        """`Engine._recompose` (the generated tokens), then the pages: the joining requests
        claim theirs, the page tables are loaded, the frames not cached are prefilled."""
        super()._recompose(shape, staying, joining)
        prefill: list[tuple[int, _CachedMember, int]] = []
        for k, m in enumerate(self._members):
            if k >= len(staying):
                rejoins = m.saved is not None  # after a failed call: its pages are still held
                m.pages, reuse = self.pages.claim(m.key, m.hashes, m.rid)
                prefill.append((k, m, reuse))
                if not rejoins:
                    self.cache_stats["reused_frames"] += reuse
                    self.cache_stats["prefilled_frames"] += len(m.hashes) - reuse
        pf = self.cache.page_frames
        window = [(p, k, j * pf, min(pf, len(m.hashes) - j * pf))
                  for k, m in enumerate(self._members) for j, p in enumerate(m.pages)]  # fmt: skip
        self.pool.clear(self.pages.take_released())  # before any prefill writes them again
        self.pool.load_window(window)
        self._prefill(shape, prefill)

    def _prefill(self, shape: PackShape, todo: list[tuple[int, _CachedMember, int]]) -> None:
        """Prefill the joining requests together; if a pass raises, each one alone, and a
        request whose own prefill raises fails alone (``Result.error``), the others go on."""
        try:
            self._prefill_frames(shape, todo)
        except Exception:
            for one in todo:
                try:
                    self._prefill_frames(shape, [one])
                except Exception as err:
                    m = one[1]
                    why = f"prefilling its context raised {type(err).__name__}: {err}"
                    _log.error("request %d failed: %s", m.rid, why, exc_info=err)
                    self._out.append(self._failed(m.rid, m.admitted, why))
                    self._drop(m.rid)  # its pages freed; its rows leave at the next step

    def _prefill_frames(self, shape: PackShape, todo: list[tuple[int, _CachedMember, int]]) -> None:
        """The frames ``reuse..`` of each of ``todo``, in passes of the cache's sizes."""
        cfg, tpf, pf = self.model.config, self.model.config.tokens_per_frame, self.cache.page_frames
        frames = [(k, m, j) for k, m, reuse in todo for j in range(reuse, len(m.hashes))]
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
                rows[t] = m.pages[j // pf] * self.pool.page_tokens + (j % pf) * tpf + s
            block = self.pool.prefill[size]
            block.load(*(t.to(self.device, non_blocking=True) for t in (x, doc, pos, thw, rows)))
            self._run_prefill(shape, block)
            self.cache_stats["prefill_passes"] += 1

    def _run_prefill(self, shape: PackShape, block: PrefillBlock) -> None:
        b, W = self._buffers[shape], shape.window_pages  # type: ignore[attr-defined]

        def fn() -> None:
            prefill_step(self.model, self.pool, W, block, b, backend=self.backend,
                         inner=self._inner, document_mask=self.model.config.document_mask)  # fmt: skip

        key = (shape, block.x.shape[0])
        self._graphed(self._prefill_graphs, key, fn, block)

    def _run(self, shape: PackShape) -> None:
        b, W = self._buffers[shape], shape.window_pages  # type: ignore[attr-defined]

        def fn() -> None:
            cached_step(self.model, b, self.pool, W, backend=self.backend, inner=self._inner,
                        document_mask=self.model.config.document_mask)  # fmt: skip

        self._graphed(self._graphs, shape, fn, b)

    def _graphed(
        self,
        graphs: dict[Any, GraphedStep],
        shape: object,
        fn: Callable[[], None],
        holder: Buffers | PrefillBlock,
    ) -> None:
        if not self.config.cuda_graphs:
            with torch.no_grad():
                fn()
            return
        g = graphs.get(shape)
        if g is None:
            with torch.no_grad():
                g = graphs[shape] = GraphedStep(fn, holder)
        g()

    @property
    def _inner(self) -> InnerMask:  # frame-causal (the constructor refused other models)
        assert self.inner is not None
        return self.inner
