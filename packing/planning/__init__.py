"""Which episodes go into which pack: token-budget planning and the samplers.

- `frames_to_tokens`: an episode's frames -> its tokens (what a plan is made of).
- `plan_packs` -> `PackPlan`: bin packing under a token budget (``algorithm`` "lookahead",
  "bfd", "ffd", "next_fit"; ``oversize`` "error", "split" or "drop").
- `split_windows`, `slice_piece`: a long episode cut into overlapping pieces.
- `PackedBatchSampler`: rank-balanced, exact-once, resumable distributed sampling of packs.
- `BufferedPacker`: a streaming packer for iterable datasets.
"""

from packing.planning._online import BufferedPacker
from packing.planning._pieces import slice_piece, split_windows
from packing.planning._plan import PackPlan, frames_to_tokens, plan_packs
from packing.planning._sampler import PackedBatchSampler

__all__ = [
    "BufferedPacker",
    "PackPlan",
    "PackedBatchSampler",
    "frames_to_tokens",
    "plan_packs",
    "slice_piece",
    "split_windows",
]
