"""What a robot asks the served LingBot-VA for: its episode so far and its next chunk.

A chunk request carries the whole feedback history of the episode (host tensors: a few
hundred KB a chunk), so it means the same thing whatever the server's cache holds; the
session's cache is a memo of it, checked by hash (`packing.integrations.lingbot_va._serve_cache`)::

    chunk k of an episode (F = frame_chunk_size, apf = action_per_frame)
    frames   (max(1, k F), C, H, W)   frame 0: the conditioning observation, then the
                                      observed keyframe latents chunk by chunk
    actions  (k F, apf, action_dim)   the executed actions of chunks 0 .. k-1 (model space,
                                      as LeRobot keeps them: all channels, frame 0 of chunk 0
                                      zero), or None: the chunks this session predicted
                                      (LeRobot's own assumption, ``_executed_actions``)
    prompt, negative (L, text_dim)    the text encoder's output for the task and for ""

LeRobot's ``predict_action_chunk`` for chunk ``k`` feeds back chunk ``k - 1``'s keyframes and
executed actions (``_compute_kv_cache``); chunk 1's feedback is the conditioning frame plus
the ``F - 1`` keyframes observed during chunk 0, so frames ``j F .. (j + 1) F`` are chunk
``j``'s feedback in every case.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from packing._validate import check_int
from packing.serve.protocol import check_request_tensor, check_seed, host_copy

__all__ = ["ChunkRequest", "Phase", "chunk_index", "draw_noise", "tensor_digest"]


def tensor_digest(*tensors: Tensor | None) -> bytes:
    """A 16-byte digest of the tensors' shapes, dtypes and bytes (``None`` counts too)."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        if t is None:
            h.update(b"none")
            continue
        c = t.detach().contiguous().cpu()
        h.update(f"{tuple(c.shape)}{c.dtype}".encode())
        h.update(c.view(torch.uint8).numpy().tobytes() if c.numel() else b"")
    return h.digest()


@dataclass(frozen=True, kw_only=True)
class ChunkRequest:
    """One robot's next chunk (module docstring for the layout).

    ``session`` names the robot's episode (its KV cache lives under it until
    ``engine.end_session(session)``); ``seed`` keys the chunk's noise (a CPU generator:
    LeRobot's ``torch.manual_seed(seed)`` before ``predict_action_chunk`` draws the same);
    ``negative`` is required when the model's guidance needs the unconditional rows."""

    session: str
    frames: Tensor
    actions: Tensor | None
    prompt: Tensor
    negative: Tensor | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.session, str) or not self.session:
            raise ValueError(f"ChunkRequest.session must be a non-empty str, got {self.session!r}")
        for name, dim, what in (("frames", 4, "(F, C, H, W)"), ("actions", 3, "(k F, apf, A)"),
                                ("prompt", 2, "(L, text_dim)"), ("negative", 2, "(L, text_dim)")):  # fmt: skip
            v = getattr(self, name)
            if v is None and name in ("negative", "actions"):
                continue
            if isinstance(v, Tensor):  # a real device, dense, a float dtype, finite in float32
                check_request_tensor("ChunkRequest", name, v)
            if not isinstance(v, Tensor) or v.dim() != dim:
                got = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
                raise ValueError(f"ChunkRequest.{name} must be a {what} tensor, got {got}")
        if self.frames.shape[0] < 1:
            raise ValueError(
                "ChunkRequest.frames is empty; frame 0 is the conditioning observation"
            )
        object.__setattr__(self, "seed", check_seed("ChunkRequest.seed", self.seed))

    def copied(self) -> ChunkRequest:
        """Detached CPU copies: the caller may reuse its buffers once submitted."""
        neg = None if self.negative is None else host_copy(self.negative)
        act = None if self.actions is None else host_copy(self.actions)
        return replace(self, frames=host_copy(self.frames), actions=act,
                       prompt=host_copy(self.prompt), negative=neg)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Phase:
    """One engine request: a chunk's video steps (``kind="video"``), then its action steps
    (``kind="action"``, `Packs.then`). ``steps`` is what the engine counts."""

    chunk: ChunkRequest
    index: int  # the chunk's index k in its episode
    kind: str
    steps: int
    noise: tuple[Tensor, Tensor]  # (latents (1, C, F, H, W), actions (1, A, F, apf, 1))
    latents: Tensor | None = None  # the video phase's result, carried by the action phase

    @property
    def session(self) -> str:
        return self.chunk.session


def chunk_index(r: ChunkRequest, chunk_frames: int) -> int:
    """The chunk ``k`` a request asks for, from its history's length (checked)."""
    n_f = r.frames.shape[0]
    k, rest = divmod(n_f, chunk_frames)
    k = 0 if n_f == 1 else k
    n_a = k * chunk_frames if r.actions is None else r.actions.shape[0]
    if (n_f != 1 and rest) or n_a != k * chunk_frames:
        raise ValueError(
            f"ChunkRequest for session {r.session!r} has {n_f} frames and {n_a} action frames; "
            f"chunk k needs k * frame_chunk_size = k * {chunk_frames} of each (1 frame for "
            "k = 0): an episode restarted mid-chunk; send whole chunks, or start a new session"
        )
    return check_int("chunk index", k, min=0)


def draw_noise(
    seed: int, latent: tuple[int, ...], action: tuple[int, ...]
) -> tuple[Tensor, Tensor]:
    """LeRobot's ``_infer`` draws: ``randn(latents)`` then ``randn(actions)``, fp32 CPU."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(latent, generator=g), torch.randn(action, generator=g)
