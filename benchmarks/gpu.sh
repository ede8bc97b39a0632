#!/usr/bin/env bash
# The one GPU entry: every benchmark the project runs on the GPU machine, by named stage.
# From the repository root on the GPU machine (results under $OUT, default .bench_out/):
#
#   bash benchmarks/gpu.sh serve       # serving: >= 200 requests an arm, Poisson sweep, padded
#                                      #   by length bucket, one at a time in its own shape, sync
#                                      #   check (SERVE_LIMIT 290 s)
#   bash benchmarks/gpu.sh step        # one-GPU step table, seed + short: packed vs lean (probed
#                                      #   attention), lean_whole, bucketing 4 buckets and
#                                      #   Open-Sora's (STEP_LIMIT 270 s a regime)
#   bash benchmarks/gpu.sh diffusers   # diffusers Wan, 30 blocks: packed vs batch 1 vs bucketed
#                                      #   (WAN_LIMIT 480 s; carry .whl/diffusers)
#   bash benchmarks/gpu.sh cache       # benchmarks/serving/bench_cache.py at 5B widths, 30 blocks (220 s)
#   bash benchmarks/gpu.sh encode      # benchmarks/data/bench_encode.py, when present (300 s)
#   bash benchmarks/gpu.sh lingtests   # LingBot-VA served, one call a stage, each carrying
#   bash benchmarks/gpu.sh lingserve   #   .whl/lingserve and .whl/lingbench: its CUDA tests and
#   bash benchmarks/gpu.sh lingserve_short  # the pool mask build (540 s); LingBot-VA's own
#                                      #   schedule vs LeRobot eager and compiled, 8 robots
#                                      #   out of step, and the one mixed pack shape at 8
#                                      #   robots (560 s); the
#                                      #   shortened video_exec_step schedule (560 s)
#                                      #   (COMPILED=0: without the compiled arm)
#   bash benchmarks/gpu.sh attention | blockmask | fillprobe | tests | verify | budget
#   NPROC=2 REGIME=seed bash benchmarks/gpu.sh fsdp     # two GPUs (nvidia-h200-x2; FSDP_ARGS)
#   bash benchmarks/gpu.sh fa4         # only stage the carried FA4 wheel half
#   bash benchmarks/gpu.sh all         # serve step diffusers encode, one after the other
#                                      #   (over 10 minutes: one device call a stage instead)
#
# One device call runs at most 10 minutes and carries at most 64 MiB. FA4 (flash-attn-4) is 8
# wheels, one of 92 MB, so it travels in two calls on one warm machine: .whl/p1 (the small
# cutlass wheels and the first half of the big one) and .whl/p2 (the second half and the
# rest). Each call copies what it carries to /tmp/whl; once both halves are there the wheels
# are installed into /tmp/site, which stays while the machine is warm. The plan of three calls:
#   call 1, carry .whl/p1:        OUT=$OUT bash benchmarks/gpu.sh serve
#   call 2, carry .whl/p2:        OUT=$OUT bash benchmarks/gpu.sh step       (FA4 installs first)
#   call 3, carry .whl/diffusers: OUT=$OUT bash benchmarks/gpu.sh diffusers
# Without FA4 every stage still runs, `auto` resolves to Flex, and each JSON says so.
#
# Every stage has its own time limit (the *_LIMIT variables) and its script writes the JSON
# after every row, so a cut stage still leaves JSON. $OUT/tree.json records the copy's
# `git rev-parse HEAD`, `git status --porcelain` and the hash of the files that ran (the copy's
# .git may show an older commit than the tree that ran); every result JSON has the same in
# its `provenance`.
#
# DRY=1 prints each stage's commands without running them; QUICK=1 runs them with --quick on
# the CPU (tiny sizes: tests/test_gpu_entry.py).
set -uo pipefail
[ $# -ge 1 ] || { sed -n 2,27p "$0"; exit 2; }
OUT=${OUT:-.bench_out}
WHL=${WHL:-.whl}
DRY=${DRY:-0}
QUICK=${QUICK:-0}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu.log") 2>&1

# -- the machine's Python environment, from the carried wheels --------------------------------
stage_wheels() {
  mkdir -p /tmp/whl
  for d in "$WHL/p1" "$WHL/p2"; do [ -d "$d" ] && cp -n "$d"/* /tmp/whl/ 2>/dev/null; done
  if [ ! -d /tmp/site/flash_attn ]; then
    if [ -f /tmp/whl/cu13.part.aa ] && [ -f /tmp/whl/cu13.part.ab ]; then
      cat /tmp/whl/cu13.part.aa /tmp/whl/cu13.part.ab \
        > /tmp/whl/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
      rm -f /tmp/whl/cu13.part.*
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/whl/*.whl \
        && echo "FA4 installed to /tmp/site" || echo "FA4 install FAILED"
    elif [ -f /tmp/whl/cu13.part.aa ] || [ -f /tmp/whl/cu13.part.ab ]; then
      echo "FA4: one half staged in /tmp/whl; the next call on this warm machine carries the other"
    fi
  fi
  if [ -d "$WHL/lingserve" ] && [ -d "$WHL/lingbench" ] && [ ! -d /tmp/site_ling/lerobot ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_ling \
      "$WHL"/lingserve/*.whl "$WHL"/lingbench/*.whl \
      && echo "lerobot and transformers installed to /tmp/site_ling" || echo "lingbot install FAILED"
  fi
  if [ -d "$WHL/diffusers" ] && [ ! -d /tmp/site_diffusers/diffusers ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_diffusers \
      "$WHL"/diffusers/*.whl && echo "diffusers installed to /tmp/site_diffusers" \
      || echo "diffusers install FAILED"
  fi
}
if [ "$DRY" != 1 ] && [ "$QUICK" != 1 ]; then stage_wheels; fi
PY=${PYTHON:-python3}
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site_ling:/tmp/site_diffusers${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

# -- what ran: the copy's git state and the hash of its files ---------------------------------
{
  echo "{"
  echo "  \"date_utc\": \"$(date -u +%FT%TZ)\","
  echo "  \"stages\": \"$*\","
  echo "  \"git_rev_parse_head\": \"$(git rev-parse HEAD 2>/dev/null || echo none)\","
  echo "  \"git_status_porcelain\": ["
  git status --porcelain 2>/dev/null | head -200 | sed 's/\\/\\\\/g; s/"/\\"/g; s/.*/    "&",/' | sed '$ s/,$//'
  echo "  ],"
  echo "  \"tree_sha256\": \"$($PY benchmarks/harness/provenance.py | cut -d' ' -f1)\""
  echo "}"
} > "$OUT/tree.json"
cat "$OUT/tree.json"
[ "$DRY" = 1 ] || $PY -c "import torch, packing.attention._packed as a; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no gpu', 'fa4', a.fa4_available())"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu,memory.used --format=csv

# t LIMIT CMD...: CMD under a timeout, its start, end and exit status logged (DRY: printed).
# QUICK=1 appends --quick --device cpu to a benchmark script's arguments.
t() {
  local lim=$1 rc; shift
  if [ "$QUICK" = 1 ]; then set -- "$@" --quick --device cpu; fi
  echo "=== $* (limit ${lim}s) $(date +%T)"
  [ "$DRY" = 1 ] && return 0
  timeout "$lim" "$@"; rc=$?; echo "=== rc=$rc $(date +%T)"; return $rc
}
TR="torchrun --nproc-per-node ${NPROC:-2}"
# GPU: the card in the LingBot-VA stages' file names (h200, h100; GPU= overrides), so a result
# names the machine it ran on
GPU=${GPU:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 \
  | grep -oE 'H[0-9]+' | tr 'H' 'h' || true)}
