"""Tokens per GPU under N-way FSDP, with and without activation checkpointing.

    torchrun --nproc-per-node 2 benchmarks/distributed/fsdp_budget.py --out results/budget    # ~3 min
    torchrun --nproc-per-node 2 benchmarks/distributed/fsdp_budget.py --smoke --out /tmp/b    # CPU, gloo
    python benchmarks/distributed/fsdp_budget.py --refit results/fsdp_budget_1xh200.json --out /tmp/r
                                     # the table again from a run's probes (no GPU)

For each checkpointing mode (``full``, ``none``) the model is sharded with
`packing.train._fsdp.shard_model` (bf16 parameters, fp32 reduction, AdamW) and trained two steps on
packs of T tokens per GPU at two shallow depths (2 and 4 blocks) and two pack sizes; the peak
memory (max over ranks) fits `packing.train._budget.MemoryModel`::

    peak = 16 bytes x params / N  +  fixed  +  T x (per_token + per_token_block x depth)

which predicts the largest pack at full depth for N = 1, 2, 4, 8 GPUs, for one micro-step a
step and for gradient accumulation without sync (FSDP2 then also keeps an unsharded fp32
gradient, `packing.train._budget.ACCUM_BYTES` a parameter). The prediction for
the N this runs on is then checked: one full-depth probe at 90% of the predicted pack, its
measured peak against the model's. Probes run eager (no compile): inductor usually keeps
less, so the answer is on the safe side. Capacity = the GPU's memory minus ``--headroom``.

Your own model: replace ``build`` (a sharded model and its optimizer at a given depth) and
``make_batch`` (a pack of T tokens) below; the fit and the table do not change.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import harness
from benchmarks.distributed.find_token_budget import pack_of
from packing.model import DiT, DiTConfig, param_count
from packing.train import MemoryModel, Probe, fit_memory_model, probe_peak, shard_model


# -- the model: replace these two for your own ----------------------------------------------
def build(cfg: DiTConfig, depth: int, ac: str, dev: torch.device) -> tuple[Any, Any, int]:
    """(sharded model, optimizer, parameter count) at ``depth`` blocks."""
    c = DiTConfig(**{**cfg.__dict__, "depth": depth})
    torch.manual_seed(0)
    with torch.device(dev):
        model = DiT(c)
    shard_model(model, checkpointing=ac, compile=False,  # type: ignore[arg-type]
                param_dtype=torch.bfloat16 if dev.type == "cuda" else None)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    return model, opt, param_count(c)


def make_batch(cfg: DiTConfig, tokens: int) -> Any:
    batch = pack_of(cfg, tokens, 240 if cfg.dim > 64 else 4, torch.Generator().manual_seed(0))
    batch.extras["seed"], batch.extras["step"] = 0, 0
    return batch


def train_step(model: Any, opt: Any, batch: Any, dev: torch.device) -> None:
    out = model(batch.to(dev))
    (out["latents"].float().mean() + out["action"].float().mean()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


# -- the search ------------------------------------------------------------------------------
def measure(cfg: DiTConfig, depth: int, ac: str, tokens: list[int], dev: torch.device,
            world: int) -> list[Probe]:  # fmt: skip
    model, opt, params = build(cfg, depth, ac, dev)
    out = []
    for t in tokens:
        batch = make_batch(cfg, t)
        peak = probe_peak(lambda m=model, o=opt, b=batch: train_step(m, o, b, dev), device=dev)
        out.append(Probe(depth=depth, tokens=t, params=params, world=world, peak_bytes=peak))
    del model, opt
    return out


def partial_checkpointing(fits: dict, capacity: float, params: int, depth: int,
                          world: int) -> list[dict[str, Any]]:  # fmt: skip
    """How many blocks may keep their activations (``shard_model(checkpoint_blocks=depth -
    k)``) at a few pack sizes: peak(full) + k x T x (none's - full's per-token-block bytes)."""
    if "full" not in fits or "none" not in fits:
        return []
    full = MemoryModel(
        **{k: fits["full"]["model"][k] for k in ("fixed", "per_token", "per_token_block")}
    )
    extra = fits["none"]["model"]["per_token_block"] - full.per_token_block
    out = []
    for t in (16384, 32768, 65536, 98304, 131072):
        free = capacity - full.peak(t, params, depth, world)
        if free <= 0 or extra <= 0:
            continue
        k = min(depth, int(free / (t * extra)))
        out.append({"GPUs": world, "pack tokens": t, "blocks without checkpointing": k,
                    "checkpoint_blocks": depth - k})  # fmt: skip
    return out


def prediction_rows(ac: str, mm: MemoryModel, capacity: float, params: int, depth: int,
                    world: int, check: dict[str, Any], multiple: int) -> list[dict[str, Any]]:  # fmt: skip
    """The table's rows for one checkpointing mode: N = 1, 2, 4, 8."""
    rows = []
    for n in (1, 2, 4, 8):
        here = n == world
        rows.append({"checkpointing": ac, "GPUs": n, "depth": depth, "params (B)": params / 1e9,
                     "tokens per GPU (predicted)": mm.max_tokens(capacity, params, depth, n,
                                                                 multiple=multiple),
                     "accumulating, no-sync (predicted)": mm.max_tokens(
                         capacity, params, depth, n, multiple=multiple, accumulate=True),
                     "checked here": here,
                     "check: measured GB at 90%": check.get("measured_gb") if here else None,
                     "check: predicted GB at 90%": check.get("predicted_gb") if here else None,
                     "per token MB (depth-free)": mm.per_token / 1e6,
                     "per token per block KB": mm.per_token_block / 1e3,
                     "fixed GB": mm.fixed / 1e9})  # fmt: skip
    return rows


