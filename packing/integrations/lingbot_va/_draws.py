"""Per-episode draws, keyed by (seed, step, episode): LeRobot's own draws, one episode alone.

LeRobot's ``LingBotVAPolicy.training_loss_from_streams`` draws from the global RNG, in this
order, for a batch of one episode of ``F`` latent frames (``_add_noise_stream`` twice, then
two integers)::

    latents   rand(F) -> timestep ids     normal(latents) -> noise
              rand(1) < 0.5 ?  rand(F) * 0.5 + 0.5 -> condition ids, normal(latents) -> noise
    actions   rand(F) -> timestep ids     normal(actions) -> noise     rand(1) (< 0.0: never)
    chunk_size = randint(1, 5)            window_size = randint(4, 65)

`draw_episode` makes exactly these calls on its own generators seeded with
``episode_seed(seed, step, episode, "lingbot_va")``: the packed step draws, episode by episode,
the numbers LeRobot draws after ``torch.manual_seed`` of that seed (on a CPU the noise shares
the generator with the integers, as the global one does; on CUDA it comes from a CUDA
generator, as ``zeros_like(latent).normal_()`` does there). So packed and unpacked see the same
inputs, whatever the pack, micro-step or rank. Nothing here reads a device tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from packing._validate import check_dtype, check_int_tuple, check_real, is_int
from packing.train import episode_seed

__all__ = ["EpisodeDraws", "draw_episode", "lingbot_seed"]

_T = 1000  # num_train_timesteps of LeRobot's FlowMatchScheduler


@dataclass(frozen=True)
class EpisodeDraws:
    """One episode's draws (host timestep ids, device noise in LeRobot's layouts).

    ``latent_noise`` is ``(C, F, H, W)`` and ``action_noise`` ``(A, F, apf, 1)`` (LeRobot's
    ``[B, ...]`` without B); ``cond_ids`` / ``cond_noise`` are None when the noisy-condition
    branch was not taken.
    """

    latent_ids: Tensor  # int64 (F,), CPU
    latent_noise: Tensor
    cond_ids: Tensor | None
    cond_noise: Tensor | None
    action_ids: Tensor  # int64 (F,), CPU
    action_noise: Tensor
    chunk_size: int
    window_size: int


def lingbot_seed(seed: int, step: int, episode_index: int) -> int:
    """The seed of one episode's draws: what the unpacked reference passes to
    ``torch.manual_seed`` before LeRobot's own training call."""
    return episode_seed(seed, step, episode_index, "lingbot_va")


def draw_episode(
    seed: int,
    step: int,
    episode_index: int,
    *,
    latent_shape: tuple[int, int, int, int],
    action_shape: tuple[int, int, int, int],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    noisy_cond_prob: float = 0.5,
    chunk_sizes: tuple[int, int] = (1, 4),
    windows: tuple[int, int] = (4, 64),
) -> EpisodeDraws:
    """LeRobot's draws for one episode: ``latent_shape`` ``(C, F, H, W)``, ``action_shape``
    ``(A, F, apf, 1)``; noise in ``dtype`` on ``device`` (LeRobot draws it in the inputs'
    dtype and device); ``chunk_sizes`` / ``windows`` are inclusive ranges."""
    s = lingbot_seed(seed, step, episode_index)
    latent_shape = check_int_tuple("latent_shape", latent_shape, length=4, min=1)  # type: ignore[assignment]
    action_shape = check_int_tuple("action_shape", action_shape, length=4, min=1)  # type: ignore[assignment]
    if latent_shape[1] != action_shape[1]:
        raise ValueError(
            f"latent_shape {latent_shape} and action_shape {action_shape} disagree on the "
            "frames (dim 1); pass (C, F, H, W) and (A, F, apf, 1) of one episode"
        )
    noisy_cond_prob = _checks_probability(noisy_cond_prob)
    chunk_sizes = draw_range("chunk_sizes", chunk_sizes, 1, 64)
    windows = draw_range("windows", windows, 0, 1 << 20)
    dtype = check_dtype("dtype", dtype)  # type: ignore[assignment]
    gen = torch.Generator().manual_seed(s)
    dev = torch.device(device)
    noise_gen = gen if dev.type == "cpu" else torch.Generator(dev).manual_seed(s)
    frames = latent_shape[1]

    def noise(shape: tuple[int, ...]) -> Tensor:
        return torch.empty((1, *shape), device=dev, dtype=dtype).normal_(generator=noise_gen)[0]

    latent_ids = _timestep_ids(gen, frames, 0.0, 1.0)
    latent_noise = noise(latent_shape)
    cond_ids = cond_noise = None
    if torch.rand(1, generator=gen).item() < noisy_cond_prob:
        cond_ids = _timestep_ids(gen, frames, 0.5, 1.0)
        cond_noise = noise(latent_shape)
    action_ids = _timestep_ids(gen, frames, 0.0, 1.0)
    action_noise = noise(action_shape)
    torch.rand(1, generator=gen)  # the action stream's condition draw (probability 0)
    chunk = int(torch.randint(chunk_sizes[0], chunk_sizes[1] + 1, (1,), generator=gen).item())
    window = int(torch.randint(windows[0], windows[1] + 1, (1,), generator=gen).item())
    return EpisodeDraws(
        latent_ids, latent_noise, cond_ids, cond_noise, action_ids, action_noise, chunk, window
    )


def draw_range(name: str, value: object, lo: int, hi: int) -> tuple[int, int]:
    """An inclusive ``(low, high)`` range of ints within ``[lo, hi]``, or a ValueError."""
    ok = isinstance(value, tuple | list) and len(value) == 2 and all(is_int(v) for v in value)
    if not ok or not lo <= value[0] <= value[1] <= hi:  # type: ignore[index]
        raise ValueError(
            f"{name}={value!r} is out of range; pass an inclusive (low, high) pair of ints with "
            f"{lo} <= low <= high <= {hi} (LeRobot draws chunk_size in (1, 4), window in (4, 64))"
        )
    return int(value[0]), int(value[1])  # type: ignore[index]


def _checks_probability(value: object) -> float:
    p = check_real("noisy_cond_prob", value, min=0.0, hint="a probability in [0, 1]")
    if p > 1:
        raise ValueError(f"noisy_cond_prob={value!r} is above 1; pass a probability in [0, 1]")
    return p


def _timestep_ids(gen: torch.Generator, n: int, lo: float, hi: float) -> Tensor:
    """LeRobot's ``_sample_timestep_id`` on ``gen``: the same float32 arithmetic."""
    u = torch.rand(size=[n], generator=gen) * (hi - lo) + lo
    return (u * _T).clamp(min=0, max=_T - 1).to(torch.int64)
