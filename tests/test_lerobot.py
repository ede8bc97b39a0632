"""LeRobotEpisodes: whole episodes of real LeRobot v3 datasets, written by lerobot's own writer.

Fixture values encode identity: ``action[t] == 100 * episode + t`` (every joint), so a test can
tell which episode and frame a row came from; latents are seeded normals in float16.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from packing.data import PackedCollator, Stream, unpack
from packing.datasets import LeRobotEpisodes, episode_lengths
from packing.datasets._default import (
    DEFAULT_LENGTHS,
    DEFAULT_TASKS,
    default_dataset_root,
    write_default_dataset,
)

# The reader needs only pyarrow; lerobot (its writer, LeRobotDataset) is the `lerobot` extra,
# which pins torch < 2.12: CI's newest-torch run has no lerobot, and every test that writes
# or opens a dataset through lerobot skips there, saying why. The rest runs everywhere.
try:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
except ImportError:
    LeRobotDataset = None

NO_LEROBOT = (
    "lerobot is not installed (pip install -e '.[lerobot]' -c constraints.txt; it needs torch < 2.12): "
    "CI's torch 2.11 run has it"
)
needs_lerobot = pytest.mark.skipif(LeRobotDataset is None, reason=NO_LEROBOT)

LENGTHS = (3, 7, 2, 5, 9, 4, 6)
TASKS = ("pick the cube", "open the drawer", "push the button")
LATENT = (48, 8, 16)
KEYS = ["latents", "action"]
REPO = "local/packing-test"


def write_lerobot(root: Path, lengths: tuple[int, ...], *, files_mb: float = 100.0) -> Path:
    """A v3 dataset written by lerobot's writer: float16 latents, action, action_is_pad, tasks."""
    features = {
        "latents": {"dtype": "float16", "shape": LATENT, "names": None},
        "action": {"dtype": "float32", "shape": (14,), "names": None},
        "action_is_pad": {"dtype": "bool", "shape": (1,), "names": None},
    }
    ds = LeRobotDataset.create(
        repo_id=REPO, fps=10, features=features, root=root, use_videos=False,
        data_files_size_in_mb=files_mb,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    for e, n in enumerate(lengths):
        for t in range(n):
            ds.add_frame(
                {
                    "latents": rng.standard_normal(LATENT).astype(np.float16),
                    "action": np.full(14, 100 * e + t, dtype=np.float32),
                    "action_is_pad": np.array([t == n - 1 and e % 2 == 1]),  # last step padded
                    "task": TASKS[e % len(TASKS)],
                }
            )
        ds.save_episode()
    ds.finalize()
    return root


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if LeRobotDataset is None:  # every test on a lerobot-written dataset
        pytest.skip(NO_LEROBOT)
    # ~12 KB of latents per frame and 0.25 MB files: several data files, some holding several
    # episodes, so per-file row offsets are exercised (asserted below, against a vacuous pass).
    r = write_lerobot(tmp_path_factory.mktemp("lr") / "ds", LENGTHS, files_mb=0.25)
    files = sorted((r / "data").glob("*/*.parquet"))
    assert len(files) > 1
    eps_per_file = [
        len(set(_pq().read_table(f, columns=["episode_index"])[0].to_pylist())) for f in files
    ]
    assert max(eps_per_file) > 1, eps_per_file
    return r


@pytest.fixture(scope="module")
def reference(root: Path) -> LeRobotDataset:
    return LeRobotDataset(REPO, root=root)


def _pq() -> Any:
    import pyarrow.parquet as pq

    return pq


def frames_of(ds: LeRobotDataset, episode: int) -> list[dict[str, Any]]:
    """lerobot's own frame-by-frame reader: the frames of one episode."""
    ep = ds.meta.episodes[episode]
    return [ds[i] for i in range(ep["dataset_from_index"], ep["dataset_to_index"])]


def assert_same_as_lerobot(item: dict[str, Any], frames: list[dict[str, Any]]) -> None:
    assert item["episode_index"] == int(frames[0]["episode_index"])
    assert item["task"] == frames[0]["task"]
    for key in KEYS:
        ref = torch.stack([f[key] for f in frames])
        got = item[key]
        assert got.shape == ref.shape, key
        # lerobot returns float32 for a float16 feature; ours keeps the declared dtype, and
        # float16 -> float32 is exact, so equality after the cast is bit equality.
        assert got.to(ref.dtype).equal(ref), key
    pad = torch.stack([f["action_is_pad"] for f in frames])
    assert item["action_loss_mask"].equal(~pad)


# -- round trip ---------------------------------------------------------------------------------


def test_root_path_round_trips_every_episode(root: Path, reference: LeRobotDataset) -> None:
    eps = LeRobotEpisodes(root, keys=KEYS)
    assert len(eps) == len(LENGTHS)
    for i in range(len(eps)):
        item = eps[i]
        assert item["latents"].dtype == torch.float16
        assert item["action"].dtype == torch.float32
        assert item["latents"].shape == (LENGTHS[i], *LATENT)
        assert item["action"][:, 0].tolist() == [100 * i + t for t in range(LENGTHS[i])]
        assert item["task"] == TASKS[i % len(TASKS)]
        assert_same_as_lerobot(item, frames_of(reference, i))
    # The columns pyarrow is slow on (nested float16 latents, action lists) were decoded from
    # their pages directly, never through the pyarrow fallback.
    counts = eps._reader.decode_counts  # type: ignore[union-attr]
    assert counts["direct"] >= 2 * len(LENGTHS) and counts["pyarrow"] == 0, counts


def test_a_column_pyarrow_must_read_is_announced(root: Path, tmp_path: Path) -> None:
    # Data page v2 is not decoded directly: the same values come through pyarrow, counted,
    # with one warning per column that says why.
    copy = tmp_path / "v2"
    shutil.copytree(root, copy)
    for f in sorted((copy / "data").glob("*/*.parquet")):
        table = _pq().read_table(f)
        _pq().write_table(table, f, data_page_version="2.0")
    direct, v2 = LeRobotEpisodes(root, keys=KEYS), LeRobotEpisodes(copy, keys=KEYS)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        items = [v2[i] for i in range(len(v2))]
    said = [str(w.message) for w in seen if "is read by pyarrow" in str(w.message)]
    # once per column (not per read), each naming the reason; the warning points at the caller
    for column in ("latents", "action", "episode_index", "task_index"):
        assert sum(f"column {column!r}" in m and "(data page v2)" in m for m in said) == 1, said
    assert all(w.filename == __file__ for w in seen if "is read by pyarrow" in str(w.message))
    for i, item in enumerate(items):
        want = direct[i]
        for key in KEYS:
            assert item[key].dtype == want[key].dtype and item[key].equal(want[key]), key
        assert item["task"] == want["task"]
    # only episode_index / task_index, where a row group holds one value (from the footer)
    assert v2._reader.decode_counts["direct"] <= 2 * len(items)  # type: ignore[union-attr]
    assert v2._reader.decode_counts["pyarrow"] >= len(LENGTHS)  # type: ignore[union-attr]


def test_instance_round_trips_like_root(root: Path, reference: LeRobotDataset) -> None:
    by_root = LeRobotEpisodes(root, keys=KEYS)
    by_instance = LeRobotEpisodes(reference, keys=KEYS)
    assert by_instance.lengths.tolist() == list(LENGTHS)
    for i in range(len(by_root)):
        a, b = by_root[i], by_instance[i]
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], torch.Tensor):
                assert a[k].dtype == b[k].dtype and a[k].equal(b[k]), k
            else:
                assert a[k] == b[k], k


