"""The packed inference engine: continuous batching of denoising requests in static packs.

Requests wait in a FIFO queue on the host. Between steps, finished requests leave and waiting
ones join (FIFO, while they fit the largest `PackShape`); the pack takes the smallest shape
that holds them. Each `Engine.step` is one model call over the pack with every request at its
own step, then each request's solver update. A pack of three requests at three steps::

    engine step 12 | request 4: step 9/10 | request 6: step 2/10 | request 7: step 0/6 | pad
                   |  t = 0.10            |  t = 0.80            |  t = 1.00            |
    after it       request 4 finishes (its Result is returned), request 8 joins at step 0

Nothing here reads a device value: the host mirrors every request's step count, so it knows
when one finishes; it waits only for the model call before the one it just launched, so the
GPU always has the next call queued while the host admits, and an arriving request joins
within two calls. A `Result` holds device tensors (call ``.cpu()`` when you need the numbers;
the policy server reads them on a side stream, `packing.serve._device.to_host`). With
``cuda_graphs=True`` each shape's step is captured once and replayed; admission copies the
new composition into the captured buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import get_args

import torch
from torch import Tensor

from packing._validate import check_bool, check_choice, check_int, check_sequence
from packing.attention import Backend, frame_causal, resolve_backend
from packing.model import DiT
from packing.serve._batching import ContinuousBatcher
from packing.serve._cache import ContextCache
from packing.serve._device import allocate, pinned
from packing.serve._limits import MAX_STEPS
from packing.serve._pack import HostPack, PackShape, build_pack, initial_tokens
from packing.serve._request import Request, Result, check_task, submitted
from packing.serve._schedulers import FlowScheduler, check_scheduler
from packing.serve._step import Buffers, GraphedStep, run_step

__all__ = ["Engine", "EngineConfig"]


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """``shapes``: the static packs (a few token budgets); ``max_steps``: the most denoising
    steps a request may ask for (the width of the schedule tables); ``cuda_graphs``: capture
    each shape's step in a CUDA graph (CUDA only); ``attention``: the backend (``auto``: sdpa
    on CPU, FlexAttention on CUDA); ``context_cache``: compute each request's clean context
    once into a paged K/V pool and run only the generated tokens at every step (frame-causal
    models only; `ContextCache`; ``None``: every step runs the whole pack)."""

    shapes: tuple[PackShape, ...]
    scheduler: FlowScheduler = field(default_factory=FlowScheduler)
    max_steps: int = 50
    cuda_graphs: bool = False
    attention: Backend = "auto"
    context_cache: ContextCache | None = None

    def __post_init__(self) -> None:
        shapes = tuple(check_sequence("EngineConfig.shapes", self.shapes))
        if not shapes or not all(isinstance(s, PackShape) for s in shapes):
            raise ValueError(f"EngineConfig.shapes={self.shapes!r}; give one or more PackShape")
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(
            self,
            "max_steps",
            check_int("EngineConfig.max_steps", self.max_steps, min=1, max=MAX_STEPS),
        )
        check_scheduler("EngineConfig.scheduler", self.scheduler)
        object.__setattr__(
            self, "cuda_graphs", check_bool("EngineConfig.cuda_graphs", self.cuda_graphs)
        )
        check_choice("EngineConfig.attention", self.attention, get_args(Backend))
        if self.context_cache is not None and not isinstance(self.context_cache, ContextCache):
            raise TypeError(
                f"EngineConfig.context_cache must be a ContextCache or None, got "
                f"{type(self.context_cache).__name__}"
            )


@dataclass
class _Member:
    rid: int
    request: Request
    admitted: int
    step: int = 0
    video_start: int = 0
    action_start: int = 0
    fresh: tuple[Tensor, Tensor] | None = None  # host tokens (clean context, noise) to join
    saved: tuple[Tensor, ...] | None = None  # its state (x_v, vp_v, x_a, vp_a) to rejoin


class Engine(ContinuousBatcher[Request, PackShape]):
    """Serve `Request`s with one model call per step over a pack of them.

    ``engine.submit(req) -> id``; ``engine.step() -> [Result, ...]`` (those that finished);
    ``engine.run()`` steps until every submitted request is done. ``model`` is the reference
    `packing.model.DiT` (or anything with its ``config``, ``patchify``/``unpatchify`` and
    ``velocity``); compile its blocks first (``block.compile()``) for compiled kernels.
    With ``config.context_cache`` it is the cached engine (`packing.serve._cached_engine`).
    """

    _packs_context = True  # the cached engine lays out the generated tokens only

    def __new__(cls, model: DiT, config: EngineConfig, **kwargs: object) -> Engine:
        if cls is Engine and getattr(config, "context_cache", None) is not None:
            from packing.serve._cached_engine import CachedEngine

            return super().__new__(CachedEngine)
        return super().__new__(cls)

    def __init__(
        self, model: DiT, config: EngineConfig, *, device: torch.device | str | None = None
    ) -> None:
        p = next(model.parameters())
        self.device = torch.device(device) if device is not None else p.device
        if p.device != self.device:
            raise ValueError(f"the model is on {p.device} but device={self.device}; move it")
        if config.cuda_graphs and self.device.type != "cuda":
            raise ValueError("EngineConfig.cuda_graphs=True needs a CUDA model; use False on CPU")
        cfg = model.config
        self.model, self.config = model, config
        self.inner = frame_causal(cfg.tokens_per_frame) if cfg.frame_causal else None
        self.backend = resolve_backend(
            config.attention,
            device=self.device,
            dtype=p.dtype,
            head_dim=cfg.head_dim,
            inner=self.inner,
        )
        if self.backend == "varlen":
            raise ValueError(
                "the engine builds its masks inside the step from doc ids; backend 'varlen' "
                "needs host-side lengths: use attention='flex' (or 'sdpa' on CPU)"
            )
        self.shapes = sorted(config.shapes, key=lambda s: (s.frames, s.actions, s.requests))
        self.scheduler, self.max_steps = config.scheduler, config.max_steps
        self._buffers = allocate(
            self.shapes,
            lambda s, dev: Buffers(s, model, max_steps=config.max_steps, device=dev),
            self.device,
            "EngineConfig.max_steps",
        )
        self._graphs: dict[PackShape, GraphedStep] = {}
        self._start()

    # -- internals --------------------------------------------------------------------------
    def _check(self, r: Request) -> Request:
        if not isinstance(r, Request):
            raise TypeError(f"submit takes a packing.serve.Request, got {type(r).__name__}")
        cfg = self.model.config
        frame = (cfg.latent_channels, *cfg.latent_hw)
        if tuple(r.context.shape[1:]) != frame:
            raise ValueError(
                f"Request.context frames are {tuple(r.context.shape[1:])}, the model takes "
                f"(C, H, W) = {frame}; encode the frames at the model's latent size"
            )
        if r.committed_actions is not None and r.committed_actions.shape[1] != cfg.action_dim:
            raise ValueError(
                f"Request.committed_actions has {r.committed_actions.shape[1]} action dims, the "
                f"model takes action_dim={cfg.action_dim}"
            )
        if r.steps > self.config.max_steps:
            raise ValueError(
                f"Request.steps={r.steps} > EngineConfig.max_steps={self.config.max_steps}; "
                "raise max_steps or ask for fewer steps"
            )
        self._check_fits(r)
        check_task(r.task, cfg.text_len)
        return submitted(r, compute=next(self.model.parameters()).dtype)  # copied, re-checked

    def _check_fits(self, r: Request) -> None:
        if not self.shapes[-1].fits([r]):
            s = self.shapes[-1]
            raise ValueError(
                f"the request needs {len(r.kept) + r.frames} frames and {r.actions} actions, "
                f"more than the largest PackShape (frames={s.frames}, actions={s.actions}); "
                "add a larger shape or drop context frames (keep_frames=)"
            )

    def _context_frames(self, r: Request) -> int:
        """Context frames of ``r`` laid out in the pack (all kept ones; none when cached)."""
        return len(r.kept) if self._packs_context else 0

    def _video_tokens(self, r: Request) -> int:
        """Video tokens of ``r`` in the pack: its laid-out context frames, then generated."""
        return (self._context_frames(r) + r.frames) * self.model.config.tokens_per_frame

    def _member(self, rid: int, r: Request) -> _Member:
        """The request's host work at admission: its tokens, clean context then noise."""
        cfg = self.model.config
        lat, act = initial_tokens(r, (cfg.latent_channels, *cfg.latent_hw), cfg.action_dim)
        ctx = r.context[list(r.kept[: self._context_frames(r)])].float()
        tokens = self.model.patchify(torch.cat([ctx, lat]))
        return _Member(rid, r, admitted=self.clock, fresh=(tokens, act))

    def _recompose(self, shape: PackShape, staying: list[_Member], joining: list[_Member]) -> None:
        """Lay the members out in ``shape``; the ``staying`` ones carry their state over."""
        members, kept = staying + joining, len(staying)
        cfg = self.model.config
        host = build_pack([m.request for m in members], shape, grid=cfg.grid,
                          text_len=cfg.text_len, context=self._packs_context)  # fmt: skip
        old = self._buffers[self._shape] if self._shape is not None else None
        new = self._buffers[shape]
        take_v, take_a = self._take(members[:kept], host, new)
        fresh_v, fresh_a, rows_v, rows_a = self._fresh(members[kept:], host, kept)
        dev = self.device
        for (x, vp), (ox, ovp), take, fresh, rows in (
            ((new.x_v, new.vp_v), (old.x_v, old.vp_v) if old else (None, None), take_v, fresh_v, rows_v),
            ((new.x_a, new.vp_a), (old.x_a, old.vp_a) if old else (None, None), take_a, fresh_a, rows_a),
        ):  # fmt: skip
            _carry(x, vp, ox, ovp, pinned(take, dev).to(dev, non_blocking=True))
            x.index_copy_(0, pinned(rows, dev).to(dev, non_blocking=True),
                          pinned(fresh, dev).to(dev, non_blocking=True))  # fmt: skip
        self._rejoin(members[kept:], host, kept, new)
        new.load(host, *self._tables(members, shape.requests))
        for k, m in enumerate(members):
            m.video_start, m.action_start = host.video_start[k], host.action_start[k]
        self._members, self._shape = members, shape

    def _take(self, staying: list[_Member], host: HostPack, new: Buffers) -> tuple[Tensor, Tensor]:
        """For each row of the new pack, the row of the old pack it comes from (-1: none).

        Request 5 at video rows 96..159 of the old pack and 0..63 of the new one gives
        ``take_v[0:64] = 96..159``; a joining request's rows stay -1 (``_fresh`` fills them).
        """
        take_v = torch.full((new.x_v.shape[0],), -1, dtype=torch.int64)
        take_a = torch.full((new.x_a.shape[0],), -1, dtype=torch.int64)
        for k, m in enumerate(staying):
            nv, v0 = self._video_tokens(m.request), host.video_start[k]
            take_v[v0 : v0 + nv] = torch.arange(nv) + m.video_start
            na, a0 = m.request.actions, host.action_start[k]
            take_a[a0 : a0 + na] = torch.arange(na) + m.action_start
        return take_v, take_a

    def _fresh(
        self, joining: list[_Member], host: HostPack, first: int
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The new requests' tokens (clean context, then noise: ``_member``) and their rows."""
        cfg = self.model.config
        vs, as_, rv, ra = (
            [torch.zeros(0, cfg.patch_features)],
            [torch.zeros(0, cfg.action_dim)],
            [],
            [],
        )
        for k, m in enumerate(joining, start=first):
            if m.fresh is None:  # rejoins from its saved state (`_rejoin`)
                continue
            r = m.request
            vs.append(m.fresh[0])
            as_.append(m.fresh[1])
            m.fresh = None
            v0, a0 = host.video_start[k], host.action_start[k]
            rv.append(torch.arange(v0, v0 + self._video_tokens(r)))
            ra.append(torch.arange(a0, a0 + r.actions))
        rows_v = torch.cat(rv) if rv else torch.zeros(0, dtype=torch.int64)
        rows_a = torch.cat(ra) if ra else torch.zeros(0, dtype=torch.int64)
        return torch.cat(vs), torch.cat(as_), rows_v, rows_a

    def _rejoin(self, joining: list[_Member], host: HostPack, first: int, b: Buffers) -> None:
        """Write back the saved state of the members that rejoin (after a failed call)."""
        for k, m in enumerate(joining, start=first):
            if m.saved is None:
                continue
            r, (xv, vpv, xa, vpa) = m.request, m.saved
            v0, a0 = host.video_start[k], host.action_start[k]
            nv = self._video_tokens(r)
            for x, src, lo, n in ((b.x_v, xv, v0, nv), (b.vp_v, vpv, v0, nv),
                                  (b.x_a, xa, a0, r.actions), (b.vp_a, vpa, a0, r.actions)):  # fmt: skip
                x[lo : lo + n] = src

    def _save(self, m: _Member) -> None:
        b, r = self._buffers[self._shape], m.request  # type: ignore[index]
        nv = self._video_tokens(r)
        v, a = slice(m.video_start, m.video_start + nv), slice(m.action_start,
                                                               m.action_start + r.actions)  # fmt: skip
        m.saved = (b.x_v[v].clone(), b.vp_v[v].clone(), b.x_a[a].clone(), b.vp_a[a].clone())

    def _flags(self, shape: PackShape) -> Tensor:
        return self._buffers[shape].bad_K

    def _run(self, shape: PackShape) -> None:
        b = self._buffers[shape]

        def fn() -> None:
            run_step(self.model, b, backend=self.backend, inner=self.inner,
                     document_mask=self.model.config.document_mask)  # fmt: skip

        if not self.config.cuda_graphs:
            with torch.no_grad():
                fn()
            return
        g = self._graphs.get(shape)
        if g is None:
            with torch.no_grad():
                g = self._graphs[shape] = GraphedStep(fn, b)
        g()

    def _result(self, m: _Member) -> Result:
        b = self._buffers[self._shape]  # type: ignore[index]
        r, tpf = m.request, self.model.config.tokens_per_frame
        v0 = m.video_start + self._context_frames(r) * tpf
        lat = self.model.unpatchify(b.x_v[v0 : v0 + r.frames * tpf].clone())
        act = b.x_a[m.action_start : m.action_start + r.actions].clone()
        return Result(m.rid, lat, act, admitted=m.admitted, finished=self.clock)


def _carry(x: Tensor, vp: Tensor, ox: Tensor | None, ovp: Tensor | None, take: Tensor) -> None:
    """``x[i] = ox[take[i]]`` where ``take >= 0``, else 0 (same for ``vp``); in place, so a
    captured graph keeps reading the same buffers. Gathers first: ``ox`` may be ``x``."""
    if ox is None or ovp is None:
        x.zero_()
        vp.zero_()
        return
    keep = (take >= 0)[:, None]
    idx = take.clamp(min=0)
    gx, gvp = ox.index_select(0, idx), ovp.index_select(0, idx)
    x.copy_(torch.where(keep, gx, 0.0))
    vp.copy_(torch.where(keep, gvp, 0.0))
