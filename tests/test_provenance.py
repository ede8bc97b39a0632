"""Every result JSON names the code that ran it (benchmarks/harness/provenance.py).

A JSON under benchmarks/results/ either carries the harness's ``provenance`` record (commit,
dirty flag, tree hash, versions) or is one of the pre-provenance files listed, byte for byte,
in benchmarks/results/pre_provenance.txt. The tree hash is checked against a small git
repository made in the test: equal to its commit's hash when clean, different once a file
changes, and the dirty flag says so.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import benchmarks.harness.provenance as pv  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def pre_provenance() -> dict[str, str]:
    lines = (RESULTS / "pre_provenance.txt").read_text().splitlines()
    return {name: sha for sha, name in (ln.split(maxsplit=1) for ln in lines if ln[:1] != "#")}


def test_every_result_json_is_traceable_or_a_listed_pre_provenance_file() -> None:
    old = pre_provenance()
    for path in sorted(RESULTS.rglob("*.json")):
        rel = path.relative_to(RESULTS).as_posix()
        if rel in old:
            sha = hashlib.sha256(path.read_bytes()).hexdigest()
            assert sha == old[rel], f"{rel} is listed as pre-provenance but its bytes changed"
            continue
        lacks = pv.missing(json.loads(path.read_text()))
        assert not lacks, f"benchmarks/results/{rel} lacks {lacks}: write it through the harness"
    assert len(old) >= 50  # the listed files are still there (guard against an empty list)


def test_missing_names_what_a_hand_written_record_lacks() -> None:
    assert pv.missing({"rows": []}) == ["provenance"]
    hand = {"provenance": {"code_commit": "914cc15", "note": "written by hand"}}
    assert set(pv.missing(hand)) >= {"git_commit", "tree_sha256", "versions"}
    full = pv.provenance_record()
    assert pv.missing({"provenance": full}) == []
    del full["versions"]["diffusers"]
    assert pv.missing({"provenance": full}) == ["versions.diffusers"]


def test_harness_writes_provenance_into_every_json(tmp_path: Path) -> None:
    from benchmarks.harness.results import write_json

    args = argparse.Namespace(out=str(tmp_path / "r.json"), quick=True)
    doc = json.loads(write_json("x", args, {"rows": [{"a": 1}]}, device="cpu").read_text())
    assert pv.missing(doc) == []
    prov = doc["provenance"]
    assert prov["tree_sha256"] == pv.tree_hash()[0]  # the files on disk, computed, not typed
    assert set(prov["versions"]) >= {"torch", "triton", "flash_attn_4", "diffusers", "lerobot"}
    assert prov["versions"]["torch"]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                          text=True).stdout  # fmt: skip


def test_tree_hash_matches_its_commit_when_clean_and_not_after_an_edit(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "packing" / "data").mkdir(parents=True)
    (repo / "benchmarks" / "step").mkdir(parents=True)
    (repo / "packing" / "data" / "_collate.py").write_text("x = 1\n")
    (repo / "benchmarks" / "step" / "bench_step.py").write_text("print(1)\n")
    (repo / "benchmarks" / "results").mkdir()
    (repo / "benchmarks" / "results" / "step.json").write_text("{}")  # data, not code
    (repo / "pyproject.toml").write_text("[project]\n")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    on_disk, n = pv.tree_hash(repo)
    assert n == 3  # two scripts and pyproject.toml; the JSON is not code
    assert pv.commit_tree_hash("HEAD", repo) == (on_disk, n)
    clean = pv.provenance_record(repo)
    assert (
        clean["git_dirty"] is False
        and clean["git_commit"] == git(repo, "rev-parse", "HEAD").strip()
    )
    (repo / "benchmarks" / "step" / "bench_step.py").write_text("print(2)\n")
    dirty = pv.provenance_record(repo)
    assert dirty["git_dirty"] is True and dirty["git_commit"] == clean["git_commit"]
    assert dirty["tree_sha256"] != clean["tree_sha256"]  # the copy that ran, not HEAD
    assert pv.commit_tree_hash("HEAD", repo)[0] == clean["tree_sha256"]
    with pytest.raises(ValueError, match="not a commit"):
        pv.commit_tree_hash("no-such-rev", repo)


def test_a_tree_without_git_records_none_not_a_guess(tmp_path: Path) -> None:
    (tmp_path / "packing").mkdir()
    (tmp_path / "packing" / "a.py").write_text("")
    prov = pv.provenance_record(tmp_path)
    # tmp_path may sit inside some other repository; only a tree with no git at all gives None
    if prov["git_commit"] is None:
        assert prov["git_dirty"] is None
    assert pv.tree_hash(tmp_path)[1] == 1
