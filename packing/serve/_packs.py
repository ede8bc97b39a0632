"""The engine's per-model protocol (`Packs`, `Member`, `Spans`) and its first implementation,
`DiTPacks` (the reference DiT, its context in the pack).

The protocol is public through `packing.serve.protocol`, whose docstring draws the call order
and says what each method must guarantee; the other implementations are
`packing.serve._cached_packs.CachedDiTPacks` (the DiT with its context in a paged pool),
`packing.serve._video.VideoPacks` (any `VideoModel`, e.g. a packed diffusers Wan) and, outside
this folder, `packing.integrations.lingbot_va.ServedLingBotVA`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import Tensor

from packing.attention import frame_causal, resolve_backend
from packing.model import DiT
from packing.serve._config import EngineConfig
from packing.serve._device import allocate
from packing.serve._pack import PackShape, build_pack, initial_tokens
from packing.serve._request import Request, check_task, submitted
from packing.serve._step import Buffers, Steps, run_step

__all__ = ["DiTPacks", "Member", "Packs", "Spans"]

R = TypeVar("R")  # the request type
S = TypeVar("S")  # the pack shape type
Spans = tuple[tuple[int, int], ...]  # a request's (first row, rows) in each state group


class Member(Protocol[R]):
    """What the engine knows of a request in its pack, as the hooks `Packs.joined` and
    `Packs.left` see it (read it, never change it)."""

    rid: int  # the request's id (what `Engine.submit` returned)
    request: R  # what `Packs.check` returned (or `Packs.then`, for a later phase)
    step: int  # steps run so far
    spans: Spans  # its rows in the pack's state groups (what `Packs.layout` returned)
    record: Any  # what `Packs.member` returned for it (None by default)
    saved: tuple[Tensor, ...] | None  # not None: it rejoins with its saved state, not `fresh`


class Packs(Generic[R, S]):
    """A served model behind the engine's one loop (`packing.serve.protocol` draws the call
    order). A subclass sets ``shapes`` (its static pack shapes, smallest first), ``device``,
    ``max_steps`` (the columns of the schedule tables it is given) and ``steps`` (a `Steps`:
    its step functions, run plainly or captured in CUDA graphs), and implements the methods
    that raise here; the hooks with a body are optional (what a model without a cache does:
    nothing)."""

    shapes: list[S]
    device: torch.device
    max_steps: int
    steps: Steps

    def check(self, request: R) -> R:
        """``request`` checked (each bad value: one ValueError or TypeError naming it) and
        copied to the host (`host_copy`), so the caller may change its own tensors once
        submitted. It must have ``steps``, an int in [1, ``max_steps``]."""
        raise NotImplementedError

    def fits(self, shape: S, requests: Sequence[R]) -> bool:
        """Whether ``requests`` fit ``shape`` together (default: ``shape.fits(requests)``)."""
        return shape.fits(requests)  # type: ignore[attr-defined,no-any-return]

    def fresh(self, request: R) -> tuple[Tensor, ...]:
        """A joining request's first rows of each state group (host tensors): its noise (and
        any clean rows it keeps in its span), exactly as many rows as `layout` gives it."""
        raise NotImplementedError

    def layout(self, shape: S, requests: Sequence[R], tables: tuple[Tensor, ...]) -> list[Spans]:
        """Write the composition ``requests`` (in this order: request k is slot k) into
        ``shape``'s static buffers with ``copy_`` (a captured step keeps reading the same
        tensors), and the engine's ``tables`` too: ``t_table (R, max_steps)`` each request's
        time at each step, ``coef (R, max_steps, 2)`` its solver's ``(a, b)`` (``x += a v + b
        v_prev``), ``step_K (R,)`` its current step; rows past the requests are 0. Returns
        each request's rows in each state group; a request's row counts never change."""
        raise NotImplementedError

    def state(self, shape: S) -> tuple[tuple[Tensor, Tensor], ...]:
        """The static state of ``shape``: ``(x, v_prev)`` per state group, rows first. The
        engine carries the staying requests' rows into a new composition in place."""
        raise NotImplementedError

    def step(self, shape: S) -> None:
        """One model call over the pack and every request's update, in place on the
        buffers, through ``self.steps.run(shape, fn, buffers)``: no host sync (no ``.item()``,
        no ``.cpu()``, no Python branch on a device value), rows outside a request's slots
        left as they are, ``quarantine`` after the update, ``step_K`` advanced by one."""
        raise NotImplementedError

    def flags(self, shape: S) -> Tensor:
        """``(R,)`` bool on the device: request k's state went non-finite in the last step
        (written by `quarantine`)."""
        raise NotImplementedError

    def result(self, shape: S, request: R, spans: Spans) -> tuple[Tensor, Tensor]:
        """A finished request's ``(latents, action)`` on the device: copies (``clone``), since
        the next composition overwrites the buffers."""
        raise NotImplementedError

    def warm_keys(self) -> list[tuple[str, Callable[[], None]]]:
        """Every step function the engine can meet, as (label, run it once)."""
        return [(_label(s), partial(self.step, s)) for s in self.shapes]

    # -- optional hooks: a cache's, a phased model's -----------------------------------------
    def member(self, rid: int, request: R) -> Any:
        """The model's own record of a joining request (a cache: its session, its hashes);
        `Member.record` in the hooks below."""
        return None

    def joined(self, shape: S, members: Sequence[Member[R]], first: int) -> list[tuple[Any, str]]:
        """After ``members`` were laid out in ``shape`` (``members[first:]`` joined): the
        members that failed here, each with why (returned, not raised: the others go on)."""
        return []

    def left(self, member: Member[R], *, finished: bool) -> None:
        """``member`` left the pack (``finished``: its last step ran, it did not fail)."""

    def end_session(self, session: str) -> None:
        """Free what is kept for ``session`` (nothing without a cache)."""

    def sweep(self, live: set[int]) -> None:
        """After a failed model call: free what belongs to requests not in ``live``."""

    def then(self, request: R, latents: Tensor, actions: Tensor) -> R | None:
        """A finished request's next phase, or None (its result is handed out). A model
        whose chunk runs in phases of different token counts (LingBot-VA: its video steps,
        then its action steps) returns the next phase's request here: it rejoins first in
        the queue under the same id, and its last phase's result is the one handed out."""
        return None

    @property
    def stats(self) -> dict[str, int]:
        """The model's counters (`Engine.stats`)."""
        return {}


