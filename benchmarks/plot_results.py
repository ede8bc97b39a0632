"""Plots for docs/benchmarks.md from benchmarks/results/*.json (matplotlib, no GPU needed).

python benchmarks/plot_results.py          # writes docs/img/bench_*.png
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1]
RES = ROOT / "benchmarks" / "results"
IMG = ROOT / "docs" / "img"


def load(name: str) -> dict[str, Any]:
    return json.loads((RES / f"{name}.json").read_text())


def attention() -> None:
    rows = [r for r in load("attention")["rows"] if "fwd+bwd TFLOP/s" in r]
    masks = ("document", "frame_causal", "cross")
    fig, axes = plt.subplots(2, 3, figsize=(19, 9))
    for i, regime in enumerate(("seed", "short")):
        for j, mask in enumerate(masks):
            ax = axes[i][j]
            rs = [r for r in rows if r["regime"] == regime and r["mask"] == mask]
            rs.sort(key=lambda r: r["fwd+bwd TFLOP/s"])
            colors = ["tab:orange" if "packing.attention[auto]" in r["method"] else "tab:blue"
                      for r in rs]  # fmt: skip
            ax.barh([r["method"] for r in rs], [r["fwd+bwd TFLOP/s"] for r in rs], color=colors)
            for k, r in enumerate(rs):
                ax.text(r["fwd+bwd TFLOP/s"], k, f" {r['fwd+bwd ms']:.2f} ms", va="center",
                        fontsize=7)  # fmt: skip
            ax.set_title(f"{regime} ({rs[0]['episodes']} eps, {rs[0]['tokens'] / 1e3:.1f}K), {mask}",
                         fontsize=9)  # fmt: skip
            ax.tick_params(axis="y", labelsize=7)
            ax.set_xlabel("useful TFLOP/s, fwd+bwd (bf16, 12x128)", fontsize=8)
    fig.suptitle("Packed attention on one H200 (higher is better; orange = backend='auto')")
    fig.tight_layout()
    fig.savefig(IMG / "bench_attention.png", dpi=100)


def fill() -> None:
    """Padding cost: the same episodes packed tight vs in the budget (1.0 = padding free)."""
    rows = [r for r in load("attention")["rows"] if "vs tight" in r]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, regime in zip(axes, ("seed", "short"), strict=True):
        rs = [r for r in rows if r["regime"] == regime]
        labels = [f"{r['mask']}, {r['kernel']}, {r['fill']:.0%} full" for r in rs]
        ax.barh(labels, [r["vs tight"] for r in rs], color="tab:orange")
        ax.axvline(0.95, color="grey", ls=":", label="goal 0.95")
        ax.set_xlim(0, 1.1)
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlabel("tight time / in-budget time, fwd+bwd (1.0 = padding is free)")
        ax.set_title(f"{regime} regime (H200)", fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(IMG / "bench_fill.png", dpi=100)


def block_mask() -> None:
    d = load("block_mask")
    rows = [r for r in d["rows"] if r["device"] == "cuda" and r["episodes"] == 16]
    t = [r["tokens"] / 1024 for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in (
        ("ours ms", "make_block_mask (eager)"),
        ("ours compiled ms", "make_block_mask(compile=True)"),
        ("cbm compiled ms", "create_block_mask(_compile=True)"),
        ("cbm eager ms", "create_block_mask (eager)"),
    ):
        pts = [(x, r[key]) for x, r in zip(t, rows, strict=True) if r.get(key)]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    # This release's CUDA-graphed build, one run at 64K (its own create_block_mask row beside)
    (g,) = load("block_mask_cuda_graph_64k")["rows"]
    ax.plot(
        [64], [g["ours cuda_graph ms"]], "*", ms=12, label='make_block_mask(compile="cuda_graph")'
    )
    ax.plot(
        [64], [g["cbm compiled ms"]], "x", ms=9, label="create_block_mask(_compile=True), same run"
    )
    ax.axhline(0.3, color="grey", ls=":", label="goal 0.3 ms")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens (K), 16 episodes")
    ax.set_ylabel("build time, ms (CUDA events, median)")
    ax.set_title("Document BlockMask build on one H200")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(IMG / "bench_block_mask.png", dpi=110)


STEP_LABELS = {
    "packed": "packed auto",
    "lean": "lean, one episode a micro-step",
    "bucket_sdpa": "bucketing, 4 buckets",
    "bucket_opensora": "Open-Sora bucketing, 8",
}


def _step_label(r: dict[str, Any]) -> str:
    kind = r["variant"].split(":")[0]
    attention = "FA4 varlen" if r["attention"] == "varlen" else r["attention"]
    return f"{STEP_LABELS.get(kind, kind)}\n[{attention}]"


def step() -> None:
    """The one-GPU step table of the last re-run: packed against each baseline at its probed
    best, real tokens/s, the rows that ran (a row cut by its deadline has no bar)."""
    fig, axes = plt.subplots(1, 2, figsize=(15, 4.6))
    for ax, regime in zip(axes, ("seed", "short"), strict=True):
        rows = [r for r in load(f"step_{regime}_h200")["rows"] if r.get("tokens/s")]
        packed = next(r["tokens/s"] for r in rows if r["variant"].startswith("packed"))
        ax.barh([_step_label(r) for r in rows], [r["tokens/s"] / 1e3 for r in rows],
                color=["tab:orange" if r["variant"].startswith("packed") else "tab:blue"
                       for r in rows])  # fmt: skip
        for i, r in enumerate(rows):
            ax.text(r["tokens/s"] / 1e3, i, f" {r['step ms']:.0f} ms, packed "
                    f"{packed / r['tokens/s']:.2f}x", va="center", fontsize=8)  # fmt: skip
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=8)
        ax.set_xlim(0, 1.35 * max(r["tokens/s"] for r in rows) / 1e3)
        ax.set_xlabel("real tokens/s (K), 4 DiT blocks at Wan-2.2-5B width, compiled")
        ax.set_title(f"{regime} regime (one H200, commit 40b14ba)", fontsize=10)
    fig.suptitle("Training step: packed (orange) vs the baselines at their probed best (blue)")
    fig.tight_layout()
    fig.savefig(IMG / "bench_step.png", dpi=110)


def collate() -> None:
    rows = [r for r in load("collate")["rows"] if "vs naive" in r and r.get("threads", 1) == 1]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    groups = sorted({(r["regime"], r["dtype"]) for r in rows})
    methods = ["bare copy", "PackedCollator", "naive full", "pad to longest"]
    w = 0.2
    for j, m in enumerate(methods):
        ys = [next(r["GB/s"] for r in rows if (r["regime"], r["dtype"]) == g and r["method"] == m)
              for g in groups]  # fmt: skip
        ax.bar([i + (j - 1.5) * w for i in range(len(groups))], ys, w, label=m)
    ax.set_xticks(range(len(groups)), [f"{g[0].split()[0]}\n{g[1]}" for g in groups])
    ax.axhline(10, color="grey", ls=":", label="goal 10 GB/s")
    ax.set_ylabel("GB/s of episode data, one thread")
    ax.set_title("Collate per DataLoader worker (CPU of the run in collate.json)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(IMG / "bench_collate.png", dpi=110)


def main() -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    for fn in (attention, fill, block_mask, step, collate):
        fn()
        print(f"wrote {IMG / ('bench_' + fn.__name__ + '.png')}")


if __name__ == "__main__":
    main()
