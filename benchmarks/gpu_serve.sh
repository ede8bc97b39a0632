#!/usr/bin/env bash
# One H200 call for the serve benchmark (docs/inference.md "Benchmark"): the CPU proof first
# (a sanity check that the tree is right), then bench_serve.py under a deadline so the call
# ends inside the device tool's limit; every finished arm is in the JSON even if it is cut.
#
#   OUT=/tmp/out DEADLINE=300 bash benchmarks/gpu_serve.sh
#
# Results: $OUT/serve.json, $OUT/serve.log.
set -uo pipefail
OUT=${OUT:-.bench_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
exec > >(tee -a "$OUT/serve.log") 2>&1
nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv
python3 -m packing verify --inference | head -3
python3 benchmarks/bench_serve.py --device cuda --out "$OUT/serve.json" \
    --deadline-s "${DEADLINE:-300}" ${BENCH_ARGS:-}
