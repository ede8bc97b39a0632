"""HFEpisodes: whole episodes from a plain ``datasets.Dataset`` with an episode column.

Fixture values encode identity: ``action[r] == 100 * episode + t`` for the t-th row of an
episode, so a test can tell which episode and frame a row came from.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from packing.data import PackedCollator, Stream, unpack
from packing.datasets._arrow import arrow_to_numpy, plan_columns
from packing.datasets._hf import HFEpisodes, group_rows

datasets = pytest.importorskip(
    "datasets", reason="datasets is not installed (pip install -e '.[hf]'); CI installs it"
)
pa = pytest.importorskip("pyarrow")

LATENT = (4, 2, 3)
FEATURES = datasets.Features(
    {
        "episode_index": datasets.Value("int64"),
        "latents": datasets.Array3D(LATENT, "float16"),
        "action": datasets.Sequence(datasets.Value("float32"), length=5),
        "action_is_pad": datasets.Value("bool"),
        "task": datasets.Value("string"),
        "note": datasets.Value("string"),
    }
)


def make_rows(episode_of_row: list[int], seed: int = 0) -> datasets.Dataset:
    """Rows in the given (possibly interleaved) episode order; values encode (episode, t)."""
    rng = np.random.default_rng(seed)
    seen: dict[int, int] = {}
    cols: dict[str, list] = {k: [] for k in FEATURES}
    for e in episode_of_row:
        t = seen.get(e, 0)
        seen[e] = t + 1
        cols["episode_index"].append(e)
        cols["latents"].append(rng.standard_normal(LATENT).astype(np.float16))
        cols["action"].append(np.full(5, 100 * e + t, dtype=np.float32))
        cols["action_is_pad"].append(t == 0 and e % 2 == 1)
        cols["task"].append(f"task {e % 3}")
        cols["note"].append("x")
    return datasets.Dataset.from_dict(cols, features=FEATURES)


def expected(ds: datasets.Dataset, e: int) -> dict[str, torch.Tensor]:
    """The slow reference: filter the rows of episode e in row order, stack them."""
    rows = [r for r in ds.with_format("numpy") if int(r["episode_index"]) == e]
    return {
        "latents": torch.from_numpy(np.stack([r["latents"] for r in rows])),
        "action": torch.from_numpy(np.stack([r["action"] for r in rows])),
        "action_loss_mask": torch.from_numpy(~np.stack([r["action_is_pad"] for r in rows])),
    }


# Three episodes of lengths 2, 4, 3, rows interleaved (episode 1 is not contiguous).
ORDER = [0, 0, 1, 2, 1, 1, 2, 2, 1]


def test_whole_episodes_in_row_order_with_dtypes_kept() -> None:
    ds = make_rows(ORDER)
    eps = HFEpisodes(ds, ["latents", "action"], task_column="task")
    assert eps.lengths.tolist() == [2, 4, 3] and eps.episode_ids.tolist() == [0, 1, 2]
    for i in range(3):
        item = eps[i]
        want = expected(ds, i)
        assert item["latents"].dtype == torch.float16 and item["latents"].shape[1:] == LATENT
        assert (
            item["action"].dtype == torch.float32 and item["action_loss_mask"].dtype == torch.bool
        )
        for k, v in want.items():
            # datasets' numpy format returns float32 for a float16 column; the cast is exact.
            assert item[k].to(v.dtype).equal(v), (i, k)
        assert item["action"][:, 0].tolist() == [100 * i + t for t in range(eps.lengths[i])]
        assert item["episode_index"] == i and item["task"] == f"task {i}"
    assert eps[1]["action_loss_mask"].tolist() == [False, True, True, True]


def test_select_and_shuffle_indices_are_honoured() -> None:
    ds = make_rows(ORDER).shuffle(seed=3).select(range(7))  # an indices mapping, not a copy
    with pytest.raises(ValueError, match="rows were reordered"):  # no frame_index to order by
        HFEpisodes(ds, ["action"])
    eps = HFEpisodes(ds, ["action"], frame_column=None)  # row order, asked for
    kept = [int(e) for e in ds["episode_index"]]
    assert eps.lengths.tolist() == [kept.count(e) for e in sorted(set(kept))]
    for i, e in enumerate(eps.episode_ids.tolist()):
        rows = [r for r in ds.with_format("numpy") if int(r["episode_index"]) == e]
        assert eps[i]["action"].equal(torch.from_numpy(np.stack([r["action"] for r in rows])))


def test_episode_filter_order_and_errors() -> None:
    eps = HFEpisodes(make_rows(ORDER), ["action"], episodes=[2, 0])
    assert eps.episode_ids.tolist() == [2, 0] and eps.lengths.tolist() == [3, 2]
    assert eps[0]["action"][0, 0] == 200
    with pytest.raises(KeyError, match=r"episodes \[7\] not found"):
        HFEpisodes(make_rows(ORDER), ["action"], episodes=[7])


def test_errors_name_the_key_and_the_fix() -> None:
    ds = make_rows(ORDER)
    with pytest.raises(KeyError, match=r"unknown key 'actions'.*'latents'"):
        HFEpisodes(ds, ["actions"])
    with pytest.raises(KeyError, match="episode_column='ep' is not a column"):
        HFEpisodes(ds, ["action"], episode_column="ep")
    with pytest.raises(ValueError, match="per-episode value"):
        HFEpisodes(ds, ["task"])
    with pytest.raises(TypeError, match=r"'note' holds string"):
        HFEpisodes(ds, ["note"])
    with pytest.raises(TypeError, match=r"expected a datasets\.Dataset.*pick a split"):
        HFEpisodes(datasets.DatasetDict({"train": ds}), ["action"])
    with pytest.raises(TypeError, match=r"column 'task' holds string"):
        HFEpisodes(ds, ["action"], episode_column="task")
    mixed = ds.map(lambda r, i: {"task": f"t{i}"}, with_indices=True)
    with pytest.raises(ValueError, match=r"episode 0 has 2 values in task column 'task'"):
        HFEpisodes(mixed, ["action"], task_column="task")[0]


def test_ragged_and_null_columns_are_refused() -> None:
    ragged = pa.array([[1.0, 2.0], [3.0]], type=pa.list_(pa.float32()))
    with pytest.raises(ValueError, match=r"'obs' is ragged"):
        arrow_to_numpy(ragged, key="obs")
    with pytest.raises(ValueError, match=r"'obs' has 1 null"):
        arrow_to_numpy(pa.array([1.0, None]), key="obs")
    nested = pa.array([[[1, 2], [3, 4]], [[5, 6], [7, 8]]], type=pa.list_(pa.list_(pa.int16(), 2)))
    got = arrow_to_numpy(nested.slice(1), key="x")  # slices respect offsets
    assert got.dtype == np.int16 and got.tolist() == [[[5, 6], [7, 8]]]


def test_a_ragged_or_null_column_is_refused_when_the_dataset_is_opened() -> None:
    """Before, HFEpisodes accepted it and the error came when an item holding it was read
    (in a DataLoader worker, steps later). A row filtered out does not count."""
    obs = [[0.0, 1.0], [2.0, 3.0], [4.0], [5.0, 6.0]]  # row 2 (episode 1) is ragged
    ds = datasets.Dataset.from_dict({"episode_index": [0, 0, 1, 1], "obs": obs})
    with pytest.raises(ValueError, match=r"column 'obs' is ragged \(rows of 1 to 2 values\)"):
        HFEpisodes(ds, keys=["obs"])
    kept = ds.filter(lambda row: row["episode_index"] == 0)
    assert HFEpisodes(kept, keys=["obs"])[0]["obs"].tolist() == [[0.0, 1.0], [2.0, 3.0]]
    nulls = datasets.Dataset.from_dict({"episode_index": [0, 0], "obs": [1.0, None]})
    with pytest.raises(ValueError, match=r"column 'obs' has 1 null values"):
        HFEpisodes(nulls, keys=["obs"])


def test_no_keys_is_refused() -> None:
    with pytest.raises(ValueError, match=r"keys=\[\] requests no column"):
        HFEpisodes(make_rows([0, 0, 1]), keys=[])


def test_plan_columns_serves_is_pad_inverted_only() -> None:
    avail = ["latents", "action", "action_is_pad"]
    assert plan_columns(["latents", "action"], avail) == [
        ("latents", "latents", False),
        ("action", "action", False),
        ("action_loss_mask", "action_is_pad", True),
    ]
    assert plan_columns(["action_is_pad"], avail) == [("action_loss_mask", "action_is_pad", True)]
    assert plan_columns(["action", "action_is_pad"], avail) == [
        ("action", "action", False),
        ("action_loss_mask", "action_is_pad", True),
    ]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=40))
def test_group_rows_is_a_stable_partition(episode_of_row: list[int]) -> None:
    ids, offsets, order = group_rows(np.array(episode_of_row))
    assert ids.tolist() == sorted(set(episode_of_row))
    for j, e in enumerate(ids.tolist()):
        rows = order[offsets[j] : offsets[j + 1]].tolist()
        assert rows == [r for r, x in enumerate(episode_of_row) if x == e]
    assert sorted(order.tolist()) == list(range(len(episode_of_row)))


# pyarrow/datasets threads are alive in the test process when the workers fork.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_multiworker_dataloader_with_packed_collate() -> None:
    ds = make_rows([e for e in range(6) for _ in range(e % 4 + 1)][::-1])  # ragged, reversed
    eps = HFEpisodes(ds, ["latents", "action"], task_column="task")
    packs = [[0, 3], [5, 1, 2], [4]]
    collate = PackedCollator(
        [Stream("latents", grid=(2, 3)), Stream("action"), Stream("action_loss_mask")],
        pad_to_multiple=8,
    )
    seen = []
    for pack, batch in zip(
        packs, DataLoader(eps, batch_sampler=packs, collate_fn=collate, num_workers=2), strict=True
    ):
        assert batch["episode_index"].tolist() == pack
        for i, ep in zip(pack, unpack(batch), strict=True):
            for k in ("latents", "action", "action_loss_mask"):
                assert ep[k].dtype == eps[i][k].dtype and ep[k].equal(eps[i][k]), (i, k)
            assert ep["task"] == f"task {i % 3}"
            seen.append(i)
    assert sorted(seen) == list(range(6))


def test_import_does_not_load_datasets() -> None:
    code = textwrap.dedent(
        """
        import sys
        import packing, packing.datasets._hf
        bad = [m for m in ("datasets", "lerobot", "pyarrow") if m in sys.modules]
        assert not bad, bad
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ}
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
