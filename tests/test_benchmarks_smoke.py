"""Every benchmark script runs with --quick on the CPU, prints one table and writes its JSON.

The scripts are plain programs run on the GPU by hand (benchmarks/gpu.sh); this keeps them
from rotting as the library changes. Tiny sizes and one regime each where the script has two:
the numbers mean nothing here. All are ``slow`` (``scripts/dev.sh test-slow``), not in CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPTS = [
    ("data/bench_collate.py", []),
    ("data/bench_collate_worker.py", []),
    ("attention/bench_block_mask.py", []),
    ("attention/bench_pool_block_mask.py", []),
    ("attention/bench_attention.py", ["--regimes", "seed"]),
    (
        "step/bench_step.py",
        ["--regimes", "seed", "--variants", "unpacked,packed,per_token,cudagraphs", "--profile"],
    ),
    (
        "step/bench_step.py",
        [
            "--regimes",
            "seed,short",
            "--variants",
            "lean,lean_whole,bucket_sdpa,bucket_crop,bucket_opensora,fill",
            "--fills",
            "1.0,0.5",
        ],
    ),
    ("step/bench_step_fill.py", []),
    ("distributed/find_token_budget.py", []),
    (
        "diffusers/bench_diffusers_wan.py",
        ["--regimes", "seed", "--variants", "unpacked,unpacked_bucketed,packed"],
    ),
    ("serving/bench_serve.py", ["--configs", "small", "--concurrency", "1,2"]),
    ("serving/host_overhead.py", []),
]


@pytest.mark.slow
@pytest.mark.parametrize(("script", "extra"), SCRIPTS, ids=[s for s, _ in SCRIPTS])
def test_script_runs_quick_on_cpu(script: str, extra: list[str], tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--device", "cpu",
         "--out", str(out), *extra],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table_lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("|---")]
    assert table_lines, f"{script} printed no markdown table"
    doc = json.loads(out.read_text())
    assert doc["machine"]["date_utc"] and doc["command"] and doc["provenance"]["tree_sha256"]
    rows = doc["rows"]
    assert rows, f"{script} wrote no rows"
    errors = [r for r in rows if r.get("error")]
    assert not errors, errors
    if script == "diffusers/bench_diffusers_wan.py":
        # packed and the unmodified model per episode, same episodes and weights, fp32 CPU
        assert {r["variant"] for r in rows} == {
            "unpacked[diffusers]",
            "unpacked_bucketed[diffusers]",
            "packed[auto]",
        }
        assert all(r["loss rel diff"] < 1e-5 for r in rows if "bucketed" not in r["variant"])
        bucketed = next(r for r in rows if "bucketed" in r["variant"])
        assert bucketed["micro-steps/step"] < bucketed["episodes/step"]  # rows share batches
    if script == "serving/bench_serve.py":
        # the CPU run is eager fp32: packed and alone agree, and the sync check ran
        assert doc["cosine"]["small"]["min"] > 0.999999, doc["cosine"]
        assert doc["cosine"]["small packed_shapes"]["min"] > 0.999999, doc["cosine"]
        assert doc["sync_check"]["engine_steps"] >= 20, doc["sync_check"]
        arms = {(r["arm"], r["mix"]): r for r in rows}
        assert arms[("alone/graphs", "short")]["shapes"] > 1  # one shape per request length
        assert arms[("packed_shapes/graphs", "short")]["shapes"] > 1  # several pack shapes
        bucketed = arms[("padded_bucketed/graphs", "short")]
        assert bucketed["tokens_mean"] < arms[("padded/graphs", "short")]["tokens_mean"]
        assert len(doc["open_loop"]) == 2 and all("p99_ms" in r for r in doc["open_loop"])
    if script == "step/bench_step.py":
        # every variant trains on the same episodes and weights: the losses must agree
        # (fp32 on CPU), and a NaN run would have been flagged as an error above
        for r in rows:
            assert r["MFU of measured 790"] > r["MFU of datasheet 989"] > 0, r
            if r["variant"].startswith(("lean", "bucket")):
                assert r["attention probe"]["self"]["chosen"], r  # probed, recorded
            assert len(r["losses"]) == 3 and all(abs(x) < 1e3 for x in r["losses"]), r
            # cropped buckets train on fewer tokens and Open-Sora's steps are other batches:
            # their losses differ by design
            if not r["variant"].startswith(("unpacked", "bucket_crop", "bucket_opensora")):
                assert r["loss rel diff"] < 1e-4, r


def test_paired_timing_reads_the_ratio_of_two_calls_whatever_runs_first() -> None:
    # The harness behind the "paired" attention rows (packing vs FA4 called directly): calls
    # alternate, each is timed alone, and the ratio is time(b) / time(a). Sleeps of 10 and 30
    # ms stand in for two kernels; a harness that mixed up A and B, or timed the pair as one,
    # would read ~1/3 or ~1. The bounds are loose because a busy 2-core CI machine wakes a
    # sleeper milliseconds late (with 1 and 3 ms sleeps under `-n 2` the ratio read 5.3).
    import time

    sys.path.insert(0, str(ROOT))
    from benchmarks import harness

    res = harness.time_paired(lambda: time.sleep(0.010), lambda: time.sleep(0.030),
                             device="cpu", warmup=1, iters=10)  # fmt: skip
    assert 1.5 < res["ratio b/a median"] < 6.0, res
    assert res["a median ms"] < res["b median ms"] and res["pairs"] == 10