def test_scalar_features_are_one_axis(root: Path, reference: LeRobotDataset) -> None:
    item = LeRobotEpisodes(root, keys=["timestamp", "frame_index", "task_index"])[4]
    frames = frames_of(reference, 4)
    for key in ("timestamp", "frame_index", "task_index"):
        assert item[key].shape == (LENGTHS[4],)
        assert item[key].equal(torch.stack([f[key] for f in frames])), key
    assert item["frame_index"].tolist() == list(range(LENGTHS[4]))


# -- lengths ------------------------------------------------------------------------------------


def test_lengths_equal_metadata(root: Path, reference: LeRobotDataset) -> None:
    meta = [int(n) for n in reference.meta.episodes["length"]]
    assert meta == list(LENGTHS)
    assert episode_lengths(root).tolist() == meta
    assert episode_lengths(str(root), episodes=[5, 1]).tolist() == [LENGTHS[5], LENGTHS[1]]
    eps = LeRobotEpisodes(root, keys=["action"])
    assert eps.lengths.dtype == np.int64 and eps.lengths.tolist() == meta
    assert [len(eps[i]["action"]) for i in range(len(eps))] == meta


def test_token_lengths_use_the_planners_formula(root: Path) -> None:
    from packing.planning import _plan as plan

    eps = LeRobotEpisodes(root, keys=["latents"])
    kw = {"latent_hw": (8, 16), "patch": (1, 2, 2), "action_tokens_per_frame": 1}
    want = [int(plan.frames_to_tokens(int(n), **kw)) for n in LENGTHS]
    assert eps.token_lengths(**kw).tolist() == want
    assert want[0] == LENGTHS[0] * (32 + 1)


