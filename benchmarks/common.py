"""Shared helpers for the benchmark scripts: timing, machine record, tables, JSON.

Every script follows the same habits (see docs/benchmarks.md): fixed seeds, warm-up that
includes compilation, CUDA events around the timed region, the median of many runs with its
spread, one markdown table printed, raw JSON written with the machine, versions, command and
date, and the alternative measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
from benchmarks.harness.flops import attention_flops, tflops  # noqa: E402, F401  (one count)


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call: median and spread over ``n`` timed calls."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    mean_ms: float
    std_ms: float
    n: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.median_ms:.3f} ms [p10 {self.p10_ms:.3f}, p90 {self.p90_ms:.3f}]"


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(samples_ms: Sequence[float]) -> Timing:
    xs = list(samples_ms)
    return Timing(
        median_ms=statistics.median(xs),
        p10_ms=_quantile(xs, 0.1),
        p90_ms=_quantile(xs, 0.9),
        min_ms=min(xs),
        mean_ms=statistics.fmean(xs),
        std_ms=statistics.pstdev(xs) if len(xs) > 1 else 0.0,
        n=len(xs),
    )


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_fn(
    fn: Callable[[], Any],
    *,
    device: torch.device | str,
    warmup: int = 3,
    iters: int = 20,
    min_time_s: float = 0.0,
) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls (compilation lands here), then ``iters`` timed
    ones, each bracketed by CUDA events on a GPU (perf_counter after a sync on CPU).

    Each call is timed on its own so the spread is real; ``min_time_s`` keeps timing past
    ``iters`` until that much time was spent (for very fast calls).
    """
    dev = torch.device(device)
    for _ in range(warmup):
        fn()
    sync(dev)
    samples: list[float] = []
    t_start = time.perf_counter()
    while len(samples) < iters or (time.perf_counter() - t_start) < min_time_s:
        if dev.type == "cuda":
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        if len(samples) >= 10 * max(iters, 1):
            break
    return summarize(samples)


def time_paired(
    fn_a: Callable[[], Any],
    fn_b: Callable[[], Any],
    *,
    device: torch.device | str,
    warmup: int = 3,
    iters: int = 40,
) -> dict[str, float]:
    """``fn_a`` against ``fn_b``, called alternately (A B B A A B ...), each timed on its own:
    the median and p10/p90 of the per-pair ratio ``time(b) / time(a)`` (> 1: A is faster).

    Two blocks of calls timed one after the other drift apart with the clocks and whatever
    else the machine does (the same kernel read 4-14% apart in one run); a pair shares its
    moment, so a few-percent gap shows in the ratio's spread instead of hiding in it.
    """
    for _ in range(warmup):
        fn_a()
        fn_b()
    pairs: list[tuple[float, float]] = []
    for i in range(iters):
        order = (0, 1) if i % 2 == 0 else (1, 0)  # alternate who goes first
        took = [0.0, 0.0]
        for who in order:
            took[who] = time_fn((fn_a, fn_b)[who], device=device, warmup=0, iters=1).median_ms
        pairs.append((took[0], took[1]))
    ratios = [b / a for a, b in pairs]
    return {
        "ratio b/a median": statistics.median(ratios),
        "ratio p10": _quantile(ratios, 0.1),
        "ratio p90": _quantile(ratios, 0.9),
        "a median ms": statistics.median(a for a, _ in pairs),
        "b median ms": statistics.median(b for _, b in pairs),
        "pairs": float(len(pairs)),
    }


def time_host(fn: Callable[[], Any], *, warmup: int = 3, iters: int = 50) -> Timing:
    """Wall time of host-side work (no device sync): collate, mask build launch cost."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return summarize(samples)


def _pkg_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def _source_hash() -> str:
    """sha1 of packing/**/*.py (`packing.verify._report.source_sha1`): names the library code
    that ran even where the machine's copy of the tree has a stale .git (the H200's reported
    the previous commit in session 3)."""
    from packing.verify._report import source_sha1

    return source_sha1()


def _git_commit() -> str | None:
    """HEAD, with ``+dirty`` when tracked files differ from it (a copied working tree, as on
    the GPU machine, can carry a stale HEAD: ``packing_src_sha1`` is then what names the
    code)."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=5, cwd=here
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        if not head:
            return None
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except Exception:
        return None


def machine_info(device: torch.device | str | None = None) -> dict[str, Any]:
    """What ran the benchmark: host, GPU, and every version that changes a number."""
    info: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _pkg_version("triton"),
        "flash_attn_4": _pkg_version("flash-attn-4"),
        "cutlass_dsl": _pkg_version("nvidia-cutlass-dsl"),
        "torch_threads": torch.get_num_threads(),
        "git_commit": _git_commit(),
        "packing_src_sha1": _source_hash(),
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
        **payload,
    }
    if partial:
        doc["partial"] = "written while running: the rows finished so far"
    path.write_text(json.dumps(doc, indent=1, default=str))
    if not partial:
        print(f"\nwrote {path}")
    return path


def seeded_lengths(
    rng: torch.Generator, n: int, lo: int, hi: int, *, multiple: int = 1
) -> list[int]:
    """``n`` episode lengths uniform in [lo, hi], rounded to ``multiple`` (32 tokens = one
    latent frame of 8x16 with 2x2 patches)."""
    xs = torch.randint(lo // multiple, hi // multiple + 1, (n,), generator=rng).tolist()
    return [max(multiple, int(x) * multiple) for x in xs]


def fill_pack(
    rng: torch.Generator, budget: int, lo: int, hi: int, *, multiple: int = 1
) -> list[int]:
    """Episode lengths drawn in [lo, hi] until the next one would overflow ``budget``."""
    out: list[int] = []
    total = 0
    while True:
        (n,) = seeded_lengths(rng, 1, lo, hi, multiple=multiple)
        if total + n > budget:
            if not out:
                out.append(min(n, budget))
            return out
        out.append(n)
        total += n


def dynamo_counters() -> dict[str, int]:
    """Graphs compiled so far. A recompile (new shapes, new guards) compiles a new graph, so
    the growth of ``unique_graphs`` after warm-up is the recompile count."""
    from torch._dynamo.utils import counters

    return {
        "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
        "frames_ok": int(counters["frames"].get("ok", 0)),
        "frames_total": int(counters["frames"].get("total", 0)),
    }


def mem_gb(device: torch.device | str) -> float:
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated() / 1e9
    return 0.0
