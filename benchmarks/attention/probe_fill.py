"""Where a half-empty pack's extra Flex time goes (a probe, CUDA only).

    python3 benchmarks/attention/probe_fill.py            # writes $OUT/probe_fill.json (or --out)

The same short-regime episodes (0.3K-2.5K tokens) at 50% of a 49,152-token budget and packed
tight, fwd+bwd through `packing.attention._packed` with the Flex backends: per CUDA kernel, the time
in the budgeted and the tight pack (torch.profiler, 10 steps), so the difference splits into
attention kernels, layout copies and elementwise work. Also times Flex on ``(1, H, T, D)``
tensors that need no transpose, to see what the ``(T, H, D)`` layout costs per row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import harness
from packing.attention import fa4_available, frame_causal, packed_attention, prepare_attention
from packing.data import layout_from_lengths

TPF, H, D = 32, 12, 128
torch._dynamo.config.recompile_limit = 64  # one compiled flex per (mask, length) probed


def kernels(fn: Any, steps: int = 10) -> dict[str, float]:
    """CUDA time per kernel name, ms per step."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0)
        if t > 0:
            out[e.key[:90]] += t / 1e3 / steps
    return dict(out)


def step_fn(T: int, lengths: list[int], backend: str, inner: Any, transposed: bool) -> Any:
    lay = layout_from_lengths(lengths, [n // TPF for n in lengths], T, TPF)
    m = prepare_attention(lay, None, inner, backend, device="cuda", dtype=torch.bfloat16)  # type: ignore[arg-type]
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, H, T, D) if transposed else (T, H, D)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
               .requires_grad_() for _ in range(3))  # fmt: skip
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
    if transposed:
        from torch.nn.attention.flex_attention import flex_attention

        compiled = torch.compile(flex_attention, dynamic=False)

        def run() -> None:
            q.grad = k.grad = v.grad = None
            o = compiled(q, k, v, block_mask=m.block_mask, kernel_options=m.kernel_options)
            o.backward(dout)  # type: ignore[union-attr]
    else:

        def run() -> None:
            q.grad = k.grad = v.grad = None
            packed_attention(q, k, v, m).backward(dout)

    return run, f"{m.backend}/{m.kernel}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "probe_fill.json"))
    p.add_argument("--fill", type=float, default=0.5)
    args = p.parse_args()
    budget, lo, hi = 49152, 320, 2528
    rng = torch.Generator().manual_seed(0)
    lengths = harness.fill_pack(rng, int(budget * args.fill), lo, hi, multiple=TPF)
    tight = -(-sum(lengths) // 128) * 128
    backends = ["flex"] + (["flex_flash"] if fa4_available() else [])
    rows: list[dict[str, Any]] = []
    for mask in ("document", "frame_causal"):
        inner = frame_causal(TPF) if mask == "frame_causal" else None
        for backend in backends:
            for transposed in (False, True):
                if transposed and backend != "flex":
                    continue
                per: dict[str, dict[str, float]] = {}
                timing: dict[str, float] = {}
                kernel = ""
                for key, T in (("budget", budget), ("tight", tight)):
                    fn, kernel = step_fn(T, lengths, backend, inner, transposed)
                    timing[key] = harness.time_fn(fn, device="cuda", warmup=3, iters=20).median_ms
                    per[key] = kernels(fn)
                names = sorted(set(per["budget"]) | set(per["tight"]),
                               key=lambda n: -(per["budget"].get(n, 0) - per["tight"].get(n, 0)))  # fmt: skip
                diff = [{"kernel": n, "budget ms": round(per["budget"].get(n, 0), 4),
                         "tight ms": round(per["tight"].get(n, 0), 4),
                         "extra ms": round(per["budget"].get(n, 0) - per["tight"].get(n, 0), 4)}
                        for n in names]  # fmt: skip
                row = {"mask": mask, "backend": backend, "kernel": kernel,
                       "inputs": "(1,H,T,D) flex_attention direct" if transposed else "(T,H,D) packing",
                       "episodes": len(lengths), "budget": budget, "tight": tight,
                       "fill": round(sum(lengths) / budget, 3), "budget ms": timing["budget"],
                       "tight ms": timing["tight"], "vs tight": timing["tight"] / timing["budget"],
                       "tail MB per q-sized tensor": (budget - tight) * H * D * 2 / 1e6,
                       "kernels": diff}  # fmt: skip
                print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
                for d in diff[:12]:
                    print("   ", d, flush=True)
                rows.append(row)
    cmd = "python3 " + " ".join(sys.argv)
    harness.write_doc(args.out, {"probe": "fill", "command": cmd,
                                 "machine": harness.machine_info("cuda"), "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
