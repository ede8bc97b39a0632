"""The ``packing`` console script, one module a subcommand::

    packing verify    packed == unpacked training (and --inference: packed serving)   _verify.py
    packing budget    tokens per GPU from the stated memory model                      _budget.py
    packing encode    a LeRobot video dataset -> a latent dataset                       _encode.py
    packing serve     the policy server for robots                                      _serve.py

`main` parses with the shared parser (``_parser.py``: one-line usage errors, and a check on
every flag's value), dispatches through one table (``_main.COMMANDS``) and gives every
subcommand the same exit status: 0 done, 1 verify's comparison failed, 2 bad input, usage or
environment (one line naming the problem and the fix), 3 a crash inside a library, 130
Ctrl-C (one line). Only argparse is imported until a command runs: ``packing --help`` does not
load torch. The commands use the other folders through their facades only.
"""

from packing.cli._main import build_parser, main
from packing.cli._verify import EXIT_STATUS

__all__ = ["EXIT_STATUS", "build_parser", "main"]
