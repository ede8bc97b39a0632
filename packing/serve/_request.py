"""What a client asks the engine for, and what it gets back.

A request is one episode's next chunk: its clean context (the latent frames seen so far),
how many latent frames and action steps to generate, a seed and a step count. In the pack it
is ONE document, context first::

    document k   c c c c | g g | a a a a a        c: context tokens (clean, t = 0)
                 frames kept    generated frames    g: generated video tokens (noisy, t_k)
                                then actions        a: generated action tokens (noisy, t_k)

Frame sparsity is packing: ``keep_frames=(0, 3)`` keeps context frames 0 and 3 of 4, so the
document is two frames shorter; the kept frames keep their original time positions (RoPE t),
computed on the host at admission, never with a device-side ``nonzero``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from packing._validate import check_finite, check_int, check_sequence, is_int
from packing.serve._limits import MAX_ACTIONS, MAX_FRAMES, MAX_STEPS

__all__ = ["SEED_MAX", "Request", "Result", "check_seed", "check_tensor_finite", "host_copy"]

# `torch.Generator.manual_seed` takes [-2**63, 2**64 - 1] and maps a negative seed s to
# 2**64 + s (so -1 and 2**64 - 1 give one noise): a request's seed is in [0, 2**64 - 1].
SEED_MAX = 2**64 - 1


def check_seed(name: str, seed: object) -> int:
    """A seed ``torch.Generator.manual_seed`` takes, each value its own noise."""
    return check_int(name, seed, min=0, max=SEED_MAX, hint="the generator's 64-bit seed")


def check_tensor_finite(where: str, key: str, value: Tensor) -> None:
    """A request's tensor holds no NaN or inf: one would reach every other request of its
    pack through attention (a masked-out NaN still gives 0 * NaN = NaN)."""
    check_finite(where, key, value, fix=(
        "a request's NaN or inf would reach every other request packed with it (0 * NaN in "
        "attention); fix the encoder's output or drop the frame"
    ))  # fmt: skip


def host_copy(value: Tensor) -> Tensor:
    """A contiguous CPU copy of ``value``, detached (no autograd history, no grad), that the
    caller can no longer change: the engine reads a request's tensors only after ``submit``
    returns, while a robot loop may refill its frame buffer the moment it has submitted."""
    out = torch.empty(value.shape, dtype=value.dtype)
    out.copy_(value.detach())
    return out


@dataclass(frozen=True, kw_only=True)
class Request:
    """One chunk to generate. ``context`` is ``(F_c, C, H, W)`` clean latent frames (``F_c``
    may be 0), ``frames``/``actions`` the latent frames and action steps to generate,
    ``steps`` the denoising steps, ``seed`` keys the initial noise (a CPU generator, so the
    same request gives the same noise on any device and in any pack; in [0, 2**64 - 1]).
    ``context`` must be finite (a NaN or inf is refused here, naming its index). ``keep_frames``: the
    context frames to attend to, ascending (``None``: all). ``session`` names the robot episode
    this chunk belongs to (a policy server sets it per connection and episode): an engine that
    caches context keeps a session's cached frames for its next chunk until
    ``engine.end_session(session)``; ``None``: a request of its own. ``committed_actions``
    ``(k, action_dim)`` float32: the chunk's first k actions, already committed (real-time
    chunking): they sit in the pack clean (t = 0), are never updated, and come back
    bit-identical in the `Result`; the engine generates the other ``actions - k``."""

    context: Tensor
    frames: int
    actions: int
    task: str = ""
    seed: int = 0
    steps: int = 10
    keep_frames: tuple[int, ...] | None = None
    session: str | None = None
    committed_actions: Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.context, Tensor) or self.context.dim() != 4:
            got = tuple(self.context.shape) if isinstance(self.context, Tensor) else self.context
            raise ValueError(
                f"Request.context must be a (F_c, C, H, W) tensor of clean latent frames, got "
                f"{got!r}; pass torch.zeros(0, C, H, W) for no context"
            )
        if not self.context.is_floating_point():
            raise TypeError(f"Request.context must be floating point, got {self.context.dtype}")
        check_tensor_finite("Request", "context", self.context)
        for name, low, top in (("frames", 0, MAX_FRAMES), ("actions", 1, MAX_ACTIONS),
                               ("steps", 1, MAX_STEPS)):  # fmt: skip
            v = check_int(f"Request.{name}", getattr(self, name), min=low, max=top)
            object.__setattr__(self, name, v)  # numpy ints welcome, stored as int
        object.__setattr__(self, "seed", check_seed("Request.seed", self.seed))
        if not isinstance(self.task, str):
            raise TypeError(f"Request.task must be a str, got {type(self.task).__name__}")
        if self.session is not None and not isinstance(self.session, str):
            raise TypeError(
                f"Request.session must be a str or None, got {type(self.session).__name__}"
            )
        if self.keep_frames is not None:
            keep = tuple(check_sequence("Request.keep_frames", self.keep_frames))
            f_c = self.context.shape[0]
            ints = all(is_int(i) for i in keep)
            if not ints or list(keep) != sorted(set(keep)) or any(not 0 <= i < f_c for i in keep):
                raise ValueError(
                    f"Request.keep_frames={self.keep_frames!r}: give distinct ascending ints in "
                    f"[0, {f_c}) (the context has {f_c} frames)"
                )
            object.__setattr__(self, "keep_frames", tuple(int(i) for i in keep))
        _check_committed(self.committed_actions, self.actions)

    @property
    def committed(self) -> int:
        """How many of the chunk's actions are committed (0 without ``committed_actions``)."""
        return 0 if self.committed_actions is None else self.committed_actions.shape[0]

    @property
    def kept(self) -> tuple[int, ...]:
        """Indices of the context frames in the pack (all of them without ``keep_frames``)."""
        n = self.context.shape[0]
        return tuple(range(n)) if self.keep_frames is None else self.keep_frames

    def noise(self, frame_shape: tuple[int, int, int], action_dim: int) -> tuple[Tensor, Tensor]:
        """The initial noise ``(frames, C, H, W)`` and ``(actions, action_dim)``, fp32 CPU."""
        gen = torch.Generator().manual_seed(self.seed)
        lat = torch.randn((self.frames, *frame_shape), generator=gen)
        act = torch.randn((self.actions, action_dim), generator=gen)
        return lat, act


def _check_committed(c: Tensor | None, actions: int) -> None:
    if c is None:
        return
    if not isinstance(c, Tensor) or c.dim() != 2 or not 1 <= c.shape[0] <= actions:
        got = tuple(c.shape) if isinstance(c, Tensor) else type(c).__name__
        raise ValueError(
            f"Request.committed_actions must be a (k, action_dim) tensor with 1 <= k <= "
            f"actions={actions}, got {got}; pass None when nothing is committed"
        )
    if c.dtype != torch.float32:
        raise TypeError(
            f"Request.committed_actions must be float32 (the engine's state, so they come back "
            f"bit-identical), got {c.dtype}; pass committed_actions.float()"
        )


@dataclass(frozen=True)
class Result:
    """A finished request: ``latents`` ``(frames, C, H, W)`` and ``action`` ``(actions, A)``
    in fp32 on the engine's device; ``admitted``/``finished`` are engine step numbers.
    ``error``: ``None`` for a good result; otherwise why this request failed (its latents and
    action are then empty and must not be used), while the other requests go on."""

    request_id: int
    latents: Tensor
    action: Tensor
    admitted: int
    finished: int
    error: str | None = None
