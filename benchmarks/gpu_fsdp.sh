#!/usr/bin/env bash
# Issue 12 on 2 GPUs of one host (nvidia-h200-x2), one stage per device call (each < 8 min):
#
#   bash benchmarks/gpu_fsdp.sh seed      # bench_fsdp seed regime, full depth        ~6 min
#   bash benchmarks/gpu_fsdp.sh short     # short regime + recompiles over 100 packs  ~5.5 min
#   bash benchmarks/gpu_fsdp.sh verify    # packing verify on 2 ranks (NCCL, bf16) + budget  ~5 min
#   bash benchmarks/gpu_fsdp.sh sweep     # micro-step sweep for the §6 fit           ~4.5 min
#
# NPROC (default 2) ranks; NVLink multicast stays off. Results: $OUT/<stage>/ (OUT defaults
# to .bench_out/). FA4 is used when /tmp/site has it (benchmarks/gpu_env.sh installs it from
# .whl/p1 + p2, or a warm machine already has it); else Flex, and the table says so.
set -uo pipefail
[ $# -ge 1 ] || { sed -n 2,11p "$0"; exit 2; }
OUT=${OUT:-.bench_out}
NPROC=${NPROC:-2}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=8
source benchmarks/gpu_env.sh  # FA4 from .whl/p1 + p2 (once per warm machine); t LIMIT CMD
TR="torchrun --nproc-per-node $NPROC"
quiet() { grep -v '^\[rank[1-9]'; }

for STAGE in "$@"; do
  R=$OUT/$STAGE
  mkdir -p "$R"
  case $STAGE in
  seed)
    t 540 $TR benchmarks/bench_fsdp.py --regime seed --steps 2 --time-limit 400 \
      --hard-limit 470 --out "$R" ${VARIANTS:+--variants $VARIANTS} 2>&1 | quiet | tail -40
    ;;
  short)
    t 540 $TR benchmarks/bench_fsdp.py --regime short --steps 4 --recompile-packs 100 \
      --time-limit 400 --hard-limit 470 --out "$R" ${VARIANTS:+--variants $VARIANTS} 2>&1 \
      | quiet | tail -40
    ;;
  verify)
    V="$TR -m packing verify --device cuda --dtype bfloat16"
    t 120 $V --json "$R/verify_fsdp_bf16.json" 2>&1 | tail -22 \
      || t 100 $V --fsdp-autocast --json "$R/verify_fsdp_bf16_autocast.json" 2>&1 | tail -12
    t 120 $V --model benchmarks.verify_models:head_dim_128 \
      --json "$R/verify_fsdp_bf16_hd128.json" 2>&1 | tail -22
    t 330 $TR benchmarks/fsdp_budget.py --modes full,ops,none --out "$R" 2>&1 | quiet | tail -30
    ;;
  sweep)
    t 540 $TR benchmarks/bench_fsdp.py --regime short --variants "" --sweep "${SWEEP:-1,2,4,8}" \
      --steps 3 --time-limit 400 --hard-limit 470 --out "$R" 2>&1 | quiet | tail -20
    ;;
  *) echo "unknown stage $STAGE (seed, short, verify, sweep)"; exit 2 ;;
  esac
done
