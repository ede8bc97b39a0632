"""``packing budget``: how many tokens a GPU holds, from the stated memory model.

::

    packing budget                                  # Wan-2.2-5B widths, 30 blocks, 1-8 GPUs
    packing budget --preset wan_1_3b --gpus 8 --checkpointing none --accumulate
    packing budget --measure                        # fit the model on this GPU first

The answer is `packing.train.MemoryModel.max_tokens` (docs/distributed.md states the model).
Without ``--measure`` it uses the coefficients fitted on one H200 (torch 2.11, the reference
DiT, bf16 parameters, fp32 reduction, AdamW; benchmarks/results/fsdp_budget_1xh200.json),
whose full-depth check measured 5.4% above the prediction: the table prints that margin
too. ``--measure`` probes this GPU at 2 and 4 blocks and two pack sizes (a minute or two),
fits the same model and answers from it.

Without ``--measure`` nothing imports torch: the answer is arithmetic, and comes in well
under a second (`packing._memory_model`, the presets' parameter counts below).
"""

from __future__ import annotations

import argparse
from typing import Any

from packing.cli._parser import real, whole

# Fitted on one H200 (benchmarks/distributed/fsdp_budget.py, 2026-12-01, packing_src_sha1 7eae458a7111):
# bytes = fixed + tokens * (per_token + per_token_block * depth) on top of the sharded states.
MEASURED_H200 = {
    "full": {"fixed": 320_931_232.0, "per_token": 356_849.7, "per_token_block": 66.857_812_5},
    "none": {"fixed": -1_709_321_952.0, "per_token": 240_049.19, "per_token_block": 184_700.56},
}
FULL_DEPTH_MARGIN = 139.17 / 132.09  # measured / predicted at 30 blocks, 144,384 tokens
# The reference DiT presets' parameters as (blocks, outside the blocks, per block), so that
# the answer needs no torch; tests/test_contract_cases.py checks them against
# packing.model.param_count(DiTConfig.<preset>(depth=d)).
PRESET_PARAMS = {
    "wan_2_2_5b": (30, 87_819_470, 163_656_704),
    "wan_1_3b": (30, 22_676_174, 46_440_704),
    "tiny": (2, 84_878, 50_624),
}
PRESETS = tuple(PRESET_PARAMS)


def add_parser(sub: Any) -> None:
    b = sub.add_parser(
        "budget",
        help="the token budget per GPU for a model, sharding and checkpointing mode",
        description=__doc__.split("::")[0].strip(),
    )
    b.add_argument("--preset", default="wan_2_2_5b", choices=PRESETS, help="reference DiT widths")
    b.add_argument(
        "--depth",
        type=whole(1, 1000, "blocks"),
        default=None,
        help="blocks (default: the preset's)",
    )
    b.add_argument(
        "--params",
        type=whole(1, 10**13, "parameters"),
        default=None,
        help="parameters of your own model (5e9 is read)",
    )
    b.add_argument(
        "--gpus",
        type=whole(1, 65_536, "GPUs"),
        action="append",
        help="GPUs (repeatable; default 1,2,4,8)",
    )
    b.add_argument("--checkpointing", default="full", choices=["full", "none"])
    b.add_argument("--accumulate", action="store_true", help="several no-sync micro-steps a step")
    b.add_argument(
        "--gpu-memory-gb",
        type=real(1, 10_000, "GB of one GPU"),
        default=None,
        help="default: 150 (an H200, the fit's machine); with --measure this GPU",
    )
    b.add_argument(
        "--headroom",
        type=real(0, 0.9, "a fraction"),
        default=0.08,
        help="fraction left free (0.08)",
    )
    b.add_argument("--measure", action="store_true", help="fit the model on this GPU first")


