"""The LingBot-VA benchmark's figures table, read from its result JSONs (nothing typed by hand).

python benchmarks/lingbot/results_table.py                 # the H200 runs in benchmarks/results
python benchmarks/lingbot/results_table.py a.json b.json   # any runs of bench_lingbot.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import harness

RUNS = ("lingbot_va_h200.json", "lingbot_va_h200_30_blocks.json")
COLUMNS = ("blocks", "regime", "arm", "episodes/step", "micro-steps/step", "tokens/step",
           "step ms", "p10-p90 ms", "tokens/s", "vs lerobot", "vs lean", "MFU of measured 790",
           "peak GB", "first loss", "loss rel diff", "packing share", "run")  # fmt: skip


def table(paths: list[Path]) -> str:
    """Every finished row of every run, one markdown table (rows that did not run are left out;
    the JSON keeps them with their reason)."""
    rows = []
    for path in paths:
        for row in json.loads(path.read_text())["rows"]:
            if "error" not in row:
                rows.append({**row, "run": path.name})
    return harness.markdown_table(rows, COLUMNS)


if __name__ == "__main__":
    given = [Path(p) for p in sys.argv[1:]] or [harness.RESULTS_DIR / r for r in RUNS]
    print(table(given))
