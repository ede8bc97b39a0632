"""Issue 35's cases outside serve, one test each, named by the case; each failed before."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from packing.data import PackedCollator
from packing.planning import fill_packs


def _batch_with_step() -> object:
    eps = [{"x": torch.ones(2, 3), "step": 7, "episode_index": 0},
           {"x": torch.ones(3, 3), "step": 9, "episode_index": 1}]  # fmt: skip
    return PackedCollator(["x"])(eps)


def test_extras_update_with_a_key_of_the_episodes_is_refused_at_the_write() -> None:
    batch = _batch_with_step()
    with pytest.raises(ValueError, match=r"extras\['step'\]: 'step' is already in per-episode"):
        batch.extras.update(seed=0, step=100)  # type: ignore[attr-defined]
    assert "seed" not in batch.extras  # type: ignore[attr-defined]  # nothing half-written


def test_two_episodes_of_one_episode_index_in_a_pack_are_refused() -> None:
    eps = [{"x": torch.ones(2, 3), "episode_index": 4}, {"x": torch.ones(3, 3), "episode_index": 4}]
    with pytest.raises(ValueError, match="both have episode_index 4"):
        PackedCollator(["x"])(eps)


@pytest.mark.parametrize(
    ("packs", "match"),
    [([[0, 1]], "11 tokens > token_budget=10"), ([[0], [0]], "item 0 is in packs"),
     ([[-1]], "holds item -1")],
)  # fmt: skip
def test_fill_packs_refuses_packs_over_budget_twice_or_out_of_range(packs, match) -> None:
    with pytest.raises(ValueError, match=match):
        fill_packs(packs, [6, 5, 4], 10)


def test_fill_packs_min_fill_true_is_refused() -> None:
    with pytest.raises(TypeError, match="min_fill=True"):
        fill_packs([[0]], [6], 10, min_fill=True)


def test_shard_model_param_dtype_string_is_refused_by_packing() -> None:
    from packing.train import shard_model

    with pytest.raises(TypeError, match=r"param_dtype='bf16'.*torch.bfloat16"):
        shard_model(torch.nn.Linear(2, 2), param_dtype="bf16")  # type: ignore[arg-type]


def test_hf_shuffled_without_frame_index_gap_none_task_and_empty() -> None:
    datasets = pytest.importorskip("datasets")
    from packing.datasets import HFEpisodes

    rows = {
        "episode_index": [0, 0, 0, 1, 1],
        "x": [0.0, 1, 2, 3, 4],
        "task": ["a"] * 3 + [None] * 2,
    }
    ds = datasets.Dataset.from_dict(rows)
    with pytest.raises(ValueError, match=r"reordered.*frame_column"):
        HFEpisodes(ds.shuffle(seed=1), ["x"])
    with pytest.raises(KeyError, match="frame_column='frame_idx' is not a column"):
        HFEpisodes(ds, ["x"], frame_column="frame_idx")
    gappy = ds.add_column("frame_index", [0, 1, 2, 0, 1]).select([0, 2, 3, 4])
    with pytest.raises(ValueError, match="episode 0 has no frame_index 1"):
        HFEpisodes(gappy, ["x"])
    with pytest.raises(ValueError, match="task None"):
        HFEpisodes(ds, ["x"], task_column="task")[1]
    with pytest.raises(ValueError, match="no rows"):
        HFEpisodes(ds.select([]), ["x"])


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "packing", *args], capture_output=True, text=True, timeout=120
    )


def test_verify_inference_with_a_training_flag_exits_2() -> None:
    out = _cli("verify", "--inference", "--steps", "5")
    assert out.returncode == 2 and "does not take --steps" in out.stderr
    out = _cli("verify", "--inference", "--model", "nope:nope")  # only a served model's name
    assert out.returncode == 2 and "the served models it proves are 'lingbot_va'" in out.stderr


def test_argparse_errors_are_one_line_and_budget_takes_5e9_without_torch() -> None:
    out = _cli("verify", "--steps", "2.5")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    code = "import sys; from packing.cli import main; main(['budget', '--params', '5e9']);"
    code += "print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip().endswith("False"), done.stderr
    assert "5.00 B parameters" in done.stdout


def test_budget_presets_match_param_count() -> None:
    import dataclasses

    from packing.cli._budget import PRESET_PARAMS
    from packing.model import DiTConfig, param_count

    for preset, (depth, outside, per_block) in PRESET_PARAMS.items():
        cfg = getattr(DiTConfig, preset)()
        assert cfg.depth == depth
        for d in (1, 7):
            assert param_count(dataclasses.replace(cfg, depth=d)) == outside + d * per_block


def test_threads_above_the_cores_exit_2_before_torch_hangs() -> None:
    out = _cli("verify", "--threads", "100000")
    assert out.returncode == 2 and "--threads: 100000 is above 4,096" in out.stderr
    import os

    more = len(os.sched_getaffinity(0)) + 1  # within the parser's bound, above this machine's
    out = _cli("verify", "--threads", str(more))
    assert out.returncode == 2 and f"--threads {more} must be in [1," in out.stderr


def _report(failures: list[str], worst_rel: float, scale: float) -> object:
    from packing.verify import Tolerances, VerifyReport

    tol = Tolerances(loss_rel=1e-6, grad_rel=1e-5, param_rel=1e-5)
    return VerifyReport(
        config={"lr": 1e-4}, tolerances=tol, steps=[object()] * 3, grads=[], param_rel=1e-8,
        param_worst="blocks.0.norm.bias", param_worst_rel=worst_rel, episodes=12, tokens=100,
        padded_tokens_unpacked=120, padded_tokens_packed=110, packs=3, pack_sizes=[4, 4, 4],
        leak=None, failures=failures, param_worst_scale=scale,
    )  # fmt: skip


def test_verify_fail_says_what_to_try_next() -> None:
    verdict = _report(["loss differs at step 0"], 1e-6, 1.0)._verdict()  # type: ignore[attr-defined]
    assert (
        verdict.startswith("FAIL: loss differs") and "docs/verify.md#what-verify-catches" in verdict
    )


def test_near_zero_note_only_when_the_tensor_is_near_zero_and_the_run_passed() -> None:
    near = _report([], 2e-5, 3e-4)._worst_tensor_note()  # type: ignore[attr-defined]
    assert "expected" in near and "3.00e-04" in near  # 3 steps x lr 1e-4: started at 0
    big = _report([], 2e-5, 0.5)._worst_tensor_note()  # type: ignore[attr-defined]
    assert "expected" not in big and "max|b| is 5.00e-01" in big
    failed = _report(["gradients differ"], 2e-5, 3e-4)._worst_tensor_note()  # type: ignore[attr-defined]
    assert "expected" not in failed  # a real failure's worst tensor is never excused


def _lerobot_copy(tmp_path, feature: str, spec: dict) -> object:  # type: ignore[no-untyped-def]
    import json
    import shutil

    from packing.datasets import default_dataset_root

    root = tmp_path / "ds"
    shutil.copytree(default_dataset_root(), root)
    info = json.loads((root / "meta" / "info.json").read_text())
    info["features"][feature] = spec
    (root / "meta" / "info.json").write_text(json.dumps(info))
    return root


def test_lerobot_int8_declared_for_float_data_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from packing.datasets import LeRobotEpisodes

    root = _lerobot_copy(tmp_path, "action", {"dtype": "int8", "shape": [14], "names": None})
    with pytest.raises(
        ValueError, match=r"stored as torch.float32 but meta/info.json declares torch.int8"
    ):
        LeRobotEpisodes(root, ["action"])[0]


def test_lerobot_missing_parquet_column_names_the_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from packing.datasets import LeRobotEpisodes

    root = _lerobot_copy(tmp_path, "extra", {"dtype": "float32", "shape": [2], "names": None})
    with pytest.raises(KeyError, match=r"file-000.parquet has no column 'extra'"):
        LeRobotEpisodes(root, ["extra"])


def test_pack_plan_built_by_hand_is_checked() -> None:
    import numpy as np

    from packing.planning import PackPlan

    def plan(items: list[int]) -> PackPlan:
        return PackPlan(
            items_N=np.array(items), offsets_P1=np.array([0, len(items)]),
            item_lengths=np.array([3, 4, 5]), token_budget=8,
        )  # fmt: skip

    with pytest.raises(ValueError, match="item 0 more than once"):
        plan([0, 0])
    with pytest.raises(ValueError, match="9 tokens > token_budget=8"):
        plan([1, 2])


def test_a_sampler_of_no_episode_is_refused_not_one_empty_step() -> None:
    """PackedBatchSampler([], 8) yielded one all-padding step an epoch."""
    from packing.planning import PackedBatchSampler, plan_packs

    for build in (lambda: PackedBatchSampler([], 8),
                  lambda: PackedBatchSampler(plan=plan_packs([], 8))):  # fmt: skip
        with pytest.raises(ValueError, match="PackedBatchSampler got no episode"):
            build()
    assert list(PackedBatchSampler([3], 8)) == [[0]]  # one episode: one step


def test_frames_to_tokens_of_no_episode_says_so() -> None:
    """It said 'got float64' (numpy's dtype of an empty list)."""
    from packing.planning import frames_to_tokens

    with pytest.raises(ValueError, match="num_frames is empty"):
        frames_to_tokens([])


def test_dataset_adapters_refuse_what_they_cannot_serve(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Each was accepted (an empty selection, a file as cache_dir, a bool as an index) or
    failed inside pathlib/numpy without naming the argument."""
    import numpy as np

    from packing.datasets import (
        LeRobotEpisodes,
        default_dataset_root,
        episode_lengths,
        write_default_dataset,
    )

    root = default_dataset_root()
    with pytest.raises(ValueError, match=r"episodes=\[\] selects no episode"):
        LeRobotEpisodes(root, keys=["latents"], episodes=[])
    with pytest.raises(ValueError, match=r"cache_dir=.* is a file; pass a folder"):
        LeRobotEpisodes(root, keys=["latents"], cache_dir=__file__)
    with pytest.raises(TypeError, match=r"cache_dir=3 must be a path"):
        LeRobotEpisodes(root, keys=["latents"], cache_dir=3)
    with pytest.raises(TypeError, match=r"root=3 must be a path"):
        episode_lengths(3)  # type: ignore[arg-type]
    eps = LeRobotEpisodes(root, keys=["latents"])
    for bad in (True, 1.0, "a"):
        with pytest.raises(TypeError, match=r"i=.* must be an int"):
            eps[bad]  # type: ignore[index]
    assert eps[np.int64(1)]["episode_index"] == 1  # numpy ints are ints
    (tmp_path / "here").mkdir()
    with pytest.raises(FileExistsError, match=r"exists; write_default_dataset writes a new"):
        write_default_dataset(tmp_path / "here")
    with pytest.raises(TypeError, match=r"lengths\[0\]=2.5 must be an int"):
        write_default_dataset(tmp_path / "new", lengths=(2.5, 3))  # type: ignore[arg-type]


def test_hf_episodes_refuse_an_empty_selection_and_a_bool_index() -> None:
    datasets = pytest.importorskip("datasets")
    from packing.datasets import HFEpisodes

    ds = datasets.Dataset.from_dict({"episode_index": [0, 0, 1], "obs": [1.0, 2.0, 3.0]})
    with pytest.raises(ValueError, match=r"episodes=\[\] selects no episode"):
        HFEpisodes(ds, keys=["obs"], episodes=[])
    with pytest.raises(TypeError, match=r"i=True must be an int"):
        HFEpisodes(ds, keys=["obs"])[True]  # type: ignore[index]


def test_train_helpers_refuse_a_device_mismatch_a_wrong_row_count_and_a_huge_noise() -> None:
    """reduce_loss on another device failed inside torch; broadcast_to_tokens took 3 rows for
    a layout of 2 episodes; episode_noise of 2**40 values failed in torch's allocator."""
    from packing.data import layout_from_lengths
    from packing.train import broadcast_to_tokens, episode_noise, reduce_loss

    ids = torch.tensor([0, 0, 1, -1])
    with pytest.raises(ValueError, match=r"loss is on meta but the doc ids on cpu"):
        reduce_loss(torch.ones(4, device="meta"), ids, "token")
    layout = layout_from_lengths([2, 1], [2, 1], 4)
    with pytest.raises(ValueError, match=r"values_K has 3 rows but the doc ids name 2"):
        broadcast_to_tokens(torch.ones(3), layout)
    assert broadcast_to_tokens(torch.ones(2), layout).tolist() == [1, 1, 1, 0]
    with pytest.raises(ValueError, match=r"values > 4,294,967,296 .* for one episode's noise"):
        episode_noise(0, 0, 0, (2**20, 2**20))


def test_collator_sizes_are_bounded_and_odd_inputs_named() -> None:
    """A budget of 2**40 tokens failed in numpy's allocator; a big-endian array and an
    episode_index of 2**70 failed inside torch; batch.to(3.5) was accepted."""
    import numpy as np

    from packing.data import PackedCollator, Stream

    ep = {"x": torch.ones(2, 3), "episode_index": 0}
    for build in (lambda: PackedCollator(["x"], token_budget=2**40),
                  lambda: PackedCollator(["x"], pad_to_multiple=2**40),
                  lambda: Stream("x", budget=2**40)):  # fmt: skip
        with pytest.raises(ValueError, match=r"must be <= 134217728 \(.*tokens"):
            build()
    with pytest.raises(TypeError, match=r"byte order '>' .* convert it to the native order"):
        PackedCollator(["x"])([{"x": np.ones((2, 3), dtype=">f4"), "episode_index": 0}])
    with pytest.raises(ValueError, match=r"key 'episode_index' is 1180591620717411303424, outside"):
        PackedCollator(["x"])([{**ep, "episode_index": 2**70}])
    batch = PackedCollator(["x"])([ep])
    with pytest.raises(TypeError, match=r"device must be a torch.device or a device string"):
        batch.to(3.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"device='bogus' is not a device"):
        batch.to("bogus")
    assert batch.to("cpu")["x"].shape == batch["x"].shape


def test_a_bool_among_the_lengths_is_refused_not_planned_as_one_token() -> None:
    import numpy as np

    from packing.planning import plan_packs

    for lengths, first in (([True, 3], 0), ((3, True), 1), (np.array([True, False]), 0)):
        with pytest.raises(TypeError, match=rf"lengths holds a bool \(episode {first}\)"):
            plan_packs(lengths, 8)
    assert plan_packs(torch.tensor([3, 4]), 8).packs == [[0, 1]]  # ints of any kind are fine


def test_verify_config_bounds_lr_and_eps_as_its_flags_do() -> None:
    from packing.verify import VerifyConfig

    for kw, match in ((dict(lr=1e300), r"lr=1e\+300 must be <= 10"),
                      (dict(adam_eps=2.0), r"adam_eps=2.0 must be <= 1")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            VerifyConfig(**kw)
    assert VerifyConfig(lr=10.0, adam_eps=1.0).lr == 10.0
