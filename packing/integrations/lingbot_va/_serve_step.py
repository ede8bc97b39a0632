"""One packed LingBot-VA call: several robots' tokens, each over its own KV cache region.

A call's queries are latent tokens then action tokens (Q = Qv + Qa), each a member of one
*doc* (a robot's conditional or unconditional row); its keys are the whole pool, a pool row
attended by the doc whose cache holds it when LeRobot's cache would attend it (valid, or
written by this call)::

    queries  q:  r0c r0c r0u r0u r1c | a2c a2c . .      doc_Q    0 0 1 1 2 | 3 3 -1 -1
    pool     P:  [region 0 | region 1 | region 2 | ... | scratch]           kdoc_P: 0 .. 1 .. 2 ..

Every layer runs LeRobot's own modules in ``WanTransformerBlock.forward``'s order; the self
attention first writes the call's keys and values into their slots (``wrow_Q``: LeRobot's
``update_cache`` slots, pads into scratch rows), then attends over the pool with the doc
mask; the cross attention reads each doc's text slot (its keys and values computed once per
prompt). Everything a call reads is an index tensor loaded at admission: no host sync, static
shapes, a call can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from einops import rearrange
from torch import Tensor

from packing.attention import AttentionMask, make_pool_block_mask, packed_attention
from packing.serve.protocol import FLEX_KERNEL_OPTIONS

__all__ = ["CallBuffers", "Pools", "forward_call"]


class Pools:
    """The model-owned device tensors: per layer, the self-attention keys and values of every
    region (``regions * capacity`` rows, then ``scratch`` rows for padding's writes) and the
    text slots' cross-attention keys and values (``text_slots * text_len`` rows)."""

    def __init__(self, model: Any, *, rows: int, text_slots: int, text_len: int,
                 device: torch.device, dtype: torch.dtype) -> None:  # fmt: skip
        H, D = model.num_attention_heads, model.attention_head_dim
        n = len(model.blocks)
        kw: dict[str, Any] = dict(device=device, dtype=dtype)
        self.k = [torch.zeros(rows, H, D, **kw) for _ in range(n)]
        self.v = [torch.zeros(rows, H, D, **kw) for _ in range(n)]
        X = text_slots * text_len
        self.tk = [torch.zeros(X, H, D, **kw) for _ in range(n)]
        self.tv = [torch.zeros(X, H, D, **kw) for _ in range(n)]
        self.text_len = text_len
        # each text row's slot: the cross mask's key docs (static)
        self.tkey_X = torch.arange(text_slots, device=device).repeat_interleave(text_len)

    @torch.no_grad()
    def fill_text(self, model: Any, slot: int, text_LD: Tensor) -> None:
        """A prompt's rows: LeRobot's ``text_embedder``, then each layer's ``attn2`` keys and
        values (``norm_k(to_k(.))``, ``to_v(.)``), as every call of LeRobot's recomputes."""
        dtype = next(model.parameters()).dtype
        th = model.condition_embedder.text_embedder(text_LD[None].to(dtype))
        rows = slice(slot * self.text_len, (slot + 1) * self.text_len)
        for i, block in enumerate(model.blocks):
            a = block.attn2
            self.tk[i][rows] = a.norm_k(a.to_k(th)).unflatten(2, (a.heads, -1))[0]
            self.tv[i][rows] = a.to_v(th).unflatten(2, (a.heads, -1))[0]


class CallBuffers:
    """The index tensors of one call shape (module docstring)."""

    def __init__(self, Qv: int, Qa: int, pool_rows: int, half_dim: int, dev: torch.device) -> None:
        Q = Qv + Qa
        i64: dict[str, Any] = dict(dtype=torch.int64, device=dev)
        self.Qv, self.Qa = Qv, Qa
        self.doc_Q = torch.full((Q,), -1, **i64)  # self-attention doc
        self.tdoc_Q = torch.full((Q,), -1, **i64)  # text slot
        self.wrow_Q = torch.zeros(Q, **i64)  # pool row its keys are written to
        self.kdoc_P = torch.full((pool_rows,), -1, **i64)  # the doc attending a pool row
        self.freqs_Q = torch.zeros(Q, half_dim, 2, device=dev)  # RoPE (real view of complex)

        self.masks: tuple[AttentionMask, AttentionMask] | None = None
        # the ids' host copies (the masks' tiles are counted there) and the text rows'
        self.host_ids = {n: getattr(self, n).cpu() for n in ("doc_Q", "tdoc_Q", "kdoc_P")}
        self._tkey: Tensor | None = None
        self._tkey_host = torch.zeros(0, dtype=torch.int64)

    def load(self, host: dict[str, Tensor], tkey_X: Tensor, *, backend: str,
             document_mask: bool) -> None:  # fmt: skip
        """A new composition: its index tensors, then its two masks, built once here (a
        composition's masks do not change from step to step) into the same tensors, so a
        step captured in a CUDA graph reads the new ones. The masks' tiles come from the
        host's copy of the ids (no device work, no sync)."""
        for name, src in host.items():
            dst = getattr(self, name)
            dst.copy_(src.pin_memory() if dst.device.type == "cuda" else src, non_blocking=True)
            if name in self.host_ids:
                self.host_ids[name] = src
        if self._tkey is not tkey_X:  # the pool's static text rows: read back once
            self._tkey, self._tkey_host = tkey_X, tkey_X.cpu()
        ids = self.host_ids
        new = (doc_mask(self.doc_Q, self.kdoc_P, backend=backend, document_mask=document_mask,
                        host=(ids["doc_Q"], ids["kdoc_P"])),
               doc_mask(self.tdoc_Q, tkey_X, backend=backend, document_mask=document_mask,
                        host=(ids["tdoc_Q"], self._tkey_host)))  # fmt: skip
        if self.masks is None:
            self.masks = new
            return
        for old, fresh in zip(self.masks, new, strict=True):
            for name in ("dense_TT", "keep_T"):
                _copy_into(getattr(old, name), getattr(fresh, name), name)
            if old.block_mask is not None:
                for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                             "full_kv_indices", "q_num_blocks", "q_indices",
                             "full_q_num_blocks", "full_q_indices"):  # fmt: skip
                    _copy_into(getattr(old.block_mask, name, None),
                               getattr(fresh.block_mask, name, None), name)  # fmt: skip


