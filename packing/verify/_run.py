"""`run_verify`: ``packing verify`` in one process, or ``nproc`` spawned ranks.

It sits above both ways of running, so neither imports the other::

    _run --> _command       (one process: prepare, plan, compare)
    _run --> _distributed --> _command   (nproc > 1: the same steps on every rank)
"""

from __future__ import annotations

from collections.abc import Callable

from packing.verify._command import VerifyConfig, build_reference, prepare
from packing.verify._harness import compare_batches
from packing.verify._report import VerifyReport

__all__ = ["run_verify"]


def run_verify(config: VerifyConfig, progress: Callable[[str], None] | None = None) -> VerifyReport:
    """``packing verify`` in one process: load data and model, plan packs, compare, check
    leaks (``config.nproc > 1``: `packing.verify._distributed.run_verify_distributed`)."""
    from packing.planning import plan_packs

    if config.nproc > 1:
        # Imported here, as before the split: the one-process path never loads that module.
        from packing.verify._distributed import run_verify_distributed

        return run_verify_distributed(config, progress)
    setup = prepare(config)
    reference, reference_name = build_reference(config, setup.model)
    packs = plan_packs(setup.lengths, setup.budget).packs
    singles = [setup.unpacked([ep]) for ep in setup.episodes]
    packed = [setup.packed([setup.episodes[i] for i in p]) for p in packs]
    return compare_batches(
        setup.model,
        reference,
        singles,
        packed,
        packs,
        config.run_options(),
        config=setup.info(config, reference=reference_name),
        progress=progress,
    )
