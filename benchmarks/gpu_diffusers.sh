#!/usr/bin/env bash
# One device call, one H200 (or GPU 0): the diffusers Wan integration on the GPU.
#
#   OUT=.bench_out/wan bash benchmarks/gpu_diffusers.sh      # carry: .whl/diffusers (18 MB)
#
# For FA4 (auto's fastest kernel) install it first on the same warm machine, in two calls that
# carry the wheel's halves (64 MiB carry limit): `bash benchmarks/gpu_diffusers.sh fa4` with
# carry .whl/p1, then the same with carry .whl/p2 (as gpu_all.sh's preamble does). Without FA4
# the packed run uses Flex (Triton) and says so in its "attention" column.
#
# 1. installs diffusers 0.42.1 and its pure deps from .whl/diffusers into /tmp/site_diffusers
#    (the GPU machine has no internet; numpy/torch are the machine's own);
# 2. packing verify, bf16 autocast, tiny Wan 2.2 TI2V with head dim 128 (FA4 varlen with
#    flash-attn-4 on PYTHONPATH, else Flex) against the unmodified model per episode;
# 3. benchmarks/bench_diffusers_wan.py: Wan-2.2-TI2V-5B config, 4 blocks, packed auto vs
#    diffusers' fastest backend per episode, seed and short regimes.
# Expected on the H200: ~1 min install + verify, ~3 min benchmark (compiles included); the
# limits (75 s + 200 s) keep the call under 5 minutes, and the benchmark writes its JSON after
# every variant, so a cut run keeps its finished rows.
# Results: $OUT/verify_wan_bf16.{json,txt}, $OUT/diffusers_wan.{json,md}, $OUT/gpu_diffusers.log
set -uo pipefail
OUT=${OUT:-.bench_out/wan}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
exec > >(tee -a "$OUT/gpu_diffusers.log") 2>&1
if [ "${1:-}" = fa4 ]; then
  mkdir -p /tmp/whl
  for d in .whl/p1 .whl/p2; do [ -d "$d" ] && cp -n "$d"/* /tmp/whl/ 2>/dev/null; done
  if [ -f /tmp/whl/cu13.part.aa ] && [ -f /tmp/whl/cu13.part.ab ]; then
    cat /tmp/whl/cu13.part.aa /tmp/whl/cu13.part.ab \
      > /tmp/whl/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
    rm /tmp/whl/cu13.part.*
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/whl/*.whl \
      && echo "FA4 installed to /tmp/site" || echo "FA4 install FAILED"
  else
    echo "FA4: first half staged in /tmp/whl; run again carrying .whl/p2"
  fi
  exit 0
fi
export PYTHONPATH=.:/tmp/site_diffusers:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
if ! python3 -c "import diffusers" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_diffusers .whl/diffusers/*.whl \
    && echo "diffusers installed to /tmp/site_diffusers" || { echo "diffusers install FAILED"; exit 3; }
fi
python3 -c "import torch, diffusers, packing.attention._packed as a; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'gpu', torch.cuda.get_device_name(0), 'fa4', a.fa4_available())"

t() { local lim=$1; shift; echo "=== $* (limit ${lim}s)"; timeout "$lim" "$@"; echo "=== rc=$? $(date +%T)"; }

t "${VERIFY_LIMIT:-75}" python3 -m packing verify --device cuda --dtype bfloat16 --model benchmarks.verify_models:wan_head_dim_128 \
  --json "$OUT/verify_wan_bf16.json" 2>&1 | tee "$OUT/verify_wan_bf16.txt"
t "${BENCH_LIMIT:-200}" python3 benchmarks/bench_diffusers_wan.py --out "$OUT" ${BENCH_ARGS:-}