class DiTPacks(Packs[Request, PackShape]):
    """The reference `packing.model.DiT` (or anything with its ``config``, ``patchify``/
    ``unpatchify`` and ``velocity``): two state groups, video tokens then action tokens, each
    request's clean context laid out in the pack before its generated tokens."""

    packs_context = True  # the cached packs lay out the generated tokens only

    def __init__(self, model: DiT, config: EngineConfig, device: torch.device) -> None:
        p = next(model.parameters())
        if p.device != device:
            raise ValueError(f"the model is on {p.device} but device={device}; move it")
        if config.cuda_graphs and device.type != "cuda":
            raise ValueError("EngineConfig.cuda_graphs=True needs a CUDA model; use False on CPU")
        cfg = model.config
        self.model, self.config, self.device = model, config, device
        self.max_steps = config.max_steps
        self.inner = frame_causal(cfg.tokens_per_frame) if cfg.frame_causal else None
        self.backend = resolve_backend(config.attention, device=device, dtype=p.dtype,
                                       head_dim=cfg.head_dim, inner=self.inner)  # fmt: skip
        if self.backend == "varlen":
            raise ValueError(
                "the engine builds its masks inside the step from doc ids; backend 'varlen' "
                "needs host-side lengths: use attention='flex' (or 'sdpa' on CPU)"
            )
        self.shapes = sorted(config.shapes, key=lambda s: (s.frames, s.actions, s.requests))
        self.buffers = allocate(
            self.shapes,
            lambda s, dev: Buffers(s, model, max_steps=config.max_steps, device=dev),
            device,
            "EngineConfig.max_steps",
        )
        self.steps = Steps(config.cuda_graphs)

    def check(self, r: Request) -> Request:
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
        self.check_fits(r)
        check_task(r.task, cfg.text_len)
        return submitted(r, compute=next(self.model.parameters()).dtype)  # copied, re-checked

    def check_fits(self, r: Request) -> None:
        if not self.shapes[-1].fits([r]):
            s = self.shapes[-1]
            raise ValueError(
                f"the request needs {len(r.kept) + r.frames} frames and {r.actions} actions, "
                f"more than the largest PackShape (frames={s.frames}, actions={s.actions}); "
                "add a larger shape or drop context frames (keep_frames=)"
            )

    def context_frames(self, r: Request) -> int:
        """Context frames of ``r`` laid out in the pack (all kept ones; none when cached)."""
        return len(r.kept) if self.packs_context else 0

    def fresh(self, r: Request) -> tuple[Tensor, ...]:
        """Its tokens: clean context then noise (video), committed actions then noise."""
        cfg = self.model.config
        lat, act = initial_tokens(r, (cfg.latent_channels, *cfg.latent_hw), cfg.action_dim)
        ctx = r.context[list(r.kept[: self.context_frames(r)])].float()
        return self.model.patchify(torch.cat([ctx, lat])), act

    def layout(
        self, shape: PackShape, requests: Sequence[Request], tables: tuple[Tensor, ...]
    ) -> list[Spans]:
        cfg = self.model.config
        host = build_pack(requests, shape, grid=cfg.grid, text_len=cfg.text_len,
                          context=self.packs_context)  # fmt: skip
        self.buffers[shape].load(host, *tables)
        tpf = cfg.tokens_per_frame
        return [
            ((v0, (self.context_frames(r) + r.frames) * tpf), (a0, r.actions))
            for r, v0, a0 in zip(requests, host.video_start, host.action_start, strict=True)
        ]

    def state(self, shape: PackShape) -> tuple[tuple[Tensor, Tensor], ...]:
        b = self.buffers[shape]
        return (b.x_v, b.vp_v), (b.x_a, b.vp_a)

    def step(self, shape: PackShape) -> None:
        b = self.buffers[shape]

        def fn() -> None:
            run_step(self.model, b, backend=self.backend, inner=self.inner,
                     document_mask=self.model.config.document_mask)  # fmt: skip

        self.steps.run(shape, fn, b)

    def flags(self, shape: PackShape) -> Tensor:
        return self.buffers[shape].bad_K

    def result(self, shape: PackShape, r: Request, spans: Spans) -> tuple[Tensor, Tensor]:
        b, tpf = self.buffers[shape], self.model.config.tokens_per_frame
        (v0, _), (a0, _) = spans
        v0 += self.context_frames(r) * tpf
        lat = self.model.unpatchify(b.x_v[v0 : v0 + r.frames * tpf].clone())
        return lat, b.x_a[a0 : a0 + r.actions].clone()


def _label(shape: Any) -> str:
    """``pack 4 frames, 64 actions, 4 requests``: what a warm-up progress line names."""
    fields = [f"{v} {k}" for k, v in vars(shape).items() if k in ("frames", "actions", "text",
                                                                  "requests")]  # fmt: skip
    return "pack " + ", ".join(fields)
