"""The benchmarks' shared harness: timing, FLOPs, provenance and the result JSON.

    from benchmarks import harness
    t = harness.time_fn(step, device="cuda", warmup=3, iters=20)   # median and spread, ms
    flops = harness.dit_flops(cfg, [(video, action, text), ...])    # model and hardware counts
    row.update(harness.mfu(flops, seconds))                         # against both named peaks
    harness.write_json("step", args, {"rows": rows})                # + machine and provenance

The scripts run as plain programs (``python benchmarks/step/bench_step.py``); each puts the
repository root on ``sys.path`` first so ``benchmarks.harness`` imports.
"""

from benchmarks.harness.flops import (
    DATASHEET_PEAK_TFLOPS,
    MEASURED_PEAK_TFLOPS,
    PEAKS,
    ZERO,
    EpisodeShape,
    Flops,
    LingbotEpisode,
    attention_flops,
    dit_flops,
    lingbot_flops,
    mfu,
    pair_flops,
    tflops,
)
from benchmarks.harness.lengths import fill_pack, seeded_lengths
from benchmarks.harness.provenance import provenance_record, tree_hash
from benchmarks.harness.results import (
    RESULTS_DIR,
    base_parser,
    machine_info,
    markdown_table,
    write_doc,
    write_json,
)
from benchmarks.harness.timing import (
    Timing,
    dynamo_counters,
    elapsed_ms,
    mark,
    mem_gb,
    summarize,
    sync,
    time_fn,
    time_host,
    time_paired,
)

__all__ = [
    "DATASHEET_PEAK_TFLOPS",
    "MEASURED_PEAK_TFLOPS",
    "PEAKS",
    "RESULTS_DIR",
    "ZERO",
    "EpisodeShape",
    "Flops",
    "LingbotEpisode",
    "Timing",
    "attention_flops",
    "base_parser",
    "dit_flops",
    "dynamo_counters",
    "elapsed_ms",
    "fill_pack",
    "lingbot_flops",
    "machine_info",
    "mark",
    "markdown_table",
    "mem_gb",
    "mfu",
    "pair_flops",
    "provenance_record",
    "seeded_lengths",
    "summarize",
    "sync",
    "tflops",
    "time_fn",
    "time_host",
    "time_paired",
    "tree_hash",
    "write_doc",
    "write_json",
]
