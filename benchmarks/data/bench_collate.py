"""Collate speed per DataLoader worker against the bare copy and a user's naive collate.

Methods, timed interleaved (one call of each in turn, so a noisy neighbour on a shared machine
hits them alike) on the same packs, episodes already in memory (I/O is bench_lerobot_io.py's
subject):

* ``bare copy``: ``torch.cat`` of each stream + doc ids (``repeat_interleave``): no padding,
  no positions; the floor any collate pays. Goal: PackedCollator >= 0.9x its speed.
* ``naive full``: what one writes by hand for the same output: cat, a second cat of a zero
  tail to reach the budget, doc ids / positions from Python lists of ``torch.full`` /
  ``torch.arange``, ``cu_seqlens``. Goal: PackedCollator >= 1.5x its speed.
* ``PackedCollator``: the library (streams, layouts with 3D positions, per-episode values).
* ``pad to longest``: ``pad_sequence`` + key mask, the padded-batch alternative.
* ``bare copy (control)``: the bare copy again, timed as a method of its own: how far two
  runs of one function differ in this setting (its "vs bare copy" would be 1.00 without noise).

GB/s counts the episodes' bytes (latents + actions), what had to be copied once. "memcpy" is
the machine's bare ``Tensor.copy_`` bandwidth on a 64 MB buffer, measured in the same run.
Sizes: ``small`` (K ~ 6 episodes of 18-42 latent frames, budget 8K tokens: 2 MB in bf16),
``seed`` (4.6K-10.7K-token episodes, budget 64K: ~25 MB bf16, ~50 MB fp32), ``short``
(0.3K-2.5K tokens, budget 48K); bf16 and fp32 latents; 1 thread and the default threads.

    python benchmarks/data/bench_collate.py            # full sizes (~3 min on 2 cores)
    python benchmarks/data/bench_collate.py --quick    # tiny, for CI
"""

from __future__ import annotations

import random
import resource
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import harness
from packing.data import PackedCollator, Stream

TOKENS_PER_FRAME = 32  # a 48x8x16 latent frame with 2x2 patches -> grid (4, 8)
ACTION_DIM = 14


def make_episodes(
    rng: torch.Generator, budget: int, lo_tokens: int, hi_tokens: int, dtype: torch.dtype
) -> list[dict[str, Any]]:
    lengths = harness.fill_pack(rng, budget, lo_tokens, hi_tokens, multiple=TOKENS_PER_FRAME)
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


def bare_copy(episodes: list[dict[str, Any]]) -> tuple[torch.Tensor, ...]:
    """The floor: one cat per stream and the doc ids, nothing else."""
    lat = torch.cat([e["latents"] for e in episodes])
    act = torch.cat([e["action"] for e in episodes])
    tokens = torch.tensor([e["latents"].shape[0] * TOKENS_PER_FRAME for e in episodes])
    doc_ids = torch.repeat_interleave(torch.arange(len(episodes), dtype=torch.int32), tokens)
    return lat, act, doc_ids


