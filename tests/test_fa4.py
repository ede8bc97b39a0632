"""The FA4 varlen custom op, on CPU with a stand-in for flash-attn-4's private functions.

The stand-in computes exact per-sequence attention (and its log-sum-exp) with the same call
signature as ``flash_attn.cute.interface._flash_attn_fwd/_bwd``, so these tests check the
wiring that the H200 tests cannot isolate: which tensor goes where, the backward's order of
gradients, fake shapes under ``torch.compile``, and that a compiled caller neither breaks its
graph nor recompiles for every new ``max_seqlen`` or number of documents.
"""

from __future__ import annotations

import shutil
import sys
import types

import pytest
import torch
from reference import per_episode

import packing.attention._packed as pa
from packing.attention import AttentionMask, packed_attention, prepare_attention
from packing.attention._fa4 import fa4_varlen
from packing.data import StreamLayout, layout_from_lengths

H, D = 2, 64


def _exact(q, k, v, cu_q, cu_kv, scale):  # type: ignore[no-untyped-def]
    """Per-sequence softmax attention in fp32: out (T_q, H, D) in q's dtype, lse (H, T_q).
    Rows in no sequence stay unwritten, as in FA4: NaN here, so a row the library forgets to
    zero shows up."""
    out = torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"), dtype=q.dtype)
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"))
    cq, ck = cu_q.tolist(), cu_kv.tolist()
    for a, b, c, d in zip(cq[:-1], cq[1:], ck[:-1], ck[1:], strict=True):
        if b == a:
            continue
        if d == c:
            out[a:b], lse[:, a:b] = 0, float("-inf")
            continue
        s = torch.einsum("qhd,khd->hqk", q[a:b].float(), k[c:d].float()) * scale
        lse[:, a:b] = s.logsumexp(-1)
        out[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[c:d].float()).to(q.dtype)
    return out, lse


class StandIn:
    """Records what the library passed to the two kernels."""

    def __init__(self) -> None:
        self.max_seqlens: list[int] = []
        self.deterministic: list[bool] = []

    def _flash_attn_fwd(self, q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,  # type: ignore[no-untyped-def]
                        max_seqlen_k, softmax_scale, return_lse):  # fmt: skip
        assert return_lse, "the backward needs lse"
        self.max_seqlens.append(max_seqlen_q)
        tiles = -(-max_seqlen_q // 128)  # host arithmetic on the int, as FA4 does
        out, lse = _exact(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale)
        return out * (1 + 0 * tiles), lse, None, None, None

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, softmax_scale, causal, softcap, *,  # type: ignore[no-untyped-def]
                        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, deterministic):  # fmt: skip
        assert not causal and softcap == 0.0
        self.deterministic.append(deterministic)
        # Analytic attention backward per sequence (a custom op runs below autograd).
        # Rows in no sequence stay unwritten, as in FA4 (torch.empty): NaN here, so a row the
        # library forgets to zero shows up.
        dq, dk, dv = (torch.full(t.shape, float("nan")) for t in (q, k, v))
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for a, b, c, d in zip(cq[:-1], cq[1:], ck[:-1], ck[1:], strict=True):
            dq[a:b], dk[c:d], dv[c:d] = 0, 0, 0
            if b == a or d == c:
                continue
            qf, kf, vf, do = (t.float() for t in (q[a:b], k[c:d], v[c:d], dout[a:b]))
            p = (torch.einsum("qhd,khd->hqk", qf, kf) * softmax_scale).softmax(-1)
            o = torch.einsum("hqk,khd->qhd", p, vf)
            dv[c:d] = torch.einsum("hqk,qhd->khd", p, do)
            dp = torch.einsum("qhd,khd->hqk", do, vf)
            ds = p * (dp - (do * o).sum(-1).T[:, :, None])
            dq[a:b] = torch.einsum("hqk,khd->qhd", ds, kf) * softmax_scale
            dk[c:d] = torch.einsum("hqk,qhd->khd", ds, qf) * softmax_scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@pytest.fixture
def fa4(monkeypatch: pytest.MonkeyPatch) -> StandIn:
    stand_in = StandIn()
    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd = stand_in._flash_attn_fwd  # type: ignore[attr-defined]
    interface._flash_attn_bwd = stand_in._flash_attn_bwd  # type: ignore[attr-defined]
    for name, mod in (
        ("flash_attn", types.ModuleType("flash_attn")),
        ("flash_attn.cute", types.ModuleType("flash_attn.cute")),
        ("flash_attn.cute.interface", interface),
    ):
        monkeypatch.setitem(sys.modules, name, mod)
    # prepare_attention builds FA4's varlen fields on CPU tensors
    monkeypatch.setattr(pa, "_resolve", lambda *_: ("varlen", "fa4", "test"))
    return stand_in


