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
