#!/usr/bin/env bash
# The baselines issue's one-GPU runs (bench_step: packed vs a lean per-episode loop vs length
# bucketing, and the whole-step fill axis), by stage, from the repository root on the GPU:
#
#   bash benchmarks/gpu_baselines.sh smoke    # 1 block, 2 steps: every variant compiles and runs
#   bash benchmarks/gpu_baselines.sh step     # 4 blocks at Wan-2.2-5B width, seed + short
#   bash benchmarks/gpu_baselines.sh wan30    # diffusers Wan-2.2-TI2V-5B config, 30 blocks
#
# Knobs (environment): STEP_LIMIT, STEPS, REGIMES, VARIANTS, VARIANT_LIMIT (seconds a baseline
# variant may take, compile included), STEP_ARGS (more bench_step flags, e.g. --profile),
# WAN_LIMIT, WAN_ARGS. The wan30 stage installs diffusers from $WHL/diffusers (its wheels and
# their pure-Python needs, ~17 MB: one carry) into /tmp/site_diffusers.
#
# FA4 travels as wheels in two device calls (benchmarks/gpu_env.sh): $WHL/p1 (the small
# wheels and the first half of the 92 MB one) in the first, $WHL/p2 in the second; they are
# collected in /tmp/whl and installed into /tmp/site once both halves are there. Without FA4
# `auto` resolves to Flex and the run says so (the "attention" column).
set -uo pipefail
OUT=${OUT:-.bench_out}
WHL=${WHL:-.whl}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh  # FA4 and diffusers from the carried wheels; t LIMIT CMD
V=lean,packed,bucket_sdpa,bucket_flex,bucket_crop,fill
for STAGE in "$@"; do
  case $STAGE in
  smoke)
    t "${SMOKE_LIMIT:-200}" python3 benchmarks/bench_step.py --depth 1 --steps 2 --warmup 1 \
      --variants $V --fills 1.0,0.5 --out "$OUT/step_smoke.json" 2>&1 | tee "$OUT/smoke.log" \
      | grep -vE "^\{'|^\[\{" ;;
  step)
    t "${STEP_LIMIT:-480}" python3 benchmarks/bench_step.py --depth 4 --steps "${STEPS:-12}" \
      --warmup 3 --regimes "${REGIMES:-seed,short}" --variants "${VARIANTS:-$V,unpacked}" \
      --variant-limit "${VARIANT_LIMIT:-0}" ${STEP_ARGS:-} \
      --out "$OUT/step_baselines.json" 2>&1 | tee "$OUT/step.log" | grep -vE "^\{'|^\[\{" ;;
  wan30)
    t "${WAN_LIMIT:-560}" python3 benchmarks/bench_diffusers_wan.py --depth 30 \
      --checkpointing seed=both,short=packed --steps "${STEPS:-3}" --warmup 1 ${WAN_ARGS:-} \
      --out "$OUT/wan30" 2>&1 | tee "$OUT/wan30.log" ;;
  *) echo "unknown stage $STAGE"; exit 2 ;;
  esac
done