def _mask(q_lay: StreamLayout, kv_lay: StreamLayout | None = None) -> AttentionMask:
    return prepare_attention(q_lay, kv_lay, backend="varlen", device="cpu")


def _qkv(tq: int, tkv: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = ((tq, H, D), (tkv, H, D), (tkv, H, D))  # bf16, as FA4 takes
    return [torch.randn(s, generator=g).bfloat16().requires_grad_() for s in shapes]


@pytest.mark.parametrize("kv_budget", [0, 16, 13], ids=["self", "cross", "cross_full_keys"])
def test_fa4_varlen_equals_one_sdpa_call_per_episode_forward_and_backward(
    fa4: StandIn, kv_budget: int
) -> None:
    # cross_full_keys: no padding key to point the padding queries at, so they join the last
    # episode's sequence; the real rows must not notice.
    cross = kv_budget > 0
    q_lay = layout_from_lengths([5, 9, 3], [5, 9, 3], 20)
    kv_lay = layout_from_lengths([4, 2, 7], [4, 2, 7], kv_budget) if cross else q_lay
    q, k, v = _qkv(q_lay.padded_len, kv_lay.padded_len)
    out = packed_attention(q, k, v, _mask(q_lay, kv_lay if cross else None))
    ref = per_episode(q.float(), k.float(), v.float(), q_lay, kv_lay)
    real = q_lay.num_tokens
    # bf16 in and out (a misrouted tensor or gradient is off by O(1), not by rounding)
    torch.testing.assert_close(out[:real].float(), ref[:real], atol=1e-2, rtol=1e-2)
    assert out[real:].abs().max() == 0  # padding queries read exactly 0
    # A weight on the padding rows too: their output is a constant 0, so whatever gradient
    # reaches them must be dropped inside the op (not leak into k/v through FA4's backward).
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for name, g, r in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(g.float(), r.float(), atol=2e-2, rtol=2e-2, msg=f"d{name}")


def test_fa4_op_passes_its_own_schema_fake_and_autograd_checks(fa4: StandIn) -> None:
    lay = layout_from_lengths([5, 9, 3], [5, 9, 3], 20)
    m = _mask(lay)
    q, k, v = _qkv(20, 20)
    args = (q, k, v, m.cu_q, m.cu_kv, m.max_q, m.max_kv, D**-0.5, m.q_real, m.kv_used)
    torch.library.opcheck(fa4_varlen, args)


def test_fa4_backward_is_deterministic_when_torch_asks_for_it(fa4: StandIn) -> None:
    # FA4 accumulates dQ with atomics unless asked; find_leaks asks (through torch's switch).
    lay = layout_from_lengths([5, 9], [5, 9], 16)
    q, k, v = _qkv(16, 16)
    packed_attention(q, k, v, _mask(lay)).sum().backward()
    torch.use_deterministic_algorithms(True)
    try:
        packed_attention(q, k, v, _mask(lay)).sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)
    assert fa4.deterministic == [False, True]


