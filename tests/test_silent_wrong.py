"""One regression test per silently wrong result of issue 25: each failed on the code before."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from packing.attention import dense_mask, document_mask_mod, make_block_mask


def test_int64_doc_ids_are_not_narrowed_in_dense_mask():
    ids = torch.tensor([0, 0, 2**32, 2**32])
    want = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(dense_mask(ids), want)


def test_int64_doc_ids_are_not_narrowed_in_the_block_masks_mask_mod():
    ids = torch.tensor([0, 0, 2**32, 2**32, 2**32 + 1])
    # block_size 8 > T: one partial tile, so Flex evaluates the mask_mod on every pair.
    bm = make_block_mask(ids, block_size=8)
    dense = create_mask(bm.mask_mod, 1, 1, 5, 5, device="cpu")[0, 0]
    assert torch.equal(dense, dense_mask(ids))
    assert not dense[0, 2] and dense[2, 3]
    assert document_mask_mod(ids).__name__ == "document"


def test_block_size_accepts_numpy_ints():
    ids = torch.tensor([0, 0, 1, 1])
    a = make_block_mask(ids, block_size=np.int64(2)).to_dense()
    assert torch.equal(a, make_block_mask(ids, block_size=2).to_dense())


# -- losses -----------------------------------------------------------------------------------
from packing.data import layout_from_lengths  # noqa: E402
from packing.train import LossNormalizer, reduce_loss  # noqa: E402


@pytest.mark.parametrize("denominator", [0, -3, 0.0, float("nan")])
def test_reduce_loss_refuses_a_denominator_that_is_not_positive(denominator):
    ids = torch.tensor([0, 0, 1])
    with pytest.raises(ValueError, match=r"denominator=.* must be"):
        reduce_loss(torch.ones(3), ids, "token", denominator=denominator)


def test_reduce_loss_refuses_a_zero_tensor_denominator_with_loss_to_normalise():
    ids = torch.tensor([0, 0, 1])
    with pytest.raises(ValueError, match=r"denominator=0.0 must be > 0"):
        reduce_loss(torch.ones(3), ids, "token", denominator=torch.tensor(0.0))
    # Nothing to learn (an all-padding pack) stays 0, as documented.
    pad = torch.tensor([-1, -1, -1])
    assert reduce_loss(torch.ones(3), pad, "token", denominator=torch.tensor(0.0)) == 0


def test_loss_normalizer_for_an_empty_step_is_refused():
    with pytest.raises(ValueError, match=r"for_step\(\[\]\): no micro-batch"):
        LossNormalizer.for_step([], "token")


def test_reduce_loss_refuses_non_contiguous_doc_ids_like_make_block_mask():
    ids = torch.tensor([0, 0, 1, 1, 0, 0])
    with pytest.raises(ValueError, match=r"doc_ids: document 0 at position 4 follows document 1"):
        reduce_loss(torch.ones(6), ids, "episode")
    with pytest.raises(ValueError, match=r"document 0 at position 4"):
        make_block_mask(ids)


def test_reduce_loss_refuses_a_0d_loss():
    lay = layout_from_lengths([2, 1], [2, 1], 4)
    with pytest.raises(ValueError, match=r"loss must be the per-token loss.*reduction='none'"):
        reduce_loss(torch.tensor(1.5), lay, "token")


# -- planning ---------------------------------------------------------------------------------
from packing.planning import (  # noqa: E402
    BufferedPacker,
    PackedBatchSampler,
    frames_to_tokens,
    plan_packs,
    split_windows,
)


def test_negative_split_overlap_is_refused():
    with pytest.raises(ValueError, match=r"split_overlap=-1 must be >= 0"):
        plan_packs([10], 4, oversize="split", split_overlap=-1)
    with pytest.raises(ValueError, match=r"overlap=-1 must be >= 0"):
        split_windows(10, 4, overlap=-1)


def test_plan_packs_of_no_episode_is_an_empty_plan_again():
    for empty in ([], (), np.array([], dtype=np.int64), np.array([])):
        plan = plan_packs(empty, 8)
        assert len(plan) == 0 and plan.packs == [] and plan.efficiency == 0.0


def test_frames_to_tokens_refuses_negative_action_tokens():
    with pytest.raises(ValueError, match=r"action_tokens_per_frame=-40 must be >= 0"):
        frames_to_tokens([9], action_tokens_per_frame=-40)
    with pytest.raises(ValueError, match=r"text_tokens=-1 must be >= 0"):
        frames_to_tokens([9], text_tokens=-1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(replan="no"), r"replan='no' must be True or False"),
        (dict(replan=True, replan_window=2.5), r"replan_window=2.5 must be an int"),
        (dict(num_replicas=2.5, rank=0), r"num_replicas=2.5 must be an int"),
    ],
)
def test_sampler_options_are_not_coerced(kwargs, match):
    with pytest.raises(TypeError, match=match):
        PackedBatchSampler([3, 4, 5], 8, **kwargs)


def test_buffered_packer_refuses_float_lengths_instead_of_overfilling():
    packer = BufferedPacker(8, length=lambda ep: ep, buffer_size=2)
    with pytest.raises(TypeError, match=r"length\(episode 0 of the stream\)=4.9 must be an int"):
        list(packer([4.9, 3.9]))


def test_a_sampler_state_of_the_previous_release_names_the_versions():
    s = PackedBatchSampler([3, 4, 5], 8)
    old = {k: v for k, v in s.state_dict().items() if k not in ("version", "replan_window")}
    with pytest.raises(KeyError, match=r"older packing release .*version 1.*reads version 2"):
        PackedBatchSampler([3, 4, 5], 8).load_state_dict(old)


# -- collate ----------------------------------------------------------------------------------
from packing.data import PackedCollator, Stream  # noqa: E402


def test_a_string_is_not_a_list_of_streams():
    with pytest.raises(TypeError, match=r"streams='obs' is a string.*streams=\['obs'\]"):
        PackedCollator("obs")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(token_budget=128.0), r"token_budget=128.0 must be an int"),
        (dict(pad_to_multiple=2.5), r"pad_to_multiple=2.5 must be an int"),
        (dict(pin_memory="no"), r"pin_memory='no' must be True or False"),
        (dict(check_finite=1), r"check_finite=1 must be True or False"),
    ],
)
def test_collator_sizes_and_flags_are_not_coerced(kwargs, match):
    with pytest.raises(TypeError, match=match):
        PackedCollator(["x"], **kwargs)


def test_stream_grid_of_floats_is_refused_at_construction():
    with pytest.raises(TypeError, match=r"stream 'x': grid\[0\]=2.0 must be an int"):
        Stream("x", grid=(2.0, 2))
    assert Stream("x", grid=(np.int64(2), 2)).tokens_per_step == 4


def test_a_tensor_that_requires_grad_is_named_not_crashed_on_in_cat():
    x = torch.ones(3, 2, requires_grad=True)
    with pytest.raises(ValueError, match=r"episode 0 stream 'x' requires grad.*x.detach\(\)"):
        PackedCollator(["x"], pad_to_multiple=1)([{"x": x}])


def test_a_pad_value_out_of_a_float_dtypes_range_is_refused():
    with pytest.raises(ValueError, match=r"pad_value=1000000.0 is out of the range.*float16"):
        Stream("x", dtype=torch.float16, pad_value=1e6)
    collate = PackedCollator([Stream("x", pad_value=1e6)], pad_to_multiple=4)
    with pytest.raises(ValueError, match=r"out of the range of its dtype torch.float16"):
        collate([{"x": torch.zeros(3, dtype=torch.float16)}])


def test_check_finite_names_the_episode_the_stream_and_the_index():
    eps = [
        {"x": torch.zeros(2, 3), "episode_index": 4},
        {"x": torch.tensor([[0.0, 1.0, 2.0], [3.0, float("nan"), 5.0]]), "episode_index": 9},
    ]
    PackedCollator(["x"])(eps)  # off by default: no cost on the hot path
    with pytest.raises(ValueError, match=r"episode 1 \(episode_index 9\) 'x' holds nan at index"):
        PackedCollator(["x"], check_finite=True)(eps)


# -- datasets ---------------------------------------------------------------------------------
import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

from packing.datasets import LeRobotEpisodes, default_dataset_root, episode_lengths  # noqa: E402


def _copy_default(tmp_path: Path) -> Path:
    root = tmp_path / "ds"
    shutil.copytree(default_dataset_root(), root)
    return root


def _rewrite(path: Path, edit) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    table = pq.read_table(path)
    pq.write_table(edit(table), path)


def test_two_episodes_with_one_episode_index_are_refused(tmp_path):
    pa = pytest.importorskip("pyarrow")
    root = _copy_default(tmp_path)
    meta = next((root / "meta" / "episodes").glob("*/*.parquet"))

    def duplicate(table):
        ids = table.column("episode_index").to_numpy().copy()
        ids[1] = ids[0]
        i = table.schema.get_field_index("episode_index")
        return table.set_column(i, "episode_index", pa.array(ids))

    _rewrite(meta, duplicate)
    with pytest.raises(ValueError, match=r"two episodes of meta/episodes carry episode_index 0"):
        LeRobotEpisodes(root, keys=["action"])
    with pytest.raises(ValueError, match=r"carry episode_index 0"):
        episode_lengths(root)


def test_an_episode_asked_for_twice_is_refused():
    with pytest.raises(ValueError, match=r"episodes lists episode 1 twice"):
        LeRobotEpisodes(default_dataset_root(), keys=["action"], episodes=[1, 0, 1])


def test_token_lengths_use_the_datasets_latent_shape(tmp_path):
    root = _copy_default(tmp_path)
    info_path = root / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info["features"]["latents"]["shape"] = [12, 6, 10]
    info_path.write_text(json.dumps(info))
    eps = LeRobotEpisodes(root, keys=["action"])
    # (6 / 2) * (10 / 2) = 15 tokens a frame, not the default latent_hw (8, 16)'s 32.
    assert eps.token_lengths().tolist() == (15 * eps.lengths).tolist()
    with pytest.raises(ValueError, match=r"latent_hw=\(8, 16\) but feature 'latents'.*\(6, 10\)"):
        eps.token_lengths(latent_hw=(8, 16))
    same = LeRobotEpisodes(default_dataset_root(), keys=["action"])
    assert same.token_lengths(latent_hw=(8, 16)).tolist() == (32 * same.lengths).tolist()


def test_check_finite_names_the_lerobot_episode_key_and_index(tmp_path):
    pa = pytest.importorskip("pyarrow")
    root = _copy_default(tmp_path)
    data = next((root / "data").glob("*/*.parquet"))

    def poison(table):
        i = table.schema.get_field_index("action")
        flat = table.column("action").combine_chunks().flatten().to_numpy().copy()
        flat[14 * 5 + 3] = np.inf  # row 5, joint 3
        col = pa.FixedSizeListArray.from_arrays(pa.array(flat), 14)
        return table.set_column(i, table.schema.field(i), col)

    _rewrite(data, poison)
    eps = LeRobotEpisodes(root, keys=["action"], check_finite=True)
    ends = np.cumsum(eps.lengths)  # one data file, episodes in index order
    pos = int(np.searchsorted(ends, 5, side="right"))
    start = int(ends[pos] - eps.lengths[pos])
    with pytest.raises(
        ValueError,
        match=rf"episode {eps.episode_ids[pos]} 'action' holds inf at index \({5 - start}, 3\)",
    ):
        eps[pos]
    assert torch.isinf(LeRobotEpisodes(root, keys=["action"])[pos]["action"]).any()  # off: served


datasets = pytest.importorskip("datasets")


def _frames(order: list[tuple[int, int]], with_frame_index: bool = True):
    """Rows (episode, t) in the given order; action = 100 * episode + t encodes both."""
    cols = {
        "episode_index": [e for e, _ in order],
        "action": [[float(100 * e + t)] * 2 for e, t in order],
    }
    if with_frame_index:
        cols["frame_index"] = [t for _, t in order]
    return datasets.Dataset.from_dict(cols)


def test_hf_episodes_of_a_shuffled_dataset_are_in_frame_order():
    from packing.datasets import HFEpisodes

    rows = [(e, t) for e, n in enumerate([3, 5, 4]) for t in range(n)]
    ds = _frames(rows).shuffle(seed=1)
    eps = HFEpisodes(ds, ["action"])
    for i, n in enumerate([3, 5, 4]):
        assert eps[i]["action"][:, 0].tolist() == [100.0 * i + t for t in range(n)]
    # Rows already contiguous but out of order are not one slice in row order.
    eps = HFEpisodes(_frames([(0, 0), (0, 2), (0, 1), (0, 3)]), ["action"])
    assert eps[0]["action"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_hf_episodes_refuse_a_repeated_frame_index_and_a_string_for_keys():
    from packing.datasets import HFEpisodes

    with pytest.raises(ValueError, match=r"episode 0 has frame_index 1 twice"):
        HFEpisodes(_frames([(0, 0), (0, 1), (0, 1)]), ["action"])
    with pytest.raises(TypeError, match=r"keys='action' is a string"):
        HFEpisodes(_frames([(0, 0)]), "action")
    with pytest.raises(ValueError, match=r"episodes lists episode 0 twice"):
        HFEpisodes(_frames([(0, 0)]), ["action"], episodes=[0, 0])


def test_hf_episodes_check_finite_names_the_episode_key_and_index():
    from packing.datasets import HFEpisodes

    ds = datasets.Dataset.from_dict(
        {"episode_index": [3, 3, 3], "frame_index": [0, 1, 2],
         "action": [[0.0, 1.0], [2.0, float("nan")], [4.0, 5.0]]}
    )  # fmt: skip
    assert torch.isnan(HFEpisodes(ds, ["action"])[0]["action"]).any()
    with pytest.raises(ValueError, match=r"episode 3 'action' holds nan at index \(1, 1\)"):
        HFEpisodes(ds, ["action"], check_finite=True)[0]


def test_lerobot_frames_are_served_in_frame_index_order(tmp_path):
    root = _copy_default(tmp_path)
    data = next((root / "data").glob("*/*.parquet"))
    want = LeRobotEpisodes(default_dataset_root(), keys=["action"])[0]["action"]
    n = len(want)

    def reverse_episode_0(table):  # rows 0..n-1 are episode 0; its frames now run backwards
        order = list(range(n - 1, -1, -1)) + list(range(n, table.num_rows))
        return table.take(order)

    _rewrite(data, reverse_episode_0)
    eps = LeRobotEpisodes(root, keys=["action"])
    assert torch.equal(eps[0]["action"], want)
    assert not torch.equal(want, want.flip(0))  # guard: the reversal was visible
