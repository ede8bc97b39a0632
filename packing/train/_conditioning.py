"""Per-episode conditioning that must survive packing: broadcast by doc id, and per-episode RNG.

A packed stream holds K episodes; every diffusion quantity that is *per episode* (timestep,
noise, classifier-free-guidance dropout) must stay per episode, or the packed run trains on
different inputs than the unpacked one. Three episodes of lengths ``[2, 4, 3]`` padded to 12::

    doc_ids       0  0  1  1  1  1  2  2  2 -1 -1 -1
    t_K           [0.1, 0.7, 0.4]                       one timestep per episode
    t_T           .1 .1 .7 .7 .7 .7 .4 .4 .4  0  0  0   broadcast_to_tokens(t_K, doc_ids)

Randomness is a pure function of ``(seed, step, episode_index, stream)`` -- never of the pack,
the micro-step or the rank an episode lands in -- so the packed run and the one-episode-per-
micro-step reference draw bit-identical timesteps and noise:

- ``episode_seed`` mixes the four keys with splitmix64 in Python integers (stable across
  processes, platforms and torch versions; Python's ``hash`` is salted per process, so it is
  not used).
- Timesteps and CFG dropout come straight from that integer (one uniform, or a Box-Muller
  normal, in float64 arithmetic): no torch generator, no device, microseconds per episode.
- Noise uses one ``torch.Generator`` per episode seeded with ``manual_seed``; the values
  depend on the generator's device (CPU and CUDA generators differ) and on the episode's
  shape, never on its neighbours.

Cost and where it runs: K generator seeds per pack (a few microseconds each) plus the normal
draws themselves. On the CPU (e.g. in the DataLoader worker, or on the pinned CPU batch
before ``batch.to(device)``) it never touches the GPU; on CUDA (``device="cuda"``) a
per-episode ``torch.Generator("cuda").manual_seed(s)`` is host-side state and ``randn`` is one
kernel per episode, so neither path makes a host-device sync. What *would* sync is reading
episode indices from a CUDA tensor, so these functions refuse one and ask for Python ints
(``batch.episode_ids``, which ``batch.to(device)`` keeps on the host) or a CPU tensor.

``step`` must be a counter both runs agree on -- the optimizer step or the epoch -- not the
micro-step index, which differs between the packed and the unpacked run. If a sampler can put
the same episode twice into one step, give each copy its own ``episode_index`` key (e.g.
``episode + occurrence * num_episodes``), or both copies draw the same noise.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any, Literal

import torch

from packing._validate import (
    check_doc_ids,
    check_int,
    check_int_tuple,
    check_optional_int,
    check_real,
    check_sequence,
    is_int,
)
from packing.data import PackedBatch, StreamLayout

__all__ = [
    "batch_rng_keys",
    "broadcast_to_tokens",
    "cfg_dropout_mask",
    "episode_noise",
    "episode_seed",
    "episode_timesteps",
    "flow_matching_inputs",
    "packed_noise",
    "step_doc_ids",
]

MAX_NOISE_ELEMENTS = 2**32  # one episode's noise: far above any real episode (1.4e9 values)

_M64 = (1 << 64) - 1


# -- broadcast ---------------------------------------------------------------------------------
def broadcast_to_tokens(
    values_K: torch.Tensor,
    doc_ids: torch.Tensor | StreamLayout,
    pad_value: float | int | bool = 0,
) -> torch.Tensor:
    """Gather one row per episode to every token of that episode; padding gets ``pad_value``.

    ``values_K`` is ``(K, ...)``, ``doc_ids`` the ``(T,)`` doc ids (or a ``StreamLayout``);
    the result is ``(T, ...)``::

        values_K   [[a0, a1], [b0, b1], [c0, c1]]        K = 3, e.g. adaLN shift/scale
        doc_ids    0  0  1  1  1  1  2  2  2 -1 -1 -1
        result     a  a  b  b  b  b  c  c  c  0  0  0    (rows, T = 12)

    This is how a per-episode modulation computed ONCE per episode (the conditioning MLP on K
    timesteps, not on T tokens -- running it per token cost a quarter of the step in our
    measurement) reaches the tokens. Sync-free and compile-friendly (clamp, index, where);
    the backward scatter-adds each token's gradient into its episode's row.
    """
    if not isinstance(values_K, torch.Tensor):
        raise TypeError(
            f"values_K must be a tensor (K, ...), one row per episode, got {type(values_K).__name__}"
        )
    ids = (
        doc_ids.doc_ids_T
        if isinstance(doc_ids, StreamLayout)
        else check_doc_ids("doc_ids", doc_ids)
    )
    if ids.dim() != 1:
        raise ValueError(f"doc_ids must be (T,), got shape {tuple(ids.shape)}")
    # K rows for the documents: known on the host for a layout, read for host doc ids (a
    # device tensor is not read: that would be a sync).
    need = (
        doc_ids.num_docs
        if isinstance(doc_ids, StreamLayout)
        else int(ids.max()) + 1
        if ids.device.type == "cpu" and ids.numel() and not torch.compiler.is_compiling()
        else 0
    )
    exact = isinstance(doc_ids, StreamLayout)  # host ids may leave trailing slots empty
    if values_K.shape[0] and (values_K.shape[0] < need or (exact and values_K.shape[0] != need)):
        raise ValueError(
            f"values_K has {values_K.shape[0]} rows but the doc ids name {need} documents; "
            "pass one row per episode of the pack"
        )
    if values_K.shape[0] == 0:
        # An all-padding pack (a rank that got no episode): nothing to gather from.
        return torch.full(
            (ids.shape[0], *values_K.shape[1:]),
            pad_value,
            dtype=values_K.dtype,
            device=values_K.device,
        )
    # Padding ids (-1) are clamped to a valid row so the gather never goes out of bounds,
    # then overwritten: no data-dependent shapes, no host sync.
    gathered = values_K.index_select(0, ids.clamp(min=0).long())
    real = (ids >= 0).view(-1, *([1] * (values_K.dim() - 1)))
    return torch.where(real, gathered, pad_value)


def step_doc_ids(layout: StreamLayout, num_steps: int | None = None) -> torch.Tensor:
    """Doc id of each *step* row of a stream whose data stays at step level (grid streams).

    ``batch["latents"]`` is ``(S, C, H, W)`` while its layout is at token level
    (``tokens_per_step`` tokens per step, each step's tokens contiguous). Steps ``[1, 2]`` of
    a ``grid=(1, 2)`` stream (2 tokens per step), ``num_steps=4``::

        doc_ids_T   0 0 1 1 1 1 -1 -1        tokens
        result      0   1   1   -1           steps

    Sync-free: step ``s`` of the packed data is token ``s * tokens_per_step``; rows past the
    last episode's steps are padding (-1). ``num_steps`` defaults to
    ``padded_len // tokens_per_step``; pass the data's row count when it differs.
    """
    if not isinstance(layout, StreamLayout):
        raise TypeError(f"layout must be a StreamLayout, got {type(layout).__name__}")
    check_optional_int("num_steps", num_steps, min=0, hint="rows of the step-level data")
    tps = layout.tokens_per_step
    if num_steps is None:
        if layout.padded_len % tps:
            raise ValueError(
                f"padded_len={layout.padded_len} is not a multiple of tokens_per_step={tps}; "
                "pass num_steps=<rows of the step-level data>"
            )
        num_steps = layout.padded_len // tps
    real_steps = sum(layout.steps_K)
    if real_steps > num_steps:
        raise ValueError(
            f"the layout's episodes have {real_steps} steps but num_steps={num_steps}; "
            "pass the row count of the step-level data"
        )
    ids_T = layout.doc_ids_T
    s = torch.arange(num_steps, device=ids_T.device)
    tok = (s * tps).clamp(max=max(layout.padded_len - 1, 0))
    if layout.padded_len == 0:
        return torch.full((num_steps,), -1, dtype=ids_T.dtype, device=ids_T.device)
    return torch.where(s < real_steps, ids_T[tok], -1).to(ids_T.dtype)


# -- seeds -----------------------------------------------------------------------------------
def _splitmix64(x: int) -> int:
    """One splitmix64 step (Steele, Lea, Flood 2014) in Python integers, modulo 2**64."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _stream_key(stream: str | int) -> int:
    if is_int(stream):
        return check_int("stream", stream) & _M64
    if not isinstance(stream, str):
        raise TypeError(f"stream={stream!r} must be a stream name (str) or an int salt")
    # A fixed hash, so "latents" salts the same way in every process (unlike hash(str)).
    return int.from_bytes(hashlib.blake2b(stream.encode(), digest_size=8).digest(), "little")


_KEY: dict[str, Any] = {"min": -(2**63), "max": 2**63 - 1, "hint": "an int64 key"}


def _mix64(seed: int, step: int, episode_index: int, stream: str | int) -> int:
    # Keys are ints, never int()-ed: seed 2.5 or episode 3.7 would draw another key's noise.
    # They are int64 (two's complement below): 2**64 would alias 0, so it is refused.
    h = _splitmix64(check_int("seed", seed, **_KEY) & _M64)
    h = _splitmix64(h ^ (check_int("step", step, **_KEY) & _M64))
    h = _splitmix64(h ^ (check_int("episode_index", episode_index, **_KEY) & _M64))
    return _splitmix64(h ^ _stream_key(stream))


def episode_seed(seed: int, step: int, episode_index: int, stream: str | int = "") -> int:
    """A 63-bit seed for one episode's draws, a stable mix of its four keys.

    ``splitmix64`` is chained over ``seed``, ``step``, ``episode_index`` and the ``stream``
    salt (a name such as ``"latents"``/``"action"``/``"timestep"``, or an int), so that
    neighbouring keys give unrelated seeds and the noise of "latents" is independent of the
    noise of "action" for the same episode. The top bit is dropped so the result is a
    non-negative int64, valid for ``torch.Generator.manual_seed`` and for int64 tensors.
    """
    return _mix64(seed, step, episode_index, stream) >> 1


def _indices(episode_index_K: Sequence[int] | torch.Tensor, what: str) -> list[int]:
    if isinstance(episode_index_K, torch.Tensor):
        if episode_index_K.device.type != "cpu":
            raise ValueError(
                f"{what}: episode_index_K is on {episode_index_K.device}; reading it would be a "
                "host-device sync. Pass batch.episode_ids (host ints that survive .to(device)) "
                "or a list of ints"
            )
        if episode_index_K.dtype.is_floating_point or episode_index_K.dtype == torch.bool:
            raise TypeError(
                f"{what}: episode_index_K must hold integer episode indices, got "
                f"{episode_index_K.dtype}; pass batch.episode_ids"
            )
        return [int(i) for i in episode_index_K.reshape(-1).tolist()]  # ints already
    items = check_sequence("episode_index_K", episode_index_K)
    return [check_int(f"episode_index_K[{k}]", i) for k, i in enumerate(items)]


def _uniform(h: int) -> float:
    """The top 53 bits of a 64-bit integer as a float in the open interval (0, 1).

    ``h`` must be a full 64-bit mix (``_mix64``), not a 63-bit ``episode_seed``, whose top
    bit is always 0 (it would only reach (0, 0.5)).
    """
    return ((h >> 11) + 0.5) * 2.0**-53


# -- timesteps and CFG dropout ------------------------------------------------------------------
def episode_timesteps(
    seed: int,
    step: int,
    episode_index_K: Sequence[int] | torch.Tensor,
    *,
    distribution: Literal["uniform", "logit_normal"] = "uniform",
    shift: float = 1.0,
    mean: float = 0.0,
    std: float = 1.0,
    stream: str | int = "timestep",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """One flow-matching time ``t`` in (0, 1) per episode, (K,), from the episode's keys alone.

    ``t = 0`` is data, ``t = 1`` is noise (see ``flow_matching_inputs``).

    - ``"uniform"``: ``t ~ U(0, 1)``.
    - ``"logit_normal"``: ``t = sigmoid(mean + std * z)``, ``z ~ N(0, 1)`` (SD3).
    - ``shift`` (Wan, SD3): ``t <- shift * t / (1 + (shift - 1) * t)``; ``shift > 1`` moves
      mass toward noise. ``shift = 1`` leaves ``t`` unchanged.

    Episode indices ``[7, 3, 7]`` give ``[t7, t3, t7]`` in any pack, any order. Computed in
    float64 on the host from ``episode_seed`` (no torch RNG), then cast to ``dtype`` and
    placed on ``device`` -- one small host-to-device copy, no sync.
    """
    if distribution not in ("uniform", "logit_normal"):
        raise ValueError(f"distribution={distribution!r}; choose 'uniform' or 'logit_normal'")
    check_real("shift", shift, above=0.0, hint="1.0 means no shift")
    check_real("mean", mean)
    check_real("std", std, above=0.0)
    ts: list[float] = []
    for e in _indices(episode_index_K, "episode_timesteps"):
        h = _mix64(seed, step, e, stream)
        if distribution == "uniform":
            t = _uniform(h)
        else:
            # Box-Muller from two independent uniforms of the same episode.
            u1, u2 = _uniform(h), _uniform(_splitmix64(h))
            z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
            t = 1.0 / (1.0 + math.exp(-(mean + std * z)))
        ts.append(shift * t / (1.0 + (shift - 1.0) * t))
    # non_blocking: a pageable host-to-device copy is staged, never a wait on the GPU.
    return torch.tensor(ts, dtype=torch.float64).to(dtype).to(device, non_blocking=True)


def cfg_dropout_mask(
    seed: int,
    step: int,
    episode_index_K: Sequence[int] | torch.Tensor,
    p: float,
    *,
    stream: str | int = "cfg",
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Bool (K,): True where the episode's condition is dropped (classifier-free guidance).

    Each episode is dropped with probability ``p``, decided by its own keys, so the same
    episodes lose their text in the packed and the unpacked run. Broadcast it to tokens with
    ``broadcast_to_tokens(mask_K, doc_ids, pad_value=False)`` when a per-token mask is needed.
    """
    check_real("p", p, hint="the dropout probability, in [0, 1]")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"cfg dropout p={p} must be in [0, 1]")
    drop = [
        _uniform(_mix64(seed, step, e, stream)) < p
        for e in _indices(episode_index_K, "cfg_dropout_mask")
    ]
    return torch.tensor(drop, dtype=torch.bool).to(device, non_blocking=True)


# -- noise -----------------------------------------------------------------------------------
def episode_noise(
    seed: int,
    step: int,
    episode_index: int,
    shape: Sequence[int],
    *,
    stream: str | int = "noise",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Standard normal noise of ``shape`` for one episode, from its own generator.

    A fresh ``torch.Generator(device)`` seeded with ``episode_seed(seed, step, episode_index,
    stream)`` draws float32 values that are then cast to ``dtype`` (so bf16 noise is the
    rounding of the fp32 noise, whatever the pack). Use the same ``device`` in the packed and
    the reference run: CPU and CUDA generators give different numbers for the same seed.
    """
    shape = check_int_tuple("shape", shape, min=0)
    if math.prod(shape) > MAX_NOISE_ELEMENTS:  # refused before torch tries to allocate it
        raise ValueError(
            f"shape={shape} is {math.prod(shape):,} values > {MAX_NOISE_ELEMENTS:,} (16 GiB of "
            "float32) for one episode's noise; check the shape (steps first, then one step's)"
        )
    gen = torch.Generator(device=device)
    gen.manual_seed(episode_seed(seed, step, episode_index, stream))
    x = torch.randn(shape, generator=gen, dtype=torch.float32, device=device)
    return x.to(dtype)


def _layout_steps(layout: StreamLayout) -> int:
    """Rows of a stream's step-level data, from its layout alone."""
    if layout.padded_len % layout.tokens_per_step:
        raise ValueError(
            f"padded_len={layout.padded_len} is not a multiple of tokens_per_step="
            f"{layout.tokens_per_step}; pass num_steps=<rows of the step-level data>"
        )
    return layout.padded_len // layout.tokens_per_step


def packed_noise(
    batch_or_layout: PackedBatch | StreamLayout,
    *,
    seed: int,
    step: int,
    stream: str,
    step_shape: Sequence[int] | None = None,
    episode_index_K: Sequence[int] | torch.Tensor | None = None,
    num_steps: int | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Noise for a packed stream, episode by episode, zeros on padding.

    With a ``PackedBatch`` the result has the shape, dtype and device of ``batch[stream]``
    (step level: ``(S, *step_shape)``), and episode indices come from ``batch.episode_ids``
    (host ints, kept on the host by ``batch.to(device)``). Steps ``[2, 4, 3]`` of episodes ``[7, 3, 5]``, ``S = 12``::

        rows     n7 n7 n3 n3 n3 n3 n5 n5 n5  0  0  0
        n7     = episode_noise(seed, step, 7, (2, *step_shape), stream=stream)

    so the rows of an episode are the same whichever pack, position or rank it lands in, and
    the one-episode reference draws them with ``episode_noise`` (or a pack of one). With a
    ``StreamLayout`` pass ``step_shape`` and ``episode_index_K`` (``num_steps`` defaults to
    ``padded_len // tokens_per_step``). ``stream`` both picks the layout and salts the seed,
    so "latents" and "action" noise are independent. Cost: K generator seeds + K draws.
    On a CUDA batch the generators run on the GPU; ``device=`` overrides (e.g. draw with CUDA
    generators for a CPU batch). The reference run must draw on the same kind of device.
    """
    if isinstance(batch_or_layout, PackedBatch):
        batch = batch_or_layout
        layout = batch.layout(stream)
        data = batch.streams[stream]
        step_shape = tuple(data.shape[1:]) if step_shape is None else tuple(step_shape)
        num_steps = int(data.shape[0]) if num_steps is None else num_steps
        if dtype is None:
            dtype = data.dtype if data.is_floating_point() else torch.float32
        device = data.device if device is None else device
        if episode_index_K is None:
            if batch.value_kinds.get("episode_index") == "absent" and layout.num_docs:
                raise ValueError(
                    "packed_noise: the episodes carry no 'episode_index', so the collator "
                    "numbered them by position in the pack and their noise would change with "
                    "packing; give each episode dict its dataset 'episode_index' (or pass "
                    "episode_index_K=)"
                )
            # Host ints that survive batch.to(device): reading them is never a sync.
            episode_index_K = batch.episode_ids
    else:
        layout = batch_or_layout
        if step_shape is None or episode_index_K is None:
            raise ValueError(
                "packed_noise(StreamLayout, ...) needs step_shape= and episode_index_K=; "
                "or pass the PackedBatch, which holds both"
            )
        step_shape = tuple(step_shape)
        num_steps = _layout_steps(layout) if num_steps is None else num_steps
    dtype = torch.float32 if dtype is None else dtype
    device = torch.device("cpu") if device is None else torch.device(device)
    episodes = _indices(episode_index_K, "packed_noise")
    if len(episodes) != layout.num_docs:
        raise ValueError(
            f"stream {stream!r} has {layout.num_docs} episodes but {len(episodes)} episode "
            "indices were given"
        )
    if sum(layout.steps_K) > num_steps:
        raise ValueError(
            f"stream {stream!r}: episodes have {sum(layout.steps_K)} steps > num_steps="
            f"{num_steps} rows; pass the data's row count"
        )
    out = torch.zeros((num_steps, *step_shape), dtype=dtype, device=device)
    start = 0
    for e, n in zip(episodes, layout.steps_K, strict=True):
        out[start : start + n] = episode_noise(
            seed, step, e, (n, *step_shape), stream=stream, dtype=dtype, device=device
        )
        start += n
    return out


# -- flow matching -----------------------------------------------------------------------------
def flow_matching_inputs(
    x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rectified-flow input and velocity target: ``x_t = (1 - t) x0 + t noise``,
    ``target = noise - x0`` (= d x_t / d t).

    Convention (Wan, SD3): ``t = 0`` is the data, ``t = 1`` pure noise, and the model predicts
    the velocity from data to noise. ``t`` has one value per row of ``x0`` -- ``(T,)`` per
    token (``broadcast_to_tokens(t_K, doc_ids)``) or ``(S,)`` per step for step-level data
    (``broadcast_to_tokens(t_K, step_doc_ids(layout))``) -- and is broadcast over the
    trailing dims. Padding rows (x0 = 0, noise = 0) give ``x_t = 0`` and ``target = 0``.
    """
    if x0.shape != noise.shape:
        raise ValueError(f"x0 {tuple(x0.shape)} and noise {tuple(noise.shape)} must match")
    if t.dim() != 1 or t.shape[0] != x0.shape[0]:
        raise ValueError(
            f"t must have one value per row of x0: expected ({x0.shape[0]},), got "
            f"{tuple(t.shape)}; gather per-episode t with broadcast_to_tokens"
        )
    t_ = t.to(x0.dtype).view(-1, *([1] * (x0.dim() - 1)))
    return (1 - t_) * x0 + t_ * noise, noise - x0


def batch_rng_keys(batch: PackedBatch) -> tuple[int, int]:
    """``(seed, step)`` from ``batch.extras``: every episode's noise and timestep are drawn
    from ``(seed, step, episode_index)``, so a model that draws them needs both, as ints."""
    for key in ("seed", "step"):
        if key not in batch.extras:
            raise KeyError(
                f"batch.extras[{key!r}] is missing: each episode's noise and timestep come from "
                "(seed, step, episode_index); set batch.extras['seed'] and ['step'] (the "
                "optimizer step) before calling the model"
            )
    seed = check_int("batch.extras['seed']", batch.extras["seed"])
    return seed, check_int("batch.extras['step']", batch.extras["step"])