def refit(path: str, out: str) -> None:
    """Fit and tabulate again from the probes a GPU run stored (same capacity and model)."""
    run = json.loads(Path(path).read_text())
    cfg = DiTConfig(**{**run["model"], "latent_hw": tuple(run["model"]["latent_hw"]),
                       "patch": tuple(run["model"]["patch"])})  # fmt: skip
    params = param_count(cfg)
    capacity = run["capacity_gb"] * 1e9
    rows, fits = [], {}
    for ac, fit in run["fits"].items():
        mm = fit_memory_model([Probe(**p) for p in fit["probes"]])
        rows += prediction_rows(ac, mm, capacity, params, cfg.depth, run["world_size"],
                                fit["check"], 1024)  # fmt: skip
        fits[ac] = {"model": mm.as_dict(), "probes": fit["probes"], "check": fit["check"]}
    partial = partial_checkpointing(fits, capacity, params, cfg.depth, run["world_size"])
    print(harness.markdown_table(rows, list(rows[0])))
    if partial:
        print(harness.markdown_table(partial, list(partial[0])))
    ns = argparse.Namespace(out=str(Path(out) / "fsdp_budget_refit.json"), quick=False,
                            refit=path)  # fmt: skip
    harness.write_json("fsdp_budget", ns, {"rows": rows, "fits": fits, "refit_of": path,
                                          "source_machine": run.get("machine"),
                                          "world_size": run["world_size"],
                                          "partial_checkpointing": partial,
                                          "capacity_gb": run["capacity_gb"],
                                          "model": run["model"]}, device="cpu")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="wan_2_2_5b", choices=["wan_1_3b", "wan_2_2_5b"])
    p.add_argument("--depth", type=int, default=30, help="the full depth to predict for")
    p.add_argument("--modes", default="full,none",
                   help="checkpointing modes, of full, ops (selective per op), attention "
                   "(attention outputs kept), none")  # fmt: skip
    p.add_argument("--headroom", type=float, default=0.08, help="fraction of memory left free")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--refit", default="", help="a run's fsdp_budget.json: refit, no GPU")
    args = p.parse_args()
    if args.refit:
        refit(args.refit, args.out)
        return
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in ("full", "ops", "attention", "none")]:
        p.error(f"--modes {args.modes}: unknown {unknown}; choose from full, ops, attention, none")
    cuda = torch.cuda.is_available() and not args.smoke
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        if cuda
        else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(dev)
        capacity = torch.cuda.get_device_properties(dev).total_memory * (1 - args.headroom)
        shallow = {"full": [16384, 49152], "ops": [8192, 16384], "attention": [16384, 32768],
                   "none": [8192, 16384]}  # fmt: skip
    else:
        capacity = 2e9  # a pretend 2 GB GPU: the smoke run exercises the arithmetic
        shallow = {"full": [512, 1024], "ops": [256, 512], "attention": [512, 1024],
                   "none": [256, 512]}  # fmt: skip
    cfg = DiTConfig.tiny() if args.smoke else getattr(DiTConfig, args.preset)(depth=args.depth)
    depth = 3 if args.smoke else args.depth
    t0 = time.perf_counter()
    rows, fits = [], {}
    for ac in modes:
        probes = [pr for d in (2, 4) for pr in measure(cfg, d, ac, shallow[ac], dev, world)]
        mm = fit_memory_model(probes)
        full_params = param_count(DiTConfig(**{**cfg.__dict__, "depth": depth}))
        mult = 1024 if cuda else 32
        predicted = mm.max_tokens(capacity, full_params, depth, world, multiple=mult)
        check_t = int(predicted * 0.9) // 1024 * 1024 if cuda else 512
        check: dict[str, Any] = {"tokens": check_t}
        if check_t > 0:
            try:
                (pr,) = measure(cfg, depth, ac, [check_t], dev, world)
                check.update(measured_gb=pr.peak_bytes / 1e9,
                             predicted_gb=mm.peak(check_t, full_params, depth, world) / 1e9)  # fmt: skip
            except torch.OutOfMemoryError as e:
                check["error"] = f"OOM at {check_t} tokens: the model underestimates ({e})"[:300]
        fits[ac] = {"model": mm.as_dict(), "probes": [p.__dict__ for p in probes], "check": check}
        rows += prediction_rows(ac, mm, capacity, full_params, depth, world, check, mult)
        if rank == 0:
            print(
                f"[{time.perf_counter() - t0:.0f} s] {ac}: {mm.as_dict()} check {check}", flush=True
            )
    partial = partial_checkpointing(fits, capacity, full_params, depth, world)
    if rank == 0:
        print(harness.markdown_table(rows, list(rows[0])))
        if partial:
            print(harness.markdown_table(partial, list(partial[0])))
        ns = argparse.Namespace(**{**vars(args), "out": str(Path(args.out) / "fsdp_budget.json"),
                                   "quick": args.smoke})  # fmt: skip
        harness.write_json("fsdp_budget", ns, {"rows": rows, "fits": fits, "world_size": world,
                                              "partial_checkpointing": partial,
                                              "capacity_gb": capacity / 1e9,
                                              "model": cfg.__dict__}, device=dev)  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