def _copy_into(old: Tensor | None, fresh: Tensor | None, name: str) -> None:
    """``old.copy_(fresh)``, refusing what a copy would get wrong: a tensor the old mask
    lacks (its blocks would be ignored) or one of another shape (`make_pool_block_mask`
    gives ``(1, 1, Q blocks, K blocks)`` for any composition; this guards that)."""
    if old is None and fresh is None:
        return
    if old is None or fresh is None or old.shape != fresh.shape:
        got = [None if t is None else tuple(t.shape) for t in (old, fresh)]
        raise AssertionError(f"the mask's {name} was {got[0]}, the new composition's {got[1]}")
    old.copy_(fresh)


def doc_mask(q_doc: Tensor, kv_doc: Tensor, *, backend: str, document_mask: bool,
             host: tuple[Tensor, Tensor] | None = None) -> AttentionMask:  # fmt: skip
    """Query ``q`` attends key ``k`` when ``q_doc[q] == kv_doc[k] >= 0``. Unlike the packed
    training masks, a doc's keys are not one run (a region's valid slots, with holes) and the
    docs are in no order: dense on the CPU, on CUDA FlexAttention's tiles counted per doc
    (`make_pool_block_mask`) from ``host``, the ids' host copy (default: read back).
    ``document_mask=False``: every real query attends every real key (the negative control)."""
    common: dict[str, Any] = dict(backend=backend, kernel=backend, reason="lingbot_va serve",
                                  q_len=q_doc.shape[0], kv_len=kv_doc.shape[0], inner=None,
                                  cross=True)  # fmt: skip

    # The rule reads ``q_doc`` and ``kv_doc`` themselves, never tensors derived from them:
    # `CallBuffers.load` copies a new composition into them and keeps the first mask, whose
    # rule the kernel evaluates on partial blocks (a tensor derived here would go stale).
    def same_doc(b: Any, h: Any, q: Tensor, k: Tensor) -> Tensor:
        if not document_mask:
            return (q_doc[q] >= 0) & (kv_doc[k] >= 0)
        return (q_doc[q] == kv_doc[k]) & (q_doc[q] >= 0)

    if backend == "sdpa":
        allowed = same_doc(None, None, torch.arange(q_doc.shape[0], device=q_doc.device)[:, None],
                           torch.arange(kv_doc.shape[0], device=q_doc.device)[None, :])  # fmt: skip
        has_key = allowed.any(dim=1)
        return AttentionMask(**common, dense_TT=allowed | ~has_key[:, None], keep_T=has_key)
    q_ids, kv_ids = host if host is not None else (q_doc.cpu(), kv_doc.cpu())
    if not document_mask:  # the tiles of "both real": every real id one document
        q_ids, kv_ids = (torch.where(t >= 0, 0, -1) for t in (q_ids, kv_ids))
    block = make_pool_block_mask(q_ids, kv_ids, device=q_doc.device, mask_mod=same_doc)
    return AttentionMask(
        **common, block_mask=block, kernel_options=FLEX_KERNEL_OPTIONS.get(backend)
    )


