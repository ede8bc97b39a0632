"""The attention a careful user gets for a baseline, chosen by measurement on its own shapes.

A baseline that forces one kernel can be slower than what a user without `packing` runs: the
last runs forced SDPA's FLASH backend, 1.88x slower than SDPA's default dispatch on a 7K-token
episode (7.71 vs 4.10 ms fwd+bwd). So every unpacked baseline probes its candidates on the
shapes it will run, fwd+bwd, and uses the fastest one whose output matches SDPA's default;
all probe timings go into the JSON.

    probe = choose("self", [(1, 24, 7040, 128), ...], UNMASKED, device="cuda")
    probe["chosen"]          # "sdpa" (default dispatch) or "sdpa_cudnn", "flex", "fa4", ...
    probe["ms"]["sdpa"]      # {"1x24x7040x128": 4.10, ...}: the median per probed shape

Candidates take ``(B, H, L, D)`` q, k, v and a mask (None, or what the masked ones need):

    UNMASKED  sdpa (default dispatch), sdpa_flash, sdpa_cudnn, sdpa_efficient, flex, fa4
    MASKED    sdpa (default dispatch with the key-padding mask), sdpa_efficient, sdpa_cudnn,
              flex (a key-padding block mask)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

Attention = Callable[[Tensor, Tensor, Tensor, Any], Tensor]


def _sdpa_with(*backends: Any) -> Attention:
    def attend(q: Tensor, k: Tensor, v: Tensor, mask: Any = None) -> Tensor:
        from torch.nn.attention import sdpa_kernel

        if not backends or q.device.type != "cuda":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        with sdpa_kernel(list(backends)):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return attend


def _backend(name: str) -> Any:
    from torch.nn.attention import SDPBackend

    return getattr(SDPBackend, name)


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Any = None) -> Tensor:
    """SDPA's default dispatch: what a user who forces nothing gets."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def flex(q: Tensor, k: Tensor, v: Tensor, mask: Any = None) -> Tensor:
    """FlexAttention, compiled (its fast path); ``mask`` a BlockMask or None. Inside a
    compiled caller (the baselines' compiled block) dynamo compiles the call itself."""
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():
        return flex_attention(q, k, v, block_mask=mask)
    return _compiled_flex()(q, k, v, block_mask=mask)


_FLEX: Any = None


def _compiled_flex() -> Any:
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def fa4(q: Tensor, k: Tensor, v: Tensor, mask: Any = None) -> Tensor:
    """flash-attn-4 through packing's custom op (`packing.attention._fa4`: one opaque node in a
    compiled caller, where FA4's own autograd.Function would be traced and break): the B rows
    of ``(B, H, L, D)`` as B sequences of one varlen call, no mask."""
    from packing.attention._fa4 import fa4_varlen

    b, h, lq, d = q.shape
    lk = k.shape[2]
    cu_q = torch.arange(b + 1, device=q.device, dtype=torch.int32) * lq
    cu_k = torch.arange(b + 1, device=q.device, dtype=torch.int32) * lk

    def flat(x: Tensor) -> Tensor:
        return x.transpose(1, 2).reshape(-1, h, x.shape[-1])

    out = fa4_varlen(flat(q), flat(k), flat(v), cu_q, cu_k, lq, lk, d**-0.5,
                     cu_q[-1:].clone(), cu_k[-1:].clone())[0]  # fmt: skip
    return out.view(b, lq, h, -1).transpose(1, 2)


@functools.cache
def _unmasked() -> dict[str, Attention]:
    return {
        "sdpa": sdpa,
        "sdpa_flash": _sdpa_with(_backend("FLASH_ATTENTION")),
        "sdpa_cudnn": _sdpa_with(_backend("CUDNN_ATTENTION")),
        "sdpa_efficient": _sdpa_with(_backend("EFFICIENT_ATTENTION")),
        "flex": flex,
        "fa4": fa4,
    }


