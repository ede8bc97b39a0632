"""The parser every ``packing`` subcommand is built with, and the checks every flag goes through.

A usage error is ONE line on stderr, exit status 2 (argparse prints its whole usage block, 2 to
17 lines, before its message)::

    packing budget: error: argument --depth: 100000 is above 1,000 (blocks; 1 to 1,000) (see packing budget --help)

Every option that takes a value is checked as it is parsed: ``Parser.add_argument`` refuses
(at build time, so every test that builds the parser fails) an option with neither
``choices`` nor one of the checks below as its ``type``. A number is bounded on both sides and
finite, a path exists where it must, a device is spelled as torch spells one::

    whole(1, 1_000, "blocks")        "12" -> 12, "5e9" -> refused (above 1,000), "2.5" -> refused
    real(0, 1e6, "GB", above=True)   "150" -> 150.0; "nan", "inf", "0" refused: not in (0, 1e6]
    folder("a LeRobot v3 root")      an existing directory, "~" expanded
    device()                         cpu, cuda, cuda:N, mps (whether the GPU is here: at run time)

Imports only argparse: ``packing --help`` stays fast and loads neither torch nor numpy.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

__all__ = [
    "Interrupted",
    "Parser",
    "device",
    "file",
    "folder",
    "given_flags",
    "is_checked",
    "pattern",
    "real",
    "report_path",
    "text",
    "whole",
]

T = TypeVar("T")
_MARK = "_packing_check"  # set on every check made below, read by `is_checked`


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with the line that says what is done and what a rerun does (``packing encode``
    raises it with its count of episodes written); ``main`` prints it and exits 130."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line, and whose options are checked."""

    def error(self, message: str) -> NoReturn:
        line = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {line} (see {self.prog} --help)\n")

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        if not is_checked(action):
            raise TypeError(
                f"{self.prog} {'/'.join(action.option_strings) or action.dest}: an option that "
                "takes a value needs choices= or a check of packing/cli/_parser.py as type= "
                "(whole, real, folder, file, device, text, pattern, report_path)"
            )
        return action


def is_checked(action: argparse.Action) -> bool:
    """True for a flag that takes no value, or whose value is a choice or goes through a check."""
    if action.nargs == 0 or isinstance(action, argparse._SubParsersAction):
        return True
    return action.choices is not None or getattr(action.type, _MARK, False)


def _check(name: str, fn: Callable[[str], T]) -> Callable[[str], T]:
    fn.__name__ = name  # argparse names the type in "invalid <name> value" messages
    setattr(fn, _MARK, True)
    return fn


MAX_TEXT = 4096  # characters of any string flag (a path, a name, a key)


def _plain(value: str, what: str) -> str:
    """A string flag's common rule: non-empty, printable, at most `MAX_TEXT` characters."""
    if not value.strip() or len(value) > MAX_TEXT or not value.isprintable():
        raise argparse.ArgumentTypeError(
            f"{value[:40]!r}{'...' if len(value) > 40 else ''} must be {what}: non-empty, "
            f"printable, at most {MAX_TEXT} characters"
        )
    return value


def whole(lo: int, hi: int, what: str) -> Callable[[str], int]:
    """A whole number in ``[lo, hi]``: ``12``, ``5_000``, or float notation that is whole
    (``5e9``); ``2.5``, ``nan`` and anything outside the bounds are refused."""

    def parse(value: str) -> int:
        n = _whole_number(value)
        if not lo <= n <= hi:
            side = f"below {lo:,}" if n < lo else f"above {hi:,}"
            raise argparse.ArgumentTypeError(f"{value} is {side} ({what}; {lo:,} to {hi:,})")
        return n

    return _check("whole number", parse)


def _whole_number(value: str) -> int:
    try:
        return int(value.replace("_", ""))
    except ValueError:
        pass
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not math.isfinite(number) or not number.is_integer():
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number")
    return int(number)


