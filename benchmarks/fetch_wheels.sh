#!/usr/bin/env bash
# The wheels benchmarks/gpu.sh installs on the GPU machine (which has no internet), laid out
# as three carries of <= 64 MiB each. Run on a machine with PyPI access, from the repo root:
#
#   bash benchmarks/fetch_wheels.sh          # fills .whl/p1, .whl/p2, .whl/diffusers
#
# .whl/p1: the cutlass-dsl wheels and the first half of the 92 MB libs-cu13 wheel;
# .whl/p2: its second half, flash-attn-4, quack-kernels, apache-tvm-ffi, torch-c-dlpack-ext;
# .whl/diffusers: diffusers and its pure-Python needs the machine lacks.
set -euo pipefail
W=${WHL:-.whl}
get() {  # DIR NAME==VERSION...: binary wheels for the GPU machine's Python 3.12, no deps
  local d=$1; shift
  mkdir -p "$d"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux1_x86_64 --platform any -d "$d" "$@"
}
get "$W/p1" nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1
get /tmp/whl_cu13 nvidia-cutlass-dsl-libs-cu13==4.8.1
(cd /tmp/whl_cu13 && split -b 46000000 nvidia_cutlass_dsl_libs_cu13-*.whl cu13.part.)
mv /tmp/whl_cu13/cu13.part.aa "$W/p1/"
mkdir -p "$W/p2" && mv /tmp/whl_cu13/cu13.part.ab "$W/p2/"
get "$W/p2" flash-attn-4==4.0.0b36 quack-kernels==0.6.5 "apache-tvm-ffi>=0.1,<0.2" \
  torch-c-dlpack-ext==0.1.5
get "$W/diffusers" diffusers==0.42.1 importlib-metadata
du -sh "$W"/*
