"""Bad input is refused with an error that names the value and the fix, never coerced.

Each test is one case found by trying bad and edge inputs across the public API (issue 15):
what was silently wrong, what raised without naming the input, and the coercions we decided
to refuse (docs/errors.md lists them).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from packing.data._collate import PackedCollator, Stream, check_batch, pack, unpack
from packing.planning import PackedBatchSampler, frames_to_tokens, plan_packs

LENGTHS = [3, 5, 2, 7, 4, 6, 1, 8, 2, 5, 3, 4]


# -- plan_packs: lengths are 1-D non-negative integers, the budget a positive int ---------------


@pytest.mark.parametrize(
    ("lengths", "budget", "error", "message"),
    [
        ([3.7, 4.9, 2.2], 8, TypeError, r"lengths must be integers .*float64 \(episode 0: 3\.7\)"),
        ([3, float("nan"), 2], 8, TypeError, r"float64 \(episode 1: nan\).*never truncates"),
        (["3", "4"], 8, TypeError, r"lengths must be integers .*<U1"),
        ([[3, 4], [2, 1]], 8, ValueError, r"one-dimensional .*shape \(2, 2\)"),
        ("345", 8, TypeError, r"1-D sequence of integer token counts, got str"),
        ([10**30, 3], 8, ValueError, r"1000000000000000000000000000000 tokens is out of range"),
        (
            [2**62, 3],
            8,
            ValueError,
            r"episode 0 has 4,611,686,018,427,387,904 tokens > token_budget=8",
        ),
        ([3, 4, 2], 8.9, TypeError, r"token_budget=8\.9 must be a positive int"),
        ([3, 4, 2], None, TypeError, r"token_budget=None must be a positive int"),
        ([3, 4, 2], True, TypeError, r"token_budget=True must be a positive int"),
        ([3, 4, 2], 0, ValueError, r"token_budget=0 must be >= 1"),
    ],
)
def test_plan_packs_refuses_what_it_would_truncate_or_parse(
    lengths: Any, budget: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        plan_packs(lengths, budget)


def test_float_budget_is_refused_by_every_algorithm() -> None:
    for algorithm in ("bfd", "ffd", "lookahead", "next_fit"):
        with pytest.raises(TypeError, match=r"token_budget=8\.9"):
            plan_packs([3, 4, 2], 8.9, algorithm=algorithm)  # type: ignore[arg-type]


def test_integer_arrays_of_any_width_still_plan() -> None:
    want = plan_packs([5, 3, 4], 8).packs
    assert plan_packs(np.array([5, 3, 4], dtype=np.uint16), np.int64(8)).packs == want
    assert plan_packs(torch.tensor([5, 3, 4]), 8).packs == want


def test_frames_to_tokens_refuses_fractional_frames() -> None:
    with pytest.raises(TypeError, match=r"num_frames must be integer frame counts, got float64"):
        frames_to_tokens([3.7, 4.0])


# -- the sampler resumes exactly, or refuses naming the setting --------------------------------


def _sampler(**kw: Any) -> PackedBatchSampler:
    return PackedBatchSampler(LENGTHS * 3, 9, **{"seed": 3, **kw})


def _resume(saved_kw: dict[str, Any], resumed_kw: dict[str, Any]) -> list[list[int]]:
    """Consume 2 packs of epoch 1 with one sampler, resume the rest with another."""
    a = _sampler(**saved_kw)
    a.set_epoch(1)
    it = iter(a)
    first = [next(it), next(it)]
    b = _sampler(**resumed_kw)
    b.load_state_dict(a.state_dict())
    return first + list(b)


def test_resume_with_the_same_settings_serves_every_episode_once() -> None:
    served = _resume({"shuffle": True}, {"shuffle": True})
    assert sorted(i for p in served for i in p) == list(range(3 * len(LENGTHS)))


@pytest.mark.parametrize(
    ("saved", "resumed", "message"),
    [
        ({"shuffle": True}, {"shuffle": False}, r"saved with shuffle=True, this sampler has shuffle=False"),
        ({"balance": "attention"}, {}, r"saved with balance='attention'.*build the sampler with balance='attention'"),
        ({"balance_window": 1}, {}, r"saved with balance_window=1, this sampler has balance_window=64"),
        ({"seed": 5}, {}, r"saved with seed=5, this sampler has seed=3"),
    ],
)  # fmt: skip
def test_state_from_other_settings_is_refused_naming_the_setting(
    saved: dict[str, Any], resumed: dict[str, Any], message: str
) -> None:
    # Guard against a vacuous refusal: these settings really change the epoch's order.
    a, b = _sampler(**saved), _sampler(**resumed)
    assert not np.array_equal(a.schedule(1), b.schedule(1))
    with pytest.raises(ValueError, match=message):
        _resume(saved, resumed)


def test_state_missing_keys_is_named() -> None:
    s = _sampler()
    state = s.state_dict()
    del state["fingerprint"], state["shuffle"]
    with pytest.raises(KeyError, match=r"sampler state lacks \['fingerprint', 'shuffle'\]"):
        s.load_state_dict(state)


@pytest.mark.parametrize("seed", [-1, 1.5, "0", None])
def test_bad_seed_is_refused_at_construction(seed: Any) -> None:
    with pytest.raises((TypeError, ValueError), match=r"seed=.* must be (an int|>= 0)"):
        _sampler(seed=seed)


def test_fractional_balance_window_and_epoch_are_refused() -> None:
    with pytest.raises(TypeError, match=r"balance_window=2\.5 must be a positive int"):
        _sampler(balance_window=2.5)
    with pytest.raises(TypeError, match=r"set_epoch\(epoch\)=1\.5 must be an int"):
        _sampler().set_epoch(1.5)  # type: ignore[arg-type]


# -- unpack refuses a batch whose layout and buffers disagree -----------------------------------


def _episodes() -> list[dict[str, Any]]:
    return [
        {"x": torch.arange(n, dtype=torch.float32) + 100 * e, "episode_index": e, "task": f"t{e}"}
        for e, n in enumerate([2, 4, 3])
    ]


def test_unpack_round_trips_a_collated_batch() -> None:
    batch = pack(_episodes(), pad_to_multiple=4)
    check_batch(batch)
    assert [ep["x"].tolist() for ep in unpack(batch)] == [ep["x"].tolist() for ep in _episodes()]


def test_unpack_refuses_lengths_that_would_serve_padding_as_data() -> None:
    from dataclasses import replace

    batch = pack(_episodes(), pad_to_multiple=4)  # 9 real steps padded to 12
    lay = batch.layouts["x"]
    # Episode 2 claims 5 steps: rows 9 and 10 are padding, and would be served as its data.
    batch.layouts["x"] = replace(lay, lengths_K=(2, 4, 5), steps_K=(2, 4, 5))
    with pytest.raises(
        ValueError, match=r"stream 'x': doc_ids/cu_seqlens do not match lengths_K \[2, 4, 5\]"
    ):
        unpack(batch)
    # A layout built for another buffer (16 tokens) over this one (12 rows).
    batch.layouts["x"] = pack(_episodes(), pad_to_multiple=16).layouts["x"]
    with pytest.raises(ValueError, match=r"padded to 16 tokens, but the buffer has 12 rows"):
        unpack(batch)


def test_unpack_refuses_a_zero_row_episode_and_edited_doc_ids() -> None:
    batch = pack(_episodes(), pad_to_multiple=4)
    lay = batch.layouts["x"]
    from dataclasses import replace

    batch.layouts["x"] = replace(lay, lengths_K=(2, 0, 7), steps_K=(2, 0, 7))
    with pytest.raises(ValueError, match=r"stream 'x': a document has 0 steps"):
        unpack(batch)
    doc = lay.doc_ids_T.clone()
    doc[9] = 2  # a padding token relabelled as episode 2's
    batch.layouts["x"] = replace(lay, doc_ids_T=doc)
    with pytest.raises(ValueError, match=r"doc_ids/cu_seqlens do not match lengths_K \[2, 4, 3\]"):
        unpack(batch)
    batch.layouts["x"] = replace(lay, steps_K=(2, 4, 4), lengths_K=(2, 4, 4))
    with pytest.raises(ValueError, match=r"doc_ids/cu_seqlens do not match"):
        unpack(batch)


def test_unpack_refuses_a_shortened_per_episode_list() -> None:
    batch = pack(_episodes(), pad_to_multiple=4)
    batch.per_episode["task"] = batch.per_episode["task"][:2]
    with pytest.raises(ValueError, match=r"per-episode value 'task' has 2 entries for 3 documents"):
        unpack(batch)


# -- collate: the coercions we refuse ------------------------------------------------------------


def test_episode_index_minus_one_is_the_padding_sentinel_not_an_episode() -> None:
    eps = _episodes()
    eps[1]["episode_index"] = -1
    with pytest.raises(ValueError, match=r"episode 1 has episode_index -1.*-1 marks padding"):
        pack(eps)


def test_fractional_episode_index_is_refused() -> None:
    eps = _episodes()
    for e in eps:
        e["episode_index"] = float(e["episode_index"]) + 0.5
    with pytest.raises(TypeError, match=r"episode_index must be an int per episode, got float"):
        pack(eps)


def test_an_episode_off_the_cpu_is_named_not_copied_with_a_device_error() -> None:
    # Packs are host memory (DataLoader workers, pinned buffers). An episode already on a GPU
    # used to fail inside the copy with torch's "cross-device copies" message, which names
    # neither the episode nor the fix. The meta device stands in for a GPU on CI.
    eps = [{"latents": torch.zeros(3, 4)}, {"latents": torch.zeros(2, 4, device="meta")}]
    with pytest.raises(ValueError, match=r"episode 1 stream 'latents' is on meta.*batch.to"):
        PackedCollator(token_budget=8)(eps)


def test_pad_value_the_stream_dtype_cannot_hold_is_refused() -> None:
    eps = [{"ids": torch.arange(n)} for n in (2, 3)]
    with pytest.raises(
        ValueError, match=r"stream 'ids': pad_value=1\.5 does not fit its dtype torch\.int64"
    ):
        PackedCollator([Stream("ids", pad_value=1.5)])(eps)
    with pytest.raises(ValueError, match=r"pad_value=-1\.0 does not fit its dtype torch\.uint8"):
        Stream("ids", pad_value=-1.0, dtype=torch.uint8)
    batch = PackedCollator([Stream("ids", pad_value=-1)], pad_to_multiple=8)(eps)
    assert batch["ids"][5:].eq(-1).all()  # an integral pad value is exact


def test_fractional_step_shape_is_refused() -> None:
    with pytest.raises(TypeError, match=r"step_shape=\(2\.5, 4\) must hold ints"):
        Stream("x", step_shape=(2.5, 4))  # type: ignore[arg-type]


# -- LeRobot: files and metadata are checked cheaply, errors name the file -----------------------


def _edit_episodes(root: Path, edit: Any) -> None:
    import pyarrow.parquet as pq

    path = next((root / "meta" / "episodes").glob("*/*.parquet"))
    table = pq.read_table(path)
    cols = {
        c: table.column(c).to_numpy().copy()
        for c in ("length", "dataset_from_index", "dataset_to_index")
    }
    edit(cols)
    for name, values in cols.items():
        table = table.set_column(table.schema.get_field_index(name), name, [values])
    pq.write_table(table, path)


def test_metadata_shortened_consistently_is_caught(user_dataset: Path, tmp_path: Path) -> None:
    """Episode 1 is 2 frames shorter in meta/episodes and every index after it shifted: each
    episode still reads its own rows, but 2 frames of the data would never be served."""
    from packing.datasets import LeRobotEpisodes

    root = tmp_path / "short"
    shutil.copytree(user_dataset, root)

    def shorten(c: dict[str, np.ndarray]) -> None:
        c["length"][1] -= 2
        c["dataset_to_index"][1:] -= 2
        c["dataset_from_index"][2:] -= 2

    _edit_episodes(root, shorten)
    with pytest.raises(
        ValueError, match=r"file-000\.parquet holds 23 frames but meta/episodes assigns 21"
    ):
        LeRobotEpisodes(root, keys=["action"])


def test_total_frames_in_info_json_is_checked(user_dataset: Path, tmp_path: Path) -> None:
    from packing.datasets import LeRobotEpisodes

    root = tmp_path / "total"
    shutil.copytree(user_dataset, root)
    info = json.loads((root / "meta" / "info.json").read_text())
    info["total_frames"] -= 1
    (root / "meta" / "info.json").write_text(json.dumps(info))
    with pytest.raises(ValueError, match=r"says total_frames=22 but the data files hold 23 rows"):
        LeRobotEpisodes(root, keys=["action"])


def test_corrupt_metadata_files_are_named(user_dataset: Path, tmp_path: Path) -> None:
    from packing.datasets import LeRobotEpisodes, episode_lengths

    root = tmp_path / "corrupt"
    shutil.copytree(user_dataset, root)
    meta = next((root / "meta" / "episodes").glob("*/*.parquet"))
    meta.write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match=rf"{meta}: cannot read it as parquet"):
        episode_lengths(root)
    shutil.rmtree(root)
    shutil.copytree(user_dataset, root)
    (root / "meta" / "info.json").write_text(json.dumps({"codebase_version": "v3.0"}))
    with pytest.raises(ValueError, match=r"info\.json has no 'features' table"):
        LeRobotEpisodes(root, keys=["action"])


def test_lerobot_keys_and_episodes_are_not_coerced(user_dataset: Path) -> None:
    from packing.datasets import LeRobotEpisodes

    with pytest.raises(ValueError, match=r"keys=\[\] requests no feature"):
        LeRobotEpisodes(user_dataset, keys=[])
    with pytest.raises(TypeError, match=r"episodes must be episode indices \(ints\), got \[1\.5\]"):
        LeRobotEpisodes(user_dataset, keys=["action"], episodes=[0, 1.5])


def test_a_lossy_cast_to_the_declared_dtype_warns_once(user_dataset: Path, tmp_path: Path) -> None:
    """info.json declares action float16 while the file stores float32: items follow the
    declaration (as before), and now say once that the cast can round."""
    from packing.datasets import LeRobotEpisodes

    root = tmp_path / "declared16"
    shutil.copytree(user_dataset, root)
    info = json.loads((root / "meta" / "info.json").read_text())
    info["features"]["action"]["dtype"] = "float16"
    (root / "meta" / "info.json").write_text(json.dumps(info))
    eps = LeRobotEpisodes(root, keys=["action"])
    with pytest.warns(
        UserWarning,
        match=r"'action' is stored as torch\.float32 but meta/info\.json declares torch\.float16",
    ):
        assert eps[0]["action"].dtype == torch.float16
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eps[1]  # once per feature, not once per item
