"""The packed layout: K episodes become one sequence, and back.

Legend (the sequence axis is first; a stream has T tokens, K documents)::

    lengths_K     [2, 4, 3]                     tokens per episode
    cu_seqlens_K1 [0, 2, 6, 9]                  episode starts, then the end
    doc_ids_T     [0,0,1,1,1,1,2,2,2,-1,-1,-1]  -1 is padding (a budget of 12)
    positions_T   [0,1,0,1,2,3,0,1,2, 0, 0, 0]  episode-local

- `Stream`, `PackedCollator`: the ``collate_fn`` (K episodes -> one `PackedBatch`).
- `PackedBatch`, `StreamLayout`: what every later step takes (mask, model, loss).
- `pack`, `unpack`: one stream's tensors in and out of the packed layout.
- `joint_layout`, `JointLayout`: several streams as one attention sequence.
"""

from packing.data._collate import PackedCollator, Stream, pack, unpack
from packing.data._joint import joint_layout
from packing.data._layout import JointLayout, PackedBatch, StreamLayout, layout_from_lengths

__all__ = [
    "JointLayout",
    "PackedBatch",
    "PackedCollator",
    "Stream",
    "StreamLayout",
    "joint_layout",
    "layout_from_lengths",
    "pack",
    "unpack",
]
