"""The rows of benchmarks/render_tables.py's tables: one function per family of result JSON,
from the loaded JSONs to the cells of each row (the last cell is the JSON's file name).

Each function reads only what its JSON holds and computes every ratio from it, so a figure on a
page cannot drift from its run. The names of variants and arms as a page says them are here
too; what the figures mean is said by the page around the table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Doc = dict[str, Any]
Docs = dict[str, Doc]  # JSON file name -> its content
Row = Sequence[str]  # the cells; the last one is the JSON file name the row came from


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


def cache_gain(doc: Doc) -> str:
    cached, uncached = by_arm(doc, "cached@8"), by_arm(doc, "uncached@8")
    return f"**{ratio(cached['req_per_s'] / uncached['req_per_s'])}** requests/s at 8 robots"


def wan_gain(doc: Doc) -> str:
    def vs(regime: str) -> float:
        packed = by_prefix(doc, "packed", regime=regime)
        return packed["tokens/s"] / by_prefix(doc, "unpacked[", regime=regime)["tokens/s"]

    return f"**{ratio(vs('short'))}** tokens/s, short episodes; {ratio(vs('seed'))} long ones"


def step_gain(baseline: str) -> Callable[[Doc], str]:
    def gain(doc: Doc) -> str:
        x = by_prefix(doc, "packed")["tokens/s"] / by_prefix(doc, baseline)["tokens/s"]
        return f"**{ratio(x)}** tokens/s" if x >= 1.1 else f"{ratio(x)} tokens/s (parity)"

    return gain


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
    doc, rows = docs[name], list[Row]()
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
    doc, rows = docs[name], list[Row]()
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


def robots_rows(source: str) -> Callable[[Docs], list[Row]]:
    def rows(docs: Docs) -> list[Row]:
        doc, out = docs[source], list[Row]()
        for r in doc["rows"]:
            alone = by_arm(doc, "one_at_a_time", robots=r["robots"])
            vs = "—" if r is alone else ratio(r["chunks_per_s"] / alone["chunks_per_s"])
            arm = "one at a time" if r is alone else "**packed**"
            cells = (str(r["robots"]), arm, f"{r['chunks_per_s']:.2f}", ms(r["p50_ms"]))
            per_call = f"{r['requests_per_call']:.2f}"
            out.append((*cells, ms(r["p99_ms"]), f"{r['idle']:.2f}", per_call, vs, source))
        return out

    return rows


def step_cost_rows(source: str) -> Callable[[Docs], list[Row]]:
    """robots.py's `step_costs`: one model call of the warmed engine alone, by pack size."""

    def rows(docs: Docs) -> list[Row]:
        out = list[Row]()
        for c in docs[source]["step_costs"]:
            chunk = ms(c["chunk_ms"]) if "chunk_ms" in c else "—"
            cells = (str(c["requests"]), f"{c['step_ms']:.1f}", f"{c['per_request_ms']:.1f}")
            out.append((*cells, chunk, source))
        return out

    return rows


def cache_rows(docs: Docs) -> list[Row]:
    name = "serve_cache_h200.json"
    doc, rows = docs[name], list[Row]()
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


def _gated(value: float, gate: float | None) -> str:
    return f"{value:.1e}" + ("" if gate is not None else " (not gated)")


def verify_cpu_rows(docs: Docs) -> list[Row]:
    """benchmarks/verify_tolerances.py's runs: each report against its own gates."""
    name = "verify_cpu.json"
    out = list[Row]()
    for run in docs[name]["rows"]:
        r, gates = run["report"], run["report"]["tolerances"]
        params = f"{r['param_rel']:.1e} / {_gated(r['param_worst_rel'], gates['param_rel'])}"
        result = "PASS" if r["passed"] else "FAIL"
        if r.get("leak") and r["leak"]["leaks"]:
            pairs = len(r["leak"]["pairs"])
            result += f": {len(r['leak']['leaks'])} leaks, all {pairs} pairs"
        cells = (run["setup"], f"`{run['command']}`", f"{r['loss_rel']:.1e}")
        cos = f"{r['grad_cos_min']:.7f}"
        out.append(
            (*cells, _gated(r["grad_rel_max"], gates["grad_rel"]), cos, params, result, name)
        )
    return out


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


# ---------------------------------------------------------------- goals


def step_goal(least: float) -> Callable[[Doc], tuple[str, bool]]:
    """Packed against its best baseline (the one with the most tokens/s)."""

    def measure(doc: Doc) -> tuple[str, bool]:
        packed = by_prefix(doc, "packed")
        others = [r for r in doc["rows"] if r is not packed and r.get("tokens/s")]
        best = max(others, key=lambda r: r["tokens/s"])
        x = packed["tokens/s"] / best["tokens/s"]
        return f"{ratio(x)} {_variant_name(best)}", x >= least

    return measure


def mfu_goal(doc: Doc) -> tuple[str, bool]:
    mfu = by_prefix(doc, "packed")["MFU of measured 790"]
    return f"{mfu:.2f} of 790", mfu >= 0.65


