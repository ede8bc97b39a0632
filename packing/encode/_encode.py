"""`encode_dataset`: decode each episode's cameras, encode them in causal chunks, write.

One batch of episodes (similar lengths) at a time, one camera at a time, chunk by chunk::

    decode frames [lo, hi) of each episode     (lerobot's decoder; --num-workers threads)
      -> (B, 3, T, H, W) on the device, resized/cropped, in [-1, 1]
      -> CausalEncoder.push: the latents of those frames (the VAE's cache carries the past)
    after the last chunk: each episode's L latents -> LatentWriter.write (atomic)

An episode shorter than the batch's longest is padded with its last frame; the encoder is
causal, so the padding never reaches its own latents, which are cut at ``L`` (tested:
batched == one by one).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from packing._latent import latent_count
from packing.encode._config import EncodeConfig, EncodeReport
from packing.encode._errors import EncodeError
from packing.encode._meta import check_size, finish_metadata, latent_features
from packing.encode._source import Episode, Source, decode
from packing.encode._vae import CausalEncoder, check_compression, load_vae
from packing.encode._write import LatentWriter, check_destination

__all__ = ["encode_dataset"]


def encode_dataset(
    config: EncodeConfig, *, progress: Callable[[str], None] | None = None
) -> EncodeReport:
    """Encode ``config.src``'s camera videos into the latent dataset ``config.dst``.

    Everything checkable is checked before the first frame is decoded (cameras, files,
    frame counts, sizes, the destination). An interrupted run is resumed by running it
    again with the same config: whole episodes already written are kept.
    """
    if not isinstance(config, EncodeConfig):
        raise TypeError(f"config must be an EncodeConfig, got {type(config).__name__}")
    _check_paths(config.src_path, config.dst_path)
    check_destination(config.dst_path)
    device, dtype = _device(config.device), getattr(torch, config.compute_dtype)
    src = Source(config.src_path, config.cameras)
    vae = load_vae(config.vae, seed=config.seed)
    tc = int(vae.config.scale_factor_temporal or 4)
    sizes = {cam: check_size(cam, config.size or src.frame_hw(cam), vae) for cam in src.cameras}
    latent_lengths = _check_lengths(src, tc, config.pad_frames)
    features, dropped = latent_features(src, sizes, vae, config)
    vae.to(device=device)
    if dtype != torch.float32:  # (diffusers warns on any dtype cast; its Wan VAE keeps none fp32)
        vae.to(dtype=dtype)
    encoder = CausalEncoder(vae)
    check_compression(config.vae, encoder, device, dtype)
    # Everything is checked: only now is the destination made.
    writer = LatentWriter(config.dst_path, _job(config, src, vae), features)
    todo = [j for j in range(len(src.ids)) if not writer.done(j, int(src.ids[j]))]
    resumed = len(src.ids) - len(todo)
    if resumed and progress:
        progress(f"resuming {config.dst_path}: {resumed} episodes already written")
    # Longest first, neighbours together: little padding, and the ETA errs on the safe side.
    todo.sort(key=lambda j: (-int(src.lengths[j]), j))
    frames = latents_done = 0
    start = time.perf_counter()
    with ThreadPoolExecutor(max(config.num_workers, 1)) as pool:
        for b in range(0, len(todo), config.batch_size):
            batch = todo[b : b + config.batch_size]
            episodes = [src.episode(j) for j in batch]
            out: list[dict[str, np.ndarray]] = [{} for _ in batch]
            for cam in src.cameras:
                lat = _encode_camera(
                    encoder, episodes, cam, sizes[cam], config, pool, device, dtype
                )
                for i, j in enumerate(batch):
                    out[i][f"{cam}.latent"] = lat[i][: latent_lengths[j]]
            for i, j in enumerate(batch):
                writer.write(j, int(src.ids[j]), episodes[i].rows, out[i], tc, config.pad_frames)
            frames += sum(e.length for e in episodes)
            latents_done += sum(int(latent_lengths[j]) for j in batch)
            if progress:
                progress(_progress_line(b + len(batch), len(todo), frames, start))
    finish_metadata(writer, src, features)
    return EncodeReport(
        dst=config.dst_path,
        episodes=len(todo),
        resumed=resumed,
        frames=frames,
        latent_frames=latents_done,
        seconds=time.perf_counter() - start,
        dropped_videos=tuple(dropped),
    )


def _check_paths(src: Path, dst: Path) -> None:
    """The destination is neither the source nor inside it (nor the source inside it)."""
    s, d = src.resolve(), dst.resolve()
    if d == s or s in d.parents:
        raise EncodeError(
            f"DST {dst} is {'SRC itself' if d == s else 'inside SRC ' + str(src)}: packing "
            "encode never writes into the dataset it reads; pass a DST outside it"
        )
    if d in s.parents:
        raise EncodeError(
            f"SRC {src} is inside DST {dst}: packing encode writes a new dataset at DST; pass "
            "a DST that does not hold the source"
        )


def _device(spec: str) -> torch.device:
    """``spec`` as a device this machine has (EncodeConfig checked its spelling)."""
    device = torch.device(spec)
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise EncodeError(f"device={spec!r} but no CUDA GPU is visible; use 'cpu'")
    if device.index is not None and device.index >= count:
        raise EncodeError(
            f"device={spec!r} but this machine has {count} CUDA GPU(s), cuda:0 to "
            f"cuda:{count - 1}; pick one of those"
        )
    return device


def _check_lengths(src: Source, tc: int, pad: bool) -> np.ndarray:
    """Latent frames per episode; an episode the VAE cannot encode exactly is named."""
    out = np.empty(len(src.ids), dtype=np.int64)
    for j, (ep, n) in enumerate(zip(src.ids, src.lengths, strict=True)):
        try:
            out[j] = latent_count(int(n), tc, pad=pad)
        except ValueError as e:
            raise EncodeError(
                f"episode {ep} of {src.root}: {e}; pass --pad-frames (pad_frames=True) to "
                "repeat its last frame up to the next 1 + 4k, recorded in the metadata"
            ) from None
    return out


def _encode_camera(encoder: CausalEncoder, episodes: list[Episode], cam: str,
                   size: tuple[int, int], config: EncodeConfig, pool: ThreadPoolExecutor,
                   device: torch.device, dtype: torch.dtype) -> list[np.ndarray]:  # fmt: skip
    """``(L_max, C, h, w)`` latents of each episode's camera ``cam`` (cut to L by the caller)."""
    tc = encoder.tc
    longest = max(e.length for e in episodes)
    total = 1 + tc * (latent_count(longest, tc, pad=True) - 1)  # frames the encoder sees
    encoder.reset()
    pieces: list[torch.Tensor] = []
    store = getattr(torch, config.store_dtype)
    for frames in _chunks(episodes, cam, total, tc * config.chunk_latents, pool, config):
        x = _pixels(frames, size, device, dtype)
        pieces.append(encoder.push(x).to("cpu", store))
    lat = torch.cat(pieces, dim=2).permute(0, 2, 1, 3, 4)  # (B, L, C, h, w)
    return [lat[i].contiguous().numpy() for i in range(len(episodes))]