GPU=${GPU:-h200}
B=benchmarks

for STAGE in "$@"; do
  [ "$STAGE" = all ] && set -- serve step diffusers encode && break
done
for STAGE in "$@"; do
  R=$OUT/$STAGE
  mkdir -p "$R"
  case $STAGE in
  fa4) ;;  # the wheels were staged above
  serve)
    t "${SERVE_LIMIT:-290}" $PY $B/serving/bench_serve.py --configs "${SERVE_CONFIGS:-small}" \
      --requests "${REQUESTS:-200}" --long-requests "${LONG_REQUESTS:-48}" \
      --deadline-s "${SERVE_DEADLINE:-250}" --out "$R/serve.json" ${SERVE_ARGS:-}
    ;;
  cache)
    # the context cache (issue 34's goals): 5B widths, 30 blocks, short mix, 10 steps, graphs
    t "${CACHE_LIMIT:-220}" $PY $B/serving/bench_cache.py --device cuda --config 5b --blocks 30 \
      --cuda-graphs --deadline-s "${CACHE_DEADLINE:-180}" --out "$R/serve_cache_h200.json"
    ;;
  step)
    # one process a regime, each with its own limit and deadline, so a slow compile in one
    # regime cannot take the other's rows; per regime the rows run in this order
    for RG in ${REGIMES:-seed short}; do
      t "${STEP_LIMIT:-270}" $PY $B/step/bench_step.py --depth 4 --steps "${STEPS:-5}" --warmup 2 \
        --regimes "$RG" --variants "${VARIANTS:-packed,lean,bucket_sdpa,bucket_opensora,lean_whole}" \
        --variant-limit "${VARIANT_LIMIT:-90}" --deadline-s "${STEP_DEADLINE:-205}" --profile \
        --probe "${PROBE:-sdpa,sdpa_flash,sdpa_cudnn,sdpa_efficient,fa4}" --out "$R/step_$RG.json" \
        ${STEP_ARGS:-}
    done
    ;;
  diffusers)
    if [ "$DRY" != 1 ] && ! $PY -c "import diffusers" 2>/dev/null; then
      echo "diffusers not importable: carry .whl/diffusers"; continue
    fi
    t "${WAN_LIMIT:-480}" $PY $B/diffusers/bench_diffusers_wan.py --depth "${WAN_DEPTH:-30}" \
      --checkpointing seed=both,short=packed --regimes "${WAN_REGIMES:-short,seed}" \
      --variants "${WAN_VARIANTS:-packed,unpacked_bucketed,unpacked}" --steps "${STEPS:-3}" \
      --warmup 1 --deadline-s "${WAN_DEADLINE:-400}" --out "$R" ${WAN_ARGS:-}
    ;;
  encode)
    if [ -f $B/data/bench_encode.py ]; then
      t "${ENCODE_LIMIT:-300}" $PY $B/data/bench_encode.py --out "$R/encode.json" ${ENCODE_ARGS:-}
    else
      echo "no benchmarks/data/bench_encode.py in this tree: skipped"
    fi
    ;;
  attention)
    t "${ATT_LIMIT:-480}" $PY $B/attention/bench_attention.py --fills "${FILLS:-0.5,0.75,1.0}" \
      --masks "${MASKS:-document,frame_causal,cross}" ${PAIRED:+--paired $PAIRED} \
      --out "$R/attention.json"
    ;;
  blockmask) t 330 $PY $B/attention/bench_block_mask.py --out "$R/block_mask.json" ;;
  lingtests | lingserve | lingserve_short)
    # issue 42 on one H200: 5B widths, 30 blocks, bf16; the rows are checkpointed as they finish
    if [ "$DRY" != 1 ] && ! $PY -c "import lerobot.policies.lingbot_va" 2>/dev/null; then
      echo "lerobot's LingBot-VA not importable: carry .whl/lingserve and .whl/lingbench"; continue
    fi
    case $STAGE in
    lingtests)
      if [ "$DRY" = 1 ]; then echo "=== pytest tests/test_gpu.py -k 'lingbot or pool_block_mask'"
      elif [ "$QUICK" != 1 ]; then
        timeout "${LINGTEST_LIMIT:-480}" $PY -m pytest tests/test_gpu.py -v -rA -p no:cacheprovider \
          -k "lingbot or pool_block_mask" 2>&1 | tee "$R/gpu_tests_lingbot.txt" \
          | grep -E "passed|failed|error|PASSED|FAILED|SKIPPED" | tail -30
      fi
      t 60 $PY $B/attention/bench_pool_block_mask.py --out "$R/pool_block_mask_$GPU.json" ;;
    lingserve)
      t "${LINGSERVE_LIMIT:-560}" $PY $B/serving/bench_lingbot_serve.py --schedules own \
        --cuda-graphs $([ "${COMPILED:-1}" = 1 ] && echo --compiled-baseline) --stagger-robots 8 --mixed-robots 8 --out "$R/bench_lingbot_serve_own_$GPU.json" \
        ${LINGSERVE_ARGS:-} ;;
    lingserve_short)
      t "${LINGSERVE_LIMIT:-560}" $PY $B/serving/bench_lingbot_serve.py --schedules short \
        --cuda-graphs --out "$R/bench_lingbot_serve_short_$GPU.json" ${LINGSERVE_ARGS:-} ;;
    esac
    ;;
  fillprobe) t 300 $PY $B/attention/probe_fill.py --out "$R/probe_fill.json" ;;
  tests)
    # -rA lists every test's outcome; the summary line counts the ones that ran
    [ "$DRY" = 1 ] && { echo "=== pytest tests/test_gpu.py"; continue; }
    timeout "${TEST_LIMIT:-420}" $PY -m pytest tests/test_gpu.py -q -rA -p no:cacheprovider \
      2>&1 | tee "$R/gpu_tests.txt" | grep -E "passed|failed|error|PASSED|FAILED|SKIPPED" | tail -80
    ;;
  verify)
    V="$PY -m packing verify --device cuda --dtype bfloat16"
    [ "$DRY" = 1 ] && { echo "=== $V (x2)"; continue; }
    timeout 90 $V --json "$R/verify_bf16.json"
    timeout 90 $V --model benchmarks.verify_models:head_dim_128 --json "$R/verify_hd128.json"
    ;;
  budget)
    t 150 $PY $B/distributed/find_token_budget.py --preset wan_2_2_5b --depth 30 \
      --out "$R/token_budget_5b.json"
    ;;
  fsdp)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    export OMP_NUM_THREADS=8
    t "${FSDP_LIMIT:-540}" $TR $B/distributed/bench_fsdp.py --regime "${REGIME:-seed}" \
      --steps "${STEPS:-2}" --time-limit 400 --hard-limit 470 \
      --variants "${VARIANTS:-packed,lean,unpacked_nosync,bucket_sdpa}" --out "$R" ${FSDP_ARGS:-}
    ;;
  *) echo "unknown stage $STAGE (see: bash benchmarks/gpu.sh)"; exit 2 ;;
  esac
  ls -la "$R"
done
