"""The parser every ``packing`` subcommand is built with: a usage error is ONE line.

argparse prints the whole usage block (2 to 17 lines) before its message; the contract of
``packing`` (exit 2, one line on stderr naming the problem and the fix) wants one line::

    packing verify: error: argument --steps: invalid int value: '2.5' (packing verify --help)

`build_parser` makes the top-level parser a `Parser`; ``sub.add_parser(...)`` builds every
subcommand's parser of the same class (argparse's ``parser_class`` default), so a subcommand
module (``packing/_budget_command.py``'s ``add_parser(sub)``) gets it without doing anything.
Imports only argparse: ``packing --help`` stays fast.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["Parser", "given_flags"]


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr, exit status 2."""

    def error(self, message: str) -> NoReturn:
        line = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {line} (see {self.prog} --help)\n")


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