# -- selection ----------------------------------------------------------------------------------


def test_episode_filter_keeps_the_given_order(root: Path) -> None:
    full = LeRobotEpisodes(root, keys=KEYS)
    sub = LeRobotEpisodes(root, keys=KEYS, episodes=[4, 0, 6])
    assert sub.episode_ids.tolist() == [4, 0, 6]
    assert sub.lengths.tolist() == [LENGTHS[4], LENGTHS[0], LENGTHS[6]]
    for j, e in enumerate([4, 0, 6]):
        assert sub[j]["episode_index"] == e
        assert sub[j]["latents"].equal(full[e]["latents"])
    assert sub[-1]["episode_index"] == 6
    with pytest.raises(IndexError, match="out of range for 3 episodes"):
        sub[3]


def test_filtered_instance_is_respected(root: Path, reference: LeRobotDataset) -> None:
    filtered = LeRobotDataset(REPO, root=root, episodes=[5, 2])
    eps = LeRobotEpisodes(filtered, keys=KEYS)
    assert sorted(eps.episode_ids.tolist()) == [2, 5]
    for i in range(len(eps)):
        assert_same_as_lerobot(eps[i], frames_of(reference, int(eps.episode_ids[i])))
    with pytest.raises(KeyError, match=r"episodes \[0\] are not loaded"):
        LeRobotEpisodes(filtered, keys=KEYS, episodes=[0, 2])


# -- loss masks ---------------------------------------------------------------------------------


def test_is_pad_becomes_a_loss_mask_and_nothing_padded_reaches_the_loss(root: Path) -> None:
    eps = LeRobotEpisodes(root, keys=["action"])
    items = [eps[i] for i in range(len(eps))]
    assert list(items[1]) == [
        "action",
        "action_loss_mask",
        "episode_index",
        "task",
    ]  # only the inverted, unambiguous form is served
    assert items[1]["action_loss_mask"].tolist() == [True] * (LENGTHS[1] - 1) + [False]
    assert items[0]["action_loss_mask"].all()
    # Requested by its own name it is still served inverted, under the mask name.
    alone = LeRobotEpisodes(root, keys=["action_is_pad"])[1]
    assert list(alone) == ["action_loss_mask", "episode_index", "task"]

    batch = PackedCollator(["action", "action_loss_mask"], pad_to_multiple=16)(items)
    mask = batch["action_loss_mask"]
    assert mask.dtype == torch.bool and len(mask) > sum(LENGTHS)  # tail padding exists
    assert not mask[sum(LENGTHS) :].any()  # padding never counts
    # A masked sum over the pack equals the sum over real, unpadded targets per episode.
    packed = (batch["action"][:, 0] * mask).sum()
    direct = sum((it["action"][:, 0] * it["action_loss_mask"]).sum() for it in items)
    assert packed == direct
    assert int(mask.sum()) == sum(LENGTHS) - sum(1 for e in range(len(LENGTHS)) if e % 2)


