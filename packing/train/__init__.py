"""What a packed training step needs beyond the layout.

- Per-episode randomness, from (seed, step, episode) alone: `episode_seed`,
  `episode_timesteps`, `episode_noise`, `packed_noise`, `cfg_dropout_mask`,
  `flow_matching_inputs`; `broadcast_to_tokens` gathers per-episode values to tokens;
  `batch_rng_keys` reads a batch's ``(seed, step)``.
- Losses that are exact under packing, accumulation and data parallelism: `reduce_loss`
  ("token", "frame", "step", "episode"), `LossNormalizer`, `global_denominator`,
  `token_weights`.
- Sharding: `shard_model` (FSDP2 per block, activation checkpointing "full", "attention",
  "ops", "none", compile), `gathered_named_parameters`.
- Memory: `MemoryModel`, `fit_memory_model`, `probe_peak` (the token budget a GPU holds;
  ``packing budget`` prints it).
- Profiling: `StepProfiler`, `profiling`.
"""

from packing.train._budget import MemoryModel, Probe, fit_memory_model, probe_peak
from packing.train._conditioning import (
    batch_rng_keys,
    broadcast_to_tokens,
    cfg_dropout_mask,
    episode_noise,
    episode_seed,
    episode_timesteps,
    flow_matching_inputs,
    packed_noise,
    step_doc_ids,
)
from packing.train._fsdp import Checkpointing, gathered_named_parameters, shard_model
from packing.train._losses import (
    LossNormalizer,
    Reduction,
    global_denominator,
    local_denominator,
    reduce_loss,
    token_weights,
)
from packing.train._profile import StepProfiler, profiling

__all__ = [
    "Checkpointing",
    "LossNormalizer",
    "MemoryModel",
    "Probe",
    "Reduction",
    "StepProfiler",
    "batch_rng_keys",
    "broadcast_to_tokens",
    "cfg_dropout_mask",
    "episode_noise",
    "episode_seed",
    "episode_timesteps",
    "fit_memory_model",
    "flow_matching_inputs",
    "gathered_named_parameters",
    "global_denominator",
    "local_denominator",
    "packed_noise",
    "probe_peak",
    "profiling",
    "reduce_loss",
    "shard_model",
    "step_doc_ids",
    "token_weights",
]
