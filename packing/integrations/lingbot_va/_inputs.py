"""The flow-matching inputs of a pack from per-episode draws: LeRobot's ``_add_noise_stream``
on the packed step-level tensors, episode by episode identical.

Step rows (one latent frame a row, both streams; legend of `packing.data`)::

    latents  (S, C, H, W)       actions (S, apf, A)      S = the pack's padded frames
    t_S      timestep of each row's frame (0 on padding), from its episode's draws
    noisy    (1 - sigma) x + sigma noise       target  noise - x     (LeRobot's add_noise,
    clean    x, or x noised to the condition time when the episode drew that branch

``sigma`` is LeRobot's lookup (``argmin |timesteps - t|``), done on the host: the timestep
ids are host tensors, so nothing here syncs (LeRobot's ``add_noise`` reads them back).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from packing.integrations.lingbot_va._draws import EpisodeDraws

__all__ = ["StreamInputs", "stream_inputs"]


@dataclass(frozen=True)
class StreamInputs:
    """One stream's inputs, step rows first: the two copies, the target, and per row the
    noisy and clean timesteps and the loss weight (host float32 -> device)."""

    noisy: Tensor
    clean: Tensor
    target: Tensor
    t_noisy_S: Tensor
    t_clean_S: Tensor
    weight_S: Tensor


def stream_inputs(
    x: Tensor,
    draws: Sequence[EpisodeDraws],
    frames_K: Sequence[int],
    scheduler: object,
    *,
    action: bool,
    mask: Tensor | None = None,
) -> StreamInputs:
    """``x`` is the stream's step-level data (``(S, C, H, W)`` latents or ``(S, apf, A)``
    actions); ``mask`` (broadcast to ``x``) zeroes unused action channels, as LeRobot does."""
    S = x.shape[0]
    ids, cond_ids, has_cond = _per_row(draws, frames_K, S, action)
    sched: object = scheduler
    timesteps = sched.timesteps  # type: ignore[attr-defined]
    t = timesteps[ids]
    t_cond = torch.where(has_cond, timesteps[cond_ids], 0.0)
    noise = _noise(draws, S, x, action, cond=False)
    shape = (S,) + (1,) * (x.dim() - 1)
    sigma = _sigma(sched, t).to(x).view(shape)
    noisy = (1 - sigma) * x + sigma * noise
    target = noise - x
    clean = x
    if bool(has_cond.any()):
        sc = _sigma(sched, t_cond).to(x).view(shape)
        cond = (1 - sc) * x + sc * _noise(draws, S, x, action, cond=True)
        clean = torch.where(has_cond.to(x.device).view(shape), cond, x)
    if mask is not None:
        m = mask.float()
        noisy, target, clean = noisy * m, target * m, clean * m
    weight = sched.training_weight(t)  # type: ignore[attr-defined]
    real = torch.zeros(S, dtype=torch.bool)
    real[: sum(frames_K)] = True
    dev = x.device
    return StreamInputs(
        noisy=noisy,
        clean=clean,
        target=target,
        t_noisy_S=torch.where(real, t, 0.0).to(dev, non_blocking=True),
        t_clean_S=torch.where(real, t_cond, 0.0).to(dev, non_blocking=True),
        weight_S=torch.where(real, weight, 0.0).to(dev, non_blocking=True),
    )


def _per_row(
    draws: Sequence[EpisodeDraws], frames_K: Sequence[int], S: int, action: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Host (S,) timestep ids, condition ids and whether the row's episode took the branch."""
    ids = torch.zeros(S, dtype=torch.int64)
    cond = torch.zeros(S, dtype=torch.int64)
    has = torch.zeros(S, dtype=torch.bool)
    r = 0
    for d, f in zip(draws, frames_K, strict=True):
        ids[r : r + f] = d.action_ids if action else d.latent_ids
        if not action and d.cond_ids is not None:
            cond[r : r + f], has[r : r + f] = d.cond_ids, True
        r += f
    return ids, cond, has


def _noise(draws: Sequence[EpisodeDraws], S: int, x: Tensor, action: bool, cond: bool) -> Tensor:
    """The episodes' noise in step-row layout, zeros on padding (and without the branch)."""
    parts = []
    for d in draws:
        n = d.action_noise if action else (d.cond_noise if cond else d.latent_noise)
        if n is None:
            f = d.latent_noise.shape[1]
            parts.append(x.new_zeros((f, *x.shape[1:])))
        elif action:  # (A, F, apf, 1) -> (F, apf, A)
            parts.append(n[..., 0].permute(1, 2, 0))
        else:  # (C, F, H, W) -> (F, C, H, W)
            parts.append(n.permute(1, 0, 2, 3))
    rows = sum(p.shape[0] for p in parts)
    if rows < S:
        parts.append(x.new_zeros((S - rows, *x.shape[1:])))
    return torch.cat(parts).to(x.dtype)


def _sigma(sched: object, t: Tensor) -> Tensor:
    """LeRobot's ``FlowMatchScheduler.add_noise`` lookup: the sigma of the nearest timestep."""
    table = sched.timesteps  # type: ignore[attr-defined]
    idx = torch.argmin((table[:, None] - t[None]).abs(), dim=0)
    return sched.sigmas[idx]  # type: ignore[attr-defined]
