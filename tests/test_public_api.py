"""The public surface: one facade per concern, each name with one home, folders layered by
their imports, and ``import packing`` light.

The specification of the layout (docs/index.md draws it): ``packing`` re-exports at most ~35
names, each from the facade of its folder; every module inside a folder is private (``_name``)
except ``packing.integrations.diffusers.testing``; no folder imports a folder above it, and
one folder uses another through its facade (the private imports that remain are listed);
inside a folder the modules import each other one way.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
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
    "server",
    "integrations",
    "cli",
)
# LeRobot's LingBot-VA needs lerobot and transformers: the oldest venv has them, the newest
# (torch 2.15, which lerobot 0.6.1 does not allow) checks the rest.
LINGBOT = all(importlib.util.find_spec(m) for m in ("lerobot", "transformers"))
FOLDERS = (
    *(f"packing.{n}" for n in LAYERS if n != "integrations" and (ROOT / n).is_dir()),
    "packing.integrations.diffusers",
    *(("packing.integrations.lingbot_va",) if LINGBOT else ()),
)
# Public modules inside a folder, next to its facade: testing helpers, and the protocol a
# served model implements (for model authors; `packing.serve`'s facade stays the users').
PUBLIC_MODULES = {
    "packing.serve.protocol",
    "packing.integrations.diffusers.testing",
    *(("packing.integrations.lingbot_va.testing",) if LINGBOT else ()),
}


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
        and (LINGBOT or not m.startswith("packing.integrations.lingbot_va"))
    ]
    assert public == []


TORCH_FREE = {"packing._memory_model": "packing.train"}


def test_every_public_name_has_one_home():
    """A name is listed in the ``__all__`` of exactly one facade, and is defined in that
    folder (a facade re-exports its own private modules, not another folder's names)."""
    homes: dict[str, list[str]] = {}
    for folder in (*FOLDERS, *sorted(PUBLIC_MODULES)):
        for name in _facade_names(folder):
            homes.setdefault(name, []).append(folder)
            obj = getattr(importlib.import_module(folder), name)
            where = getattr(obj, "__module__", "") or ""
            # packing._memory_model sits below the folders (torch-free, so that `packing budget`
            # answers without torch); packing.train is its one facade.
            # a public module (`PUBLIC_MODULES`) re-exports its own folder's names
            home = folder.rsplit(".", 1)[0] if folder in PUBLIC_MODULES else folder
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and where not in TORCH_FREE:
                assert where.startswith(home), (folder, name, where)
    # Each integration's entry point is its own `install` (packing.integrations.<x>.install):
    # the one name facades share on purpose, always qualified by the integration's path.
    per_integration = {"install"}
    shared = {
        n: ms
        for n, ms in homes.items()
        if len(ms) > 1
        and not (n in per_integration and all(m.startswith("packing.integrations.") for m in ms))
    }
    assert shared == {}


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


# One folder uses another through its facade. These private imports across folders remain,
# each for a reason; the list may only shrink (an entry that no longer occurs fails too).
CROSS_FOLDER_PRIVATE = {
    # Compiled-call plumbing of the attention kernels; the harness times the same call.
    ("packing/verify/_harness.py", "packing.attention._compile", "call_compiled"),
    # A serving engine reserves static FlexAttention kernels for the shapes it warms up.
    ("packing/serve/_engine.py", "packing.attention._compile", "FLEX_KERNELS"),
    # The paged block tables of the context cache; built by the engine, not by users.
    ("packing/serve/_cached_step.py", "packing.attention._block_tables", "tables_from_flags"),
    # packing serve's --device: whether that GPU is here, with verify's one message.
    ("packing/cli/_serve.py", "packing.verify._command", "check_device"),
}


def _folder(path: Path) -> str | None:
    """``packing/serve/_engine.py`` -> ``serve``; a top-level module is in no folder."""
    parts = path.relative_to(ROOT).parts
    return parts[0] if len(parts) > 1 else None


def _private_cross_folder_imports() -> set[tuple[str, str, str]]:
    found = set()
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):  # function-level imports too
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            parts = node.module.split(".")
            if parts[0] != "packing" or len(parts) < 3 or parts[1] == _folder(path):
                continue
            if any(p.startswith("_") for p in parts[2:]):
                rel = path.relative_to(ROOT.parent).as_posix()
                found |= {(rel, node.module, a.name) for a in node.names}
    return found


def test_folders_use_each_other_through_their_facades():
    found = _private_cross_folder_imports()
    new = sorted(found - CROSS_FOLDER_PRIVATE)
    gone = sorted(CROSS_FOLDER_PRIVATE - found)
    assert new == [], f"import these from the folder's facade (or export them there): {new}"
    assert gone == [], f"no longer imported; drop them from CROSS_FOLDER_PRIVATE: {gone}"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports_of(path: Path, modules: set[str]) -> set[str]:
    """The ``modules`` that ``path`` imports, at module level or inside a function
    (``from packing.attention import _masks`` imports the module ``_masks``, not the facade)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            subs = {f"{node.module}.{a.name}" for a in node.names}
            out |= subs & modules  # a private module imported from its package
            if not subs <= modules:
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out & modules


# Circles inside a folder that remain, each a whole cycle as the DFS prints it.
FOLDER_CYCLES: set[str] = set()


def _cycles(graph: dict[str, set[str]]) -> set[str]:
    """Each circle a depth-first walk of ``graph`` meets, as ``a -> b -> a``."""
    cycles = set()
    state: dict[str, int] = {}  # 1: on the walk's stack, 2: done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.add(" -> ".join([*stack[stack.index(n) :], n]))
            elif n not in state:
                visit(n, [*stack, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def _folder_cycles() -> set[str]:
    cycles = set()
    for folder in sorted(p for p in ROOT.iterdir() if (p / "__init__.py").exists()):
        paths = {_module_name(p): p for p in folder.rglob("*.py")}
        cycles |= _cycles({m: _imports_of(p, set(paths)) - {m} for m, p in paths.items()})
    return cycles


def test_no_import_cycles_inside_a_folder():
    """Inside one folder the modules import each other one way (the facade included).
    Function-level and ``TYPE_CHECKING`` imports count: a circle hidden in a function is
    still a circle. `FOLDER_CYCLES` lists the ones that remain; it may only shrink."""
    found = _folder_cycles()
    assert sorted(found - FOLDER_CYCLES) == [], "modules of one folder import each other"
    assert sorted(FOLDER_CYCLES - found) == [], "gone; drop it from FOLDER_CYCLES"