def _chunks(episodes: list[Episode], cam: str, total: int, step: int,
            pool: ThreadPoolExecutor, config: EncodeConfig) -> Iterator[torch.Tensor]:  # fmt: skip
    """``(B, T, 3, H0, W0)`` uint8 frames, chunk by chunk (the first ``1 + step``); each
    episode past its end repeats its last frame. With workers, the next chunk is decoded
    while this one is encoded."""
    bounds = [(0, min(1 + step, total))]
    while bounds[-1][1] < total:
        lo = bounds[-1][1]
        bounds.append((lo, min(lo + step, total)))

    def load(lo: int, hi: int) -> list[Future[torch.Tensor]]:
        return [pool.submit(_episode_frames, e, cam, lo, hi) for e in episodes]

    ahead = load(*bounds[0])
    for k in range(len(bounds)):
        current = ahead
        if config.num_workers and k + 1 < len(bounds):
            ahead = load(*bounds[k + 1])
        parts = [f.result() for f in current]
        yield torch.stack(parts)
        if not config.num_workers and k + 1 < len(bounds):
            ahead = load(*bounds[k + 1])


def _episode_frames(episode: Episode, cam: str, lo: int, hi: int) -> torch.Tensor:
    """Frames ``lo:hi`` of an episode, its last frame repeated past its end."""
    n = episode.length
    real = decode(episode, cam, min(lo, n - 1), min(hi, n))
    if hi <= n:
        return real
    pad = real[-1:].expand(hi - max(lo, n), *real.shape[1:])
    return torch.cat([real if lo < n else real[:0], pad])


def _pixels(frames: torch.Tensor, size: tuple[int, int], device: torch.device,
            dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """uint8 ``(B, T, 3, H0, W0)`` -> ``(B, 3, T, H, W)`` in [-1, 1]: scaled to cover
    ``size`` (bilinear, antialiased), centre-cropped; unchanged pixels when sizes match."""
    b, t, _c, h0, w0 = frames.shape
    x = frames.to(device, non_blocking=True).flatten(0, 1).float()
    h, w = size
    if (h0, w0) != (h, w):
        scale = max(h / h0, w / w0)
        sh, sw = max(h, round(h0 * scale)), max(w, round(w0 * scale))
        x = torch.nn.functional.interpolate(x, size=(sh, sw), mode="bilinear", antialias=True)
        top, left = (sh - h) // 2, (sw - w) // 2
        x = x[:, :, top : top + h, left : left + w]
    x = (x / 127.5 - 1.0).to(dtype)
    return x.unflatten(0, (b, t)).permute(0, 2, 1, 3, 4)


def _progress_line(done: int, total: int, frames: int, start: float) -> str:
    dt = max(time.perf_counter() - start, 1e-9)
    eta = (total - done) * dt / max(done, 1)
    return (
        f"encode: {done}/{total} episodes, {done / dt:.2f} episodes/s, "
        f"{frames / dt:,.0f} frames/s, ETA {eta:,.0f} s"
    )


def _job(config: EncodeConfig, src: Source, vae: Any) -> dict[str, Any]:
    """What makes two runs the same job (a resume must not mix two): what changes the
    latents. Not batch_size, chunk_latents or num_workers, which change them by fp32
    rounding at most (tested <= 1e-5; the same config resumes bit for bit)."""
    info = (src.root / "meta" / "info.json").read_bytes()
    vae_cfg = json.dumps(dict(vae.config), sort_keys=True, default=str).encode()
    return {
        "src": str(Path(src.root).resolve()),
        "src_info_sha1": hashlib.sha1(info).hexdigest(),
        "cameras": list(src.cameras),
        "size": list(config.size) if config.size else None,
        "vae": config.vae,
        "vae_config_sha1": hashlib.sha1(vae_cfg).hexdigest(),
        "seed": config.seed,
        "pad_frames": config.pad_frames,
        "dtype": config.compute_dtype,
        "store_dtype": config.store_dtype,
        "chunks_size": int(src.info.get("chunks_size", 1000)),
    }