def test_the_loss_mask_key_the_docs_name_is_in_an_adapter_batch(root: Path) -> None:
    # packing.train._losses and docs/losses.md tell users to pass batch["action_loss_mask"]; it must be
    # what the adapter serves (the docs once said ~batch["action_is_pad"]: a KeyError).
    import packing.train._losses
    from packing.train import LossNormalizer

    docs = (Path(__file__).resolve().parents[1] / "docs" / "losses.md").read_text()
    assert 'b["action_loss_mask"]' in (packing.train._losses.LossNormalizer.__doc__ or "")
    assert 'batch["action_loss_mask"]' in docs and '~batch["action_is_pad"]' not in docs
    eps = LeRobotEpisodes(root, keys=["action"])
    collate = PackedCollator(["action", "action_loss_mask"], pad_to_multiple=16)
    micro = [collate([eps[i] for i in pack]) for pack in ([0, 1], [2, 3])]
    # The documented loop, as LossNormalizer's docstring shows it.
    norm = LossNormalizer.for_step(
        [b.layout("action") for b in micro], "episode", [b["action_loss_mask"] for b in micro]
    )
    total = sum(
        float(norm(b["action"][:, 0].float() ** 2, b.layout("action"), b["action_loss_mask"]))
        for b in micro
    )
    assert norm.denominator == 4 and total > 0  # four episodes, each with real actions


# -- DataLoader -----------------------------------------------------------------------------------


# The test process has lerobot (and its threads) loaded for the reference reader; a user's
# process that reads by root path has no extra threads when the workers fork.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("source", ["root", "root+cache", "instance"])
def test_multiworker_dataloader_with_packed_collate(
    root: Path, reference: LeRobotDataset, source: str, tmp_path: Path
) -> None:
    if source == "instance":
        eps = LeRobotEpisodes(reference, keys=KEYS)
    else:
        eps = LeRobotEpisodes(root, keys=KEYS, cache_dir=tmp_path if "cache" in source else None)
    packs = [[4, 0], [1, 2, 6], [3], [5]]  # a batch sampler: lists of item positions
    collate = PackedCollator(
        [Stream("latents", grid=(4, 8)), Stream("action"), Stream("action_loss_mask")],
        pad_to_multiple=64,
    )
    loader = DataLoader(eps, batch_sampler=packs, collate_fn=collate, num_workers=2)
    seen = []
    for pack, batch in zip(packs, loader, strict=True):
        assert batch["episode_index"].tolist() == pack
        assert batch["latents"].dtype == torch.float16
        lat = batch.layout("latents")
        assert lat.steps_K == tuple(LENGTHS[i] for i in pack)
        assert lat.lengths_K == tuple(32 * LENGTHS[i] for i in pack)
        for i, ep in zip(pack, unpack(batch), strict=True):
            want = eps[i]
            assert ep["task"] == want["task"]
            for k in ("latents", "action", "action_loss_mask"):
                assert ep[k].dtype == want[k].dtype and ep[k].equal(want[k]), (i, k)
            seen.append(i)
    assert sorted(seen) == list(range(len(LENGTHS)))


# -- one-frame episodes -------------------------------------------------------------------------


