"""The torch and numpy ranges pyproject.toml declares are the ones CI tests, and the torch
internals packing reads exist on the torch this runs on.

CI runs this file on both ends of the range (scripts/dev.sh test: torch 2.11 with numpy 2.0,
torch 2.15 with numpy 2.5); docs/compatibility.md says what was run where.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch

from packing.attention._compile import TESTED_TORCH, _torch_minor, check_torch_version

ROOT = Path(__file__).resolve().parents[1]


def _dependency(name: str) -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(d for d in deps if re.match(rf"{name}\b", d))


def _pin(constraints: str, name: str) -> str:
    match = re.search(rf"^{name}==(\S+)$", (ROOT / constraints).read_text(), re.M)
    assert match, f"{constraints} pins no {name}"
    return match.group(1)


def _minor(version: str) -> tuple[int, int]:
    return _torch_minor(version)


def test_the_torch_range_is_exactly_the_two_ends_ci_runs() -> None:
    # pyproject: torch>=2.11,<2.16; CI: 2.11.0 (constraints.txt) and 2.15.0
    # (constraints-newest.txt). Raising the cap without running the new release, or moving a
    # pin without the range, fails here.
    lo, hi = re.fullmatch(r"torch>=(\d+\.\d+),<(\d+\.\d+)", _dependency("torch")).groups()  # type: ignore[union-attr]
    oldest = _minor(_pin("constraints.txt", "torch"))
    newest = _minor(_pin("constraints-newest.txt", "torch"))
    assert _minor(lo) == oldest and _minor(hi) == (newest[0], newest[1] + 1)
    assert (oldest, newest) == TESTED_TORCH


def test_the_numpy_range_starts_at_the_oldest_numpy_ci_runs() -> None:
    # pyproject: numpy>=2.0, tested with 2.0.2 beside torch 2.11 and 2.5.5 beside torch 2.15.
    lo = re.fullmatch(r"numpy>=(\d+\.\d+)", _dependency("numpy")).group(1)  # type: ignore[union-attr]
    oldest, newest = _pin("constraints.txt", "numpy"), _pin("constraints-newest.txt", "numpy")
    assert _minor(oldest) == _minor(lo) and _minor(newest) > _minor(oldest)


def test_this_suite_runs_inside_the_tested_range() -> None:
    # Inside the range nothing warns; the suite on another torch would be testing a claim
    # pyproject.toml does not make.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_torch_version(), torch.__version__
    assert _minor(np.__version__) >= _minor(_dependency("numpy").split(">=")[1]), np.__version__


@pytest.mark.parametrize(
    ("version", "inside"),
    [("2.11.0+cu130", True), ("2.15.0", True), ("2.13.1+cpu", True), ("2.10.2", False),
     ("2.16.0", False), ("2.16.0a0+git1234567", False), ("3.0.0", False)],
)  # fmt: skip
def test_a_torch_outside_the_range_is_warned_about(version: str, inside: bool) -> None:
    check_torch_version.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert check_torch_version(version) is inside
            assert check_torch_version(version) is inside  # cached: warns once
        messages = [str(w.message) for w in caught]
        if inside:
            assert messages == []
        else:
            assert len(messages) == 1
            assert re.search(
                rf"torch {re.escape(version)} is outside .*2\.11 to 2\.15", messages[0]
            )
    finally:
        check_torch_version.cache_clear()


def test_the_dynamo_internals_packing_reads_exist() -> None:
    # packing.attention._compile.call_compiled sets these two and catches the exception by
    # name; the selective-checkpoint policy of packing.train._fsdp saves flex attention's
    # higher-order op (an ImportError there would silently recompute attention instead).
    import torch._dynamo
    import torch._dynamo.exc
    from torch._higher_order_ops.flex_attention import flex_attention as flex_hop

    cfg = torch._dynamo.config
    assert isinstance(cfg.recompile_limit, int)
    assert isinstance(cfg.fail_on_recompile_limit_hit, bool)
    assert issubclass(torch._dynamo.exc.FailOnRecompileLimitHit, Exception)
    assert callable(flex_hop)


def test_the_first_compile_checks_the_torch_version(monkeypatch: pytest.MonkeyPatch) -> None:
    # The check sits where packing compiles (FLEX_KERNELS, the compiled block-mask builder),
    # not in the per-call path.
    import packing.attention._compile as compile_mod

    calls: list[None] = []
    monkeypatch.setattr(compile_mod, "check_torch_version", lambda: calls.append(None))
    kernels = compile_mod.ShapeKernels(lambda: lambda x: x, static_shapes=1, name="t", fix="")
    kernels.get((8, 8))
    kernels.get((8, 8))
    assert len(calls) == 1


def test_every_extras_install_hint_is_a_command_that_works_here() -> None:
    """A missing optional package names the command that installs its extra: from packing's
    checkout (packing is not on an index, where ``packing[x]`` is someone else's package),
    with constraints.txt exactly for the extras that pull lerobot (its torch pin makes pip
    backtrack without them)."""
    from packing._lazy import CONSTRAINED, install_hint

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    pulls_lerobot = {name for name, deps in extras.items() if any("lerobot" in d for d in deps)}
    assert pulls_lerobot == set(CONSTRAINED)
    for name in extras:
        hint = install_hint(name)
        assert hint.startswith(f"pip install -e '.[{name}]'"), hint
        assert ("-c constraints.txt" in hint) == (name in pulls_lerobot), hint
        assert "'packing[" not in hint
