"""``main``: parse, dispatch to the subcommand's module, and turn what it raises into the exit
status every subcommand shares.

    0  done (verify: within tolerance)      2  bad input, usage or environment: one line
    1  verify's comparison ran and failed   3  a crash inside torch, a library or the model
  130  interrupted (Ctrl-C): one line saying what is kept
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from types import ModuleType

from packing.cli import _budget, _encode, _serve, _verify
from packing.cli._parser import Interrupted, Parser, given_flags

__all__ = ["COMMANDS", "build_parser", "main"]

# The dispatch table: each module gives ``add_parser(sub)`` and ``run(args) -> exit status``.
COMMANDS: dict[str, ModuleType] = {
    "verify": _verify,
    "budget": _budget,
    "serve": _serve,
    "encode": _encode,
}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="packing",
        description="Pack whole robot episodes into one sequence, and prove it changes nothing.",
    )
    parser.add_argument("--version", action="version", version=f"packing {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS.values():
        module.add_parser(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("packing")
    except PackageNotFoundError:  # run from a source tree that is not installed
        from packing import __version__

        return __version__


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)  # usage errors: one line (`Parser`)
    except SystemExit as e:  # --help and --version exit 0 as argparse does
        if e.code == 2:
            return 2  # the same status, returned: main() called from Python is a function
        raise
    if args.command is None:
        parser.print_help()
        return 2
    sub = _subparser(parser, args.command)
    args.given = given_flags(sub, argv[argv.index(args.command) + 1 :])
    try:
        return int(COMMANDS[args.command].run(args))
    except KeyboardInterrupt as e:  # Ctrl-C: one line, no traceback, the shell's 130
        said = str(e) if isinstance(e, Interrupted) else "interrupted"
        print(f"packing {args.command}: {said}", file=sys.stderr, flush=True)
        return 130
    except Exception as e:  # the contract: 2 bad input or environment, 3 a crash
        tb = getattr(args, "traceback", False)
        if tb:
            traceback.print_exc()
        print(f"packing {args.command}: error: {_one_line(e, tb)}", file=sys.stderr)
        return 2 if _is_input_error(e) else 3


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:  # argparse keeps its subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise LookupError(name)


def _is_input_error(e: BaseException) -> bool:
    """An error packing raised on bad input or environment (exit 2): a builtin ValueError,
    TypeError, LookupError, OSError, ImportError or AttributeError, or one of packing's own.
    Anything else -- an error from inside torch, a library or the user's model while the
    command ran -- is a crash (exit 3)."""
    known = (ValueError, TypeError, LookupError, OSError, ImportError, AttributeError)
    own = type(e).__module__.startswith("packing.")
    return (isinstance(e, known) and type(e).__module__ == "builtins") or own


def _one_line(e: BaseException, traceback_shown: bool) -> str:
    """The exception as one line. Errors packing raises on bad input (builtin types, or its
    own) already name the problem and the fix; anything else (an error from inside a library
    or a user's model) is named by its type, with a pointer to ``--traceback``."""
    args = e.args
    # KeyError's str() adds quotes around its message.
    text = args[0] if isinstance(e, KeyError) and len(args) == 1 else str(e)
    text = " ".join(str(text).split()) or type(e).__name__
    if _is_input_error(e):
        return text
    return f"{type(e).__name__}: {text}" + ("" if traceback_shown else " (--traceback shows where)")
