# Sourced by the gpu_*.sh scripts: the GPU machine's Python environment, from carried wheels.
#
#   source benchmarks/gpu_env.sh        # WHL (default .whl) holds what the calls carried
#
# It also defines t LIMIT CMD...: CMD under a timeout, its start, end and exit status logged.
#
# FA4 travels in two device calls on one warm machine (64 MiB a call): $WHL/p1 (the small
# wheels and the first half of the 92 MB cutlass-dsl-libs-cu13 wheel) in one, $WHL/p2 (the
# second half) in the next. Each call stages what it carries in /tmp/whl; once both halves are
# there the wheels are installed into /tmp/site (the machine has no internet). diffusers and
# its pure-Python needs ($WHL/diffusers, ~17 MB: one carry) go to /tmp/site_diffusers.
# Without FA4 `auto` resolves to Flex, and the printed line (and each run's JSON) says so.
WHL=${WHL:-.whl}
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
if [ -d "$WHL/diffusers" ] && [ ! -d /tmp/site_diffusers/diffusers ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_diffusers \
    "$WHL"/diffusers/*.whl && echo "diffusers installed to /tmp/site_diffusers" \
    || echo "diffusers install FAILED"
fi
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site_diffusers
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -c "import torch, packing.attention._packed as a; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no gpu', 'fa4', a.fa4_available())"

t() {
  local lim=$1 rc; shift; echo "=== $* (limit ${lim}s) $(date +%T)"
  timeout "$lim" "$@"; rc=$?; echo "=== rc=$rc $(date +%T)"; return $rc
}
