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
    out = _cli("verify", "--inference", "--model", "nope:nope")
    assert out.returncode == 2 and "does not take --model" in out.stderr


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
