#!/usr/bin/env bash
# The wheels benchmarks/gpu.sh installs on the GPU machine (which has no internet), laid out
# as three carries of <= 64 MiB each. Run on a machine with PyPI access, from the repo root:
#
#   bash benchmarks/fetch_wheels.sh          # fills .whl/p1, .whl/p2, .whl/diffusers,
#                                            #   .whl/lingserve, .whl/lingbench
#
# .whl/p1: the cutlass-dsl wheels and the first half of the 92 MB libs-cu13 wheel;
# .whl/p2: its second half, flash-attn-4, quack-kernels, apache-tvm-ffi, torch-c-dlpack-ext;
# .whl/diffusers: diffusers and its pure-Python needs the machine lacks;
# .whl/lingserve + .whl/lingbench (one carry, 35 MB): lerobot 0.6.1 with the transformers and
# diffusers it pins, for `gpu.sh lingserve` (the machine's own transformers is newer).
set -euo pipefail
W=${WHL:-.whl}
get() {  # DIR NAME==VERSION...: binary wheels for the GPU machine's Python 3.12, no deps
  local d=$1; shift
  mkdir -p "$d"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 --platform any -d "$d" "$@"
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
get "$W/lingserve" accelerate==1.15.0 annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0 \
  certifi==2026.10.19.post1 click==8.5.1 h11==0.16.0 hf-xet==1.8.0 httpcore==1.0.9 \
  httpx==0.29.0 huggingface-hub==1.33.0 idna==3.20 markdown-it-py==4.3.0 mdurl==0.1.2 \
  packaging==26.4 psutil==7.2.2 pydantic==2.14.4 pydantic-core==2.50.5 pygments==2.21.0 \
  pyyaml==6.0.4 regex==2026.12.2 rich==15.0.0 safetensors==0.8.0 shellingham==1.5.4 \
  tokenizers==0.22.2 tqdm==4.70.1 transformers==5.5.4 typer==0.29.2 typing-inspection==0.4.5
get "$W/lingbench" diffusers==0.42.1 dill==0.4.1 draccus==0.11.6 farama-notifications==0.0.6 \
  gymnasium==1.4.0 importlib-metadata==10.2.0 lerobot==0.6.1 mergedeep==1.3.4 toml==0.10.2
du -sh "$W"/*
