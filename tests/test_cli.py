"""The ``packing`` console script: the README's main command passes, the proofs fail, errors exit 2."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from packing.cli import build_parser, main

DOCS = Path(__file__).resolve().parents[1] / "docs" / "verify.md"


def test_readme_main_command_passes_on_the_embedded_dataset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``packing verify`` with every default: the embedded dataset, the tiny DiT, fp32 CPU."""
    out = tmp_path / "report.json"
    assert main(["verify", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "PASS: packed training matches unpacked" in printed
    assert "| step | loss unpacked | loss packed |" in printed
    report = json.loads(out.read_text())
    assert report["passed"] is True and report["failures"] == []
    # Not vacuous: all 12 episodes, several per pack, 3 steps, every gradient compared.
    assert report["episodes"] == 12 and len(report["steps"]) == 3
    assert report["packs"] < report["episodes"] and max(report["pack_sizes"]) >= 3
    assert len(report["grads"]) > 50
    assert report["loss_rel"] <= 1e-6 and report["grad_rel_max"] <= 1e-5
    assert report["param_rel"] <= 1e-5
    assert report["leak"]["ok"] is True and report["leak"]["num_docs"] >= 2
    assert report["config"]["dataset"] == "embedded default dataset"
    # The report names the code that produced it (a copied tree's git HEAD can be stale).
    from packing.verify._report import source_sha1

    assert report["environment"]["packing_src_sha1"] == source_sha1()
    assert len(source_sha1()) == 12


def test_no_document_mask_reports_the_leak_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    code = main(["verify", "--no-document-mask", "--episodes", "4", "--steps", "1",
                 "--json", str(out)])  # fmt: skip
    captured = capsys.readouterr()
    printed = captured.out
    assert code == 1
    # Progress goes to stderr as it happens: a run cut short (a long --compile) shows how far
    # it got, and the report on stdout stays clean.
    assert re.search(r"step 0: unpacked, 4 micro-steps, loss [\d.]+", captured.err)
    assert re.search(r"step 0: packed, \d micro-steps", captured.err)
    assert "leak check on a pack of" in captured.err and "step 0:" not in printed
    assert "LEAKS" in printed and "FAIL: " in printed
    report = json.loads(out.read_text())
    assert report["passed"] is False
    assert report["leak"]["ok"] is False and report["leak"]["pairs"]
    assert any("leak" in f for f in report["failures"])


def test_mean_of_means_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    code = main(["verify", "--loss-normaliser", "per-micro-step", "--episodes", "5",
                 "--steps", "1", "--no-leak-check", "--json", str(out)])  # fmt: skip
    # Guard: with equal episode counts per pack a mean of per-pack episode means is exact by
    # accident; the plan here is uneven, which is what real plans are.
    assert len(set(json.loads(out.read_text())["pack_sizes"])) > 1
    assert code == 1
    assert "loss differs" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="torch.compile on CPU needs a C++ compiler (Inductor's CPU code generator)",
)
def test_verify_compile_passes_and_really_compiles(tmp_path: Path) -> None:
    """``--compile``: both models under torch.compile (unpacked dynamic, packed static), the
    same tolerances, and dynamo really built graphs (no silent eager run). ``slow``: 3.8 min
    with a cold Inductor cache on a 2-core VM (docs/verify.md), far longer under load."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    out = tmp_path / "r.json"
    code = main(["verify", "--compile", "--episodes", "4", "--steps", "1", "--no-leak-check",
                 "--json", str(out)])  # fmt: skip
    graphs = counters["stats"]["unique_graphs"] - before
    torch._dynamo.reset()
    report = json.loads(out.read_text())
    assert code == 0, report["failures"]
    assert report["config"]["compile"] is True
    assert report["loss_rel"] <= 1e-6 and report["grad_rel_max"] <= 1e-5
    assert graphs >= 2, f"only {graphs} compiled graphs: the models ran eagerly"


def _docs_example() -> str:
    text = DOCS.read_text()
    m = re.search(r"<!-- example-model: my_packed_model.py -->\n```python\n(.*?)```", text, re.S)
    assert m, "docs/verify.md lost its example model block"
    return m.group(1)


def test_docs_example_model_passes_verify(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The minimal model of docs/verify.md, written to a user's file, through --model."""
    (tmp_path / "my_packed_model.py").write_text(_docs_example())
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "r.json"
    code = main(["verify", "--model", "my_packed_model:build", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(out.read_text())
    assert report["config"]["model"] == "my_packed_model:build"
    assert report["leak"]["inputs"] == ["action"] and report["leak"]["ok"]
    assert report["episodes"] == 12 and report["packs"] >= 2


def test_user_model_factory_without_the_flag_parameter_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "my_packed_model.py").write_text(_docs_example())
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["verify", "--model", "my_packed_model:build", "--mask", "frame-causal"])
    err = capsys.readouterr().err
    assert code == 2
    assert "takes no ['mask'] parameter" in err and "--mask frame-causal" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "nowhere_such_module:build"], "cannot import module 'nowhere_such_module'"),
        (["--model", "packing.model._dit:nope"], "has no callable 'nope'"),
        (["--model", "no_colon"], "expected 'module:factory'"),
        (["--dataset", "/nonexistent/robot"], "expected a local LeRobot v3 dataset root"),
        (["--episodes", "1"], "at least 2 episodes"),
        (["--episodes", "99"], "--episodes 99 > 12 episodes"),
        (["--token-budget", "64"], "> --token-budget 64"),
    ],
)
def test_usage_errors_exit_2_and_name_the_fix(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", *argv]) == 2
    assert message in capsys.readouterr().err


def test_parser_defaults_match_the_docs() -> None:
    args = build_parser().parse_args(["verify"])
    assert (args.device, args.dtype, args.steps, args.mask, args.reduction) == (
        "cpu",
        "float32",
        3,
        "document",
        "episode",
    )
    assert args.document_mask is True and args.leak_check is True
    assert (args.lr, args.adam_eps, args.loss_normaliser) == (1e-4, 1e-6, "global")


def test_no_subcommand_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "verify" in capsys.readouterr().out


def test_python_dash_m_packing_runs_the_cli() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "packing", "verify", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0
    assert "--no-document-mask" in res.stdout and "--model" in res.stdout


def test_dataset_flag_reads_a_users_lerobot_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--dataset takes any local LeRobot v3 root: here a copy of the embedded one."""
    import shutil

    from packing.datasets import default_dataset_root

    root = tmp_path / "my_robot"
    shutil.copytree(default_dataset_root(), root)
    out = tmp_path / "r.json"
    code = main(["verify", "--dataset", str(root), "--episodes", "3", "--steps", "1",
                 "--no-leak-check", "--json", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["config"]["dataset"] == str(root) and report["episodes"] == 3
