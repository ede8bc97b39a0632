"""Writing the latent dataset: one parquet file per episode, atomically, then the metadata.

The destination is a LeRobot v3 root; while the job runs it has no ``meta/info.json`` (so no
reader takes it for a dataset) and holds the job's manifest::

    DST/.packing-encode/manifest.json         the job (source, cameras, size, VAE, dtypes)
    DST/.packing-encode/episode-000007.json   episode 7's latent counts and stats
    DST/data/chunk-000/file-000007.parquet    episode 7's rows: every source column + latents

An episode counts as done when its parquet exists: it is written to a temp file and renamed
after its sidecar, so a killed job leaves whole episodes or none of one, and the same command
continues with the next. `finish` writes ``meta/episodes``, ``meta/tasks.parquet``,
``meta/stats.json`` and, last, ``meta/info.json``, then removes the manifest.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from packing._latent import ENCODE_STAGING, latent_rows
from packing._lazy import require
from packing.encode._errors import EncodeError

__all__ = ["LatentWriter", "check_destination", "latent_stats"]

STAGING = ENCODE_STAGING


class LatentWriter:
    """Writes episodes into ``dst`` for the job ``job`` (a JSON-able dict); resumes a ``dst``
    holding the manifest of the same job, refuses any other existing ``dst``."""

    def __init__(self, dst: Path, job: dict[str, Any], features: dict[str, Any]) -> None:
        self.dst, self.job, self.features = dst, job, features
        self.staging = dst / STAGING
        manifest = self.staging / "manifest.json"
        check_destination(dst)
        if manifest.is_file():
            old = json.loads(manifest.read_text())
            if old != job:
                diff = sorted(k for k in set(old) | set(job) if old.get(k) != job.get(k))
                raise EncodeError(
                    f"destination {dst} holds an unfinished packing encode of another job "
                    f"(it differs in {diff}); rerun that command to finish it, or pass "
                    "another DST"
                )
        self.staging.mkdir(parents=True, exist_ok=True)
        for tmp in (dst / "data").glob("*/.*.tmp"):  # a killed run's half-written episode
            tmp.unlink()
        _atomic_write(manifest, json.dumps(job, indent=2).encode())
        self.hf = require("lerobot.datasets.feature_utils", extra="encode")
        # lerobot's own reader makes shapes tuples before this call ((1,) is a scalar column).
        shaped = {k: {**f, "shape": tuple(f["shape"])} for k, f in features.items()}
        self.schema = self.hf.get_hf_features_from_features(shaped).arrow_schema
        self.chunks_size = int(job.get("chunks_size", 1000))

    def data_path(self, pos: int) -> Path:
        chunk, file = divmod(pos, self.chunks_size)
        return self.dst / "data" / f"chunk-{chunk:03d}" / f"file-{file:03d}.parquet"

    def done(self, pos: int, index: int) -> bool:
        return self.data_path(pos).is_file() and self._sidecar(index).is_file()

    def _sidecar(self, index: int) -> Path:
        return self.staging / f"episode-{index:06d}.json"

    def write(self, pos: int, index: int, rows: Any, latents: dict[str, np.ndarray],
              tc: int, pad: bool) -> None:  # fmt: skip
        """Episode ``index`` (``pos``-th): its source ``rows`` plus one column per latent key,
        ``(L, C, h, w)`` latents stored on the rows `latent_rows` names, zeros elsewhere."""
        pa = require("pyarrow", extra=None)
        pq = require("pyarrow.parquet", extra=None)
        n = rows.num_rows
        columns = {}
        for name in self.schema.names:
            if name in latents:
                lat = latents[name]
                full = np.zeros((n, *lat.shape[1:]), dtype=lat.dtype)
                full[latent_rows(n, tc, pad=pad)] = lat
                columns[name] = _array3d(pa, full, self.schema.field(name).type)
            else:
                columns[name] = rows.column(name).cast(self.schema.field(name).type)
        table = pa.table(columns, schema=self.schema)
        side = {"index": index, "length": n}
        side["latents"] = {
            k: {"length": len(v), "stats": latent_stats(v)} for k, v in latents.items()
        }
        _atomic_write(self._sidecar(index), json.dumps(side).encode())
        path = self.data_path(pos)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        pq.write_table(table, tmp, row_group_size=max(n, 1), compression="snappy")
        os.replace(tmp, path)  # the commit: the episode is whole, or absent

    def sidecar(self, index: int) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self._sidecar(index).read_text())
        return out

    def finish(self, src: Any, info: dict[str, Any], episodes: Any, stats: dict[str, Any]) -> None:
        """The metadata, ``meta/info.json`` last; then the manifest goes."""
        pq = require("pyarrow.parquet", extra=None)
        meta = self.dst / "meta"
        (meta / "episodes" / "chunk-000").mkdir(parents=True, exist_ok=True)
        tmp = meta / "episodes" / "chunk-000" / ".file-000.parquet.tmp"
        pq.write_table(episodes, tmp)
        os.replace(tmp, meta / "episodes" / "chunk-000" / "file-000.parquet")
        shutil.copyfile(src / "meta" / "tasks.parquet", meta / "tasks.parquet")
        _atomic_write(meta / "stats.json", json.dumps(stats, indent=4).encode())
        _atomic_write(meta / "info.json", json.dumps(info, indent=4).encode())
        shutil.rmtree(self.staging)


def check_destination(dst: Path) -> None:
    """``dst`` can take a new dataset: it does not exist, is an empty folder, or holds an
    unfinished packing encode (whose job `LatentWriter` compares). Checked first, before
    the VAE is loaded, and again when the writer is made."""
    if dst.exists() and not dst.is_dir():
        raise EncodeError(f"destination {dst} is a file; pass a folder path for DST")
    if (dst / "meta" / "info.json").exists():
        raise EncodeError(
            f"destination {dst} already holds a dataset (meta/info.json); packing encode "
            "writes a new one: pass another DST or remove it"
        )
    if dst.exists() and not (dst / STAGING / "manifest.json").is_file() and any(dst.iterdir()):
        raise EncodeError(
            f"destination {dst} exists and is not empty; packing encode writes a new "
            "dataset: pass a new DST (or an unfinished packing encode's, to resume it)"
        )


def latent_stats(latents: np.ndarray) -> dict[str, Any]:
    """Per-channel min/max/mean/std/count of ``(L, C, h, w)`` latents, shaped ``(C, 1, 1)`` as
    lerobot keeps image stats (the latents a trainer normalises by)."""
    x = latents.astype(np.float64)
    axes = (0, 2, 3)
    return {
        "min": x.min(axis=axes)[:, None, None].tolist(),
        "max": x.max(axis=axes)[:, None, None].tolist(),
        "mean": x.mean(axis=axes)[:, None, None].tolist(),
        "std": x.std(axis=axes)[:, None, None].tolist(),
        "count": [len(x)],
    }


def _array3d(pa: Any, values: np.ndarray, arrow_type: Any) -> Any:
    """``(N, C, h, w)`` values as datasets' Array3D column (lists of lists of lists), the
    form lerobot's writer gives a 3-D feature."""
    n, c, h, w = values.shape
    arr = pa.array(np.ascontiguousarray(values).reshape(-1))
    for size, count in ((w, n * c * h), (h, n * c), (c, n)):
        offsets = np.arange(0, (count + 1) * size, size, dtype=np.int32)
        arr = pa.ListArray.from_arrays(offsets, arr)
    return pa.ExtensionArray.from_storage(arrow_type, arr)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
