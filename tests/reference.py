"""Slow, obvious references shared by the CPU and GPU attention tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from packing.layout import StreamLayout
from packing.masks import InnerMask


def per_episode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_lay: StreamLayout,
    kv_lay: StreamLayout,
    inner: InnerMask | None = None,
) -> torch.Tensor:
    """One SDPA call per episode on its own rows, in q's dtype and device; padding rows 0."""
    dev = q.device
    out = torch.zeros_like(q)
    cq, ck = q_lay.cu_seqlens_K1.tolist(), kv_lay.cu_seqlens_K1.tolist()
    for d in range(q_lay.num_docs):
        lq, lk = cq[d + 1] - cq[d], ck[d + 1] - ck[d]
        m = None
        if inner is not None:
            z = torch.zeros((), dtype=torch.int64, device=dev)
            ar_q, ar_k = torch.arange(lq, device=dev), torch.arange(lk, device=dev)
            m = inner(z, z, ar_q[:, None], ar_k[None, :]).expand(lq, lk)
        o = F.scaled_dot_product_attention(
            q[cq[d] : cq[d + 1]].transpose(0, 1),
            k[ck[d] : ck[d + 1]].transpose(0, 1),
            v[ck[d] : ck[d + 1]].transpose(0, 1),
            m,
        )
        out = out.index_copy(0, torch.arange(cq[d], cq[d + 1], device=dev), o.transpose(0, 1))
    return out


def layout_from_lengths(
    lengths: list[int],
    steps: list[int],
    padded: int,
    tokens_per_step: int = 1,
    grid: tuple[int, int] | None = None,
    max_docs: int | None = None,
) -> StreamLayout:
    """The layout token by token, in Python: what `packing.layout.layout_from_lengths` must
    reproduce exactly (values, dtypes and shapes)."""
    doc, pos, thw = [-1] * padded, [0] * padded, [[0, 0, 0] for _ in range(padded)]
    t = 0
    for d, n in enumerate(lengths):
        for p in range(n):
            doc[t], pos[t] = d, p
            if grid is not None:
                h, w = grid
                thw[t] = [p // (h * w), (p % (h * w)) // w, p % w]
            t += 1
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    cu += [cu[-1]] * (max(len(lengths), max_docs or 0) - len(lengths))
    return StreamLayout(
        doc_ids_T=torch.tensor(doc, dtype=torch.int32),
        position_ids_T=torch.tensor(pos, dtype=torch.int32),
        cu_seqlens_K1=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=max(lengths, default=0),
        lengths_K=tuple(lengths),
        steps_K=tuple(steps),
        tokens_per_step=tokens_per_step,
        grid=grid,
        thw_T3=None if grid is None else torch.tensor(thw, dtype=torch.int32).reshape(padded, 3),
    )
