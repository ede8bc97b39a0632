"""Observation adapters: an observation dict becomes a request, a result becomes the reply.

One observation from a robot (the keys `DiTAdapter` reads; all but the context optional)::

    {"context": float (F_c, C, H, W)   clean latent frames so far     or
     "images":  (F, ...) camera frames, through the adapter's ``encoder`` into latents
     "prompt":  "pick up the cup"      the task (Request.task)
     "frames": 1, "actions": 16        the chunk to generate (default: the adapter's)
     "seed": 7, "steps": 10            noise seed, denoising steps (default: the adapter's)
     "keep_frames": [0, 2]             context frames to attend to
     "episode": "start" | "end"}       episode control (`episode_control`)

    reply  {"actions": float32 (actions, A), "latents": float32 (frames, C, H, W),
            "server_timing": {...}}    (the server adds server_timing)

Unknown keys are refused (a misspelt ``"step"`` would otherwise be silently ignored), and so
are arrays that are not numbers or not in native byte order. Any object with the same two
methods (``request(observation, session)``, ``reply(result)``) is an adapter: write your own
for other keys; give it ``default_request(engine)`` too and the server checks its defaults
against every engine at startup.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from packing._validate import check_bool, check_int
from packing.serve import Request, Result, VideoRequest
from packing.serve.protocol import MAX_ACTIONS, MAX_FRAMES, MAX_STEPS, SEED_MAX, to_host

__all__ = ["Adapter", "DiTAdapter", "WanAdapter", "episode_control"]

Encoder = Callable[[np.ndarray], Any]  # camera frames -> (F_c, C, H, W) latents
EPISODE = ("start", "end")


class Adapter(Protocol):
    """What the server needs to turn observations into engine requests and back. An adapter
    that keeps state per episode also gives ``end_session(session)``: the server calls it
    when the episode ends (``"episode": "end"`` or ``"start"``, or the robot disconnects);
    and ``unserved(session)``: the server calls it when the request ``request`` last built
    for ``session`` was not served (busy, failed in the engine, past its deadline), so what
    ``request`` recorded for it is undone and the robot can send the observation again."""

    def request(self, observation: dict[str, Any], session: str) -> Any: ...

    def reply(self, result: Result) -> dict[str, Any]: ...


def episode_control(observation: dict[str, Any]) -> str | None:
    """``observation["episode"]``: ``"start"`` (a new episode begins with this observation),
    ``"end"`` (the episode ends after it), or None; anything else is refused."""
    value = observation.get("episode")
    if value is not None and value not in EPISODE:
        raise ValueError(f"observation['episode']={value!r}: use 'start', 'end' or leave it out")
    return value


def _context(obs: dict[str, Any], encoder: Encoder | None) -> Tensor:
    """The latent context: ``obs["context"]`` or the encoder applied to ``obs["images"]``."""
    if ("context" in obs) == ("images" in obs):
        raise ValueError("an observation needs exactly one of 'context' (latent frames "
                         "(F_c, C, H, W)) and 'images' (camera frames for the encoder)")  # fmt: skip
    if "images" in obs:
        if encoder is None:
            raise ValueError("this server has no image encoder; send latent frames as 'context'")
        out = encoder(_array("images", obs["images"]))
        return out if isinstance(out, Tensor) else torch.from_numpy(np.array(out))
    return torch.from_numpy(_array("context", obs["context"]).copy())


def _array(key: str, value: Any) -> np.ndarray:
    """A numeric numpy array in native byte order (what torch can read without a copy)."""
    if not isinstance(value, np.ndarray):
        raise TypeError(f"observation[{key!r}] must be a numpy array, got {type(value).__name__}")
    if value.dtype.kind not in "biuf":
        raise TypeError(
            f"observation[{key!r}] is a {value.dtype} array; send numbers (float32 latents)"
        )
    if not value.dtype.isnative:
        raise ValueError(
            f"observation[{key!r}] is {value.dtype.str}, not in this machine's byte order; "
            f"send {value.dtype.newbyteorder('=').str} (array.astype(array.dtype.newbyteorder('=')))"
        )
    return value


def _frame(engine: Any) -> tuple[int, ...]:
    """The latent frame ``(C, H, W)`` an engine's model takes (a `VideoModel` says it, the
    reference DiT's config has it)."""
    model = engine.model
    if hasattr(model, "frame_shape"):
        return tuple(model.frame_shape)
    return (model.config.latent_channels, *model.config.latent_hw)


def _fields(obs: dict[str, Any], known: frozenset[str], defaults: dict[str, int]) -> dict[str, Any]:
    unknown = sorted(set(obs) - known)
    if unknown:
        raise ValueError(f"unknown observation keys {unknown}; this server reads {sorted(known)}")
    # min 0: the request checks its own lower bounds (a DiT chunk may have 0 frames)
    return {k: check_int(f"observation[{k!r}]", obs.get(k, v), min=0) for k, v in defaults.items()}


