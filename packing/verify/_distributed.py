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
import os
import pickle
import socket
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from packing.verify._command import Setup, VerifyConfig, prepare
from packing.verify._harness import (
    RunOptions,
    Side,
    batch_counts,
    environment,
    leak_report,
    run_steps,
    with_step,
)
from packing.verify._report import (
    NO_MULTI_EPISODE_PACK,
    LeakReport,
    Tolerances,
    VerifyReport,
    build_report,
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


def run_verify_distributed(
    config: VerifyConfig, progress: Callable[[str], None] | None = None
) -> VerifyReport:
    """Spawn ``config.nproc`` ranks on this machine; returns rank 0's report."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

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
    os.environ.setdefault("OMP_NUM_THREADS", str(config.threads or 1))
    torch.set_num_threads(config.threads or 1)  # --threads reaches every rank
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
    dev = _init(config)
    # On an error, no barrier: another rank may sit in a collective, and this process
    # exiting is what lets the launcher (torchrun, or the spawning parent) end the others.
    report = _verify(config, dev, progress or (lambda _line: None))
    dist.barrier()
    dist.destroy_process_group()
    return report


def _packs_by_rank(lengths: list[int], budget: int, seed: int, world: int) -> list[list[list[int]]]:
    """Every rank's packs for one epoch of the distributed sampler (same on every rank)."""
    from packing.planning import PackedBatchSampler

    out = []
    for r in range(world):
        s = PackedBatchSampler(lengths, budget, seed=seed, num_replicas=world, rank=r)
        s.set_epoch(0)
        out.append([list(p) for p in s])
    return out


def _rank_denominators(plan: list[list[list[int]]], setup: Setup, reduction: str) -> list[int]:
    """What each rank's own normaliser divides by (its episodes, frames or tokens)."""
    tps = setup.streams[0].tokens_per_step
    per_episode = {
        "episode": [1] * len(setup.lengths),
        "token": list(setup.lengths),
        "frame": [n // tps for n in setup.lengths],
    }[reduction]
    return [sum(per_episode[i] for p in rank for i in p) for rank in plan]


def plan_ranks(
    config: VerifyConfig, setup: Setup, world: int, say: Callable[[str], None]
) -> list[list[list[int]]]:
    """The sampler's packs per rank. For the ``per-rank`` ablation the split must give the
    ranks different denominators (with equal ones a rank's own mean *is* the global mean, and
    the planted mistake cannot fail): the first sampler seed from ``config.seed`` on whose
    split they differ is taken, and said; none in 64 seeds is an error."""
    if config.loss_normaliser != "per-rank":
        return _packs_by_rank(setup.lengths, setup.budget, config.seed, world)
    for seed in range(config.seed, config.seed + 64):
        plan = _packs_by_rank(setup.lengths, setup.budget, seed, world)
        if len(set(_rank_denominators(plan, setup, config.reduction))) > 1:
            if seed != config.seed:
                say(
                    f"--loss-normaliser per-rank: the split of sampler seed {config.seed} gives "
                    f"every rank the same {config.reduction} count, where the ablation cannot "
                    f"fail; using the split of seed {seed}"
                )
            return plan
    raise ValueError(
        f"--loss-normaliser per-rank cannot fail here: every split of these "
        f"{len(setup.lengths)} episodes over {world} ranks gives each rank the same "
        f"{config.reduction} count; use --reduction token, other --episodes, or another dataset"
    )


def _sides(
    setup: Setup, config: VerifyConfig, opts: RunOptions, dev: torch.device, rank: int
) -> tuple[Side | None, Side]:
    """The packed side, FSDP2 on every rank; the unpacked ground truth, rank 0 alone."""
    from packing.train import gathered_named_parameters, shard_model

    model_u = copy.deepcopy(setup.model).to(dev) if rank == 0 else None
    model_p = setup.model.to(dev)
    bf16 = opts.dtype != torch.float32
    half_params = bf16 and not config.fsdp_autocast
    shard_model(model_p, blocks=config.blocks, checkpointing=config.checkpointing,  # type: ignore[arg-type]
                compile=config.compile, param_dtype=opts.dtype if half_params else None)  # fmt: skip
    model_p.train()
    packed = Side(
        model=model_p,
        call=model_p,
        optimizer=torch.optim.AdamW(model_p.parameters(), lr=opts.lr, eps=opts.adam_eps),
        normalise=opts.normalise,  # global: one all_reduce over every rank and micro-step
        autocast=opts.dtype if bf16 and config.fsdp_autocast else None,
        gradient_sync_last=True,
        mean_over_ranks=True,
        gather=gathered_named_parameters,
    )
    if model_u is None:
        return None, packed
    model_u.train()
    unpacked = Side(
        model=model_u,
        call=model_u,
        optimizer=torch.optim.AdamW(model_u.parameters(), lr=opts.lr, eps=opts.adam_eps),
        normalise="local",  # this process alone: no collective
        autocast=opts.autocast,
    )
    return unpacked, packed


def _verify(
    config: VerifyConfig, dev: torch.device, say: Callable[[str], None]
) -> VerifyReport | None:
    """The distributed comparison on this rank: packed under FSDP2 on every rank, unpacked on
    rank 0, which alone returns the report (None elsewhere). The loop and the report are the
    single-process harness's (`run_steps`, `build_report`); every collective
    (``packed.grads()``, ``packed.parameters()``, the FSDP forward/backward) runs on every
    rank in the same order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    setup = prepare(config)
    plan = plan_ranks(config, setup, world, say)
    singles = [setup.unpacked([ep]) for ep in setup.episodes]
    mine = [setup.packed([setup.episodes[i] for i in p]) for p in plan[rank]]
    opts = replace(config.run_options(), device=dev)
    tol = Tolerances.for_dtype(opts.dtype)
    unpacked, packed = _sides(setup, config, opts, dev, rank)
    noise_seed = config.seed + (_RANK_SALT * (rank + 1) if config.noise_key == "rank" else 0)
    steps = run_steps(unpacked, packed, singles, mine, opts, tol, say, noise_seed=noise_seed)
    params_p = packed.parameters()  # collective
    if unpacked is None:
        return None
    packs = [p for r in plan for p in r]

    def leak() -> tuple[LeakReport | None, list[str]]:
        return _leak_check_trained(unpacked.model, params_p, packs, setup, opts, say)

    info = setup.info(
        config,
        world_size=world,
        episodes_per_rank=[sum(len(p) for p in r) for r in plan],
        fsdp="FSDP2 fully_shard per block + root",
        backend=dist.get_backend(),
    )
    return build_report(
        config=info,
        tolerances=tol,
        steps=steps,
        params_u=unpacked.parameters(),
        params_p=params_p,
        leak_check=leak if opts.leak_check else None,
        counts=batch_counts(singles, packs, setup.budget * len(packs)),
        environment={**environment(dev), "world_size": str(world)},
        planned_steps=opts.steps,
    )


def _leak_check_trained(
    model_u: nn.Module,
    params_p: dict[str, torch.Tensor],
    packs: list[list[int]],
    setup: Setup,
    opts: RunOptions,
    say: Callable[[str], None],
) -> tuple[LeakReport | None, list[str]]:
    """The leak check on a plain copy holding the packed run's trained weights (rank 0)."""
    multi = [p for p in packs if len(p) >= 2]
    if not multi:
        return None, [NO_MULTI_EPISODE_PACK]
    trained = copy.deepcopy(model_u)
    result = trained.load_state_dict({k: v.float() for k, v in params_p.items()}, strict=False)
    names = {n for n, _ in trained.named_parameters()}
    if result.unexpected_keys or names & set(result.missing_keys):
        raise KeyError(
            f"the packed run's parameters do not match the model's: unexpected "
            f"{result.unexpected_keys[:4]}, missing {sorted(names & set(result.missing_keys))[:4]}"
        )
    trained.eval()
    batch = with_step(
        setup.packed([setup.episodes[i] for i in multi[0]]), opts.seed, 0, opts.device
    )
    say(f"leak check on a pack of {len(multi[0])} episodes (the packed run's trained weights)")
    return leak_report(trained, batch, opts.autocast, opts.device), []
