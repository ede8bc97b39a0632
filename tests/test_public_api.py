"""The public surface: one facade per concern, each name with one home, folders layered by
their imports, and ``import packing`` light.

The specification of the layout (docs/index.md draws it): ``packing`` re-exports at most ~35
names, each from the facade of its folder; every module inside a folder is private (``_name``)
except ``packing.integrations.diffusers.testing``; no folder imports a folder above it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

import packing

ROOT = Path(packing.__file__).parent
# Bottom to top: a folder may import the folders before it, never one after it.
LAYERS = (
    "data",
    "attention",
    "planning",
    "train",
    "datasets",
    "encode",
    "model",
    "verify",
    "serve",
    "integrations",
)
FOLDERS = (
    *(f"packing.{n}" for n in LAYERS if n != "integrations" and (ROOT / n).is_dir()),
    "packing.integrations.diffusers",
)
PUBLIC_MODULES = {"packing.integrations.diffusers.testing", "packing.cli"}


def _facade_names(module: str) -> list[str]:
    return list(importlib.import_module(module).__all__)


def test_every_exported_name_resolves_and_the_top_level_is_small():
    assert len(packing.__all__) <= 35
    assert sorted(packing.__all__) == sorted(n for ns in packing._FOLDERS.values() for n in ns)
    for name in packing.__all__:
        assert getattr(packing, name) is not None


def test_each_top_level_name_comes_from_its_folders_facade():
    for folder, names in packing._FOLDERS.items():
        facade = importlib.import_module(folder)
        for name in names:
            assert name in facade.__all__, (folder, name)
            assert getattr(packing, name) is getattr(facade, name)


def test_a_facade_is_the_only_public_module_of_its_folder():
    modules = [m.name for m in pkgutil.walk_packages(packing.__path__, "packing.")]
    public = [
        m
        for m in modules
        if not any(part.startswith("_") for part in m.split(".")[1:])
        and m not in FOLDERS
        and m not in PUBLIC_MODULES
        and m != "packing.integrations"
    ]
    assert public == []


TORCH_FREE = {"packing._memory_model": "packing.train"}


def test_every_public_name_has_one_home():
    """A name is listed in the ``__all__`` of exactly one facade, and is defined in that
    folder (a facade re-exports its own private modules, not another folder's names)."""
    homes: dict[str, list[str]] = {}
    for folder in (*FOLDERS, "packing.integrations.diffusers.testing"):
        for name in _facade_names(folder):
            homes.setdefault(name, []).append(folder)
            obj = getattr(importlib.import_module(folder), name)
            where = getattr(obj, "__module__", "") or ""
            # packing._memory_model sits below the folders (torch-free, so that `packing budget`
            # answers without torch); packing.train is its one facade.
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and where not in TORCH_FREE:
                assert where.startswith(folder.removesuffix(".testing")), (folder, name, where)
    assert {n: ms for n, ms in homes.items() if len(ms) > 1} == {}


def test_facades_stay_small():
    for folder in FOLDERS:
        assert 3 <= len(_facade_names(folder)) <= 30, folder


def _imported_folders(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for n in names:
            parts = n.split(".")
            if parts[0] == "packing" and len(parts) > 1 and parts[1] in LAYERS:
                found.add(parts[1])
    return found


def test_no_folder_imports_a_folder_above_it():
    upward = []
    for layer, name in enumerate(LAYERS):
        for path in (ROOT / name).rglob("*.py"):
            for other in _imported_folders(path):
                if LAYERS.index(other) > layer:
                    upward.append(f"{path.relative_to(ROOT)} imports packing.{other}")
    assert upward == []


def test_import_packing_needs_only_torch_numpy_einops():
    code = (
        "import sys, packing; "
        "heavy = [m for m in ('torch', 'lerobot', 'datasets', 'pyarrow', 'matplotlib', "
        "'pandas', 'diffusers') if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_shims_for_old_names():
    """An unreleased package keeps no moved-name maps (CHANGELOG says what moved, once)."""
    for old in ("packing.collate", "packing.masks", "packing.verify_cli", "packing.block_mask"):
        try:
            importlib.import_module(old)
        except ModuleNotFoundError:
            continue
        raise AssertionError(f"{old} still imports")
    assert not hasattr(packing, "_MODULES")
