"""packing: pack whole episodes into one sequence for video-action diffusion transformers.

The names a training loop uses, by concern; each folder's facade has the rest::

    packing.data        PackedCollator, Stream, PackedBatch, StreamLayout, unpack
    packing.attention   make_block_mask, document_mask_mod, causal, frame_causal,
                        sliding_window, packed_attention
    packing.planning    plan_packs, frames_to_tokens, PackedBatchSampler, BufferedPacker
    packing.datasets    LeRobotEpisodes, HFEpisodes, default_dataset_root
    packing.train       episode_timesteps, episode_noise, flow_matching_inputs,
                        broadcast_to_tokens, reduce_loss, LossNormalizer, shard_model
    packing.model       DiT, DiTConfig (the reference model)
    packing.verify      VerifyConfig, run_verify, compare_packed_unpacked, find_leaks

``import packing`` is instant: a name is imported from its folder on first use (torch, numpy
and einops then; lerobot / datasets only by the dataset adapters that need them).
"""

from typing import TYPE_CHECKING

from packing._lazy import lazy_names

if TYPE_CHECKING:  # names for type checkers and IDEs; at run time see _FOLDERS below
    from packing.attention import (
        causal,
        document_mask_mod,
        frame_causal,
        make_block_mask,
        packed_attention,
        sliding_window,
    )
    from packing.data import PackedBatch, PackedCollator, Stream, StreamLayout, unpack
    from packing.datasets import HFEpisodes, LeRobotEpisodes, default_dataset_root
    from packing.model import DiT, DiTConfig
    from packing.planning import BufferedPacker, PackedBatchSampler, frames_to_tokens, plan_packs
    from packing.train import (
        LossNormalizer,
        broadcast_to_tokens,
        episode_noise,
        episode_timesteps,
        flow_matching_inputs,
        reduce_loss,
        shard_model,
    )
    from packing.verify import VerifyConfig, compare_packed_unpacked, find_leaks, run_verify

__all__ = [
    "BufferedPacker",
    "DiT",
    "DiTConfig",
    "HFEpisodes",
    "LeRobotEpisodes",
    "LossNormalizer",
    "PackedBatch",
    "PackedBatchSampler",
    "PackedCollator",
    "Stream",
    "StreamLayout",
    "VerifyConfig",
    "broadcast_to_tokens",
    "causal",
    "compare_packed_unpacked",
    "default_dataset_root",
    "document_mask_mod",
    "episode_noise",
    "episode_timesteps",
    "find_leaks",
    "flow_matching_inputs",
    "frame_causal",
    "frames_to_tokens",
    "make_block_mask",
    "packed_attention",
    "plan_packs",
    "reduce_loss",
    "run_verify",
    "shard_model",
    "sliding_window",
    "unpack",
]
__version__ = "0.1.0"

_FOLDERS = {
    "packing.data": ("PackedBatch", "PackedCollator", "Stream", "StreamLayout", "unpack"),
    "packing.attention": (
        "causal",
        "document_mask_mod",
        "frame_causal",
        "make_block_mask",
        "packed_attention",
        "sliding_window",
    ),
    "packing.planning": ("BufferedPacker", "PackedBatchSampler", "frames_to_tokens", "plan_packs"),
    "packing.datasets": ("HFEpisodes", "LeRobotEpisodes", "default_dataset_root"),
    "packing.train": (
        "LossNormalizer",
        "broadcast_to_tokens",
        "episode_noise",
        "episode_timesteps",
        "flow_matching_inputs",
        "reduce_loss",
        "shard_model",
    ),
    "packing.model": ("DiT", "DiTConfig"),
    "packing.verify": ("VerifyConfig", "compare_packed_unpacked", "find_leaks", "run_verify"),
}
__getattr__ = lazy_names(globals(), _FOLDERS)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
