"""The baselines' own logic (benchmarks/baselines.py, merge_step_runs.py, bench_diffusers_wan's
checkpointing switch): what a skeptic's row is compared on must itself be right."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import baselines as bl
import merge_step_runs
from bench_step import ACTIONS_PER_FRAME, make_episode

from packing.model import DiT, DiTConfig

CPU = torch.device("cpu")


def _inputs(frames: list[int]) -> tuple[DiTConfig, list[bl.EpisodeInputs], int]:
    cfg = DiTConfig.tiny(depth=1)
    g = torch.Generator().manual_seed(0)
    eps = [make_episode(i, f, cfg, g) for i, f in enumerate(frames)]
    return cfg, bl.prepare_episodes(DiT(cfg), eps, 0, CPU), cfg.tokens_per_frame + ACTIONS_PER_FRAME


def test_padded_bucket_rows_are_16_aligned_and_keep_every_token():
    cfg, inputs, tpf = _inputs([4, 5, 6, 7, 8, 8, 5, 4])
    bounds = bl.bounds_for("pad", 4 * tpf, 8 * tpf, 3, tpf)
    batches = bl.bucket_step(inputs, bounds, 4 * 8 * tpf, "pad", cfg.text_len, CPU)
    assert all(b.L % bl.PAD_ALIGN == 0 for b in batches)
    assert all(int(n) <= b.L for b in batches for n in b.lengths_B)
    assert sum(b.real_tokens for b in batches) == sum(x.tokens for x in inputs)
    assert sum(b.cropped_tokens for b in batches) == 0
    # the key-padding mask is True on exactly the real keys of each row
    for b in batches:
        keep = (torch.arange(b.L)[None] < b.lengths_B[:, None]).sum()
        assert int(keep) == b.real_tokens


def test_cropped_bucket_rows_are_exact_and_count_what_they_cut():
    cfg, inputs, tpf = _inputs([4, 5, 6, 7, 8, 8, 5, 4])
    bounds = bl.bounds_for("crop", 4 * tpf, 8 * tpf, 3, tpf)
    batches = bl.bucket_step(inputs, bounds, 4 * 8 * tpf, "crop", cfg.text_len, CPU)
    assert all(b.real_tokens == b.slots for b in batches)  # no padding: flash needs no mask
    assert all(b.L in bounds for b in batches)
    assert sum(b.real_tokens + b.cropped_tokens for b in batches) == sum(x.tokens for x in inputs)
    assert sum(b.cropped_tokens for b in batches) > 0


def _run(rows: list[tuple[str, str, float]]) -> dict:
    return {"rows": [{"regime": r, "variant": f"{k}: ...", "tokens/s": t} for r, k, t in rows]}


def test_merge_reads_each_row_against_the_lean_loop_of_its_own_run():
    a = _run([("seed", "lean", 100.0), ("seed", "bucket_sdpa", 90.0)])
    b = _run([("seed", "lean", 110.0), ("seed", "packed", 132.0)])
    rows = {(r["run"], r["kind"]): r for r in merge_step_runs.merge([a, b])}
    assert rows[(1, "packed")]["vs lean"] == pytest.approx(1.2)
    assert rows[(0, "bucket_sdpa")]["vs lean"] == pytest.approx(0.9)
    # the best baseline is the lean loop of run 1 (110), directly and through the anchors
    assert rows[(1, "packed")]["vs best baseline"] == pytest.approx(1.2)
    assert rows[(1, "packed")]["vs best baseline (anchored)"] == pytest.approx(1.2)
    assert rows[(1, "lean")]["lean vs run 0 lean"] == pytest.approx(1.1)


def test_merge_gives_no_anchored_ratio_when_a_baseline_run_has_no_lean_row():
    a = _run([("short", "bucket_sdpa", 106.0)])  # its lean row was cut
    b = _run([("short", "lean", 48.0), ("short", "packed", 120.0)])
    rows = {(r["run"], r["kind"]): r for r in merge_step_runs.merge([a, b])}
    packed = rows[(1, "packed")]
    assert packed["best baseline"] == "bucket_sdpa"
    assert packed["vs best baseline"] == pytest.approx(120 / 106)
    assert "vs best baseline (anchored)" not in packed  # not the lean-only 2.5


def test_errored_rows_are_left_out_of_the_merge():
    a = _run([("seed", "lean", 100.0)])
    a["rows"].append({"regime": "seed", "variant": "bucket_flex: ...", "error": "cut"})
    assert [r["kind"] for r in merge_step_runs.merge([a])] == ["lean"]


def test_diffusers_checkpointing_switch_per_regime():
    pytest.importorskip("diffusers")
    import bench_diffusers_wan as wan

    per = "seed=both,short=packed"
    assert wan.checkpointed(per, "seed", "unpacked") and wan.checkpointed(per, "seed", "packed")
    assert wan.checkpointed(per, "short", "packed")
    assert not wan.checkpointed(per, "short", "unpacked")
    assert wan.checkpointed("packed", "short", "packed")
    assert not wan.checkpointed("none", "seed", "packed")
    with pytest.raises(ValueError, match="--checkpointing 'sometimes'"):
        wan.checkpointed("seed=sometimes", "seed", "packed")
