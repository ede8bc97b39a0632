"""packing: pack whole episodes into one sequence for video-action diffusion transformers.

``import packing`` is instant: every name below is imported from its module on first use
(torch, numpy and einops then; lerobot / datasets / pyarrow only by the dataset adapters).
Each name has one home, the module listed for it in ``_MODULES``.
"""

from typing import TYPE_CHECKING

from packing._lazy import lazy_names

if TYPE_CHECKING:  # names for type checkers and IDEs; at run time see _MODULES below
    from packing.attention import AttentionMask, packed_attention, prepare_attention
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
    from packing.default_dataset import default_dataset_root
    from packing.fsdp import shard_model
    from packing.hf import HFEpisodes
    from packing.joint import JointLayout, joint_layout
    from packing.layout import PackedBatch, StreamLayout
    from packing.leak import LeakReport, assert_no_leaks, find_leaks
    from packing.lerobot import LeRobotEpisodes, episode_lengths
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
    from packing.pieces import slice_piece, split_windows
    from packing.plan import PackPlan, frames_to_tokens, plan_packs
    from packing.profile import StepProfiler, profiling
    from packing.sampler import PackedBatchSampler
    from packing.verify import compare_packed_unpacked
    from packing.verify_cli import VerifyConfig, run_verify
    from packing.verify_report import Tolerances, VerifyReport

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
    "packed_attention",
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

# Every name is imported on first use (PEP 562), so `packing --help` and `import packing` do
# not pay for torch (seconds of CPU on a busy machine). The dataset adapters import lerobot /
# datasets / pyarrow only when an instance is made.
_MODULES = {
    "packing.attention": ("AttentionMask", "packed_attention", "prepare_attention"),
    "packing.collate": ("PackedCollator", "Stream", "pack", "unpack"),
    "packing.conditioning": (
        "broadcast_to_tokens",
        "cfg_dropout_mask",
        "episode_noise",
        "episode_seed",
        "episode_timesteps",
        "flow_matching_inputs",
        "packed_noise",
        "step_doc_ids",
    ),
    "packing.default_dataset": ("default_dataset_root",),
    "packing.fsdp": ("shard_model",),
    "packing.hf": ("HFEpisodes",),
    "packing.joint": ("JointLayout", "joint_layout"),
    "packing.layout": ("PackedBatch", "StreamLayout"),
    "packing.leak": ("LeakReport", "assert_no_leaks", "find_leaks"),
    "packing.lerobot": ("LeRobotEpisodes", "episode_lengths"),
    "packing.losses": ("LossNormalizer", "global_denominator", "reduce_loss", "token_weights"),
    "packing.masks": (
        "causal",
        "dense_mask",
        "document_mask_mod",
        "frame_causal",
        "make_block_mask",
        "sliding_window",
        "with_block_rule",
    ),
    "packing.model": ("DiT", "DiTConfig"),
    "packing.online": ("BufferedPacker",),
    "packing.pieces": ("slice_piece", "split_windows"),
    "packing.plan": ("PackPlan", "frames_to_tokens", "plan_packs"),
    "packing.profile": ("StepProfiler", "profiling"),
    "packing.sampler": ("PackedBatchSampler",),
    "packing.verify": ("compare_packed_unpacked",),
    "packing.verify_cli": ("VerifyConfig", "run_verify"),
    "packing.verify_report": ("Tolerances", "VerifyReport"),
}
__getattr__ = lazy_names(globals(), _MODULES)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
