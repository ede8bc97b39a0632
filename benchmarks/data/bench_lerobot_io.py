"""Whole-episode reads (LeRobotEpisodes) vs lerobot's frame-by-frame ``dataset[i]``, per worker.

One process = one DataLoader worker: every reader runs in this process, single-threaded
Arrow (``LeRobotEpisodes`` reads with ``use_threads=False``), over the same generated dataset
written by lerobot's own writer. Each method reads every episode of the dataset once per
pass, after one warm-up pass (page cache warm, parquet footers read); the table reports the
median over passes and the spread (min-max) of episodes/s and MB/s. MB counts the payload at
the declared dtypes (latents float16 + action float32), the same bytes for every method, so
MB/s compares work done; lerobot returns the float16 latents as float32 (twice the bytes).
"open s" is the time to open the dataset: for lerobot (and so for a LeRobotEpisodes built
on a LeRobotDataset) its first load converts the parquet files into datasets' Arrow cache.
"first pass s" is the warm-up pass; with ``cache_dir`` it includes building our Arrow cache.

    HF_HUB_OFFLINE=1 python benchmarks/data/bench_lerobot_io.py            # ~1 min on 1 core
    HF_HUB_OFFLINE=1 python benchmarks/data/bench_lerobot_io.py --episodes 64 --passes 5
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from benchmarks import harness
from packing.datasets import LeRobotEpisodes

LATENT = (48, 8, 16)
ACTION = 14
KEYS = ["latents", "action"]
RESULTS = Path(__file__).resolve().parent / "results" / "lerobot_io.json"


def write_dataset(root: Path, lengths: list[int], seed: int = 0) -> None:
    """A latent dataset written by lerobot's writer (one row per latent frame)."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    features = {
        "latents": {"dtype": "float16", "shape": LATENT, "names": None},
        "action": {"dtype": "float32", "shape": (ACTION,), "names": None},
    }
    ds = LeRobotDataset.create(
        repo_id="bench/latents", fps=10, features=features, root=root, use_videos=False
    )
    rng = np.random.default_rng(seed)
    for e, n in enumerate(lengths):
        lat = rng.standard_normal((n, *LATENT)).astype(np.float16)
        act = rng.standard_normal((n, ACTION)).astype(np.float32)
        for t in range(n):
            ds.add_frame({"latents": lat[t], "action": act[t], "task": f"task {e % 4}"})
        ds.save_episode()
    ds.finalize()


def read_ours(eps: LeRobotEpisodes) -> int:
    frames = 0
    for i in range(len(eps)):
        frames += eps[i]["latents"].shape[0]
    return frames


def decode_only(root: Path) -> int:
    """What an uncached read cost before packing decoded pages itself: pyarrow decoding every
    row group of the requested columns into Arrow, nothing else (no tensors, no checks)."""
    import pyarrow.parquet as pq

    rows = 0
    for f in sorted((root / "data").glob("*/*.parquet")):
        pf = pq.ParquetFile(f, memory_map=True)
        for g in range(pf.num_row_groups):
            rows += pf.read_row_groups([g], columns=KEYS, use_threads=False).num_rows
    return rows


def read_lerobot(ds: Any, bounds: list[tuple[int, int]]) -> int:
    """What a user does to get a whole episode from lerobot: its frames, stacked."""
    frames = 0
    for lo, hi in bounds:
        items = [ds[j] for j in range(lo, hi)]
        lat = torch.stack([f["latents"] for f in items])
        torch.stack([f["action"] for f in items])
        frames += lat.shape[0]
    return frames


