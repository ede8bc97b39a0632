"""Where a CUDA-graphed block-mask build spends its time (a probe, CUDA only).

    python3 benchmarks/probe_block_mask_parts.py        # writes $OUT/block_mask_parts.json

Times, at 8K and 64K tokens (16 episodes), the whole ``make_block_mask(compile="cuda_graph")``
and its parts: the mask_mod closure, the graphed tables, the ``BlockMask`` constructor (CUDA
events and host wall time, median of 30), then prints a CUDA profile of 10 graphed builds.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

from packing.attention import document_mask_mod, make_block_mask
from packing.attention._block_tables import document_rule
from packing.attention._compile import BLOCK_MASK_GRAPHS


def median_ms(fn: Callable[[], Any]) -> dict[str, float]:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(30):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        c0 = time.perf_counter()
        s.record()
        fn()
        e.record()
        host.append((time.perf_counter() - c0) * 1e3)
        e.synchronize()
        gpu.append(s.elapsed_time(e))
    return {"event ms": statistics.median(gpu), "host ms": statistics.median(host)}


def probe(T: int) -> dict[str, Any]:
    """The parts' timings at ``T`` tokens, then the CUDA profile of the graphed tables."""
    lens = [T // 16 - 37] * 16
    doc = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lens)])
    doc = F.pad(doc, (0, T - len(doc)), value=-1).cuda()
    tables = BLOCK_MASK_GRAPHS(doc, doc, document_rule, 128, 128, True)
    mod = document_mask_mod(doc)
    parts: dict[str, Callable[[], Any]] = {
        "make_block_mask cuda_graph": lambda: make_block_mask(doc, compile="cuda_graph"),
        "document_mask_mod": lambda: document_mask_mod(doc),
        "graphed tables": lambda: BLOCK_MASK_GRAPHS(doc, doc, document_rule, 128, 128, True),
        "BlockMask(...)": lambda: BlockMask(
            seq_lengths=(T, T), **tables._asdict(), BLOCK_SIZE=(128, 128), mask_mod=mod
        ),
    }
    out = {}
    for name, fn in parts.items():
        out[f"{T} {name}"] = median_ms(fn)
        print(T, name, out[f"{T} {name}"], flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            BLOCK_MASK_GRAPHS(doc, doc, document_rule, 128, 128, True)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))
    return out


def main() -> None:
    out: dict[str, Any] = {"command": " ".join(["python3", *sys.argv]),
                           "machine": common.machine_info("cuda")}  # fmt: skip
    for T in (8192, 65536):
        out.update(probe(T))
    path = Path(os.environ.get("OUT", ".")) / "block_mask_parts.json"
    path.write_text(json.dumps(out, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
