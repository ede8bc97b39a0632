"""Several token-level streams of a pack laid out as one attention sequence.

A video-action DiT attends jointly over an episode's video and action tokens. The collate
keeps each stream in its own buffer; `joint_layout` builds the permutation that puts every
episode's tokens side by side, and back (a `JointLayout`, defined next to the `PackedBatch`
that caches it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from packing._layout_math import positions_from_lengths
from packing._validate import check_sequence
from packing.data._layout import JointLayout, PackedBatch, layout_from_lengths

__all__ = ["joint_layout"]


def joint_layout(batch: PackedBatch, streams: Sequence[str]) -> JointLayout:
    """Lay ``streams`` of ``batch`` out as one sequence; cached on the batch.

    Built from the layouts' host-side lengths, so it costs no device sync; pass
    ``PackedCollator(joint=[...])`` to build it in the DataLoader worker instead.
    """
    names = tuple(check_sequence("streams", streams, of=str))
    if len(names) < 2 or len(set(names)) != len(names):
        raise ValueError(f"joint_layout needs two or more distinct streams, got {names}")
    cache = batch.joint_layouts
    if names in cache:
        return cache[names]
    lays = [batch.layout(n) for n in names]
    k = lays[0].num_docs
    for n, lay in zip(names, lays, strict=True):
        if lay.num_docs != k:
            raise ValueError(f"stream {n!r} has {lay.num_docs} documents, expected {k}")
    device = lays[0].doc_ids_T.device
    per_doc = np.array([lay.lengths_K for lay in lays], dtype=np.int64).reshape(len(lays), k)
    doc_len = per_doc.sum(0)  # joint tokens per document
    doc_start = np.concatenate([[0], np.cumsum(doc_len)])
    real = int(doc_start[-1])
    pads = [lay.padded_len - lay.num_tokens for lay in lays]
    dest_parts: dict[str, np.ndarray] = {}
    before = np.zeros(k, dtype=np.int64)  # tokens of earlier streams inside each document
    pad_before = 0
    for s, n in enumerate(names):
        lens = per_doc[s]
        offs = doc_start[:-1] + before  # where this stream's part of each doc starts
        local = positions_from_lengths(lens.tolist())
        real_dest = np.repeat(offs, lens) + local
        pad_dest = real + pad_before + np.arange(pads[s])
        dest_parts[n] = np.concatenate([real_dest, pad_dest])
        before += lens
        pad_before += pads[s]
    total = real + sum(pads)
    src = np.empty(total, dtype=np.int64)
    sid = np.empty(total, dtype=np.int64)
    offset = 0
    for s, n in enumerate(names):
        d = dest_parts[n]
        src[d] = offset + np.arange(d.shape[0])
        sid[d] = s
        offset += d.shape[0]
    max_docs = int(lays[0].cu_seqlens_K1.shape[0]) - 1  # keeps a static max_docs static
    joint_lengths = [int(x) for x in doc_len]
    layout = layout_from_lengths(joint_lengths, joint_lengths, total, 1, None, max_docs).to(
        device, non_blocking=True
    )
    joint = JointLayout(
        streams=names,
        padded_lens=tuple(lay.padded_len for lay in lays),
        src_index_J=torch.from_numpy(src).to(device, non_blocking=True),
        dest_index={
            n: torch.from_numpy(d).to(device, non_blocking=True) for n, d in dest_parts.items()
        },
        stream_ids_J=torch.from_numpy(sid).to(device, non_blocking=True),
        layout=layout,
    )
    cache[names] = joint
    return joint
