"""The one GPU entry, benchmarks/gpu.sh, on the CPU: what it would run, and that it runs.

``DRY=1`` prints each stage's commands without running them and still writes ``tree.json``
(the copy's git HEAD, its porcelain status and the hash of the files that would run); the
commands must be the ones docs/benchmarks.md lists for the integrator's GPU run, so the docs
cannot drift from the script. ``QUICK=1`` runs the stages' scripts with ``--quick --device
cpu`` (slow: a few minutes), and every JSON they write carries its provenance.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.harness import provenance as pv  # noqa: E402  (the module: tree_hash, missing)

STAGES = ("serve", "step", "diffusers")


def gpu_sh(out: Path, *stages: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "PYTHONPATH": str(ROOT),
            "CUDA_VISIBLE_DEVICES": "", **env}  # fmt: skip
    return subprocess.run(["bash", "benchmarks/gpu.sh", *stages], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=1500)  # fmt: skip


def commands(stdout: str, out: Path) -> list[str]:
    lines = [ln[4:] for ln in stdout.splitlines() if ln.startswith("=== ") and "limit" in ln]
    cmds = [re.sub(r" \(limit \d+s\) .*", "", ln).replace(str(out), "$OUT") for ln in lines]
    return [c.replace(sys.executable, "python3", 1) for c in cmds]


def test_dry_run_lists_the_documented_commands_and_records_the_tree(tmp_path: Path) -> None:
    proc = gpu_sh(tmp_path, *STAGES, DRY="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = commands(proc.stdout, tmp_path)
    assert [c.split()[1] for c in got] == [
        "benchmarks/serving/bench_serve.py",
        "benchmarks/step/bench_step.py",  # seed
        "benchmarks/step/bench_step.py",  # short
        "benchmarks/diffusers/bench_diffusers_wan.py",
    ]
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    block = doc[doc.index("## Not yet re-measured") :]
    documented = [ln for ln in block.splitlines() if ln.startswith("python3 benchmarks/")]
    assert got == documented[: len(got)], "docs/benchmarks.md's GPU commands drifted from gpu.sh"
    tree = json.loads((tmp_path / "tree.json").read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip
    assert tree["git_rev_parse_head"] == head
    assert isinstance(tree["git_status_porcelain"], list)
    assert tree["tree_sha256"] == pv.tree_hash()[0]


def test_unknown_stage_and_no_stage_are_refused(tmp_path: Path) -> None:
    bad = gpu_sh(tmp_path, "stepp", DRY="1")
    assert bad.returncode == 2 and "unknown stage stepp" in bad.stdout
    usage = gpu_sh(tmp_path)
    assert usage.returncode == 2 and "bash benchmarks/gpu.sh step" in usage.stdout


@pytest.mark.slow
def test_quick_run_of_the_three_stages_writes_traceable_json(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    proc = gpu_sh(tmp_path, *STAGES, QUICK="1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    paths = [tmp_path / "serve" / "serve.json", tmp_path / "step" / "step_seed.json",
             tmp_path / "step" / "step_short.json",
             tmp_path / "diffusers" / "diffusers_wan.json"]  # fmt: skip
    for path in paths:
        doc = json.loads(path.read_text())
        assert pv.missing(doc) == [], path
        assert doc["rows"] and not [r for r in doc["rows"] if r.get("error")], path


def test_lingbot_served_stages_run_the_tests_then_the_benchmark_in_three_calls(
    tmp_path: Path,
) -> None:
    """Issue 42's H200 run: the CUDA tests and the pool mask build in one call, each schedule
    in its own call (a 10-minute limit each), the own one with the compiled LeRobot too."""
    proc = gpu_sh(tmp_path, "lingtests", "lingserve", "lingserve_short", DRY="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "=== pytest tests/test_gpu.py -k 'lingbot or pool_block_mask'" in proc.stdout
    got = commands(proc.stdout, tmp_path)
    assert [c.split()[1] for c in got] == [
        "benchmarks/attention/bench_pool_block_mask.py",
        "benchmarks/serving/bench_lingbot_serve.py",
        "benchmarks/serving/bench_lingbot_serve.py",
    ]
    assert "--schedules own --cuda-graphs --compiled-baseline" in got[1]
    assert "--schedules short --cuda-graphs" in got[2]
    limits = [int(m) for m in re.findall(r"\(limit (\d+)s\)", proc.stdout)]
    assert max(limits) < 600  # each stage fits one device call
