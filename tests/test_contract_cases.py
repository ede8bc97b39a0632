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

    from packing._budget_command import PRESET_PARAMS
    from packing.model import DiTConfig, param_count

    for preset, (depth, outside, per_block) in PRESET_PARAMS.items():
        cfg = getattr(DiTConfig, preset)()
        assert cfg.depth == depth
        for d in (1, 7):
            assert param_count(dataclasses.replace(cfg, depth=d)) == outside + d * per_block


def test_threads_above_the_cores_exit_2_before_torch_hangs() -> None:
    out = _cli("verify", "--threads", "100000")
    assert out.returncode == 2 and "--threads 100000 must be in [1," in out.stderr


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
