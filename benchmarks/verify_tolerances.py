"""`packing verify` on the CPU in each set-up docs/verify.md lists, into one JSON with provenance.

Each set-up is the CLI run as a user runs it (`python -m packing verify ... --json`), one
process each; the JSON keeps every report whole, so docs/verify.md's "Measured tolerances"
table is rendered from it (benchmarks/render_tables.py) instead of typed:

    python benchmarks/verify_tolerances.py             # seconds a set-up; --compile minutes
    python benchmarks/verify_tolerances.py --only fp32,no_document_mask

A set-up that is meant to fail (no document mask, the mean of means) exits 1: that is its
result, recorded, not an error of this script.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.harness.results import RESULTS_DIR, machine_info, write_doc  # noqa: E402

# name -> (what the page calls it, the CLI arguments after `packing verify`)
SETUPS = {
    "fp32": ("fp32, CPU, tiny DiT, 12 episodes, 3 steps", []),
    "frame_causal": ("fp32, CPU, frame-causal", ["--mask", "frame-causal"]),
    "token_mean": ("fp32, CPU, token mean", ["--reduction", "token"]),
    "bf16": ("bf16 autocast, CPU", ["--dtype", "bfloat16"]),
    "compiled": ("fp32, CPU, whole model compiled", ["--compile", "--steps", "2"]),
    "no_document_mask": ("fp32, CPU, **no document mask**", ["--no-document-mask"]),
    "mean_of_means": ("fp32, CPU, **mean of means**", ["--loss-normaliser", "per-micro-step"]),
}


def run(args: list[str]) -> tuple[int, dict, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "packing", "verify", *args, "--json", str(out)]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if proc.returncode not in (0, 1) or not out.is_file():
            raise SystemExit(f"packing verify {' '.join(args)} exited {proc.returncode}:\n"
                             f"{proc.stderr[-2000:]}")  # fmt: skip
        return proc.returncode, json.loads(out.read_text()), seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=",".join(SETUPS), help="comma-separated set-up names")
    p.add_argument("--out", default=str(RESULTS_DIR / "verify_cpu.json"))
    args = p.parse_args()
    rows = []
    for name in args.only.split(","):
        label, cli = SETUPS[name]
        status, report, seconds = run(cli)
        print(f"{name}: exit {status}, loss rel {report['loss_rel']:.1e}, "
              f"worst gradient rel {report['grad_rel_max']:.1e}, {seconds:.0f} s")  # fmt: skip
        rows.append({"name": name, "setup": label, "command": " ".join(["packing verify", *cli]),
                     "exit": status, "seconds": seconds, "report": report})  # fmt: skip
    doc = {
        "benchmark": "verify_cpu",
        "command": " ".join(["python", *sys.argv]),
        "machine": machine_info("cpu"),
        "rows": rows,
    }
    print(f"wrote {write_doc(args.out, doc)}")


if __name__ == "__main__":
    main()
