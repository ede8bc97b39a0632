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
loaded JSONs to rows (benchmarks/table_rows.py), add one `Table` to TABLES here, put
`<!-- table: NAME -->` and `<!-- /table -->` where it goes, and run the script. A row of the
README's first table is one `Gain` in GAINS, a goal one `Goal` in GOALS; a LingBot-VA row,
for one, is `Gain("lingbot_va_h200.json", "<what a user runs today>", "<with packing>",
<a function from that JSON to the gain>)`. Only figures live here: what a table means is
said by the page around it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from the repository root
from benchmarks import table_rows as rows  # noqa: E402  (the row functions, cell formats)
from benchmarks.table_rows import Doc, Docs, Row  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
FIX = "python benchmarks/render_tables.py"
REGION = re.compile(r"<!-- table: (?P<name>[\w-]+)[^>]*-->\n.*?<!-- /table -->", re.DOTALL)


@dataclass(frozen=True)
class Table:
    """One rendered table: its JSONs (file names under benchmarks/results), its columns (the
    last is always `from`) and a function from the loaded JSONs to its rows."""

    name: str
    sources: tuple[str, ...]
    columns: tuple[str, ...]
    rows: Callable[[Docs], list[Row]]


@dataclass(frozen=True)
class Gain:
    """One row of the README's first table: what a user runs today, what packing changes,
    and the measured ratio (a function of the JSON, so it cannot drift from it)."""

    source: str
    today: str
    packing: str
    gain: Callable[[Doc], str]


GAINS: tuple[Gain, ...] = (
    Gain(
        "serve_cache_h200.json",
        "a policy server that recomputes each robot's context at every denoising step "
        "(frame-causal DiT, 5B widths, 30 blocks)",
        "the context cache: each robot's context computed once",
        rows.cache_gain,
    ),
    Gain(
        "lingbot_va_h200.json",
        "LeRobot's LingBot-VA training path (its `training_loss_from_streams`, one sample a "
        "micro-step + accumulation; 5B widths, 4 blocks)",
        "K whole episodes a pack, the layout `lingbot_va.install(policy)` builds (in this "
        "4-block run built by the benchmark script; the integration at 30 blocks: docs/lingbot-va.md)",
        rows.lingbot_gain,
    ),
    Gain(
        "diffusers_wan_30_blocks_h200.json",
        "diffusers' Wan 2.2 TI2V 5B (30 blocks), one episode a micro-step + gradient accumulation",
        "`install(model)`: one pack a step, the weights untouched",
        rows.wan_gain,
    ),
    Gain(
        "step_short_h200.json",
        "a per-episode training loop on short episodes (0.3K–2.5K tokens), one episode a "
        "micro-step at its best attention backend",
        "one pack of whole episodes a step",
        rows.step_gain("lean"),
    ),
    Gain(
        "step_seed_h200.json",
        "the same loop on long episodes (4.6K–10.7K tokens): each already fills the GPU",
        "one pack a step",
        rows.step_gain("lean"),
    ),
    Gain(
        "step_short_h200.json",
        "Open-Sora's bucketing (8 length buckets, one bucket a step), short episodes",
        "one pack a step",
        rows.step_gain("bucket_opensora"),
    ),
)


def headline_rows(docs: Docs) -> list[Row]:
    return [(g.today, g.packing, g.gain(docs[g.source]), g.source) for g in GAINS]


@dataclass(frozen=True)
class Goal:
    """A goal set before a run, and what the run measured against it: ``measure`` returns the
    figure as text and whether it meets the goal, so met/missed cannot drift from the JSON."""

    source: str
    goal: str
    measure: Callable[[Doc], tuple[str, bool]]