def wan_goal(regime: str, least: float) -> Callable[[Doc], tuple[str, bool]]:
    def measure(doc: Doc) -> tuple[str, bool]:
        packed = by_prefix(doc, "packed", regime=regime)["tokens/s"]
        x = packed / by_prefix(doc, "unpacked[", regime=regime)["tokens/s"]
        return f"{ratio(x)} by tokens/s over the mean step", x >= least

    return measure


def serve_goal(arm: str, mix: str, least: float) -> Callable[[Doc], tuple[str, bool]]:
    def measure(doc: Doc) -> tuple[str, bool]:
        packed = by_arm(doc, "packed/graphs", mix=mix)["req_per_s"]
        x = packed / by_arm(doc, arm, mix=mix)["req_per_s"]
        return f"{ratio(x)} {SERVE_ARMS[arm]}", x >= least

    return measure


def bound_goal(doc: Doc) -> tuple[str, bool]:
    short, long = (
        by_arm(doc, "packed/graphs", mix=m)["fraction_of_bound"] for m in ("short", "long")
    )
    return f"{short:.2f} short, {long:.2f} long", min(short, long) >= 0.8


def cache_rate_goal(doc: Doc) -> tuple[str, bool]:
    x = by_arm(doc, "cached@8")["req_per_s"] / by_arm(doc, "uncached@8")["req_per_s"]
    return f"{ratio(x)}", x >= 3


def cache_p99_goal(robots: int, most_ms: float) -> Callable[[Doc], tuple[str, bool]]:
    def measure(doc: Doc) -> tuple[str, bool]:
        r = by_arm(doc, f"cached@{robots}")
        return f"{ms(r['p99_ms'])} ms of {r['requests']} chunks", r["p99_ms"] <= most_ms

    return measure


def robots_lone_goal(doc: Doc) -> tuple[str, bool]:
    """A lone robot's chunk through the server against the engine's own one-request chunk."""
    lone = by_arm(doc, "packed", robots=1)["p50_ms"]
    engine = next(c["chunk_ms"] for c in doc["step_costs"] if c["requests"] == 1)
    return f"{ms(lone)} ms vs {ms(engine)} ms ({ratio(lone / engine)})", lone <= 1.1 * engine


def robots_p99_goal(robots: int, most_ms: float) -> Callable[[Doc], tuple[str, bool]]:
    def measure(doc: Doc) -> tuple[str, bool]:
        r = by_arm(doc, "packed", robots=robots)
        return f"{ms(r['p99_ms'])} ms of {r['chunks']} chunks", r["p99_ms"] <= most_ms

    return measure


def robots_rate_goal(robots: int, least: float) -> Callable[[Doc], tuple[str, bool]]:
    def measure(doc: Doc) -> tuple[str, bool]:
        packed = by_arm(doc, "packed", robots=robots)["chunks_per_s"]
        x = packed / by_arm(doc, "one_at_a_time", robots=robots)["chunks_per_s"]
        return f"{ratio(x)} (robots' pacing caps it: docs/serving.md)", x >= least

    return measure


# ---------------------------------------------------------------- LingBot-VA (LeRobot's port)

LINGBOT_RUNS = ("lingbot_va_h200.json", "lingbot_va_h200_30_blocks.json")


def _lingbot_row(
    docs: Docs, blocks: int, regime: str, arm: str, runs: Sequence[str] = LINGBOT_RUNS
) -> Doc:
    for name in runs:
        for r in docs[name]["rows"]:
            if (r["blocks"], r["regime"], r["arm"]) == (blocks, regime, arm) and "error" not in r:
                return r
    raise KeyError(f"no LingBot-VA row {blocks} blocks, {regime}, {arm}")


def lingbot_rows(docs: Docs) -> list[Row]:
    """Every finished row of both runs (a row that did not run keeps its reason in the JSON)."""
    out = list[Row]()
    for name in LINGBOT_RUNS:
        for r in docs[name]["rows"]:
            if "error" in r:
                continue
            vs = "—" if r["arm"] == "lerobot" else ratio(r["vs lerobot"])
            share = r.get("packing share")
            cells = (str(r["blocks"]), r["regime"], r["arm"], count(r["tokens/s"]), vs)
            mfu, peak = f"{r['MFU of measured 790']:.2f}", f"{r['peak GB']:.1f}"
            loss = f"{r['loss rel diff']:.1e}" if r["arm"] != "lerobot" else "—"
            out.append((*cells, mfu, peak, loss, pct(share) if share is not None else "—", name))
    return out


def lingbot_gain(doc: Doc) -> str:
    """The README row: LeRobot's own path on its 16-frame windows, and at the notes' lengths."""
    short = _lingbot_row({"run": doc}, 4, "short", "packed[bench]", runs=("run",))["vs lerobot"]
    seed = _lingbot_row({"run": doc}, 4, "seed", "packed[bench]", runs=("run",))["vs lerobot"]
    return f"**{ratio(short)}** tokens/s on its 16-frame windows; {ratio(seed)} on whole episodes"


