"""Bad input, refused at the boundary (install, the collator, loss) in one line naming the
episode or argument, the limit and the fix. Nothing is cropped, padded or dropped."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from packing._lazy import require
from packing._validate import check_int, check_real, is_int
from packing.data import PackedBatch, PackedCollator
from packing.integrations.lingbot_va._draws import draw_range
from packing.integrations.lingbot_va._loss import REDUCTIONS

__all__ = [
    "CheckedCollator",
    "LingBotConfig",
    "budget_frames",
    "draw_range",
    "episode",
    "latent_hw",
    "micro_batches",
    "model_and_config",
    "probability",
    "reduction",
    "schedulers",
]

_FIX_MODE = (
    "LingBot-VA trains with attn_mode='flex' (LeRobot's training_loss_from_streams refuses "
    "other modes): build it with LingBotVAConfig(attn_mode='flex', ...), or set "
    "config.attn_mode = 'flex' before LingBotVAPolicy.from_pretrained(path, config=config)"
)


@dataclass(frozen=True)
class LingBotConfig:
    """What the packed step reads of LeRobot's ``LingBotVAConfig``."""

    patch_size: tuple[int, int, int]
    in_channels: int
    action_dim: int
    text_dim: int
    action_per_frame: int
    frame_chunk_size: int
    used_action_channel_ids: tuple[int, ...]
    snr_shift: float
    action_snr_shift: float


def model_and_config(obj: Any, config: Any) -> tuple[nn.Module, LingBotConfig]:
    """(transformer, config) of a ``LingBotVAPolicy`` or its ``WanTransformer3DModel``."""
    modeling = require("lerobot.policies.lingbot_va.modeling_lingbot_va", extra="lingbot")
    utils = require("lerobot.policies.lingbot_va.utils", extra="lingbot")
    conf = require("lerobot.policies.lingbot_va.configuration_lingbot_va", extra="lingbot")
    if isinstance(obj, modeling.LingBotVAPolicy):
        if config is not None:
            raise ValueError(
                "config= is for a bare transformer; a LingBotVAPolicy brings its own "
                "(policy.config): drop config="
            )
        transformer, cfg = obj.transformer, obj.config
    elif isinstance(obj, utils.WanTransformer3DModel):
        transformer = obj
        cfg = conf.LingBotVAConfig if config is None else config  # class defaults, or yours
    else:
        raise TypeError(
            f"expected LeRobot's LingBotVAPolicy or its WanTransformer3DModel "
            f"(lerobot.policies.lingbot_va), got {type(obj).__name__}; a diffusers "
            "WanTransformer3DModel packs with packing.integrations.diffusers.install"
        )
    if any(type(b.attn1.attn_op).__name__ == "PackedAttentionOp" for b in transformer.blocks):
        raise ValueError(
            "this LingBot-VA transformer is already packed (install was called on it); keep "
            "the PackedLingBotVA it returned, or call its uninstall() first"
        )
    mode = transformer.config.attn_mode
    if mode != "flex":
        raise ValueError(f"the model was built with attn_mode={mode!r}; {_FIX_MODE}")
    tc = transformer.config
    return transformer, LingBotConfig(
        patch_size=tuple(int(p) for p in tc.patch_size),  # type: ignore[arg-type]
        in_channels=int(tc.in_channels),
        action_dim=int(tc.action_dim),
        text_dim=int(tc.text_dim),
        action_per_frame=int(cfg.action_per_frame),
        frame_chunk_size=int(cfg.frame_chunk_size),
        used_action_channel_ids=_used_channels(cfg, int(tc.action_dim)),
        snr_shift=float(cfg.snr_shift),
        action_snr_shift=float(cfg.action_snr_shift),
    )


def _used_channels(cfg: Any, action_dim: int) -> tuple[int, ...]:
    ids = cfg.used_action_channel_ids
    if callable(ids) or not isinstance(ids, Sequence):  # the class default is a field factory
        ids = list(range(7))
    ids = tuple(int(i) for i in ids)
    if not ids or len(set(ids)) != len(ids) or not all(0 <= i < action_dim for i in ids):
        raise ValueError(
            f"used_action_channel_ids={list(ids)} must be distinct channels in [0, "
            f"{action_dim}) (the model's action_dim); fix the policy config"
        )
    return ids


def schedulers(cfg: LingBotConfig) -> tuple[Any, Any]:
    """LeRobot's two training schedulers (latents, actions), as ``_ensure_train_schedulers``."""
    utils = require("lerobot.policies.lingbot_va.utils", extra="lingbot")
    out = []
    for shift in (cfg.snr_shift, cfg.action_snr_shift):
        s = utils.FlowMatchScheduler(shift=shift, sigma_min=0.0, extra_one_step=True)
        s.set_timesteps(1000, training=True)
        out.append(s)
    return out[0], out[1]


