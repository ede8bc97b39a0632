"""What an encode job is: `EncodeConfig` (plain data, checked once) and `EncodeReport`."""

from __future__ import annotations

import os
import re
from dataclasses import KW_ONLY, dataclass
from pathlib import Path

from packing._validate import check_bool, check_choice, check_int, check_int_tuple, check_sequence
from packing.encode._errors import EncodeError

__all__ = ["EncodeConfig", "EncodeReport"]


@dataclass(frozen=True)
class EncodeConfig:
    """A LeRobot v3 video dataset ``src`` -> a latent dataset ``dst`` (docs/encode.md).

    Args:
        src, dst: dataset roots; ``dst`` must not exist, unless it is this job's unfinished
            run (then it is resumed).
        vae: ``"tiny"`` (random-init, for tests), ``"wan2.2-config"`` (Wan 2.2's size,
            random init, for benchmarks) or a local diffusers ``AutoencoderKLWan`` folder.
        cameras: the video features to encode (default: all); other video features are not
            carried over (the report lists them), every non-video feature is.
        size: ``(H, W)`` the frames are resized to (scaled to cover, then centre-cropped);
            default: each camera's own size. Must be a multiple of the VAE's spatial factor.
        pad_frames: an episode of ``F != 1 + 4k`` frames is refused unless True: then its
            last frame is repeated up to ``1 + 4k`` (recorded in the metadata).
        chunk_latents: latent frames encoded per chunk (``4 * chunk_latents`` video frames
            in memory per episode); the result does not depend on it.
        batch_size: episodes encoded together (of similar length; padding past an episode's
            end cannot change its latents, the encoder being causal).
        device, dtype: where the VAE runs; dtype default float32 on CPU, bfloat16 on CUDA.
        store_dtype: dtype of the stored latents.
        num_workers: threads decoding video beside the encoder (0: decode in between).
        seed: the random-init VAEs' seed.
    """

    src: str | os.PathLike[str]
    dst: str | os.PathLike[str]
    _: KW_ONLY
    vae: str = "tiny"
    cameras: tuple[str, ...] | None = None
    size: tuple[int, int] | None = None
    pad_frames: bool = False
    chunk_latents: int = 8
    batch_size: int = 4
    device: str = "cpu"
    dtype: str | None = None
    store_dtype: str = "float16"
    num_workers: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("src", "dst"):
            if not isinstance(getattr(self, name), str | os.PathLike):
                raise TypeError(f"{name}={getattr(self, name)!r} must be a path")
        if not isinstance(self.vae, str) or not self.vae:
            raise TypeError(f"vae={self.vae!r} must be 'tiny', 'wan2.2-config' or a folder path")
        if self.cameras is not None:
            cams = tuple(check_sequence("cameras", self.cameras, of=str))
            if not cams or len(set(cams)) != len(cams):
                raise EncodeError(f"cameras={self.cameras!r}: give each camera once, at least one")
            object.__setattr__(self, "cameras", cams)
        if self.size is not None:
            object.__setattr__(self, "size", check_int_tuple("size", self.size, length=2, min=1))
        check_bool("pad_frames", self.pad_frames)
        # Bounded: each is a size of what is held in memory at once, or of a thread pool.
        check_int(
            "chunk_latents", self.chunk_latents, min=1, max=4096, hint="latent frames per chunk"
        )
        check_int("batch_size", self.batch_size, min=1, max=4096, hint="episodes per batch")
        check_int("num_workers", self.num_workers, min=0, max=256, hint="decoding threads")
        check_int("seed", self.seed, min=0, max=2**63 - 1)
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise EncodeError(f"device={self.device!r}: use 'cpu', 'cuda' or 'cuda:N'")
        if self.dtype is not None:
            check_choice("dtype", self.dtype, ("float32", "bfloat16"))
        check_choice("store_dtype", self.store_dtype, ("float16", "float32"))

    @property
    def compute_dtype(self) -> str:
        return self.dtype or ("bfloat16" if self.device.startswith("cuda") else "float32")

    @property
    def src_path(self) -> Path:
        return Path(self.src).expanduser()

    @property
    def dst_path(self) -> Path:
        return Path(self.dst).expanduser()


@dataclass(frozen=True)
class EncodeReport:
    """What a run did: episodes encoded now and found done (resumed), frames, time."""

    dst: Path
    episodes: int
    resumed: int
    frames: int
    latent_frames: int
    seconds: float
    dropped_videos: tuple[str, ...]

    @property
    def episodes_per_s(self) -> float:
        return self.episodes / self.seconds if self.seconds > 0 else float("nan")

    @property
    def frames_per_s(self) -> float:
        return self.frames / self.seconds if self.seconds > 0 else float("nan")

    def format(self) -> str:
        dropped = f"; not carried over: {list(self.dropped_videos)}" if self.dropped_videos else ""
        return (
            f"packing encode: wrote {self.dst} ({self.episodes} episodes encoded, "
            f"{self.resumed} found done; {self.frames:,} video frames -> "
            f"{self.latent_frames:,} latent frames; {self.episodes_per_s:.2f} episodes/s, "
            f"{self.frames_per_s:,.1f} frames/s){dropped}"
        )
