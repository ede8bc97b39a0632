"""The proof that packing changes nothing: packed vs unpacked loss and every gradient.

- `VerifyConfig` + `run_verify`: what ``packing verify`` runs (one process, or ``nproc``
  ranks), returning a `VerifyReport` judged against `Tolerances`.
- `compare_packed_unpacked`: the harness on your own model, episodes and collate.
- `find_leaks`, `assert_no_leaks` -> `LeakReport`: does any episode's output depend on
  another episode's input?
- `load_factory` (``module:factory`` -> the callable), `launched_by_torchrun` and
  `verify_rank` (one rank of the distributed verify): what ``packing verify`` and
  ``packing serve`` are built from.
"""

from packing.verify._command import VerifyConfig, load_factory
from packing.verify._distributed import launched_by_torchrun, verify_rank
from packing.verify._harness import compare_packed_unpacked
from packing.verify._leak import Leak, LeakReport, assert_no_leaks, find_leaks
from packing.verify._report import Tolerances, VerifyReport
from packing.verify._run import run_verify

__all__ = [
    "Leak",
    "LeakReport",
    "Tolerances",
    "VerifyConfig",
    "VerifyReport",
    "assert_no_leaks",
    "compare_packed_unpacked",
    "find_leaks",
    "launched_by_torchrun",
    "load_factory",
    "run_verify",
    "verify_rank",
]
