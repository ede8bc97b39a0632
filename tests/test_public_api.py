"""The public surface: every exported name resolves and has one home; `import packing` stays
light; names that moved still resolve, with a warning naming their new home."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys
import types
import warnings

import pytest

import packing

# Package __init__ files are the public surface: they re-export names from their modules.
FACADES = ("packing", "packing.integrations", "packing.integrations.diffusers")


def _public_modules() -> list[str]:
    """Every module of packing that is not private (no ``_`` component) and not a facade."""
    names = [m.name for m in pkgutil.walk_packages(packing.__path__, "packing.")]
    return [
        m
        for m in names
        if m not in FACADES and not any(part.startswith("_") for part in m.split("."))
    ]


def test_every_exported_name_resolves():
    missing = [n for n in packing.__all__ if getattr(packing, n, None) is None]
    assert missing == []


def test_submodules_are_not_shadowed_by_exported_names():
    import packing.attention as attention_module

    assert isinstance(attention_module, types.ModuleType)
    assert callable(attention_module.packed_attention)


def test_import_packing_needs_only_torch_numpy_einops():
    code = (
        "import sys, packing; "
        "heavy = [m for m in ('lerobot', 'datasets', 'pyarrow', 'matplotlib', 'pandas', 'diffusers') "
        "if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_public_name_has_one_home():
    """A name is listed in the ``__all__`` of exactly one public module, and a function or
    class listed there is defined there (or in a private module behind it)."""
    homes: dict[str, list[str]] = {}
    borrowed = []
    for name in _public_modules():
        module = importlib.import_module(name)
        for attr in getattr(module, "__all__", ()):
            homes.setdefault(attr, []).append(name)
            obj = getattr(module, attr)
            where = getattr(obj, "__module__", "") or ""
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and where.startswith("packing."):
                private = any(part.startswith("_") for part in where.split("."))
                if where != name and not private:
                    borrowed.append(f"{name}.{attr} is {where}.{attr}")
    assert {n: ms for n, ms in homes.items() if len(ms) > 1} == {}
    assert borrowed == []
    # ...and the package exports each name from that home.
    for module, names in packing._MODULES.items():
        for n in names:
            assert homes.get(n) == [module], (n, homes.get(n))


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("packing.collate:JointLayout", "packing.joint:JointLayout"),
        ("packing.plan:split_windows", "packing.pieces:split_windows"),
        ("packing.verify:VerifyConfig", "packing.verify_cli:VerifyConfig"),
        ("packing.verify:StepRecord", "packing.verify_report:StepComparison"),
        ("packing.profile:StepRecord", "packing.profile:MicroStepRecord"),
        ("packing.attention:attention", "packing.attention:packed_attention"),
        ("packing.attention:call_compiled", "packing._compile:call_compiled"),
        ("packing.block_mask:block_tables", "packing._block_mask:block_tables"),
        ("packing.block_mask:BlockRule", "packing.masks:BlockRule"),
        ("packing.hf:arrow_to_numpy", "packing._arrow:arrow_to_numpy"),
    ],
)
def test_a_moved_name_still_resolves_for_one_release_and_names_its_new_home(old, new):
    (old_module, old_name), (new_module, new_name) = (x.split(":") for x in (old, new))
    with pytest.warns(DeprecationWarning, match=rf"moved to {new_module}\.{new_name}"):
        value = getattr(importlib.import_module(old_module), old_name)
    assert value is getattr(importlib.import_module(new_module), new_name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        getattr(importlib.import_module(new_module), new_name)  # the new home is silent
