"""Whole episodes from a local LeRobot v3 dataset, read as Arrow slices, never frame by frame.

LeRobot serves frames (``dataset[i]`` is one frame, or a fixed window around it); packing
needs whole episodes and their lengths before any data is read. A v3 root looks like::

    meta/info.json                           features {name: {dtype, shape}}, fps, data_path
    meta/episodes/chunk-*/file-*.parquet     one row per episode: length, data/chunk_index,
                                             data/file_index, dataset_from_index, dataset_to_index
    meta/tasks.parquet                       task_index -> task text
    data/chunk-*/file-*.parquet              one row per frame, episodes contiguous, one
                                             row group per episode (lerobot's writer)

``dataset_from_index`` counts rows across the data files in sorted order, so an episode is
rows ``[from - file_start, to - file_start)`` of its file. Three episodes of lengths
``[2, 4, 3]`` in one file::

    row            0 1 2 3 4 5 6 7 8
    episode_index  0 0 1 1 1 1 2 2 2      from/to: [0,2) [2,6) [6,9)
    item 1 = {"latents": (4, 48, 8, 16) float16, "action": (4, 14) float32,
              "episode_index": 1, "task": "open the drawer"}

Item values: each requested key as a tensor with the frame axis first in its declared dtype
(float16 stays float16; lerobot's own reader returns float32); a ``(1,)``-shaped feature is
``(F,)``. A boolean ``{key}_is_pad`` feature is served as ``{key}_loss_mask = ~is_pad``
(see `packing.datasets._arrow.plan_columns`). ``"task"`` is the text of the episode's first frame;
request ``"task_index"`` for per-frame tasks.

Reading needs only pyarrow (a core dependency of packing); lerobot is never imported for a
root path, and nothing is downloaded. A ``LeRobotDataset`` instance is read through its own memory-mapped Arrow table.
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from packing._latent import latent_count, latent_rows, latent_spec
from packing._lazy import require
from packing._lerobot_v3 import EPISODE_COLUMNS, check_root, episodes_table, load_info, read_parquet
from packing._validate import (
    check_bool,
    check_finite,
    check_int,
    check_path,
    check_sequence,
    is_int,
)
from packing.datasets._arrow import plan_columns, table_to_episode
from packing.datasets._parquet_pages import ColumnChunks, Unsupported, fixed_shape

__all__ = ["LeRobotEpisodes", "episode_lengths"]

_MAX_OPEN_FILES = 64  # parquet handles kept open per process (least recently used closed)


def _check_files_covered(
    root: Path, template: str, table: Any, rows: dict[Path, int], info: dict[str, Any]
) -> None:
    """Every data row belongs to an episode of ``meta/episodes``: per file, the episodes'
    lengths sum to the file's row count (from the footers, no data read). Metadata shortened
    consistently (lengths and indices) would otherwise serve fewer frames without a word."""
    chunk = table.column("data/chunk_index").to_numpy()
    file = table.column("data/file_index").to_numpy()
    length = table.column("length").to_numpy().astype(np.int64)
    pairs, inverse = np.unique(np.stack([chunk, file], axis=1), axis=0, return_inverse=True)
    per_pair = np.bincount(inverse.reshape(-1), weights=length, minlength=len(pairs))
    claimed = {
        root / template.format(chunk_index=int(c), file_index=int(f)): int(n)
        for (c, f), n in zip(pairs, per_pair, strict=True)
    }
    for path, n in rows.items():
        if claimed.get(path, 0) != n:
            raise ValueError(
                f"{path} holds {n:,} frames but meta/episodes assigns "
                f"{claimed.get(path, 0):,} to it: the metadata and the data disagree (edited or "
                "partly copied?); re-create meta/episodes from the data or re-copy the dataset"
            )
    total = info.get("total_frames")
    if isinstance(total, int) and total != sum(rows.values()):
        raise ValueError(
            f"{root / 'meta' / 'info.json'} says total_frames={total:,} but the data files hold "
            f"{sum(rows.values()):,} rows: the metadata and the data disagree; re-copy the dataset"
        )


def _select(ids: np.ndarray, episodes: Sequence[int] | None, where: object) -> np.ndarray:
    """Positions of ``episodes`` (by episode_index) among ``ids``, in the order given."""
    dup = np.flatnonzero(np.diff(np.sort(ids)) == 0)
    if len(dup):
        e = np.sort(ids)[dup[0]]
        raise ValueError(
            f"{where}: two episodes of meta/episodes carry episode_index {e}; both would be "
            "served as that episode (one noise and timestep key for two episodes): renumber "
            "the episodes so each index is unique"
        )
    if episodes is None:
        return np.arange(len(ids))
    episodes = check_sequence("episodes", episodes)
    if not len(episodes):
        raise ValueError(f"episodes=[] selects no episode of {where}; pass None for all of them")
    bad = [e for e in episodes if not is_int(e)]
    if bad:
        raise TypeError(f"episodes must be episode indices (ints), got {bad[:5]}")
    if len(set(map(int, episodes))) != len(episodes):
        twice = next(e for i, e in enumerate(episodes) if e in episodes[:i])
        raise ValueError(
            f"episodes lists episode {twice} twice; each episode is served once (its "
            "episode_index keys its noise and timesteps): remove the duplicate"
        )
    pos = {int(e): j for j, e in enumerate(ids)}
    missing = [int(e) for e in episodes if int(e) not in pos]
    if missing:
        raise KeyError(
            f"episodes {missing[:10]} are not in {where} "
            f"({len(ids)} episodes, indices {ids.min()}..{ids.max()})"
        )
    return np.array([pos[int(e)] for e in episodes], dtype=np.int64)


def _cache_folder(cache_dir: Any) -> Path:
    """``cache_dir`` as a folder that exists or can be made (a file there is refused now,
    not when the first item is read)."""
    path = Path(check_path("cache_dir", cache_dir)).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"cache_dir={cache_dir!r} is a file; pass a folder (it is created)")
    return path


def episode_lengths(
    root: str | os.PathLike[str], episodes: Sequence[int] | None = None
) -> np.ndarray:
    """Frames per episode from ``meta/episodes`` with pyarrow only; no frame is read.

    Ordered by ``episode_index`` (or as ``episodes`` lists them), the same order as the items
    of ``LeRobotEpisodes(root, keys, episodes=episodes)``::

        episode_lengths("~/data/my_robot")  ->  array([2, 4, 3])
    """
    root = Path(check_path("root", root)).expanduser()
    check_root(root)
    load_info(root)
    table = episodes_table(root)
    ids = table.column("episode_index").to_numpy()
    return table.column("length").to_numpy().astype(np.int64)[_select(ids, episodes, root)]


class _ParquetEpisodes:
    """Reads episode rows straight from the data files (root path; lerobot not needed).

    Parquet handles are opened lazily per process, so a DataLoader worker never shares a file
    object with its parent. With ``cache_dir`` each file's ``columns`` are decoded once into an
    Arrow IPC file there, memory-mapped and sliced without decoding.
    """

    def __init__(
        self,
        root: Path,
        info: dict[str, Any],
        table: Any,
        sel: np.ndarray,
        columns: list[str],
        cache_dir: Path | None = None,
    ) -> None:
        pq = require("pyarrow.parquet", extra=None)
        self.columns, self.cache_dir = list(columns), cache_dir
        data_files = sorted((root / "data").glob("*/*.parquet"))
        if not data_files:
            raise FileNotFoundError(f"{root / 'data'} has no chunk-*/file-*.parquet data files")
        # Global row numbers (dataset_from_index) run across the files in sorted order, the
        # order lerobot concatenates them in; the footers give each file's row count.
        footers = [read_parquet(f, pq.read_metadata) for f in data_files]
        rows = np.array([m.num_rows for m in footers], dtype=np.int64)
        for f, m in zip(data_files, footers, strict=True):  # a missing column, named here
            names = m.schema.to_arrow_schema().names
            missing = [c for c in self.columns if c not in names]
            if missing:
                raise KeyError(
                    f"{f} has no column {missing[0]!r}, which meta/info.json declares (the "
                    f"file's columns: {names}); re-write the file with every feature, or do "
                    "not request that key"
                )
        start = dict(zip(data_files, np.cumsum(rows) - rows, strict=True))
        nrows = dict(zip(data_files, rows, strict=True))

        col = {c: table.column(c).to_numpy()[sel] for c in EPISODE_COLUMNS}
        template = info.get(
            "data_path", "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
        )
        _check_files_covered(root, template, table, {f: int(n) for f, n in nrows.items()}, info)
        self.paths: list[Path] = []
        self.row0 = np.empty(len(sel), dtype=np.int64)
        for j in range(len(sel)):
            ep, lo, hi = (
                int(col[c][j]) for c in ("episode_index", "dataset_from_index", "dataset_to_index")
            )
            path = root / template.format(
                chunk_index=int(col["data/chunk_index"][j]),
                file_index=int(col["data/file_index"][j]),
            )
            if path not in start:
                raise FileNotFoundError(f"episode {ep}: its data file {path} is missing")
            r0 = lo - int(start[path])
            if hi - lo != col["length"][j] or r0 < 0 or r0 + (hi - lo) > nrows[path]:
                raise ValueError(
                    f"episode {ep}: meta/episodes says rows [{lo}, {hi}) (length "
                    f"{col['length'][j]}), which do not lie in {path} (global rows "
                    f"[{start[path]}, {start[path] + nrows[path]})); the metadata is inconsistent"
                )
            self.paths.append(path)
            self.row0[j] = r0
        self._open: OrderedDict[Path, tuple[Any, ...]] = OrderedDict()
        self._pid = os.getpid()
        self._features = [c for c in columns if c in info.get("features", {})]
        # Columns decoded by packing.datasets._parquet_pages vs by pyarrow (when a file's pages are
        # not ones it handles): a fallback is slower, never different, and it is counted.
        self.decode_counts = {"direct": 0, "pyarrow": 0}
        self._fell_back: set[str] = set()  # columns whose fallback was reported

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_open": OrderedDict()}

    def _file(self, path: Path) -> tuple[Any, ...]:
        """An open parquet file, its row-group offsets and its directly decodable columns
        (see `_direct_columns`), or a cached Arrow table and None."""
        if self._pid != os.getpid():  # forked: do not reuse the parent's handles
            self._open, self._pid = OrderedDict(), os.getpid()
        if path in self._open:
            self._open.move_to_end(path)
            return self._open[path]
        if self.cache_dir is not None:
            self._open[path] = (_arrow_cache(path, self.columns, self.cache_dir), None)
        else:
            pf = require("pyarrow.parquet", extra=None).ParquetFile(path, memory_map=True)
            sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
            offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            self._open[path] = (pf, offsets, self._direct_columns(path, pf))
        if len(self._open) > _MAX_OPEN_FILES:  # a big dataset must not exhaust file handles
            old = self._open.popitem(last=False)[1]
            if old[1] is not None:
                old[0].close()
        return self._open[path]

    def _direct_columns(self, path: Path, pf: Any) -> tuple[Any, dict[str, Any]]:
        """The file's bytes (memory-mapped, zero-copy), and the requested numeric columns
        that `packing.datasets._parquet_pages` can decode: name -> (`ColumnChunks`, numpy dtype, per-row
        shape).

        The per-row shape is the one the file's own Arrow schema guarantees (`fixed_shape`),
        or ``()`` for a flat column; a column without that guarantee is read by pyarrow. The
        declared shape is checked against what was read later, as for any read. Flat columns
        are decoded too: when every requested column is, no pyarrow reader is built per read
        (~1 ms each, more than decoding the two small columns)."""
        pa = require("pyarrow", extra=None)
        metadata = pf.metadata
        leaves: dict[str, list[int]] = {}
        for i in range(metadata.num_columns):
            leaves.setdefault(metadata.schema.column(i).path.split(".")[0], []).append(i)
        found: dict[str, Any] = {}
        for name in self._features:
            if len(leaves.get(name, ())) != 1:
                continue
            leaf = metadata.schema.column(leaves[name][0])
            dtype = _PHYSICAL_DTYPES.get(leaf.physical_type)
            if leaf.physical_type == "FIXED_LEN_BYTE_ARRAY" and str(leaf.logical_type) == "Float16":
                dtype = np.float16
            if leaf.max_repetition_level == 0:  # flat: only where Arrow's type is ours
                arrow = pf.schema_arrow.field(name).type
                numeric = pa.types.is_integer(arrow) or pa.types.is_floating(arrow)
                same = numeric and np.dtype(arrow.to_pandas_dtype()) == np.dtype(dtype)
                stored: tuple[int, ...] | None = () if dtype is not None and same else None
            else:
                stored = fixed_shape(pf.schema_arrow.field(name))
            if dtype is not None and stored is not None:
                found[name] = (ColumnChunks(metadata, leaves[name][0]), dtype, stored)
        buffer = pa.memory_map(str(path), "r").read_buffer() if found else None
        return None if buffer is None else np.frombuffer(buffer, dtype=np.uint8), found

    def read(self, j: int, length: int, columns: list[str]) -> tuple[Any, dict[str, np.ndarray]]:
        """Episode ``j``'s rows: an Arrow table of the columns read by pyarrow (``None`` when
        there are none) and ``{column: ndarray (length, *shape)}`` of those decoded directly."""
        source, rg, *direct = self._file(self.paths[j])
        r0 = int(self.row0[j])
        if rg is None:  # memory-mapped Arrow cache: a zero-copy slice
            return source.slice(r0, length).select(columns), {}
        # Only the row groups that overlap the episode are decoded (lerobot writes one per
        # episode). One thread: DataLoader workers are the parallelism.
        first = int(np.searchsorted(rg, r0, side="right")) - 1
        last = int(np.searchsorted(rg, r0 + length, side="left"))
        groups = list(range(first, last))
        path = self.paths[j]

        def read(_: Path) -> Any:
            return self._read_groups(
                path, source, direct, groups, columns, r0 - int(rg[first]), length
            )

        return read_parquet(path, read)  # type: ignore[no-any-return]

    def _read_groups(self, path: Path, source: Any, direct: Any, groups: list[int],
                     columns: list[str], start: int, length: int) -> Any:  # fmt: skip
        """Row groups ``groups``, fixed-shape columns decoded from their pages straight into
        one array each (no Arrow round trip), the rest through pyarrow. A column that falls
        back to pyarrow is counted and reported once, with the decoder's reason."""
        file, specs = direct[0]
        decoded: dict[str, np.ndarray] = {}
        for c in columns:
            if c not in specs:
                continue
            chunks, dtype, shape = specs[c]
            per_row = math.prod(shape)
            try:
                values = chunks.decode(file, groups, dtype, per_row)
            except Unsupported as e:
                self.decode_counts["pyarrow"] += 1
                self._report_fallback(path, c, str(e))
                continue
            self.decode_counts["direct"] += 1
            decoded[c] = values[start * per_row : (start + length) * per_row].reshape(
                length, *shape
            )
        rest = [c for c in columns if c not in decoded]
        if not rest:
            return None, decoded
        table = source.read_row_groups(groups, columns=rest, use_threads=False)
        return table.slice(start, length), decoded

    def _report_fallback(self, path: Path, column: str, why: str) -> None:
        if column in self._fell_back:
            return
        self._fell_back.add(column)
        warnings.warn(
            f"{path}: column {column!r} is read by pyarrow, not decoded from its pages ({why}); "
            "the values are the same, the reads several times slower (decode_counts counts "
            "them). Rewriting the data with lerobot's writer (data page v1, no nulls) or "
            "passing cache_dir= avoids it",
            stacklevel=7,  # the caller of dataset[i]
        )


