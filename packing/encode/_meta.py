"""The latent dataset's metadata: its features, ``meta/episodes``, ``stats.json``, ``info.json``.

Each encoded camera ``front`` becomes the feature ``front.latent`` (in the camera's place);
its ``info.json`` entry says what a latent frame is, under ``"latent"``::

    "observation.images.front.latent": {
        "dtype": "float16", "shape": [48, 44, 80], "names": ["channels", "height", "width"],
        "latent": {"source_feature": "observation.images.front", "temporal_compression": 4,
                   "spatial_compression": 16, "pad_frames": false, "frame_size": [704, 1280],
                   "covers": "latent 0: video frame 0; latent j >= 1: frames 4j-3 .. 4j",
                   "rows": "latent j is stored on row min(4j, F-1); the other rows hold zeros",
                   ...}}

``meta/episodes`` keeps every source column except the encoded cameras' ``videos/...`` and
``stats/...``; ``data/chunk_index``/``data/file_index`` point to the episode's own file, and
``latents/{key}/length`` gives its latent frames.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from packing._lazy import require
from packing.encode._errors import EncodeError

__all__ = ["check_size", "finish_metadata", "latent_features"]


def check_size(cam: str, size: tuple[int, int], vae: Any) -> tuple[int, int]:
    """``size`` when the VAE takes it (both sides multiples of its spatial factor)."""
    s = int(vae.config.scale_factor_spatial or 8)
    h, w = size
    if h % s or w % s:
        near = f"{max(s, h // s * s)}x{max(s, w // s * s)}"
        raise EncodeError(
            f"camera {cam!r}: frames of {h}x{w} pixels cannot be encoded by this VAE, whose "
            f"latent grid is 1/{s} of the frame: pass --size HxW with multiples of {s} (e.g. "
            f"--size {near}; frames are scaled to cover it and centre-cropped)"
        )
    return h, w


def latent_features(src: Any, sizes: dict[str, tuple[int, int]], vae: Any,
                    config: Any) -> tuple[dict[str, Any], list[str]]:  # fmt: skip
    """The output features (source order, each encoded camera replaced by its latent
    feature) and the video features not carried over."""
    from packing.encode._vae import vae_name

    tc = int(vae.config.scale_factor_temporal or 4)
    s = int(vae.config.scale_factor_spatial or 8)
    out: dict[str, Any] = {}
    dropped = []
    for key, feature in src.features.items():
        if feature.get("dtype") != "video":
            out[key] = feature
        elif key not in src.cameras:
            dropped.append(key)
        else:
            h, w = sizes[key]
            out[f"{key}.latent"] = {
                "dtype": config.store_dtype,
                "shape": [int(vae.config.z_dim), h // s, w // s],
                "names": ["channels", "height", "width"],
                "latent": {
                    "source_feature": key,
                    "vae": vae_name(config.vae, vae),
                    "temporal_compression": tc,
                    "spatial_compression": s,
                    "pad_frames": config.pad_frames,
                    "frame_size": [h, w],
                    "source_frame_size": list(src.frame_hw(key)),
                    "resize": "scaled to cover frame_size (bilinear, antialiased), centre-cropped",
                    "pixels": "uint8 / 127.5 - 1",
                    "value": "posterior mean, (mean - latents_mean) / latents_std per channel",
                    "covers": f"latent 0: video frame 0; latent j >= 1: frames {tc}j-{tc - 1} .. "
                    f"{tc}j"
                    + (
                        " (the last: up to F-1, then copies of frame F-1)"
                        if config.pad_frames
                        else ""
                    ),
                    "rows": f"latent j is stored on row min({tc}j, F-1) of its episode; the other "
                    "rows hold zeros (packing's LeRobotEpisodes serves the L latent frames)",
                },
            }
    return out, dropped


def finish_metadata(writer: Any, src: Any, features: dict[str, Any]) -> None:
    """meta/episodes, stats.json and info.json of the finished dataset (info.json last)."""
    pa = require("pyarrow", extra=None)
    compute_stats = require("lerobot.datasets.compute_stats", extra="encode")
    table = src.table
    videos = [k for k, f in src.features.items() if f.get("dtype") == "video"]
    keep = [
        c
        for c in table.column_names
        if not any(c.startswith((f"videos/{v}/", f"stats/{v}/")) for v in videos)
    ]
    table = table.select(keep)
    n = len(src.ids)
    sides = [writer.sidecar(int(e)) for e in src.ids]
    chunk, file = np.divmod(np.arange(n, dtype=np.int64), writer.chunks_size)
    ends = np.cumsum(src.lengths)
    replace = {
        "data/chunk_index": chunk,
        "data/file_index": file,
        "dataset_from_index": ends - src.lengths,
        "dataset_to_index": ends,
    }
    for name, values in replace.items():
        i = table.column_names.index(name)
        table = table.set_column(i, name, pa.array(values.astype(np.int64)))
    latent_keys = [k for k, f in features.items() if "latent" in f]
    per_episode: list[dict[str, Any]] = []
    for side in sides:
        per_episode.append(
            {
                k: {s: np.array(v) for s, v in side["latents"][k]["stats"].items()}
                for k in latent_keys
            }
        )
    for k in latent_keys:
        table = table.append_column(
            f"latents/{k}/length", pa.array([side["latents"][k]["length"] for side in sides])
        )
        for stat in ("min", "max", "mean", "std", "count"):
            values = [side["latents"][k]["stats"][stat] for side in sides]
            table = table.append_column(f"stats/{k}/{stat}", pa.array(values))
    stats = _source_stats(src.root, videos)
    for k in latent_keys:  # lerobot's pooled mean/std (its aggregate_stats takes any key
        # holding "image" for an RGB image and would refuse C != 3 channels)
        pooled = compute_stats.aggregate_feature_stats([e[k] for e in per_episode])
        stats[k] = {s: np.asarray(a).tolist() for s, a in pooled.items()}
    info = dict(src.info)
    info["features"] = features
    if not any(f.get("dtype") == "video" for f in features.values()):
        info["video_path"] = None
    writer.finish(src.root, info, table, stats)


def _source_stats(root: Path, videos: list[str]) -> dict[str, Any]:
    path = root / "meta" / "stats.json"
    if not path.is_file():
        return {}
    stats: dict[str, Any] = json.loads(path.read_text())
    return {k: v for k, v in stats.items() if k not in videos}
