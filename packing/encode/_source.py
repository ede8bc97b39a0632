"""The LeRobot v3 video dataset being encoded: its episodes, their rows and their video frames.

A v3 root keeps the frames of many episodes in one mp4 per camera; ``meta/episodes`` says
where each episode's span starts (``videos/{camera}/from_timestamp``), and a frame's time in
it is its row's ``timestamp``, the query lerobot's own reader makes::

    episode 1, camera front: videos/front/chunk-000/file-000.mp4, from_timestamp 0.9
    row timestamps 0.0 0.1 0.2  ->  decode_video_frames(mp4, [0.9, 1.0, 1.1], tol, "pyav")

Everything that can be checked before a frame is decoded is checked here, once, and named by
episode and file: cameras that are not videos, missing files, spans whose frame count is not
the episode's row count.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from packing._lazy import require
from packing._lerobot_v3 import check_root, episodes_table, load_info, read_parquet
from packing.encode._errors import EncodeError

__all__ = ["Episode", "Source"]

TOLERANCE_S = 1e-4  # LeRobotDataset's default: a decoded frame must be this close to its query


@dataclass(frozen=True)
class Episode:
    """One source episode: its index, rows (an Arrow table, every non-video column) and, per
    camera, the mp4 and the times of its frames in it."""

    index: int
    rows: Any
    videos: dict[str, tuple[Path, np.ndarray]]

    @property
    def length(self) -> int:
        return int(self.rows.num_rows)


class Source:
    """A LeRobot v3 root whose ``cameras`` (video features; all of them by default) are read."""

    def __init__(self, root: Path, cameras: tuple[str, ...] | None) -> None:
        check_root(root)
        self.root = root
        self.info = load_info(root)
        self.features: dict[str, dict[str, Any]] = self.info["features"]
        self.videos = [k for k, f in self.features.items() if f.get("dtype") == "video"]
        if cameras is None:
            if not self.videos:
                raise EncodeError(
                    f"{root} has no video feature (features: {sorted(self.features)}); "
                    "packing encode encodes camera videos: the dataset is already numeric, read "
                    "it with LeRobotEpisodes"
                )
            cameras = tuple(self.videos)
        for cam in cameras:
            if cam not in self.features:
                raise EncodeError(
                    f"--cameras {cam}: {root} has no feature {cam!r}; its video features are "
                    f"{self.videos}"
                )
            if cam not in self.videos:
                raise EncodeError(
                    f"--cameras {cam}: feature {cam!r} is {self.features[cam].get('dtype')}, not "
                    f"a video; pass video features only: {self.videos}"
                )
            if (self.features[cam].get("info") or {}).get("is_depth_map"):
                raise EncodeError(
                    f"--cameras {cam}: {cam!r} is a depth map; the VAE encodes RGB video: "
                    "leave it out of --cameras"
                )
        self.cameras = cameras
        self.fps = float(self.info["fps"])
        self.table = _episodes_table_with_videos(root, cameras)
        self.ids = self.table.column("episode_index").to_numpy().astype(np.int64)
        self.lengths = self.table.column("length").to_numpy().astype(np.int64)
        self._files: dict[Path, tuple[Any, np.ndarray, np.ndarray]] = {}  # see _rows
        self._check_videos()

    def frame_hw(self, cam: str) -> tuple[int, int]:
        """(H, W) of a camera's frames, from its feature's shape and names."""
        f = self.features[cam]
        shape, names = list(f["shape"]), list(f.get("names") or ["height", "width", "channels"])
        return int(shape[names.index("height")]), int(shape[names.index("width")])

    def _video_path(self, cam: str, j: int) -> Path:
        template = (
            self.info.get("video_path")
            or "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
        )
        chunk = self.table.column(f"videos/{cam}/chunk_index")[j].as_py()
        file = self.table.column(f"videos/{cam}/file_index")[j].as_py()
        return self.root / template.format(video_key=cam, chunk_index=chunk, file_index=file)

    def _check_videos(self) -> None:
        """Every episode's video file exists and its span holds as many frames as it has rows."""
        for j, ep in enumerate(self.ids):
            for cam in self.cameras:
                path = self._video_path(cam, j)
                if not path.is_file():
                    raise EncodeError(
                        f"episode {ep}: camera {cam!r}: its video {path} is missing; re-copy the "
                        "dataset's videos/ folder from its source"
                    )
                lo = self.table.column(f"videos/{cam}/from_timestamp")[j].as_py()
                hi = self.table.column(f"videos/{cam}/to_timestamp")[j].as_py()
                frames = round((hi - lo) * self.fps)
                if frames != self.lengths[j]:
                    raise EncodeError(
                        f"episode {ep}: camera {cam!r}: meta/episodes gives it {frames} video "
                        f"frames of {path} ([{lo:.4f}, {hi:.4f}) s at {self.fps:g} fps) but "
                        f"{self.lengths[j]} rows of data: frame counts disagree; re-create the "
                        "episode or drop it from the dataset"
                    )

    def episode(self, j: int) -> Episode:
        """The ``j``-th episode (by ``episode_index``): its rows, read once, and its videos."""
        ep = int(self.ids[j])
        template = self.info["data_path"]
        path = self.root / template.format(
            chunk_index=self.table.column("data/chunk_index")[j].as_py(),
            file_index=self.table.column("data/file_index")[j].as_py(),
        )
        rows = self._rows(ep, path, int(self.lengths[j]))
        ts = rows.column("timestamp").to_numpy().astype(np.float64)
        videos = {}
        for cam in self.cameras:
            start = self.table.column(f"videos/{cam}/from_timestamp")[j].as_py()
            videos[cam] = (self._video_path(cam, j), start + ts)
        return Episode(ep, rows, videos)

    def _rows(self, ep: int, path: Path, length: int) -> Any:
        """Episode ``ep``'s rows of data file ``path``: only the row groups holding them are
        read (lerobot writes one per episode); each file's episode_index column is read once."""
        if path not in self._files:
            if not path.is_file():
                raise EncodeError(f"episode {ep}: its data file {path} is missing")
            pq = require("pyarrow.parquet", extra=None)
            pf = read_parquet(path, lambda p: pq.ParquetFile(p, memory_map=True))
            ids = read_parquet(path, lambda p: pf.read(columns=["episode_index"]))
            sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
            offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            self._files[path] = (pf, ids.column(0).to_numpy(), offsets)
        pf, ids, offsets = self._files[path]
        mine = np.flatnonzero(ids == ep)
        if len(mine) != length or not length or np.any(np.diff(mine) != 1):
            raise EncodeError(
                f"episode {ep}: {path} holds {len(mine)} rows of it, meta/episodes says "
                f"{length} (contiguous): the data and the metadata disagree; re-create the "
                "episode's data"
            )
        lo, hi = int(mine[0]), int(mine[-1]) + 1
        first = int(np.searchsorted(offsets, lo, side="right")) - 1
        last = int(np.searchsorted(offsets, hi, side="left"))
        rows = pf.read_row_groups(list(range(first, last))).slice(lo - int(offsets[first]), hi - lo)
        if "frame_index" in rows.column_names:  # latents are stored by row: rows in time order
            order = rows.column("frame_index").to_numpy()
            if np.any(np.diff(order) <= 0):
                raise EncodeError(
                    f"episode {ep}: its rows in {path} are not in frame_index order; packing "
                    "encode keeps rows as stored: rewrite the episode in time order"
                )
        return rows