_PHYSICAL_DTYPES = {"FLOAT": np.float32, "DOUBLE": np.float64, "INT32": np.int32, "INT64": np.int64}


def _arrow_cache(path: Path, columns: list[str], cache_dir: Path) -> Any:
    """``columns`` of parquet ``path`` as a memory-mapped Arrow table, converted once.

    The cache file name hashes the source's path, size and mtime and the columns, so a
    rewritten source gets a new file. Workers racing to convert each write a private temp
    file and atomically rename it; the loser's rename replaces an identical file.
    """
    pa = require("pyarrow", extra=None)
    pq = require("pyarrow.parquet", extra=None)
    st = path.resolve().stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{','.join(columns)}"
    name = f"{path.parent.name}-{path.stem}-{hashlib.sha1(ident.encode()).hexdigest()[:16]}"
    target = cache_dir / f"{name}.arrow"
    if not target.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        table = pq.read_table(path, columns=columns, use_threads=False)
        tmp = cache_dir / f".{name}.{os.getpid()}.tmp"
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        os.replace(tmp, target)
    return pa.ipc.open_file(pa.memory_map(str(target), "r")).read_all()


class _InstanceEpisodes:
    """Reads episode rows from a ``LeRobotDataset``'s own memory-mapped Arrow table."""

    def __init__(self, ds: Any, table: Any, sel: np.ndarray) -> None:
        lo = table.column("dataset_from_index").to_numpy()[sel]
        mapping = ds.absolute_to_relative_idx  # set only when the instance filters episodes
        self.row0 = np.array([lo_ if mapping is None else mapping[int(lo_)] for lo_ in lo])
        self._rows = ds.hf_dataset.with_format("arrow")  # drops lerobot's to-torch transform
        self._selected: dict[tuple[str, ...], Any] = {}

    def read(self, j: int, length: int, columns: list[str]) -> tuple[Any, dict[str, np.ndarray]]:
        key = tuple(columns)
        if key not in self._selected:
            self._selected[key] = self._rows.select_columns(columns)
        r0 = int(self.row0[j])
        return self._selected[key][r0 : r0 + length], {}


