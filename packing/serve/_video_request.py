"""What `VideoEngine` serves and is asked for: the model protocol, a request, a pack shape.

The engine asks a `VideoModel` for ONE velocity over the pack given per-token times; the pack
is described by `VideoPack` (doc ids and positions, static shapes fixed by a `VideoShape`).
A `VideoRequest` is one episode: text embeddings, optional clean context frames, the frames
to generate (picture: `packing.serve._video`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from packing._validate import check_int
from packing.serve._limits import MAX_FRAMES, MAX_REQUESTS, MAX_STEPS, MAX_TEXT
from packing.serve._request import check_request_tensor, check_seed

__all__ = ["VideoModel", "VideoPack", "VideoRequest", "VideoShape"]


class VideoPack(NamedTuple):
    """The device index tensors of one composition (int64, static shapes).

    ``doc_T`` ``(S * tpf,)`` each latent token's request (-1: padding), ``thw_T3`` its
    (t, h, w) inside its request (t: the frame's place, context first), ``text_doc_X``
    ``(X,)`` each text row's request (-1: padding)."""

    doc_T: Tensor
    thw_T3: Tensor
    text_doc_X: Tensor


class VideoModel(Protocol):
    """What `VideoEngine` needs from a model.

    ``frame_shape`` ``(C, H, W)`` of one latent frame, ``grid`` its token grid (gh, gw),
    ``text_dim`` the width of the text embeddings it reads; ``device``. ``velocity(x_SCHW,
    t_T, text_XD, pack)`` is the velocity ``(S, C, H, W)`` of every frame of the pack given
    per-token times ``t_T`` in [0, 1] (0: clean, 1: noise; 0 on padding) and the packed text
    rows ``(X, text_dim)``; padding frames' output is ignored. It must keep requests apart
    (document masks from ``pack``) and do no host sync."""

    frame_shape: tuple[int, int, int]
    grid: tuple[int, int]
    text_dim: int
    device: torch.device

    def velocity(self, x_SCHW: Tensor, t_T: Tensor, text_XD: Tensor, pack: VideoPack) -> Tensor:
        """The velocity ``(S, C, H, W)`` of the pack."""
        ...


@dataclass(frozen=True, kw_only=True)
class VideoShape:
    """A static pack: ``frames`` latent frames (context and generated, all requests),
    ``text`` text rows (all requests) and at most ``requests`` requests."""

    frames: int
    text: int
    requests: int

    def __post_init__(self) -> None:
        for name, top in (("frames", MAX_FRAMES), ("text", MAX_TEXT), ("requests", MAX_REQUESTS)):
            v = check_int(f"VideoShape.{name}", getattr(self, name), min=1, max=top)
            object.__setattr__(self, name, v)

    def fits(self, requests: Sequence[VideoRequest]) -> bool:
        frames = sum(r.context.shape[0] + r.frames for r in requests)
        text = sum(r.text.shape[0] for r in requests)
        return len(requests) <= self.requests and frames <= self.frames and text <= self.text


@dataclass(frozen=True, kw_only=True)
class VideoRequest:
    """One episode to generate: ``text`` ``(L, D_txt)`` its text-encoder output (``L >= 1``),
    ``context`` ``(F_c, C, H, W)`` clean latent frames (``F_c`` may be 0), ``frames`` the
    latent frames to generate, ``steps`` denoising steps; ``seed`` keys the initial noise (a
    CPU generator: the same noise on any device and in any pack; in [0, 2**64 - 1]). Both
    tensors must be finite, in float32 too, the engine's dtype (a NaN, inf or a float64
    beyond float32's range is refused here, naming its index; `check_request_tensor`)."""

    text: Tensor
    context: Tensor
    frames: int
    seed: int = 0
    steps: int = 10

    def __post_init__(self) -> None:
        for name, dim, what in (("text", 2, "(L, D_txt)"), ("context", 4, "(F_c, C, H, W)")):
            v = getattr(self, name)
            if not isinstance(v, Tensor) or v.dim() != dim:
                got = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
                raise ValueError(f"VideoRequest.{name} must be a {what} tensor, got {got}")
            check_request_tensor("VideoRequest", name, v)
        if self.text.shape[0] < 1:
            raise ValueError("VideoRequest.text has no rows; give the text encoder's output")
        for name, top in (("frames", MAX_FRAMES), ("steps", MAX_STEPS)):
            v = check_int(f"VideoRequest.{name}", getattr(self, name), min=1, max=top)
            object.__setattr__(self, name, v)
        object.__setattr__(self, "seed", check_seed("VideoRequest.seed", self.seed))

    def noise(self) -> Tensor:
        """The initial noise ``(frames, C, H, W)``, fp32 CPU."""
        gen = torch.Generator().manual_seed(self.seed)
        return torch.randn((self.frames, *self.context.shape[1:]), generator=gen)
