"""What ran a benchmark, recorded by the harness, never by hand.

Every result JSON carries ``provenance``::

    git_commit      HEAD of the tree that ran (full sha), None outside a git checkout
    git_dirty       True when `git status --porcelain` lists anything (tracked or not)
    git_status      those lines (the first 50)
    tree_sha256     sha256 over the files that ran: packing/**, benchmarks/** scripts
                    (*.py, *.sh), pyproject.toml; names and bytes, in sorted order
    tree_files      how many files that hash covers
    versions        torch, triton, flash-attn-4, diffusers, lerobot, numpy, python, cuda
                    (None where a package is absent)

``tree_sha256`` names the code even where HEAD does not: the GPU machine runs a copy of the
working tree whose ``.git`` may still show the session-start commit. To find the commit a JSON
came from, ``python benchmarks/harness/provenance.py --commit <rev>`` prints that commit's
tree hash (the same function over ``git show <rev>:<path>``); a match is the code that ran.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HASHED_DIRS = ("packing", "benchmarks")
HASHED_SUFFIXES = (".py", ".sh")
HASHED_FILES = ("pyproject.toml",)
VERSIONED = {
    "torch": "torch",
    "triton": "triton",
    "flash_attn_4": "flash-attn-4",
    "cutlass_dsl": "nvidia-cutlass-dsl",
    "diffusers": "diffusers",
    "lerobot": "lerobot",
    "numpy": "numpy",
}
REQUIRED = ("git_commit", "git_dirty", "tree_sha256", "versions")
REQUIRED_VERSIONS = ("torch", "triton", "flash_attn_4", "diffusers", "lerobot")


def hashed(path: str) -> bool:
    """Whether a repository-relative path is part of the tree hash."""
    parts = Path(path).parts
    if not parts or "__pycache__" in parts:
        return False
    if path in HASHED_FILES:
        return True
    return parts[0] in HASHED_DIRS and path.endswith(HASHED_SUFFIXES)


def digest(files: Iterable[tuple[str, bytes]]) -> tuple[str, int]:
    """sha256 over ``(relative path, bytes)`` pairs in sorted path order, and their count."""
    h = hashlib.sha256()
    n = 0
    for name, data in sorted(files):
        h.update(name.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
        n += 1
    return h.hexdigest(), n


def tree_hash(root: Path = ROOT) -> tuple[str, int]:
    """The hash of the files on disk under ``root``: what actually ran."""
    files = []
    for d in (*HASHED_DIRS, *HASHED_FILES):
        base = root / d
        paths = [base] if base.is_file() else sorted(base.rglob("*")) if base.is_dir() else []
        for f in paths:
            rel = f.relative_to(root).as_posix()
            if f.is_file() and hashed(rel):
                files.append((rel, f.read_bytes()))
    return digest(files)


def _git(root: Path, *args: str) -> str | None:
    try:
        p = subprocess.run(["git", *args], capture_output=True, timeout=20, cwd=root)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.decode(errors="replace") if p.returncode == 0 else None


def commit_tree_hash(rev: str, root: Path = ROOT) -> tuple[str, int]:
    """`tree_hash` of a commit: the same files, read with ``git show rev:path``."""
    listing = _git(root, "ls-tree", "-r", "--name-only", rev)
    if listing is None:
        raise ValueError(f"git ls-tree {rev!r} failed in {root}: not a commit of this repository")
    files = []
    for rel in listing.splitlines():
        if hashed(rel):
            data = subprocess.run(["git", "show", f"{rev}:{rel}"], capture_output=True,
                                  cwd=root, check=True).stdout  # fmt: skip
            files.append((rel, data))
    return digest(files)


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Every version that changes a number; None where the package is absent."""
    out: dict[str, str | None] = {k: _version(v) for k, v in VERSIONED.items()}
    out["python"] = sys.version.split()[0]
    try:
        import torch

        out["cuda"] = torch.version.cuda
    except ImportError:
        out["cuda"] = None
    return out


def provenance_record(root: Path = ROOT) -> dict[str, Any]:
    """The ``provenance`` record of a result JSON (see the module docstring)."""
    head = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain")
    lines = status.splitlines() if status is not None else None
    sha, n = tree_hash(root)
    return {
        "git_commit": head.strip() if head else None,
        "git_dirty": bool(lines) if lines is not None else None,
        "git_status": lines[:50] if lines is not None else None,
        "tree_sha256": sha,
        "tree_files": n,
        "versions": versions(),
    }


def missing(doc: Any) -> list[str]:
    """The provenance fields a result document lacks (empty: it is traceable)."""
    prov = doc.get("provenance") if isinstance(doc, dict) else None
    if not isinstance(prov, dict):
        return ["provenance"]
    out = [k for k in REQUIRED if k not in prov]
    if not isinstance(prov.get("tree_sha256"), str) or len(prov.get("tree_sha256", "")) != 64:
        out.append("tree_sha256 (64 hex digits)")
    vers = prov.get("versions")
    if isinstance(vers, dict):
        out += [f"versions.{k}" for k in REQUIRED_VERSIONS if k not in vers]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description="print the tree hash of the working tree or a commit")
    p.add_argument("--commit", default=None, help="a git revision (default: the files on disk)")
    args = p.parse_args()
    sha, n = commit_tree_hash(args.commit) if args.commit else tree_hash()
    print(f"{sha}  ({n} files{', ' + args.commit if args.commit else ', on disk'})")


if __name__ == "__main__":
    main()
