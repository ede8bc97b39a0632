"""`packing verify --nproc W`: packed on W ranks under FSDP2 against unpacked on one process.

Each optimizer step trains the same episodes two ways, from the same initial weights::

    packed     W ranks, FSDP2 (packing.train._fsdp.shard_model: per-block checkpointing), packs from
               the distributed sampler (packing.planning._sampler), the step's normaliser summed over
               every rank and micro-step (LossNormalizer.for_step: one all_reduce)
               rank 0:  [e3 e0 ....] [e5 ..]     rank 1:  [e1 e4 e2] [e6 ...]
    unpacked   rank 0 alone, a plain copy of the model, one episode per micro-step:
               [e0] [e1] [e2] [e3] [e4] [e5] [e6]  -> the single-process ground truth

After every step every gradient is gathered whole (``DTensor.full_tensor``) and compared on
rank 0 with the unpacked one; after the last step the parameters; then the leak check runs
on a plain copy holding the packed run's trained weights, on a pack of >= 2 episodes. The
gates are `packing.verify._harness`'s (fp32: loss 1e-6, gradients and parameters 1e-5; bf16: loss
5e-3, gradient cosine >= 0.999), so the run fails when

- the document mask is removed                    (``--no-document-mask``: the leak check);
- the normaliser ignores the other ranks          (``--loss-normaliser per-rank``: each
  rank's own mean, then FSDP's average over ranks -- wrong when ranks hold different counts);
- noise and timesteps depend on the rank          (``--noise-key rank``: the RNG seed mixes
  in the rank, as ``torch.manual_seed(seed + rank)`` does, instead of only the episode).

Launch: ``packing verify --nproc 2`` spawns W processes (gloo on CPU, NCCL on CUDA with
``cuda:rank``), or run ``torchrun --nproc-per-node 2 -m packing verify`` (the ranks come from
the environment). bf16 (``--dtype bfloat16``) trains the packed run as users do (FSDP
parameters in bf16, reduction in fp32) against the unpacked run under bf16 autocast.
"""

from __future__ import annotations

import copy
import math
import os
import pickle
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from packing.data._layout import PackedBatch
from packing.data._layout_math import round_up
from packing.train._losses import LossNormalizer, local_denominator
from packing.verify._command import (
    DEFAULT_MODEL,
    VerifyConfig,
    default_token_budget,
    model_and_episodes,
)
from packing.verify._harness import _environment, _leak_check, _loss_mask, _sync, _with_step
from packing.verify._report import (
    StepComparison,
    Tolerances,
    VerifyReport,
    both_diverged_at,
    grad_badness,
    judge,
    nonfinite_tensors,
    parameter_difference,
    params_diverged,
    record_grad_diffs,
)

__all__ = ["launched_by_torchrun", "run_verify_distributed", "verify_rank"]

_RANK_SALT = 7919  # --noise-key rank: seed -> seed + 7919 * (rank + 1)


def launched_by_torchrun() -> bool:
    """True inside a process started by torchrun with more than one rank."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _check(config: VerifyConfig) -> None:
    if config.reference is not None:
        raise ValueError(
            f"--reference {config.reference} is single-process: the distributed run's unpacked "
            "side is a plain copy of the model on rank 0 (its leak check runs the packed "
            "model's weights in that copy); drop --nproc, or drop --reference"
        )
    if config.loss_normaliser == "per-micro-step":
        raise ValueError(
            "--loss-normaliser per-micro-step is the single-process ablation; across "
            "processes the planted mistake is --loss-normaliser per-rank"
        )


def run_verify_distributed(
    config: VerifyConfig, progress: Callable[[str], None] | None = None
) -> VerifyReport:
    """Spawn ``config.nproc`` ranks on this machine; returns rank 0's report."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    _check(config)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
        try:
            mp.start_processes(
                _spawned, args=(config, env, str(out)), nprocs=config.nproc, start_method="spawn"
            )
        except ProcessException as e:
            raise _rank_error(Path(tmp), e) from None
        with open(out, "rb") as f:
            return pickle.load(f)  # type: ignore[no-any-return]


def _spawned(rank: int, config: VerifyConfig, env: dict[str, str], out: str) -> None:
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(config.nproc))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        report = verify_rank(config, progress=_rank0_printer(rank))
    except Exception as e:  # the parent re-raises it: the CLI's exit contract sees the error
        _save_error(Path(out).parent / f"error.{rank}", e)
        raise
    if report is not None:
        with open(out, "wb") as f:
            pickle.dump(report, f)


