"""FSDP2 training step on N GPUs: packed vs one episode per micro-step, full-depth DiT.

Launch one process per GPU::

    torchrun --nproc-per-node 2 benchmarks/distributed/bench_fsdp.py --regime seed --out results/fsdp
    torchrun --nproc-per-node 2 benchmarks/distributed/bench_fsdp.py --smoke --out /tmp/fsdp   # CPU, gloo

The reference DiT at Wan-2.2-5B widths (``--depth``, default 30 blocks), sharded with
`packing.train._fsdp.shard_model`: ``fully_shard`` per block and root, bf16 parameters, fp32 gradient
reduction, per-block activation checkpointing (``--checkpointing``), each block compiled,
AdamW. Every rank trains 16 episodes per optimizer step (``--episodes-per-gpu``), drawn from
the regime (seed: 144-336 frames = 4.6K-10.7K tokens; short: 10-79 frames = 0.3K-2.5K); the
same episodes and initial weights in every variant::

    unpacked_sync    one episode per micro-step, 16 micro-steps, gradient reduce-scatter on
                     every micro-step (our users' earlier setup); blocks compiled with
                     dynamic=True, attention = SDPA's default dispatch on the one unpadded
                     episode (the withdrawn rows of docs/benchmarks.md §5 forced FLASH)
    unpacked_nosync  the same, reduce-scatter only on the last micro-step
                     (set_requires_gradient_sync(False) before: the better of the two)
    lean             one episode per micro-step, sync on the last, through
                     benchmarks/step/baselines.py's lean forward (inputs prepared ahead, exact
                     length, SDPA's default dispatch, the blocks compiled dynamic=True inside
                     the same FSDP + checkpoint wrapping): the strongest per-episode setup
    bucket_sdpa      length bucketing as Open-Sora 2.0 (--buckets frame buckets, a batch per
    bucket_flex      bucket of ~--pack-budget tokens, padded rows with a key-padding mask
    bucket_crop      through SDPA or Flex, or cropped to the bucket below), sync on the last
    packed           the step's episodes of ALL ranks through the distributed sampler
                     (`PackedBatchSampler`: the fewest packs of --pack-budget tokens, the
                     same count on every rank, ranks balanced by tokens; 16 episodes per
                     GPU on average), one static shape, attention `auto` (FA4 varlen when
                     installed, else Flex), compiled dynamic=False, sync on the last
                     micro-step. Pooling matters: 16 seed episodes of one rank fill packs of
                     65,536 to 86% (2.2 packs); the 32 of two ranks to 92% (2.0 packs)
    packed_ops       packed with selective per-op checkpointing (attention outputs and every
                     second matmul saved, the rest recomputed; "MFU incl. recompute" counts
                     no recompute for it, so it reads low)
    packed_attn      packed with every block's forward recomputed but its attention (the
                     attention kernels' outputs kept: "attention" checkpointing); combine
                     with a budget as packed_b131072_attn
    packed_acN       packed with N blocks fully checkpointed, the rest keeping activations

Reported per variant (rank 0 prints a markdown table; JSON to --out): s/step (median of the
timed steps, CUDA events, up to the end-of-step barrier), tokens/s over all GPUs, MFU by model
FLOPs (`benchmarks/harness/flops.py`, against both named peaks; recompute NOT counted;
"MFU incl. recompute" adds one more block forward for full checkpointing), first-step time and
compile estimate (first step minus a timed one), peak memory (max over ranks), per-rank wait at
the end-of-step barrier (CUDA events), exposed communication from one profiled step (GPU time
when a NCCL kernel runs and no compute kernel does: transfers not hidden + waiting for the
other rank), every step's loss (all-reduced, read after the loop) and its relative difference
to unpacked_sync, and dynamo graphs compiled after warm-up (recompiles).

``--recompile-packs 100`` then trains the packed variant on 100 random packs at
``--recompile-depth`` blocks (the same compiled block code; full depth would take minutes per
100 steps) and counts the graphs compiled after the first pack. ``--sweep 1,2,4,8`` trains the
same episodes in exactly M packs for each M (reduce-scatter on every micro-step) to fit
``step = a + M * x`` (docs/benchmarks.md §5; benchmarks/distributed/fit_microsteps.py re-predicts 4 and
8 GPUs). ``--time-limit`` skips what would not finish (all ranks agree), so the run ends in time.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
import packing.model._dit as pm
from benchmarks import harness
from benchmarks.attention import backends
from benchmarks.harness import PEAKS, dit_flops
from benchmarks.step import baselines as bl
from benchmarks.step.bench_step import (
    _LIB_ATTENTION,
    episode_shape,
    make_episode,
    sdpa_one_episode,
    step_flops,
    to_device,
)
from packing.data import PackedBatch, PackedCollator, Stream
from packing.model import DiT, DiTConfig
from packing.planning import plan_packs
from packing.planning._sampler import PackedBatchSampler, equalise_packs
from packing.train import LossNormalizer, shard_model

REGIMES = {"seed": (144, 336), "short": (10, 79)}  # frames (32 tokens each)
DEFAULT_BUDGET = {"seed": 65536, "short": 24576}  # pooled packs fill ~92% / ~85%
MESH: dict[str, Any] = {}  # one DeviceMesh for the whole run (set in main)
VARIANTS = ("packed", "unpacked_sync", "unpacked_nosync")  # packed first: the headline
# packed[_b<budget>][_ac<blocks> | _ops | _attn], or an unpacked baseline
VARIANT_NAME = re.compile(
    r"unpacked_sync|unpacked_nosync|lean|bucket_sdpa|bucket_flex|bucket_crop"
    r"|packed(_b\d+)?(_ac\d+|_ops|_attn)?"
)
BASELINES = ("lean", "bucket_sdpa", "bucket_flex", "bucket_crop")  # benchmarks/step/baselines.py


# -- episodes and plans ------------------------------------------------------------------------
def step_lengths(args: Any, step: int, world: int) -> list[list[int]]:
    """Frames of every rank's episodes at ``step`` (all ranks compute the same table)."""
    lo, hi = REGIMES[args.regime] if not args.smoke else (2, 6)
    prng = random.Random(args.seed * 1_000_003 + step)
    return [[prng.randint(lo, hi) for _ in range(args.episodes_per_gpu)] for _ in range(world)]


