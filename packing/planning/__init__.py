"""Which episodes go into which pack: token-budget planning and the samplers.

- `frames_to_tokens`: an episode's frames -> its tokens (what a plan is made of).
- `plan_packs` -> `PackPlan`: bin packing under a token budget (``algorithm`` "lookahead",
  "bfd", "ffd", "next_fit"; ``oversize`` "error", "split" or "drop").
- `split_windows`, `slice_piece`: a long episode cut into overlapping pieces.
- `PackedBatchSampler`: rank-balanced, exact-once, resumable distributed sampling of packs.
- `BufferedPacker`: a streaming packer for iterable datasets.
- `compose_steps`, `step_token_budget`, `fill_packs`: a step defined by an episode count or a
  time budget -> one static budget and packs kept >= 97% full (the step's padding tail).
"""

from packing.planning._online import BufferedPacker
from packing.planning._pieces import slice_piece, split_windows
from packing.planning._plan import PackPlan, frames_to_tokens, plan_packs
from packing.planning._sampler import PackedBatchSampler
from packing.planning._steps import compose_steps, fill_packs, pack_fill, step_token_budget

__all__ = [
    "BufferedPacker",
    "PackPlan",
    "PackedBatchSampler",
    "compose_steps",
    "fill_packs",
    "frames_to_tokens",
    "pack_fill",
    "plan_packs",
    "slice_piece",
    "split_windows",
    "step_token_budget",
]