def _save_error(path: Path, e: Exception) -> None:
    try:
        data = pickle.dumps(e)
        pickle.loads(data)  # an exception whose __init__ takes other arguments fails here
    except Exception:
        data = pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}"))
    path.write_bytes(data)


def _rank_error(tmp: Path, e: Exception) -> Exception:
    """The first failing rank's own exception (the spawned rank saved it), else ``e``.

    A rank that raised saved its error; the launcher then ended the other ranks. The lowest
    rank that saved one is what the user sees (``packing verify: error: ...``, exit 2).
    """
    saved = sorted(tmp.glob("error.*"), key=lambda p: int(p.suffix[1:]))
    if not saved:
        return RuntimeError(f"a verify rank ended without a report: {str(e).strip()}")
    error = pickle.loads(saved[0].read_bytes())
    return error if isinstance(error, Exception) else e


def _rank0_printer(rank: int) -> Callable[[str], None] | None:
    if rank:
        return None
    import sys

    return lambda line: print(f"  .. {line}", file=sys.stderr, flush=True)


# -- one rank --------------------------------------------------------------------------------------
def _init(config: VerifyConfig) -> torch.device:
    if not dist.is_initialized():
        backend = "nccl" if config.device.startswith("cuda") else "gloo"
        dist.init_process_group(backend)
    rank = dist.get_rank()
    if config.device.startswith("cuda"):
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        return dev
    return torch.device(config.device)


def verify_rank(
    config: VerifyConfig, progress: Callable[[str], None] | None = None
) -> VerifyReport | None:
    """The distributed verify in this process (one rank); rank 0 returns the report."""
    _check(config)
    dev = _init(config)
    # On an error, no barrier: another rank may sit in a collective, and this process
    # exiting is what lets the launcher (torchrun, or the spawning parent) end the others.
    report = _verify(config, dev, progress or (lambda _line: None))
    dist.barrier()
    dist.destroy_process_group()
    return report


def _packs_by_rank(lengths: list[int], budget: int, seed: int, world: int) -> list[list[list[int]]]:
    """Every rank's packs for one epoch of the distributed sampler (same on every rank)."""
    from packing.planning._sampler import PackedBatchSampler

    out = []
    for r in range(world):
        s = PackedBatchSampler(lengths, budget, seed=seed, num_replicas=world, rank=r)
        s.set_epoch(0)
        out.append([list(p) for p in s])
    return out


def _normaliser(
    config: VerifyConfig, batches: Sequence[PackedBatch], model: nn.Module, dev: torch.device
) -> dict[str, LossNormalizer]:
    """The packed run's normaliser per stream; ``per-rank`` is the mistake under test."""
    norms = {}
    for s in batches[0].layouts:
        lays = [b.layout(s) for b in batches]
        masks = [_loss_mask(model, b, s) for b in batches]
        if config.loss_normaliser == "per-rank":  # this rank's own mean; FSDP then averages
            d = local_denominator(lays, config.reduction, masks, device=dev)  # type: ignore[arg-type]
            norms[s] = LossNormalizer(reduction=config.reduction, denominator=d)  # type: ignore[arg-type]
        else:
            norms[s] = LossNormalizer.for_step(lays, config.reduction, masks, device=dev)  # type: ignore[arg-type]
    return norms


def _packed_step(
    model: nn.Module,
    batches: Sequence[PackedBatch],
    config: VerifyConfig,
    dev: torch.device,
    autocast: torch.dtype | None,
) -> float:
    """One packed optimizer step's forward/backward on this rank; returns the global loss.

    Gradients are reduced once, on the last micro-step (``set_requires_gradient_sync``).
    """
    norms = _normaliser(config, batches, model, dev)
    total = torch.zeros((), dtype=torch.float64, device=dev)
    for i, b in enumerate(batches):
        model.set_requires_gradient_sync(i == len(batches) - 1)  # type: ignore[operator]
        with torch.autocast(dev.type, dtype=autocast, enabled=autocast is not None):
            out = model(b)
        loss = torch.zeros((), dtype=torch.float32, device=dev)
        for k, v in out.items():
            lay = b.token_layout(
                k, v.shape[0], f"the model's loss {k!r}", fix="key losses by stream"
            )
            loss = loss + norms[k](v, lay, _loss_mask(model, b, k))
        loss.backward()
        total += loss.detach().double()
    dist.all_reduce(total)  # FSDP averages gradients: the loss they descend is the mean
    return float(total) / dist.get_world_size()