class Episodes:
    """Every episode of a step, made on demand from (seed, step, global index) and kept, so
    each variant trains the very same tensors; rank r owns indices [16 r, 16 r + 16)."""

    def __init__(self, args: Any, cfg: DiTConfig, world: int) -> None:
        self.args, self.cfg, self.world = args, cfg, world
        self.cache: dict[tuple[int, int], dict] = {}

    def frames(self, step: int) -> list[int]:
        return [f for fr in step_lengths(self.args, step, self.world) for f in fr]

    def get(self, step: int, g: int) -> dict:
        if (step, g) not in self.cache:
            rng = torch.Generator().manual_seed((self.args.seed * 1_000_003 + step) * 4099 + g)
            self.cache[step, g] = make_episode(step * 100_000 + g, self.frames(step)[g],
                                               self.cfg, rng)  # fmt: skip
        return self.cache[step, g]

    def own(self, step: int, rank: int) -> list[int]:
        e = self.args.episodes_per_gpu
        return list(range(rank * e, (rank + 1) * e))


def pooled_packs(args: Any, cfg: DiTConfig, eps: Episodes, step: int, rank: int,
                 budget: int) -> list[list[int]]:  # fmt: skip
    """This rank's packs (global episode indices) from the distributed sampler over ALL the
    step's episodes: 16 per GPU on average, the fewest packs of ``budget``, the same count on
    every rank, ranks balanced by tokens."""
    lengths = [f * cfg.tokens_per_frame for f in eps.frames(step)]
    sampler = PackedBatchSampler(lengths, budget, num_replicas=eps.world, rank=rank,
                                 shuffle=False)  # fmt: skip
    return [list(p) for p in sampler]


def rank_packs(args: Any, cfg: DiTConfig, step: int, rank: int, world: int,
               budget: int, packs: int | None = None) -> list[list[int]]:  # fmt: skip
    """This rank's own episodes (global indices) in exactly ``packs`` packs (the sweep)."""
    import numpy as np

    tpf = cfg.tokens_per_frame
    per_rank = [[f * tpf for f in fr] for fr in step_lengths(args, step, world)]
    plans = [plan_packs(lengths, budget).packs for lengths in per_rank]
    m = packs or max(len(p) for p in plans)
    if any(len(p) > m for p in plans):
        raise ValueError(f"--sweep {m}: the episodes need {max(map(len, plans))} packs of {budget}")
    base = rank * args.episodes_per_gpu
    mine = equalise_packs(plans[rank], np.asarray(per_rank[rank]), m)
    return [[base + i for i in p] for p in mine]


