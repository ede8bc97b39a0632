"""LingBot-VA episodes from a LeRobot latent dataset plus text embeddings.

A latent dataset (`packing.datasets.LeRobotEpisodes` over what ``packing encode`` writes)
serves an episode as ``latents (L, C, H, W)``, ``action (N, n_used)`` and its ``task``.
LingBot-VA takes ``action_per_frame`` actions a latent frame, LeRobot's convention: action
row ``r`` belongs to latent frame ``r // action_per_frame`` (its training windows of 16 video
frames hold 16 actions and 4 latents)::

    latents   0        1        2                      L = 3, action_per_frame = 4
    actions   0 1 2 3  4 5 6 7  8 9 10 11              N must be L * 4 = 12

A whole episode encoded by a causal VAE has ``N = 1 + 4 (L - 1)`` rows: 3 short of the last
frame's actions. That is refused, naming the episode, unless ``last_frame="drop"``, which
trains on the first ``N // action_per_frame`` latent frames and their actions (the rest of
the episode is named in the docs, not used). Nothing is padded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils.data import Dataset

from packing._validate import check_int

__all__ = ["lingbot_episodes"]

TextEmbeddings = Mapping[str, Tensor] | Callable[[str], Tensor]


class _LingBotEpisodes(Dataset):
    def __init__(
        self,
        source: Sequence[Mapping[str, Any]],
        text: TextEmbeddings,
        latent_key: str,
        action_key: str,
        action_per_frame: int,
        last_frame: str,
    ) -> None:
        self.source = source
        self.text = text
        self.latent_key = latent_key
        self.action_key = action_key
        self.apf = action_per_frame
        self.last_frame = last_frame
        lengths = getattr(source, "lengths", None)
        self.lengths = lengths  # video frames per episode (the planner may read them)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ep = self.source[i]
        name = f"episode {ep.get('episode_index', f'at position {i}')}"
        for key in (self.latent_key, self.action_key, "task"):
            if key not in ep:
                raise KeyError(f"{name} has no {key!r} (keys: {sorted(ep)}); pass latent_key= / "
                               "action_key= naming the dataset's features")  # fmt: skip
        lat, act = ep[self.latent_key], ep[self.action_key]
        frames = lat.shape[0]
        if act.shape[0] != frames * self.apf:
            keep = act.shape[0] // self.apf
            if self.last_frame != "drop" or keep < 1:
                raise ValueError(
                    f"{name}: {act.shape[0]} action rows do not match its {frames} latent "
                    f"frames x action_per_frame={self.apf} = {frames * self.apf}; pass "
                    "last_frame='drop' to train on the frames whose actions are all there"
                )
            frames = min(frames, keep)
        return {
            "latents": lat[:frames],
            "actions": act[: frames * self.apf].reshape(frames, self.apf, *act.shape[1:]),
            "text": _text(self.text, ep["task"], name),
            "episode_index": ep.get("episode_index", i),
        }


def _text(text: TextEmbeddings, task: str, name: str) -> Tensor:
    if callable(text) and not isinstance(text, Mapping):
        out = text(task)
    elif task in text:
        out = text[task]
    else:
        raise KeyError(
            f"{name}: no text embedding for its task {task!r}; add it to text_embeddings"
        )
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        raise ValueError(f"{name}: the text embedding of {task!r} must be a (L, text_dim) tensor")
    return out


def lingbot_episodes(
    source: Sequence[Mapping[str, Any]],
    text_embeddings: TextEmbeddings,
    *,
    latent_key: str = "latents",
    action_key: str = "action",
    action_per_frame: int = 4,
    last_frame: Literal["error", "drop"] = "error",
) -> Dataset:
    """A map-style dataset of LingBot-VA episodes over ``source`` (e.g. ``LeRobotEpisodes(root,
    keys=["observation.latent", "action"])``): ``latents (F, C, H, W)``, ``actions (F,
    action_per_frame, n_used)``, ``text (L, text_dim)`` from ``text_embeddings[task]`` (a
    mapping, or a function of the task), ``episode_index``. ``last_frame``: ``"error"``
    (default) or ``"drop"`` (module docstring)."""
    if not isinstance(last_frame, str) or last_frame not in ("error", "drop"):
        raise ValueError(f"last_frame={last_frame!r}; use 'error' or 'drop'")
    if (
        isinstance(source, str)
        or not hasattr(source, "__getitem__")
        or not hasattr(source, "__len__")
    ):
        raise TypeError(
            f"source must be an episode dataset (LeRobotEpisodes, a list of dicts), got "
            f"{type(source).__name__}"
        )
    for name, key in (("latent_key", latent_key), ("action_key", action_key)):
        if not isinstance(key, str):
            raise TypeError(f"{name}={key!r} must be a feature name (str)")
    check_int("action_per_frame", action_per_frame, min=1, hint="actions a latent frame")
    if not (isinstance(text_embeddings, Mapping) or callable(text_embeddings)):
        raise TypeError(
            "text_embeddings must map each task to a (L, text_dim) tensor, or be a function of "
            f"the task; got {type(text_embeddings).__name__}"
        )
    return _LingBotEpisodes(
        source, text_embeddings, latent_key, action_key, action_per_frame, last_frame
    )
