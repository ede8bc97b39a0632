#!/usr/bin/env bash
# One device call, one H200 (or GPU 0): the diffusers Wan integration on the GPU.
#
#   OUT=.bench_out/wan bash benchmarks/gpu_diffusers.sh      # carry: .whl/diffusers (~17 MB)
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
exec > >(tee -a "$OUT/gpu_diffusers.log") 2>&1
source benchmarks/gpu_env.sh  # FA4 halves and diffusers from the carried wheels; t LIMIT CMD
[ "${1:-}" = fa4 ] && exit 0  # a call that only stages FA4's wheels
python3 -c "import diffusers; print('diffusers', diffusers.__version__)" \
  || { echo "diffusers not importable: carry .whl/diffusers"; exit 3; }

t "${VERIFY_LIMIT:-75}" python3 -m packing verify --device cuda --dtype bfloat16 --model benchmarks.verify_models:wan_head_dim_128 \
  --json "$OUT/verify_wan_bf16.json" 2>&1 | tee "$OUT/verify_wan_bf16.txt"
t "${BENCH_LIMIT:-200}" python3 benchmarks/bench_diffusers_wan.py --out "$OUT" ${BENCH_ARGS:-}
