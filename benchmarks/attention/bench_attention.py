"""Packed attention: every kernel a user could pick, for the same episodes, fwd and fwd+bwd.

ms (median of CUDA-event timed calls after warm-up, compile included in warm-up) and useful
TFLOP/s, counting only in-episode (q, k) pairs that the mask keeps (fwd 4*pairs*D*H, fwd+bwd
3.5x that, the FlashAttention convention). Each output is compared with one SDPA call per
episode (the unpacked reference) before it is timed.

Methods (rows):

* ``packing.attention[auto|flex|flex_flash|varlen]``: the library call, (T, H, D) in.
* ``flex triton + create_block_mask``: the same FlexAttention kernel with torch's mask builder.
* ``FA4 varlen`` / ``torch varlen_attn``: ``cu_seqlens`` kernels called directly.
* ``SDPA per episode, own tensors`` (eager and ``torch.compile(dynamic=True)``): what a user
  without packing runs: each episode's q/k/v are tensors of their own, one SDPA call and one
  backward per episode. THE baseline of every "vs per-episode" ratio.
* ``SDPA per episode, slices of the pack``: the same calls on slices of the packed tensors
  (the reference the outputs are checked against; its backward writes a full-size gradient
  per slice, so it is slower than what a user runs and is not a baseline).
* ``SDPA padded batch``: (K, H, L_max, D) with a key-padding mask.

``--fills 0.5,0.75,1.0`` adds the fill axis: the same episodes in the regime's budget and
packed tight (budget = their tokens rounded up to 128), for every library backend; a pack's
time must not depend on how much of its budget is empty.

Masks: ``document`` (doc-only), ``frame_causal`` (32 tokens/frame), ``cross`` (video tokens
-> the episode's 64-512 text tokens). ``aligned`` rows start every episode at a multiple of
128 (pad tokens between episodes) to show what tile alignment buys.

    python benchmarks/attention/bench_attention.py --fills 0.5,0.75,1.0   # H200, ~4 min
    python benchmarks/attention/bench_attention.py --quick               # tiny, CPU, for CI
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import harness
from benchmarks.harness import pair_flops
from packing.attention import (
    document_mask_mod,
    fa4_available,
    frame_causal,
    make_block_mask,
    packed_attention,
    prepare_attention,
)
from packing.attention._compile import FLEX_KERNELS
from packing.data import StreamLayout, layout_from_lengths

TPF = 32  # tokens per latent frame


def aligned_layout(lengths: list[int], padded: int, align: int) -> StreamLayout:
    """Each episode starts at a multiple of ``align``; pad (-1) between episodes."""
    doc = torch.full((padded,), -1, dtype=torch.int32)
    pos = torch.zeros(padded, dtype=torch.int32)
    starts, s = [], 0
    for k, n in enumerate(lengths):
        starts.append(s)
        doc[s : s + n] = k
        pos[s : s + n] = torch.arange(n, dtype=torch.int32)
        s = -(-(s + n) // align) * align
    if s > padded:
        raise ValueError(f"aligned pack needs {s} tokens > {padded}")
    cu = torch.tensor([*starts, starts[-1] + lengths[-1]], dtype=torch.int32)
    return StreamLayout(
        doc_ids_T=doc,
        position_ids_T=pos,
        cu_seqlens_K1=cu,  # not contiguous runs: only the Flex/SDPA paths use this layout
        max_seqlen=max(lengths),
        lengths_K=tuple(lengths),
        steps_K=tuple(n // TPF for n in lengths),
    )


def pairs(lengths: list[int], mask: str, kv_lengths: list[int] | None = None) -> list[float]:
    """Useful (q, k) pairs per episode under ``mask``."""
    if mask == "cross":
        assert kv_lengths is not None
        return [q * k for q, k in zip(lengths, kv_lengths, strict=True)]
    if mask == "frame_causal":
        return [TPF * TPF * (n // TPF) * (n // TPF + 1) / 2 for n in lengths]
    return [n * n for n in lengths]


class Case:
    """One workload: episode lengths, layouts and tensors on the device."""

    def __init__(self, name: str, lengths: list[int], budget: int, heads: int, dim: int,
                 device: torch.device, dtype: torch.dtype, rng: torch.Generator,
                 text: bool) -> None:  # fmt: skip
        self.name, self.lengths, self.budget = name, lengths, budget
        self.heads, self.dim, self.device, self.dtype = heads, dim, device, dtype
        self.layout = layout_from_lengths(lengths, [n // TPF for n in lengths], budget, TPF)
        self.aligned = aligned_layout(lengths, budget + 128 * len(lengths), 128)
        self.text_lengths = [int(x) for x in torch.randint(64, 513, (len(lengths),), generator=rng)]
        tb = -(-sum(self.text_lengths) // 128) * 128
        self.text_layout = layout_from_lengths(self.text_lengths, self.text_lengths, tb, 1)

        def r(t: int) -> torch.Tensor:
            return torch.randn(t, heads, dim, generator=rng).to(device=device, dtype=dtype)

        self.q, self.k, self.v = r(budget), r(budget), r(budget)
        self.kt, self.vt = r(tb), r(tb)
        ta = self.aligned.padded_len
        self.qa, self.ka, self.va = r(ta), r(ta), r(ta)

    def flops(self, mask: str, backward: bool) -> float:
        kv = self.text_lengths if mask == "cross" else None
        p = pairs(self.lengths, mask, kv)
        # the hardware count (bwd = 2.5x fwd), as FlashAttention's papers report kernels
        return pair_flops(sum(p), heads=self.heads, head_dim=self.dim, backward=backward)


def _req(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(True) for t in ts]


def grads_of(fn: Callable[..., torch.Tensor], ins: list[torch.Tensor], g_out: torch.Tensor,
             mask: str) -> list[torch.Tensor]:  # fmt: skip
    """Gradients w.r.t. q and the k/v actually used (text k/v for cross-attention)."""
    q, k, v, kt, vt = _req(*ins)
    fn(q, k, v, kt, vt).backward(g_out)
    used = (q, kt, vt) if mask == "cross" else (q, k, v)
    return [t.grad.float() if t.grad is not None else torch.zeros_like(t, dtype=torch.float32)
            for t in used]  # fmt: skip


def cosine(a: torch.Tensor, b: torch.Tensor, real: int, case: Any, mask: str, i: int) -> float:
    """Cosine of two gradients over the real rows (padding rows are not compared)."""
    n = sum(case.text_lengths) if (mask == "cross" and i > 0) else real
    a, b = a[:n].flatten(), b[:n].flatten()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-30))


def run_fn(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], backward: bool
           ) -> Callable[[], None]:  # fmt: skip
    if not backward:

        def fwd() -> None:
            with torch.no_grad():
                fn(*inputs)

        return fwd
    leaves = _req(*inputs)
    grad: list[torch.Tensor] = []

    def fwd_bwd() -> None:
        # Fresh gradients each call, as q/k/v in a model (activations, not accumulating
        # leaves): no add of every row's old gradient, which grows with the padded length.
        for t in leaves:
            t.grad = None
        out = fn(*leaves)
        if not grad:
            grad.append(torch.randn_like(out))
        out.backward(grad[0])

    return fwd_bwd  # fmt: skip


# ------------------------------------------------------------------ the alternatives
def sdpa_per_episode(case: Case, mask: str) -> Callable[..., torch.Tensor]:
    cu = [0, *torch.tensor(case.lengths).cumsum(0).tolist()]
    cu_t = [0, *torch.tensor(case.text_lengths).cumsum(0).tolist()]
    dense: list[torch.Tensor | None] = []
    for n in case.lengths:
        if mask == "frame_causal":
            f = torch.arange(n, device=case.device) // TPF
            dense.append(f[:, None] >= f[None, :])
        else:
            dense.append(None)

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kt: torch.Tensor | None = None,
           vt: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        outs = []
        for i in range(len(case.lengths)):
            qs = q[cu[i] : cu[i + 1]].transpose(0, 1)[None]
            if mask == "cross":
                assert kt is not None and vt is not None
                ks = kt[cu_t[i] : cu_t[i + 1]].transpose(0, 1)[None]
                vs = vt[cu_t[i] : cu_t[i + 1]].transpose(0, 1)[None]
            else:
                ks = k[cu[i] : cu[i + 1]].transpose(0, 1)[None]
                vs = v[cu[i] : cu[i + 1]].transpose(0, 1)[None]
            outs.append(
                F.scaled_dot_product_attention(qs, ks, vs, attn_mask=dense[i])[0].transpose(0, 1)
            )
        out = torch.cat(outs)
        pad = q.shape[0] - out.shape[0]
        return torch.cat([out, out.new_zeros(pad, *out.shape[1:])]) if pad else out

    return fn


class PerEpisodeOwn:
    """One SDPA call per episode on tensors of its own, as an unpacked user has them.

    ``run(backward)`` is the timed closure: per episode, forward (and backward with that
    episode's slice of the output gradient), as in one micro-step per episode. ``outputs``
    returns the packed output and gradients for the correctness check.
    """

    def __init__(self, case: Case, mask: str, compiled: bool) -> None:
        cu = [0, *torch.tensor(case.lengths).cumsum(0).tolist()]
        cu_t = [0, *torch.tensor(case.text_lengths).cumsum(0).tolist()]
        self.real = cu[-1]
        self.pieces: list[tuple[torch.Tensor, ...]] = []
        for i in range(len(case.lengths)):
            kv = (case.kt, case.vt, cu_t) if mask == "cross" else (case.k, case.v, cu)
            q = case.q[cu[i] : cu[i + 1]]
            k, v = (t[kv[2][i] : kv[2][i + 1]] for t in kv[:2])
            # (1, H, L, D) contiguous copies: the layout an unpacked model's projections give
            self.pieces.append(tuple(t.transpose(0, 1)[None].contiguous() for t in (q, k, v)))
        self.causal_frames = mask == "frame_causal"

        def one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            m = None
            if self.causal_frames:
                f = torch.arange(q.shape[2], device=q.device) // TPF
                m = f[:, None] >= f[None, :]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

        self.one = torch.compile(one, dynamic=True) if compiled else one

    def run(self, backward: bool, g_out: torch.Tensor) -> Callable[[], None]:
        leaves = [tuple(t.detach().clone().requires_grad_(backward) for t in p)
                  for p in self.pieces]  # fmt: skip
        cu = [0, *torch.tensor([p[0].shape[2] for p in self.pieces]).cumsum(0).tolist()]
        grads = [g_out[cu[i] : cu[i + 1]].transpose(0, 1)[None].contiguous()
                 for i in range(len(self.pieces))]  # fmt: skip

        def step() -> None:
            for (q, k, v), g in zip(leaves, grads, strict=True):
                if backward:
                    q.grad = k.grad = v.grad = None  # fresh, as in run_fn
                    self.one(q, k, v).backward(g)
                else:
                    with torch.no_grad():
                        self.one(q, k, v)

        return step

    def outputs(self, g_out: torch.Tensor, mask: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        outs, gq, gk, gv = [], [], [], []
        cu = 0
        for p in self.pieces:
            q, k, v = (t.detach().clone().requires_grad_(True) for t in p)
            o = self.one(q, k, v)
            n = o.shape[2]
            # contiguous, as in `run`: a transposed view as the compiled backward's incoming
            # gradient is the suspected cause of the compiled row's cosine ~0 on the H200
            o.backward(g_out[cu : cu + n].transpose(0, 1)[None].contiguous())
            cu += n
            outs.append(o[0].transpose(0, 1).detach())
            for acc, t in ((gq, q), (gk, k), (gv, v)):
                assert t.grad is not None
                acc.append(t.grad[0].transpose(0, 1).float())
        return torch.cat(outs).float(), [torch.cat(g) for g in (gq, gk, gv)]


def sdpa_padded(case: Case, mask: str) -> Callable[..., torch.Tensor]:
    """(K, H, L_max, D) with a key-padding (and frame-causal) mask; scatter back to packed."""
    L = max(case.lengths)
    dev = case.device
    lengths = torch.tensor(case.lengths, device=dev)
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    t = torch.arange(L, device=dev)
    valid = t[None, :] < lengths[:, None]  # (K, L)
    idx = (cu[:-1, None] + t[None, :]).clamp(max=case.budget - 1)  # (K, L) token index
    tl = torch.tensor(case.text_lengths, device=dev)
    Lt = int(tl.max())
    cu_t = torch.cat([tl.new_zeros(1), tl.cumsum(0)])
    tt = torch.arange(Lt, device=dev)
    valid_t = tt[None, :] < tl[:, None]
    idx_t = (cu_t[:-1, None] + tt[None, :]).clamp(max=case.kt.shape[0] - 1)
    if mask == "cross":
        attn_mask = valid_t[:, None, None, :]
    elif mask == "frame_causal":
        f = t // TPF
        attn_mask = valid[:, None, None, :] & (f[:, None] >= f[None, :])[None, None]
    else:
        attn_mask = valid[:, None, None, :]

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kt: torch.Tensor | None = None,
           vt: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        qb = q[idx].transpose(1, 2)  # (K, H, L, D)
        if mask == "cross":
            assert kt is not None and vt is not None
            kb, vb = kt[idx_t].transpose(1, 2), vt[idx_t].transpose(1, 2)
        else:
            kb, vb = k[idx].transpose(1, 2), v[idx].transpose(1, 2)
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=attn_mask).transpose(1, 2)
        out = q.new_zeros(q.shape)
        return out.index_put((idx[valid],), ob[valid])

    return fn


def varlen_direct(case: Case, mask: str, kind: str) -> Callable[..., torch.Tensor]:
    dev = case.device
    cu_q = case.layout.cu_seqlens_K1.to(dev)
    cu_k = case.text_layout.cu_seqlens_K1.to(dev) if mask == "cross" else cu_q
    max_q = max(case.lengths)
    max_k = max(case.text_lengths) if mask == "cross" else max_q
    real = sum(case.lengths)
    real_k = sum(case.text_lengths) if mask == "cross" else real
    if kind == "fa4":
        from flash_attn.cute.interface import flash_attn_varlen_func as f4
    else:
        from torch.nn.attention.varlen import varlen_attn

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kt: torch.Tensor | None = None,
           vt: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        if mask == "cross":
            assert kt is not None and vt is not None
            k, v = kt, vt
        qs, ks, vs = q[:real], k[:real_k], v[:real_k]
        if kind == "fa4":
            res = f4(qs, ks, vs, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                     max_seqlen_k=max_k)  # fmt: skip
            out = res[0] if isinstance(res, tuple) else res
        else:
            out = varlen_attn(qs, ks, vs, cu_q, cu_k, max_q, max_k)
        pad = q.shape[0] - real
        return torch.cat([out, out.new_zeros(pad, *out.shape[1:])]) if pad else out

    return fn


_FLEX: Any = None


def flex_direct(case: Case, mask: str, builder: str, backend: str) -> Callable[..., torch.Tensor]:
    """FlexAttention called directly, (1, H, T, D) views of the THD tensors (the strides
    packing.attention uses, so both share one compiled kernel)."""
    global _FLEX
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=False)
    dev = case.device
    doc = case.layout.doc_ids_T.to(dev)
    kv_doc = case.text_layout.doc_ids_T.to(dev) if mask == "cross" else None
    inner = frame_causal(TPF) if mask == "frame_causal" else None
    if builder == "ours":
        bm = make_block_mask(doc, kv_doc, inner)
    else:
        mod = document_mask_mod(doc, kv_doc, inner)
        tk = doc.shape[0] if kv_doc is None else kv_doc.shape[0]
        bm = create_block_mask(mod, None, None, doc.shape[0], tk, device=dev, _compile=True)
    opts = {"BACKEND": "FLASH"} if backend == "flash" else None

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kt: torch.Tensor | None = None,
           vt: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        if mask == "cross":
            assert kt is not None and vt is not None
            k, v = kt, vt
        out = _FLEX(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                    block_mask=bm, kernel_options=opts)  # fmt: skip
        return out[0].transpose(0, 1)

    return fn


def library(case: Case, mask: str, backend: str, aligned: bool = False
            ) -> tuple[Callable[..., torch.Tensor], str]:  # fmt: skip
    lay = case.aligned if aligned else case.layout
    inner = frame_causal(TPF) if mask == "frame_causal" else None
    kv = case.text_layout if mask == "cross" else None
    m = prepare_attention(lay, kv, inner, backend, device=case.device, dtype=case.dtype)  # type: ignore[arg-type]

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kt: torch.Tensor | None = None,
           vt: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        if mask == "cross":
            assert kt is not None and vt is not None
            return packed_attention(q, kt, vt, m)
        return packed_attention(q, k, v, m)

    return fn, f"{m.backend}/{m.kernel}"


# ------------------------------------------------------------------ driver
def methods_for(case: Case, mask: str, quick: bool) -> list[tuple[str, Callable[[], Any]]]:
    """(label, factory) pairs valid for this mask on this device; factories build lazily so a
    missing kernel fails one row, not the run."""
    cuda = case.device.type == "cuda"
    fa4 = fa4_available()
    out: list[tuple[str, Callable[[], Any]]] = [
        ("packing.attention[auto]", lambda: library(case, mask, "auto"))
    ]
    if cuda:
        out.append(("packing.attention[flex]", lambda: library(case, mask, "flex")))
        if fa4:
            out.append(("packing.attention[flex_flash]", lambda: library(case, mask, "flex_flash")))
        if mask != "frame_causal":
            out.append(("packing.attention[varlen]", lambda: library(case, mask, "varlen")))
        if mask == "document":
            out.append(("flex triton + create_block_mask",
                        lambda: (flex_direct(case, mask, "cbm", "triton"), "flex/triton")))  # fmt: skip
            out.append(("flex triton, aligned to 128",
                        lambda: library(case, mask, "flex", aligned=True)))  # fmt: skip
            if fa4:
                out.append(("flex FLASH, aligned to 128",
                            lambda: library(case, mask, "flex_flash", aligned=True)))  # fmt: skip
        if mask != "frame_causal":
            if fa4:
                out.append(
                    ("FA4 varlen (direct)", lambda: (varlen_direct(case, mask, "fa4"), "fa4"))
                )
            out.append(("torch varlen_attn (direct)",
                        lambda: (varlen_direct(case, mask, "torch"), "torch")))  # fmt: skip
    out.append(("SDPA per episode, slices of the pack",
                lambda: (sdpa_per_episode(case, mask), "sdpa loop")))  # fmt: skip
    out.append(("SDPA padded batch", lambda: (sdpa_padded(case, mask), "sdpa padded")))
    return out


def main() -> None:
    p = harness.base_parser(__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--masks", default="document,frame_causal,cross")
    p.add_argument("--regimes", default="seed,short")
    p.add_argument("--fills", default="", help="fill axis, e.g. 0.5,0.75,1.0 (empty: none)")
    p.add_argument("--paired", type=int, default=40,
                   help="pairs for the interleaved packing-vs-FA4-direct ratio (0: off)")  # fmt: skip
    args = p.parse_args()
    # Every budget and tight length of the fill axis gets the static Flex kernel a training
    # run with one budget gets (the library's default keeps 4 per process).
    FLEX_KERNELS.reset(static_shapes=64)
    dev = torch.device(args.device)
    # One process compiles FlexAttention for 3 masks x 2 shapes x (grad on/off) x 2 backends:
    # past dynamo's default limit of 8 graphs it silently falls back to eager flex, which
    # materialises the T x T scores (the 100-200 GiB OOMs of the first H200 run).
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 4096
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rng = torch.Generator().manual_seed(args.seed)
    regimes = {
        # name: (budget, lo, hi) tokens per episode, multiples of one frame
        "seed": (65536, 4608, 10752),
        "short": (49152, 320, 2528),
    }
    if args.quick:
        regimes = {"seed": (1024, 256, 512), "short": (768, 32, 160)}
        args.heads, args.dim, args.iters = 2, 16, 2
    rows: list[dict[str, Any]] = []
    for rname in args.regimes.split(","):
        budget, lo, hi = regimes[rname]
        lengths = harness.fill_pack(rng, budget - 128, lo, hi, multiple=TPF)
        case = Case(f"{rname}: {len(lengths)} eps, {sum(lengths) / 1e3:.1f}K tok", lengths,
                    budget, args.heads, args.dim, dev, dtype, rng, text=True)  # fmt: skip
        print(f"\n## {case.name} (lengths {lengths})", flush=True)
        for mask in args.masks.split(","):
            ins = [case.q, case.k, case.v, case.kt, case.vt]
            ref_fn = sdpa_per_episode(case, mask)
            with torch.no_grad():
                ref = ref_fn(*ins).float()
            real = sum(case.lengths)
            g_out = torch.randn(ref.shape, generator=rng).to(dev, dtype)
            ref_grads = grads_of(ref_fn, ins, g_out, mask)
            built: dict[str, tuple[Callable[..., torch.Tensor], list[torch.Tensor]]] = {}
            for label, factory in methods_for(case, mask, args.quick):
                aligned = "aligned" in label
                try:
                    fn, kernel = factory()
                    if aligned:
                        # same tokens, scattered to aligned positions; compare on real tokens
                        dst = (case.aligned.doc_ids_T >= 0).nonzero().squeeze(1).to(dev)
                        call_ins = [case.qa, case.ka, case.va]
                        case.qa[dst] = case.q[:real]
                        case.ka[dst] = case.k[:real]
                        case.va[dst] = case.v[:real]
                        with torch.no_grad():
                            got = fn(*call_ins)[dst].float()
                    else:
                        call_ins = ins
                        with torch.no_grad():
                            got = fn(*call_ins).float()[:real]
                    err = float((got - ref[:real]).abs().max())
                    row: dict[str, Any] = {"regime": rname, "mask": mask, "method": label,
                                           "kernel": kernel, "max err": err}  # fmt: skip
                    if not aligned:
                        # the backward too: a kernel can be right forward and wrong backward
                        got_g = grads_of(fn, call_ins, g_out, mask)
                        # every row, padding included: a NaN in a padding row's gradient
                        # reaches every weight through the projections (seen on the H200)
                        row["finite grads"] = all(bool(torch.isfinite(g).all()) for g in got_g)
                        row["grad cosine"] = min(
                            cosine(a, b, real, case, mask, i)
                            for i, (a, b) in enumerate(zip(got_g, ref_grads, strict=True))
                        )
                    for bwd in (False, True):
                        t = harness.time_fn(run_fn(fn, call_ins, bwd), device=dev, warmup=2,
                                           iters=args.iters)  # fmt: skip
                        key = "fwd+bwd" if bwd else "fwd"
                        row[f"{key} ms"] = t.median_ms
                        row[f"{key} TFLOP/s"] = harness.tflops(case.flops(mask, bwd), t.median_ms)
                        row[f"{key} timing"] = t.as_dict()
                except Exception as e:  # a failing kernel is a row with its error, not a crash
                    row = {"regime": rname, "mask": mask, "method": label,
                           "error": f"{type(e).__name__}: {str(e)[:300]}"}  # fmt: skip
                if row.get("finite grads") is False:
                    row["error"] = "non-finite gradient (padding rows included): WRONG GRADIENT"
                elif "grad cosine" in row and not (row["grad cosine"] >= 0.99):
                    row["error"] = f"grad cosine {row['grad cosine']:.3g} < 0.99: WRONG GRADIENT"
                tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
                if "max err" in row and not (row["max err"] <= tol):
                    row["error"] = f"max err {row['max err']:.3g} > {tol}: WRONG OUTPUT"
                if "error" not in row and not aligned:
                    built[label] = (fn, call_ins)  # checked right: may be paired below
                row.update(tokens=real, episodes=len(case.lengths), budget=case.budget,
                           heads=args.heads, dim=args.dim)  # fmt: skip
                rows.append(row)
                print({k: v for k, v in row.items() if "timing" not in k}, flush=True)
            rows += own_tensor_rows(case, mask, ref, ref_grads, g_out, rname, args.iters)
            rows += paired_rows(built, rname, mask, dev, args.paired)
            harness.write_json("attention", args, {"rows": rows, "fa4": fa4_available()},
                              device=dev, partial=True)  # fmt: skip
    if args.fills:
        fills = [float(f) for f in args.fills.split(",")]
        for rname in args.regimes.split(","):
            rows += fill_rows(regimes[rname], rname, fills, args, dev, dtype, rng)
            harness.write_json("attention", args, {"rows": rows, "fa4": fa4_available()},
                              device=dev, partial=True)  # fmt: skip
    summarize(rows)
    cols = ["regime", "mask", "method", "kernel", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms",
            "fwd+bwd TFLOP/s", "vs per-episode", "max err", "grad cosine"]  # fmt: skip
    print()
    print(harness.markdown_table([r for r in rows if "fill" not in r and "paired" not in r], cols))
    if any("paired" in r for r in rows):
        print()
        print(harness.markdown_table([r for r in rows if "paired" in r],
                                    ["regime", "mask", "method", "a ms", "b ms", "a vs b",
                                     "p10-p90"]))  # fmt: skip
    fill_cols = ["regime", "mask", "backend", "kernel", "fill", "episodes", "budget",
                 "budget ms", "tight budget", "tight ms", "vs tight", "error"]  # fmt: skip
    if any("fill" in r for r in rows):
        print()
        print(harness.markdown_table([r for r in rows if "fill" in r], fill_cols))
    harness.write_json("attention", args, {"rows": rows, "fa4": fa4_available(),
                                          "flops_convention": "fwd 4*pairs*D*H; bwd 2.5x fwd"},
                      device=dev)  # fmt: skip
    if not fa4_available():
        print("\nNOTE: flash-attn-4 is not installed: FA4 varlen and Flex FLASH rows are absent.")


def summarize(rows: list[dict[str, Any]]) -> None:
    """Ratios inside each (regime, mask), fwd+bwd: vs the faster of the per-episode SDPA loops
    on the episodes' own tensors (eager or compiled), what an unpacked user runs."""
    for r in rows:
        if "fill" in r:
            continue
        base = [b["fwd+bwd ms"] for b in rows if b["regime"] == r["regime"]
                and b["mask"] == r["mask"] and "fill" not in b and "fwd+bwd ms" in b
                and str(b["method"]).startswith("SDPA per episode, own tensors")]  # fmt: skip
        if base and "fwd+bwd ms" in r and not math.isnan(r["fwd+bwd ms"]):
            r["vs per-episode"] = min(base) / r["fwd+bwd ms"]


def own_tensor_rows(case: Case, mask: str, ref: torch.Tensor, ref_grads: list[torch.Tensor],
                    g_out: torch.Tensor, rname: str, iters: int) -> list[dict[str, Any]]:  # fmt: skip
    """The unpacked user's loop, eager and compiled, checked against the reference first."""
    out = []
    real = sum(case.lengths)
    for compiled in (False, True):
        label = "SDPA per episode, own tensors" + (", compiled" if compiled else "")
        row: dict[str, Any] = {"regime": rname, "mask": mask, "method": label,
                               "kernel": "sdpa" + (" compiled" if compiled else "")}  # fmt: skip
        try:
            pe = PerEpisodeOwn(case, mask, compiled)
            got, got_g = pe.outputs(g_out, mask)
            row["max err"] = float((got - ref[:real]).abs().max())
            row["grad cosine"] = min(cosine(a, b, real, case, mask, i)
                                     for i, (a, b) in enumerate(zip(got_g, ref_grads, strict=True)))  # fmt: skip
            for bwd in (False, True):
                t = harness.time_fn(pe.run(bwd, g_out), device=case.device, warmup=2, iters=iters)
                key = "fwd+bwd" if bwd else "fwd"
                row[f"{key} ms"] = t.median_ms
                row[f"{key} TFLOP/s"] = harness.tflops(case.flops(mask, bwd), t.median_ms)
                row[f"{key} timing"] = t.as_dict()
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row.update(tokens=real, episodes=len(case.lengths), budget=case.budget)
        print({k: v for k, v in row.items() if "timing" not in k}, flush=True)
        out.append(row)
    return out


def paired_rows(built: dict[str, tuple[Callable[..., torch.Tensor], list[torch.Tensor]]],
                rname: str, mask: str, dev: torch.device, pairs: int) -> list[dict[str, Any]]:  # fmt: skip
    """The library against FA4 called directly, fwd+bwd, calls interleaved (`time_paired`):
    a gap of a few percent is below the drift between two blocks of timed calls."""
    out: list[dict[str, Any]] = []
    b_label = "FA4 varlen (direct)"
    for a_label in ("packing.attention[auto]", "packing.attention[varlen]"):
        if pairs <= 0 or a_label not in built or b_label not in built:
            continue
        (fa, ia), (fb, ib) = built[a_label], built[b_label]
        res = harness.time_paired(run_fn(fa, ia, True), run_fn(fb, ib, True), device=dev,
                                 iters=pairs)  # fmt: skip
        row = {"regime": rname, "mask": mask, "method": f"{a_label} vs {b_label}, paired",
               "paired": res, "a ms": res["a median ms"], "b ms": res["b median ms"],
               "a vs b": res["ratio b/a median"],
               "p10-p90": f"{res['ratio p10']:.3f}-{res['ratio p90']:.3f}"}  # fmt: skip
        print(row, flush=True)
        out.append(row)
    return out


def fill_rows(regime: tuple[int, int, int], rname: str, fills: list[float], args: Any,
              dev: torch.device, dtype: torch.dtype, rng: torch.Generator
              ) -> list[dict[str, Any]]:  # fmt: skip
    """The same episodes in the regime's budget and packed tight, fwd+bwd, every backend.

    ``fill`` is the share of the budget the episodes take; "vs tight" is the tight pack's
    time over the budgeted one's (1.0 = padding is free; goal >= 0.95 from 50% to 100%)."""
    budget, lo, hi = regime
    out: list[dict[str, Any]] = []
    backends = ["auto", "flex"] + (["flex_flash"] if fa4_available() else [])
    if dev.type != "cuda":
        backends = ["auto"]
    for fill in fills:
        lengths = harness.fill_pack(rng, int(budget * fill) - (128 if fill >= 1 else 0), lo, hi,
                                   multiple=TPF)  # fmt: skip
        tight = -(-sum(lengths) // 128) * 128
        for mask in ("document", "frame_causal"):
            inner = frame_causal(TPF) if mask == "frame_causal" else None
            for backend in backends:
                row: dict[str, Any] = {"regime": rname, "mask": mask, "fill": round(
                    sum(lengths) / budget, 3), "backend": backend, "budget": budget,
                    "tight budget": tight, "episodes": len(lengths)}  # fmt: skip
                try:
                    for key, b in (("budget", budget), ("tight", tight)):
                        lay = layout_from_lengths(lengths, [n // TPF for n in lengths], b, TPF)
                        m = prepare_attention(lay, None, inner, backend, device=dev, dtype=dtype)  # type: ignore[arg-type]
                        q, k, v = (torch.randn(b, args.heads, args.dim, generator=rng)
                                   .to(dev, dtype) for _ in range(3))  # fmt: skip
                        fn = lambda q, k, v, m=m: packed_attention(q, k, v, m)  # noqa: E731
                        t = harness.time_fn(run_fn(fn, [q, k, v], True), device=dev, warmup=2,
                                           iters=args.iters)  # fmt: skip
                        row[f"{key} ms"] = t.median_ms
                        row["kernel"] = f"{m.backend}/{m.kernel}"
                    row["vs tight"] = row["tight ms"] / row["budget ms"]
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(row, flush=True)
                out.append(row)
    return out


if __name__ == "__main__":
    main()