def run(args: argparse.Namespace) -> int:
    from packing._memory_model import MemoryModel

    gpus = args.gpus or [1, 2, 4, 8]  # the parser bounded every flag
    blocks, outside, per_block = PRESET_PARAMS[args.preset]
    depth = args.depth if args.depth is not None else blocks
    params = args.params or outside + depth * per_block
    memory = _memory(args.gpu_memory_gb, args.measure)
    capacity = memory * (1 - args.headroom)
    if args.measure:
        model, source = _measured(args.preset, depth, args.checkpointing), "measured on this GPU"
    else:
        model = MemoryModel(**MEASURED_H200[args.checkpointing])
        source = "fitted on one H200 (benchmarks/results/fsdp_budget_1xh200.json)"
    rows = [(n, _fit(model, capacity, params, depth, n, args.accumulate)) for n in gpus]
    if not any(isinstance(fit, int) for _, fit in rows):
        n, why = max(rows)  # the most GPUs: the best chance, and still nothing
        raise ValueError(
            f"nothing fits: at {n} GPUs {why}; give fewer --params or --depth, more --gpus, "
            "a larger --gpu-memory-gb"
            + (" or --checkpointing full" if args.checkpointing != "full" else "")
        )
    print(
        f"packing budget: {params / 1e9:.2f} B parameters, depth {depth}, "
        f"checkpointing {args.checkpointing}, {'accumulating' if args.accumulate else 'one micro-step a step'}, "
        f"{capacity / 1e9:.1f} GB usable ({memory / 1e9:.1f} GB - {args.headroom:.0%}); model {source}"
    )
    if args.gpu_memory_gb is None and not args.measure:
        print(
            f"note: {memory / 1e9:.1f} GB is an H200's, assumed; for another GPU pass "
            "--gpu-memory-gb (or --measure on it)"
        )
    print("| GPUs | tokens per GPU | with the full-depth margin |")
    print("|---:|---:|---:|")
    for n, fit in rows:
        safe = _fit(model, capacity / FULL_DEPTH_MARGIN, params, depth, n, args.accumulate)
        print(f"| {n} | {_cell(fit)} | {_cell(safe)} |")
    return 0


def _fit(
    model: Any, capacity: float, params: int, depth: int, n: int, accumulate: bool
) -> int | str:
    """The largest pack per GPU, or why none fits (the memory model says 0 tokens)."""
    tokens = model.max_tokens(capacity, params, depth, n, accumulate=accumulate)
    if tokens:
        return int(tokens)
    states = model.peak(0, params, depth, n, accumulate=accumulate)
    if states >= capacity:
        return f"the sharded states alone need {states / 1e9:,.1f} GB of {capacity / 1e9:,.1f} GB"
    pack = model.peak(1024, params, depth, n, accumulate=accumulate) - states
    free = capacity - states
    return f"1,024 tokens need {pack / 1e9:,.1f} GB, {free / 1e9:,.1f} GB are left"


def _cell(fit: int | str) -> str:
    return f"{fit:,}" if isinstance(fit, int) else f"none ({fit})"


def _memory(gpu_memory_gb: float | None, measure: bool) -> float:
    """Bytes of the GPU: ``--gpu-memory-gb``, else this GPU's when measuring (torch), else an
    H200's (the machine the stored fit was made on; no torch import)."""
    if gpu_memory_gb is not None:
        return gpu_memory_gb * 1e9
    if measure:
        import torch

        if torch.cuda.is_available():
            return float(torch.cuda.get_device_properties(0).total_memory)
    return 150e9  # an H200's 141 GB (decimal 150.1)


def _measured(preset: str, depth: int, checkpointing: str) -> Any:
    """Fit the memory model from probes on this GPU: 2 and 4 blocks, two pack sizes."""
    import torch

    from packing.data import PackedCollator, Stream
    from packing.model import DiT, DiTConfig, param_count, text_tokens
    from packing.train import Probe, fit_memory_model, probe_peak, shard_model

    cfg = getattr(DiTConfig, preset)()
    cfg = DiTConfig(**{**cfg.__dict__, "depth": depth})
    if not torch.cuda.is_available():
        raise ValueError("--measure needs a CUDA GPU; drop it to use the stored H200 fit")
    dev = torch.device("cuda")
    tpf = cfg.tokens_per_frame
    probes = []
    for depth in (2, 4):
        c = DiTConfig(**{**cfg.__dict__, "depth": depth})
        torch.manual_seed(0)
        with torch.device(dev):
            model = DiT(c)
        shard_model(model, checkpointing=checkpointing, compile=False, param_dtype=torch.bfloat16)  # type: ignore[arg-type]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        for tokens in (16_384, 49_152):
            frames = tokens // tpf
            g = torch.Generator().manual_seed(0)
            eps = [
                {
                    "latents": torch.randn(f, c.latent_channels, *c.latent_hw, generator=g),
                    "action": torch.randn(f, c.action_dim, generator=g),
                    "text": text_tokens(f"task {i}", c.text_len),
                    "episode_index": i,
                }
                for i, f in enumerate([240] * (frames // 240) + [frames % 240] * bool(frames % 240))
            ]
            streams = [Stream("latents", grid=c.grid, budget=frames * tpf), Stream("action"),
                       Stream("text")]  # fmt: skip
            batch = PackedCollator(streams, pad_to_multiple=128)(eps).to(dev)
            batch.extras.update(seed=0, step=0)

            def step(m: Any = model, o: Any = opt, b: Any = batch) -> None:
                out = m(b)
                (out["latents"].float().mean() + out["action"].float().mean()).backward()
                o.step()
                o.zero_grad(set_to_none=True)

            peak = probe_peak(step, device=dev)
            probes.append(Probe(depth, tokens, param_count(c), 1, peak))
        del model, opt
    return fit_memory_model(probes)
