"""The ``packing`` console script. One subcommand today: ``packing verify``.

::

    packing verify                          # embedded default dataset, tiny reference model, fp32 CPU
    packing verify --no-document-mask       # proof it can fail: reports the leak, exits 1
    packing verify --dataset ~/data/my_robot --model my_models:build --json report.json
    packing verify --device cuda --dtype bfloat16 --compile

Exit status: 0 when packed and unpacked training agree within tolerance, 1 when they do not,
2 on a usage or set-up error (bad flag, missing dataset, a model that breaks the protocol).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="packing",
        description="Pack whole robot episodes into one sequence, and prove it changes nothing.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
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
    )
    v.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    v.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="float32 runs the model as is; bfloat16/float16 use autocast with fp32 weights",
    )
    v.add_argument("--compile", action="store_true", help="torch.compile both models")
    v.add_argument("--steps", type=int, default=3, help="AdamW steps (default 3)")
    v.add_argument("--episodes", type=int, default=None, help="first N episodes (default all)")
    v.add_argument(
        "--token-budget",
        type=int,
        default=None,
        help="tokens per pack (default: about a third of a step's tokens)",
    )
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
        choices=["global", "per-micro-step"],
        help=(
            "global (correct): one denominator for the whole step; per-micro-step: each pack's "
            "own mean, averaged (the mean-of-means mistake; verify must FAIL)"
        ),
    )
    v.add_argument("--dataset", default=None, help="a local LeRobot v3 root (default: embedded)")
    v.add_argument(
        "--model",
        default=None,
        help="module:factory returning your packed model (see docs/verify.md)",
    )
    v.add_argument(
        "--reference",
        default=None,
        help=(
            "module:factory called with the packed model, returning the unpacked baseline "
            "(default: the model's reference() if it has one, else a copy of the model)"
        ),
    )
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    v.add_argument(
        "--adam-eps",
        type=float,
        default=1e-6,
        help="AdamW eps (default 1e-6: keeps fp32 rounding noise of zero gradients below eps)",
    )
    v.add_argument("--no-leak-check", dest="leak_check", action="store_false")
    v.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON")
    return parser


def _progress(line: str) -> None:
    print(f"  .. {line}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "verify":
        parser.print_help()
        return 2
    from packing.verify import VerifyConfig, run_verify

    try:
        config = VerifyConfig(
            device=args.device,
            dtype=args.dtype,
            compile=args.compile,
            steps=args.steps,
            episodes=args.episodes,
            token_budget=args.token_budget,
            mask=args.mask,
            document_mask=args.document_mask,
            reduction=args.reduction,
            loss_normaliser=args.loss_normaliser,
            dataset=args.dataset,
            model=args.model,
            reference=args.reference,
            seed=args.seed,
            lr=args.lr,
            adam_eps=args.adam_eps,
            leak_check=args.leak_check,
        )
        report = run_verify(config, progress=_progress)
    except (ValueError, TypeError, KeyError, AttributeError, ImportError, FileNotFoundError) as e:
        print(f"packing verify: error: {e}", file=sys.stderr)
        return 2
    print(report.format(), flush=True)
    if args.json:
        report.to_json(args.json)
        print(f"report written to {args.json}")
    return 0 if report.passed else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
