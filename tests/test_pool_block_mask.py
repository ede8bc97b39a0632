"""`make_pool_block_mask`: the block mask of a K/V pool (documents in any order, with holes)
is the one ``create_block_mask`` finds from every pair, and attends as the rule by hand."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from packing.attention import ascii_blocks, make_pool_block_mask

TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")  # fmt: skip


def _pool(g: torch.Generator, n: int, docs: int) -> torch.Tensor:
    """Pool rows: runs of one document or of holes, in no order (a region's slots)."""
    out = []
    while sum(map(len, out)) < n:
        run = int(torch.randint(1, 40, (1,), generator=g))
        out.append(torch.full((run,), int(torch.randint(-1, docs, (1,), generator=g))))
    return torch.cat(out)[:n]


def _listed(bm: Any, num: str, idx: str) -> list[list[int]]:
    """Each tile row's listed tiles, as a set (the order past the count is the kernel's own)."""
    n, i = getattr(bm, num)[0, 0], getattr(bm, idx)[0, 0]
    return [sorted(i[r, : n[r]].tolist()) for r in range(n.shape[0])]


def _by_pairs(q: torch.Tensor, kv: torch.Tensor, block: tuple[int, int]) -> Any:
    def same_doc(b: Any, h: Any, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return (q[i] == kv[j]) & (q[i] >= 0)

    return create_block_mask(same_doc, None, None, q.shape[0], kv.shape[0], device="cpu",
                             BLOCK_SIZE=block)  # fmt: skip


@pytest.mark.parametrize("seed", range(12))
def test_tiles_are_create_block_masks_from_every_pair(seed: int) -> None:
    """Queries of a few documents (any order, with padding), keys a pool of runs with holes
    and ids no query has; ragged ends; square and oblong tiles; int64 and int32 ids: the
    eight tables list the same tiles as torch's own classification of every (q, k) pair."""
    g = torch.Generator().manual_seed(seed)
    docs = int(torch.randint(1, 6, (1,), generator=g))
    Tq, Tk = (int(torch.randint(1, m, (1,), generator=g)) for m in (200, 600))
    block = [(16, 16), (32, 32), (16, 64), (64, 16)][seed % 4]
    q = _pool(g, Tq, docs)
    kv = _pool(g, Tk, docs + 2)  # ids docs, docs + 1: keys no query attends
    ids = (q.int(), kv.int()) if seed % 3 == 0 else (q, kv)  # PackedCollator's ids are int32
    got, want = make_pool_block_mask(*ids, block), _by_pairs(q, kv, block)
    for num, idx in zip(TABLES[::2], TABLES[1::2], strict=True):
        assert _listed(got, num, idx) == _listed(want, num, idx), (num, q.tolist(), kv.tolist())
    assert got.shape == want.shape and got.BLOCK_SIZE == want.BLOCK_SIZE


def test_a_pool_where_every_tile_kind_occurs_lists_them_all() -> None:
    """The guard against a vacuous comparison: the random pools above hold full tiles,
    partial ones and skipped ones (counted over the same seeds)."""
    kinds = torch.zeros(3, dtype=torch.int64)
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        docs = int(torch.randint(1, 6, (1,), generator=g))
        Tq, Tk = (int(torch.randint(1, m, (1,), generator=g)) for m in (200, 600))
        block = [(16, 16), (32, 32), (16, 64), (64, 16)][seed % 4]
        bm = make_pool_block_mask(_pool(g, Tq, docs), _pool(g, Tk, docs + 2), block)
        pics = ascii_blocks(bm)
        kinds += torch.tensor([pics.count(c) for c in "#+."])
    assert (kinds > 0).all(), kinds


def test_the_docstrings_picture() -> None:
    q = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    kv = torch.tensor([1, 1, 1, 1, 0, 0, -1, 0, -1, -1, -1, -1, 0, 1, 1, 1])
    assert ascii_blocks(make_pool_block_mask(q, kv, 4)) == ". + . +\n# . . +"
    assert make_pool_block_mask.__doc__ is not None
    assert "q tile 0       .  +  .  +" in make_pool_block_mask.__doc__


def test_flex_attention_over_it_is_the_rule_by_hand() -> None:
    """FlexAttention (eager, CPU) with the pool mask: each query's softmax runs over its own
    document's keys alone, wherever the pool holds them; a query of no document gives 0."""
    g = torch.Generator().manual_seed(0)
    q_doc, kv_doc = _pool(g, 96, 3), _pool(g, 320, 4)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (96, 320, 320))
    out = flex_attention(q, k, v, block_mask=make_pool_block_mask(q_doc, kv_doc, 32))
    allowed = (q_doc[:, None] == kv_doc[None, :]) & (q_doc[:, None] >= 0)
    s = (q @ k.transpose(-1, -2)) / 4.0
    want = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0) @ v
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
    assert allowed.any(1).sum() < 96  # some queries have no key: the 0 rows are checked too


def test_a_rule_reading_other_buffers_is_the_kernels_and_the_tiles_stay_these_ids() -> None:
    """``mask_mod=`` (a serving loop's rule over its static buffers) is what partial tiles
    evaluate; the tiles come from the ids given."""
    q, kv = torch.tensor([0, 0, 1, 1]), torch.tensor([1, 1, 0, 0])
    buf_q, buf_kv = q.clone(), kv.clone()

    def rule(b: Any, h: Any, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return buf_q[i] == buf_kv[j]

    bm = make_pool_block_mask(q, kv, 2, mask_mod=rule)
    assert bm.mask_mod is rule
    assert ascii_blocks(bm) == ". #\n# ."


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((torch.tensor([0.0]), torch.tensor([0])), {}, TypeError, r"q_doc_ids must be an integer"),
        ((torch.tensor([0]), torch.tensor([[0]])), {}, ValueError, r"kv_doc_ids must be 1-D"),
        ((torch.tensor([0]), torch.tensor([], dtype=torch.int64)), {}, ValueError,
         r"kv_doc_ids is empty"),
        ((torch.tensor([0, -3]), torch.tensor([0])), {}, ValueError,
         r"q_doc_ids\[1\] = -3; a document id is >= 0, or -1"),
        ((torch.tensor([0]), torch.tensor([0, 0, -2])), {}, ValueError, r"kv_doc_ids\[2\] = -2"),
        ((torch.tensor([0]), torch.tensor([0])), {"block_size": 0}, ValueError, r"block_size=0"),
        ((torch.tensor([0]), torch.tensor([0])), {"device": "gpu0"}, ValueError,
         r"device='gpu0' is not a device"),
        ((torch.tensor([0]), torch.tensor([0])), {"mask_mod": "same"}, TypeError,
         r"mask_mod='same' is not callable"),
    ],
)  # fmt: skip
def test_bad_ids_and_options_name_the_argument(args: Any, kwargs: Any, error: Any,
                                                match: str) -> None:  # fmt: skip
    with pytest.raises(error, match=match):
        make_pool_block_mask(*args, **kwargs)