def latent_hw(value: Any, patch: tuple[int, int, int]) -> tuple[int, int]:
    ok = isinstance(value, tuple | list) and len(value) == 2 and all(is_int(v) for v in value)
    if not ok or not all(v > 0 and v % p == 0 for v, p in zip(value, patch[1:], strict=True)):
        raise ValueError(
            f"latent_hw={value!r}; pass the latent frame's (H, W), positive multiples of the "
            f"model's patch {tuple(patch[1:])}"
        )
    return int(value[0]), int(value[1])


def probability(name: str, value: Any) -> float:
    p = check_real(name, value, min=0.0, hint="a probability in [0, 1]")
    if p > 1:
        raise ValueError(f"{name}={value!r} is above 1; pass a probability in [0, 1]")
    return p


def budget_frames(token_budget: Any, tokens_per_frame: int) -> int:
    budget = check_int("token_budget", token_budget, min=1, hint="latent tokens of one copy")
    if budget % tokens_per_frame:
        raise ValueError(
            f"token_budget={budget} is not a multiple of a latent frame's {tokens_per_frame} "
            f"tokens; use {budget - budget % tokens_per_frame or tokens_per_frame} or "
            f"{budget + tokens_per_frame - budget % tokens_per_frame}"
        )
    return budget // tokens_per_frame


def reduction(value: Any) -> str:
    if not isinstance(value, str) or value not in REDUCTIONS:
        raise ValueError(
            f"reduction={value!r}; use 'episode' (LingBot-VA's trainer) or 'frame' (LeRobot's "
            "batch mean)"
        )
    return value


def micro_batches(value: Any, batch: PackedBatch) -> list[PackedBatch]:
    """Every micro-batch of the step (this one among them), as PackedBatches."""
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise TypeError(
            f"micro_batches={value!r}; pass the list of this optimizer step's PackedBatches "
            "(fetched before the first backward), or None"
        )
    items = list(value)
    if not items or not all(isinstance(b, PackedBatch) for b in items):
        raise TypeError("micro_batches must be a non-empty list of PackedBatches")
    if not any(b is batch for b in items):
        raise ValueError(
            "micro_batches does not hold this batch; pass every micro-batch of the step, "
            "this one included"
        )
    return items


def episode(ep: Mapping[str, Any], i: int, streams: Sequence[Any], chunk: int) -> None:
    """One episode as LingBot-VA needs it, or a ValueError naming it and the fix."""
    name = f"episode {ep.get('episode_index', f'at position {i}')}"
    if "episode_index" not in ep:
        raise ValueError(
            f"{name} has no 'episode_index': LingBot-VA's draws are keyed by it; add it "
            "(LeRobotEpisodes and lingbot_episodes serve it)"
        )
    lat_s, act_s, txt_s = streams
    for key in ("latents", "actions", "text"):
        if not isinstance(ep.get(key), torch.Tensor):
            raise ValueError(f"{name} has no tensor {key!r}; LingBot-VA episodes hold latents, "
                             "actions and text (see lingbot_episodes)")  # fmt: skip
    lat, act, txt = ep["latents"], ep["actions"], ep["text"]
    if lat.dim() != 4 or tuple(lat.shape[1:]) != lat_s.step_shape:
        raise ValueError(
            f"{name}: latents {tuple(lat.shape)} must be (F, C, H, W) with (C, H, W) = "
            f"{lat_s.step_shape} (the model's in_channels and install's latent_hw)"
        )
    frames = lat.shape[0]
    if frames < chunk:
        raise ValueError(
            f"{name} has {frames} latent frames, shorter than one chunk (the policy's "
            f"frame_chunk_size={chunk}); drop it from the dataset (packing never pads an episode)"
        )
    apf, used = act_s.step_shape
    if tuple(act.shape) != (frames, apf, used):
        raise ValueError(
            f"{name}: actions {tuple(act.shape)} do not match its {frames} latent frames; "
            f"LingBot-VA takes ({frames}, action_per_frame={apf}, {used} used channels), "
            "action_per_frame actions a latent frame (lingbot_episodes builds them)"
        )
    if txt.dim() != 2 or txt.shape[1] != txt_s.step_shape[0]:
        raise ValueError(
            f"{name}: text embeddings {tuple(txt.shape)} are not (L, text_dim="
            f"{txt_s.step_shape[0]}); encode the task with the model's text encoder width"
        )


class CheckedCollator:
    """A `PackedCollator` that first checks each episode for LingBot-VA (`episode`)."""

    def __init__(self, inner: PackedCollator, chunk: int) -> None:
        self.inner = inner
        self.chunk = chunk
        self.streams = inner.streams

    def __call__(self, episodes: Sequence[Mapping[str, Any]]) -> PackedBatch:
        for i, ep in enumerate(episodes):
            episode(ep, i, self.streams, self.chunk)  # type: ignore[arg-type]
        return self.inner(episodes)

    def __repr__(self) -> str:
        return f"CheckedCollator({self.inner!r}, chunk={self.chunk})"
