"""FSDP2 for packed training: shard, checkpoint and compile a model block by block.

One process per GPU, a 1-D `DeviceMesh` over them. ``shard_model`` applies, per block::

    model.blocks[i]  ->  fully_shard( checkpoint_wrapper( torch.compile(block) ) )
    model            ->  fully_shard(model)        (embeddings, heads: the root unit)

    forward of one micro-step:
      root   prepare(batch): noise, layouts, AttentionMask   <- built ONCE per micro-step
      block0 all-gather -> compiled block(x, ..., mask) -> reshard
      ...                                                     (the mask is an argument:
      backward: block k recomputes its forward from its saved   the recompute reuses it,
      inputs (the same mask tensors), then reduce-scatter       nothing is rebuilt)

Mixed precision as users train: parameters all-gathered in bf16, gradients reduced in fp32,
fp32 master weights and optimizer states (sharded 1/N). Gradient averaging over ranks is
FSDP's default, so pair it with `packing.train._losses.LossNormalizer.for_step` (``grad_scale = N``
undoes the average; its denominator covers every micro-step of every rank)::

    mesh = init_device_mesh("cuda", (world,))
    shard_model(model, mesh, checkpointing="full", compile=True)
    norm = LossNormalizer.for_step([b.layout("latents") for b in micro], "episode", device=dev)
    for i, b in enumerate(micro):
        model.set_requires_gradient_sync(i == len(micro) - 1)   # reduce once per step
        norm(model(b)["latents"], b.layout("latents")).backward()

Your own model: pass its blocks (``blocks=model.layers`` or the attribute name); everything
else (the root unit, the policy) is the same. ``checkpointing`` picks what is recomputed:
``"full"`` every block's forward, ``"ops"`` all but the saved matmul/attention outputs
(torchtitan's selective op policy: every second matmul saved), ``"attention"`` all but the
attention kernels' outputs (the recompute skips attention, the costliest op per byte kept:
per layer ``T x heads x head_dim`` bf16 plus its log-sum-exp; 24 GB for 30 blocks of
131K tokens at Wan-2.2-5B widths), ``"none"``;
``checkpoint_blocks=n`` checkpoints only n of the blocks (spread evenly), the per-block
selective choice when memory allows some blocks to keep their activations.

Full checkpointing wraps the *compiled* block (torchtitan compiles the checkpointed one):
the recompute calls the same compiled forward with the same arguments, no rebuild, no new
guard. ``"ops"`` and ``"attention"`` sit inside compile (a policy must see each op); the
checkpoint's higher-order op guards on everything its inputs hold, which is why
`AttentionMask` holds only device tensors and ints fixed by the pack's padded shape (it held
the layouts' episode lengths once, and every new pack composition recompiled). All keep one
graph per block across pack compositions (``tests/test_attention.py`` checks the checkpoint
inside compile for both policies).

CPU (gloo) runs the same code: FSDP2 shards and reduces on CPU in torch 2.11, which is how
CI runs the 2-process ``packing verify --nproc 2``.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from packing._validate import check_bool, check_dtype, check_int, check_optional_int

__all__ = [
    "Checkpointing",
    "checkpointed_blocks",
    "full_tensor",
    "gathered_named_parameters",
    "shard_model",
    "strip_wrapper_names",
]

Checkpointing = Literal["full", "ops", "attention", "none"]
_MODES = ("full", "ops", "attention", "none")
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def checkpointed_blocks(depth: int, count: int | None) -> list[bool]:
    """Which of ``depth`` blocks get checkpointed when ``count`` of them should be, evenly
    spread (None: all). ``checkpointed_blocks(6, 2) == [F, F, T, F, F, T]``."""
    # 2.5 blocks is not a count: int() would checkpoint 2 and say nothing.
    n = depth if count is None else check_int("checkpoint_blocks", count)
    if not 0 <= n <= depth:
        raise ValueError(f"checkpoint_blocks={count} must be in [0, {depth}] (the block count)")
    return [(i + 1) * n // depth > i * n // depth for i in range(depth)]


def _ops_policy(save_matmuls: bool = True) -> Callable[[], Any]:
    """Context factory for op-level selective checkpointing: save attention outputs and (with
    ``save_matmuls``) every second matmul output, recompute the rest (norms, pointwise, the
    other matmuls)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    mms = {aten.mm.default, aten.addmm.default}
    save: set[Any] = set(mms) | {
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
    }
    with contextlib.suppress(
        AttributeError, RuntimeError
    ):  # FA4 registered (packing.attention._fa4)
        save.add(torch.ops.packing.fa4_varlen.default)
    try:
        from torch._higher_order_ops.flex_attention import flex_attention as flex_hop

        save.add(flex_hop)
    except ImportError:
        pass

    def context() -> Any:
        count: dict[str, int] = defaultdict(int)

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            key = "recompute" if ctx.is_recompute else "forward"
            if func in mms:
                if not save_matmuls:
                    return CheckpointPolicy.PREFER_RECOMPUTE
                count[key] += 1
                if count[key] % 2 == 0:
                    return CheckpointPolicy.PREFER_RECOMPUTE
            if func in save:
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context


