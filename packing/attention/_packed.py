"""One attention call for packed batches: build the mask once per step, share it across layers.

Packed ``q``/``k``/``v`` are ``(T, H, D)`` (tokens first, "THD"; ``T_q``/``T_kv`` on the query
and key side, K documents: the legend of ``docs/index.md``). Two episodes of 3 and 2 tokens,
padded to 6, self-attention with the document mask (``#`` attends, ``.`` does not)::

    doc_ids  0 0 0 1 1 -1         k: 0 0 0 1 1 p
                               q 0   # # # . . .
                                 0   # # # . . .
                                 0   # # # . . .
                                 1   . . . # # .
                                 1   . . . # # .
                                 p   . . . . . .     a pad row attends to nothing: it reads 0

Padding is free: a pad query attends to nothing and every backend returns exactly ``0`` for
it, in self- and cross-attention (``kv_layout`` differs, e.g. video tokens -> the episode's
text tokens), so a pack's attention time does not depend on how much of its budget is empty.

Usage, once per training step, then in every layer::

    mask = prepare_attention(batch.layout(), inner=causal(), backend="auto", device="cuda")
    out_THD = packed_attention(q_THD, k_THD, v_THD, mask)   # mask.backend: what auto chose

Backends (``docs/attention.md`` has the measured speeds and CPU agreement):

============  =====================================================================  ==========
``sdpa``      dense ``(T_q, T_kv)`` bool mask from the same mask_mod, SDPA math.       any device
              The reference: exact, with backward, O(T^2) memory.
``flex``      FlexAttention with our block mask, compiled (Triton on CUDA; a static    CUDA (CPU:
              kernel for each of a process's first 4 shapes: packing/attention/_compile.py).     fwd only)
``flex_flash`` the same, ``kernel_options={"BACKEND": "FLASH"}`` (flash-attn-4 CuTe).  CUDA + FA4
``varlen``    ``cu_seqlens`` kernel: FA4 (op ``packing::fa4_varlen``) if installed,    CUDA,
              else ``torch.nn.attention.varlen.varlen_attn``. Document-only masks.     bf16/fp16
============  =====================================================================  ==========

``backend="auto"`` picks: CPU -> ``sdpa``; CUDA + document-only + FA4 + half precision ->
``varlen`` (FA4); CUDA otherwise -> ``flex_flash`` when FA4 is installed and the dtype is half
precision, else ``flex``. Impossible requests raise ``ValueError`` naming the fix; nothing falls
back silently.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from packing._layout_math import round_up
from packing._lazy import probe
from packing._validate import check_choice, check_device, check_dtype, check_optional_int
from packing.attention import _compile
from packing.attention import _masks as masks
from packing.attention._fa4 import fa4_varlen, zero_rows_from
from packing.attention._masks import InnerMask, MaskMod
from packing.data import StreamLayout

__all__ = [
    "AttentionMask",
    "Backend",
    "fa4_available",
    "packed_attention",
    "prepare_attention",
    "resolve_backend",
]


Backend = Literal["auto", "sdpa", "flex", "flex_flash", "varlen"]
_BACKENDS: tuple[str, ...] = get_args(Backend)
_HALF = (torch.float16, torch.bfloat16)
# Head dims flash-attn-4's CuTe kernels support (its interface's "Supported features"); others
# are not rejected by every entry point, and a tiny model's head dim 16 gave wrong gradients.
FA4_HEAD_DIMS = (64, 96, 128)
# Inductor lowers FlexAttention only for heads this wide or wider ("NYI: embedding dimension
# of the query, key, and value must be at least 16")
FLEX_MIN_HEAD_DIM = 16


def fa4_available() -> bool:
    """True when flash-attn-4's CuTe interface (``flash_attn.cute.interface``) imports."""
    return _fa4_import_error() is None


def _fa4_import_error() -> str | None:
    """None when FA4 imports; else why not, so `auto`'s reason can say it."""
    return probe("flash_attn.cute.interface", package="flash-attn-4")


