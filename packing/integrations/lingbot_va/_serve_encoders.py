"""LeRobot's own VAE and text encoder behind `LingBotVAAdapter`, one VAE cache per episode.

LeRobot's policy encodes one robot's observations with one *streaming* VAE: the causal
cache of its 3-D convolutions carries from chunk to chunk, so a policy serves one robot. Here
every episode (a server session) keeps its own cache over the same weights, and the policy's
own ``_encode_frames`` runs with that cache swapped in::

    robot A chunk 0 | robot B chunk 0 | robot A chunk 1 | ...     messages, interleaved
    cache A  ------------------------> cache A                     each episode's own,
    cache B           ---------------------------------> ...       as if it ran alone

A chunk the server did not serve (busy, failed, past its deadline) puts the episode's cache
back as it was, since the robot sends the same frames again. The prompt goes through the
policy's own tokenizer and UMT5 (``_get_t5_prompt_embeds``); a prompt longer than
``max_sequence_length`` tokens is refused, where LeRobot would cut it silently.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from torch import Tensor

from packing._lazy import require
from packing._validate import check_int

__all__ = ["PolicyEncoders"]

_STREAMS = ("streaming_vae", "streaming_vae_half")  # the policy's streaming VAEs (half: T-shape)


class PolicyEncoders:
    """``PolicyEncoders(policy)``: ``encoders(session, {camera: frames})`` the frames' latents
    ``(n, C, h, w)`` (LeRobot's ``_encode_frames`` on that episode's own VAE cache) and
    ``encoders.text(prompt)`` its embeddings ``(tokens, text_dim)`` (LeRobot's UMT5).
    Loads the policy's frozen modules if it has not (LeRobot's ``_ensure_frozen_modules``:
    from ``config.wan_pretrained_path``). ``episodes``: VAE caches kept at most (the
    oldest go; the adapter forgets the same episodes)."""

    def __init__(self, policy: Any, *, episodes: int = 4096) -> None:
        check_int("PolicyEncoders.episodes", episodes, min=1)
        policy._ensure_frozen_modules()
        self.policy, self.episodes = policy, episodes
        self._utils = require("lerobot.policies.lingbot_va.utils", extra="lingbot")
        self._caches: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._before: dict[str, dict[str, list[Any]]] = {}  # the caches before the last encode
        self._lock = threading.Lock()  # one encode at a time: the policy's modules are swapped

    @torch.no_grad()
    def __call__(self, session: str, frames: dict[str, np.ndarray]) -> Tensor:
        cams = list(self.policy.config.obs_cam_keys)
        clips = {k: _unit_frames(k, frames[k]) for k in cams}
        n = {clip.shape[0] for clip in clips.values()}
        if len(n) != 1:
            raise ValueError(f"the cameras sent different frame counts {sorted(n)}; send each "
                             "camera's frames of the same instants")  # fmt: skip
        count = n.pop()
        raw = [{k: clips[k][i : i + 1] for k in cams} for i in range(count)]
        frozen = self.policy._frozen
        with self._lock:
            caches = self._caches.get(session)
            _check_count(count, caches is None, int(frozen["vae"].config.scale_factor_temporal))
            if caches is None:  # a new episode: fresh caches over the policy's VAE weights
                caches = {s: self._utils.WanVAEStreamingWrapper(frozen[s].vae)
                          for s in _STREAMS if s in frozen}  # fmt: skip
            before = {s: list(w.feat_cache) for s, w in caches.items()}
            own = {s: frozen[s] for s in caches}
            frozen.update(caches)
            try:
                latents = self.policy._encode_frames(raw)  # (1, C, F, h, w)
            except Exception:  # a cache half written is no cache: put it back
                for s, cache in before.items():
                    caches[s].feat_cache = cache
                raise
            finally:
                frozen.update(own)
            self._before[session] = before
            self._caches[session] = caches
            self._caches.move_to_end(session)
            while len(self._caches) > self.episodes:
                old, _ = self._caches.popitem(last=False)
                self._before.pop(old, None)
        return latents[0].transpose(0, 1)

    @torch.no_grad()
    def text(self, prompt: str) -> Tensor:
        """LeRobot's UMT5 embeddings of ``prompt``, its real tokens only ``(tokens, text_dim)``
        (the adapter pads them with zero rows, as LeRobot does)."""
        L = int(self.policy.config.max_sequence_length)
        tokenizer = self.policy._frozen["tokenizer"]
        n = len(tokenizer(self._utils.clean_prompt(prompt), add_special_tokens=True).input_ids)
        if n > L:
            raise ValueError(
                f"the prompt {prompt[:40]!r} is {n} tokens, more than the text encoder takes "
                f"(max_sequence_length={L}); shorten the task"
            )
        with self._lock:
            return self.policy._get_t5_prompt_embeds(prompt, L)[0, :n]

    def unserved(self, session: str) -> None:
        """The last chunk of ``session`` was not served: its VAE cache goes back to before."""
        with self._lock:
            before, caches = self._before.pop(session, None), self._caches.get(session)
            if before is None or caches is None:
                return
            for s, cache in before.items():
                caches[s].feat_cache = cache

    def end_session(self, session: str) -> None:
        """The episode ended: its VAE cache is freed."""
        with self._lock:
            self._caches.pop(session, None)
            self._before.pop(session, None)


def _check_count(n: int, first: bool, stride: int) -> None:
    """LeRobot's streaming VAE takes an episode's conditioning observation alone, then
    keyframes in whole groups of its temporal stride (each group one latent frame)."""
    if n == 0:
        raise ValueError("the message carries no frames; send each camera's frames since the "
                         "last chunk (an episode's first message: the one observation)")  # fmt: skip
    if first and n != 1:
        raise ValueError(
            f"an episode's first message carries {n} frames a camera; it takes 1, the "
            "conditioning observation (start a new episode with 'episode': 'start')"
        )
    if not first and n % stride:
        raise ValueError(
            f"the message carries {n} frames a camera; after an episode's first, the VAE takes "
            f"keyframes in whole groups of {stride} (a chunk's keyframes): an episode restarted "
            "mid-chunk; send whole chunks, or start a new episode ('episode': 'start')"
        )


def _unit_frames(key: str, value: Any) -> Tensor:
    """A camera's frames as LeRobot's policy reads them: float ``(n, 3, H, W)`` in [0, 1]
    (a client's uint8 ``(n, H, W, 3)`` divided by 255, as LeRobot's processors do)."""
    if isinstance(value, np.ndarray) and value.ndim == 4:
        if value.dtype == np.uint8 and value.shape[-1] == 3:
            return torch.from_numpy(np.ascontiguousarray(value)).permute(0, 3, 1, 2).float() / 255
        if value.dtype in (np.float32, np.float64) and value.shape[1] == 3:
            out = torch.from_numpy(np.ascontiguousarray(value)).float()
            if bool(torch.isfinite(out).all()) and out.min() >= 0 and out.max() <= 1:
                return out
    got = (f"{value.dtype} {value.shape}" if isinstance(value, np.ndarray)
           else type(value).__name__)  # fmt: skip
    raise ValueError(
        f"observation[{key!r}] must be (n, H, W, 3) uint8 or (n, 3, H, W) float frames in "
        f"[0, 1], got {got}"
    )
