"""The LingBot-VA benchmark runs with --smoke on the CPU: every arm on the same episodes,
weights and draws, and the first step's loss agrees across LeRobot's own path, the lean loop
and the packed step (a packing bug would show as O(1), bf16 noise is ~1e-5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_lingbot_smoke_runs_and_the_arms_agree(tmp_path: Path) -> None:
    pytest.importorskip("lerobot.policies.lingbot_va.utils")
    out = tmp_path / "lingbot.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/lingbot/bench_lingbot.py"), "--smoke",
         "--out", str(out)],
        capture_output=True, text=True, timeout=900, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert any(ln.startswith("|---") for ln in proc.stdout.splitlines())
    doc = json.loads(out.read_text())
    assert doc["provenance"]["tree_sha256"] and doc["machine"]["date_utc"]
    rows = doc["rows"]
    assert not [r for r in rows if r.get("error")], rows
    arms = {(r["regime"], r["arm"]) for r in rows}
    want = ("packed[lingbot_va]", "packed[bench]", "lerobot", "lean")
    assert arms == {(g, a) for g in ("seed", "short") for a in want}
    for r in rows:
        assert r["loss rel diff"] < 1e-3, r  # bf16 on the CPU; every arm, every regime
        assert r["MFU of measured 790"] > 0 and r["tokens/s"] > 0
    assert all(0 < p["share of step (masks + conditioning)"] < 1 for p in doc["profile"].values())


@pytest.mark.slow
def test_bench_lingbot_fsdp_runs_on_two_gloo_ranks(tmp_path: Path) -> None:
    # issue 44's script, proven where it can be: 2 CPU ranks under torchrun (gloo), FSDP2 over
    # a tiny LingBot-VA; every arm runs, packing makes fewer collective calls than one episode
    # a micro-step, and the first step's loss agrees across arms (bf16 on the CPU)
    pytest.importorskip("lerobot.policies.lingbot_va.utils")
    out = tmp_path / "fsdp.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         str(ROOT / "benchmarks/lingbot/bench_lingbot_fsdp.py"), "--smoke", "--out", str(out)],
        capture_output=True, text=True, timeout=1200, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["arm"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"packed[lingbot_va]", "lerobot", "lean"}, rows
    assert not [r for r in rows.values() if r.get("error")], rows
    assert all(r["gpus"] == 2 for r in rows.values())
    packed, lerobot, lean = rows["packed[lingbot_va]"], rows["lerobot"], rows["lean"]
    assert packed["collectives/step"] < lean["collectives/step"] < lerobot["collectives/step"]
    for r in (packed, lean):
        assert r["loss rel diff"] < 1e-3, r