@dataclass(frozen=True, kw_only=True)
class AttentionMask:
    """What one backend needs to run the packed attention of a step; build with
    `prepare_attention` and pass the same object to every layer.

    ``backend`` is the resolved name (never ``"auto"``), ``kernel`` the implementation
    (``"math"``, ``"triton"``, ``"flash"``, ``"fa4"``, ``"torch"``), ``reason`` why it was
    chosen. Only the fields of the chosen backend are set.

    It holds device tensors and ints that depend on the pack's padded shape only, never the
    layouts' host-side episode lengths: a compiled block (or a checkpoint inside compile, whose
    higher-order op guards on everything its inputs hold) sees the same values for every pack
    of a static budget, so it never recompiles as the composition changes.
    """

    backend: str
    kernel: str
    reason: str
    q_len: int  # padded query tokens (T_q)
    kv_len: int  # padded key tokens (T_kv)
    inner: InnerMask | None
    cross: bool
    mask_mod: Any = None  # the extra mask_mod AND-ed with the document mask (flex, sdpa)
    dense_TT: Tensor | None = None  # sdpa: bool (T_q, T_kv), rows with no key made all-True
    keep_T: Tensor | None = None  # sdpa, torch varlen: bool (T_q,), rows not forced to 0
    block_mask: Any = None  # flex: torch BlockMask
    kernel_options: dict[str, Any] | None = None  # flex
    cu_q: Tensor | None = None  # varlen: int32 (K+2,), the pad tail as one more sequence
    cu_kv: Tensor | None = None
    max_q: int = 0
    max_kv: int = 0
    q_real: Tensor | None = None  # varlen (FA4): int32 (1,), real query tokens; rows after read 0
    kv_used: Tensor | None = None  # varlen: int32 (1,), keys in a sequence; later rows' grad 0

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q_len, self.kv_len)

    def __repr__(self) -> str:
        return (
            f"AttentionMask(backend={self.backend!r}, kernel={self.kernel!r}, "
            f"shape={self.shape}, cross={self.cross}, inner={_name(self.inner)}, "
            f"mask_mod={_name(self.mask_mod)}, reason={self.reason!r})"
        )


def _name(fn: Any) -> str | None:
    return None if fn is None else getattr(fn, "__name__", repr(fn))


def _resolve_auto(
    device: torch.device, inner: InnerMask | None, dtype: torch.dtype | None, head_dim: int | None
) -> tuple[str, str, str]:
    """``auto``'s (backend, kernel, reason) on ``device``."""
    if device.type != "cuda":
        return "sdpa", "math", f"auto: {device.type} -> sdpa (the only CPU backend with backward)"
    half = dtype in _HALF
    fa4 = fa4_available()
    fa4_dim = head_dim is None or head_dim in FA4_HEAD_DIMS
    if inner is None and fa4 and half and fa4_dim:
        return "varlen", "fa4", "auto: CUDA, document-only mask, flash-attn-4 installed"
    if fa4 and half and fa4_dim:
        return "flex_flash", "flash", "auto: CUDA, inner mask, flash-attn-4 installed"
    why = (
        (_fa4_import_error() or "flash-attn-4 not available")
        if not fa4
        else f"dtype {dtype} is not bf16/fp16"
        if not half
        else f"head_dim {head_dim} is not one of flash-attn-4's {FA4_HEAD_DIMS}"
    )
    if head_dim is not None and head_dim < FLEX_MIN_HEAD_DIM:
        least = f"head_dim {head_dim} < {FLEX_MIN_HEAD_DIM} (compiled FlexAttention's least)"
        return "sdpa", "math", f"auto: CUDA, {why}, {least} -> sdpa"
    return "flex", "triton", f"auto: CUDA, {why} -> FlexAttention (Triton)"


