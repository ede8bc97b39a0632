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
# FA4 travels as wheels in two device calls (see benchmarks/gpu_all.sh): $WHL/p1 (the small
# wheels and the first half of the 92 MB one) in the first, $WHL/p2 in the second; they are
# collected in /tmp/whl and installed into /tmp/site once both halves are there. Without FA4
# `auto` resolves to Flex and the run says so (the "attention" column).
set -uo pipefail
OUT=${OUT:-.bench_out}
WHL=${WHL:-.whl}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" /tmp/whl
for d in "$WHL/p1" "$WHL/p2"; do [ -d "$d" ] && cp -n "$d"/* /tmp/whl/ 2>/dev/null; done
if [ ! -d /tmp/site/flash_attn ] && [ -f /tmp/whl/cu13.part.aa ] && [ -f /tmp/whl/cu13.part.ab ]; then
  cat /tmp/whl/cu13.part.aa /tmp/whl/cu13.part.ab \
    > /tmp/whl/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
  rm -f /tmp/whl/cu13.part.*
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/whl/*.whl \
    && echo "FA4 installed to /tmp/site" || echo "FA4 install FAILED"
fi
if [ -d "$WHL/diffusers" ] && [ ! -d /tmp/site_diffusers/diffusers ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_diffusers \
    "$WHL"/diffusers/*.whl && echo "diffusers installed to /tmp/site_diffusers" \
    || echo "diffusers install FAILED"
fi
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site_diffusers
export HF_HUB_OFFLINE=1
python3 -c "import torch, packing.attention._packed as a; print('torch', torch.__version__, torch.cuda.get_device_name(0), 'fa4', a.fa4_available())"
t() { local lim=$1; shift; echo "=== $* (limit ${lim}s) $(date +%T)"; timeout "$lim" "$@"; echo "=== rc=$? $(date +%T)"; }
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