def _unpacked_step(
    model: nn.Module,
    batches: Sequence[PackedBatch],
    config: VerifyConfig,
    dev: torch.device,
    autocast: torch.dtype | None,
) -> float:
    """The ground truth: one episode per micro-step, this process alone (no collective)."""
    norms = {}
    for s in batches[0].layouts:
        lays = [b.layout(s) for b in batches]
        masks = [_loss_mask(model, b, s) for b in batches]
        d = local_denominator(lays, config.reduction, masks, device=dev)  # type: ignore[arg-type]
        norms[s] = LossNormalizer(reduction=config.reduction, denominator=d)  # type: ignore[arg-type]
    total = 0.0
    for b in batches:
        with torch.autocast(dev.type, dtype=autocast, enabled=autocast is not None):
            out = model(b)
        loss = sum(
            norms[k](
                v, b.token_layout(k, v.shape[0], f"loss {k!r}", fix=""), _loss_mask(model, b, k)
            )
            for k, v in out.items()
        )
        loss.backward()  # type: ignore[union-attr]
        total += float(loss)
    return total


def _verify(
    config: VerifyConfig, dev: torch.device, say: Callable[[str], None]
) -> VerifyReport | None:
    """The distributed comparison on this rank: packed under FSDP2 on every rank, unpacked on
    rank 0, which alone returns the report (None elsewhere).

    One function on purpose (~100 lines): every collective (``gathered_named_parameters``,
    the FSDP forward/backward) is visible in the order each rank runs it; split across
    helpers that branch on the rank, a collective one rank skips would hang the others.
    """
    from packing.data._collate import PackedCollator, Stream
    from packing.train._fsdp import gathered_named_parameters, shard_model

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(config.seed)
    model, episodes, where, mapping = model_and_episodes(config)
    streams: list[Stream] = list(model.streams)  # type: ignore[arg-type]
    unpacked = PackedCollator(streams)
    singles = [unpacked([ep]) for ep in episodes]
    lengths = [b.layout(streams[0].name).num_tokens for b in singles]
    tps = streams[0].tokens_per_step  # a pack holds whole steps (frames) of the primary
    budget = config.token_budget or round_up(default_token_budget(lengths), tps)
    plan = _packs_by_rank(lengths, budget, config.seed, world)
    collate = PackedCollator(streams, token_budget=budget)
    mine = [collate([episodes[i] for i in p]) for p in plan[rank]]

    model_u = copy.deepcopy(model).to(dev) if rank == 0 else None
    model_p = model.to(dev)
    bf16 = config.torch_dtype != torch.float32
    half_params = bf16 and not config.fsdp_autocast
    shard_model(model_p, blocks=config.blocks, checkpointing=config.checkpointing,  # type: ignore[arg-type]
                compile=config.compile, param_dtype=config.torch_dtype if half_params else None)  # fmt: skip
    autocast_p = config.torch_dtype if bf16 and config.fsdp_autocast else None
    model_p.train()
    opt_p = torch.optim.AdamW(model_p.parameters(), lr=config.lr, eps=config.adam_eps)
    opt_u = None
    if model_u is not None:
        model_u.train()
        opt_u = torch.optim.AdamW(model_u.parameters(), lr=config.lr, eps=config.adam_eps)
    tol = Tolerances.for_dtype(config.torch_dtype)
    records, worst, failures = [], {}, []  # type: ignore[var-annotated]
    noise_seed = config.seed + (_RANK_SALT * (rank + 1) if config.noise_key == "rank" else 0)
    for s in range(config.steps):
        _sync(dev)
        t0 = time.perf_counter()
        bp = [_with_step(b, noise_seed, s, dev) for b in mine]
        loss_p = _packed_step(model_p, bp, config, dev, autocast_p)
        _sync(dev)
        sec_p = time.perf_counter() - t0
        grads_p = gathered_named_parameters(model_p, grads=True)  # collective: every rank
        say(f"step {s}: packed on {world} ranks, {len(mine)} micro-steps each, loss {loss_p:.8g}")
        if model_u is not None and opt_u is not None:
            t0 = time.perf_counter()
            bu = [_with_step(b, config.seed, s, dev) for b in singles]
            loss_u = _unpacked_step(model_u, bu, config, dev, config.torch_dtype if bf16 else None)
            sec_u = time.perf_counter() - t0
            say(f"step {s}: unpacked, {len(bu)} micro-steps, loss {loss_u:.8g}")
            rel = abs(loss_p - loss_u) / abs(loss_u) if loss_u else abs(loss_p)
            records.append(StepComparison(step=s, loss_unpacked=loss_u, loss_packed=loss_p,
                                          loss_rel=rel, micro_steps_unpacked=len(bu),
                                          micro_steps_packed=len(mine), seconds_unpacked=sec_u,
                                          seconds_packed=sec_p))  # fmt: skip
            grads_u = {n: p.grad for n, p in model_u.named_parameters()}
            failures += record_grad_diffs(worst, grads_u, grads_p, s, tol)
            opt_u.step()
            opt_u.zero_grad(set_to_none=True)
        opt_p.step()
        opt_p.zero_grad(set_to_none=True)
    params_p = gathered_named_parameters(model_p)  # collective
    if model_u is None:
        return None
    params_u = {n: p.detach() for n, p in model_u.named_parameters()}
    params_pp = {n: t for n, t in params_p.items() if t is not None}
    param_rel, param_worst, param_worst_rel = parameter_difference(params_u, params_pp)
    diverged = _diverged(records, params_u, params_pp)
    leak = None
    if config.leak_check and not diverged:
        leak = _leak_check_trained(model_u, params_pp, plan, episodes, collate, config, dev,
                                   bf16, failures, say)  # fmt: skip
    grads = sorted(worst.values(), key=lambda g: grad_badness(g, tol), reverse=True)
    failures += judge(records, grads, param_rel, param_worst, leak, tol, config.steps)
    if diverged:  # no verdict on packing: every difference compares nan with nan
        failures = [diverged]
    packs = [p for r in plan for p in r]
    info = {**asdict(config), "model": config.model or DEFAULT_MODEL, "dataset": where,
            "features": {s.name: mapping.get(s.name, s.name) for s in streams},
            "token_budget": budget, "world_size": world,
            "episodes_per_rank": [sum(len(p) for p in r) for r in plan],
            "fsdp": "FSDP2 fully_shard per block + root", "backend": dist.get_backend()}  # fmt: skip
    primary = streams[0].name
    return VerifyReport(
        config=info,
        tolerances=tol,
        steps=records,
        grads=grads,
        param_rel=param_rel,
        param_worst=param_worst,
        param_worst_rel=param_worst_rel,
        episodes=len(episodes),
        tokens=sum(lengths),
        padded_tokens_unpacked=sum(b.layout(primary).padded_len for b in singles),
        padded_tokens_packed=budget * len(packs),
        packs=len(packs),
        pack_sizes=[len(p) for p in packs],
        leak=leak,
        failures=failures,
        diverged=bool(diverged),
        environment={**_environment(dev), "world_size": str(world)},
    )


