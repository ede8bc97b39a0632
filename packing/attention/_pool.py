"""The block mask of a K/V pool: documents in any order, each key where its slot happens to be.

`make_block_mask` wants each document as one run, in increasing order; a serving engine's
pool has neither (a robot's cache is a region with holes, regions are handed out as robots
come and go). Here a tile's documents are *counted*, and a (q tile, kv tile) pair is

* listed when some document has tokens in both tiles;
* full when both tiles hold that one document in every slot;

which is exactly what ``create_block_mask`` finds from the ``T_q x T_kv`` pairs, in
``O(T_q + T_kv + R x C x docs)`` work instead (R q tiles, C kv tiles).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from packing._layout_math import ceil_div
from packing._validate import check_device
from packing.attention._block_tables import tables_from_flags
from packing.attention._masks import MaskMod, _block_sizes, _check_tensor, _in_range

__all__ = ["make_pool_block_mask", "pool_tiles"]


def make_pool_block_mask(
    q_doc_ids: Tensor,
    kv_doc_ids: Tensor,
    block_size: int | tuple[int, int] = 128,
    *,
    device: torch.device | str | None = None,
    mask_mod: MaskMod | None = None,
) -> BlockMask:
    """FlexAttention ``BlockMask`` where query ``q`` attends key ``k`` when
    ``q_doc_ids[q] == kv_doc_ids[k] >= 0``, the ids in any order and with holes (-1).

    Two requests over a pool, ``block_size=4`` (``#`` full, ``+`` partial, ``.`` skipped)::

        q_doc    0 0 0 0 | 1 1 1 1
        kv_doc   1 1 1 1 | 0 0 -1 0 | -1 -1 -1 -1 | 0 1 1 1
                              kv tile 0  1  2  3
                         q tile 0       .  +  .  +
                         q tile 1       #  .  .  +

    The tiles are built where the ids are (ids on the host: no device work, no sync; ids on a
    GPU: host reads, for the checks and the number of documents) and the mask lives on ``device`` (the
    ids' device by default). ``mask_mod`` is the rule the kernel evaluates in partial tiles:
    by default it reads these ids (moved to ``device``); a serving loop that copies each new
    composition into static id buffers passes a rule reading those buffers instead, which
    must give the same pairs as the ids given here.
    """
    q_ids, kv_ids = _check_ids(q_doc_ids, kv_doc_ids)
    bq, bkv = _block_sizes(block_size)
    dev = q_ids.device if device is None else check_device("device", device)
    if mask_mod is not None and not callable(mask_mod):
        raise TypeError(
            f"mask_mod={mask_mod!r} is not callable; give a rule (b, h, q, kv) -> bool tensor, "
            "or None for the one these ids give"
        )
    any_RC, all_RC = pool_tiles(q_ids, kv_ids, bq, bkv)
    tables = tables_from_flags(any_RC, all_RC)
    if mask_mod is None:
        mask_mod = _pool_document(_to(q_ids, dev), _to(kv_ids, dev))
    return BlockMask(
        seq_lengths=(q_ids.shape[0], kv_ids.shape[0]),
        **{k: _to(t, dev) for k, t in tables._asdict().items()},
        BLOCK_SIZE=(bq, bkv),
        mask_mod=mask_mod,
    )


def pool_tiles(q_doc_T: Tensor, kv_doc_T: Tensor, bq: int, bkv: int) -> tuple[Tensor, Tensor]:
    """``(any_RC, all_RC)`` bool: does the tile hold a pair of one document / is every pair
    one (module docstring). Slots past the end count as no document, so a ragged last tile
    is never full, as with ``create_block_mask``."""
    docs = max(int(q_doc_T.max()) + 1, 1)  # keys of other ids meet no query
    q_RD, kv_CD = _doc_counts(q_doc_T, bq, docs), _doc_counts(kv_doc_T, bkv, docs)
    # a float matmul sums at most `docs` ones per pair: exact far past any pool's doc count
    shared = (q_RD > 0).float() @ (kv_CD > 0).float().T
    whole = (q_RD == bq).float() @ (kv_CD == bkv).float().T
    return shared > 0, whole > 0


def _doc_counts(doc_T: Tensor, block: int, docs: int) -> Tensor:
    """int64 ``(tiles, docs)``: how many tokens of each document (ids ``0 .. docs-1``) a
    tile of ``block`` tokens holds."""
    T = doc_T.shape[0]
    counted = (doc_T >= 0) & (doc_T < docs)
    tile_T = torch.arange(T, device=doc_T.device) // block
    at = tile_T * docs + torch.where(counted, doc_T.to(torch.int64), 0)
    counts = torch.zeros(ceil_div(T, block) * docs, dtype=torch.int64, device=doc_T.device)
    return counts.index_add_(0, at, counted.to(torch.int64)).view(-1, docs)


def _to(t: Tensor, dev: torch.device) -> Tensor:
    """``t`` on ``dev``; from the host to a GPU through pinned memory, without a sync (a
    plain ``.to`` from pageable memory waits for the stream: every earlier kernel)."""
    if t.device == dev or t.device.type != "cpu" or dev.type != "cuda":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


def _pool_document(q_doc: Tensor, kv_doc: Tensor) -> MaskMod:
    def pool_document(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        q, kv, inside = _in_range(q, kv, q_doc, kv_doc)
        return (q_doc[q] == kv_doc[kv]) & (q_doc[q] >= 0) & inside

    return pool_document


def _check_ids(q_doc_ids: Any, kv_doc_ids: Any) -> tuple[Tensor, Tensor]:
    """Both id tensors, checked: integer, 1-D, non-empty, on one device, each id >= -1."""
    _check_tensor(q_doc_ids, "q_doc_ids")
    _check_tensor(kv_doc_ids, "kv_doc_ids")
    if q_doc_ids.device != kv_doc_ids.device:
        raise ValueError(
            f"q_doc_ids is on {q_doc_ids.device} but kv_doc_ids on {kv_doc_ids.device}; "
            "give both on one device (the host, where a serving loop builds them, needs no sync)"
        )
    for name, ids in (("q_doc_ids", q_doc_ids), ("kv_doc_ids", kv_doc_ids)):
        low = int(ids.min())
        if low < -1:
            at = int((ids < -1).nonzero()[0])
            raise ValueError(
                f"{name}[{at}] = {int(ids[at])}; a document id is >= 0, or -1 for a slot of "
                "no document (padding, a free pool row)"
            )
    return q_doc_ids, kv_doc_ids
