"""The baselines' own logic (benchmarks/step/baselines.py, the attention probe, bench_diffusers_wan's
checkpointing switch): what a skeptic's row is compared on must itself be right."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.step import baselines as bl
from benchmarks.step.bench_step import ACTIONS_PER_FRAME, make_episode
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


def test_diffusers_checkpointing_switch_per_regime():
    pytest.importorskip("diffusers")
    from benchmarks.diffusers import bench_diffusers_wan as wan

    per = "seed=both,short=packed"
    assert wan.checkpointed(per, "seed", "unpacked") and wan.checkpointed(per, "seed", "packed")
    assert wan.checkpointed(per, "short", "packed")
    assert not wan.checkpointed(per, "short", "unpacked")
    assert wan.checkpointed("packed", "short", "packed")
    assert not wan.checkpointed("none", "seed", "packed")
    with pytest.raises(ValueError, match="--checkpointing 'sometimes'"):
        wan.checkpointed("seed=sometimes", "seed", "packed")


def test_attention_probe_picks_the_fastest_candidate_that_is_right():
    # A candidate that is wrong (zeros) or raises is never chosen, whatever its speed; of the
    # right ones the fastest wins; every timing and error is recorded for the JSON.
    import time

    from benchmarks.attention import backends

    def wrong(q, k, v, mask=None):
        return q * 0.0

    def broken(q, k, v, mask=None):
        raise RuntimeError("no kernel for this shape")

    def slow(q, k, v, mask=None):
        time.sleep(0.02)
        return backends.sdpa(q, k, v, mask)

    probe = backends.choose(
        "self", [(1, 2, 24, 24, 8), (1, 2, 40, 40, 8)],
        {"slow": slow, "sdpa": backends.sdpa, "wrong": wrong, "broken": broken},
        device="cpu", iters=3,
    )  # fmt: skip
    assert probe["chosen"] == "sdpa"
    assert set(probe["ms"]) == {"slow", "sdpa"} and set(probe["ms"]["sdpa"]) == {
        "1x2x24x24x8",
        "1x2x40x40x8",
    }
    assert "differs from SDPA's default" in probe["errors"]["wrong"]
    assert "no kernel" in probe["errors"]["broken"]
    assert probe["total ms"]["slow"] > probe["total ms"]["sdpa"]
    with pytest.raises(RuntimeError, match="no self attention candidate ran"):
        backends.choose("self", [(1, 1, 8, 8, 4)], {"broken": broken}, device="cpu")


def test_opensora_sampler_has_one_row_count_a_bucket_and_defers_partial_batches():
    frames = [4, 4, 4, 5, 5, 6, 7, 8, 8, 8, 8, 4, 6, 7]
    cfg, inputs, tpf = _inputs(frames)
    bounds = bl.bounds_for("pad", 4 * tpf, 8 * tpf, 4, tpf)
    target = 3 * 8 * tpf
    batches, deferred = bl.opensora_steps(inputs, bounds, target, cfg.text_len, CPU, seed=0)
    per_bucket: dict[int, set[int]] = {}
    for b in batches:
        rows = b.slots // b.L
        per_bucket.setdefault(b.L, set()).add(rows)
        assert rows == bl.opensora_rows(b.L, target) and b.cropped_tokens == 0
    assert all(len(r) == 1 for r in per_bucket.values())  # one shape a bucket: static
    assert len(per_bucket) <= len(bounds)
    trained = sum(b.slots // b.L for b in batches)
    assert trained + deferred == len(frames) and deferred > 0 and trained > 0
