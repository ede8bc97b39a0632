"""``packing encode`` (chunked, batched, decoding threads, bf16 on a GPU) vs the naive loop.

The naive loop is what a user writes first: one episode at a time, all its frames decoded by
lerobot's decoder, one ``vae.encode(whole episode)`` in fp32, the latents kept (not written).
``packing encode`` does more work (it writes every episode's parquet file) and is timed by
its own report: the episode loop (decode, encode, write), not the VAE's construction, the
checks before it or the final metadata (milliseconds); the naive loop is timed around the
loop too, its VAE built before. Both read the same video dataset, written here by lerobot's own writer (SVT-AV1) with
seeded frames, or reused with ``--root``. One warm-up of each, then ``--passes`` passes each,
interleaved; the table gives the median and the spread (min-max) of episodes/s and video
frames/s, and on a GPU the peak memory of each (both include the naive loop's fp32 VAE,
which stays resident; packing's own VAE is built per pass, outside its timed loop).

    HF_HUB_OFFLINE=1 python benchmarks/data/bench_encode.py                # CPU, tiny VAE
    HF_HUB_OFFLINE=1 python benchmarks/data/bench_encode.py --device cuda --vae-config wan2.2 \\
        --size 704x1280 --episodes 8 --frames 81 --batch-size 2 --num-workers 4

``--vae-config wan2.2`` is the Wan 2.2 VAE's config (48 channels, 16x space, 4x time) with
random-init weights of the real size: no download; speed does not depend on the weights.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from benchmarks import harness as common
from packing.encode import EncodeConfig, encode_dataset
from packing.encode._source import TOLERANCE_S, Source
from packing.encode._vae import load_vae

CAMERA = "observation.images.front"
VAE_SPECS = {"tiny": "tiny", "wan2.2": "wan2.2-config"}


def write_video_dataset(
    root: Path, episodes: int, frames: int, hw: tuple[int, int], seed: int
) -> Path:
    """``episodes`` episodes of ``frames`` frames at ``hw``: a moving gradient plus noise (a
    video codec has something to encode), a 7-D action; lerobot's writer."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    features = {
        CAMERA: {"dtype": "video", "shape": (*hw, 3), "names": ["height", "width", "channels"]},
        "action": {"dtype": "float32", "shape": (7,), "names": None},
    }
    ds = LeRobotDataset.create(repo_id="bench/video", fps=16, features=features, root=root)
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0 : hw[0], 0 : hw[1]]
    for e in range(episodes):
        for f in range(frames):
            base = (yy // 2 + xx // 3 + 7 * f + 40 * e) % 256
            img = np.stack([base, 255 - base, (2 * base) % 256], -1)
            img = img + rng.integers(0, 16, (*hw, 3))
            action = rng.standard_normal(7).astype(np.float32)
            ds.add_frame({CAMERA: np.clip(img, 0, 255).astype(np.uint8), "action": action,
                          "task": "bench"})  # fmt: skip
        ds.save_episode(parallel_encoding=False)
    ds.finalize()
    return root


def naive_pass(root: Path, vae: Any, device: torch.device) -> tuple[int, None]:
    """One episode at a time, decoded whole, one fp32 ``vae.encode``; returns frames."""
    from lerobot.datasets.video_utils import decode_video_frames

    src = Source(root, (CAMERA,))
    frames = 0
    for j in range(len(src.ids)):
        ep = src.episode(j)
        path, times = ep.videos[CAMERA]
        x = decode_video_frames(path, times.tolist(), TOLERANCE_S, backend="pyav")
        x = (x.to(device) * 2 - 1).permute(1, 0, 2, 3)[None]
        with torch.no_grad():
            lat = vae.encode(x).latent_dist.mode().cpu()
        assert lat.shape[2] == 1 + (ep.length - 1) // 4
        frames += ep.length
    return frames, None


def packing_pass(root: Path, config: dict[str, Any], tmp: Path) -> tuple[int, float]:
    """One ``encode_dataset`` run; (frames, seconds of its episode loop)."""
    dst = tmp / f"latent-{time.monotonic_ns()}"
    report = encode_dataset(EncodeConfig(root, dst, **config))
    shutil.rmtree(dst)
    return report.frames, report.seconds


def timed(fn: Any, device: torch.device) -> tuple[float, int, float | None]:
    """(seconds, frames, peak GiB on a GPU) of one call (its own seconds if it says)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    frames, seconds = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return seconds or time.perf_counter() - t, frames, peak


def main() -> None:
    p = common.base_parser(__doc__.split("\n")[0])
    p.add_argument("--vae-config", default="tiny", choices=sorted(VAE_SPECS))
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--frames", type=int, default=33, help="frames per episode (1 + 4k)")
    p.add_argument("--size", default="64x96", help="video HxW (encoded at this size)")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--chunk-latents", type=int, default=8)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="packing's compute dtype (default bf16 on CUDA, fp32 on CPU)")  # fmt: skip
    p.add_argument("--root", default=None, help="where the video dataset is written or reused")
    args = p.parse_args()
    if args.quick:
        args.episodes, args.frames, args.size, args.passes = 3, 9, "32x48", 1
    hw = tuple(int(v) for v in args.size.lower().split("x"))
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="bench_encode_"))
    root = Path(args.root) if args.root else tmp / "video"
    if not (root / "meta" / "info.json").exists():
        t = time.perf_counter()
        write_video_dataset(root, args.episodes, args.frames, hw, args.seed)  # type: ignore[arg-type]
        print(f"wrote {root} with lerobot's writer in {time.perf_counter() - t:.1f} s", flush=True)
    spec = VAE_SPECS[args.vae_config]
    vae = load_vae(spec, seed=args.seed).to(device)  # the naive loop's: fp32, whole episodes
    config = dict(vae=spec, cameras=(CAMERA,), device=args.device, dtype=args.dtype,
                  batch_size=args.batch_size, chunk_latents=args.chunk_latents,
                  num_workers=args.num_workers, seed=args.seed)  # fmt: skip
    runs: dict[str, Any] = {
        "naive (one episode, whole, fp32)": lambda: naive_pass(root, vae, device),
        "packing encode": lambda: packing_pass(root, config, tmp),
    }
    samples: dict[str, list[tuple[float, int, float | None]]] = {k: [] for k in runs}
    for fn in runs.values():  # warm-up: kernels, caches, the decoder
        timed(fn, device)
    for _ in range(args.passes):
        for name, fn in runs.items():
            samples[name].append(timed(fn, device))
            print(f"  {name}: {samples[name][-1][0]:.2f} s", flush=True)
    rows = []
    naive_eps = None
    for name, got in samples.items():
        eps = [args.episodes / s for s, _, _ in got]
        fps = [f / s for s, f, _ in got]
        med = statistics.median(eps)
        naive_eps = naive_eps or med
        peaks = [m for _, _, m in got if m is not None]
        rows.append({
            "method": name,
            "episodes/s": med,
            "spread": f"{min(eps):.3g}-{max(eps):.3g}",
            "frames/s": statistics.median(fps),
            "vs naive": med / naive_eps,
            "peak GiB": max(peaks) if peaks else None,
            "seconds": [s for s, _, _ in got],
        })  # fmt: skip
    what = (f"{args.episodes} episodes x {args.frames} frames at {args.size}, VAE "
            f"{args.vae_config}, {args.device}, packing dtype "
            f"{args.dtype or ('bfloat16' if device.type == 'cuda' else 'float32')}, batch "
            f"{args.batch_size}, {args.num_workers} decoding threads, {args.passes} passes")  # fmt: skip
    print(f"\n{what}\n")
    print(
        common.markdown_table(
            rows, ["method", "episodes/s", "spread", "frames/s", "vs naive", "peak GiB"]
        )
    )
    name = f"encode_{device.type}" + ("" if args.vae_config == "tiny" else f"_{args.vae_config}")
    common.write_json(name, args, {"what": what, "rows": rows}, device=device)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
