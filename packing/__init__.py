"""packing: pack whole episodes into one sequence for video-action diffusion transformers.

``import packing`` needs only torch, numpy and einops; the dataset adapters
(`LeRobotEpisodes`, `HFEpisodes`) load lerobot / datasets / pyarrow only when used.
"""

from typing import TYPE_CHECKING, Any

# The function `attention` stays in its module: exporting it here would shadow the module
# `packing.attention` (`import packing.attention` would then bind the function).
from packing.attention import AttentionMask, prepare_attention
from packing.collate import PackedCollator, Stream, pack, unpack
from packing.conditioning import (
    broadcast_to_tokens,
    cfg_dropout_mask,
    episode_noise,
    episode_seed,
    episode_timesteps,
    flow_matching_inputs,
    packed_noise,
    step_doc_ids,
)
from packing.fsdp import shard_model
from packing.joint import JointLayout, joint_layout
from packing.layout import PackedBatch, StreamLayout
from packing.leak import LeakReport, assert_no_leaks, find_leaks
from packing.losses import LossNormalizer, global_denominator, reduce_loss, token_weights
from packing.masks import (
    causal,
    dense_mask,
    document_mask_mod,
    frame_causal,
    make_block_mask,
    sliding_window,
    with_block_rule,
)
from packing.model import DiT, DiTConfig
from packing.online import BufferedPacker
from packing.plan import PackPlan, frames_to_tokens, plan_packs, slice_piece, split_windows
from packing.profile import StepProfiler, profiling
from packing.sampler import PackedBatchSampler
from packing.verify import VerifyConfig, compare_packed_unpacked, run_verify
from packing.verify_report import Tolerances, VerifyReport

if TYPE_CHECKING:
    from packing.default_dataset import default_dataset_root
    from packing.hf import HFEpisodes
    from packing.lerobot import LeRobotEpisodes, episode_lengths

__all__ = [
    "AttentionMask",
    "BufferedPacker",
    "DiT",
    "DiTConfig",
    "HFEpisodes",
    "JointLayout",
    "LeRobotEpisodes",
    "LeakReport",
    "LossNormalizer",
    "PackPlan",
    "PackedBatch",
    "PackedBatchSampler",
    "PackedCollator",
    "StepProfiler",
    "Stream",
    "StreamLayout",
    "Tolerances",
    "VerifyConfig",
    "VerifyReport",
    "assert_no_leaks",
    "broadcast_to_tokens",
    "causal",
    "cfg_dropout_mask",
    "compare_packed_unpacked",
    "default_dataset_root",
    "dense_mask",
    "document_mask_mod",
    "episode_lengths",
    "episode_noise",
    "episode_seed",
    "episode_timesteps",
    "find_leaks",
    "flow_matching_inputs",
    "frame_causal",
    "frames_to_tokens",
    "global_denominator",
    "joint_layout",
    "make_block_mask",
    "pack",
    "packed_noise",
    "plan_packs",
    "prepare_attention",
    "profiling",
    "reduce_loss",
    "run_verify",
    "shard_model",
    "slice_piece",
    "sliding_window",
    "split_windows",
    "step_doc_ids",
    "token_weights",
    "unpack",
    "with_block_rule",
]
__version__ = "0.1.0"

# Adapters behind one lazy boundary: their modules import lerobot / datasets / pyarrow only
# when an instance is made, but even the module import waits until the name is used.
_LAZY = {
    "LeRobotEpisodes": "packing.lerobot",
    "episode_lengths": "packing.lerobot",
    "HFEpisodes": "packing.hf",
    "default_dataset_root": "packing.default_dataset",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'packing' has no attribute {name!r}")
