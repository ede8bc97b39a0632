"""``packing verify``: packed vs unpacked training from the same weights, and its exit status.

::

    packing verify                          # embedded default dataset, tiny reference model, fp32 CPU
    packing verify --no-document-mask       # proof it can fail: reports the leak, exits 1
    packing verify --dataset ~/data/my_robot --model my_models:build --json report.json
    packing verify --device cuda --dtype bfloat16 --compile
    packing verify --inference              # packed inference == each request alone (serve)

Exit status, a contract scripts can rely on (`EXIT_STATUS`):

    0  packed and unpacked training agree within tolerance
    1  the comparison ran and failed (a leak, a loss or gradient that differs)
    2  bad input, usage or environment: one line on stderr names the problem and the fix
       (a bad flag, a flag of the other mode, a missing dataset or folder, an unreadable
       file, no GPU, a model factory that raises, both runs diverging); ``--traceback`` adds
       the full traceback
    3  the run crashed: an error inside torch, a library or the model while it ran (also in
       a rank of ``--nproc``); the line names its type, ``--traceback`` shows where
   130  interrupted (Ctrl-C): no verdict

Under ``torchrun`` each rank exits with this status, and torchrun itself reports any failing
rank as 1: read the rank's line (``packing verify: error: ...``) or use ``--nproc``, which keeps
the contract.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from packing.cli._parser import device, folder, pattern, real, report_path, whole

__all__ = ["EXIT_STATUS", "add_parser", "run"]

EXIT_STATUS = """exit status:
  0  packed and unpacked training agree within tolerance
  1  the comparison ran and failed (a leak, a loss or gradient that differs)
  2  bad input, usage or environment (a bad flag, a flag of the other mode, a missing dataset
     or folder, an unreadable file, no GPU, a model factory that raises, both runs
     diverging): one line on stderr names the problem and the fix; --traceback adds the
     full traceback
  3  the run crashed (an error inside torch, a library or the model; also in a rank of
     --nproc): the line names its type; --traceback shows where
  130  interrupted (Ctrl-C): no verdict"""


# The flags ``packing verify --inference`` reads; any other verify flag is refused with it
# (a --model would otherwise be dropped and the built-in model proven in its place).
INFERENCE_FLAGS = frozenset(
    {
        "inference",
        "mask",
        "document_mask",
        "seed",
        "json",
        "threads",
        "traceback",
        "context_cache",
        "model",
    }
)


FACTORY = pattern(r"[\w.]+:[\w.]+", "my_models:build", "'module:factory'")
# --model also names a served model for --inference (LeRobot's LingBot-VA)
MODEL = pattern(r"[\w.]+:[\w.]+|lingbot_va", "my_models:build",
                "'module:factory' (or lingbot_va with --inference)")  # fmt: skip


def add_parser(sub: Any) -> None:
    v = sub.add_parser(
        "verify",
        help="train packed and unpacked from the same weights; compare losses and gradients",
        description=(
            "Run the same episodes unpacked (one episode per micro-step, gradient accumulation) "
            "and packed (K episodes per micro-step under a token budget) from the same initial "
            "weights for N AdamW steps; compare per-step losses, every parameter gradient and "
            "the parameters after N steps, and check that no episode leaks into another. Exit "
            "status 0 only within tolerance (fp32: loss 1e-6, gradients and parameters 1e-5 "
            "relative; bf16: loss 5e-3, gradient cosine >= 0.999)."
        ),
        epilog=EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_run_options(v)
    _add_comparison_options(v)
    _add_distributed_options(v)
    _add_model_and_data_options(v)
    _add_optimizer_and_output_options(v)


def _add_run_options(v: argparse.ArgumentParser) -> None:
    """Where and how long: device, dtype, compile, steps, episodes, budget."""
    v.add_argument(
        "--device", type=device(), default="cpu", help="cpu (default), cuda, cuda:1, ..."
    )
    v.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="float32 runs the model as is; bfloat16/float16 use autocast with fp32 weights",
    )
    v.add_argument("--compile", action="store_true", help="torch.compile both models")
    v.add_argument(
        "--inference",
        action="store_true",
        help=(
            "verify packed inference instead (packing.serve): requests of mixed lengths at "
            "mixed denoising steps in one pack == each request alone, fp32 CPU, rel 1e-5; "
            "takes --mask, --no-document-mask, --seed, --json, --context-cache"
        ),
    )
    v.add_argument(
        "--context-cache",
        action="store_true",
        help="with --inference: the packed run through the engine's frame-causal context cache",
    )
    v.add_argument(
        "--steps", type=whole(1, 10_000, "AdamW steps"), default=3, help="AdamW steps (default 3)"
    )
    v.add_argument(
        "--episodes",
        type=whole(2, 10**6, "packing needs at least 2 episodes"),
        default=None,
        help="first N episodes (default all)",
    )
    v.add_argument(
        "--token-budget",
        type=whole(1, 2**22, "tokens per pack"),
        default=None,
        help="tokens per pack (default: about a third of a step's tokens)",
    )


def _add_comparison_options(v: argparse.ArgumentParser) -> None:
    """What is compared: the mask, the loss reduction and normaliser."""
    v.add_argument(
        "--mask",
        default="document",
        choices=["document", "frame-causal"],
        help="attention inside an episode: all of it, or frame-causal",
    )
    v.add_argument(
        "--no-document-mask",
        dest="document_mask",
        action="store_false",
        help="drop the document mask: episodes see each other. verify must FAIL (the proof)",
    )
    v.add_argument(
        "--reduction",
        default="episode",
        choices=["token", "frame", "episode"],
        help="loss mean (default episode: what one episode per micro-step + accumulation does)",
    )
    v.add_argument(
        "--loss-normaliser",
        default="global",
        choices=["global", "per-micro-step", "per-rank"],
        help=(
            "global (correct): one denominator for the whole step, over every micro-step and "
            "rank; per-micro-step: each pack's own mean, averaged (the mean-of-means mistake); "
            "per-rank (with --nproc): each rank's own mean, averaged by FSDP. The mistakes must "
            "FAIL"
        ),
    )


def _add_distributed_options(v: argparse.ArgumentParser) -> None:
    """The distributed run (``--nproc``, FSDP2): ranks, sharding, noise keys."""
    v.add_argument(
        "--nproc",
        type=whole(1, 64, "processes"),
        default=1,
        help=(
            "ranks: > 1 trains packed under FSDP2 on that many processes (gloo on CPU, NCCL on "
            "cuda:rank) with the distributed sampler, against unpacked on rank 0 "
            "(docs/distributed.md); under torchrun the ranks come from the environment"
        ),
    )
    v.add_argument(
        "--checkpointing",
        default="full",
        choices=["full", "ops", "attention", "none"],
        help="distributed run: activation checkpointing of each block (default full)",
    )
    v.add_argument(
        "--blocks",
        type=pattern(r"[A-Za-z_][\w.]*", "blocks", "an attribute name"),
        default="blocks",
        help="distributed run: the model's nn.ModuleList of blocks to shard (default 'blocks')",
    )
    v.add_argument(
        "--fsdp-autocast",
        action="store_true",
        help=(
            "distributed bf16/fp16 run: keep fp32 sharded parameters and use autocast (the "
            "reference's regime) instead of FSDP's bf16 parameters with fp32 reduction"
        ),
    )
    v.add_argument(
        "--noise-key",
        default="episode",
        choices=["episode", "rank"],
        help=(
            "distributed run: noise/timesteps keyed by episode (correct) or with the rank mixed "
            "into the seed (the mistake; verify must FAIL)"
        ),
    )


def _add_model_and_data_options(v: argparse.ArgumentParser) -> None:
    """Whose model, on whose data: dataset, features, model, reference."""
    v.add_argument(
        "--dataset",
        type=folder("a local LeRobot v3 dataset root"),
        default=None,
        help="a local LeRobot v3 root (default: embedded)",
    )
    v.add_argument(
        "--feature",
        action="append",
        type=pattern(r"[^=\s]+=[^=\s]+", "latents=observation.latent", "STREAM=FEATURE"),
        default=[],
        metavar="STREAM=FEATURE",
        help=(
            "read the model's stream STREAM from the dataset feature FEATURE, e.g. "
            "--feature latents=observation.latent (repeatable). With the reference model, "
            "unmapped streams are found from the dataset's feature shapes"
        ),
    )
    v.add_argument(
        "--model",
        type=MODEL,
        default=None,
        help=(
            "module:factory returning your packed model (see docs/verify.md); with "
            "--inference: lingbot_va (LeRobot's LingBot-VA served to several robots)"
        ),
    )
    v.add_argument(
        "--reference",
        type=FACTORY,
        default=None,
        help=(
            "module:factory called with the packed model, returning the unpacked baseline "
            "(default: the model's reference() if it has one, else a copy of the model)"
        ),
    )


def _add_optimizer_and_output_options(v: argparse.ArgumentParser) -> None:
    """AdamW, the leak check, the report and the process."""
    v.add_argument("--seed", type=whole(0, 2**63 - 1, "a seed"), default=0)
    v.add_argument(
        "--lr",
        type=real(0, 10, "a learning rate", above=True),
        default=1e-4,
        help="AdamW learning rate (default 1e-4)",
    )
    v.add_argument(
        "--adam-eps",
        type=real(0, 1, "AdamW's eps"),
        default=1e-6,
        help="AdamW eps (default 1e-6: keeps fp32 rounding noise of zero gradients below eps)",
    )
    v.add_argument("--no-leak-check", dest="leak_check", action="store_false")
    v.add_argument(
        "--no-check-finite",
        dest="check_finite",
        action="store_false",
        help="do not refuse data holding NaN or inf (by default the episode and key are named)",
    )
    v.add_argument(
        "--json", type=report_path(), default=None, metavar="PATH", help="write the report as JSON"
    )
    v.add_argument(
        "--threads",
        type=whole(1, 4096, "CPU threads"),
        default=None,
        help=(
            "CPU threads for torch (default: $OMP_NUM_THREADS if set, else 1: the models are "
            "small, and more threads on a busy machine make verify ~10x slower)"
        ),
    )
    v.add_argument(
        "--traceback", action="store_true", help="on an error, print the full traceback too"
    )


def _progress(line: str) -> None:
    print(f"  .. {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    _check_json_path(args.json)
    restore = _set_threads(args.threads)
    try:
        return _run(args)
    finally:
        restore()  # main() called from Python (a test, a notebook) leaves torch as it was


def _run(args: argparse.Namespace) -> int:
    if args.inference:
        return _run_inference(args)
    if args.context_cache:
        raise ValueError("--context-cache is a flag of --inference; add --inference")
    if args.model == "lingbot_va":
        raise ValueError(
            "--model lingbot_va names the served model --inference proves; add --inference, "
            "or give a module:factory (packing.integrations.lingbot_va.testing:tiny_lingbot_va "
            "for its training)"
        )
    import dataclasses

    from packing.verify import VerifyConfig, launched_by_torchrun, run_verify, verify_rank

    # Every VerifyConfig field is a flag of the same name (--feature is parsed first).
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(VerifyConfig)
        if f.name != "features"
    }
    if launched_by_torchrun():  # the ranks come from the environment, not --nproc
        given["nproc"] = int(os.environ["WORLD_SIZE"])
    config = VerifyConfig(**{**given, "features": _parse_features(args.feature)})
    if launched_by_torchrun():
        first = int(os.environ["RANK"]) == 0
        result = verify_rank(config, progress=_progress if first else None)
        if result is None:
            return 0  # rank 0 reports and sets the exit status
        report = result
    else:
        report = run_verify(config, progress=_progress)  # --nproc > 1: spawns the ranks
    if args.json:  # written before the verdict is printed: a PASS is never followed by a crash
        report.to_json(args.json)
    print(report.format(), flush=True)
    if args.json:
        print(f"report written to {args.json}")
    if report.passed:
        return 0
    return 2 if report.diverged else 1


def _run_inference(args: argparse.Namespace) -> int:
    given = getattr(args, "given", {})  # main() sets it; absent when called otherwise
    other = sorted(flag for dest, flag in given.items() if dest not in INFERENCE_FLAGS)
    if other:
        flags = ", ".join(other)
        raise ValueError(
            f"--inference proves packing.serve on the built-in tiny model, fp32 CPU; it does "
            f"not take {flags} (flags of the training comparison: drop them, or drop "
            "--inference to verify your model's training; the bf16 GPU inference comparison "
            "is benchmarks/serving/bench_serve.py)"
        )
    if args.model is not None:
        return _run_lingbot_serving(args)
    from packing.serve import verify_inference

    report = verify_inference(
        mask=args.mask, document_mask=args.document_mask, seed=args.seed,
        context_cache=args.context_cache,
    )  # fmt: skip
    if args.json:
        report.to_json(args.json)
    print(report.format(), flush=True)
    return 0 if report.passed else 1


def _run_lingbot_serving(args: argparse.Namespace) -> int:
    """``--inference --model lingbot_va``: LeRobot's LingBot-VA served to several robots at
    once equals its own policy run for each robot alone (tiny, fp32 CPU)."""
    if args.model != "lingbot_va":
        raise ValueError(
            f"--inference --model {args.model}: the served models it proves are 'lingbot_va' "
            "(LeRobot's LingBot-VA); drop --model for the built-in DiT"
        )
    from packing.integrations.lingbot_va import prove_serving

    report = prove_serving(None if args.document_mask else "no_document_mask")
    verdict = "PASS" if report.ok else "FAIL"
    print(
        f"{verdict}: lingbot_va served, {report.chunks} chunks of 4 robots vs LeRobot alone: "
        f"latents max |diff| {report.latents:.2e}, actions {report.actions:.2e} (tol 1e-5); "
        f"fullest pack {report.max_pack} robots, mixed steps {report.mixed_steps}, "
        f"steps by pack {report.pack_kinds}, evicted slots {report.evicted}, "
        f"failed robots {sorted(report.errors) or 'none'}",
        flush=True,
    )
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(vars(report), indent=2))
    return 0 if report.ok else 1


def _check_json_path(path: str | None) -> None:
    """Try writing the report now (the parser checked its folder): a report that cannot be
    written must not cost a whole comparison."""
    if path is None:
        return
    p = Path(path)
    existed = p.exists()
    try:
        with open(p, "a"):
            pass
    except OSError as e:
        raise PermissionError(
            f"--json {path} cannot be written ({e.strerror}); write the report elsewhere"
        ) from e
    if not existed:
        p.unlink()


def _set_threads(threads: int | None) -> Callable[[], None]:
    """One CPU thread unless the user says otherwise (--threads, or $OMP_NUM_THREADS); returns
    what restores the previous setting."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if threads is not None and not 1 <= threads <= (cores or 1):
        raise ValueError(
            f"--threads {threads} must be in [1, {cores}] (the cores this process may use); "
            "more threads than cores only slow torch down"
        )
    if threads is None and os.environ.get("OMP_NUM_THREADS"):
        return lambda: None  # torch already follows it
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads or 1)
    return lambda: torch.set_num_threads(before)


def _parse_features(pairs: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        stream, sep, feature = pair.partition("=")
        if not sep or not stream or not feature:
            raise ValueError(
                f"--feature {pair!r}: expected STREAM=FEATURE, e.g. "
                "--feature latents=observation.latent"
            )
        if stream in out:
            raise ValueError(f"--feature: stream {stream!r} is mapped twice")
        out[stream] = feature
    return out