def _wrap_checkpoint(block: nn.Module, checkpointing: Checkpointing) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if checkpointing == "full":
        return checkpoint_wrapper(block, preserve_rng_state=False)
    policy = _ops_policy(save_matmuls=checkpointing == "ops")
    return checkpoint_wrapper(block, context_fn=policy, preserve_rng_state=False)


def _blocks_of(model: nn.Module, blocks: str | nn.ModuleList) -> nn.ModuleList:
    found = getattr(model, blocks, None) if isinstance(blocks, str) else blocks
    if not isinstance(found, nn.ModuleList) or not len(found):
        raise TypeError(
            f"shard_model: blocks={blocks!r} must name (or be) a non-empty nn.ModuleList of "
            f"the model's repeated blocks; {type(model).__name__} gives "
            f"{type(found).__name__}. Pass blocks=model.layers (or your list) explicitly"
        )
    return found


def shard_model(
    model: nn.Module,
    mesh: Any = None,
    *,
    blocks: str | nn.ModuleList = "blocks",
    checkpointing: Checkpointing = "full",
    checkpoint_blocks: int | None = None,
    compile: bool = True,
    dynamic: bool | None = False,
    compile_options: dict[str, Any] | None = None,
    param_dtype: torch.dtype | None = torch.bfloat16,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard ``model`` in place with FSDP2, one unit per block plus the root; returns it.

    ``blocks``: the attribute name or the `nn.ModuleList` of repeated blocks (replaced in
    place by their wrapped versions). ``checkpointing``/``checkpoint_blocks``: see the module
    docstring. ``compile``: ``torch.compile`` each block (``dynamic=False``: packs have one
    static shape; ``True`` for a one-episode-per-micro-step baseline whose length varies);
    ``compile_options`` go to ``torch.compile`` (e.g. ``{"backend": "aot_eager"}``).
    ``param_dtype=None`` keeps fp32 parameters (for autocast or fp32 runs). ``mesh``: a 1-D
    DeviceMesh (default: all ranks of the default group, on the model's device type).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if checkpointing not in _MODES:
        raise ValueError(
            f"checkpointing={checkpointing!r}; choose 'full', 'ops', 'attention' or 'none'"
        )
    check_optional_int("checkpoint_blocks", checkpoint_blocks, min=0, hint="blocks")
    check_bool("compile", compile)
    check_bool("reshard_after_forward", reshard_after_forward)
    if dynamic is not None:
        check_bool("dynamic", dynamic)
    check_dtype("param_dtype", param_dtype, optional=True)
    check_dtype("reduce_dtype", reduce_dtype, optional=True)
    if not torch.distributed.is_initialized():
        raise RuntimeError(
            "shard_model needs torch.distributed: call dist.init_process_group('nccl') (gloo "
            "on CPU) in every process first, e.g. under torchrun"
        )
    if mesh is None:
        dev_type = next(model.parameters()).device.type
        mesh = init_device_mesh(dev_type, (torch.distributed.get_world_size(),))
    # cast_forward_inputs=False: FSDP would otherwise cast every float input of a block to
    # bf16, RoPE angles included (an angle of 300 rad in bf16 is off by ~1 rad).
    mp = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
    )
    layers = _blocks_of(model, blocks)
    wanted = checkpointed_blocks(len(layers), checkpoint_blocks)
    for i, block in enumerate(list(layers)):
        ckpt = checkpointing if wanted[i] else "none"
        wrapped: Any = block
        if ckpt in ("ops", "attention"):  # a policy must see the ops: inside compile
            wrapped = _wrap_checkpoint(wrapped, ckpt)
        if compile:
            wrapped = torch.compile(wrapped, dynamic=dynamic, **(compile_options or {}))
        if ckpt == "full":
            # Outside compile: the compiled forward runs again in the backward, same guards.
            # Inside, the checkpoint would lift the whole AttentionMask into its inputs and
            # guard on its host lists (episode lengths): one recompile per pack.
            wrapped = _wrap_checkpoint(wrapped, "full")
        # The last block's backward starts right after the forward: keep it gathered.
        last = i == len(layers) - 1
        fully_shard(
            wrapped,
            mesh=mesh,
            mp_policy=mp,
            reshard_after_forward=reshard_after_forward and not last,
        )
        layers[i] = wrapped
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return model


def strip_wrapper_names(name: str) -> str:
    """A parameter's name without the wrappers' parts: ``blocks.0._orig_mod.
    _checkpoint_wrapped_module.ffn.0.weight -> blocks.0.ffn.0.weight`` (the unsharded name)."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) DTensor: an all-gather on every rank."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def gathered_named_parameters(
    model: nn.Module, *, grads: bool = False
) -> dict[str, torch.Tensor | None]:
    """Every parameter (or its gradient) gathered whole, by unsharded name, detached.

    A collective: every rank must call it at the same point (same model, same order).
    """
    out: dict[str, torch.Tensor | None] = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p
        out[strip_wrapper_names(name)] = None if t is None else full_tensor(t.detach())
    return out