def _rotate(x: Tensor, freqs: Tensor) -> Tensor:
    """LeRobot's ``apply_rotary_emb``: in float64, times the complex64 frequencies."""
    out = torch.view_as_complex(x.to(torch.float64).reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(out * freqs).flatten(3).to(x.dtype)


def _block(block: Any, layer: int, h: Tensor, proj: Tensor, freqs: Tensor,
           cb: CallBuffers, pools: Pools, masks: tuple[Any, Any], bad_Q: Tensor) -> Tensor:  # fmt: skip
    """``WanTransformerBlock.forward`` with its attention over the pool (batch of 1)."""
    sst = block.scale_shift_table[None] + proj.float()
    shift, scale, gate, c_shift, c_scale, c_gate = (
        t.squeeze(1) for t in rearrange(sst, "b l n c -> b n l c").chunk(6, dim=1)
    )
    x = (block.norm1(h.float()) * (1.0 + scale) + shift).type_as(h)
    a = block.attn1
    q = a.norm_q(a.to_q(x)).unflatten(2, (a.heads, -1))
    k = a.norm_k(a.to_k(x)).unflatten(2, (a.heads, -1))
    v = a.to_v(x).unflatten(2, (a.heads, -1))
    q, k = _rotate(q, freqs), _rotate(k, freqs)
    # Every doc reads the whole pool, masked: a robot's NaN there would reach the others as
    # 0 * NaN. Finite keys and values are written as they are; that robot's own rows still
    # go non-finite and it fails alone (quarantine).
    bad_Q |= ~(torch.isfinite(k).flatten(2).all(-1) & torch.isfinite(v).flatten(2).all(-1))[0]
    k, v = (torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0) for t in (k, v))
    pools.k[layer].index_copy_(0, cb.wrow_Q, k[0].to(pools.k[layer].dtype))
    pools.v[layer].index_copy_(0, cb.wrow_Q, v[0].to(pools.v[layer].dtype))
    o = packed_attention(q[0], pools.k[layer], pools.v[layer], masks[0])[None]
    o = a.to_out[1](a.to_out[0](o.flatten(2, 3).type_as(q)))
    h = (h.float() + o * gate).type_as(h)
    x = block.norm2(h.float()).type_as(h)
    c = block.attn2
    q = c.norm_q(c.to_q(x)).unflatten(2, (c.heads, -1))
    o = packed_attention(q[0], pools.tk[layer], pools.tv[layer], masks[1])[None]
    h = h + c.to_out[1](c.to_out[0](o.flatten(2, 3).type_as(q)))
    x = (block.norm3(h.float()) * (1.0 + c_scale) + c_shift).type_as(h)
    return (h.float() + block.ffn(x).float() * c_gate).type_as(h)


def forward_call(
    model: Any, cb: CallBuffers, pools: Pools, tok_v: Tensor, tok_a: Tensor, t_Q: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """LeRobot's ``WanTransformer3DModel.forward`` over a pack of both streams: the velocity
    of each latent token ``(Qv, C p_t p_h p_w)`` (the input's feature order) and of each
    action token ``(Qa, action_dim)``, fp32; every query's keys written to its slot; and
    ``(Q,)`` bool: the queries whose keys or values were not finite in some layer (written
    as 0, so no other doc reads them: the caller fails their robot)."""
    dtype = next(model.parameters()).dtype
    streams = [
        (embed, cond, tok, t)
        for embed, cond, tok, t, n in (
            (model.patch_embedding_mlp, model.condition_embedder, tok_v, t_Q[None, : cb.Qv], cb.Qv),
            (
                model.action_embedder,
                model.condition_embedder_action,
                tok_a,
                t_Q[None, cb.Qv :],
                cb.Qa,
            ),
        )
        if n > 0
    ]  # a pack of one loop only (`phase_shapes`): LeRobot's embedders take no 0 rows
    h = torch.cat([embed(tok.to(dtype)) for embed, _, tok, _ in streams])[None]
    temb_proj = [cond(t, dtype=h.dtype) for _, cond, _, t in streams]
    temb = torch.cat([te for te, _ in temb_proj], 1)
    proj = torch.cat([p for _, p in temb_proj], 1).unflatten(2, (6, -1))
    freqs = torch.view_as_complex(cb.freqs_Q)[None, :, None]
    masks = cb.masks
    assert masks is not None, "load() a composition first"
    bad_Q = torch.zeros(h.shape[1], dtype=torch.bool, device=h.device)  # keys not finite
    for i, block in enumerate(model.blocks):
        h = _block(block, i, h, proj, freqs, cb, pools, masks, bad_Q)
    sst = model.scale_shift_table[None] + temb[:, :, None, ...]
    shift, scale = (t.squeeze(1) for t in rearrange(sst, "b l n c -> b n l c").chunk(2, dim=1))
    h = (model.norm_out(h.float()) * (1.0 + scale) + shift).type_as(h)
    n = math.prod(model.patch_size)  # a Python int: no tensor made (or read) in the call
    out_v = model.proj_out(h[0, : cb.Qv])  # features (n, c): LeRobot's "b l (n c)"
    out_v = out_v.unflatten(1, (n, -1)).transpose(1, 2).flatten(1)  # -> (c, n): the input's
    out_a = model.action_proj_out(h[0, cb.Qv :])
    return out_v.float(), out_a.float(), bad_Q
