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

import warnings
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

import torch
from torch import Tensor

from packing._validate import check_finite, check_int, check_sequence, is_int
from packing.serve._limits import MAX_ACTIONS, MAX_FRAMES, MAX_STEPS

__all__ = [
    "FLOATS", "SEED_MAX", "Request", "Result", "check_request_tensor", "check_seed",
    "check_task", "host_copy", "submitted",
]  # fmt: skip

# `torch.Generator.manual_seed` takes [-2**63, 2**64 - 1] and maps a negative seed s to
# 2**64 + s (so -1 and 2**64 - 1 give one noise): a request's seed is in [0, 2**64 - 1].
SEED_MAX = 2**64 - 1

# The dtypes a request's float tensors may have. The engines hold every request's state in
# float32 (`STATE`), so a value is checked finite in float32 too: 1e39 in a float64 context
# passes a float64 NaN/inf check and becomes inf in the engine, where attention carries it
# to every other request of the pack (0 * inf = NaN).
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
STATE = torch.float32
_FIX = (
    "a request's NaN or inf would reach every other request packed with it (0 * NaN in "
    "attention); send finite values (fix the encoder's output, or drop the frame)"
)

R = TypeVar("R")


def check_seed(name: str, seed: object) -> int:
    """``seed`` if ``torch.Generator.manual_seed`` takes it as its own noise: an int in
    [0, `SEED_MAX`] (numpy ints too); ``name`` is what the error calls it."""
    _check_name("check_seed", "name", name)
    return check_int(name, seed, min=0, max=SEED_MAX, hint="the generator's 64-bit seed")


def check_request_tensor(
    where: str,
    key: str,
    value: Any,
    *,
    dtypes: tuple[torch.dtype, ...] = FLOATS,
    compute: tuple[torch.dtype, ...] = (STATE,),
) -> Tensor:
    """The one check of every tensor a request carries (context, text, committed actions,
    keep_frames given as a tensor), at construction and again at ``submit``: a dense tensor
    with values (not on the meta device), of one of ``dtypes``, finite in its own dtype and
    in each of ``compute``, the dtypes the engine casts it to (its state, the model's)::

        check_request_tensor("Request", "context", torch.full((1, 8, 4, 8), 1e39, dtype=torch.float64))
        ValueError: Request 'context' holds 1e+39 at index (0, 0, 0, 0), beyond float32's
        range (max 3.4e+38): the engine computes in float32, where it is inf; ...
    """
    _check_name("check_request_tensor", "where", where)
    _check_name("check_request_tensor", "key", key)
    for arg, given in (("dtypes", dtypes), ("compute", compute)):
        if not isinstance(given, tuple) or not all(isinstance(d, torch.dtype) for d in given):
            raise TypeError(
                f"check_request_tensor's {arg}={given!r} must be a tuple of torch.dtype"
            )
    name = f"{where}.{key}"
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.layout != torch.strided:
        raise TypeError(f"{name} is a {value.layout} tensor; pass a dense one ({key}.to_dense())")
    if value.device.type == "meta":
        raise ValueError(
            f"{name} is on the meta device (a shape without values); pass a tensor with "
            "values, on the cpu or a GPU"
        )
    if value.dtype not in dtypes:
        raise TypeError(f"{name} is {value.dtype}; pass one of {', '.join(str(d) for d in dtypes)}")
    if not value.is_floating_point():
        return value
    check_finite(where, key, value, fix=_FIX)
    for dtype in compute:
        if torch.finfo(dtype).max >= torch.finfo(value.dtype).max:
            continue  # every finite value stays finite
        over = ~torch.isfinite(value.to(dtype))
        if bool(over.any()):
            flat = int(over.reshape(-1).nonzero()[0])
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), value.shape))
            raise ValueError(
                f"{where} {key!r} holds {value.reshape(-1)[flat].item():.3g} at index {index} "
                f"(first of {int(over.sum())}), beyond {_name(dtype)}'s range (max "
                f"{torch.finfo(dtype).max:.3g}): the engine computes in {_name(dtype)}, where "
                f"it is inf; {_FIX}"
            )
    return value