def _prompt(obs: dict[str, Any]) -> str:
    prompt = obs.get("prompt", "")
    if not isinstance(prompt, str):
        raise TypeError(f"observation['prompt'] must be a str, got {type(prompt).__name__}")
    return prompt


@dataclass(frozen=True, kw_only=True)
class DiTAdapter:
    """Observations for the reference-DiT `Engine`: ``frames``/``actions``/``steps``/``seed``
    are the defaults a robot may override per observation; ``encoder`` turns camera frames
    (``"images"``) into latents; ``latents``: send the generated frames back too."""

    frames: int = 1
    actions: int = 16
    steps: int = 10
    seed: int = 0
    encoder: Encoder | None = None
    latents: bool = True

    KEYS = frozenset({"context", "images", "prompt", "frames", "actions", "seed", "steps",
                      "keep_frames", "episode"})  # fmt: skip

    def __post_init__(self) -> None:
        for name, low, top in (("frames", 0, MAX_FRAMES), ("actions", 1, MAX_ACTIONS),
                               ("steps", 1, MAX_STEPS), ("seed", 0, SEED_MAX)):  # fmt: skip
            check_int(f"DiTAdapter.{name}", getattr(self, name), min=low, max=top)
        check_bool("DiTAdapter.latents", self.latents)

    def request(self, observation: dict[str, Any], session: str) -> Request:
        defaults = {"frames": self.frames, "actions": self.actions, "steps": self.steps,
                    "seed": self.seed}  # fmt: skip
        fields = _fields(observation, self.KEYS, defaults)
        keep = observation.get("keep_frames")
        if keep is not None and not isinstance(keep, list | np.ndarray):
            raise TypeError("observation['keep_frames'] must be a list of ints")
        return Request(
            context=_context(observation, self.encoder),
            task=_prompt(observation),
            keep_frames=None if keep is None else tuple(keep),
            session=session,
            **fields,
        )

    def default_request(self, engine: Any) -> Request:
        """The request an observation with no context and no overrides becomes; the server
        builds it at startup for each engine (`PolicyServer`): an engine that refuses it
        would refuse every such observation, so the server refuses to start instead."""
        return Request(context=torch.zeros(0, *_frame(engine)), frames=self.frames,
                       actions=self.actions, steps=self.steps, seed=self.seed)  # fmt: skip

    def reply(self, result: Result) -> dict[str, Any]:
        out = {"actions": to_host(result.action.detach()).float().numpy()}
        if self.latents:
            out["latents"] = to_host(result.latents.detach()).float().numpy()
        return out


@dataclass(frozen=True, kw_only=True)
class WanAdapter:
    """Observations for a `VideoEngine` serving a diffusers Wan (`ServedWan`): the prompt
    goes through ``text_encoder`` (str -> ``(L, D_txt)``), or the robot sends ready embeddings
    as ``"text"`` (not both: one would be dropped); the reply is ``{"latents": (frames, C, H, W)}`` (a Wan has no action head).
    The episode keys work as for `DiTAdapter` (a `VideoRequest` has no session to cache)."""

    text_encoder: Callable[[str], Tensor] | None = None
    frames: int = 1
    steps: int = 10
    seed: int = 0
    encoder: Encoder | None = None

    KEYS = frozenset({"context", "images", "prompt", "text", "frames", "seed", "steps",
                      "episode"})  # fmt: skip

    def __post_init__(self) -> None:
        for name, low, top in (("frames", 1, MAX_FRAMES), ("steps", 1, MAX_STEPS),
                               ("seed", 0, SEED_MAX)):  # fmt: skip
            check_int(f"WanAdapter.{name}", getattr(self, name), min=low, max=top)

    def request(self, observation: dict[str, Any], session: str) -> VideoRequest:
        defaults = {"frames": self.frames, "steps": self.steps, "seed": self.seed}
        fields = _fields(observation, self.KEYS, defaults)
        if "text" in observation and "prompt" in observation:
            raise ValueError(
                "an observation has both 'text' (ready embeddings) and 'prompt'; send one: the "
                "prompt goes through the server's text encoder, 'text' replaces it"
            )
        if "text" in observation:
            text = torch.from_numpy(_array("text", observation["text"]).copy())
        elif self.text_encoder is not None:
            text = self.text_encoder(_prompt(observation))
        else:
            raise ValueError("this server has no text encoder; send the prompt's embeddings "
                             "as 'text' (L, D_txt)")  # fmt: skip
        return VideoRequest(text=text, context=_context(observation, self.encoder), **fields)

    def default_request(self, engine: Any) -> VideoRequest:
        """The request an observation with no context and no overrides becomes, with one
        row of zero text (the prompt's encoding is the robot's): see `DiTAdapter`'s."""
        text = torch.zeros(1, getattr(engine.model, "text_dim", 1))
        return VideoRequest(text=text, context=torch.zeros(0, *_frame(engine)),
                            frames=self.frames, steps=self.steps, seed=self.seed)  # fmt: skip

    def reply(self, result: Result) -> dict[str, Any]:
        return {"latents": to_host(result.latents.detach()).float().numpy()}