class LeRobotEpisodes(Dataset):
    """Episode-level ``torch`` dataset over a LeRobot v3 dataset: item ``i`` is one episode.

    Args:
        root_or_dataset: a local dataset root (read with pyarrow; lerobot not needed), or a
            ``lerobot.datasets.lerobot_dataset.LeRobotDataset`` (read through its Arrow table;
            its own ``episodes`` selection is respected).
        keys: numeric features to serve, e.g. ``["latents", "action"]``.
        episodes: episode indices to serve, in this order (default: all, by index).
        cache_dir: root path only. Each data file is decoded once, its requested columns
            written there as an uncompressed Arrow file and memory-mapped from then on (what
            lerobot's own loader does through ``datasets``): reads become zero-copy slices,
            ~8x cheaper for float16 latents, at the cost of disk space. ``None``: decode the
            parquet row groups of each episode on every read (fixed-shape numeric columns
            straight from their pages, docs/datasets.md), write nothing.
        check_finite: refuse an item whose features hold NaN or inf, naming the episode, the
            key and the first bad index (one reduction per feature).

    Attributes:
        lengths: frames per item (numpy int64), from metadata alone: the planner's input.
        episode_ids: the ``episode_index`` of each item.
        features, fps, tasks: from ``meta/``.

    Example::

        eps = LeRobotEpisodes("~/data/my_robot", keys=["latents", "action"])
        eps.lengths        # array([2, 4, 3])
        eps[1]["latents"]  # (4, 48, 8, 16) float16
    """

    def __init__(
        self,
        root_or_dataset: str | os.PathLike[str] | Any,
        keys: Sequence[str],
        episodes: Sequence[int] | None = None,
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        check_finite: bool = False,
    ) -> None:
        if isinstance(keys, str):
            raise TypeError(f"keys must be a list of feature names, got the string {keys!r}")
        self.keys = tuple(check_sequence("keys", keys, of=str))
        self.check_finite = check_bool("check_finite", check_finite)
        self._warned: set[str] = set()  # features whose lossy cast was reported
        if not self.keys:
            raise ValueError(
                "keys=[] requests no feature: items would hold only episode_index and task; "
                "name the features to serve, e.g. keys=['latents', 'action']"
            )
        if isinstance(root_or_dataset, (str, os.PathLike)):
            self.root = Path(root_or_dataset).expanduser()
            check_root(self.root)
            info = load_info(self.root)
            self.features: dict[str, dict[str, Any]] = info["features"]
            self.fps = info.get("fps")
            table = episodes_table(self.root)
            self.tasks = _tasks_from_parquet(self.root)
            where: object = self.root
        else:
            table, episodes = self._read_instance_meta(root_or_dataset, episodes)
            where = f"the LeRobotDataset {root_or_dataset.repo_id!r}"

        self._plan = plan_columns(self.keys, list(self.features))
        for _, column, _ in self._plan:
            self._check_numeric(column)
        ids = table.column("episode_index").to_numpy()
        sel = _select(ids, episodes, where)
        self.episode_ids = ids[sel].astype(np.int64)
        self.lengths = table.column("length").to_numpy()[sel].astype(np.int64)
        # episode_index is read back to prove the slice is the episode; task_index gives "task";
        # frame_index (when the dataset has it, as LeRobot's writer always does) orders frames.
        ids_cols = {"episode_index", "task_index"} | (
            {"frame_index"} if "frame_index" in self.features else set()
        )
        self._columns = sorted({c for _, c, _ in self._plan} | ids_cols)
        if isinstance(root_or_dataset, (str, os.PathLike)):
            cache = None if cache_dir is None else _cache_folder(cache_dir)
            self._reader: _ParquetEpisodes | _InstanceEpisodes = _ParquetEpisodes(
                self.root, info, table, sel, self._columns, cache
            )
        else:
            if cache_dir is not None:
                raise ValueError(
                    "cache_dir applies to a root path; a LeRobotDataset is already read from "
                    "its own Arrow cache"
                )
            self._reader = _InstanceEpisodes(root_or_dataset, table, sel)
        self._dtypes = {
            name: torch.from_numpy(np.empty(0, dtype=self.features[col]["dtype"])).dtype
            for name, col, invert in self._plan
            if not invert
        }
        self._latents = self._latent_specs(where)
        # Declared per-frame shape; a (1,) feature is served as (F,), like lerobot's scalars.
        self._shapes = {
            name: ()
            if tuple(self.features[col]["shape"]) == (1,)
            else tuple(self.features[col]["shape"])
            for name, col, _ in self._plan
        }

    def _latent_specs(self, where: object) -> dict[str, tuple[int, bool]]:
        """Latent features (packing encode) hold L latent frames on F video-frame rows:
        ``{name: (temporal_compression, padded)}``; each episode's F must encode exactly."""
        latents = {
            name: spec
            for name, col, _ in self._plan
            if (spec := latent_spec(self.features[col], col)) is not None
        }
        for name, (tc, pad) in latents.items():
            for ep, n in zip(self.episode_ids, self.lengths, strict=True):
                try:
                    latent_count(int(n), tc, pad=pad)
                except ValueError as e:
                    raise ValueError(
                        f"episode {ep} of {where}: latent feature {name!r}: {e}, but the "
                        "dataset says it was encoded without padding; re-encode it"
                    ) from None
        return latents

    def _read_instance_meta(self, ds: Any, episodes: Sequence[int] | None) -> tuple[Any, Any]:
        """Root, features, fps and tasks of a ``LeRobotDataset`` instance onto ``self``;
        returns (its episodes table sorted by id, the episodes to serve)."""
        if not hasattr(ds, "meta") or not hasattr(ds, "hf_dataset"):
            raise TypeError(
                f"expected a dataset root path or a lerobot LeRobotDataset, got {type(ds).__name__}"
            )
        if getattr(ds, "delta_timestamps", None):
            raise ValueError(
                "this LeRobotDataset has delta_timestamps (frame windows); LeRobotEpisodes "
                "serves whole episodes, so build it without delta_timestamps or pass its root"
            )
        self.root = Path(ds.root)
        self.features = dict(ds.meta.features)
        self.fps = ds.meta.fps
        table = ds.meta.episodes.with_format("arrow")[:].select(EPISODE_COLUMNS)
        tasks_df = ds.meta.tasks
        self.tasks = [""] * (int(tasks_df["task_index"].max()) + 1 if len(tasks_df) else 0)
        for text, idx in zip(tasks_df.index, tasks_df["task_index"], strict=True):
            self.tasks[int(idx)] = str(text)
        if episodes is None and ds.episodes is not None:
            episodes = list(ds.episodes)
        elif episodes is not None and ds.episodes is not None:
            episodes = check_sequence("episodes", episodes)
            bad = [e for e in episodes if not is_int(e)]
            if bad:  # int(1.5) would select episode 1
                raise TypeError(f"episodes must be episode indices (ints), got {bad[:5]}")
            outside = sorted(set(episodes) - set(map(int, ds.episodes)))
            if outside:
                raise KeyError(
                    f"episodes {outside[:10]} are not loaded by this LeRobotDataset "
                    f"(its episodes={list(ds.episodes)[:10]}...)"
                )
        return table.sort_by("episode_index"), episodes

    def _check_numeric(self, key: str) -> None:
        dtype = self.features[key]["dtype"]
        if dtype == "video":
            raise ValueError(
                f"feature {key!r} is stored as video; LeRobotEpisodes serves numeric features. "
                f"Encode the videos to latents with packing encode {self.root} <latent root> "
                f"--vae <path> --cameras {key} (docs/encode.md), then read <latent root> and "
                f"request {key + '.latent'!r}"
            )
        try:
            numeric = np.dtype(dtype).kind in "biuf"
        except TypeError:
            numeric = False
        if not numeric:
            raise ValueError(
                f"feature {key!r} has dtype {dtype!r}; LeRobotEpisodes serves numeric features "
                "(encode images to latents stored as a numeric feature)"
            )

    def __len__(self) -> int:
        return len(self.episode_ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        i = check_int("i", i, hint="an episode position; numpy ints too, not bools")
        if not -len(self) <= i < len(self):
            raise IndexError(f"episode position {i} out of range for {len(self)} episodes")
        i = i % len(self)
        ep, length = int(self.episode_ids[i]), int(self.lengths[i])
        table, arrays = self._reader.read(i, length, self._columns)
        column = arrays.get  # decoded from the pages, else read by pyarrow into `table`
        got = column("episode_index")
        if got is None:
            got = table.column("episode_index").to_numpy()
        if len(got) != length or (got != ep).any():
            raise RuntimeError(
                f"episode {ep}: the rows read from {self.root} belong to episodes "
                f"{sorted(set(got.tolist()))[:5]}, not {ep}; meta/episodes and data/ disagree"
            )
        rest = [p for p in self._plan if p[1] not in arrays]
        by_arrow = table_to_episode(table, rest) if rest else {}
        item: dict[str, Any] = {}
        for name, col, invert in self._plan:
            if col not in arrays:
                item[name] = by_arrow[name]
            else:  # numbers only: a boolean `_is_pad` column is read by pyarrow
                if invert:
                    raise TypeError(
                        f"{col!r} is {arrays[col].dtype}, but a '_is_pad' column must be "
                        f"boolean (True = padded frame) to become {name!r}"
                    )
                item[name] = torch.from_numpy(arrays[col])
        for name, want in self._dtypes.items():
            if item[name].dtype != want:  # stored type differs from the declared one
                self._check_cast(name, item[name].dtype, want)
                item[name] = item[name].to(want)
        for name, shape in self._shapes.items():
            if tuple(item[name].shape[1:]) != shape:
                raise ValueError(
                    f"episode {ep}: {name!r} has frames of shape {tuple(item[name].shape[1:])} "
                    f"but meta/info.json declares {shape or (1,)}"
                )
        order = self._frame_order(ep, table, arrays)
        if order is not None:  # rows out of time order: serve the frames by frame_index
            for name in self._shapes:
                item[name] = item[name][order]
        for name, (tc, pad) in self._latents.items():  # F rows -> the L latent frames
            rows = latent_rows(length, tc, pad=pad)
            _check_latent_rows(f"episode {ep} of {self.root}", name, item[name], rows, tc)
            item[name] = item[name][torch.from_numpy(rows)]
        if self.check_finite:
            for name in self._shapes:
                check_finite(f"episode {ep}", name, item[name])
        item["episode_index"] = ep
        task = column("task_index")
        task = table.column("task_index")[0].as_py() if task is None else task[0]
        item["task"] = self.tasks[int(task)]
        return item

    def _frame_order(self, ep: int, table: Any, arrays: dict[str, np.ndarray]) -> Any:
        """None when the rows are in ``frame_index`` order (LeRobot's writer keeps them so),
        else the permutation that puts them in it; a repeated frame index is refused."""
        if "frame_index" not in self._columns:
            return None
        frames = arrays.get("frame_index")
        if frames is None:
            frames = table.column("frame_index").to_numpy()
        step = np.diff(frames)
        if (step > 0).all():
            return None
        if (step == 0).any() or len(np.unique(frames)) != len(frames):
            raise ValueError(
                f"episode {ep} has a repeated frame_index in {self.root}: its frames have no "
                "time order; re-create the episode's data"
            )
        return torch.from_numpy(np.argsort(frames, kind="stable"))

    def _check_cast(self, name: str, stored: torch.dtype, declared: torch.dtype) -> None:
        """Items follow meta/info.json's dtype. A widening cast (float16 -> float32) is exact;
        a narrower float (float32 stored, float16 declared) rounds, said once; any other cast
        (float data declared int8, int64 declared int8) changes the values and is refused."""
        # promote_types(float16, float32) is float32: the declared type holds every stored value.
        if torch.promote_types(stored, declared) == declared:
            return
        if not (stored.is_floating_point and declared.is_floating_point):
            raise ValueError(
                f"{self.root}: feature {name!r} is stored as {stored} but meta/info.json "
                f"declares {declared}; casting would change the values (float data cast to an "
                f"integer type is truncated, mostly to 0): fix the dtype in meta/info.json "
                f"(to {str(stored).removeprefix('torch.')}) or rewrite the data"
            )
        warned = self._warned
        if name in warned:
            return
        warned.add(name)
        warnings.warn(
            f"{self.root}: feature {name!r} is stored as {stored} but meta/info.json declares "
            f"{declared}; items are cast to {declared} (the declared dtype), which can round. "
            "Fix the dtype in info.json or rewrite the data if that is not what you want",
            stacklevel=3,
        )

    def token_lengths(
        self, *, latent_key: str = "latents", **frames_to_tokens_kwargs: Any
    ) -> np.ndarray:
        """Tokens per item: ``packing.planning._plan.frames_to_tokens(self.lengths, **kwargs)``.

        ``latent_hw`` is the dataset's own: the last two dims of feature ``latent_key``'s
        declared shape (``(48, 8, 16)`` -> ``(8, 16)``). A ``latent_hw=`` that disagrees with
        it is refused (it would plan another number of tokens than the items hold); without
        the feature, ``latent_hw`` must be given. For a latent feature of ``packing encode``
        (F video-frame rows, L latent frames) the tokens count its L latent frames, the
        frames its items hold, so ``temporal_compression`` is the dataset's and not given."""
        from packing.planning import frames_to_tokens

        feature = self.features.get(latent_key)
        frames = self.lengths
        spec = None if feature is None else latent_spec(feature, latent_key)
        if spec is not None:
            if frames_to_tokens_kwargs.get("temporal_compression", 1) != 1:
                raise ValueError(
                    f"feature {latent_key!r} already holds latent frames (temporal compression "
                    f"{spec[0]}, from meta/info.json); drop temporal_compression="
                )
            frames = np.array([latent_count(int(n), spec[0], pad=spec[1]) for n in frames])
        shape = None if feature is None else tuple(feature["shape"])
        given = frames_to_tokens_kwargs.get("latent_hw")
        if shape is not None and len(shape) >= 2:
            real = (int(shape[-2]), int(shape[-1]))
            if given is not None and tuple(given) != real:
                raise ValueError(
                    f"latent_hw={tuple(given)} but feature {latent_key!r} has latents of shape "
                    f"{shape}, so latent_hw={real}; drop latent_hw= (it is read from the "
                    "dataset) or pass the latent_key of the feature you plan"
                )
            frames_to_tokens_kwargs["latent_hw"] = real
        elif given is None:
            raise ValueError(
                f"token_lengths: the dataset has no feature {latent_key!r} with a (.., H, W) "
                f"shape to read latent_hw from (features: {sorted(self.features)}); pass "
                "latent_hw=(H, W) or latent_key=<your latents feature>"
            )
        return np.asarray(frames_to_tokens(frames, **frames_to_tokens_kwargs), dtype=np.int64)


def _tasks_from_parquet(root: Path) -> list[str]:
    """``meta/tasks.parquet`` as a list: ``tasks[task_index]`` is the task text."""
    pq = require("pyarrow.parquet", extra=None)
    path = root / "meta" / "tasks.parquet"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: a v3 dataset stores its task texts there")
    table = read_parquet(path, pq.read_table)
    # pandas stores the task text as its index column: "task" (or __index_level_0__).
    text_col = next(c for c in table.column_names if c != "task_index")
    index = table.column("task_index").to_pylist()
    tasks = [""] * (max(index) + 1 if index else 0)
    for text, idx in zip(
        table.column(text_col).to_pylist(), table.column("task_index").to_pylist(), strict=True
    ):
        tasks[int(idx)] = str(text)
    return tasks


def _check_latent_rows(where: str, name: str, full: torch.Tensor, rows: np.ndarray,
                       tc: int) -> None:  # fmt: skip
    """A latent column holds its latent frames on ``rows`` and zeros on every other row
    (`packing._latent`). A ``temporal_compression`` in meta/info.json that is not the one
    the latents were written with puts ``rows`` elsewhere: some hold zeros, and latents sit
    on rows never served. Refused, naming the rows that do hold latents."""
    held = full.reshape(len(full), -1).ne(0).any(dim=1).numpy()
    expected = np.zeros(len(full), dtype=bool)
    expected[rows] = True
    if (held == expected).all():
        return
    real = np.flatnonzero(held)
    raise ValueError(
        f"{where}: latent feature {name!r}: meta/info.json's temporal_compression {tc} puts "
        f"its latent frames on rows {rows.tolist()[:8]}, but the rows holding latents are "
        f"{real.tolist()[:8]}: the dataset's metadata does not match its latents; re-encode it "
        "with packing encode, or correct temporal_compression in meta/info.json"
    )
