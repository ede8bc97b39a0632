"""What a LeRobot LingBot-VA client sends `packing serve`, and what it gets back.

One message a chunk, openpi's protocol (msgpack, numpy arrays), the episode a session::

    {"observation.images.image":  uint8 (n, H, W, 3) or float (n, 3, H, W) in [0, 1]
     ... every camera in config.obs_cam_keys, the frames since the last chunk (n = 1 at an
         episode's start: the conditioning observation; then the keyframes LeRobot's
         select_action buffers during a chunk)
     "observation.state": float (S,)   optional; LingBot-VA does not read it
     "task": "put the bowl on the plate"
     "seed": 7                         optional (default: the adapter's seed + 1000 k)
     "episode": "start" | "end"}
    reply {"actions": float32 (steps, n_used)}   predict_action_chunk's output for the chunk

The VAE (``encoder``) runs once per message, outside the packed steps; the text encoder
once per prompt (cached). The adapter keeps each episode's latent frames; the engine's
session keeps the executed actions (the chunks it served, LeRobot's assumption) and the KV
cache. Bad input is one line to that robot: a missing camera, a prompt longer than
``max_sequence_length`` tokens, a keyframe count that is not a whole chunk (an episode
restarted mid-chunk), a task changed mid-episode. A chunk that is not served (busy, failed in
the engine, past its deadline) leaves the episode as it was: the robot sends the same
observation again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from packing._validate import check_int
from packing.integrations.lingbot_va._serve_request import ChunkRequest
from packing.serve import Result
from packing.serve.protocol import SEED_MAX, to_host

__all__ = ["LingBotVAAdapter"]

Encoder = Callable[[str, dict[str, np.ndarray]], Tensor]  # (session, frames) -> (n, C, H, W)
OTHER_KEYS = frozenset({"observation.state", "task", "seed", "episode"})


@dataclass
class _Episode:
    task: str
    frames: list[Tensor] = field(default_factory=list)  # latent frames so far
    chunks: int = 0  # chunks asked for
    before: tuple[list[Tensor], int] | None = None  # (frames, chunks) before the last request


@dataclass(kw_only=True)
class LingBotVAAdapter:
    """``LingBotVAAdapter(config=policy.config, encoder=vae, text_encoder=umt5)``.

    ``encoder(session, {camera: frames})`` returns the frames' latents ``(n, C, H, W)``
    (the session lets a streaming VAE keep its causal cache per episode; its optional
    ``unserved(session)`` and ``end_session(session)`` are called when a chunk was not
    served and when the episode ends); ``text_encoder(prompt)`` the prompt's embeddings
    ``(tokens, text_dim)``, unpadded. ``LingBotVAAdapter.from_policy(policy)`` builds both
    from the policy's own VAE and UMT5 (`PolicyEncoders`).
    An episode's frames are kept until it ends (`end_session`, which the server calls);
    ``episodes``: how many are kept at most, for robots that never say (the oldest go)."""

    config: Any
    encoder: Encoder
    text_encoder: Callable[[str], Tensor]
    seed: int = 0
    episodes: int = 4096
    _state: OrderedDict[str, _Episode] = field(default_factory=OrderedDict, init=False)
    _text: dict[str, Tensor] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        check_int("LingBotVAAdapter.seed", self.seed, min=0, max=SEED_MAX)
        check_int("LingBotVAAdapter.episodes", self.episodes, min=1)

    @classmethod
    def from_policy(cls, policy: Any, *, seed: int = 0, episodes: int = 4096) -> LingBotVAAdapter:
        """The adapter over the policy's own frozen VAE and UMT5 (loaded from
        ``config.wan_pretrained_path`` if they are not yet), each episode with its own
        streaming VAE cache (`PolicyEncoders`): a robot's frames encode as they would in a
        LeRobot policy serving that robot alone."""
        from packing.integrations.lingbot_va._serve_encoders import PolicyEncoders

        encoders = PolicyEncoders(policy, episodes=episodes)
        return cls(config=policy.config, encoder=encoders, text_encoder=encoders.text,
                   seed=seed, episodes=episodes)  # fmt: skip

    def request(self, observation: dict[str, Any], session: str) -> ChunkRequest:
        cams = list(self.config.obs_cam_keys)
        unknown = sorted(set(observation) - set(cams) - OTHER_KEYS)
        if unknown:
            raise ValueError(f"unknown observation keys {unknown}; LingBot-VA reads {cams} "
                             f"and {sorted(OTHER_KEYS)}")  # fmt: skip
        missing = [k for k in cams if k not in observation]
        if missing:
            raise ValueError(
                f"the observation lacks camera {missing[0]!r}, which the config names "
                f"(obs_cam_keys={cams}); send every camera's frames"
            )
        task = observation.get("task")
        if not isinstance(task, str):
            raise TypeError(f"observation['task'] must be a str, got {type(task).__name__}")
        frames = {k: _frames(k, observation[k]) for k in cams}
        with self._lock:
            ep = self._state.get(session)
        if ep is not None and ep.task != task:
            raise ValueError(
                f"observation['task'] changed mid-episode ({ep.task!r} -> {task!r}); LeRobot "
                "conditions an episode on its first task: start a new episode ('episode': 'start')"
            )
        prompt, negative = self._embed(task), self._embed("")
        latents = self.encoder(session, frames)
        try:
            return self._request(session, ep, task, latents, prompt, negative, observation)
        except Exception:  # refused after encoding: the encoder's episode goes back too
            _tell(self.encoder, "unserved", session)
            raise

    def _request(self, session: str, ep: _Episode | None, task: str, latents: Tensor,
                 prompt: Tensor, negative: Tensor, observation: dict[str, Any]) -> ChunkRequest:  # fmt: skip
        k = 0 if ep is None else ep.chunks
        F_ = int(self.config.frame_chunk_size)
        want = 1 if k == 0 else F_ - 1 if k == 1 else F_
        if latents.shape[0] != want:
            raise ValueError(
                f"the observation's frames encode to {latents.shape[0]} latent frames; chunk {k} "
                f"of this episode takes {want} (the conditioning frame, then a whole chunk's "
                "keyframes): an episode restarted mid-chunk; send whole chunks, or start a new "
                "episode ('episode': 'start')"
            )
        ep = ep or _Episode(task)
        history = torch.cat([*ep.frames, latents.float().cpu()])
        seed = observation.get("seed", self.seed + 1000 * k)
        req = ChunkRequest(session=session, frames=history, actions=None, prompt=prompt,
                           negative=negative, seed=seed)  # fmt: skip
        with self._lock:
            ep.before = (ep.frames, ep.chunks)
            ep.frames, ep.chunks = [history], k + 1
            self._state[session] = ep
            self._state.move_to_end(session)
            while len(self._state) > self.episodes:
                self._state.popitem(last=False)
        return req

    def unserved(self, session: str) -> None:
        """The chunk last asked for in ``session`` was not served (the server's call: busy, it
        failed in the engine, its deadline passed): the episode is as before that request, so
        the robot sends the same observation again (the engine rolled its session back too)."""
        with self._lock:
            ep = self._state.get(session)
            if ep is not None and ep.before is not None:
                ep.frames, ep.chunks = ep.before
                ep.before = None
                if ep.chunks == 0:  # nothing of the episode was served: it starts afresh
                    del self._state[session]
        _tell(self.encoder, "unserved", session)  # a streaming VAE's cache goes back too

    def end_session(self, session: str) -> None:
        """The episode ``session`` ended: its frames are dropped (the server's call; the
        engine's session, its KV cache, is freed by the engine's own ``end_session``)."""
        with self._lock:
            self._state.pop(session, None)
        _tell(self.encoder, "end_session", session)

    def _embed(self, prompt: str) -> Tensor:
        """The text encoder's output padded to ``max_sequence_length`` rows, as LeRobot's."""
        with self._lock:
            if prompt in self._text:
                return self._text[prompt]
        out = self.text_encoder(prompt).detach().float().cpu()
        L = int(self.config.max_sequence_length)
        if out.dim() != 2 or out.shape[0] > L:
            raise ValueError(
                f"the prompt {prompt[:40]!r} is {out.shape[0]} tokens, more than the text "
                f"encoder takes (max_sequence_length={L}); shorten the task"
            )
        padded = torch.cat([out, out.new_zeros(L - out.shape[0], out.shape[1])])
        with self._lock:
            self._text[prompt] = padded
        return padded

    def reply(self, result: Result) -> dict[str, Any]:
        return {"actions": to_host(result.action.detach()).float().numpy()}


def _tell(encoder: Any, hook: str, session: str) -> None:
    """The encoder's optional per-episode hook (`PolicyEncoders` keeps a VAE cache each)."""
    fn = getattr(encoder, hook, None)
    if callable(fn):
        fn(session)


def _frames(key: str, value: Any) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.ndim != 4:
        got = value.shape if isinstance(value, np.ndarray) else type(value).__name__
        raise ValueError(
            f"observation[{key!r}] must be (n, H, W, 3) uint8 or (n, 3, H, W) float frames, "
            f"got {got}"
        )
    return value