@needs_lerobot
def test_one_frame_episodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any length, including 1. lerobot 0.6.1's writer cannot compute and aggregate the stats
    of a one-frame episode with a multi-dimensional feature, so its per-episode stats are
    computed over the frame written twice (same min/max/mean/quantiles); the data files and
    the episode metadata are still written by lerobot's writer.
    """
    from lerobot.datasets import dataset_writer

    real_stats = dataset_writer.compute_episode_stats

    def stats_of_one_frame_as_two(data: dict[str, Any], features: dict, *a: Any, **k: Any) -> dict:
        def twice(v: Any) -> Any:
            return np.concatenate([v, v]) if isinstance(v, np.ndarray) and len(v) == 1 else v

        return real_stats({key: twice(v) for key, v in data.items()}, features, *a, **k)

    monkeypatch.setattr(dataset_writer, "compute_episode_stats", stats_of_one_frame_as_two)
    lengths = (3, 1, 2, 1)
    r = write_lerobot(tmp_path / "ds", lengths)
    reference = LeRobotDataset(REPO, root=r)
    eps = LeRobotEpisodes(r, keys=KEYS)
    assert eps.lengths.tolist() == list(lengths) == episode_lengths(r).tolist()
    for i in range(len(eps)):
        assert eps[i]["latents"].shape == (lengths[i], *LATENT)
        assert_same_as_lerobot(eps[i], frames_of(reference, i))


# -- offline and lazy imports ---------------------------------------------------------------------


def test_reads_offline_without_importing_lerobot_or_datasets(root: Path) -> None:
    code = textwrap.dedent(
        f"""
        import socket, sys
        def no_network(*a, **k):
            raise OSError("network access attempted")
        socket.socket.connect = no_network
        socket.create_connection = no_network
        import packing, packing.datasets._lerobot, packing.datasets._hf, packing.datasets._default, packing._lazy
        from packing.datasets import LeRobotEpisodes, episode_lengths
        assert "lerobot" not in sys.modules and "datasets" not in sys.modules
        eps = LeRobotEpisodes({str(root)!r}, keys=["latents", "action"])
        assert eps[1]["latents"].shape[0] == {LENGTHS[1]}
        assert episode_lengths({str(root)!r}).tolist() == {list(LENGTHS)}
        d = LeRobotEpisodes(packing.datasets._default.default_dataset_root(), keys=["latents"])
        assert d[0]["latents"].dtype.is_floating_point
        bad = [m for m in ("lerobot", "datasets") if m in sys.modules]
        assert not bad, bad
        print("ok")
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_missing_optional_dependency_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from packing._lazy import require

    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import of it now fails
    with pytest.raises(ModuleNotFoundError, match=r"pip install -e '\.\[lerobot\]' -c constraints"):
        require("pyarrow", extra="lerobot")


# -- errors ---------------------------------------------------------------------------------------


def test_wrong_root_fails_before_anything_is_created(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "dataset"
    with pytest.raises(FileNotFoundError, match=r"dataset does not exist.*meta/info\.json"):
        LeRobotEpisodes(missing, keys=KEYS)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        episode_lengths(missing)
    assert not (tmp_path / "no").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"has no meta/info\.json"):
        LeRobotEpisodes(empty, keys=KEYS)
    assert list(empty.iterdir()) == []
    # A hub repo id is not a local root: no download is attempted, nothing is created.
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(FileNotFoundError, match="lerobot/pusht does not exist"):
            LeRobotEpisodes("lerobot/pusht", keys=KEYS)
        assert not (tmp_path / "lerobot").exists()
    finally:
        os.chdir(cwd)


def test_unknown_key_lists_the_features(root: Path) -> None:
    with pytest.raises(KeyError, match=r"unknown key 'latent'.*'latents', 'action'"):
        LeRobotEpisodes(root, keys=["latent", "action"])
    with pytest.raises(ValueError, match="always returned as a per-episode value"):
        LeRobotEpisodes(root, keys=["latents", "episode_index"])
    with pytest.raises(TypeError, match="list of feature names"):
        LeRobotEpisodes(root, keys="latents")


def test_unknown_episode_is_named(root: Path) -> None:
    with pytest.raises(KeyError, match=r"episodes \[99\] are not in"):
        LeRobotEpisodes(root, keys=KEYS, episodes=[0, 99])
    with pytest.raises(KeyError, match=r"episodes \[-1\]"):
        episode_lengths(root, episodes=[-1])


def _copy_with_info(root: Path, dest: Path, edit: Any) -> Path:
    shutil.copytree(root, dest)
    info_path = dest / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    edit(info)
    info_path.write_text(json.dumps(info))
    return dest


