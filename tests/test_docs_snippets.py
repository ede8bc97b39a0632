"""Every ```python block of README.md and docs/*.md runs as written: on CPU, offline.

One subprocess runs all blocks (torch is imported once, which keeps this cheap on CI's two
cores); each block gets fresh globals, an empty temporary working directory and a time limit,
so a block that needs a name or a file from an earlier block fails here, as it would for a
reader who copies it alone. A block that cannot run on a CPU without a download (a pretrained
checkpoint, a GPU) says so on the line before it, ``<!-- skip: why -->``; those are counted and
kept rare. The README's loops must also print what a user needs to see (their losses), and
docs/index.md's package table must name every public name on its folder's row.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK_S = 120  # per block: the slowest (the diffusers loop) takes ~5 s on an idle core
MAX_SKIPS = 4  # a skip is for a pretrained download or a GPU only; more means rewrite blocks
SKIP = re.compile(r"<!--\s*skip:\s*(\S.*?)\s*-->")
INDEX = ROOT / "docs" / "index.md"
FOLDERS = ("data", "attention", "planning", "train", "datasets", "encode", "model", "verify")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repo root
    number: int  # 1-based, counting this page's python blocks
    line: int  # of the opening fence
    code: str
    skip: str | None  # the reason, from a preceding <!-- skip: ... -->

    @property
    def name(self) -> str:
        return f"{self.page} python block {self.number} (line {self.line})"


def python_blocks(path: Path) -> list[Block]:
    """The page's ```python blocks, in order, each with the skip note just above it, if any."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```python":
            i += 1
            continue
        start = i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{path.name}:{start + 1}: a ```python block is never closed"
        above = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        note = SKIP.search(above)
        blocks.append(
            Block(
                page=str(path.relative_to(ROOT)),
                number=len(blocks) + 1,
                line=start + 1,
                code="\n".join(lines[start + 1 : end]) + "\n",
                skip=note.group(1) if note else None,
            )
        )
        i = end + 1
    return blocks


# Runs in the subprocess: every block in fresh globals and its own empty cwd, with an alarm.
RUNNER = textwrap.dedent(
    """
    import contextlib, io, json, os, signal, sys, tempfile, time, traceback

    class Timeout(Exception):
        pass

    def alarm(signum, frame):
        raise Timeout(f"took more than {limit} s")

    blocks, limit = json.load(sys.stdin), int(sys.argv[1])
    signal.signal(signal.SIGALRM, alarm)
    results = []
    for block in blocks:
        out, t0 = io.StringIO(), time.perf_counter()
        with tempfile.TemporaryDirectory() as cwd:
            os.chdir(cwd)
            signal.alarm(limit)
            try:
                with contextlib.redirect_stdout(out):
                    exec(compile(block["code"], block["name"], "exec"), {"__name__": "__main__"})
                error = None
            except SystemExit as e:
                error = None if e.code in (None, 0) else f"SystemExit({e.code!r})"
            except BaseException:
                error = traceback.format_exc(limit=-8)
            finally:
                signal.alarm(0)
                os.chdir("/")
        results.append({"error": error, "stdout": out.getvalue(),
                        "seconds": round(time.perf_counter() - t0, 2)})
    print(json.dumps(results))
    """
)


def run_blocks(blocks: list[Block]) -> list[dict[str, object]]:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "",  # CPU only, as CI: a block must not need a GPU
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    payload = json.dumps([{"name": b.name, "code": b.code} for b in blocks])
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, str(BLOCK_S)],
        input=payload,
        capture_output=True,
        text=True,
        env=env,
        timeout=BLOCK_S * len(blocks) + 60,
    )
    assert proc.returncode == 0, f"the snippet runner itself failed:\n{proc.stderr[-4000:]}"
    results: list[dict[str, object]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return results


def test_blocks_are_found_and_skips_are_rare_and_justified() -> None:
    blocks = [b for page in PAGES for b in python_blocks(page)]
    readme = [b for b in blocks if b.page == "README.md"]
    assert len(readme) >= 2, "README.md lost its training loop or its diffusers loop"
    assert len(blocks) >= 10, f"only {len(blocks)} python blocks found: did the fence change?"
    skipped = [b for b in blocks if b.skip is not None]
    assert len(skipped) <= MAX_SKIPS, "too many skipped blocks:\n" + "\n".join(
        f"  {b.name}: {b.skip}" for b in skipped
    )
    assert not [b for b in readme if b.skip], "README's blocks must run as written"


def test_every_python_block_runs_on_cpu_offline() -> None:
    blocks = [b for page in PAGES for b in python_blocks(page) if b.skip is None]
    # LingBot-VA's blocks need lerobot 0.6.1, which the newest venv cannot install (its
    # torch pin): they run in the oldest venv (scripts/dev.sh), where lerobot is.
    if not _has_lingbot():
        blocks = [b for b in blocks if "packing.integrations.lingbot_va" not in b.code]
    results = run_blocks(blocks)
    assert len(results) == len(blocks)
    failures = [
        f"{b.name} failed:\n{textwrap.indent(str(r['error']), '    ')}"
        for b, r in zip(blocks, results, strict=True)
        if r["error"] is not None
    ]
    assert not failures, "\n\n".join(failures)
    # The README's loops are a newcomer's first run: they must show that training happened.
    for b, r in zip(blocks, results, strict=True):
        if b.page == "README.md":
            printed = str(r["stdout"])
            assert re.search(r"loss \d", printed), f"{b.name} prints no loss:\n{printed}"


def test_the_runner_reports_a_broken_block_and_isolates_the_next() -> None:
    """Guard against a vacuous pass: a failing block is reported, and names do not leak."""
    blocks = [
        Block("x.md", 1, 1, "name = 1\nundefined_name\n", None),
        Block("x.md", 2, 9, "print('ran'); name\n", None),  # `name` was block 1's
        Block("x.md", 3, 19, "print('fine')\n", None),
    ]
    first, second, third = run_blocks(blocks)
    assert "NameError: name 'undefined_name'" in str(first["error"])
    assert "NameError: name 'name'" in str(second["error"]) and second["stdout"] == "ran\n"
    assert third["error"] is None and third["stdout"] == "fine\n"


def test_the_index_names_every_public_name_on_its_folders_row() -> None:
    """docs/index.md's package table: a newcomer finds any public name's home from it."""
    import importlib

    rows = {
        m.group(1): m.group(2)
        for m in re.finditer(
            r"^\| `packing/([a-z_/.]+?)/?` \|[^|]*\|(.*)\|$", INDEX.read_text(), re.M
        )
    }
    serve = ("serve",) if (ROOT / "packing" / "serve" / "__init__.py").exists() else ()
    lingbot = ("integrations/lingbot_va",) if _has_lingbot() else ()
    for folder in (*FOLDERS, *serve, "integrations/diffusers", *lingbot, "cli"):
        assert folder in rows, f"docs/index.md has no row for packing/{folder}"
        module = "packing." + folder.removesuffix(".py").replace("/", ".")
        names = set(importlib.import_module(module).__all__)
        if folder.startswith("integrations/"):
            names |= set(importlib.import_module(module + ".testing").__all__)
        missing = sorted(n for n in names if f"`{n}`" not in rows[folder])
        assert not missing, f"docs/index.md's row for packing/{folder} lacks {missing}"


def _has_lingbot() -> bool:
    """LeRobot's LingBot-VA (and the transformers it requires) are installed: the oldest venv."""
    import importlib.util

    return all(importlib.util.find_spec(m) for m in ("lerobot", "transformers"))
