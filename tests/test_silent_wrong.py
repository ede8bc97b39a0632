"""One regression test per silently wrong result of issue 25: each failed on the code before."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from packing.attention import dense_mask, document_mask_mod, make_block_mask


def test_int64_doc_ids_are_not_narrowed_in_dense_mask():
    ids = torch.tensor([0, 0, 2**32, 2**32])
    want = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(dense_mask(ids), want)


def test_int64_doc_ids_are_not_narrowed_in_the_block_masks_mask_mod():
    ids = torch.tensor([0, 0, 2**32, 2**32, 2**32 + 1])
    # block_size 8 > T: one partial tile, so Flex evaluates the mask_mod on every pair.
    bm = make_block_mask(ids, block_size=8)
    dense = create_mask(bm.mask_mod, 1, 1, 5, 5, device="cpu")[0, 0]
    assert torch.equal(dense, dense_mask(ids))
    assert not dense[0, 2] and dense[2, 3]
    assert document_mask_mod(ids).__name__ == "document"


def test_block_size_accepts_numpy_ints():
    ids = torch.tensor([0, 0, 1, 1])
    a = make_block_mask(ids, block_size=np.int64(2)).to_dense()
    assert torch.equal(a, make_block_mask(ids, block_size=2).to_dense())
