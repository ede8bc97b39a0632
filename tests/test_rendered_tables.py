"""The measured tables of README.md and docs/*.md are what their JSONs give, and the pages for
users stay readable: no commit hashes (those live in benchmarks/reports/), under 400 lines.

Every table of a measured figure is rendered by benchmarks/render_tables.py between
``<!-- table: NAME -->`` and ``<!-- /table -->``; a hand edit of a figure, or a JSON replaced
by a new run without re-rendering, fails here with the command that fixes it.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import render_tables as rt  # noqa: E402

# A commit hash as prose quotes one: 7-40 hex digits with at least one letter and one digit,
# not inside a word or a number (1.0e-06 and 0.9999959 are not hashes).
HASH = re.compile(r"(?<![\w.\-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?!\w)")
MAX_LINES = 400


def test_every_rendered_table_matches_its_json() -> None:
    stale = [p.name for p in rt.PAGES if rt.rendered(p.read_text(), p.name) != p.read_text()]
    assert not stale, f"tables in {stale} differ from their JSONs: run `{rt.FIX}`"


def test_every_registered_table_is_on_a_page_and_its_jsons_exist() -> None:
    used = {m["name"] for p in rt.PAGES for m in rt.REGION.finditer(p.read_text())}
    assert set(rt.TABLES) <= used, f"registered but on no page: {set(rt.TABLES) - used}"
    for table in rt.TABLES.values():
        for name in table.sources:
            assert (rt.RESULTS / name).is_file(), f"{table.name} reads a missing {name}"


def test_a_changed_json_makes_its_region_stale(tmp_path: Path, monkeypatch) -> None:
    """Negative control: the check can fail. A new run of the cache benchmark (its cached
    rate doubled) no longer matches the README's first table."""
    shutil.copytree(rt.RESULTS, tmp_path, dirs_exist_ok=True)
    doc = json.loads((tmp_path / "serve_cache_h200.json").read_text())
    next(r for r in doc["rows"] if r["arm"] == "cached@8")["req_per_s"] *= 2
    (tmp_path / "serve_cache_h200.json").write_text(json.dumps(doc))
    readme = (ROOT / "README.md").read_text()
    assert rt.rendered(readme, "README.md") == readme
    monkeypatch.setattr(rt, "RESULTS", tmp_path)
    fresh = rt.rendered(readme, "README.md")
    assert fresh != readme and "8.75×" in fresh


def test_an_unknown_table_name_is_refused() -> None:
    with pytest.raises(SystemExit, match="no table 'nope'"):
        rt.rendered("<!-- table: nope -->\n<!-- /table -->", "x.md")


def test_no_commit_hashes_on_user_pages() -> None:
    found = [f"{p.name}: {m[0]}" for p in rt.PAGES for m in HASH.finditer(p.read_text())]
    assert not found, f"commit hashes belong in benchmarks/reports/, not user pages: {found}"
    assert HASH.findall("at commit 40b14ba, before 8265bc2") == ["40b14ba", "8265bc2"]
    assert not HASH.findall("1.0e-06, 0.9999959, 2.85e-08, deadbeef, facade")


def test_user_pages_stay_under_400_lines() -> None:
    long = {p.name: n for p in rt.PAGES if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"pages over {MAX_LINES} lines (split them or move records to reports): {long}"