def check_task(task: str, text_len: int) -> None:
    """The reference DiT reads ``text_len`` tokens of a task, ``[BOS]`` and the first
    ``text_len - 1`` UTF-8 bytes (`packing.model.text_tokens`, in training as in serving): a
    longer task is served so, with a warning (once per ``text_len``), never cut silently."""
    if len(task.encode("utf-8")) > text_len - 1:
        warnings.warn(
            f"Request.task is longer than the {text_len - 1} UTF-8 bytes the model reads "
            f"(DiTConfig.text_len={text_len}: [BOS] and {text_len - 1} bytes, as in training); "
            "the rest is not read: shorten the prompt, or serve a model with a larger text_len",
            stacklevel=4,
        )


def host_copy(value: Tensor) -> Tensor:
    """A contiguous CPU copy of ``value``, detached (no autograd history, no grad), that the
    caller can no longer change: the engine reads a request's tensors only after ``submit``
    returns, while a robot loop may refill its frame buffer the moment it has submitted."""
    if not isinstance(value, Tensor):
        raise TypeError(f"host_copy(value) copies a tensor, got value={type(value).__name__}")
    out = torch.empty(value.shape, dtype=value.dtype)
    out.copy_(value.detach())
    return out


def submitted(request: R, compute: torch.dtype | None = None) -> R:
    """What an engine keeps of ``request`` at ``submit``: every tensor it carries copied to
    the host (`host_copy`) and checked again as at construction (the caller may have changed
    them since), and finite in ``compute`` too, the dtype the model reads them in."""
    copies = {f.name: host_copy(v) for f in fields(request)  # type: ignore[arg-type]
              if isinstance(v := getattr(request, f.name), Tensor)}  # fmt: skip
    out = replace(request, **copies)  # type: ignore[type-var]  # re-runs __post_init__
    if compute is not None:
        for key, v in copies.items():
            if v.is_floating_point():
                check_request_tensor(type(request).__name__, key, v, compute=(compute,))
    return out


def _check_name(fn: str, arg: str, value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{fn}'s {arg}={value!r} must be a str: what the error names")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, kw_only=True)
class Request:
    """One chunk to generate. ``context`` is ``(F_c, C, H, W)`` clean latent frames (``F_c``
    may be 0), ``frames``/``actions`` the latent frames and action steps to generate,
    ``steps`` the denoising steps, ``seed`` keys the initial noise (a CPU generator, so the
    same request gives the same noise on any device and in any pack; in [0, 2**64 - 1]).
    ``context`` must be finite, in float32 too (a NaN, inf or a float64 beyond float32's range is
    refused here, naming its index; `check_request_tensor`). ``keep_frames``: the context frames to
    attend to, ascending ints, a tuple (or an integer tensor) (``None``: all). ``session`` names the robot episode
    this chunk belongs to (a policy server sets it per connection and episode): an engine that
    caches context keeps a session's cached frames for its next chunk until
    ``engine.end_session(session)``; ``None``: a request of its own. ``committed_actions``
    ``(k, action_dim)`` float32, finite: the chunk's first k actions, already committed (real-time
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
        check_request_tensor("Request", "context", self.context)
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
            keep = self.keep_frames
            if isinstance(keep, Tensor):  # indices as a tensor: checked as every tensor is
                keep = check_request_tensor("Request", "keep_frames", keep, dtypes=INTS).tolist()
                if not isinstance(keep, list):
                    raise ValueError("Request.keep_frames is a 0-d tensor; pass a 1-d one")
            keep = tuple(check_sequence("Request.keep_frames", keep))
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
    check_request_tensor("Request", "committed_actions", c, dtypes=(torch.float32,))


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
