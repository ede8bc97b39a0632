"""Attention over a packed sequence: masks built from doc boundaries, and the kernels.

- mask_mod factories that compose (inner rules see episode-local positions):
  `document_mask_mod`, `causal`, `frame_causal`, `sliding_window`, `with_block_rule`;
  `dense_mask` is the T x T reference of any of them.
- `make_block_mask(doc_ids)`: the FlexAttention `BlockMask` from doc boundaries, no T x T and
  no host sync; ``mask_mod=`` ANDs an extra rule on per-token attributes (a model's own
  mask, e.g. LingBot-VA's), sync-free when it carries a `with_tile_rule` (`TileRule`) (``compile=`` "cuda_graph" for the fastest build on a GPU;
  ``BLOCK_MASK_GRAPHS.reset()`` frees the graphs it keeps, one per shape).
- `make_pool_block_mask(q_doc_ids, kv_doc_ids)`: the same for a K/V pool, whose documents are
  in any order and with holes (a served robot's cache region), from per-tile doc counts.
- `packed_attention(q, k, v, mask)` over `prepare_attention(...)`'s `AttentionMask`:
  ``backend`` "flex", "flex_flash", "varlen" (FA4), "sdpa" or "auto";
  `resolve_backend` says which one "auto" (or a request) runs as on a device.
- `ascii_mask`, `ascii_blocks`, `save_png`: pictures of a mask (docs/img).
"""

from packing.attention._compile import BLOCK_MASK_GRAPHS
from packing.attention._masks import (
    BlockRule,
    InnerMask,
    TileRule,
    causal,
    dense_mask,
    document_mask_mod,
    frame_causal,
    make_block_mask,
    sliding_window,
    with_block_rule,
    with_tile_rule,
)
from packing.attention._packed import (
    AttentionMask,
    Backend,
    fa4_available,
    packed_attention,
    prepare_attention,
    resolve_backend,
)
from packing.attention._pool import make_pool_block_mask
from packing.attention._render import ascii_blocks, ascii_mask, save_png

__all__ = [
    "BLOCK_MASK_GRAPHS",
    "AttentionMask",
    "Backend",
    "BlockRule",
    "InnerMask",
    "TileRule",
    "ascii_blocks",
    "ascii_mask",
    "causal",
    "dense_mask",
    "document_mask_mod",
    "fa4_available",
    "frame_causal",
    "make_block_mask",
    "make_pool_block_mask",
    "packed_attention",
    "prepare_attention",
    "resolve_backend",
    "save_png",
    "sliding_window",
    "with_block_rule",
    "with_tile_rule",
]