def _resolve(
    backend: str,
    device: torch.device,
    inner: InnerMask | None,
    dtype: torch.dtype | None,
    head_dim: int | None = None,
) -> tuple[str, str, str]:
    """(backend, kernel, reason) for a request, or a ValueError that names the fix."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r}; choose one of {_BACKENDS}")
    cuda = device.type == "cuda"
    half = dtype in _HALF
    narrow = cuda and head_dim is not None and head_dim < FLEX_MIN_HEAD_DIM
    if backend == "auto":
        return _resolve_auto(device, inner, dtype, head_dim)
    if backend == "sdpa":
        return "sdpa", "math", "requested"
    if narrow and backend == "flex":
        raise ValueError(
            f"backend='flex' on CUDA needs head_dim >= {FLEX_MIN_HEAD_DIM} (Inductor lowers "
            f"FlexAttention for no narrower heads), got head_dim {head_dim}; use backend='sdpa' "
            "(or 'auto')"
        )
    if backend == "flex":
        kernel = "triton" if cuda else "eager"
        note = "" if cuda else " (CPU: forward only; use backend='sdpa' for training)"
        return "flex", kernel, "requested" + note
    if backend == "flex_flash":
        if not cuda:
            raise ValueError(
                f"backend='flex_flash' needs CUDA, got device {device}; use backend='sdpa' on CPU"
            )
        if not fa4_available():
            raise ValueError(
                "backend='flex_flash' needs flash-attn-4 (flash_attn.cute), which is not "
                "installed; install flash-attn-4 or use backend='flex' (Triton)"
            )
        if dtype is not None and not half:
            raise ValueError(
                f"backend='flex_flash' runs bf16/fp16 only, got dtype {dtype}; cast to bf16 or "
                "use backend='flex'"
            )
        return "flex_flash", "flash", "requested"
    # varlen
    if inner is not None:
        raise ValueError(
            f"backend='varlen' supports document-only masks, but inner={_name(inner)} was "
            "given; use backend='flex' (or 'auto') for an inner mask"
        )
    if not cuda:
        raise ValueError(
            f"backend='varlen' needs CUDA, got device {device}; use backend='sdpa' on CPU"
        )
    if dtype is not None and not half:
        raise ValueError(
            f"backend='varlen' runs bf16/fp16 only, got dtype {dtype}; cast to bf16 or use "
            "backend='flex'"
        )
    return "varlen", "fa4" if fa4_available() else "torch", "requested"


def resolve_backend(
    backend: Backend = "auto",
    *,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    inner: InnerMask | None = None,
) -> str:
    """The backend ``backend`` runs as on ``device``, for q/k/v of ``dtype`` and ``head_dim``
    under ``inner``: ``auto``'s choice (never ``"auto"``), or ``backend`` itself when it can
    run there. A backend that cannot (``varlen`` with an inner mask, ``flex_flash`` without
    flash-attn-4, either on the CPU) is a ValueError that names the fix.

    `prepare_attention` makes the same choice for every step (its ``AttentionMask.reason``
    says why); an engine resolves once, up front, with this::

        resolve_backend("auto", device="cpu")                       -> "sdpa"
        resolve_backend("auto", device="cuda", dtype=torch.bfloat16,
                        head_dim=128)    -> "varlen" with flash-attn-4, else "flex"
    """
    check_choice("backend", backend, _BACKENDS)
    dev = check_device("device", device)
    check_dtype("dtype", dtype, optional=True)
    check_optional_int("head_dim", head_dim, min=1)
    if inner is not None and not callable(inner):
        raise TypeError(
            f"inner must be a mask rule such as causal() or frame_causal(...), or None; got "
            f"{type(inner).__name__}"
        )
    return _resolve(backend, dev, inner, dtype, head_dim)[0]


def prepare_attention(
    layout: StreamLayout,
    kv_layout: StreamLayout | None = None,
    inner: InnerMask | None = None,
    backend: Backend = "auto",
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    mask_mod: MaskMod | None = None,
) -> AttentionMask:
    """Build the attention mask of one step for ``backend``; share it across layers.

    ``layout`` is the query side (e.g. ``batch.layout()`` or a joint layout's ``.layout``),
    ``kv_layout`` the key side for cross-attention (``None``: self-attention). ``inner`` is an
    episode-local rule from `packing.attention._masks` (``causal()``, ``frame_causal(...)``,
    ``sliding_window(...)``) AND-ed with the document mask; ``mask_mod`` an extra rule on
    global indices (per-token attributes, e.g. LingBot-VA's chunk mask), AND-ed too, with a
    ``tile_rule`` (`with_tile_rule`) for a sync-free block mask; either rules out ``varlen``
    (``auto`` then picks a Flex kernel on CUDA). ``device`` defaults to the layout's;
    ``dtype`` (of q/k/v) lets ``auto`` rule out half-precision-only kernels for fp32, and
    ``head_dim`` the flash-attn-4 kernels for head dims they do not support (64, 96, 128);
    without it, `packed_attention` refuses an unsupported head dim on those kernels at call time.

    No host-device sync: everything is built from the layouts' tensors and host-side lengths.
    """
    for name, lay in (("layout", layout), ("kv_layout", kv_layout)):
        if lay is not None and not isinstance(lay, StreamLayout):
            raise TypeError(
                f"{name} must be a StreamLayout (batch.layout(stream)), got {type(lay).__name__}"
            )
    check_optional_int("head_dim", head_dim, min=1)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype={dtype!r} must be a torch.dtype (of q/k/v) or None")
    dev = torch.device(device) if device is not None else layout.doc_ids_T.device
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    q_lay = layout.to(dev, non_blocking=True)  # a host layout: no sync
    kv_lay = q_lay if kv_layout is None else kv_layout.to(dev, non_blocking=True)
    cross = kv_layout is not None
    if cross and kv_lay.num_docs != q_lay.num_docs:
        raise ValueError(
            f"cross-attention pairs document k of the queries with document k of the keys, but "
            f"the query layout has {q_lay.num_docs} documents and the key layout "
            f"{kv_lay.num_docs}; build both layouts from the same pack"
        )
    if mask_mod is not None and not callable(mask_mod):
        raise TypeError(
            f"mask_mod must be a mask_mod(b, h, q, kv) -> bool tensor, or None; got "
            f"{type(mask_mod).__name__}"
        )
    rule_for_kernel = inner if inner is not None else mask_mod
    name, kernel, reason = _resolve(backend, dev, rule_for_kernel, dtype, head_dim)
    common: dict[str, Any] = dict(
        backend=name,
        kernel=kernel,
        reason=reason,
        q_len=q_lay.padded_len,
        kv_len=kv_lay.padded_len,
        inner=inner,
        cross=cross,
        mask_mod=mask_mod,
    )
    kv_doc = kv_lay.doc_ids_T if cross else None
    if name == "sdpa":
        dense = masks.dense_mask(q_lay.doc_ids_T, kv_doc, inner, mask_mod)
        has_key = dense.any(dim=1)
        # SDPA turns a row with no allowed key into NaN; open it to every key, then zero its
        # output in `attention` (pad queries must read 0, never NaN).
        dense = dense | ~has_key[:, None]
        return AttentionMask(**common, dense_TT=dense, keep_T=has_key)
    if name in ("flex", "flex_flash"):
        block_mask = masks.make_block_mask(q_lay.doc_ids_T, kv_doc, inner, mask_mod=mask_mod)
        options = {"BACKEND": "FLASH"} if name == "flex_flash" else None
        return AttentionMask(**common, block_mask=block_mask, kernel_options=options)
    docs = max(len(q_lay.cu_seqlens_K1), len(kv_lay.cu_seqlens_K1)) - 1
    seq = varlen_sequences(q_lay, kv_lay, docs, static=kernel == "fa4")
    keep = None if kernel == "fa4" else q_lay.doc_ids_T >= 0
    return AttentionMask(**common, keep_T=keep, **seq)


def varlen_sequences(
    q_lay: StreamLayout, kv_lay: StreamLayout, docs: int, static: bool
) -> dict[str, Any]:
    """``cu_seqlens`` for a varlen kernel in which padding costs no attention work.

    Both sides get the same number of sequences, ``docs + 1``: the K documents, ``docs - K``
    empty ones (a static ``max_docs`` on one side), and one for the padding tail.

    ``static`` (FA4, through the ``packing::fa4_varlen`` op): the tail sequence is empty on
    both sides, so the padding rows are in no sequence and cost no work at all. The op zeroes
    what FA4 leaves unwritten there (the outputs and ``dq`` from ``q_real`` on, ``dk``/``dv``
    from ``kv_used`` on). ``max_q``/``max_kv`` are the padded lengths: FA4's varlen scheduler
    on the H200 (SM90) sizes its grid from the token count, not from max_seqlen, and a constant
    keeps a compiled step from recompiling when the longest episode changes (with the exact
    length: 2 recompiles after warm-up in 10 short-regime steps on the H200). Lengths
    ``[2, 4, 3]`` padded to 12::

        q   [0, 2, 6, 9, 9]      rows 9..12 in no sequence
        kv  [0, 2, 6, 9, 9]

    Otherwise (torch's kernel, whose backward gave NaN for rows outside every sequence): the
    tail's queries attend to ONE padding key, a tail of P tokens costing P query-key pairs, not
    P^2 (a 23.5K-token tail took 2.5x the work of the 41K real tokens when it attended to
    itself); their outputs are zeroed afterwards and their gradient dropped::

        q   [0, 2, 6, 9, 12]     the tail 9..12 is one sequence of 3 queries
        kv  [0, 2, 6, 9, 10]     ... attending to the first padding key (9) alone

    Cross-attention whose key stream is full (no padding key to point at): the tail's queries
    join the last document's sequence instead (``q [0, 2, 6, 12, 12]``), which costs P x that
    document's key count, with the same zeroing. ``max_q``/``max_kv`` are the longest sequence
    rounded up to a multiple of 256 (torch's grid is ``ceil(max_seqlen / block) x docs``),
    capped at the padded length.
    """
    k = q_lay.num_docs
    nq, Tq, nk, Tk = q_lay.num_tokens, q_lay.padded_len, kv_lay.num_tokens, kv_lay.padded_len
    q_lens, kv_lens = list(q_lay.lengths_K), list(kv_lay.lengths_K)
    if static:  # the padding rows are in no sequence (the op zeroes them)
        join, q_end, kv_tail = False, nq, 0
    else:
        join = nq < Tq and nk == Tk and k > 0  # no padding key: the tail joins the last doc
        if join:
            q_lens[-1] += Tq - nq
        q_end = Tq if join else nq
        kv_tail = 1 if Tk > nk else 0
    q_stop = nq if static else Tq
    dev = q_lay.doc_ids_T.device

    def cu(lay: StreamLayout, last: int, end: int) -> Tensor:
        real = lay.cu_seqlens_K1[: k + 1].to(torch.int32)
        if last != lay.num_tokens:
            real = torch.cat([real[:k], torch.full((1,), last, dtype=torch.int32, device=dev)])
        rest = torch.full((docs - k,), last, dtype=torch.int32, device=dev)
        return torch.cat([real, rest, torch.full((1,), end, dtype=torch.int32, device=dev)])

    if static:
        max_q, max_kv = max(Tq, 1), max(Tk, 1)
    else:
        max_q = _bucket(max([*q_lens, Tq - q_end, 1]), Tq)
        max_kv = _bucket(max([*kv_lens, kv_tail, 1]), Tk)
    return dict(
        cu_q=cu(q_lay, q_end, q_stop).contiguous(),
        # A separate tensor for the keys even when equal: FA4's compiled entry point guards
        # against aliased arguments and recompiled every step when both were the same tensor.
        cu_kv=cu(kv_lay, nk, nk + kv_tail).contiguous(),
        max_q=max_q,
        max_kv=max_kv,
        q_real=torch.full((1,), nq, dtype=torch.int32, device=dev) if static else None,
        # Keys after the last sequence's are in no sequence: both kernels leave their gradient
        # unwritten (NaN seen on the H200), so it is zeroed explicitly.
        kv_used=torch.full((1,), nk + kv_tail, dtype=torch.int32, device=dev),
    )


def _bucket(longest: int, padded: int) -> int:
    return min(round_up(longest, _MAX_SEQLEN_BUCKET), max(padded, 1))


_MAX_SEQLEN_BUCKET = 256


# -- the call ----------------------------------------------------------------------------------
def packed_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float | None = None
) -> Tensor:
    """Packed attention ``(T_q, H, D), (T_kv, H, D), (T_kv, H, D) -> (T_q, H, D)``.

    ``mask`` comes from `prepare_attention` for the same layouts. Rows with no allowed key
    (cross-attention padding queries) are exactly ``0`` in every backend. ``scale`` defaults
    to ``1 / sqrt(D)``.
    """
    _check_shapes(q, k, v, mask)
    if mask.backend == "sdpa":
        return _sdpa(q, k, v, mask, scale)
    if mask.backend in ("flex", "flex_flash"):
        return _flex(q, k, v, mask, scale)
    return _varlen(q, k, v, mask, scale)


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a (T, H, D) tensor, got {type(t).__name__}")
    if not isinstance(mask, AttentionMask):
        raise TypeError(
            f"mask must be the AttentionMask prepare_attention returned, got {type(mask).__name__}"
        )
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"packed attention takes (T, H, D) tensors, got q {tuple(q.shape)}, k "
            f"{tuple(k.shape)}, v {tuple(v.shape)}; reshape (T, H * D) to (T, H, D)"
        )
    tq, tkv = mask.shape
    if q.shape[0] != tq or k.shape[0] != tkv or v.shape[0] != tkv:
        raise ValueError(
            f"the mask was built for {tq} query and {tkv} key tokens, but q has {q.shape[0]}, "
            f"k {k.shape[0]}, v {v.shape[0]}; build the mask from the layout of these tokens"
        )
    if mask.kernel in ("fa4", "flash") and q.shape[-1] not in FA4_HEAD_DIMS:
        raise ValueError(
            f"backend={mask.backend!r} runs flash-attn-4, which supports head dims "
            f"{FA4_HEAD_DIMS}, got {q.shape[-1]}; pass head_dim={q.shape[-1]} to "
            "prepare_attention so 'auto' picks FlexAttention (Triton), or use backend='flex'"
        )
    if mask.backend in ("varlen", "flex_flash") and q.dtype not in _HALF:
        raise ValueError(
            f"backend={mask.backend!r} runs bf16/fp16 only, got {q.dtype}; cast q/k/v, or "
            f"prepare the mask with dtype={q.dtype} so 'auto' picks a kernel that takes it"
        )


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float | None) -> Tensor:
    assert mask.dense_TT is not None and mask.keep_T is not None
    q_HTD, k_HTD, v_HTD = (rearrange(x, "t h d -> h t d") for x in (q, k, v))
    out_HTD = F.scaled_dot_product_attention(q_HTD, k_HTD, v_HTD, mask.dense_TT, scale=scale)
    return torch.where(mask.keep_T[:, None, None], rearrange(out_HTD, "h t d -> t h d"), 0.0)


def _flex(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float | None) -> Tensor:
    if q.device.type != "cuda":
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise ValueError(
                "backend='flex' on CPU is forward-only (FlexAttention has no CPU backward); "
                "use backend='sdpa' (or 'auto') to train on CPU, or run under torch.no_grad()"
            )
        q, k, v = q.detach(), k.detach(), v.detach()
    q_BHTD, k_BHTD, v_BHTD = (rearrange(x, "t h d -> 1 h t d") for x in (q, k, v))
    kw: dict[str, Any] = dict(
        block_mask=mask.block_mask, scale=scale, kernel_options=mask.kernel_options
    )
    if q.device.type == "cuda" and torch.compiler.is_compiling():
        # Inside the caller's compiled model: traced into its graph, which decides the
        # shapes (and no library state is read or changed while dynamo traces).
        from torch.nn.attention.flex_attention import flex_attention

        out = flex_attention(q_BHTD, k_BHTD, v_BHTD, **kw)
        return rearrange(out[0], "h t d -> t h d")  # type: ignore[index]
    if q.device.type == "cuda":
        # Compiled, one static kernel per shape for a process's first few shapes (the FLASH
        # backend always static: torch 2.11 cannot compile it with dynamic shapes, an
        # InductorError on the H200, and 2.15's template still has it as a TODO); the
        # contract is in packing/attention/_compile.py.
        fn = _compile.FLEX_KERNELS.get(
            (q.shape[0], k.shape[0]), always_static=mask.kernel == "flash"
        )
        out = _compile.call_compiled(
            fn, q_BHTD, k_BHTD, v_BHTD, graph_limit=_compile.FLEX_GRAPH_LIMIT, **kw
        )
    else:
        from torch.nn.attention.flex_attention import flex_attention

        with warnings.catch_warnings():
            # Eager flex on CPU is deliberate (a forward cross-check of the block mask); its
            # "not compiled" warning would only repeat what `mask.reason` already says.
            warnings.filterwarnings("ignore", message="flex_attention called without torch")
            out = flex_attention(q_BHTD, k_BHTD, v_BHTD, **kw)
    return rearrange(out[0], "h t d -> t h d")  # type: ignore[index]


def _varlen(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float | None) -> Tensor:
    assert mask.cu_q is not None and mask.cu_kv is not None
    if mask.kernel == "fa4":
        # A custom op (packing/attention/_fa4.py): one opaque node in a compiled caller's graph.
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        assert mask.q_real is not None and mask.kv_used is not None  # zeroed inside the op
        out = fa4_varlen(
            q, k, v, mask.cu_q, mask.cu_kv, mask.max_q, mask.max_kv, scale, mask.q_real,
            mask.kv_used,
        )[0]  # fmt: skip
    else:
        from torch.nn.attention.varlen import varlen_attn

        assert mask.kv_used is not None
        k, v = _ZeroGradFrom.apply(k, mask.kv_used), _ZeroGradFrom.apply(v, mask.kv_used)
        res = varlen_attn(q, k, v, mask.cu_q, mask.cu_kv, mask.max_q, mask.max_kv, scale=scale)
        out = res[0] if isinstance(res, tuple) else res  # (out, lse) only when asked for lse
    if mask.keep_T is not None:  # torch's kernel: padding queries read 0
        out = torch.where(mask.keep_T[:, None, None], out, 0.0)
    return out


class _ZeroGradFrom(torch.autograd.Function):
    """Identity whose backward zeroes the gradient's rows from ``start_1[0]`` on (no sync):
    keys in no varlen sequence, whose gradient torch's kernel leaves unwritten."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, start_1: Tensor) -> Tensor:
        ctx.save_for_backward(start_1)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (start_1,) = ctx.saved_tensors
        return zero_rows_from(grad.contiguous().clone(), start_1), None