GOALS: tuple[Goal, ...] = (
    Goal("step_seed_h200.json", "one-GPU step, long episodes: ≥ 1.0× the best baseline",
         rows.step_goal(1.0)),
    Goal("step_short_h200.json", "one-GPU step, short episodes: ≥ 1.25× the best baseline",
         rows.step_goal(1.25)),
    Goal("step_seed_h200.json", "packed step MFU ≥ 0.65 of 790 TFLOP/s, long", rows.mfu_goal),
    Goal("step_short_h200.json", "packed step MFU ≥ 0.65 of 790 TFLOP/s, short", rows.mfu_goal),
    Goal("diffusers_wan_30_blocks_h200.json", "diffusers Wan, long: ≥ 1.3× batch 1",
         rows.wan_goal("seed", 1.3)),
    Goal("diffusers_wan_30_blocks_h200.json", "diffusers Wan, short: ≥ 2× batch 1",
         rows.wan_goal("short", 2.0)),
    Goal("serve_h200.json", "packed inference ≥ 0.8 of the compute bound", rows.bound_goal),
    Goal("serve_h200.json", "packed inference never slower than padded, short mix",
         rows.serve_goal("padded_bucketed/graphs", "short", 1.0)),
    Goal("serve_h200.json", "packed inference ≥ 1.2× padded on the long mix",
         rows.serve_goal("padded_bucketed/graphs", "long", 1.2)),
    Goal("serve_cache_h200.json", "context cache ≥ 3× uncached at 8 robots", rows.cache_rate_goal),
    Goal("serve_cache_h200.json", "context cache p99 ≤ 300 ms at 8 robots",
         rows.cache_p99_goal(8, 300)),
    Goal("serve_cache_h200.json", "context cache p99 ≤ 600 ms at 16 robots",
         rows.cache_p99_goal(16, 600)),
    Goal("lingbot_va_h200.json", "LingBot-VA, the notes' lengths: ≥ 2× LeRobot's path (4 blocks)",
         rows.lingbot_goal(4, "seed", "packed[bench]", 2.0)),
    Goal("lingbot_va_h200_30_blocks.json", "LingBot-VA, the notes' lengths: ≥ 2× LeRobot's path (30 blocks)",
         rows.lingbot_goal(30, "seed", "packed[lingbot_va]", 2.0)),
    Goal("lingbot_va_h200.json", "LingBot-VA, LeRobot's 16-frame windows: ≥ 20× its path",
         rows.lingbot_goal(4, "short", "packed[bench]", 20.0)),
    Goal("lingbot_va_h200_30_blocks.json", "LingBot-VA: packing's own work ≤ 5% of a packed step",
         rows.lingbot_share_goal),
    Goal("serving_robots_h200.json", "a lone robot through the server ≤ 1.1× the engine's chunk",
         rows.robots_lone_goal),
    Goal("serving_robots_h200.json", "8 robots through the server: p99 ≤ 300 ms",
         rows.robots_p99_goal(8, 300)),
    Goal("serving_robots_h200.json", "16 robots through the server: p99 ≤ 600 ms",
         rows.robots_p99_goal(16, 600)),
    Goal("serving_robots_h200.json", "8 robots: packed ≥ 3× one at a time, chunks/s",
         rows.robots_rate_goal(8, 3.0)),
    Goal(rows.LINGBOT_SERVE_H200,
         "LingBot-VA served, 8 robots in step / out of step: ≥ 4× LeRobot one at a time",
         rows.lingbot_serve_goal("x4")),
    Goal(rows.LINGBOT_SERVE_H200,
         "LingBot-VA served, 8 robots in step / out of step: p99 ≤ one robot alone's",
         rows.lingbot_serve_goal("p99")),
)  # fmt: skip


def goal_rows(docs: Docs) -> list[Row]:
    out: list[Row] = []
    for g in GOALS:
        figure, met = g.measure(docs[g.source])
        out.append((g.goal, figure, "met" if met else "**missed**", g.source))
    return out


ROBOTS_COLUMNS = ("robots", "arm", "chunks/s", "p50 ms", "p99 ms", "robot idle",
                  "requests a model call", "vs one at a time", "from")  # fmt: skip


