#!/usr/bin/env bash
# Everything the project runs on the GPU machine, by stage (each stays under the device tool's
# 10-minute limit per command). Run from the repository root on the GPU machine:
#
#   bash benchmarks/gpu_all.sh tests       # every GPU test (torch's varlen kernel unless FA4 is
#                                          # installed), with the count of tests that ran
#   bash benchmarks/gpu_all.sh blockmask   # block-mask build vs create_block_mask (plain mask_mod)
#   bash benchmarks/gpu_all.sh attention   # every kernel, per-episode baselines, fill axis
#   bash benchmarks/gpu_all.sh fillprobe   # per-kernel time of a half-empty pack vs tight (Flex)
#   bash benchmarks/gpu_all.sh verify      # packing verify in bf16 (tiny model; head dim 128)
#   bash benchmarks/gpu_all.sh step        # 4-block training step, one GPU (REGIMES, VARIANTS)
#   bash benchmarks/gpu_all.sh budget      # token budget finder, unsharded and under FSDP2
#
# Stages can be chained: `bash benchmarks/gpu_all.sh tests blockmask`.
#
# flash-attn-4 (FA4) is 8 wheels, one of 92 MB; a device call carries 64 MiB, so they travel
# in two calls while the machine stays warm: .whl/p1 (the small
# wheels and the first half of the big one) and .whl/p2 (the second half). Each call copies
# what it carries to /tmp/whl; once both halves are there the wheels are installed into
# /tmp/site, which stays while the machine is warm. REQUIRE_FA4=1 stops at once if FA4 is not
# importable. Without FA4 every stage still runs and says so.
#
# Results: $OUT/<stage>/*.json and $OUT/<stage>.log (OUT defaults to .bench_out/).
set -uo pipefail
[ $# -ge 1 ] || { sed -n 2,15p "$0"; exit 2; }
OUT=${OUT:-.bench_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_all.log") 2>&1
source benchmarks/gpu_env.sh  # FA4 (and diffusers) from the carried wheels; t LIMIT CMD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu,memory.used --format=csv
if [ "${REQUIRE_FA4:-0}" = 1 ] && ! python3 -c "import packing.attention._packed as a, sys; sys.exit(not a.fa4_available())"; then
  echo "REQUIRE_FA4=1 but flash-attn-4 is not importable (machine not warm?): stopping"; exit 3
fi

M=benchmarks.verify_models:head_dim_128

for STAGE in "$@"; do
  R=$OUT/$STAGE
  mkdir -p "$R"
  case $STAGE in
  tests)
    # -rA lists every test's outcome; the summary line counts the ones that ran.
    t "${TEST_LIMIT:-420}" python3 -m pytest tests/test_gpu.py -q -rA -p no:cacheprovider \
      2>&1 | tee "$R/gpu_tests.txt" | grep -E "passed|failed|error|PASSED|FAILED|SKIPPED" | tail -80
    ;;
  blockmask)
    t 330 python3 benchmarks/bench_block_mask.py --out "$R/block_mask.json"
    ;;
  attention)
    t "${ATT_LIMIT:-480}" python3 benchmarks/bench_attention.py --fills "${FILLS:-0.5,0.75,1.0}" \
      --masks "${MASKS:-document,frame_causal,cross}" --out "$R/attention.json"
    ;;
  fillprobe)
    t 300 python3 benchmarks/probe_fill.py --out "$R/probe_fill.json"
    ;;
  verify)
    t 90 python3 -m packing verify --device cuda --dtype bfloat16 --json "$R/verify_bf16.json"
    t 90 python3 -m packing verify --device cuda --dtype bfloat16 --model $M --json "$R/verify_hd128.json"
    ;;
  step)
    t "${STEP_LIMIT:-540}" python3 benchmarks/bench_step.py --steps "${STEPS:-10}" --long-steps "${LONG_STEPS:-0}" \
      --regimes "${REGIMES:-seed,short}" --variants "${VARIANTS:-unpacked,packed}" \
      --profile --out "$R/step.json"
    ;;
  budget)
    t 150 python3 benchmarks/find_token_budget.py --preset wan_2_2_5b --depth 30 --out "$R/token_budget_5b.json"
    # under FSDP2 on this one GPU (~4.5 min): the memory model and its N = 1, 2, 4, 8 answers
    t 360 torchrun --nproc-per-node 1 benchmarks/fsdp_budget.py --out "$R" 2>&1 | tail -24
    ;;
  *)
    echo "unknown stage $STAGE"; exit 2
    ;;
  esac
  ls -la "$R"
done
