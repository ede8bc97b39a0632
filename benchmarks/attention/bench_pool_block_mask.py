"""A K/V pool's block mask at admission: make_pool_block_mask vs create_block_mask.

The served LingBot-VA rebuilds its masks whenever a pack's composition changes: queries of
each robot's guidance rows over a pool of every robot's cache regions, a region's valid slots
with holes, regions in no order. The baseline is what that engine ran before, and what a user
writes: ``create_block_mask`` with ``q_doc[q] == kv_doc[k]`` over the ids on the device (it
evaluates every pair). ``make_pool_block_mask`` counts each tile's documents from the ids'
host copy (where the engine builds them) and moves the tables to the device. Both masks are
checked to list the same tiles.

Geometry: LIBERO's LingBot-VA as benchmarks/serving/bench_lingbot_serve.py serves it (two
128x128 cameras: 128 latent and 16 action tokens a chunk, attention window 30: a region of
2,160 rows), every robot in its video phase with guidance (2 docs), its cache 1-15 chunks
full. Timed on the device (CUDA events; host wall time on the CPU), median of the calls.

    python benchmarks/attention/bench_pool_block_mask.py            # the GPU if there is one
    python benchmarks/attention/bench_pool_block_mask.py --device cpu --out benchmarks/results/pool_block_mask_cpu.json
    python benchmarks/attention/bench_pool_block_mask.py --quick    # tiny, for the smoke test
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention.flex_attention import create_block_mask

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.attention.bench_block_mask import tiles_of
from benchmarks.harness.results import base_parser, markdown_table, write_json
from benchmarks.harness.timing import time_fn
from packing.attention import make_pool_block_mask

L, A, WINDOW = 128, 16, 30  # latent and action tokens a chunk, LeRobot's attn_window
ROWS = 2  # guidance: a conditional and an unconditional doc per robot


def pool_ids(robots: int, chunk: tuple[int, int], window: int,
             g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(q_doc, kv_doc)`` int64 on the host: each robot's two docs' queries (one chunk of
    latents), and the pool (``robots * 2`` regions, handed out in a shuffled order, then the
    scratch rows a call's own keys go to)."""
    Lc, Ac = chunk
    half = window // 2
    capacity = half * Lc + half * Ac
    docs = robots * ROWS
    q_doc = torch.arange(docs).repeat_interleave(Lc)
    kv_doc = torch.full((docs * capacity + q_doc.shape[0],), -1, dtype=torch.int64)
    for d, region in enumerate(torch.randperm(docs, generator=g).tolist()):
        full = int(torch.randint(1, half + 1, (1,), generator=g))  # chunks in the cache
        base = region * capacity
        kv_doc[base : base + full * Lc] = d  # the latent slots, then the action slots
        kv_doc[base + half * Lc : base + half * Lc + full * Ac] = d
    return q_doc, kv_doc


def measure(robots: int, args: Any, dev: torch.device, g: torch.Generator) -> dict[str, Any]:
    chunk, window = ((16, 4), 6) if args.quick else ((L, A), WINDOW)
    q_host, kv_host = pool_ids(robots, chunk, window, g)
    q_dev, kv_dev = q_host.to(dev), kv_host.to(dev)

    def same_doc(b: Any, h: Any, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (q_dev[q] == kv_dev[k]) & (q_dev[q] >= 0)

    Q, P = q_host.shape[0], kv_host.shape[0]

    def pairs() -> Any:
        return create_block_mask(same_doc, None, None, Q, P, device=dev)

    def pool() -> Any:
        return make_pool_block_mask(q_host, kv_host, device=dev, mask_mod=same_doc)

    same = all(torch.equal(a, b) for a, b in zip(tiles_of(pool()), tiles_of(pairs()), strict=True))
    iters = 3 if args.quick else args.iters
    t_pairs = time_fn(pairs, device=dev, warmup=1, iters=iters)
    t_pool = time_fn(pool, device=dev, warmup=1, iters=iters)
    listed = int(pool().kv_num_blocks.sum() + pool().full_kv_num_blocks.sum())
    return {
        "robots": robots, "queries": Q, "pool rows": P, "tiles listed": listed,
        "create_block_mask ms": t_pairs.median_ms, "make_pool_block_mask ms": t_pool.median_ms,
        "speedup": t_pairs.median_ms / t_pool.median_ms, "same tiles": same,
    }  # fmt: skip


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--robots", default="1,4,8,16", help="comma-separated robot counts")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    dev = torch.device(args.device)
    robots = [1, 2] if args.quick else [int(r) for r in args.robots.split(",")]
    g = torch.Generator().manual_seed(args.seed)
    rows = [measure(r, args, dev, g) for r in robots]
    cols = ["robots", "queries", "pool rows", "tiles listed", "create_block_mask ms",
            "make_pool_block_mask ms", "speedup", "same tiles"]  # fmt: skip
    print(markdown_table(rows, cols))
    write_json("pool_block_mask", args, {"rows": rows}, device=dev)
    if not all(r["same tiles"] for r in rows):
        raise SystemExit("the two masks list different tiles")


if __name__ == "__main__":
    main()
