"""``packing encode``: a LeRobot v3 video dataset -> a latent dataset `packing verify` reads.

::

    packing encode ~/data/my_robot ~/data/my_robot_latents --vae ~/models/Wan2.2-TI2V-5B-Diffusers
    packing encode SRC DST --vae tiny --cameras observation.images.front --size 64x96
    packing encode SRC DST --vae PATH --device cuda --batch-size 8 --num-workers 4

Each camera becomes a ``{camera}.latent`` feature (Wan VAE: 1 + (F-1)/4 latent frames for F
video frames), every non-video feature and the episode/task tables are carried over, one
row per video frame (docs/encode.md). Interrupted, the same command continues where it
stopped. Exit status: 0 written; 2 bad input (one line names the episode, the file and the
fix; --traceback adds the traceback); 3 a crash inside a library; 130 Ctrl-C (one line: the
episodes written are kept, the same command resumes).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from packing.cli._parser import Interrupted, device, folder, pattern, text, whole

VAE_NAMES = ("tiny", "wan2.2-config")


def add_parser(sub: Any) -> None:
    e = sub.add_parser(
        "encode",
        help="encode a LeRobot video dataset's cameras into a latent dataset (Wan VAE)",
        description=__doc__.split("::")[0].strip(),
    )
    e.add_argument(
        "src",
        metavar="SRC",
        type=folder("a local LeRobot v3 dataset root"),
        help="a local LeRobot v3 dataset root with video cameras",
    )
    e.add_argument(
        "dst",
        metavar="DST",
        type=text("a folder path"),
        help="the latent dataset to write (must not exist)",
    )
    e.add_argument(
        "--vae",
        required=True,
        type=folder("a diffusers VAE folder, 'tiny' or 'wan2.2-config'", also=VAE_NAMES),
        help="a local diffusers AutoencoderKLWan folder (or a Wan checkpoint holding vae/), "
        "'tiny' (random init, for tests) or 'wan2.2-config' (Wan 2.2's size, random init)",
    )
    e.add_argument(
        "--cameras",
        nargs="+",
        type=text("a video feature"),
        default=None,
        help="video features (default: all)",
    )
    e.add_argument(
        "--size",
        type=pattern(r"\d+x\d+", "704x1280", "HxW in pixels"),
        default=None,
        metavar="HxW",
        help="resize/crop frames to HxW",
    )
    e.add_argument(
        "--pad-frames",
        action="store_true",
        help="pad an episode of F != 1 + 4k frames with copies of its last frame (default: "
        "refuse it)",
    )
    e.add_argument(
        "--chunk-latents",
        type=whole(1, 4096, "latent frames"),
        default=8,
        help="latent frames per chunk (8)",
    )
    e.add_argument(
        "--batch-size",
        type=whole(1, 4096, "episodes"),
        default=4,
        help="episodes encoded together (4)",
    )
    e.add_argument(
        "--device", type=device(), default="cpu", help="cpu (default), cuda, cuda:1, ..."
    )
    e.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="VAE compute dtype (default: float32 on CPU, bfloat16 on CUDA)")  # fmt: skip
    e.add_argument("--store-dtype", default="float16", choices=["float16", "float32"])
    e.add_argument(
        "--num-workers", type=whole(0, 256, "threads"), default=0, help="video decoding threads (0)"
    )
    e.add_argument(
        "--seed", type=whole(0, 2**63 - 1, "a seed"), default=0, help="seed of the random-init VAEs"
    )
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
    done: list[str] = []

    def progress(line: str) -> None:
        done.append(line)
        print(f"  .. {line}", file=sys.stderr, flush=True)

    try:
        report = encode_dataset(config, progress=progress)
    except KeyboardInterrupt:
        so_far = _written(done)
        raise Interrupted(
            f"interrupted; {so_far} in {args.dst} are kept (each episode is written whole or "
            "not at all): run the same command again to resume with the rest"
        ) from None
    print(report.format(), flush=True)
    return 0


def _written(progress_lines: list[str]) -> str:
    """How far the run got, from its progress lines (``encode: 3/5 episodes, ...``)."""
    last = next((x for x in reversed(progress_lines) if x.startswith("encode: ")), None)
    if last is None:
        return "no episode of this run is written yet; those of earlier runs"
    return f"{last.split()[1]} episodes written by this run"


def _size(text: str) -> tuple[int, int]:
    h, _, w = text.partition("x")  # the parser checked the form
    return int(h), int(w)
