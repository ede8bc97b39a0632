"""``packing encode``: a LeRobot v3 video dataset -> a latent dataset `packing verify` reads.

::

    packing encode ~/data/my_robot ~/data/my_robot_latents --vae ~/models/Wan2.2-TI2V-5B-Diffusers
    packing encode SRC DST --vae tiny --cameras observation.images.front --size 64x96
    packing encode SRC DST --vae PATH --device cuda --batch-size 8 --num-workers 4

Each camera becomes a ``{camera}.latent`` feature (Wan VAE: 1 + (F-1)/4 latent frames for F
video frames), every non-video feature and the episode/task tables are carried over, one
row per video frame (docs/encode.md). Interrupted, the same command continues where it
stopped. Exit status: 0 written; 2 bad input (one line names the episode, the file and the
fix; --traceback adds the traceback); 3 a crash inside a library.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(sub: Any) -> None:
    e = sub.add_parser(
        "encode",
        help="encode a LeRobot video dataset's cameras into a latent dataset (Wan VAE)",
        description=__doc__.split("::")[0].strip(),
    )
    e.add_argument("src", metavar="SRC", help="a local LeRobot v3 dataset root with video cameras")
    e.add_argument("dst", metavar="DST", help="the latent dataset to write (must not exist)")
    e.add_argument(
        "--vae",
        required=True,
        help="a local diffusers AutoencoderKLWan folder (or a Wan checkpoint holding vae/), "
        "'tiny' (random init, for tests) or 'wan2.2-config' (Wan 2.2's size, random init)",
    )
    e.add_argument("--cameras", nargs="+", default=None, help="video features (default: all)")
    e.add_argument("--size", default=None, metavar="HxW", help="resize/crop frames to HxW")
    e.add_argument(
        "--pad-frames",
        action="store_true",
        help="pad an episode of F != 1 + 4k frames with copies of its last frame (default: "
        "refuse it)",
    )
    e.add_argument("--chunk-latents", type=int, default=8, help="latent frames per chunk (8)")
    e.add_argument("--batch-size", type=int, default=4, help="episodes encoded together (4)")
    e.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    e.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="VAE compute dtype (default: float32 on CPU, bfloat16 on CUDA)")  # fmt: skip
    e.add_argument("--store-dtype", default="float16", choices=["float16", "float32"])
    e.add_argument("--num-workers", type=int, default=0, help="video decoding threads (0)")
    e.add_argument("--seed", type=int, default=0, help="seed of the random-init VAEs")
    e.add_argument("--traceback", action="store_true", help="on an error, print the traceback")


def run(args: argparse.Namespace) -> int:
    from packing.encode import EncodeConfig, encode_dataset

    config = EncodeConfig(
        args.src,
        args.dst,
        vae=args.vae,
        cameras=None if args.cameras is None else tuple(args.cameras),
        size=None if args.size is None else _size(args.size),
        pad_frames=args.pad_frames,
        chunk_latents=args.chunk_latents,
        batch_size=args.batch_size,
        device=args.device,
        dtype=args.dtype,
        store_dtype=args.store_dtype,
        num_workers=args.num_workers,
        seed=args.seed,
    )
    report = encode_dataset(
        config, progress=lambda line: print(f"  .. {line}", file=sys.stderr, flush=True)
    )
    print(report.format(), flush=True)
    return 0


def _size(text: str) -> tuple[int, int]:
    h, sep, w = text.lower().partition("x")
    if not sep or not h.isdigit() or not w.isdigit():
        raise ValueError(f"--size {text!r}: expected HxW in pixels, e.g. --size 704x1280")
    return int(h), int(w)