def measure_all(
    fns: dict[str, Any], passes: int, n_episodes: int, payload_mb: float
) -> dict[str, dict[str, Any]]:
    """Wall and CPU time of ``passes`` full passes of every method, after one warm-up pass
    each. The passes are interleaved (pass 1 of every method, then pass 2, ...) so that a
    neighbour's burst on a shared machine hits every method alike.

    CPU time (this process) is reported too: on a shared machine it is the steadier measure
    of what one worker costs, while wall time includes waiting for a core.
    """
    first = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()  # warm-up: page cache, parquet footers, the Arrow cache of cache_dir
        first[name] = time.perf_counter() - t0
    secs: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(passes):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            secs[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    out = {}
    for name in fns:
        eps_s = [n_episodes / s for s in secs[name]]
        mb_s = [payload_mb / s for s in secs[name]]
        out[name] = {
            "first_pass_s": first[name],
            "seconds": secs[name],
            "cpu_seconds": cpu[name],
            "episodes_per_s": statistics.median(eps_s),
            "episodes_per_s_range": [min(eps_s), max(eps_s)],
            "mb_per_s": statistics.median(mb_s),
            "mb_per_s_range": [min(mb_s), max(mb_s)],
            "episodes_per_cpu_s": n_episodes / statistics.median(cpu[name]),
            "mb_per_cpu_s": payload_mb / statistics.median(cpu[name]),
        }
    return out


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for pkg in ("torch", "numpy", "pyarrow", "datasets", "lerobot"):
        try:
            versions[pkg] = version(pkg)
        except Exception:
            versions[pkg] = None
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "versions": versions,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--episodes", type=int, default=24)
    p.add_argument("--min-frames", type=int, default=20)
    p.add_argument("--max-frames", type=int, default=120)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--root", type=Path, default=None, help="reuse/keep the dataset here")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    lengths = rng.integers(args.min_frames, args.max_frames + 1, args.episodes).tolist()
    tmp = None
    if args.root is None:
        tmp = tempfile.TemporaryDirectory()
        root = Path(tmp.name) / "ds"
    else:
        root = args.root
    if not (root / "meta" / "info.json").exists():
        t0 = time.perf_counter()
        write_dataset(root, lengths)
        print(f"wrote {sum(lengths)} frames in {time.perf_counter() - t0:.1f} s to {root}")

    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    t0 = time.perf_counter()
    by_root = LeRobotEpisodes(root, keys=KEYS)
    setup_root = time.perf_counter() - t0
    lengths = by_root.lengths.tolist()
    frame_bytes = 2 * int(np.prod(LATENT)) + 4 * ACTION
    payload_mb = sum(lengths) * frame_bytes / 1e6
    # lerobot's first load converts the parquet files into datasets' Arrow cache (on disk,
    # uncompressed); the instance path then slices that memory-mapped cache.
    t0 = time.perf_counter()
    ref = LeRobotDataset("bench/latents", root=root)
    setup_lerobot = time.perf_counter() - t0
    t0 = time.perf_counter()
    by_instance = LeRobotEpisodes(ref, keys=KEYS)
    setup_instance = setup_lerobot + time.perf_counter() - t0
    ep = ref.meta.episodes
    bounds = list(zip(ep["dataset_from_index"], ep["dataset_to_index"], strict=True))

    cache_tmp = tempfile.TemporaryDirectory()  # never inside a dataset root (the embedded one)
    cache_dir = Path(cache_tmp.name) / "arrow-cache"
    by_cache = LeRobotEpisodes(root, keys=KEYS, cache_dir=cache_dir)

    n = len(lengths)
    results = measure_all(
        {
            "LeRobotEpisodes(root) whole episodes": lambda: read_ours(by_root),
            "pyarrow read_row_groups only (pyarrow's decode)": lambda: decode_only(root),
            "LeRobotEpisodes(root, cache_dir) whole episodes": lambda: read_ours(by_cache),
            "LeRobotEpisodes(LeRobotDataset) whole episodes": lambda: read_ours(by_instance),
            "lerobot dataset[i] frame by frame + stack": lambda: read_lerobot(ref, bounds),
        },
        args.passes,
        n,
        payload_mb,
    )
    results["LeRobotEpisodes(root) whole episodes"]["setup_s"] = setup_root
    results["pyarrow read_row_groups only (pyarrow's decode)"]["setup_s"] = 0.0
    results["LeRobotEpisodes(root, cache_dir) whole episodes"]["setup_s"] = setup_root
    results["LeRobotEpisodes(LeRobotDataset) whole episodes"]["setup_s"] = setup_instance
    results["lerobot dataset[i] frame by frame + stack"]["setup_s"] = setup_lerobot
    base = results["lerobot dataset[i] frame by frame + stack"]["episodes_per_s"]
    decode = results["pyarrow read_row_groups only (pyarrow's decode)"]["episodes_per_s"]
    rows = [
        "| method (1 process, 1 thread) | open s | first pass s | episodes/s | MB/s "
        "| MB per CPU-s | vs frame by frame | vs pyarrow's decode |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lo, hi = r["episodes_per_s_range"]
        mlo, mhi = r["mb_per_s_range"]
        rows.append(
            f"| {name} | {r['setup_s']:.2f} | {r['first_pass_s']:.2f} | {r['episodes_per_s']:.1f} ({lo:.1f}-{hi:.1f}) | "
            f"{r['mb_per_s']:.1f} ({mlo:.1f}-{mhi:.1f}) | {r['mb_per_cpu_s']:.1f} | "
            f"{r['episodes_per_s'] / base:.1f}x | {r['episodes_per_s'] / decode:.2f}x |"
        )
    table = "\n".join(rows)
    print(
        f"\n{n} episodes, {sum(lengths)} frames ({min(lengths)}-{max(lengths)} per episode), "
        f"{payload_mb:.1f} MB payload, {args.passes} passes after 1 warm-up\n"
    )
    print(table)
    print(f"\ncolumns decoded from their pages / by pyarrow: {by_root._reader.decode_counts}")
    record = {
        "benchmark": "lerobot_io",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "config": {
            "episodes": n,
            "frames": sum(lengths),
            "lengths": lengths,
            "latent_shape": LATENT,
            "action_dim": ACTION,
            "payload_mb": payload_mb,
            "passes": args.passes,
        },
        "results": results,
        "decode_counts": by_root._reader.decode_counts,
        "table_markdown": table,
    }
    harness.write_doc(args.out, record)
    print(f"\nwrote {args.out}")
    cache_tmp.cleanup()
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
