"""Render every measured table of README.md and docs/*.md from benchmarks/results/*.json.

A table lives in the markdown between two markers; everything between them is rewritten:

    <!-- table: step_h200 (rendered from step_seed_h200.json, step_short_h200.json ...) -->
    | regime | variant | ... | from |          each row names the JSON it came from
    |---|---|...|---|
    | seed | packed | ... | step_seed_h200.json |
    ...
    - `step_seed_h200.json`: `python3 benchmarks/step/bench_step.py ...` (date, GPU, torch)
    <!-- /table -->                                and each JSON the command that wrote it

    python benchmarks/render_tables.py            rewrite every region from its JSONs
    python benchmarks/render_tables.py --check    exit 1 naming the regions that differ

tests/test_rendered_tables.py runs the check. To add a table: write a function from the
loaded JSONs to rows, add one `Table` to TABLES, put `<!-- table: NAME -->` and
`<!-- /table -->` where it goes, and run the script. A row of the README's first table is one
`Gain` in GAINS. Only figures live here: what a table means is said by the page around it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
FIX = "python benchmarks/render_tables.py"
REGION = re.compile(r"<!-- table: (?P<name>[\w-]+)[^>]*-->\n.*?<!-- /table -->", re.DOTALL)

Doc = dict[str, Any]
Docs = dict[str, Doc]  # JSON file name -> its content
Row = Sequence[str]  # the cells; the last one is the JSON file name the row came from


@dataclass(frozen=True)
class Table:
    """One rendered table: its JSONs (file names under benchmarks/results), its columns (the
    last is always `from`) and a function from the loaded JSONs to its rows."""

    name: str
    sources: tuple[str, ...]
    columns: tuple[str, ...]
    rows: Callable[[Docs], list[Row]]


# ---------------------------------------------------------------- cell formats


def ratio(x: float) -> str:
    """Two decimals (one from 10×); three near parity, where 1.005× and 1.01× differ."""
    if abs(x - 1) < 0.02:
        return f"{x:.3f}×"
    return f"{x:.1f}×" if x >= 10 else f"{x:.2f}×"


def spread(p10_p90: str) -> str:
    return p10_p90.replace("-", "–")


def count(x: float) -> str:
    return f"{x:,.0f}"


def ms(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def pct(x: float, digits: int = 1) -> str:
    return f"{100 * x:.{digits}f}%"


def by_prefix(doc: Doc, variant: str, **match: Any) -> Doc:
    """The row whose `variant` starts with ``variant`` (and whose keys equal ``match``)."""
    for row in doc["rows"]:
        if str(row.get("variant", "")).startswith(variant) and all(
            row.get(k) == v for k, v in match.items()
        ):
            return row
    raise KeyError(f"no row {variant!r} {match} in {doc.get('benchmark')}")


def by_arm(doc: Doc, arm: str, **match: Any) -> Doc:
    for row in doc["rows"]:
        if row.get("arm") == arm and all(row.get(k) == v for k, v in match.items()):
            return row
    raise KeyError(f"no arm {arm!r} {match} in {doc.get('benchmark')}")


# ---------------------------------------------------------------- the README's first table


@dataclass(frozen=True)
class Gain:
    """One row of the README's first table: what a user runs today, what packing changes,
    and the measured ratio (a function of the JSON, so it cannot drift from it)."""

    source: str
    today: str
    packing: str
    gain: Callable[[Doc], str]


def _cache_gain(doc: Doc) -> str:
    cached, uncached = by_arm(doc, "cached@8"), by_arm(doc, "uncached@8")
    return f"**{ratio(cached['req_per_s'] / uncached['req_per_s'])}** requests/s at 8 robots"


def _wan_gain(doc: Doc) -> str:
    def vs(regime: str) -> float:
        packed = by_prefix(doc, "packed", regime=regime)
        return packed["tokens/s"] / by_prefix(doc, "unpacked[", regime=regime)["tokens/s"]

    return f"**{ratio(vs('short'))}** tokens/s, short episodes; {ratio(vs('seed'))} long ones"


def _step_gain(baseline: str) -> Callable[[Doc], str]:
    def gain(doc: Doc) -> str:
        x = by_prefix(doc, "packed")["tokens/s"] / by_prefix(doc, baseline)["tokens/s"]
        return f"**{ratio(x)}** tokens/s" if x >= 1.1 else f"{ratio(x)} tokens/s (parity)"

    return gain


GAINS: tuple[Gain, ...] = (
    Gain(
        "serve_cache_h200.json",
        "a policy server that recomputes each robot's context at every denoising step "
        "(frame-causal DiT, 5B widths, 30 blocks)",
        "the context cache: each robot's context computed once",
        _cache_gain,
    ),
    Gain(
        "diffusers_wan_30_blocks_h200.json",
        "diffusers' Wan 2.2 TI2V 5B (30 blocks), one episode a micro-step + gradient accumulation",
        "`install(model)`: one pack a step, the weights untouched",
        _wan_gain,
    ),
    Gain(
        "step_short_h200.json",
        "a per-episode training loop on short episodes (0.3K–2.5K tokens), one episode a "
        "micro-step at its best attention backend",
        "one pack of whole episodes a step",
        _step_gain("lean"),
    ),
    Gain(
        "step_seed_h200.json",
        "the same loop on long episodes (4.6K–10.7K tokens): each already fills the GPU",
        "one pack a step",
        _step_gain("lean"),
    ),
    Gain(
        "step_short_h200.json",
        "Open-Sora's bucketing (8 length buckets, one bucket a step), short episodes",
        "one pack a step",
        _step_gain("bucket_opensora"),
    ),
)


def headline_rows(docs: Docs) -> list[Row]:
    return [(g.today, g.packing, g.gain(docs[g.source]), g.source) for g in GAINS]


# ---------------------------------------------------------------- training


def _variant_name(row: Doc) -> str:
    v = row["variant"]
    if v.startswith("packed"):
        return "**packed** (`auto`)"
    if v.startswith("lean_whole"):
        return "lean, the whole episode loss compiled as one graph"
    if v.startswith("lean"):
        return "lean: one episode a micro-step, exact length"
    padded = pct(row["padding fraction"])
    if v.startswith("bucket_opensora"):
        return f"Open-Sora bucketing, {len(row['buckets'])} buckets, one a step ({padded} padded)"
    return f"bucketing, {len(row['buckets'])} buckets ({padded} padded)"


def step_rows(docs: Docs) -> list[Row]:
    rows: list[Row] = []
    for name in ("step_seed_h200.json", "step_short_h200.json"):
        doc = docs[name]
        packed = by_prefix(doc, "packed")
        for r in doc["rows"]:
            regime, variant = r["regime"], _variant_name(r)
            if r.get("error"):
                rows.append((regime, variant, r["error"], "", "", "", "", "", name))
                continue
            vs = "—" if r is packed else ratio(packed["tokens/s"] / r["tokens/s"])
            mfu = f"{r['MFU of measured 790']:.2f} / {r['MFU of datasheet 989']:.2f}"
            step = f"{ms(r['step ms'])} ({spread(r['p10-p90 ms'])})"
            attention = r["attention"].replace(" (probed)", "")
            cells = (regime, variant, attention, step, count(r["tokens/s"]), vs, mfu)
            rows.append((*cells, f"{r['peak GB']:.1f}", name))
    return rows


WAN_VARIANTS = {
    "packed[auto]": "**packed** (`install`, `auto`)",
    "unpacked[diffusers]": "unmodified, batch 1 + accumulation",
    "unpacked_bucketed[diffusers]": "unmodified, bucketed",
}


def wan_rows(docs: Docs) -> list[Row]:
    name = "diffusers_wan_30_blocks_h200.json"
    doc, rows = docs[name], []
    for regime in ("seed", "short"):
        packed = by_prefix(doc, "packed", regime=regime)
        for r in (row for row in doc["rows"] if row["regime"] == regime):
            t = r["timing"]
            step = f"{ms(t['median_ms'])} ({ms(t['min_ms'])}; {spread(r['p10-p90 ms'])})"
            vs = "—" if r is packed else ratio(packed["tokens/s"] / r["tokens/s"])
            if r.get("recompiles after warm-up"):
                vs = f"not quoted: recompiled in its timed steps ({r['recompiles after warm-up']}×)"
            variant = WAN_VARIANTS[r["variant"]]
            if r.get("cropped fraction"):
                variant += f" ({pct(r['cropped fraction'])} of the tokens cropped)"
            cells = (regime, variant, step, count(r["tokens/s"]), vs, f"{r['peak GB']:.1f}")
            rows.append((*cells, name))
    return rows


# ---------------------------------------------------------------- inference and serving

SERVE_ARMS = {
    "alone/graphs": "one at a time",
    "packed/graphs": "**packed**",
    "padded/graphs": "padded to the longest",
    "padded_bucketed/graphs": "padded by length bucket",
}


def serve_rows(docs: Docs) -> list[Row]:
    name = "serve_h200.json"
    doc, rows = docs[name], []
    for mix in ("short", "long"):
        packed = by_arm(doc, "packed/graphs", mix=mix)
        for r in (row for row in doc["rows"] if row["mix"] == mix):
            vs = "—" if r is packed else ratio(packed["req_per_s"] / r["req_per_s"])
            latency = f"{ms(r['p50_ms'])} / {ms(r['p99_ms'])}"
            bound = f"{r['fraction_of_bound']:.2f}"
            if r["fraction_of_useful_bound"] < r["fraction_of_bound"] - 0.005:
                bound += f" ({r['fraction_of_useful_bound']:.2f} useful)"
            cells = (mix, SERVE_ARMS[r["arm"]], count(r["tokens_mean"]), f"{r['req_per_s']:.1f}")
            rows.append((*cells, latency, vs, bound, name))
    return rows


ROBOTS_COLUMNS = ("robots", "arm", "chunks/s", "p50 ms", "p99 ms", "robot idle",
                  "requests a model call", "vs one at a time", "from")  # fmt: skip


def robots_rows(source: str) -> Callable[[Docs], list[Row]]:
    def rows(docs: Docs) -> list[Row]:
        doc, out = docs[source], []
        for r in doc["rows"]:
            alone = by_arm(doc, "one_at_a_time", robots=r["robots"])
            vs = "—" if r is alone else ratio(r["chunks_per_s"] / alone["chunks_per_s"])
            arm = "one at a time" if r is alone else "**packed**"
            cells = (str(r["robots"]), arm, f"{r['chunks_per_s']:.2f}", ms(r["p50_ms"]))
            per_call = f"{r['requests_per_call']:.2f}"
            out.append((*cells, ms(r["p99_ms"]), f"{r['idle']:.2f}", per_call, vs, source))
        return out

    return rows


def cache_rows(docs: Docs) -> list[Row]:
    name = "serve_cache_h200.json"
    doc, rows = docs[name], []
    for r in doc["rows"]:
        uncached = by_arm(doc, f"uncached@{r['C']}")
        vs = "—" if r is uncached else ratio(r["req_per_s"] / uncached["req_per_s"])
        engine = "**cached**" if r["cached"] else "uncached, packed"
        cells = (engine, str(r["C"]), str(r["requests"]), f"{r['req_per_s']:.1f}")
        latency = (ms(r["p50_ms"]), ms(r["p99_ms"]), ms(r["p99_after_first_round_ms"]))
        rows.append((*cells, *latency, vs, name))
    return rows


def cache_flops_rows(docs: Docs) -> list[Row]:
    name = "serve_cache_h200.json"
    return [
        (
            r["config"],
            r["mix"],
            r["case"],
            f"{r['uncached_tflop']:.1f}",
            f"{r['cached_tflop']:.2f}",
            ratio(r["ratio"]),
            name,
        )
        for r in docs[name]["flops"]
    ]


# ---------------------------------------------------------------- planning


def planner_rows(docs: Docs) -> list[Row]:
    name = "planner.json"
    rows = docs[name]["rows"]

    def find(algorithm: str, like: Doc) -> Doc | None:
        keys = ("n", "lengths", "x_median")
        match = (
            r for r in rows if r["algorithm"] == algorithm and all(r[k] == like[k] for k in keys)
        )
        return next(match, None)

    out: list[Row] = []
    for r in (r for r in rows if r["algorithm"] == "lookahead"):
        speed = f"**{r['episodes_per_s'] / 1e6:.2f}** ({r['episodes_per_s_best'] / 1e6:.2f})"
        before = find("lookahead (before)", r)
        ref = "—" if before is None else f"{before['episodes_per_s'] / 1e6:.2f}"
        vs = "—" if before is None else ratio(r["episodes_per_s"] / before["episodes_per_s"])
        fills = [pct(f["efficiency"], 2) if (f := find(a, r)) else "—" for a in ("bfd", "next_fit")]
        budget = f"{count(r['budget'])} ({r['x_median']}×)"
        cells = (count(r["n"]), r["lengths"], budget, speed, f"{r['p90_over_median']:.2f}")
        out.append((*cells, ref, vs, pct(r["efficiency"], 2), *fills, name))
    return out


# ---------------------------------------------------------------- datasets

LEROBOT_METHODS = {  # the JSON's method names -> what the page calls them
    "LeRobotEpisodes(root) whole episodes": "`LeRobotEpisodes(root)` (pages decoded directly)",
    "pyarrow read_row_groups only (pyarrow's decode)": "pyarrow `read_row_groups` only",
    "LeRobotEpisodes(root, cache_dir) whole episodes": "`LeRobotEpisodes(root, cache_dir=...)`",
    "LeRobotEpisodes(LeRobotDataset) whole episodes": "`LeRobotEpisodes(LeRobotDataset(...))`",
    "lerobot dataset[i] frame by frame + stack": "lerobot `dataset[i]` frame by frame + `torch.stack`",
}


def lerobot_io_rows(source: str) -> Callable[[Docs], list[Row]]:
    def rows(docs: Docs) -> list[Row]:
        results = docs[source]["results"]
        frames = results["lerobot dataset[i] frame by frame + stack"]["mb_per_s"]
        pyarrow = results["pyarrow read_row_groups only (pyarrow's decode)"]["mb_per_s"]
        out: list[Row] = []
        for method, label in LEROBOT_METHODS.items():
            r = results[method]
            lo, hi = r["mb_per_s_range"]
            cells = (label, f"{r['setup_s']:.2f}", f"{r['first_pass_s']:.2f}")
            rate = f"{r['mb_per_s']:,.1f} ({lo:,.1f}–{hi:,.1f})"
            vs = (ratio(r["mb_per_s"] / frames), ratio(r["mb_per_s"] / pyarrow))
            out.append((*cells, rate, f"{r['mb_per_cpu_s']:,.1f}", *vs, source))
        return out

    return rows


# ---------------------------------------------------------------- verify and encode

# `packing verify --json` reports: (JSON, the set-up, the command that wrote it)
VERIFY_RUNS = (
    ("h200_verify_fp32.json", "fp32, Flex", "packing verify --device cuda"),
    ("h200_verify_bf16.json", "bf16, Flex (Triton), tiny DiT",
     "packing verify --device cuda --dtype bfloat16"),
    ("h200_verify_fa4_bf16.json", "bf16, head dim 128, FA4 varlen (`auto`)",
     "... --model benchmarks.verify_models:head_dim_128"),
    ("h200_verify_fa4_frame_causal_bf16.json", "bf16, head dim 128, frame-causal (Flex FLASH)",
     "... --mask frame-causal --model benchmarks.verify_models:head_dim_128"),
    ("h200_verify_wan_bf16.json", "bf16, a diffusers Wan 2.2 (head dim 128) vs the unmodified model",
     "... --model benchmarks.verify_models:wan_head_dim_128"),
    ("h200x2_verify_fsdp_bf16.json", "bf16, two H200s, FSDP2, Flex",
     "torchrun --nproc-per-node 2 -m packing verify --device cuda --dtype bfloat16"),
    ("h200x2_verify_fsdp_bf16_hd128.json", "bf16, two H200s, FSDP2, FA4 varlen",
     "the same + --model benchmarks.verify_models:head_dim_128"),
)  # fmt: skip


def verify_rows(docs: Docs) -> list[Row]:
    rows: list[Row] = []
    for name, setup, cmd in VERIFY_RUNS:
        d = docs[name]
        result = "PASS" if d["passed"] else "FAIL"
        cells = (setup, f"`{cmd}`", f"{d['loss_rel']:.1e}", f"{d['grad_cos_min']:.5f}", result)
        rows.append((*cells, name))
    return rows


def encode_rows(docs: Docs) -> list[Row]:
    name = "encode_cpu.json"
    return [
        (
            r["method"],
            f"{r['episodes/s']:.2f} ({spread(r['spread'])})",
            count(r["frames/s"]),
            "—" if r["method"].startswith("naive") else ratio(r["vs naive"]),
            name,
        )
        for r in docs[name]["rows"]
    ]


# ---------------------------------------------------------------- goals


@dataclass(frozen=True)
class Goal:
    """A goal set before a run, and what the run measured against it: ``measure`` returns the
    figure as text and whether it meets the goal, so met/missed cannot drift from the JSON."""

    source: str
    goal: str
    measure: Callable[[Doc], tuple[str, bool]]


def _step_goal(least: float) -> Callable[[Doc], tuple[str, bool]]:
    """Packed against its best baseline (the one with the most tokens/s)."""

    def measure(doc: Doc) -> tuple[str, bool]:
        packed = by_prefix(doc, "packed")
        others = [r for r in doc["rows"] if r is not packed and r.get("tokens/s")]
        best = max(others, key=lambda r: r["tokens/s"])
        x = packed["tokens/s"] / best["tokens/s"]
        return f"{ratio(x)} {_variant_name(best)}", x >= least

    return measure


def _mfu_goal(doc: Doc) -> tuple[str, bool]:
    mfu = by_prefix(doc, "packed")["MFU of measured 790"]
    return f"{mfu:.2f} of 790", mfu >= 0.65


def _wan_goal(regime: str, least: float) -> Callable[[Doc], tuple[str, bool]]:
    def measure(doc: Doc) -> tuple[str, bool]:
        packed = by_prefix(doc, "packed", regime=regime)["tokens/s"]
        x = packed / by_prefix(doc, "unpacked[", regime=regime)["tokens/s"]
        return f"{ratio(x)} by tokens/s over the mean step", x >= least

    return measure


def _serve_goal(arm: str, mix: str, least: float) -> Callable[[Doc], tuple[str, bool]]:
    def measure(doc: Doc) -> tuple[str, bool]:
        packed = by_arm(doc, "packed/graphs", mix=mix)["req_per_s"]
        x = packed / by_arm(doc, arm, mix=mix)["req_per_s"]
        return f"{ratio(x)} {SERVE_ARMS[arm]}", x >= least

    return measure


def _bound_goal(doc: Doc) -> tuple[str, bool]:
    short, long = (
        by_arm(doc, "packed/graphs", mix=m)["fraction_of_bound"] for m in ("short", "long")
    )
    return f"{short:.2f} short, {long:.2f} long", min(short, long) >= 0.8


def _cache_rate_goal(doc: Doc) -> tuple[str, bool]:
    x = by_arm(doc, "cached@8")["req_per_s"] / by_arm(doc, "uncached@8")["req_per_s"]
    return f"{ratio(x)}", x >= 3


def _cache_p99_goal(robots: int, most_ms: float) -> Callable[[Doc], tuple[str, bool]]:
    def measure(doc: Doc) -> tuple[str, bool]:
        r = by_arm(doc, f"cached@{robots}")
        return f"{ms(r['p99_ms'])} ms of {r['requests']} chunks", r["p99_ms"] <= most_ms

    return measure


GOALS: tuple[Goal, ...] = (
    Goal("step_seed_h200.json", "one-GPU step, long episodes: ≥ 1.0× the best baseline",
         _step_goal(1.0)),
    Goal("step_short_h200.json", "one-GPU step, short episodes: ≥ 1.25× the best baseline",
         _step_goal(1.25)),
    Goal("step_seed_h200.json", "packed step MFU ≥ 0.65 of 790 TFLOP/s, long", _mfu_goal),
    Goal("step_short_h200.json", "packed step MFU ≥ 0.65 of 790 TFLOP/s, short", _mfu_goal),
    Goal("diffusers_wan_30_blocks_h200.json", "diffusers Wan, long: ≥ 1.3× batch 1",
         _wan_goal("seed", 1.3)),
    Goal("diffusers_wan_30_blocks_h200.json", "diffusers Wan, short: ≥ 2× batch 1",
         _wan_goal("short", 2.0)),
    Goal("serve_h200.json", "packed inference ≥ 0.8 of the compute bound", _bound_goal),
    Goal("serve_h200.json", "packed inference never slower than padded, short mix",
         _serve_goal("padded_bucketed/graphs", "short", 1.0)),
    Goal("serve_h200.json", "packed inference ≥ 1.2× padded on the long mix",
         _serve_goal("padded_bucketed/graphs", "long", 1.2)),
    Goal("serve_cache_h200.json", "context cache ≥ 3× uncached at 8 robots", _cache_rate_goal),
    Goal("serve_cache_h200.json", "context cache p99 ≤ 300 ms at 8 robots",
         _cache_p99_goal(8, 300)),
    Goal("serve_cache_h200.json", "context cache p99 ≤ 600 ms at 16 robots",
         _cache_p99_goal(16, 600)),
)  # fmt: skip


def goal_rows(docs: Docs) -> list[Row]:
    rows: list[Row] = []
    for g in GOALS:
        figure, met = g.measure(docs[g.source])
        rows.append((g.goal, figure, "met" if met else "**missed**", g.source))
    return rows


def step_profile_rows(docs: Docs) -> list[Row]:
    rows: list[Row] = []
    for name in ("step_seed_h200.json", "step_short_h200.json"):
        packed = by_prefix(docs[name], "packed")
        kernels = packed["profile"]["kernel_table"]
        shares = kernels["shares"]
        cells = (packed["regime"], ms(kernels["total_ms"]))
        parts = tuple(pct(shares[k]) for k in ("gemm", "attention", "elementwise"))
        rows.append((*cells, *parts, name))
    return rows


# ---------------------------------------------------------------- the registry

TABLES: dict[str, Table] = {
    t.name: t
    for t in (
        Table(
            "headline",
            tuple(dict.fromkeys(g.source for g in GAINS)),
            ("what you run today (the baseline)", "with packing", "gain, one H200", "from"),
            headline_rows,
        ),
        Table(
            "goals",
            tuple(dict.fromkeys(g.source for g in GOALS)),
            ("goal", "measured", "", "from"),
            goal_rows,
        ),
        Table(
            "step_profile",
            ("step_seed_h200.json", "step_short_h200.json"),
            ("regime", "packed step, CUDA kernel ms", "GEMM", "attention", "elementwise", "from"),
            step_profile_rows,
        ),
        Table(
            "step_h200",
            ("step_seed_h200.json", "step_short_h200.json"),
            (
                "regime",
                "variant",
                "attention",
                "step ms (p10–p90)",
                "tokens/s",
                "packed vs it",
                "MFU of 790 / of 989",
                "peak GB",
                "from",
            ),
            step_rows,
        ),
        Table(
            "diffusers_wan_h200",
            ("diffusers_wan_30_blocks_h200.json",),
            (
                "regime",
                "variant",
                "median step ms (fastest; p10–p90)",
                "tokens/s",
                "packed vs it (tokens/s)",
                "peak GB",
                "from",
            ),
            wan_rows,
        ),
        Table(
            "serve_h200",
            ("serve_h200.json",),
            (
                "mix",
                "arm",
                "tokens a request",
                "requests/s",
                "p50 / p99 ms",
                "packed vs it",
                "of the bound (790)",
                "from",
            ),
            serve_rows,
        ),
        Table(
            "robots_h200",
            ("serving_robots_h200.json",),
            ROBOTS_COLUMNS,
            robots_rows("serving_robots_h200.json"),
        ),
        Table(
            "robots_cpu",
            ("serving_robots_cpu.json",),
            ROBOTS_COLUMNS,
            robots_rows("serving_robots_cpu.json"),
        ),
        Table(
            "planner",
            ("planner.json",),
            (
                "episodes",
                "lengths",
                "budget",
                "lookahead M/s median (best)",
                "p90 / median",
                "reference M/s",
                "vs reference",
                "lookahead fill",
                "bfd fill",
                "next_fit fill",
                "from",
            ),
            planner_rows,
        ),
        *(
            Table(
                f"lerobot_io{suffix}",
                (f"lerobot_io{suffix}.json",),
                (
                    "method (1 process, 1 thread)",
                    "open s",
                    "first pass s",
                    "MB/s (min–max)",
                    "MB per CPU-s",
                    "vs frame by frame",
                    "vs pyarrow's decode",
                    "from",
                ),
                lerobot_io_rows(f"lerobot_io{suffix}.json"),
            )
            for suffix in ("", "_embedded")
        ),
        Table(
            "verify_gpu",
            tuple(name for name, _, _ in VERIFY_RUNS),
            ("set-up", "command", "loss rel", "min gradient cosine", "result", "from"),
            verify_rows,
        ),
        Table(
            "encode_cpu",
            ("encode_cpu.json",),
            ("method", "episodes/s (min–max)", "frames/s", "vs naive", "from"),
            encode_rows,
        ),
        Table(
            "context_cache_h200",
            ("serve_cache_h200.json",),
            (
                "engine",
                "robots",
                "chunks",
                "requests/s",
                "p50 ms",
                "p99 ms",
                "p99 after the first round ms",
                "vs uncached",
                "from",
            ),
            cache_rows,
        ),
        Table(
            "context_cache_flops",
            ("serve_cache_h200.json",),
            (
                "widths (30 blocks)",
                "mix",
                "chunk",
                "uncached TFLOP",
                "cached TFLOP",
                "cached less by",
                "from",
            ),
            cache_flops_rows,
        ),
    )
}


# ---------------------------------------------------------------- rendering


def load(names: Sequence[str]) -> Docs:
    docs: Docs = {}
    for name in names:
        path = RESULTS / name
        if not path.is_file():
            raise SystemExit(f"benchmarks/results/{name} is missing: a rendered table reads it")
        docs[name] = json.loads(path.read_text())
    return docs


def command(doc: Doc) -> str:
    """The command as recorded, without its `--out` (a path on the machine that ran it)."""
    return re.sub(r" --out \S+", "", doc.get("command", "(not recorded in the JSON)"))


def source_line(name: str, doc: Doc) -> str:
    """`- name: command (date, GPU, torch; how much of the code that ran is recorded)`: the
    harness records these in a few places over its history, so each is looked up in turn."""
    machine = doc.get("machine") or doc.get("environment") or {}
    if not isinstance(machine, dict):  # planner.json: a CPU name
        machine = {}
    torch = machine.get("torch") or machine.get("versions", {}).get("torch") or doc.get("torch")
    date = str(machine.get("date_utc") or doc.get("date") or "")[:10]
    where = ", ".join(x for x in (date, machine.get("gpu"), torch and f"torch {torch}") if x)
    if "git_commit" not in doc.get("provenance", {}):
        where += "; pre-provenance: the code that ran is not recorded with it"
    elif doc["provenance"].get("git_dirty"):
        where += "; uncommitted changes, hashed in its `provenance`"
    if doc.get("partial"):
        where += "; partial: the run was cut after these rows"
    return f"- `{name}`: `{command(doc)}` ({where})"


def render(table: Table) -> str:
    docs = load(table.sources)
    lines = [
        f"<!-- table: {table.name} (rendered from {', '.join(table.sources)} by {FIX};"
        " edit the script, not this table) -->",
        "| " + " | ".join(table.columns) + " |",
        "|" + "---|" * len(table.columns),
    ]
    for row in table.rows(docs):
        assert len(row) == len(table.columns), (table.name, row)
        lines.append("| " + " | ".join([*row[:-1], f"`{row[-1]}`"]) + " |")
    lines += ["", "<details><summary>the commands that wrote these JSONs</summary>", ""]
    lines.extend(source_line(name, docs[name]) for name in table.sources)
    lines += ["", "</details>", "<!-- /table -->"]
    return "\n".join(lines)


def rendered(text: str, page: str) -> str:
    """``text`` with every table region replaced by what its JSONs give."""

    def one(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in TABLES:
            raise SystemExit(f"{page}: no table {name!r} in {FIX}'s TABLES ({sorted(TABLES)})")
        return render(TABLES[name])

    return REGION.sub(one, text)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 on a stale table")
    args = p.parse_args(argv)
    stale = []
    for path in PAGES:
        text = path.read_text()
        new = rendered(text, path.name)
        if new != text:
            stale.append(str(path.relative_to(ROOT)))
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print(f"stale rendered tables in {', '.join(stale)}: run `{FIX}`")
        return 1
    print(f"{'stale' if args.check else 'rewrote'}: {', '.join(stale) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