def test_video_feature_points_to_the_latent_workflow(root: Path, tmp_path: Path) -> None:
    def add_camera(info: dict[str, Any]) -> None:
        info["features"]["observation.images.top"] = {
            "dtype": "video", "shape": [3, 96, 128], "names": ["channels", "height", "width"],
        }  # fmt: skip

    r = _copy_with_info(root, tmp_path / "video", add_camera)
    with pytest.raises(ValueError, match=r"'observation.images.top' is stored as video.*latents"):
        LeRobotEpisodes(r, keys=["observation.images.top"])
    # Other keys of a dataset with cameras still work.
    assert LeRobotEpisodes(r, keys=["action"])[0]["action"].shape == (LENGTHS[0], 14)


def test_old_format_is_refused_with_the_conversion(root: Path, tmp_path: Path) -> None:
    r = _copy_with_info(root, tmp_path / "v21", lambda i: i.update(codebase_version="v2.1"))
    with pytest.raises(ValueError, match=r"format v2\.1.*convert_dataset_v21_to_v30"):
        LeRobotEpisodes(r, keys=KEYS)


def test_inconsistent_metadata_is_caught(root: Path, tmp_path: Path) -> None:
    """An episode table that points at the wrong rows is an error, never a silent mix."""
    pq = _pq()
    r = tmp_path / "bad"
    shutil.copytree(root, r)
    path = next((r / "meta" / "episodes").glob("*/*.parquet"))
    table = pq.read_table(path)
    lo = table.column("dataset_from_index").to_numpy().copy()
    hi = table.column("dataset_to_index").to_numpy().copy()
    lo[2], hi[2] = lo[1], lo[1] + LENGTHS[2]  # episode 2 now claims episode 1's rows
    table = table.set_column(
        table.schema.get_field_index("dataset_from_index"), "dataset_from_index", [lo]
    )
    table = table.set_column(
        table.schema.get_field_index("dataset_to_index"), "dataset_to_index", [hi]
    )
    pq.write_table(table, path)
    eps = LeRobotEpisodes(r, keys=KEYS)
    with pytest.raises((RuntimeError, ValueError), match="episode 2"):
        eps[2]


def test_delta_timestamps_instance_is_refused(root: Path) -> None:
    windowed = LeRobotDataset(REPO, root=root, delta_timestamps={"action": [0.0, 0.1]})
    with pytest.raises(ValueError, match="delta_timestamps"):
        LeRobotEpisodes(windowed, keys=KEYS)


def test_not_a_dataset_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="root path or a lerobot LeRobotDataset"):
        LeRobotEpisodes(42, keys=KEYS)


# -- the embedded default dataset -------------------------------------------------------------------


@needs_lerobot
def test_default_dataset_ships_and_reads_like_lerobot() -> None:
    r = default_dataset_root()
    size = sum(p.stat().st_size for p in r.rglob("*") if p.is_file())
    assert size < 2_000_000
    eps = LeRobotEpisodes(r, keys=["latents", "action"])
    assert eps.lengths.tolist() == list(DEFAULT_LENGTHS)
    assert len(set(DEFAULT_LENGTHS)) > 5 and min(DEFAULT_LENGTHS) == 2 and max(DEFAULT_LENGTHS) == 9
    assert {eps[i]["task"] for i in range(len(eps))} == set(DEFAULT_TASKS)
    reference = LeRobotDataset("packing/default", root=r)
    for i in range(len(eps)):
        item = eps[i]
        assert item["latents"].dtype == torch.float16 and item["latents"].shape[1:] == (48, 8, 16)
        assert item["action"].dtype == torch.float32 and item["action"].shape[1:] == (14,)
        frames = frames_of(reference, i)
        assert item["task"] == frames[0]["task"] == DEFAULT_TASKS[i % 3]
        for k in ("latents", "action"):
            assert item[k].to(torch.float32).equal(torch.stack([f[k] for f in frames])), (i, k)


