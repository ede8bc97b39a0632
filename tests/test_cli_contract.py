"""The exit-status contract of ``packing verify`` and verify on a user's own dataset.

0 = pass, 1 = the comparison ran and failed, 2 = bad input, usage or environment, with one
line on stderr that names the problem and the fix (``--traceback`` adds the traceback),
3 = the run crashed inside torch, a library or the model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from packing.cli import build_parser, main

DOCS = Path(__file__).resolve().parents[1] / "docs" / "verify.md"
FAST = ["--episodes", "3", "--steps", "1", "--no-leak-check"]


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The one stderr line of an exit-2 error (progress lines start with '  ..')."""
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("  ..")]
    assert len(err) == 1, err
    assert err[0].startswith("packing verify: error: ")
    return err[0]


@pytest.fixture
def user_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module of broken factories on the path."""
    (tmp_path / "broken_models.py").write_text(
        textwrap.dedent(
            """
            import torch
            from packing.model import tiny_reference_model

            def raises():
                return {}["weights"]   # a KeyError from inside the user's code

            def crashes(**kw):
                m = tiny_reference_model(**kw)

                def forward(batch):
                    raise RuntimeError("CUDA error: an illegal memory access")  # not input
                m.forward = forward
                return m

            def nan_weights(**kw):
                m = tiny_reference_model(**kw)
                with torch.no_grad():
                    for p in m.parameters():
                        p.fill_(float("nan"))
                return m
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "broken_models"


# -- exit 2: bad input, usage, environment -------------------------------------------------------


