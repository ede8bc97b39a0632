"""Results: the machine record, the shared argument parser, one markdown table, and the JSON
every script writes (command, arguments, machine, `provenance`, then the payload)."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.provenance import provenance_record

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


def machine_info(device: torch.device | str | None = None) -> dict[str, Any]:
    """Where the benchmark ran: host and GPU (the code and versions are in `provenance`)."""
    info: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        p = torch.cuda.get_device_properties(0)
        info.update(
            gpu=p.name,
            gpu_memory_gib=round(p.total_memory / 2**30, 1),
            sm_count=p.multi_processor_count,
            capability=f"{p.major}.{p.minor}",
        )
    else:
        info["gpu"] = None
    return info


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a CPU smoke run")
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu"
    )
    p.add_argument(
        "--out",
        default=None,
        help="JSON path (default benchmarks/results/<name>.json; <name>_quick.json with --quick)",
    )
    p.add_argument("--seed", type=int, default=0)
    return p


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """One markdown table; floats get 3 significant decimals, None prints as '—'."""

    def fmt(v: Any) -> str:
        if v is None:
            return "—"
        if isinstance(v, bool):
            return "yes" if v else "no"
        if isinstance(v, float):
            if v != v:
                return "nan"
            if abs(v) >= 100:
                return f"{v:,.0f}"
            if abs(v) >= 10:
                return f"{v:.1f}"
            return f"{v:.3g}" if abs(v) < 1 else f"{v:.2f}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def write_json(
    name: str,
    args: argparse.Namespace,
    payload: dict[str, Any],
    *,
    device: torch.device | str | None = None,
    partial: bool = False,
) -> Path:
    """Write ``payload`` with machine, versions, command and date to the results folder.

    ``partial=True`` marks a checkpoint written while the run goes on (silently), so a run cut
    at its time limit still leaves every finished row; the final write replaces it."""
    if args.out:
        path = Path(args.out)
    else:
        path = RESULTS_DIR / f"{name}{'_quick' if args.quick else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": name,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "args": vars(args),
        "machine": machine_info(device),
        "provenance": provenance_record(),
        **payload,
    }
    if partial:
        doc["partial"] = "written while running: the rows finished so far"
    path.write_text(json.dumps(doc, indent=1, default=str))
    if not partial:
        print(f"\nwrote {path}")
    return path


def write_doc(path: str | Path, doc: dict[str, Any]) -> Path:
    """Write a script's own JSON document, with `provenance` added (for the scripts that do
    not take `base_parser`'s arguments): no result leaves the harness without it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**doc, "provenance": provenance_record()}, indent=1, default=str))
    return path