def test_a_compiled_caller_never_recompiles_as_the_longest_episode_changes(
    fa4: StandIn,
) -> None:
    # On the H200, FA4's traced entry point recompiled a compiled step once per 256-token
    # bucket of the longest episode (24 times in 200 steps), wrapping it in
    # torch.compiler.disable broke the graph at every layer, and the op with the exact
    # max_seqlen still recompiled on its first change, which in the short regime came after
    # warm-up. As an op given the padded length, with a static max_docs: one graph, ever.
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, fullgraph=True)
    def step(q: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
        return (packed_attention(q * 2, q, q, mask) ** 2).sum()

    q = torch.randn(512, H, D, dtype=torch.bfloat16, requires_grad=True)
    packs = ([300, 212], [40, 400, 72], [129, 129, 129, 125], [500, 12], [257, 255], [480, 32],
             [1, 2, 3, 4, 5, 497], [100] * 5 + [12])  # fmt: skip
    for ls in packs:
        step(q, _mask(layout_from_lengths(ls, ls, 512, max_docs=6))).backward()
    assert counter.frame_count == 1, "a new longest episode or document count recompiled"
    assert fa4.max_seqlens == [512] * len(packs), "FA4 should get the padded length"
    assert len(fa4.deterministic) == len(packs)
    torch._dynamo.reset()


@pytest.mark.parametrize(
    ("mode", "fwd_kernels", "mm_recomputed"),
    [("full", 2, 1), ("attention", 1, 1), ("ops", 1, 0)],
)
def test_checkpointing_modes_recompute_what_they_say(
    fa4: StandIn, mode: str, fwd_kernels: int, mm_recomputed: int
) -> None:
    # shard_model's policies, on a block of two matmuls around the FA4 op: "full" runs the
    # attention kernel again in the backward, "attention" keeps its output and recomputes
    # the matmul that makes q, "ops" keeps that matmul too (the recompute stops early, once
    # every saved input is back: the last matmul is never re-run). Counted, not assumed: a
    # policy that missed the op (a renamed op, a new attention path) would read 2 kernels.
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint

    from packing.train._fsdp import _ops_policy

    calls: list[int] = []
    real_fwd = fa4._flash_attn_fwd

    def counted_fwd(*a, **k):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real_fwd(*a, **k)

    fa4._flash_attn_fwd = counted_fwd  # type: ignore[method-assign]
    sys.modules["flash_attn.cute.interface"]._flash_attn_fwd = counted_fwd  # type: ignore[attr-defined]

    class CountMM(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.mm = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                self.mm += 1
            return func(*args, **(kwargs or {}))

    lay = layout_from_lengths([5, 9, 3], [5, 9, 3], 20)
    mask = _mask(lay)
    w = torch.randn(H * D, H * D, dtype=torch.bfloat16, requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        q = (x @ w).unflatten(-1, (H, D))
        return packed_attention(q, q, q, mask).flatten(1) @ w

    x = torch.randn(20, H * D, dtype=torch.bfloat16, requires_grad=True)
    kw = {} if mode == "full" else {"context_fn": _ops_policy(save_matmuls=mode == "ops")}
    out = checkpoint(block, x, use_reentrant=False, **kw)
    assert len(calls) == 1
    with CountMM() as counter:
        out.float().sum().backward()
    assert len(calls) == fwd_kernels, f"{mode}: attention kernel ran {len(calls)} times"
    # the backward's own matmuls: 2 per forward matmul (grad of x and of w)
    assert counter.mm - 4 == mm_recomputed, f"{mode}: {counter.mm - 4} matmuls recomputed"


def test_torch_varlen_gets_the_longest_sequence_rounded_up_not_the_padded_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch's varlen kernel sizes its grid by max_seqlen x documents: the padded length there
    # would launch tiles for 1024 rows per document where 768 do.
    monkeypatch.setattr(pa, "_resolve", lambda *_: ("varlen", "torch", "test"))
    lay = layout_from_lengths([300, 600], [300, 600], 1024)
    m = prepare_attention(lay, backend="varlen", device="cpu")
    assert (m.max_q, m.max_kv) == (768, 768)  # 600 rounded up to 256s, not 1024
    assert m.cu_q.tolist() == [0, 300, 900, 1024]
    lay = layout_from_lengths([100, 30], [100, 30], 160)
    m = prepare_attention(lay, backend="varlen", device="cpu")
    assert (m.max_q, m.max_kv) == (160, 160)  # capped at the padded length


def test_flex_flash_keeps_a_static_kernel_for_every_shape() -> None:
    # torch 2.11 cannot compile FlexAttention's FLASH backend with dynamic shapes (a captured
    # SymInt); on the H200 the 5th shape of a process raised an InductorError.
    from packing.attention._compile import FLEX_KERNELS as flex

    before = flex.static_shapes
    flex.reset(static_shapes=1)
    try:
        static = flex.get((64, 64))
        with pytest.warns(UserWarning, match="dynamic-shape kernel"):
            assert flex.get((128, 128)) is not static  # Triton: dynamic
        assert flex.get((256, 256), always_static=True) is static
    finally:
        flex.reset(static_shapes=before)


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="Inductor on CPU needs a C++ compiler",
)
def test_inductor_compiled_attention_through_the_op_matches_eager(fa4: StandIn) -> None:
    # Inductor plans buffers from the op's fake shapes and strides; a mismatch with what the
    # kernel returns would give wrong numbers silently, not an error.
    import torch._dynamo

    torch._dynamo.reset()
    lay = layout_from_lengths([5, 9, 3], [5, 9, 3], 20)
    mask = _mask(lay)
    w = torch.randn(20, H, D, generator=torch.Generator().manual_seed(2))
    w[lay.num_tokens :] = 0

    def block(x: torch.Tensor) -> torch.Tensor:  # elementwise work on both sides of the op
        return (packed_attention(x * 0.5, x, x.sin(), mask).float() * w).sum()

    x = torch.randn(20, H, D, generator=torch.Generator().manual_seed(3)).bfloat16()
    got = []
    for fn in (block, torch.compile(block, backend="inductor", fullgraph=True)):
        leaf = x.clone().requires_grad_()
        loss = fn(leaf)
        loss.backward()
        got.append((loss.detach(), leaf.grad.float()))
    (loss_e, grad_e), (loss_c, grad_c) = got
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-2, atol=1e-2)
    # bf16: inductor rounds once where eager rounds per op; a misplaced buffer is O(1) off
    assert (grad_c - grad_e).abs().max() <= 2e-2 * grad_e.abs().max(), "compiled gradient"
    torch._dynamo.reset()
