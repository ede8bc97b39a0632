"""Collate throughput per DataLoader worker: PackedCollator vs naive torch.cat vs pad-to-longest.

One DataLoader worker runs one thread, so this times the collate on one thread
(``torch.set_num_threads(1)``), on episodes already in memory (I/O is bench_lerobot_io.py's
subject). GB/s counts the bytes of the episodes' streams (latents + actions), i.e. what had
to be copied once; episodes/s is the number of episodes collated per second.

The alternatives, as a user would write them:

* ``naive``: ``torch.cat`` each stream, then ``torch.cat`` a zero tail to reach the budget
  (a second copy), doc ids / positions from Python lists of ``torch.full``/``torch.arange``.
* ``pad_longest``: ``pad_sequence`` to the longest episode, ``(K, L_max, ...)`` plus a key mask
  (the padded-batch alternative to packing; it copies as much but pads a lot).

    python benchmarks/bench_collate.py            # full sizes (~1 min)
    python benchmarks/bench_collate.py --quick    # tiny, for CI
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

from packing.collate import PackedCollator, Stream

TOKENS_PER_FRAME = 32  # a 48x8x16 latent frame with 2x2 patches -> grid (4, 8)
ACTION_DIM = 14


def make_episodes(
    rng: torch.Generator, budget: int, lo_tokens: int, hi_tokens: int, dtype: torch.dtype
) -> list[dict[str, Any]]:
    lengths = common.fill_pack(rng, budget, lo_tokens, hi_tokens, multiple=TOKENS_PER_FRAME)
    eps = []
    for i, n in enumerate(lengths):
        f = n // TOKENS_PER_FRAME
        eps.append(
            {
                "latents": torch.randn(f, 48, 8, 16, generator=rng).to(dtype),
                "action": torch.randn(f, ACTION_DIM, generator=rng),
                "episode_index": i,
                "task": f"task {i % 7}",
            }
        )
    return eps


def naive_collate(episodes: list[dict[str, Any]], budget: int) -> dict[str, Any]:
    """What one writes by hand: cat, cat a zero tail, build the layout from Python lists."""
    frames = [e["latents"].shape[0] for e in episodes]
    lat = torch.cat([e["latents"] for e in episodes])
    pad_f = budget // TOKENS_PER_FRAME - lat.shape[0]
    lat = torch.cat([lat, lat.new_zeros(pad_f, *lat.shape[1:])])
    act = torch.cat([e["action"] for e in episodes])
    act = torch.cat([act, act.new_zeros(pad_f, act.shape[1])])
    tokens = [f * TOKENS_PER_FRAME for f in frames]
    doc_ids = torch.cat(
        [torch.full((n,), k, dtype=torch.int32) for k, n in enumerate(tokens)]
        + [torch.full((budget - sum(tokens),), -1, dtype=torch.int32)]
    )
    pos = torch.cat(
        [torch.arange(n, dtype=torch.int32) for n in tokens]
        + [torch.zeros(budget - sum(tokens), dtype=torch.int32)]
    )
    cu = torch.tensor([0, *torch.tensor(tokens).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "latents": lat,
        "action": act,
        "doc_ids": doc_ids,
        "position_ids": pos,
        "cu_seqlens": cu,
        "episode_index": torch.tensor([e["episode_index"] for e in episodes]),
        "task": [e["task"] for e in episodes],
    }


def pad_longest_collate(episodes: list[dict[str, Any]]) -> dict[str, Any]:
    """The padded batch: (K, L_max, ...) and a key mask."""
    lat = pad_sequence([e["latents"] for e in episodes], batch_first=True)
    act = pad_sequence([e["action"] for e in episodes], batch_first=True)
    frames = torch.tensor([e["latents"].shape[0] for e in episodes])
    key_mask = torch.arange(lat.shape[1])[None, :] < frames[:, None]
    return {
        "latents": lat,
        "action": act,
        "key_mask": key_mask,
        "episode_index": torch.tensor([e["episode_index"] for e in episodes]),
        "task": [e["task"] for e in episodes],
    }


def episode_bytes(episodes: list[dict[str, Any]]) -> int:
    return sum(
        e["latents"].numel() * e["latents"].element_size()
        + e["action"].numel() * e["action"].element_size()
        for e in episodes
    )


def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--packs", type=int, default=8, help="distinct packs per regime (rotated)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 = one worker)")
    p.add_argument("--dataloader", action="store_true", help="also time DataLoader(workers=1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rng = torch.Generator().manual_seed(args.seed)
    # (name, budget tokens, min, max tokens per episode)
    regimes = [
        ("seed 4.6K-10.7K / 64K", 65536, 4608, 10752),
        ("short 0.3K-2.5K / 48K", 49152, 320, 2528),
    ]
    if args.quick:
        regimes = [("quick seed", 4096, 640, 1280), ("quick short", 2048, 64, 320)]
        args.packs, args.iters = 2, 3
    dtypes = [torch.bfloat16, torch.float32]

    rows: list[dict[str, Any]] = []
    for name, budget, lo, hi in regimes:
        for dtype in dtypes:
            packs = [make_episodes(rng, budget, lo, hi, dtype) for _ in range(args.packs)]
            collator = PackedCollator(
                [Stream("latents", grid=(4, 8), budget=budget), Stream("action")],
                pad_to_multiple=128,
            )
            nbytes = sum(episode_bytes(p) for p in packs) / len(packs)
            neps = sum(len(p) for p in packs) / len(packs)
            # Check the alternative computes the same packed data before timing it.
            ref = collator(packs[0])
            alt = naive_collate(packs[0], budget)
            assert torch.equal(ref["latents"], alt["latents"]), "naive collate disagrees"
            assert torch.equal(ref["doc_ids"], alt["doc_ids"]), "naive doc ids disagree"

            methods = {
                "PackedCollator": collator,
                "naive torch.cat": partial(naive_collate, budget=budget),
                "pad to longest": pad_longest_collate,
            }
            res: dict[str, common.Timing] = {}
            for mname, fn in methods.items():
                it = iter(range(10**9))

                def call(fn: Any = fn, it: Any = it, packs: Any = packs) -> None:
                    fn(packs[next(it) % len(packs)])

                res[mname] = common.time_host(call, warmup=2, iters=args.iters)
            base = res["naive torch.cat"].median_ms
            for mname, t in res.items():
                rows.append(
                    {
                        "regime": name,
                        "dtype": str(dtype).replace("torch.", ""),
                        "method": mname,
                        "episodes/pack": round(neps, 1),
                        "MB/pack": nbytes / 1e6,
                        "ms": t.median_ms,
                        "p10-p90 ms": f"{t.p10_ms:.2f}-{t.p90_ms:.2f}",
                        "GB/s": nbytes / (t.median_ms * 1e-3) / 1e9,
                        "episodes/s": neps / (t.median_ms * 1e-3),
                        "vs naive": base / t.median_ms,
                        "timing": t.as_dict(),
                    }
                )

    dl_rows = []
    if args.dataloader:
        dl_rows = dataloader_rows(args, regimes[0])
    cols = ["regime", "dtype", "method", "episodes/pack", "MB/pack", "ms", "p10-p90 ms", "GB/s",
            "episodes/s", "vs naive"]  # fmt: skip
    print(common.markdown_table(rows + dl_rows, cols))
    common.write_json(
        "collate",
        args,
        {"rows": rows + dl_rows, "threads": args.threads},
        device="cpu",
    )


def dataloader_rows(args: Any, regime: tuple[str, int, int, int]) -> list[dict[str, Any]]:
    """End to end through DataLoader(num_workers=1): collate in the worker + the IPC hand-off."""
    import time

    from torch.utils.data import DataLoader

    name, budget, lo, hi = regime
    rng = torch.Generator().manual_seed(args.seed + 1)
    packs = [make_episodes(rng, budget, lo, hi, torch.bfloat16) for _ in range(args.packs)]
    flat = [e for p in packs for e in p]
    offsets, i = [], 0
    for pk in packs:
        offsets.append(list(range(i, i + len(pk))))
        i += len(pk)
    collator = PackedCollator(
        [Stream("latents", grid=(4, 8), budget=budget), Stream("action")], pad_to_multiple=128
    )
    out = []
    for mname, fn in {
        "DataLoader(workers=1) PackedCollator": collator,
        "DataLoader(workers=1) naive": lambda pk: naive_collate(pk, budget),
    }.items():
        dl = DataLoader(
            flat, batch_sampler=offsets * 4, collate_fn=fn, num_workers=1, prefetch_factor=2
        )
        t0 = time.perf_counter()
        n = 0
        for b in dl:
            n += 1
            del b
        dt = time.perf_counter() - t0
        nbytes = sum(episode_bytes(p) for p in packs) * 4
        out.append(
            {
                "regime": name,
                "dtype": "bfloat16",
                "method": mname,
                "episodes/pack": len(flat) / len(packs),
                "MB/pack": nbytes / 4 / len(packs) / 1e6,
                "ms": dt / n * 1e3,
                "GB/s": nbytes / dt / 1e9,
                "episodes/s": len(flat) * 4 / dt,
            }
        )
    return out


if __name__ == "__main__":
    main()
