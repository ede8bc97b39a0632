"""One table from bench_step runs of separate device calls (FA4 needs its own call).

Each run has its own lean row, the anchor: a row's ``vs lean`` is against the lean loop of its
own run (the same process), and the packed row's ratio to the best baseline of another run is
read through the two anchors, ``(packed / lean_B) / (baseline / lean_A)``; the direct ratio
is printed beside it. The lean rows' ratio (``lean_B / lean_A``) says how far two runs differ.

    python benchmarks/merge_step_runs.py RUN_A.json RUN_B.json [--out merged.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common


def merge(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for i, run in enumerate(runs):
        for r in run["rows"]:
            if "tokens/s" in r and not r.get("error"):
                rows.append({**r, "run": i, "kind": r["variant"].split(":")[0]})
    lean = {(r["run"], r["regime"]): r["tokens/s"] for r in rows if r["kind"] == "lean"}
    for r in rows:
        anchor = lean.get((r["run"], r["regime"]))
        r["vs lean"] = r["tokens/s"] / anchor if anchor else None
    for regime in sorted({r["regime"] for r in rows}):
        mine = [r for r in rows if r["regime"] == regime]
        base = [r for r in mine if r["kind"].startswith(("lean", "bucket"))]
        if not base:
            continue
        best_direct = max(base, key=lambda r: r["tokens/s"])
        # through the anchors only where every baseline row has one (else it would silently
        # leave out the baselines of an anchorless run)
        anchored = all(r["vs lean"] for r in base)
        best_anchored = max(base, key=lambda r: r["vs lean"] or 0.0)
        for r in mine:
            r["best baseline"] = best_direct["kind"]
            r["vs best baseline"] = r["tokens/s"] / best_direct["tokens/s"]
            if anchored and r["vs lean"]:
                r["vs best baseline (anchored)"] = r["vs lean"] / best_anchored["vs lean"]
        leans = [r for r in mine if r["kind"] == "lean"]
        for r in leans[1:]:
            r["lean vs run 0 lean"] = r["tokens/s"] / leans[0]["tokens/s"]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="bench_step JSON files")
    p.add_argument("--out", default=None, help="merged JSON")
    args = p.parse_args()
    runs = [json.loads(Path(f).read_text()) for f in args.runs]
    rows = merge(runs)
    cols = ["regime", "run", "kind", "attention", "step ms", "tokens/s", "MFU", "vs lean",
            "vs best baseline", "vs best baseline (anchored)", "best baseline",
            "lean vs run 0 lean", "padding fraction", "cropped fraction", "peak GB",
            "recompiles after warm-up", "steps timed"]  # fmt: skip
    print(common.markdown_table(rows, cols))
    if args.out:
        slim = [{k: v for k, v in r.items() if k not in ("losses", "timing", "profile")}
                for r in rows]  # fmt: skip
        Path(args.out).write_text(json.dumps({"runs": args.runs, "rows": slim}, indent=1))


if __name__ == "__main__":
    main()
