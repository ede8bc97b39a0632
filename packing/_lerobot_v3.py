"""The LeRobot v3 on-disk layout, read the one way every part of packing reads it.

The dataset reader (`packing.datasets.LeRobotEpisodes`), ``packing encode`` (which reads a
source dataset's episodes and writes a latent one) and ``packing verify --data`` all start
here, so a root is checked, and a broken file named, the same way everywhere::

    <root>/meta/info.json                   features {name: {dtype, shape}}, codebase_version v3.x
    <root>/meta/episodes/chunk-*/file-*.parquet   one row per episode (EPISODE_COLUMNS)
    <root>/data/chunk-*/file-*.parquet      one row per frame

Reading needs only pyarrow (imported when a table is read); lerobot is never imported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from packing._latent import ENCODE_STAGING
from packing._lazy import require

__all__ = ["EPISODE_COLUMNS", "check_root", "episodes_table", "load_info", "read_parquet"]

EPISODE_COLUMNS = [
    "episode_index",
    "length",
    "data/chunk_index",
    "data/file_index",
    "dataset_from_index",
    "dataset_to_index",
]


def check_root(root: Path) -> None:
    """Fail before anything (lerobot included) can create directories or reach the network."""
    info = root / "meta" / "info.json"
    if not info.is_file() and (root / ENCODE_STAGING / "manifest.json").is_file():
        raise FileNotFoundError(
            f"{root} is an unfinished packing encode (no meta/info.json yet; "
            f"{root / ENCODE_STAGING} holds its manifest): run the same packing encode "
            "command again to finish it"
        )
    if not info.is_file():
        what = "does not exist" if not root.exists() else f"has no {info.relative_to(root)}"
        raise FileNotFoundError(
            f"{root} {what}: expected a local LeRobot v3 dataset root containing "
            "meta/info.json, meta/episodes/ and data/ (LeRobotEpisodes reads local files or a "
            "LeRobotDataset instance, and never downloads). A hub dataset is downloaded first "
            "(huggingface-cli download --repo-type dataset <repo_id> --local-dir <root>); its "
            "camera videos are then encoded to latents with packing encode <root> "
            "<latent root> --vae <path> (docs/encode.md): pass <latent root>"
        )


def load_info(root: Path) -> dict[str, Any]:
    path = root / "meta" / "info.json"
    try:
        info: dict[str, Any] = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{path} is not valid JSON ({e}); the file is truncated or corrupt: restore it from "
            "the dataset's source or re-create the dataset"
        ) from e
    if not isinstance(info, dict) or not isinstance(info.get("features"), dict):
        raise ValueError(
            f"{path} has no 'features' table ({{name: {{dtype, shape}}}}); it is not a LeRobot "
            "info.json: restore it from the dataset's source or re-create the dataset"
        )
    version = str(info.get("codebase_version", "?"))
    if not version.startswith("v3"):
        raise ValueError(
            f"{root} is LeRobot format {version}; LeRobotEpisodes reads v3.x. Convert it with "
            "python -m lerobot.datasets.v30.convert_dataset_v21_to_v30"
        )
    return info


def episodes_table(root: Path) -> Any:
    """meta/episodes rows (no stats columns), sorted by episode_index."""
    pq = require("pyarrow.parquet", extra=None)
    pa = require("pyarrow", extra=None)
    files = sorted((root / "meta" / "episodes").glob("*/*.parquet"))
    if not files:
        raise FileNotFoundError(
            f"{root / 'meta' / 'episodes'} has no chunk-*/file-*.parquet: "
            "the dataset was not finalized (call LeRobotDataset.finalize() after recording)"
        )
    # Columnar read: the per-episode stats columns, most of the bytes, are never decoded.
    table = pa.concat_tables(
        [read_parquet(f, lambda f: pq.read_table(f, columns=EPISODE_COLUMNS)) for f in files]
    )
    return table.sort_by("episode_index")


def read_parquet(path: Path, read: Any) -> Any:
    """``read(path)``, with an error that names the file when it is not readable parquet."""
    try:
        return read(path)
    except (OSError, ValueError, KeyError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(
            f"{path}: cannot read it as parquet ({' '.join(str(e).split())[:200]}); the file is "
            "truncated, corrupt or lacks a column LeRobot v3 writes: re-copy it from the "
            "dataset's source or re-create the dataset"
        ) from e