@needs_lerobot
def test_default_dataset_regenerates_identically(tmp_path: Path) -> None:
    shipped = LeRobotEpisodes(default_dataset_root(), keys=["latents", "action"])
    fresh = LeRobotEpisodes(write_default_dataset(tmp_path / "default"), keys=["latents", "action"])
    assert fresh.lengths.tolist() == shipped.lengths.tolist()
    for i in range(len(shipped)):
        a, b = shipped[i], fresh[i]
        assert a["task"] == b["task"]
        assert a["latents"].equal(b["latents"]) and a["action"].equal(b["action"]), i
    with pytest.raises(ValueError, match="shorter than 2 frames"):
        write_default_dataset(tmp_path / "x", lengths=(3, 1))


# -- the end-to-end example ---------------------------------------------------------------------------


def test_training_example_runs_on_the_default_dataset() -> None:
    """docs/example_lerobot_training.py, imported and run: it cannot rot unnoticed."""
    import runpy

    path = Path(__file__).resolve().parents[1] / "docs" / "example_lerobot_training.py"
    main = runpy.run_path(str(path))["main"]
    out = main(["--epochs", "1", "--workers", "0", "--token-budget", "1024"])
    assert out["steps"] >= 2  # several packs, so several episodes share a pack
    assert sorted(out["episodes_seen"]) == list(range(out["num_episodes"]))  # one epoch, each once
    assert all(np.isfinite(out["losses"]))


def test_declared_shapes_and_dtypes_are_enforced(root: Path, tmp_path: Path) -> None:
    def edit(info: dict[str, Any]) -> None:
        info["features"]["action"]["shape"] = [7, 2]  # 14 values, but not the stored shape
        info["features"]["language"] = {"dtype": "string", "shape": [1], "names": None}

    r = _copy_with_info(root, tmp_path / "shape", edit)
    with pytest.raises(
        ValueError, match=r"'action' has frames of shape \(14,\).*declares \(7, 2\)"
    ):
        LeRobotEpisodes(r, keys=["action"])[0]
    with pytest.raises(ValueError, match=r"'language' has dtype 'string'.*numeric"):
        LeRobotEpisodes(r, keys=["language"])


def test_file_handles_are_bounded(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import packing.datasets._lerobot as lr

    monkeypatch.setattr(lr, "_MAX_OPEN_FILES", 1)
    eps, full = LeRobotEpisodes(root, keys=["action"]), LeRobotEpisodes(root, keys=["action"])
    order = [6, 0, 3, 6, 1, 5, 0, 2, 4]  # jumps between files, so handles are closed and reopened
    for i in order:
        assert eps[i]["action"].equal(full[i]["action"])
        assert len(eps._reader._open) == 1  # type: ignore[union-attr]


def test_arrow_cache_reads_the_same_and_is_reused(root: Path, tmp_path: Path) -> None:
    plain = LeRobotEpisodes(root, keys=KEYS)
    cached = LeRobotEpisodes(root, keys=KEYS, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()  # converted lazily, on first read of a file
    for i in range(len(plain)):
        a, b = plain[i], cached[i]
        for k in a:
            if isinstance(a[k], torch.Tensor):
                assert a[k].dtype == b[k].dtype and a[k].equal(b[k]), (i, k)
            else:
                assert a[k] == b[k]
    files = sorted((tmp_path / "cache").glob("*.arrow"))
    assert len(files) == len(list((root / "data").glob("*/*.parquet"))) > 1
    stamps = [f.stat().st_mtime_ns for f in files]
    again = LeRobotEpisodes(root, keys=KEYS, cache_dir=tmp_path / "cache")
    assert again[3]["latents"].equal(plain[3]["latents"])
    assert [f.stat().st_mtime_ns for f in files] == stamps  # reused, not rewritten
    other_keys = LeRobotEpisodes(root, keys=["action"], cache_dir=tmp_path / "cache")
    other_keys[0]
    assert len(list((tmp_path / "cache").glob("*.arrow"))) == len(files) + 1  # own columns
    assert not list((tmp_path / "cache").glob(".*.tmp"))
    with pytest.raises(ValueError, match="cache_dir applies to a root path"):
        LeRobotEpisodes(LeRobotDataset(REPO, root=root), keys=KEYS, cache_dir=tmp_path)