def _diverged(
    records: Sequence[StepComparison],
    params_u: dict[str, torch.Tensor],
    params_p: dict[str, torch.Tensor],
) -> str:
    """Both runs non-finite (a loss at some step, or the parameters at the end): no verdict
    on packing, as in `packing.verify._harness.compare_packed_unpacked` ("" when they are finite)."""
    for r in records:
        if not (math.isfinite(r.loss_unpacked) or math.isfinite(r.loss_packed)):
            return both_diverged_at(r.step, r.loss_unpacked, r.loss_packed)
    return params_diverged(len(records), nonfinite_tensors(params_u), nonfinite_tensors(params_p))


def _leak_check_trained(
    model_u: nn.Module,
    params_p: dict[str, torch.Tensor],
    plan: list[list[list[int]]],
    episodes: Sequence[Any],
    collate: Callable[[Sequence[Any]], PackedBatch],
    config: VerifyConfig,
    dev: torch.device,
    bf16: bool,
    failures: list[str],
    say: Callable[[str], None],
) -> Any:
    """The leak check on a plain copy holding the packed run's trained weights (rank 0)."""
    multi = [p for r in plan for p in r if len(p) >= 2]
    if not multi:
        failures.append("leak check impossible: no pack holds >= 2 episodes; lower the budget")
        return None
    trained = copy.deepcopy(model_u)
    result = trained.load_state_dict({k: v.float() for k, v in params_p.items()}, strict=False)
    names = {n for n, _ in trained.named_parameters()}
    if result.unexpected_keys or names & set(result.missing_keys):
        raise KeyError(
            f"the packed run's parameters do not match the model's: unexpected "
            f"{result.unexpected_keys[:4]}, missing {sorted(names & set(result.missing_keys))[:4]}"
        )
    trained.eval()
    batch = replace(_with_step(collate([episodes[i] for i in multi[0]]), config.seed, 0, dev))
    say(f"leak check on a pack of {len(multi[0])} episodes (the packed run's trained weights)")
    return _leak_check(trained, batch, config.torch_dtype if bf16 else None, dev)