def test_json_into_a_missing_folder_exits_2_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no" / "such" / "report.json"
    assert main(["verify", *FAST, "--json", str(missing)]) == 2
    captured = capsys.readouterr()
    assert "PASS" not in captured.out  # refused before the run: never PASS then a crash
    assert f"the folder {missing.parent} does not exist; create it first" in captured.err
    assert "Traceback" not in captured.err


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("tpu", r"--device: 'tpu' is not a torch device; use cpu, cuda or cuda:N"),
        ("cuda", r"--device cuda: torch sees no CUDA GPU .*or use --device cpu"),
        ("cuda:7", r"--device cuda:7: torch sees no CUDA GPU"),
    ],
)
def test_a_device_that_is_not_here_exits_2(
    device: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert main(["verify", "--device", device]) == 2
    import re

    assert re.search(message, error_line(capsys))


def test_a_model_factory_that_raises_exits_2_naming_it(
    user_models: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", "--model", f"{user_models}:raises"]) == 2
    line = error_line(capsys)
    assert f"--model {user_models}:raises: the factory raised KeyError: 'weights'" in line
    assert "fix the factory" in line


def test_traceback_flag_adds_the_traceback(
    user_models: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", "--model", f"{user_models}:raises", "--traceback"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and 'return {}["weights"]' in err
    assert err.rstrip().splitlines()[-1].startswith("packing verify: error: --model")


def test_a_truncated_parquet_exits_2_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from packing.datasets import default_dataset_root

    root = tmp_path / "ds"
    shutil.copytree(default_dataset_root(), root)
    data = sorted((root / "data").glob("*/*.parquet"))[0]
    data.write_bytes(data.read_bytes()[:2000])
    assert main(["verify", "--dataset", str(root), *FAST]) == 2
    line = error_line(capsys)
    assert f"{data}: cannot read it as parquet" in line and "truncated, corrupt" in line


def test_invalid_info_json_exits_2_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from packing.datasets import default_dataset_root

    root = tmp_path / "ds"
    shutil.copytree(default_dataset_root(), root)
    (root / "meta" / "info.json").write_text('{"features": ')
    assert main(["verify", "--dataset", str(root), *FAST]) == 2
    assert f"{root / 'meta' / 'info.json'} is not valid JSON" in error_line(capsys)


def test_bad_feature_flags_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--feature", "latents"]) == 2
    assert "expected STREAM=FEATURE" in error_line(capsys)
    assert main(["verify", "--feature", "latents=nope"]) == 2
    assert "has no feature 'nope'" in error_line(capsys)
    assert main(["verify", "--threads", "0"]) == 2
    assert "--threads: 0 is below 1 (CPU threads; 1 to 4,096)" in error_line(capsys)


# -- divergence is not a packing verdict ---------------------------------------------------------


def test_both_runs_non_finite_is_reported_as_divergence(
    user_models: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    code = main(["verify", "--model", f"{user_models}:nan_weights", *FAST, "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 2
    assert "DIVERGED (no verdict on packing): both runs diverged" in printed
    assert "loss differs" not in printed and " ok" not in printed
    report = json.loads(out.read_text())
    assert report["diverged"] is True and report["passed"] is False


def test_adam_eps_0_divergence_never_prints_ok_beside_nan(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """AdamW with eps=0 divides 0 by 0 on exactly-zero gradients: parameters turn nan in both
    runs after the first step. Before, the parameter line said 'ok' (max() skipped the nan)."""
    assert main(["verify", "--adam-eps", "0", *FAST]) == 2
    printed = capsys.readouterr().out
    assert "DIVERGED" in printed and "raise --adam-eps" in printed
    param_line = next(line for line in printed.splitlines() if "rel param diff" in line)
    assert "inf" in param_line and " ok" not in param_line


# -- the contract is documented -------------------------------------------------------------------


def test_verify_help_and_docs_state_the_exit_contract() -> None:
    sub = build_parser()._subparsers._group_actions[0].choices["verify"]  # type: ignore[union-attr]
    text = sub.format_help()
    for line in ("0  packed and unpacked training agree", "1  the comparison ran and failed",
                 "2  bad input, usage or environment", "--traceback"):  # fmt: skip
        assert line in text
    docs = DOCS.read_text()
    assert "| 2 | bad input, usage or environment" in docs


def test_help_does_not_import_torch() -> None:
    code = (
        "import sys; from packing.cli import main\n"
        "try:\n    main(['verify', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "print(sorted(m for m in ('torch', 'numpy', 'pyarrow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_verify_runs_on_one_cpu_thread_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's default (a thread per core) made verify ~10x slower on a busy 2-core machine."""
    from packing.cli._verify import _set_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torch.set_num_threads(2)
        restore = _set_threads(None)
        assert torch.get_num_threads() == 1
        restore()  # main() leaves torch as it found it
        assert torch.get_num_threads() == 2
        _set_threads(2)  # --threads 2 (of the 2 cores CI has)
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's environment says otherwise
        torch.set_num_threads(2)
        _set_threads(None)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_main_command_needs_no_extra_only_pyarrow(tmp_path: Path) -> None:
    """What a plain ``pip install packing`` has: the main command never imports lerobot or
    datasets (the extras), only torch, numpy, einops and pyarrow (which itself uses pandas
    when it happens to be installed, and does without it otherwise)."""
    code = textwrap.dedent(
        """
        import sys
        from packing.cli import main
        code = main(["verify", "--episodes", "3", "--steps", "1", "--no-leak-check"])
        extras = [m for m in ("lerobot", "datasets") if m in sys.modules]
        print("exit", code, "extras", extras, "pyarrow", "pyarrow" in sys.modules)
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    last = out.stdout.strip().splitlines()[-1]
    assert last == "exit 0 extras [] pyarrow True", out.stderr[-2000:]
    import tomllib

    pyproject = tomllib.loads((DOCS.parents[1] / "pyproject.toml").read_text())
    deps = pyproject["project"]["dependencies"]
    assert any(d.startswith("pyarrow") for d in deps)
    # The torch and numpy ranges are the tested ones: tests/test_versions.py.


# -- verify on the user's own data, no code --------------------------------------------------------


def test_verify_on_a_lerobot_dataset_with_its_own_feature_names_and_shapes(
    user_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """observation.latent (16, 6, 10) and action (7,), written by lerobot: verify maps the
    features to the reference model's streams, sizes the model from them and passes."""
    out = tmp_path / "r.json"
    code = main(["verify", "--dataset", str(user_dataset), "--steps", "1", "--json", str(out)])
    assert code == 0, capsys.readouterr()
    report = json.loads(out.read_text())
    assert report["config"]["features"] == {"latents": "observation.latent", "action": "action"}
    assert report["episodes"] == 6 and report["packs"] < 6
    # 15 tokens a frame (6x10 latents, 2x2 patches) and the real frame counts: sized from data.
    assert report["tokens"] == 15 * (3 + 5 + 2 + 4 + 6 + 3)
    assert report["leak"]["ok"] is True and report["leak"]["num_docs"] >= 2
    # Padding stays modest with 15-token frames (128 would pad each episode to 1,920 tokens,
    # 3% real; a multiple of 8 pads to 120).
    assert report["efficiency_unpacked"] > 0.4


def test_feature_flag_maps_a_stream_explicitly(
    user_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """observation.state (5,) as the action stream: the model is sized to 5 action dims."""
    out = tmp_path / "r.json"
    code = main(["verify", "--dataset", str(user_dataset), "--feature",
                 "action=observation.state", *FAST, "--json", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr()
    features = json.loads(out.read_text())["config"]["features"]
    assert features == {"latents": "observation.latent", "action": "observation.state"}


def test_ambiguous_features_name_the_candidates(
    user_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "two_actions"
    shutil.copytree(user_dataset, root)
    info = json.loads((root / "meta" / "info.json").read_text())
    info["features"]["joint_targets"] = info["features"].pop("action")  # no feature "action"
    (root / "meta" / "info.json").write_text(json.dumps(info))
    assert main(["verify", "--dataset", str(root), *FAST]) == 2
    line = error_line(capsys)
    assert "cannot tell which feature is the reference model's 'action' stream" in line
    assert "'observation.state', 'joint_targets'" in line
    assert "pass --feature action=FEATURE" in line


def test_training_example_runs_on_the_users_dataset_without_code(user_dataset: Path) -> None:
    """docs/example_lerobot_training.py on observation.latent (16, 6, 10) + action (7,)."""
    import runpy

    import numpy as np

    path = DOCS.parent / "example_lerobot_training.py"
    out = runpy.run_path(str(path))["main"]([str(user_dataset), "--epochs", "1", "--workers",
                                             "0", "--token-budget", "256"])  # fmt: skip
    assert out["streams"] == {"latents": "observation.latent", "action": "action"}
    assert sorted(out["episodes_seen"]) == list(range(6)) and out["steps"] >= 2
    assert all(np.isfinite(out["losses"]))


# -- flags of the other mode, crashes, the report path, the data ----------------------------------
def test_flags_of_the_distributed_run_are_refused_without_nproc(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["verify", "--checkpointing", "ops", "--fsdp-autocast", "--blocks", "nope"]
    assert main(argv) == 2
    line = error_line(capsys)
    assert (
        "--checkpointing ops, --blocks nope, --fsdp-autocast apply to the distributed run" in line
    )
    assert "add --nproc 2" in line


def test_the_single_process_ablation_is_refused_with_nproc(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["verify", "--nproc", "2", "--loss-normaliser", "per-micro-step"]) == 2
    assert "planted mistake is --loss-normaliser per-rank" in error_line(capsys)


def test_a_crash_inside_the_model_exits_3_not_2(
    user_models: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", "--model", f"{user_models}:crashes", *FAST]) == 3
    line = error_line(capsys)
    assert "RuntimeError: CUDA error: an illegal memory access" in line
    assert "--traceback shows where" in line


def test_an_unwritable_report_path_is_refused_before_the_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["verify", *FAST, "--json", "/proc/report.json"]) == 2
    line = error_line(capsys)
    assert "--json /proc/report.json cannot be written" in line
    assert ".. step" not in capsys.readouterr().err  # nothing ran


def test_non_finite_data_is_named_by_episode_key_and_index() -> None:
    from packing.verify._command import check_finite_episodes

    good = {"latents": torch.zeros(3, 2), "episode_index": 4}
    bad = {"latents": torch.zeros(3, 2), "action": torch.zeros(3, 7), "episode_index": 9}
    bad["action"][2, 5] = float("inf")
    check_finite_episodes([good], "here")
    with pytest.raises(
        ValueError,
        match=r"episode 9 of here: .action. holds inf at index \(2, 5\).*--no-check-finite",
    ):
        check_finite_episodes([good, bad], "here")


def test_version_and_budget_commands(capsys: pytest.CaptureFixture[str]) -> None:
    import packing

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"packing {packing.__version__}"
    assert main(["budget", "--gpus", "2", "--gpu-memory-gb", "150"]) == 0
    out = capsys.readouterr().out
    # The stored H200 fit: 271K tokens per GPU at 2 GPUs, full checkpointing, 5.0 B parameters.
    assert "5.00 B parameters, depth 30" in out and "| 2 | 271,360 |" in out
    assert "assumed" not in out  # the memory was given
    assert main(["budget", "--gpus", "2"]) == 0
    # Without --gpu-memory-gb or --measure the H200's memory is an assumption, and it says so.
    assert "note: 150.0 GB is an H200's, assumed; for another GPU pass --gpu-memory-gb" in (
        capsys.readouterr().out
    )
    assert main(["budget", "--gpus", "0"]) == 2
    assert "--gpus: 0 is below 1 (GPUs; 1 to 65,536)" in capsys.readouterr().err


def test_the_no_multi_episode_pack_hint_says_raise_the_budget() -> None:
    from packing.verify._report import NO_MULTI_EPISODE_PACK

    assert "raise --token-budget" in NO_MULTI_EPISODE_PACK and "lower" not in NO_MULTI_EPISODE_PACK


# -- every flag of every subcommand goes through the shared parser's checks ---------------------
def _subcommands() -> dict[str, argparse.ArgumentParser]:
    sub = build_parser()._subparsers._group_actions[0]  # type: ignore[union-attr]
    return dict(sub.choices)  # type: ignore[arg-type]


def _valid_argv(command: str, tmp_path: Path) -> list[str]:
    """The least a command needs to parse (encode's SRC, DST and --vae)."""
    return (
        [command, str(tmp_path), str(tmp_path / "out"), "--vae", "tiny"]
        if command == ("encode")
        else [command]
    )


def _parses(argv: list[str]) -> bool:
    """Whether the parser takes ``argv`` (parsed only: an accepted value runs nothing)."""
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        assert e.code == 2
        return False
    return True


def test_an_option_without_a_check_is_refused_when_the_parser_is_built() -> None:
    from packing.cli._parser import Parser, whole

    p = Parser(prog="packing demo")
    p.add_argument("--ok", type=whole(1, 8, "things"))
    p.add_argument("--mode", choices=["a", "b"])
    p.add_argument("--flag", action="store_true")
    with pytest.raises(TypeError, match=r"packing demo --steps: .* needs choices= or a check"):
        p.add_argument("--steps", type=int)
    with pytest.raises(TypeError, match="--name"):
        p.add_argument("--name")


def test_every_option_of_every_subcommand_is_checked() -> None:
    from packing.cli._parser import is_checked

    commands = _subcommands()
    assert set(commands) == {"verify", "budget", "encode", "serve"}
    seen = 0
    for name, parser in commands.items():
        for action in parser._actions:
            assert is_checked(action), (name, action.option_strings or action.dest)
            seen += action.nargs != 0
    assert seen > 50  # not vacuous: the options that take a value were walked


BAD_NUMBERS = ("nan", "inf", "-inf", "1e30", "-1e30", "abc", "")
BAD_TEXT = ("", "\x00bad", "x" * 5000)


def test_every_option_refuses_bad_values_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each option that takes a value, given values no check should take: a number option
    nan, inf, +-1e30 (bounded on both sides), a text option an empty or control-character
    string. The parser answers exit 2, one line naming the option; never a run."""
    (tmp_path / "meta").mkdir()
    for name, parser in _subcommands().items():
        for action in parser._actions:
            if action.nargs == 0 or not action.option_strings:
                continue
            flag = action.option_strings[-1]
            numeric = getattr(action.type, "__name__", "") in ("whole number", "number")
            for bad in BAD_NUMBERS if numeric else BAD_TEXT:
                assert not _parses([*_valid_argv(name, tmp_path), flag, bad]), (name, flag, bad)
                err = capsys.readouterr().err.splitlines()
                assert len(err) == 1 and flag in err[0], (name, flag, bad, err)
    for bad in ("", "nope", str(tmp_path / "no" / "such")):  # encode's SRC: a folder
        assert not _parses(["encode", bad, str(tmp_path / "out"), "--vae", "tiny"])
        assert "a local LeRobot v3 dataset root" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--depth", "100000"], "--depth: 100000 is above 1,000"),
        (["--params", "1e30"], "--params: 1e30 is above 10,000,000,000,000"),
        (
            ["--gpu-memory-gb", "0.001"],
            "--gpu-memory-gb: 0.001 must be a finite number in [1, 10000]",
        ),
        (["--gpu-memory-gb", "5"], "nothing fits: at 8 GPUs the sharded states alone need"),
        (["--params", "1e12", "--gpus", "2"], "nothing fits: at 2 GPUs the sharded states"),
    ],
)
def test_budget_refuses_what_would_print_a_table_of_zeros(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """These printed a table of zeros and exited 0."""
    assert main(["budget", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1
    assert message in captured.err


def test_budget_says_why_a_gpu_count_holds_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    """1 GPU of 40 GB cannot hold a 5 B model's states, 8 can: the 1-GPU row says why."""
    assert main(["budget", "--gpu-memory-gb", "40", "--gpus", "1", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "| 1 | none (the sharded states alone need 80.3 GB of 36.8 GB)" in out
    assert "| 8 | 73,728 |" in out and "| 0 |" not in out


def test_ctrl_c_exits_130_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from packing.cli import _main

    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(_main.COMMANDS["budget"], "run", interrupted)
    assert main(["budget"]) == 130
    assert capsys.readouterr().err.splitlines() == ["packing budget: interrupted"]