@functools.cache
def _masked() -> dict[str, Attention]:
    return {
        "sdpa": sdpa,
        "sdpa_efficient": _sdpa_with(_backend("EFFICIENT_ATTENTION")),
        "sdpa_cudnn": _sdpa_with(_backend("CUDNN_ATTENTION")),
        "flex": flex,
    }


def unmasked() -> dict[str, Attention]:
    """The candidates without a mask, by name (a copy; the functions are the same objects on
    every call, so a compiled caller's guards on them hold across variants)."""
    return dict(_unmasked())


def masked() -> dict[str, Attention]:
    """The candidates that take a key-padding mask, by name (a copy, as `unmasked`)."""
    return dict(_masked())


def shape_key(shape: Sequence[int]) -> str:
    return "x".join(str(int(s)) for s in shape)


def _time_ms(fn: Callable[[], Any], dev: torch.device, iters: int) -> float:
    """Median ms of ``iters`` calls (the first call, which compiled, ran before)."""
    from benchmarks.harness.timing import time_fn

    return time_fn(fn, device=dev, warmup=0, iters=iters).median_ms


def choose(
    role: str,
    shapes: Sequence[tuple[int, int, int, int, int]],
    candidates: dict[str, Attention],
    *,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    make_mask: Callable[[tuple[int, ...], str], Any] | None = None,
    iters: int = 5,
    tol: float = 5e-2,
) -> dict[str, Any]:
    """Time every candidate, fwd+bwd, on each ``(B, H, Lq, Lk, D)`` shape; keep those whose
    output matches SDPA's default dispatch (max abs error ``tol``, bf16); choose the fastest by
    the summed medians. ``make_mask(shape, name)`` builds a candidate's mask for a shape (None:
    no mask). A candidate that raises is recorded with its error, never chosen."""
    dev = torch.device(device)
    if dev.type != "cuda":
        dtype = torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    ms: dict[str, dict[str, float]] = {name: {} for name in candidates}
    errors: dict[str, str] = {}
    for shape in shapes:
        b, h, lq, lk, d = shape
        q = torch.randn(b, h, lq, d, device=dev, dtype=dtype, generator=g, requires_grad=True)
        k = torch.randn(b, h, lk, d, device=dev, dtype=dtype, generator=g, requires_grad=True)
        v = torch.randn(b, h, lk, d, device=dev, dtype=dtype, generator=g, requires_grad=True)
        ref = sdpa(q, k, v, make_mask(shape, "sdpa") if make_mask else None).detach()
        for name, fn in candidates.items():
            if name in errors:
                continue
            mask = make_mask(shape, name) if make_mask else None

            def step(fn: Attention = fn, mask: Any = mask, qkv: tuple = (q, k, v)) -> Tensor:
                out = fn(*qkv, mask)
                out.sum().backward()
                return out

            try:
                out = step().detach()  # first call: compiles, and checks the result
                err = (out.float() - ref.float()).abs().max().item()
                if err > tol:
                    raise ValueError(f"output differs from SDPA's default by {err:.3g} > {tol}")
                ms[name][shape_key(shape)] = _time_ms(step, dev, iters)
            except Exception as e:  # recorded: an unavailable kernel is a fact of the machine
                errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
            q.grad = k.grad = v.grad = None
    totals = {n: sum(t.values()) for n, t in ms.items() if n not in errors and t}
    if not totals:
        raise RuntimeError(f"no {role} attention candidate ran: {errors}")
    chosen = min(totals, key=lambda n: totals[n])
    return {
        "role": role,
        "chosen": chosen,
        "total ms": totals,
        "ms": {n: t for n, t in ms.items() if n not in errors},
        "errors": errors,
        "shapes": [shape_key(s) for s in shapes],
    }


def representative(lengths: Sequence[int], n: int = 3) -> list[int]:
    """``n`` lengths spread over the sorted ``lengths`` (min, median, max for n=3)."""
    s = sorted(set(int(x) for x in lengths))
    if len(s) <= n:
        return s
    return sorted({s[round(i * (len(s) - 1) / (n - 1))] for i in range(n)})
