"""Serving a latent-video model behind a small protocol: the engine asks the model for ONE
velocity over the pack given per-token times, and runs the scheduler itself.

`Engine` serves the reference DiT (video and action streams, its own patchify and text ids);
`VideoEngine` is the same engine over `VideoPacks`, for any `VideoModel`, e.g. a packed diffusers Wan
(`packing.integrations.diffusers.ServedWan`). A request is one episode: its text embeddings,
optional clean context frames and the latent frames to generate. The pack is frame-major, one
frame ``tokens_per_frame`` tokens, tokens of a frame in (h, w) order::

    frames  S    c0 g0 g0 | g1 | g2 g2 | .          request 0: 1 context frame, 2 generated
    doc_S         0  0  0 |  1 |  2  2 | -1
    slot_S       -1  0  0 |  1 |  2  2 | -1          the scheduler updates slot >= 0 frames
    t_S           0 t0 t0 | t1 | t2 t2 | 0           (per token: each frame's t, tpf times)
    text   X     w0 w0 w0 | w1 w1 | w2 | . .         doc_X 0 0 0 1 1 2 -1 -1

Context frames are clean (``t = 0`` on their tokens: Wan 2.2 TI2V's first frame, the
pipeline's ``expand_timesteps``). Shapes are fixed by a `VideoShape` (frames, text rows,
requests); admission copies a composition into the shape's static buffers, and the step
(`video_step`) is tensor work only, no host sync, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from packing._validate import check_int
from packing.serve._device import allocate, pinned, quarantine
from packing.serve._engine import Engine
from packing.serve._limits import MAX_STEPS
from packing.serve._packs import Packs, Spans
from packing.serve._request import host_copy
from packing.serve._schedulers import FlowScheduler, check_scheduler
from packing.serve._step import Steps
from packing.serve._video_request import VideoModel, VideoPack, VideoRequest, VideoShape
from packing.train import broadcast_to_tokens

__all__ = ["VideoEngine", "VideoPacks", "video_step"]


class _Buffers:
    """The static device tensors of one `VideoShape`: state, index tensors, schedule tables."""

    def __init__(
        self, shape: VideoShape, model: VideoModel, max_steps: int, dev: torch.device
    ) -> None:
        gh, gw = model.grid
        S, R, X = shape.frames, shape.requests, shape.text
        self.x_S = torch.zeros(S, *model.frame_shape, device=dev)
        self.vp_S = torch.zeros_like(self.x_S)
        self.slot_S = torch.full((S,), -1, dtype=torch.int64, device=dev)
        self.text_XD = torch.zeros(X, model.text_dim, device=dev)
        self.pack = VideoPack(
            torch.full((S * gh * gw,), -1, dtype=torch.int64, device=dev),
            torch.zeros(S * gh * gw, 3, dtype=torch.int64, device=dev),
            torch.full((X,), -1, dtype=torch.int64, device=dev),
        )
        self.step_K = torch.zeros(R, dtype=torch.int64, device=dev)
        self.bad_K = torch.zeros(R, dtype=torch.bool, device=dev)  # state not finite
        self.t_table = torch.zeros(R, max_steps, device=dev)
        self.coef = torch.zeros(R, max_steps, 2, device=dev)


def video_step(model: VideoModel, b: _Buffers) -> None:
    """One denoising step of every request in the pack, in place on ``b`` (no host sync)."""
    R, N = b.t_table.shape
    n_K = b.step_K.clamp(max=N - 1)  # a finished request is removed on the host first
    t_K = b.t_table.gather(1, n_K[:, None])[:, 0]
    ab_K2 = b.coef.gather(1, n_K[:, None, None].expand(R, 1, 2))[:, 0]
    tpf = b.pack.doc_T.shape[0] // b.x_S.shape[0]
    t_T = broadcast_to_tokens(t_K, b.slot_S).repeat_interleave(tpf)  # context, padding: 0
    v = model.velocity(b.x_S, t_T, b.text_XD, b.pack).float()
    ab_S2 = broadcast_to_tokens(ab_K2, b.slot_S)[:, :, None, None, None]
    new = b.x_S + ab_S2[:, 0] * v + ab_S2[:, 1] * b.vp_S  # raises before any write
    vp = v.expand_as(b.vp_S)
    b.x_S.copy_(torch.where((b.slot_S >= 0)[:, None, None, None], new, b.x_S))
    b.vp_S.copy_(vp)
    quarantine(b.bad_K, ((b.x_S, b.slot_S), (b.vp_S, b.slot_S)))
    b.step_K.add_(1)


class VideoPacks(Packs[VideoRequest, VideoShape]):
    """Packs of `VideoRequest`s for a `VideoModel`: one state group, the pack's frames (each
    request's clean context frames, then its generated ones)."""

    def __init__(self, model: VideoModel, shapes: Sequence[VideoShape], max_steps: int) -> None:
        shapes = tuple(shapes)
        if not shapes or not all(isinstance(s, VideoShape) for s in shapes):
            raise ValueError(f"shapes={shapes!r}; give one or more VideoShape")
        self.model, self.max_steps = model, max_steps
        self.shapes = sorted(shapes, key=lambda s: (s.frames, s.text, s.requests))
        self.device = torch.device(model.device)
        self.buffers = allocate(
            self.shapes, lambda s, dev: _Buffers(s, model, max_steps, dev), self.device,
            "max_steps",
        )  # fmt: skip
        self.steps = Steps(cuda_graphs=False)

    def check(self, request: VideoRequest) -> VideoRequest:
        if not isinstance(request, VideoRequest):
            raise TypeError(f"submit takes a VideoRequest, got {type(request).__name__}")
        m = self.model
        if tuple(request.context.shape[1:]) != tuple(m.frame_shape):
            raise ValueError(
                f"VideoRequest.context frames are {tuple(request.context.shape[1:])}, the model "
                f"takes (C, H, W) = {tuple(m.frame_shape)}; encode at the model's latent size"
            )
        if request.text.shape[1] != m.text_dim:
            raise ValueError(
                f"VideoRequest.text is (L, {request.text.shape[1]}), the model reads text "
                f"width {m.text_dim}; pass the model's text encoder output"
            )
        if request.steps > self.max_steps:
            raise ValueError(
                f"VideoRequest.steps={request.steps} > max_steps={self.max_steps}; raise "
                "max_steps or ask for fewer steps"
            )
        if not self.shapes[-1].fits([request]):
            s = self.shapes[-1]
            raise ValueError(
                f"the request needs {request.context.shape[0] + request.frames} frames and "
                f"{request.text.shape[0]} text rows, more than the largest VideoShape "
                f"(frames={s.frames}, text={s.text}); add a larger shape"
            )
        # Copied (re-checked finite) so the caller may reuse its buffers once submitted.
        return replace(request, text=host_copy(request.text), context=host_copy(request.context))

    def fresh(self, r: VideoRequest) -> tuple[Tensor, ...]:
        """Its clean context frames, then its noise."""
        return (torch.cat([r.context.float(), r.noise()]),)

    def layout(
        self, shape: VideoShape, requests: Sequence[VideoRequest], tables: tuple[Tensor, ...]
    ) -> list[Spans]:
        """The host index tensors of ``requests`` in ``shape``, copied in (no sync)."""
        (gh, gw), b = self.model.grid, self.buffers[shape]
        S, X = shape.frames, shape.text
        doc_S = torch.full((S,), -1, dtype=torch.int64)
        slot_S, pos_S = doc_S.clone(), torch.zeros(S, dtype=torch.int64)
        text_doc_X = torch.full((X,), -1, dtype=torch.int64)
        text_XD = torch.zeros(X, self.model.text_dim)
        spans: list[Spans] = []
        s0 = x0 = 0
        for k, r in enumerate(requests):
            f_c, n, L = r.context.shape[0], r.context.shape[0] + r.frames, r.text.shape[0]
            doc_S[s0 : s0 + n] = k
            slot_S[s0 + f_c : s0 + n] = k
            pos_S[s0 : s0 + n] = torch.arange(n)
            text_doc_X[x0 : x0 + L] = k
            text_XD[x0 : x0 + L] = r.text.float()
            spans.append(((s0, n),))
            s0, x0 = s0 + n, x0 + L
        tpf = gh * gw
        hw = torch.stack(torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij"), -1)
        thw_T3 = torch.cat([pos_S[:, None, None].expand(S, tpf, 1),
                            hw.reshape(1, tpf, 2).expand(S, tpf, 2)], -1).reshape(-1, 3)  # fmt: skip
        doc_T = doc_S.repeat_interleave(tpf)
        thw_T3 = torch.where((doc_T >= 0)[:, None], thw_T3, 0)
        t, coef, step = tables
        for dst, src in ((b.slot_S, slot_S), (b.text_XD, text_XD), (b.pack.doc_T, doc_T),
                         (b.pack.thw_T3, thw_T3), (b.pack.text_doc_X, text_doc_X),
                         (b.t_table, t), (b.coef, coef), (b.step_K, step)):  # fmt: skip
            dst.copy_(pinned(src, self.device), non_blocking=True)
        return spans

    def state(self, shape: VideoShape) -> tuple[tuple[Tensor, Tensor], ...]:
        b = self.buffers[shape]
        return ((b.x_S, b.vp_S),)

    def step(self, shape: VideoShape) -> None:
        b = self.buffers[shape]
        self.steps.run(shape, lambda: video_step(self.model, b), b)

    def flags(self, shape: VideoShape) -> Tensor:
        return self.buffers[shape].bad_K

    def result(self, shape: VideoShape, r: VideoRequest, spans: Spans) -> tuple[Tensor, Tensor]:
        ((s0, _),) = spans
        lat = self.buffers[shape].x_S[s0 + r.context.shape[0] : s0 + r.context.shape[0] + r.frames]
        return lat.clone(), torch.zeros(0, 0, device=lat.device)


class VideoEngine(Engine):
    """`Engine` serving `VideoRequest`s with one `VideoModel.velocity` call per step.

    ``engine.submit(req) -> id``; ``engine.step() -> [Result, ...]`` (those that finished;
    ``Result.latents`` the generated frames ``(frames, C, H, W)``, ``Result.action`` empty);
    ``engine.run()`` steps until every request is done. The same loop as `Engine` (FIFO
    admission, the smallest shape that fits, state carried over in place) over `VideoPacks`.
    """

    def __init__(
        self,
        model: VideoModel,
        shapes: Sequence[VideoShape],
        *,
        scheduler: FlowScheduler | None = None,
        max_steps: int = 50,
        context_cache: object = None,
    ) -> None:
        if context_cache is not None:  # the context cache's refusal (issue 34)
            raise ValueError(
                "VideoEngine cannot cache context: its models (a diffusers Wan) attend "
                "bidirectionally, so every context token attends to the generated frames and "
                "its keys and values change at every step; pass context_cache=None (the context "
                "is recomputed each step), or serve a frame-causal DiT with Engine"
            )
        missing = [a for a in ("frame_shape", "grid", "text_dim", "device", "velocity")
                   if not hasattr(model, a)]  # fmt: skip
        if missing:
            raise TypeError(
                f"VideoEngine's model must be a VideoModel; {type(model).__name__} has no "
                f"{missing}: wrap a packed diffusers Wan in ServedWan "
                "(packing.integrations.diffusers), serve the reference DiT with Engine"
            )
        max_steps = check_int("max_steps", max_steps, min=1, max=MAX_STEPS)
        sched = FlowScheduler() if scheduler is None else check_scheduler("scheduler", scheduler)
        self.model, self.config = model, None
        self._serve(VideoPacks(model, shapes, max_steps), sched, max_steps)