def sweep_budget(args: Any, cfg: DiTConfig, m: int, world: int, steps: int) -> int:
    """Smallest budget (multiple of 1024) under which every step's episodes fit M packs."""
    tpf = cfg.tokens_per_frame
    need = 0
    for s in range(steps):
        for fr in step_lengths(args, s, world):
            need = max(need, -(-sum(fr) * tpf // m), max(fr) * tpf)
    quantum = 128 if args.smoke else 1024
    budget = -(-need // quantum) * quantum
    while any(len(plan_packs([f * tpf for f in fr], budget).packs) > m
              for s in range(steps) for fr in step_lengths(args, s, world)):  # fmt: skip
        budget += quantum
    return budget


def packed_collator(cfg: DiTConfig, budget: int, max_docs: int) -> PackedCollator:
    tpf = cfg.tokens_per_frame
    a_budget = -(-budget // tpf // 128) * 128
    c, (h, w) = cfg.latent_channels, cfg.latent_hw
    return PackedCollator(
        [Stream("latents", grid=cfg.grid, budget=budget, step_shape=(c, h, w)),
         Stream("action", budget=a_budget, step_shape=(cfg.action_dim,)),
         Stream("text", budget=max_docs * cfg.text_len)],
        max_docs=max_docs,
    )  # fmt: skip


# -- the model -----------------------------------------------------------------------------------
def build(args: Any, cfg: DiTConfig, dev: torch.device, kind: str, depth: int | None = None) -> Any:
    """Fresh model (same seed -> same weights on every rank and in every variant), sharded."""
    torch._dynamo.reset()  # each variant compiles from scratch: its compile time is its own
    unpacked = kind.startswith("unpacked") or kind in BASELINES
    attn = "auto" if dev.type != "cuda" else ("varlen" if unpacked else args.attention)
    mcfg = DiTConfig(**{**cfg.__dict__, "attention": attn,
                        "depth": depth or cfg.depth})  # fmt: skip
    torch.manual_seed(args.seed)
    with torch.device(dev):  # a 5B model initialised on the CPU takes minutes
        model = DiT(mcfg)
    pm.packed_attention = sdpa_one_episode if unpacked else _LIB_ATTENTION
    shard_model(model, MESH.get("mesh"), checkpointing=variant_checkpointing(kind, args),
                checkpoint_blocks=checkpoint_count(kind), compile=not args.no_compile,
                dynamic=unpacked,
                compile_options={"backend": args.compile_backend},
                param_dtype=torch.bfloat16 if dev.type == "cuda" else None)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    if kind in BASELINES:
        _route_through_baselines(model)
    return model, opt, mcfg


def _route_through_baselines(model: Any) -> None:
    """Make the sharded model run `benchmarks/step/baselines.py`'s forward: each inner Block's
    ``forward`` becomes `bl.block_forward` (so FSDP's per-block hooks, the checkpoint wrapper
    and the compiled wrapper still run around it), the baseline losses call the wrapped
    blocks, and ``model(...)`` (the root's hooks: embeddings and head gathered) runs the loss
    function given as its first argument."""
    import types

    for layer in model.blocks:
        inner = layer
        while not isinstance(inner, pm.Block):  # through _orig_mod / _checkpoint_wrapped_module
            inner = next(inner.children())
        inner.forward = types.MethodType(bl.block_forward, inner)
    bl.block_fn = lambda layer, *args: layer(*args)
    model.forward = lambda loss_fn, *args: loss_fn(model, *args)


def accumulate(net: Any, last: bool, keep_unsharded: bool) -> None:
    """Before a micro-step: reduce-scatter only on the ``last`` one; with ``keep_unsharded``
    the parameters also stay gathered between the accumulation micro-steps (no reshard after
    forward, none after backward until the last), so a baseline does not all-gather every
    block again each micro-step (FSDP2's default), at the memory of one unsharded copy."""
    net.set_requires_gradient_sync(last)
    if keep_unsharded:
        net.set_reshard_after_forward(False)
        net.set_reshard_after_backward(last)


def train_step(model: Any, opt: Any, mbs: list[PackedBatch], step: int, dev: torch.device,
               sync_every: bool, keep_unsharded: bool = False) -> torch.Tensor:  # fmt: skip
    """One optimizer step over this rank's micro-batches; the global loss stays on device."""
    norms = {s: LossNormalizer.for_step([b.layout(s) for b in mbs], "token", device=dev)
             for s in ("latents", "action")}  # fmt: skip
    total = torch.zeros((), device=dev, dtype=torch.float32)
    for i, mb in enumerate(mbs):
        if sync_every:
            model.set_requires_gradient_sync(True)
        else:
            accumulate(model, i == len(mbs) - 1, keep_unsharded and len(mbs) > 1)
        batch = to_device(mb, dev)
        batch.extras["seed"], batch.extras["step"] = 0, step
        out = model(batch)
        loss = sum(norms[s](out[s], batch.token_layout(s, out[s].shape[0], "loss", fix=""))
                   for s in ("latents", "action"))  # fmt: skip
        loss.backward()  # type: ignore[union-attr]
        total += loss.detach().float() / norms["latents"].grad_scale  # type: ignore[union-attr]
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


# -- measurement helpers ----------------------------------------------------------------------
class Clock:
    """Step time and the end-of-step wait: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, dev: torch.device) -> None:
        self.cuda = dev.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    @staticmethod
    def ms(a: Any, b: Any) -> float:
        return a.elapsed_time(b) if isinstance(a, torch.cuda.Event) else (b - a) * 1e3


def count_syncs(model: Any, opt: Any, mb: PackedBatch, step: int, dev: torch.device) -> int:
    """Host-device synchronisations in one micro-step's forward + backward (FSDP hooks,
    checkpoint recompute and the loss included), counted by torch's sync debug mode."""
    import warnings

    model.set_requires_gradient_sync(False)
    batch = to_device(mb, dev)
    batch.extras["seed"], batch.extras["step"] = 0, step
    norms = {s: LossNormalizer.for_step([mb.layout(s)], "token", device=dev)
             for s in ("latents", "action")}  # fmt: skip
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = model(batch)
            loss = sum(norms[s](out[s], batch.token_layout(s, out[s].shape[0], "loss", fix=""))
                       for s in ("latents", "action"))  # fmt: skip
            loss.backward()  # type: ignore[union-attr]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    opt.zero_grad(set_to_none=True)
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    if syncs and dist.get_rank() == 0:
        print(f"host syncs in a micro-step: {len(syncs)}, first: {syncs[0].message}", flush=True)
    return len(syncs)


def start_timing(dev: torch.device) -> int:
    """After the warm-up: peak memory from here, and the graph count recompiles are taken
    against."""
    harness.sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    return int(harness.dynamo_counters()["unique_graphs"])


def end_of_step(
    clock: Clock, dev: torch.device, s: int, warmup: int, t0: float, start: Any, marks: list
) -> float | None:
    """Mark step ``s``'s end and its wait at the end-of-step barrier; a timed step's
    (start, done, after-barrier) marks go to ``marks``. Returns the first step's seconds
    (compile included) at ``s == 0``, else None."""
    done = clock.mark()
    barrier_on(dev)
    after = clock.mark()
    if s >= warmup:
        marks.append((start, done, after))
        return None
    harness.sync(dev)
    return time.perf_counter() - t0 if s == 0 else None


def timing_summary(dev: torch.device, marks: list, g0: int) -> tuple[int, list[float], list[float]]:
    """(graphs compiled since the warm-up, step ms, barrier-wait ms) of the timed steps."""
    harness.sync(dev)
    recompiles = harness.dynamo_counters()["unique_graphs"] - g0
    step_ms = [Clock.ms(a, c) for a, _, c in marks]
    wait_ms = [Clock.ms(b, c) for _, b, c in marks]
    return recompiles, step_ms, wait_ms


def barrier_on(dev: torch.device) -> None:
    """A barrier that runs on the GPU stream (an all-reduce of one element)."""
    dist.all_reduce(torch.zeros(1, device=dev))


def union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total / 1e3  # us -> ms


def _kernel_intervals(prof: Any) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every GPU kernel/memcpy the profiler saw."""
    out = []
    try:  # the raw kineto events: no FunctionEvent tree to build for ~10^5 kernels
        for ev in prof.profiler.kineto_results.events():
            if ev.device_type() == torch.autograd.DeviceType.CUDA:
                start = ev.start_ns() / 1e3
                out.append((ev.name(), start, start + ev.duration_ns() / 1e3))
    except AttributeError:
        out = []
    if not out:
        for fe in prof.events():
            if fe.device_type == torch.autograd.DeviceType.CUDA:
                out.append((fe.name, float(fe.time_range.start), float(fe.time_range.end)))
    return out


def exposed_comm(prof: Any) -> dict[str, float]:
    """GPU ms of compute kernels, of NCCL kernels, and of NCCL with no compute under it
    (transfers not hidden behind compute, plus the time a rank's NCCL kernel waits for the
    other rank to arrive)."""
    comm, comp = [], []
    for name, a, b in _kernel_intervals(prof):
        (comm if "nccl" in name.lower() else comp).append((a, b))
    if not comm and not comp:
        raise RuntimeError("the profiler recorded no GPU kernel")
    c_ms, k_ms = union_ms(comm), union_ms(comp)
    both = union_ms(comm + comp)
    return {"compute_ms": k_ms, "comm_ms": c_ms, "exposed_comm_ms": both - k_ms,
            "kernels": float(len(comm) + len(comp))}  # fmt: skip


def gather_floats(x: dict[str, float], dev: torch.device) -> list[dict[str, float]]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def variant_checkpointing(kind: str, args: Any) -> str:
    """``packed_ops`` -> selective per-op checkpointing ("ops"), ``packed_attn`` (also after a
    budget, ``packed_b131072_attn``) -> attention outputs kept ("attention"); else
    ``--checkpointing``."""
    if kind.endswith("_ops"):
        return "ops"
    return "attention" if kind.endswith("_attn") else args.checkpointing


def checkpoint_count(kind: str) -> int | None:
    """``packed_ac20`` -> 20 blocks checkpointed (the rest keep their activations); None: all."""
    m = re.search(r"_ac(\d+)", kind)
    return int(m.group(1)) if m else None


def max_docs(args: Any, cfg: DiTConfig, budget: int, world: int) -> int:
    """Static shapes: the most episodes a pack can hold (each >= the regime's shortest)."""
    lo_frames = 2 if args.smoke else REGIMES[args.regime][0]
    return min(world * args.episodes_per_gpu, max(1, budget // (lo_frames * cfg.tokens_per_frame)))


def variant_budget(kind: str, args: Any) -> int:
    """``packed_b131072`` -> packs of 131,072 tokens; else ``--pack-budget``."""
    m = re.search(r"_b(\d+)", kind)
    return int(m.group(1)) if m else args.pack_budget


def recompute_flops(cfg: DiTConfig, eps: list[dict], checkpointing: str,
                    blocks: int | None = None) -> float:  # fmt: skip
    """FLOPs the checkpointing recompute adds: one more forward of each checkpointed block,
    its dense part only for 'attention' (the attention outputs are kept); 0 for 'none' and
    'ops'."""
    if checkpointing not in ("full", "attention"):
        return 0.0
    again = dit_flops(cfg, [episode_shape(cfg, ep) for ep in eps], backward=False,
                      blocks=cfg.depth if blocks is None else blocks, outside_blocks=False)  # fmt: skip
    return again.model if checkpointing == "full" else again.dense


# -- one variant -------------------------------------------------------------------------------
def run_variant(kind: str, args: Any, cfg: DiTConfig, dev: torch.device, data: Episodes,
                sweep_m: int | None = None) -> dict[str, Any]:  # fmt: skip
    rank, world = dist.get_rank(), dist.get_world_size()
    t_build = time.perf_counter()
    model, opt, mcfg = build(args, cfg, dev, kind)
    build_s = time.perf_counter() - t_build
    if kind in BASELINES:
        return run_baseline(kind, args, model, opt, mcfg, dev, data, build_s)
    unpacked = kind.startswith("unpacked")
    sync_every = kind == "unpacked_sync" or sweep_m is not None
    keep = args.keep_unsharded and kind == "unpacked_nosync"  # packed: its own default
    n_steps = args.warmup + args.steps
    if unpacked:
        col = PackedCollator([*mcfg.streams(), Stream("text")], pad_to_multiple=1)
        groups = [[[g] for g in data.own(s, rank)] for s in range(n_steps)]
        budget = None
    else:
        budget = (sweep_budget(args, cfg, sweep_m, world, n_steps) if sweep_m
                  else variant_budget(kind, args))  # fmt: skip
        col = packed_collator(mcfg, budget, max_docs(args, cfg, budget, world))
        groups = [rank_packs(args, cfg, s, rank, world, budget, sweep_m) if sweep_m
                  else pooled_packs(args, cfg, data, s, rank, budget)
                  for s in range(n_steps)]  # fmt: skip
    plans = [[col([data.get(s, g) for g in p]) for p in groups[s]] for s in range(n_steps)]
    trained = [[data.get(s, g) for p in groups[s] for g in p] for s in range(n_steps)]
    clock = Clock(dev)
    marks, losses, first_s = [], [], 0.0
    g0 = 0
    for s in range(n_steps):
        if s == args.warmup:
            g0 = start_timing(dev)
        t0 = time.perf_counter()
        a = clock.mark()
        losses.append(train_step(model, opt, plans[s], s, dev, sync_every, keep))
        first_s = end_of_step(clock, dev, s, args.warmup, t0, a, marks) or first_s
    recompiles, step_ms, wait_ms = timing_summary(dev, marks, g0)
    peak = torch.cuda.max_memory_allocated() / 1e9 if dev.type == "cuda" else 0.0
    prof_row: dict[str, float] = {}
    if dev.type == "cuda" and sweep_m is None:
        try:
            prof_row["host_syncs"] = float(count_syncs(model, opt, plans[-1][0], n_steps, dev))
        except Exception as e:  # a reporting failure must not cost the variant's row
            print(f"rank {rank}: host syncs not counted: {e!r}", flush=True)
    if dev.type == "cuda" and sweep_m is None and kind in args.profile.split(","):
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            train_step(model, opt, plans[-1], n_steps, dev, sync_every, keep)
            barrier_on(dev)
            harness.sync(dev)
        try:
            prof_row.update(exposed_comm(prof))  # keeps the host-sync count above
        except Exception as e:  # a reporting failure must not cost the variant's row
            print(f"rank {rank}: exposed communication not measured: {e!r}", flush=True)
        del prof
    step_losses = torch.stack(losses)
    dist.all_reduce(step_losses)  # each rank holds its share of the step's global mean
    loss_vals = [float(x) for x in step_losses.tolist()]
    tpf = mcfg.tokens_per_frame
    timed = trained[args.warmup :]
    mine = {
        "step_ms": statistics.median(step_ms) if step_ms else float("nan"),
        "wait_ms": statistics.median(wait_ms) if wait_ms else float("nan"),
        "peak_gb": peak,
        "first_step_s": first_s,
        "tokens": float(
            sum(e["latents"].shape[0] * tpf + e["action"].shape[0] for eps in timed for e in eps)
        ),
        "flops": sum(step_flops(mcfg, eps).model for eps in timed),
        "recompute_flops": sum(
            recompute_flops(mcfg, eps, variant_checkpointing(kind, args), checkpoint_count(kind))
            for eps in timed
        ),
        "micro_steps": sum(len(p) for p in plans[args.warmup :]) / max(len(timed), 1),
        **prof_row,
    }
    ranks = gather_floats(mine, dev)
    del model, opt
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    pm.packed_attention = _LIB_ATTENTION
    shared = shared_fields(ranks, args.steps, first_s, build_s)
    rflops = sum(r["recompute_flops"] for r in ranks) / max(args.steps, 1)
    row = {
        "variant": kind if sweep_m is None else f"packed M={sweep_m}",
        "attention": "sdpa default dispatch (per episode)"
        if unpacked
        else attention_name(mcfg, dev),
        "reshard every micro-step": unpacked and not keep,
        "budget": budget,
        **shared,
        **mfu(ranks, args.steps, shared["s/step"], world),
        **mfu(ranks, args.steps, shared["s/step"], world, extra=rflops, label=" incl. recompute"),
        "exposed comm ms (per rank)": [
            round(r.get("exposed_comm_ms", float("nan")), 1) for r in ranks
        ],
        "comm ms (per rank)": [round(r.get("comm_ms", float("nan")), 1) for r in ranks],
        "recompiles after warm-up": recompiles,
        "host syncs per micro-step": ranks[0].get("host_syncs"),
        "losses": loss_vals,
    }
    return row


def shared_fields(ranks: list[dict[str, float]], steps: int, first_s: float,
                  build_s: float) -> dict[str, Any]:  # fmt: skip
    """The row fields of every variant, from the ranks' gathered figures: a step takes as long
    as its slowest rank, tokens are summed over the ranks."""
    step_s = max(r["step_ms"] for r in ranks) / 1e3
    return {
        "micro-steps": ranks[0]["micro_steps"],
        "s/step": step_s,
        "tokens/s": sum(r["tokens"] for r in ranks) / max(steps, 1) / step_s,
        "first step s": first_s,
        "compile s (est.)": first_s - step_s,
        "build+shard s": build_s,
        "peak GB": max(r["peak_gb"] for r in ranks),
        "wait ms (per rank)": [round(r["wait_ms"], 1) for r in ranks],
        "wait % of step": 100 * max(r["wait_ms"] for r in ranks) / 1e3 / step_s,
        "steps timed": steps,
        "ranks": ranks,
    }


def mfu(ranks: list[dict[str, float]], steps: int, step_s: float, world: int,
        extra: float = 0.0, scale: float = 1.0, label: str = "") -> dict[str, float]:  # fmt: skip
    """Model FLOPs per step (the ranks' sum, ``scale``d, plus ``extra``) over the GPUs' peak,
    one field per named peak (``MFU of measured 790``, ``MFU of datasheet 989``)."""
    flops = sum(r["flops"] for r in ranks) / max(steps, 1) * scale + extra
    return {f"MFU{label} of {name}": flops / step_s / (peak * 1e12 * world)
            for name, peak in PEAKS.items()}  # fmt: skip


def run_baseline(kind: str, args: Any, model: Any, opt: Any, cfg: DiTConfig, dev: torch.device,
                 data: Episodes, build_s: float) -> dict[str, Any]:  # fmt: skip
    """The lean per-episode loop (gradient sync on the last micro-step only) or length
    bucketing (one micro-step per bucket batch, sync on the last), over this rank's own
    episodes, through the sharded model (benchmarks/step/baselines.py, as in bench_step)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n_steps = args.warmup + args.steps
    tpf = cfg.tokens_per_frame + 1  # joint tokens a frame: video + one action
    lo, hi = REGIMES[args.regime] if not args.smoke else (2, 6)
    mode = "crop" if kind == "bucket_crop" else "pad"
    bounds = bl.bounds_for(mode, lo * tpf, hi * tpf, args.buckets, tpf)
    attn = {"bucket_flex": bl.flex_masked, "bucket_crop": backends.sdpa}.get(kind, bl.sdpa_masked)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # FSDP's param dtype
    steps, plans = [], []
    for s in range(n_steps):
        eps = [data.get(s, g) for g in data.own(s, rank)]
        inputs = bl.prepare_episodes(model, eps, s, dev)
        steps.append(inputs)
        if kind != "lean":
            mbs = bl.bucket_step(inputs, bounds, args.pack_budget, mode, cfg.text_len, dev)
            # every rank runs as many micro-steps (FSDP all-gathers in each one)
            n = torch.tensor([len(mbs)], device=dev)
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
            if int(n) > len(mbs):
                mbs = bl.bucket_step(inputs, bounds, args.pack_budget, mode, cfg.text_len, dev,
                                     min_batches=int(n))  # fmt: skip
            plans.append(mbs)

    def step_inputs(s: int) -> tuple[list[tuple], list[float], torch.Tensor, torch.Tensor]:
        """Step ``s``'s micro-batches (the loss function and its arguments), their weights and
        the step's denominators."""
        if kind == "lean":
            micro = [(bl.lean_episode_loss, x.xt_v.to(dtype), x.v_v, x.xt_a.to(dtype), x.v_a, x.t,
                      x.thw, x.text) for x in steps[s]]  # fmt: skip
        else:
            micro = []
            for mb in plans[s]:
                a = mb.args
                mask = (bl.key_padding_block_mask(mb.lengths_B, mb.L) if kind == "bucket_flex"
                        else (torch.arange(mb.L, device=dev)[None] < mb.lengths_B[:, None])[
                            :, None, None])  # fmt: skip
                micro.append((bl.bucket_batch_loss, a[0].to(dtype), a[1], a[2].to(dtype), *a[3:],
                              attn, mask, mb.weight))  # fmt: skip
        # one global denominator per stream (every rank's trained tokens), times W: FSDP
        # averages gradients over the ranks (packing.train.LossNormalizer does the same)
        weights = [1.0] * len(micro) if kind == "lean" else [m[-1] for m in micro]
        micro = micro if kind == "lean" else [m[:-1] for m in micro]
        local = torch.tensor([float(sum(m[1].shape[0] * w for m, w in zip(micro, weights, strict=True))),
                              float(sum(m[3].shape[0] * w for m, w in zip(micro, weights, strict=True)))],
                             device=dev)  # fmt: skip
        dist.all_reduce(local)
        return micro, weights, local[0] / world, local[1] / world

    def micro_steps(net: Any, micro: list[tuple], weights: list[float], dv: Any,
                    da: Any) -> torch.Tensor:  # fmt: skip
        total = torch.zeros((), device=dev)
        for i, m in enumerate(micro):
            accumulate(net, i == len(micro) - 1, args.keep_unsharded and len(micro) > 1)
            loss = net(*m, dv, da) * weights[i]
            loss.backward()
            total += loss.detach().float() / world
        return total

    if args.warm_pass:
        # dynamic shapes compile several graphs (batch-of-one, divisibility and range guards:
        # bench_step's H200 run met them in timed steps): every step's micro-batches once,
        # untimed, gradients dropped, no optimizer step
        for s in range(n_steps):
            micro_steps(model, *step_inputs(s))
            opt.zero_grad(set_to_none=True)
    clock = Clock(dev)
    marks, losses, first_s, g0 = [], [], 0.0, 0
    for s in range(n_steps):
        if s == args.warmup:
            g0 = start_timing(dev)
        micro, weights, dv, da = step_inputs(s)
        t0 = time.perf_counter()
        a0 = clock.mark()
        total = micro_steps(model, micro, weights, dv, da)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        first_s = end_of_step(clock, dev, s, args.warmup, t0, a0, marks) or first_s
    recompiles, step_ms, wait_ms = timing_summary(dev, marks, g0)
    step_losses = torch.stack(losses)
    dist.all_reduce(step_losses)
    trained = [[data.get(s, g) for g in data.own(s, rank)] for s in range(args.warmup, n_steps)]
    ran = sum(len(p) for p in plans[args.warmup :])  # weight-0 copies included: they ran
    flat = [b for p in plans[args.warmup :] for b in p if b.weight > 0]
    mine = {
        "step_ms": statistics.median(step_ms) if step_ms else float("nan"),
        "wait_ms": statistics.median(wait_ms) if wait_ms else float("nan"),
        "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if dev.type == "cuda" else 0.0,
        "tokens": float(sum(x.tokens for inputs in steps[args.warmup :] for x in inputs))
        if kind != "bucket_crop" else float(sum(b.real_tokens for b in flat)),
        "flops": sum(step_flops(cfg, eps).model for eps in trained),
        "micro_steps": (sum(len(x) for x in steps[args.warmup :]) if kind == "lean"
                        else ran) / max(args.steps, 1),
        "slots": float(sum(b.slots for b in flat)),
        "real": float(sum(b.real_tokens for b in flat)),
        "cropped": float(sum(b.cropped_tokens for b in flat)),
    }  # fmt: skip
    ranks = gather_floats(mine, dev)
    del model, opt
    bl.block_fn = bl.block_forward
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    shared = shared_fields(ranks, args.steps, first_s, build_s)
    # crop trains on fewer tokens than the episodes hold: scale the FLOPs to the kept
    kept = (
        1.0
        if kind != "bucket_crop"
        else sum(r["real"] for r in ranks) / max(sum(r["real"] + r["cropped"] for r in ranks), 1)
    )
    row: dict[str, Any] = {
        "variant": kind,
        "attention": bl.ATTENTION_NAMES[kind],
        "reshard every micro-step": not args.keep_unsharded,
        "budget": args.pack_budget if kind != "lean" else None,
        **shared,
        **mfu(ranks, args.steps, shared["s/step"], world, scale=kept),
        "recompiles after warm-up": recompiles,
        "losses": [float(x) for x in step_losses.tolist()],
    }  # fmt: skip
    if kind != "lean":
        slots = sum(r["slots"] for r in ranks)
        real = sum(r["real"] for r in ranks)
        cropped = sum(r["cropped"] for r in ranks)
        row["padding fraction"] = 1 - real / max(slots, 1)
        row["cropped fraction"] = cropped / max(real + cropped, 1)
        row["buckets"] = bounds
    return row


def attention_name(cfg: DiTConfig, dev: torch.device) -> str:
    from packing.data import layout_from_lengths

    lay = layout_from_lengths([256], [256], 256)
    try:
        return pm.prepare_attention(lay, None, None, cfg.attention, device=dev,
                                    dtype=torch.bfloat16, head_dim=cfg.head_dim).backend  # fmt: skip
    except Exception as e:  # recorded, never hidden
        return f"? {type(e).__name__}: {e}"[:80]


# -- recompiles over many packs at small depth ---------------------------------------------
def recompile_check(args: Any, cfg: DiTConfig, dev: torch.device) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, mcfg = build(args, cfg, dev, "packed", depth=args.recompile_depth)
    col = packed_collator(mcfg, args.pack_budget, args.episodes_per_gpu)
    t0 = time.perf_counter()
    g0 = None
    for s in range(args.recompile_packs + 1):
        lo, hi = REGIMES[args.regime] if not args.smoke else (2, 6)
        prng = random.Random(args.seed * 31 + s * world + rank)
        eps, tok = [], 0
        rng = torch.Generator().manual_seed(s * world + rank)
        while len(eps) < args.episodes_per_gpu:
            f = prng.randint(lo, hi)
            if tok + f * mcfg.tokens_per_frame > args.pack_budget:
                break
            eps.append(make_episode(len(eps) + 1000 * (s * world + rank), f, mcfg, rng))
            tok += f * mcfg.tokens_per_frame
        train_step(model, opt, [col(eps)], s, dev, False)
        if g0 is None:
            harness.sync(dev)
            g0 = harness.dynamo_counters()["unique_graphs"]
    harness.sync(dev)
    n = harness.dynamo_counters()["unique_graphs"] - (g0 or 0)
    del model, opt
    pm.packed_attention = _LIB_ATTENTION
    return {"recompile check": f"{args.recompile_packs} random packs at depth "
            f"{args.recompile_depth}, budget {args.pack_budget}",
            "graphs compiled after the first pack": n, "seconds": time.perf_counter() - t0}  # fmt: skip


COLUMNS = ["variant", "attention", "micro-steps", "budget", "s/step", "tokens/s",
           "vs unpacked_sync", "vs best unpacked", "vs lean", "vs best bucketing", "MFU of measured 790",
           "padding fraction", "cropped fraction", "MFU incl. recompute of measured 790", "first step s",
           "compile s (est.)", "peak GB", "wait % of step", "exposed comm ms (per rank)",
           "loss rel diff (step 0)", "loss rel diff (max)", "recompiles after warm-up",
           "host syncs per micro-step", "seconds", "error"]  # fmt: skip


# -- main ------------------------------------------------------------------------------------
def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--regime", default="seed", choices=sorted(REGIMES))
    p.add_argument("--depth", type=int, default=30)
    p.add_argument("--episodes-per-gpu", type=int, default=16)
    p.add_argument("--pack-budget", type=int, default=None, help="tokens (default per regime)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--buckets", type=int, default=4, help="length buckets of bucket_*")
    p.add_argument(
        "--keep-unsharded",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="accumulating baselines (unpacked_nosync, lean, bucket_*) keep the "
        "parameters gathered between micro-steps (reshard_after_forward=False)",
    )
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--warm-pass", action=argparse.BooleanOptionalAction, default=True,
                   help="baselines: every micro-batch once before the steps, untimed, so no "
                   "dynamic-shape compile lands in a timed step (--no-warm-pass: skip)")  # fmt: skip
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per variant")
    p.add_argument("--checkpointing", default="full",
                   choices=["full", "ops", "attention", "none"])  # fmt: skip
    p.add_argument("--attention", default="auto", help="packed variants' backend")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend (aot_eager: a CPU check of the traced path)",
    )
    p.add_argument(
        "--profile",
        default="packed,unpacked_sync",
        help="variants that get one extra profiled step (exposed communication)",
    )
    p.add_argument("--recompile-packs", type=int, default=0)
    p.add_argument("--recompile-depth", type=int, default=2)
    p.add_argument("--sweep", default="", help="micro-step counts, e.g. 1,2,4,8")
    p.add_argument(
        "--time-limit",
        type=float,
        default=400.0,
        help="seconds: a variant starts only if the last one's time is left",
    )
    p.add_argument(
        "--hard-limit",
        type=float,
        default=470.0,
        help="seconds: print and save what finished, then exit 124 (a stuck compile)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU with gloo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="directory for the JSON")
    return p.parse_args()


def main() -> None:
    args = parse()
    t_start = time.perf_counter()
    cuda = torch.cuda.is_available() and not args.smoke
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    from torch.distributed.device_mesh import init_device_mesh

    MESH["mesh"] = init_device_mesh(dev.type, (world,))
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 4096
    if args.smoke:
        cfg = DiTConfig.tiny(depth=2)
        args.episodes_per_gpu = min(args.episodes_per_gpu, 4)
        args.pack_budget = args.pack_budget or 512
        if args.compile_backend == "inductor":
            args.no_compile = True  # inductor on a 2-core CPU takes minutes; the GPU compiles
    else:
        cfg = DiTConfig.wan_2_2_5b(depth=args.depth)
        args.pack_budget = args.pack_budget or DEFAULT_BUDGET[args.regime]
    data = Episodes(args, cfg, world)
    rows: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_fsdp_{args.regime}{'_smoke' if args.smoke else ''}.json"

    def say(msg: str) -> None:
        if rank == 0:
            print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)

    def time_left() -> float:  # the same on every rank: the slowest rank's view
        t = torch.tensor([time.perf_counter() - t_start], dtype=torch.float64)
        t = t.to(dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return args.time_limit - float(t)

    def save(partial: bool) -> None:
        if rank == 0:
            ns = argparse.Namespace(**{**vars(args), "out": str(path), "quick": args.smoke})
            harness.write_json("fsdp", ns, {"rows": rows, "world_size": world, **extra,
                                           "model": cfg.__dict__}, device=dev,
                              partial=partial)  # fmt: skip

    def abort() -> None:  # a watchdog thread: a stuck compile must not eat the device call
        say(f"hard limit {args.hard_limit:.0f} s reached: saving the rows that finished")
        if rank == 0:
            print(harness.markdown_table(rows, COLUMNS), flush=True)
        extra["aborted"] = f"hard limit {args.hard_limit} s"
        save(partial=True)
        os._exit(124)

    watchdog = threading.Timer(args.hard_limit, abort)
    watchdog.daemon = True
    watchdog.start()
    say(f"{world} ranks, {dev.type}, regime {args.regime}, depth {cfg.depth}, budget "
        f"{args.pack_budget}, {args.episodes_per_gpu} episodes per GPU per step")  # fmt: skip
    names = [v for v in args.variants.split(",") if v]
    if bad := [v for v in names if not VARIANT_NAME.fullmatch(v)]:
        raise SystemExit(f"--variants: unknown {bad}; see the variants at the top of this file")
    jobs: list[tuple[str, int | None]] = [(v, None) for v in names]
    jobs += [("packed", int(m)) for m in args.sweep.split(",") if m]
    last_cost = 0.0
    for kind, m in jobs:
        left = time_left()
        if left < last_cost:
            rows.append(
                {
                    "variant": kind if m is None else f"packed M={m}",
                    "error": f"skipped: {left:.0f} s left < last variant's {last_cost:.0f} s",
                }
            )
            say(rows[-1]["error"])
            continue
        t0 = time.perf_counter()
        try:
            row = run_variant(kind, args, cfg, dev, data, sweep_m=m)
        except Exception as e:
            # Recorded and the run goes on (an error both ranks hit: a compile failure, or an
            # OOM, the ranks having the same shapes); one rank alone would leave the other in
            # a collective: the watchdog ends that, keeping the rows saved so far.
            import traceback

            traceback.print_exc()
            row = {"variant": kind if m is None else f"packed M={m}",
                   "error": f"{type(e).__name__}: {str(e)[:300]}"}  # fmt: skip
            pm.packed_attention = _LIB_ATTENTION
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        last_cost = time.perf_counter() - t0
        row["seconds"] = last_cost
        rows.append(row)
        say({k: v for k, v in row.items() if k not in ("ranks", "losses")})
        save(partial=True)
    if args.recompile_packs:
        if time_left() > 90 or args.smoke:
            extra["recompiles"] = recompile_check(args, cfg, dev)
        else:
            extra["recompiles"] = "skipped: time limit"
        say(extra["recompiles"])
    base = next((r for r in rows if r.get("variant") == "unpacked_sync" and "losses" in r), None)
    # losses against an unpacked row of this run (the sync setting does not change them)
    ref = base or next((r for r in rows if str(r.get("variant")).startswith("unpacked")
                        and "losses" in r), None)  # fmt: skip
    for r in rows:
        if ref and "losses" in r and len(r["losses"]) == len(ref["losses"]):
            r["loss rel diff (step 0)"] = abs(r["losses"][0] - ref["losses"][0]) / abs(
                ref["losses"][0]
            )
            r["loss rel diff (max)"] = max(abs(x - y) / abs(y)
                                           for x, y in zip(r["losses"], ref["losses"], strict=True))  # fmt: skip
        if base and "tokens/s" in r:
            r["vs unpacked_sync"] = r["tokens/s"] / base["tokens/s"]
    best_u = max((r["tokens/s"] for r in rows if str(r.get("variant")).startswith("unpacked")
                  and "tokens/s" in r), default=None)  # fmt: skip
    lean = next((r["tokens/s"] for r in rows if r.get("variant") == "lean" and "tokens/s" in r),
                None)  # fmt: skip
    best_b = max((r["tokens/s"] for r in rows if str(r.get("variant")).startswith("bucket")
                  and "tokens/s" in r), default=None)  # fmt: skip
    for r in rows:
        if best_u and "tokens/s" in r:
            r["vs best unpacked"] = r["tokens/s"] / best_u
        if lean and "tokens/s" in r:
            r["vs lean"] = r["tokens/s"] / lean
        if best_b and "tokens/s" in r:
            r["vs best bucketing"] = r["tokens/s"] / best_b
    extra["total_seconds"] = time.perf_counter() - t_start
    watchdog.cancel()
    if rank == 0:
        print(harness.markdown_table(rows, COLUMNS))
    save(partial=False)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
