#!/usr/bin/env bash
# Issue 12 on 2 GPUs of one host (nvidia-h200-x2), one stage per device call (each < 8 min):
#
#   bash benchmarks/gpu_fsdp.sh seed      # bench_fsdp seed regime, full depth        ~6 min
#   bash benchmarks/gpu_fsdp.sh short     # short regime + recompiles over 100 packs  ~5.5 min
#   bash benchmarks/gpu_fsdp.sh verify    # packing verify on 2 ranks (NCCL, bf16) + budget  ~5 min
#   bash benchmarks/gpu_fsdp.sh sweep     # micro-step sweep for the §6 fit           ~4.5 min
#
# NPROC (default 2) ranks; NVLink multicast stays off. Results: $OUT/<stage>/ (OUT defaults
# to .bench_out/). FA4 is used when /tmp/site has it (installed below from .whl/p1 + p2 as
# gpu_all.sh does, or already there on a warm machine); else Flex, and the table says so.
set -uo pipefail
[ $# -ge 1 ] || { sed -n 2,11p "$0"; exit 2; }
OUT=${OUT:-.bench_out}
NPROC=${NPROC:-2}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
# FA4 wheels carried in .whl/p1 + .whl/p2 (gpu_all.sh's scheme): install once per machine.
mkdir -p /tmp/whl
for d in .whl/p1 .whl/p2; do [ -d "$d" ] && cp -n "$d"/* /tmp/whl/ 2>/dev/null; done
if [ ! -d /tmp/site/flash_attn ] && [ -f /tmp/whl/cu13.part.aa ] && [ -f /tmp/whl/cu13.part.ab ]; then
  cat /tmp/whl/cu13.part.aa /tmp/whl/cu13.part.ab \
    > /tmp/whl/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/whl/*.whl \
    && echo "FA4 installed to /tmp/site" || echo "FA4 install FAILED"
fi
python3 -c "import torch, packing.attention._packed as a; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'fa4', a.fa4_available())"
TR="torchrun --nproc-per-node $NPROC"
t() {
  local lim=$1 rc; shift; echo "=== $* (limit ${lim}s) $(date +%T)"
  timeout "$lim" "$@"; rc=$?; echo "=== rc=$rc $(date +%T)"; return $rc
}
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
