"""How many tokens per GPU: a memory model of sharded training, fitted on a few probes.

Peak memory of one GPU in an N-way FSDP run of a model of depth ``d`` on packs of ``T``
tokens, stated as::

    peak(T, d, N) =  state_bytes * P(d) / N          params + grads + AdamW m, v, all fp32,
                                                     sharded 1/N (16 bytes a parameter)
                   + fixed                           gathered bf16 blocks in flight, CUDA and
                                                     NCCL workspaces, allocator slack
                   + T * (per_token + per_token_block * d)
                                                     activations: with full checkpointing
                                                     each block keeps its input (per block)
                                                     and one block is recomputed at a time
                                                     (per token, depth-free); without, every
                                                     block keeps all of its activations
                   + accum_bytes * P(d)              only when gradients accumulate over
                                                     micro-steps without a sync
                                                     (``set_requires_gradient_sync(False)``):
                                                     FSDP2 keeps each parameter's *unsharded*
                                                     gradient in the reduce dtype (fp32, 4
                                                     bytes a parameter) until the synced
                                                     micro-step; not divided by N

``fit_memory_model`` finds ``fixed``, ``per_token`` and ``per_token_block`` by least squares
from probes at shallow depths (2 and 4 blocks, two pack sizes: minutes at full depth become
seconds), with the parameter term computed from the parameter count. ``max_tokens`` inverts
the model for any depth and N; the caller then checks the prediction with one full-depth
probe (`probe_peak`) on the GPUs it has. Only the first term depends on N, so the answer
for 8 GPUs comes from a run on 2 with the same activation terms.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from typing import Any

import torch

from packing._validate import check_int

__all__ = ["ACCUM_BYTES", "MemoryModel", "Probe", "fit_memory_model", "probe_peak"]

from packing._memory_model import ACCUM_BYTES, STATE_BYTES, MemoryModel, Probe


def fit_memory_model(probes: Sequence[Probe]) -> MemoryModel:
    """Least squares of ``peak - STATE_BYTES * P / N = fixed + T * a + T * d * b`` over the
    probes (at least two depths and two pack sizes)."""
    if len({p.depth for p in probes}) < 2 or len({p.tokens for p in probes}) < 2:
        raise ValueError(
            f"fit_memory_model needs probes at >= 2 depths and >= 2 pack sizes, got "
            f"{[(p.depth, p.tokens) for p in probes]}"
        )
    a = torch.tensor([[1.0, p.tokens, p.tokens * p.depth] for p in probes], dtype=torch.float64)
    y = torch.tensor(
        [p.peak_bytes - STATE_BYTES * p.params / p.world for p in probes], dtype=torch.float64
    )
    sol = torch.linalg.lstsq(a, y[:, None]).solution[:, 0].tolist()
    return MemoryModel(fixed=sol[0], per_token=sol[1], per_token_block=sol[2])


def probe_peak(step: Callable[[], Any], *, device: torch.device, repeats: int = 2) -> float:
    """Peak bytes allocated over ``repeats`` calls of ``step`` (a full training step; the
    second one holds the optimizer states), max over ranks when distributed."""
    check_int("repeats", repeats, min=1)
    if not isinstance(device, torch.device):
        raise TypeError(f"device={device!r} must be a torch.device, e.g. torch.device('cuda')")
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(repeats):
        step()
    peak = 0.0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = float(torch.cuda.max_memory_allocated(device))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        t = torch.tensor([peak], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        peak = float(t)
    return peak