def decode(episode: Episode, cam: str, lo: int, hi: int) -> torch.Tensor:
    """Frames ``lo:hi`` of an episode's camera, ``(T, 3, H, W)`` uint8, by lerobot's own
    decoder (PyAV); a corrupt file or a frame not found is an `EncodeError` naming both."""
    video_utils = require("lerobot.datasets.video_utils", extra="encode")
    path, times = episode.videos[cam]
    try:
        frames = video_utils.decode_video_frames(
            path, times[lo:hi].tolist(), TOLERANCE_S, backend="pyav", return_uint8=True
        )
    except Exception as e:  # PyAV's and lerobot's errors, named for the user here
        raise EncodeError(
            f"episode {episode.index}: camera {cam!r}: decoding frames {lo}..{hi - 1} of {path} "
            f"failed ({type(e).__name__}: {' '.join(str(e).split())[:300]}); the video is "
            "corrupt or shorter than its rows: re-copy it from the dataset's source"
        ) from e
    return frames


def _episodes_table_with_videos(root: Path, cameras: tuple[str, ...]) -> Any:
    """meta/episodes (every column, stats included), sorted by episode_index; each camera's
    video columns must be there."""
    pa = require("pyarrow", extra=None)
    pq = require("pyarrow.parquet", extra=None)
    episodes_table(root)  # the same checks LeRobotEpisodes makes (files present, readable)
    files = sorted((root / "meta" / "episodes").glob("*/*.parquet"))
    table = pa.concat_tables([read_parquet(f, pq.read_table) for f in files])
    for cam in cameras:
        for col in ("chunk_index", "file_index", "from_timestamp", "to_timestamp"):
            if f"videos/{cam}/{col}" not in table.column_names:
                raise EncodeError(
                    f"{root}/meta/episodes has no column videos/{cam}/{col}: camera {cam!r} "
                    "has no video index (not a LeRobot v3 video dataset?)"
                )
    return table.sort_by("episode_index")