def lingbot_goal(
    blocks: int, regime: str, arm: str, least: float
) -> Callable[[Doc], tuple[str, bool]]:
    """Packed tokens/s over LeRobot's own path, ``least`` or more."""

    def measure(doc: Doc) -> tuple[str, bool]:
        x = _lingbot_row({"run": doc}, blocks, regime, arm, runs=("run",))["vs lerobot"]
        return ratio(x), x >= least

    return measure


def lingbot_share_goal(doc: Doc) -> tuple[str, bool]:
    r = next(r for r in doc["rows"] if r["arm"] == "packed[lingbot_va]" and "error" not in r)
    return f"{pct(r['packing share'], 2)} of a 30-block step", r["packing share"] <= 0.05


def pool_mask_rows(docs: Docs) -> list[Row]:
    """bench_pool_block_mask.py: one row per robot count."""
    name = "pool_block_mask_cpu.json"
    return [
        (count(r["robots"]), f"{r['queries']:,} x {r['pool rows']:,}", ms(r["create_block_mask ms"]),
         ms(r["make_pool_block_mask ms"]), ratio(r["speedup"]), "yes" if r["same tiles"] else "NO",
         name)
        for r in docs[name]["rows"]
    ]  # fmt: skip


LINGBOT_SERVE_RUNS = ("bench_lingbot_serve_own_h100.json", "bench_lingbot_serve_short_h100.json")
LINGBOT_SERVE_H200 = "bench_lingbot_serve_own_h200.json"
_ALONE = "LeRobot, one robot at a time"


def _alone(rows: list[Doc], schedule: str) -> tuple[float, float]:
    """LeRobot one robot at a time on ``schedule``: (chunks/s, one robot's p99 ms), from any
    of its rows (a derived row of N robots is N of one robot's chunk times)."""
    r = next(r for r in rows if r["schedule"] == schedule and r["server"] == _ALONE)
    return r["chunks_per_s"], r["p99_ms"] / r["robots"]


def lingbot_serve_rows(*sources: str) -> Callable[[Docs], list[Row]]:
    """bench_lingbot_serve.py: every row of each schedule's run; a derived row (N robots served
    one at a time: one robot's measured chunk time, N of them waiting) says so."""

    def rows(docs: Docs) -> list[Row]:
        out = list[Row]()
        for name in sources:
            for r in docs[name]["rows"]:
                packed = r["server"].startswith("packed")
                server = f"**{r['server']}**" if packed else r["server"]
                if r.get("derived"):
                    server += " (derived)"
                x = r.get("x_lerobot")  # absent in a run cut before its summary
                x = (
                    r["chunks_per_s"] / _alone(docs[name]["rows"], r["schedule"])[0]
                    if x is None
                    else x
                )
                vs = ratio(x) if packed or "compiled" in r["server"] else "—"
                peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "—"
                cells = (r["schedule"], server, str(r["robots"]), ms(r["p50_ms"]), ms(r["p99_ms"]))
                out.append((*cells, f"{r['chunks_per_s']:.2f}", vs, peak, name))
        return out

    return rows


def lingbot_fill_rows(docs: Docs) -> list[Row]:
    """fill_lingbot_packs.py: per robots, arrival and shape set, the share of a step's query
    tokens that were robots' and the tokens a chunk computed (counts, the same anywhere)."""
    name = "fill_lingbot_packs.json"
    doc = docs[name]
    return [(str(r["robots"]), r["arrival"], doc["packs"][r["packs"]], pct(r["fill"], 0),
             f"{r['tokens_per_chunk']:,.0f}", ratio(r["x_fewer_tokens"]), name)
            for r in doc["rows"]]  # fmt: skip


def lingbot_serve_goal(key: str) -> Callable[[Doc], tuple[str, bool]]:
    """Issue 42's goals at 8 robots on LingBot-VA's own schedule, from the rows, for robots in
    step and out of step: ``key`` "x4" (≥ 4× LeRobot one robot at a time, chunks/s) or "p99"
    (p99 no worse than one robot alone's); met when both are."""
    servers = ("packed (LingBotVAEngine)", "packed, robots out of step")

    def measure(doc: Doc) -> tuple[str, bool]:
        rows = doc["rows"]
        packed = [next(r for r in rows if r["server"] == s and r["robots"] == 8
                       and r["schedule"].startswith("video 20+1")) for s in servers]  # fmt: skip
        cps, p99 = _alone(rows, packed[0]["schedule"])
        if key == "x4":
            xs = [r["chunks_per_s"] / cps for r in packed]
            return " / ".join(map(ratio, xs)) + " chunks/s", min(xs) >= 4.0
        got = " / ".join(ms(r["p99_ms"]) for r in packed)
        met = max(r["p99_ms"] for r in packed) <= p99
        return f"p99 {got} ms (one robot alone: {ms(p99)} ms)", met

    return measure