# ---------------------------------------------------------------- the registry

LINGBOT_SERVE_COLUMNS = ("schedule", "server", "robots", "p50 ms", "p99 ms", "chunks/s",
                         "vs LeRobot alone", "peak GiB", "from")  # fmt: skip

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
            "pool_mask_cpu",
            ("pool_block_mask_cpu.json",),
            (
                "robots",
                "queries x pool rows",
                "create_block_mask ms",
                "make_pool_block_mask ms",
                "faster",
                "same tiles",
                "from",
            ),
            rows.pool_mask_rows,
        ),
        Table(
            "step_profile",
            ("step_seed_h200.json", "step_short_h200.json"),
            ("regime", "packed step, CUDA kernel ms", "GEMM", "attention", "elementwise", "from"),
            rows.step_profile_rows,
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
            rows.step_rows,
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
            rows.wan_rows,
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
            rows.serve_rows,
        ),
        Table(
            "robots_h200",
            ("serving_robots_h200.json",),
            ROBOTS_COLUMNS,
            rows.robots_rows("serving_robots_h200.json"),
        ),
        Table(
            "lingbot_va_h200",
            rows.LINGBOT_RUNS,
            (
                "blocks",
                "regime",
                "arm",
                "tokens/s",
                "vs lerobot",
                "MFU (790)",
                "peak GB",
                "first-step loss rel. diff",
                "packing's share",
                "from",
            ),
            rows.lingbot_rows,
        ),
        Table(
            "lingbot_serve_h100",
            rows.LINGBOT_SERVE_RUNS,
            LINGBOT_SERVE_COLUMNS,
            rows.lingbot_serve_rows(*rows.LINGBOT_SERVE_RUNS),
        ),
        Table(
            "lingbot_serve_h200",
            (rows.LINGBOT_SERVE_H200,),
            LINGBOT_SERVE_COLUMNS,
            rows.lingbot_serve_rows(rows.LINGBOT_SERVE_H200),
        ),
        Table(
            "lingbot_fill",
            ("fill_lingbot_packs.json",),
            (
                "robots",
                "arrival",
                "pack shapes",
                "robots' share of the tokens",
                "tokens a robot's chunk",
                "fewer than one mixed shape",
                "from",
            ),
            rows.lingbot_fill_rows,
        ),
        Table(
            "robots_h200_steps",
            ("serving_robots_h200.json",),
            ("requests in the pack", "step ms", "ms a request", "one request's chunk ms", "from"),
            rows.step_cost_rows("serving_robots_h200.json"),
        ),
        Table(
            "robots_cpu",
            ("serving_robots_cpu.json",),
            ROBOTS_COLUMNS,
            rows.robots_rows("serving_robots_cpu.json"),
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
            rows.planner_rows,
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
                rows.lerobot_io_rows(f"lerobot_io{suffix}.json"),
            )
            for suffix in ("", "_embedded")
        ),
        Table(
            "verify_cpu",
            ("verify_cpu.json",),
            (
                "set-up",
                "command",
                "loss rel",
                "worst gradient rel",
                "min gradient cosine",
                "params rel (all / worst tensor)",
                "result",
                "from",
            ),
            rows.verify_cpu_rows,
        ),
        Table(
            "verify_gpu",
            tuple(name for name, _, _ in rows.VERIFY_RUNS),
            ("set-up", "command", "loss rel", "min gradient cosine", "result", "from"),
            rows.verify_rows,
        ),
        Table(
            "encode_cpu",
            ("encode_cpu.json",),
            ("method", "episodes/s (min–max)", "frames/s", "vs naive", "from"),
            rows.encode_rows,
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
            rows.cache_rows,
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
            rows.cache_flops_rows,
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
    elif [
        ln for ln in doc["provenance"].get("git_status") or [] if "benchmarks/results/" not in ln
    ]:
        where += "; uncommitted changes, hashed in its `provenance`"  # results JSONs are no code
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
