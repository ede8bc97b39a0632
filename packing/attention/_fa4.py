"""FlashAttention-4's varlen kernel as a torch custom op, so a compiled model keeps one graph.

``torch.ops.packing.fa4_varlen(q, k, v, cu_q, cu_kv, max_q, max_kv, scale, q_real) -> (out,
lse)`` runs FA4's forward (``flash_attn.cute.interface._flash_attn_fwd``); its registered
backward runs ``_flash_attn_bwd``. ``q``/``k``/``v`` are ``(T, H, D)``, ``lse`` is ``(H, T_q)``
fp32. ``kv_used`` (int32 ``(1,)``) is where the last key sequence ends: key rows after it are
in no sequence, and their gradient is 0 (FA4 would leave it unwritten). ``q_real`` (int32
``(1,)``, on the device) is the number of real query tokens: rows from
there on are padding and read exactly 0, and their incoming gradient is dropped, as if the
output had gone through ``torch.where(doc_ids >= 0, out, 0)``. The zeroing is one small kernel
that writes the padding rows only (`zero_rows_from`), not a pass over the whole output.

Why an op and not FA4's own ``flash_attn_varlen_func``: dynamo traces that entry point, whose
host-side arithmetic on ``max_seqlen`` specialises the caller's graph on the value. On the H200
a compiled training step recompiled 24 times in 200 steps of random packs (one graph per
256-token bucket of the longest episode). Wrapping the call in ``torch.compiler.disable``
instead split every transformer block into pieces at the attention call (a graph break per
layer) and still recompiled 24 times in 200 steps, on a guard on the number of documents at
the break; 663 ms a step against 645 ms as an op (seed regime). An op is one opaque node
with fake (shape-only) implementations, so the caller's graph neither breaks nor specialises
on tensor contents. Its ints still guard: `packing.attention._packed` passes the padded length as
``max_q``/``max_kv`` (FA4's varlen grid on SM90 comes from the token count), a constant under
a static budget; with the exact length the short regime recompiled twice after warm-up.

Determinism: FA4's backward accumulates dQ with atomics, so two runs can differ in the last
bit. Under ``torch.use_deterministic_algorithms(True)`` the backward asks FA4 for its
deterministic (semaphore-ordered) mode; `packing.verify._leak.find_leaks` does that, because a 1-ulp
flip in one episode's gradient after perturbing another would read as a leak.

Pinned to flash-attn-4 4.0.0b36's private functions (the public one is an autograd.Function
that dynamo traces); `packing.attention._packed` only calls this when FA4 imports.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import Tensor

__all__ = ["fa4_varlen", "zero_rows_from"]


def _interface() -> Any:
    return importlib.import_module("flash_attn.cute.interface")


def zero_rows_from(x: Tensor, start_1: Tensor) -> Tensor:
    """Zero ``x[start:]`` in place, ``start = start_1[0]`` read on the device (no sync).

    On CUDA a Triton kernel whose programs below ``start`` store nothing, so the cost is the
    padding rows' bytes, not the tensor's; elsewhere a masked fill (the tests' path).
    """
    if x.is_cuda:
        from packing.attention._triton_zero import zero_rows_from_cuda

        zero_rows_from_cuda(x, start_1)
        return x
    rows = torch.arange(x.shape[0], device=x.device).view(-1, *([1] * (x.dim() - 1)))
    return x.masked_fill_(rows >= start_1.to(x.device), 0)


@torch.library.custom_op("packing::fa4_varlen", mutates_args=())
def fa4_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Tensor,
    cu_kv: Tensor,
    max_q: int,
    max_kv: int,
    scale: float,
    q_real: Tensor,
    kv_used: Tensor,
) -> tuple[Tensor, Tensor]:
    """FA4 varlen forward: ``(T_q, H, D) x2 (T_kv, H, D) -> (out (T_q, H, Dv), lse (H, T_q))``,
    padding rows (from ``q_real[0]`` on) exactly 0."""
    res = _interface()._flash_attn_fwd(
        q,
        k,
        v,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_kv,
        max_seqlen_q=max_q,
        max_seqlen_k=max_kv,
        softmax_scale=scale,
        return_lse=True,
    )
    # lse: (H, T_q); the padding columns are in no sequence (unwritten): 0, so the op's output
    # is defined (FA4's backward reads lse only inside sequences).
    lse = res[1].contiguous()
    cols = torch.arange(lse.shape[-1], device=lse.device)
    return zero_rows_from(res[0].contiguous(), q_real), lse.masked_fill_(cols >= q_real, 0.0)


@fa4_varlen.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_kv: Tensor, max_q: int, max_kv: int,
      scale: float, q_real: Tensor, kv_used: Tensor) -> tuple[Tensor, Tensor]:  # fmt: skip
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    return out, lse


@torch.library.custom_op("packing::fa4_varlen_backward", mutates_args=())
def fa4_varlen_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_q: Tensor,
    cu_kv: Tensor,
    max_q: int,
    max_kv: int,
    scale: float,
    deterministic: bool,
    q_real: Tensor,
    kv_used: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """FA4 varlen backward: ``dq, dk, dv``; the padding rows' ``dout`` is never read (those rows
    are in no sequence), and query rows from ``q_real[0]`` on and key rows from ``kv_used[0]``
    on (in no sequence: FA4 leaves them unwritten) get 0."""
    res = _interface()._flash_attn_bwd(
        q,
        k,
        v,
        out,
        # Not zeroed: the padding rows (from q_real on) are in no sequence, and FA4's
        # backward reads dout only inside sequences (the H200 tests give those rows a
        # nonzero gradient and compare every dq/dk/dv with the per-episode reference).
        dout.contiguous(),
        lse,
        scale,
        False,  # causal
        0.0,  # softcap
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_kv,
        max_seqlen_q=max_q,
        max_seqlen_k=max_kv,
        deterministic=deterministic,
    )
    # Contiguous whatever FA4 did with an unaligned input (it copies those), so the fake
    # below states the real strides.
    dq = zero_rows_from(res[0].contiguous(), q_real)  # padding rows: in no sequence
    dk = zero_rows_from(res[1].contiguous(), kv_used)
    return dq, dk, zero_rows_from(res[2].contiguous(), kv_used)


@fa4_varlen_backward.register_fake
def _(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor,
      cu_kv: Tensor, max_q: int, max_kv: int, scale: float, deterministic: bool,
      q_real: Tensor, kv_used: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, cu_q, cu_kv, max_q, max_kv, scale, q_real, kv_used = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_q, cu_kv, q_real, kv_used)
    ctx.sizes = (max_q, max_kv, scale)


def _backward(ctx: Any, dout: Tensor, _dlse: Tensor) -> tuple[Tensor | None, ...]:
    q, k, v, out, lse, cu_q, cu_kv, q_real, kv_used = ctx.saved_tensors
    deterministic = torch.are_deterministic_algorithms_enabled()
    dq, dk, dv = fa4_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_kv, *ctx.sizes,
                                     deterministic, q_real, kv_used)  # fmt: skip
    return dq, dk, dv, None, None, None, None, None, None, None


fa4_varlen.register_autograd(_backward, setup_context=_setup_context)