def memcpy_gbs(mb: int = 64, iters: int = 20) -> float:
    """The machine's bare copy bandwidth (GB/s of payload: bytes read once, written once)."""
    src = torch.ones(mb * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    t = harness.time_host(lambda: dst.copy_(src), warmup=3, iters=iters)
    return src.numel() / (t.median_ms * 1e-3) / 1e9


def time_interleaved(
    methods: dict[str, Any], packs: list[Any], iters: int, warmup: int = 3
) -> dict[str, harness.Timing]:
    """Each method once per round, in turn, rotating the pack: a burst of load from a
    neighbour hits every method alike, so ratios stay meaningful on a shared machine.

    The order of the methods is shuffled every round (seeded): the first method of a round
    reads the pack from memory, the others from the cache it left (a small pack fits in L3),
    and each call finds the heap as the previous method left it, so a fixed order (or a fixed
    rotation, where each method always follows the same one) favours some methods: two runs
    of the same function differed by up to 30% that way. Minor page faults per call
    (``getrusage``, outside the timed region) are returned alongside."""
    names = list(methods)
    order = random.Random(0)
    samples: dict[str, list[float]] = {m: [] for m in methods}
    faults: dict[str, int] = dict.fromkeys(methods, 0)
    for i in range(warmup + iters):
        pk = packs[i % len(packs)]
        for m in order.sample(names, len(names)):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            out = methods[m](pk)
            dt = (time.perf_counter() - t0) * 1e3
            f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            del out  # freed outside the timed region for every method alike
            if i >= warmup:
                samples[m].append(dt)
                faults[m] += f1 - f0
    return {m: (harness.summarize(v), faults[m] / max(iters, 1)) for m, v in samples.items()}


def main() -> None:
    p = harness.base_parser(__doc__.splitlines()[0])
    p.add_argument("--packs", type=int, default=8, help="distinct packs per regime (rotated)")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument(
        "--threads", default="1,default", help="torch thread counts, 'default' = torch's own"
    )
    p.add_argument("--dataloader", action="store_true", help="also time DataLoader(workers=1)")
    p.add_argument("--regimes", default="small,seed,short", help="which of small,seed,short to run")
    args = p.parse_args()
    default_threads = torch.get_num_threads()
    threads = [default_threads if t == "default" else int(t) for t in args.threads.split(",")]
    # (name, budget tokens, min, max tokens per episode)
    regimes = [
        ("small 0.6K-1.3K / 8K", 8192, 576, 1344),
        ("seed 4.6K-10.7K / 64K", 65536, 4608, 10752),
        ("short 0.3K-2.5K / 48K", 49152, 320, 2528),
    ]
    chosen = args.regimes.split(",")
    regimes = [r for r in regimes if r[0].split()[0] in chosen] or regimes
    if args.quick:
        regimes = [("quick seed", 4096, 640, 1280), ("quick short", 2048, 64, 320)]
        args.packs, args.iters, threads = 2, 3, threads[:1]
    dtypes = [torch.bfloat16, torch.float32]
    copy_gbs = memcpy_gbs(8 if args.quick else 64)
    print(f"memcpy (Tensor.copy_, 1 thread): {copy_gbs:.1f} GB/s")

    rows: list[dict[str, Any]] = []
    for nthreads in threads:
        torch.set_num_threads(nthreads)
        rng = torch.Generator().manual_seed(args.seed)
        for name, budget, lo, hi in regimes:
            for dtype in dtypes:
                rows += regime_rows(args, nthreads, name, budget, lo, hi, dtype, rng)
    torch.set_num_threads(default_threads)

    dl_rows = []
    if args.dataloader:
        dl_rows = dataloader_rows(
            args, next((r for r in regimes if r[0].startswith("seed")), regimes[0])
        )
    cols = ["threads", "regime", "dtype", "method", "episodes/pack", "MB/pack", "ms",
            "p10-p90 ms", "GB/s", "vs bare copy", "vs naive", "page faults/call"]  # fmt: skip
    print(harness.markdown_table(rows + dl_rows, cols))
    harness.write_json(
        "collate",
        args,
        {"rows": rows + dl_rows, "threads": threads, "memcpy_gb_per_s": copy_gbs},
        device="cpu",
    )


def regime_rows(
    args: Any, nthreads: int, name: str, budget: int, lo: int, hi: int, dtype: torch.dtype,
    rng: torch.Generator,
) -> list[dict[str, Any]]:  # fmt: skip
    packs = [make_episodes(rng, budget, lo, hi, dtype) for _ in range(args.packs)]
    collator = PackedCollator(
        [
            Stream("latents", grid=(4, 8), budget=budget),
            Stream("action", budget=budget // TOKENS_PER_FRAME),  # one action per frame
        ]
    )
    nbytes = sum(episode_bytes(p) for p in packs) / len(packs)
    neps = sum(len(p) for p in packs) / len(packs)
    # The alternatives must compute the same packed data before they are timed.
    ref, alt, bare = collator(packs[0]), naive_collate(packs[0], budget), bare_copy(packs[0])
    for key in ("latents", "action", "doc_ids", "position_ids", "cu_seqlens"):
        assert torch.equal(ref[key], alt[key]), f"naive collate disagrees on {key}"
    n_frames = bare[0].shape[0]
    assert torch.equal(ref["latents"][:n_frames], bare[0]), "bare copy disagrees"
    assert torch.equal(ref["doc_ids"][: len(bare[2])], bare[2]), "bare doc ids disagree"

    methods = {
        "bare copy": bare_copy,
        "bare copy (control)": bare_copy,  # the same function: the spread of the method
        "naive full": partial(naive_collate, budget=budget),
        "PackedCollator": collator,
        "pad to longest": pad_longest_collate,
    }
    timed = time_interleaved(methods, packs, args.iters)
    res = {m: t for m, (t, _) in timed.items()}
    bare_ms, naive_ms = res["bare copy"].median_ms, res["naive full"].median_ms
    return [
        {
            "threads": nthreads,
            "regime": name,
            "dtype": str(dtype).replace("torch.", ""),
            "method": mname,
            "episodes/pack": round(neps, 1),
            "MB/pack": nbytes / 1e6,
            "ms": t.median_ms,
            "p10-p90 ms": f"{t.p10_ms:.3f}-{t.p90_ms:.3f}",
            "GB/s": nbytes / (t.median_ms * 1e-3) / 1e9,
            "episodes/s": neps / (t.median_ms * 1e-3),
            "vs bare copy": bare_ms / t.median_ms,
            "vs naive": naive_ms / t.median_ms,
            "page faults/call": timed[mname][1],
            "timing": t.as_dict(),
        }
        for mname, t in res.items()
    ]


def dataloader_rows(args: Any, regime: tuple[str, int, int, int]) -> list[dict[str, Any]]:
    """End to end through DataLoader(num_workers=1): collate in the worker + the IPC hand-off."""
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