def real(lo: float, hi: float, what: str, *, above: bool = False) -> Callable[[str], float]:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``above=True``); nan and inf are
    refused."""

    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
        low_ok = x > lo if above else x >= lo
        if not math.isfinite(x) or not low_ok or x > hi:
            span = f"{'(' if above else '['}{lo:g}, {hi:g}]"
            raise argparse.ArgumentTypeError(f"{value} must be a finite number in {span} ({what})")
        return x

    return _check("number", parse)


def folder(what: str, *, also: tuple[str, ...] = ()) -> Callable[[str], str]:
    """An existing directory (``~`` expanded), or one of the names ``also``."""

    def parse(value: str) -> str:
        if value in also:
            return value
        path = Path(_plain(value, what)).expanduser()  # (Path("") would be ".")
        if not path.is_dir():
            why = "is a file" if path.exists() else "does not exist"
            raise argparse.ArgumentTypeError(f"{value} {why}; expected {what}")
        return os.fspath(path)

    return _check("folder", parse)


def file(what: str) -> Callable[[str], str]:
    """An existing file (``~`` expanded)."""

    def parse(value: str) -> str:
        path = Path(_plain(value, what)).expanduser()
        if not path.is_file():
            why = "is a folder" if path.is_dir() else "does not exist"
            raise argparse.ArgumentTypeError(f"{value} {why}; expected {what}")
        return os.fspath(path)

    return _check("file", parse)


def report_path() -> Callable[[str], str]:
    """A file path to write a report to: not a directory, in a folder that exists."""

    def parse(value: str) -> str:
        p = Path(_plain(value, "a file path")).expanduser()
        if p.is_dir():
            raise argparse.ArgumentTypeError(
                f"{value} is a directory; give a file path, e.g. {p / 'report.json'}"
            )
        if not p.parent.is_dir():
            raise argparse.ArgumentTypeError(
                f"{value}: the folder {p.parent} does not exist; create it first "
                f"(mkdir -p {p.parent}) or write the report elsewhere"
            )
        return os.fspath(p)

    return _check("path", parse)


_DEVICE = re.compile(r"(cpu|mps|cuda(:\d+)?)")


def device() -> Callable[[str], str]:
    """A torch device as written on the command line: ``cpu``, ``cuda``, ``cuda:N``, ``mps``.
    Whether that GPU is on this machine is the command's check (it needs torch)."""

    def parse(value: str) -> str:
        if not _DEVICE.fullmatch(value):
            raise argparse.ArgumentTypeError(
                f"{value[:40]!r} is not a torch device; use cpu, cuda or cuda:N"
            )
        return value

    return _check("device", parse)


def text(what: str) -> Callable[[str], str]:
    """A non-empty string without control characters, at most `MAX_TEXT` characters."""

    def parse(value: str) -> str:
        return _plain(value, what)

    return _check("text", parse)


def pattern(regex: str, example: str, what: str) -> Callable[[str], str]:
    """A string of a fixed form (``HxW``, ``module:factory``, ``STREAM=FEATURE``)."""
    compiled = re.compile(regex)

    def parse(value: str) -> str:
        if not compiled.fullmatch(_plain(value, what)):
            raise argparse.ArgumentTypeError(f"{value!r}: expected {what}, e.g. {example}")
        return value

    return _check(what, parse)


def given_flags(parser: argparse.ArgumentParser, argv: list[str]) -> dict[str, str]:
    """``{destination: flag}`` of the options the user actually typed in ``argv`` (a flag
    given with its default value counts as given), by parsing again with every default
    suppressed: ``["--no-document-mask"]`` -> ``{"document_mask": "--no-document-mask"}``."""
    saved = {a: a.default for a in parser._actions}  # argparse's own list of options
    try:
        for action in parser._actions:
            action.default = argparse.SUPPRESS
        namespace, _ = parser.parse_known_args(argv)
    finally:
        for action, default in saved.items():
            action.default = default
    flags = {a.dest: (a.option_strings or [a.dest])[-1] for a in parser._actions}
    return {dest: flags[dest] for dest in vars(namespace)}
