#!/usr/bin/env bash
# The two commands of the README, on a fresh machine:
#   scripts/dev.sh verify [packing verify options]   packed vs unpacked loss and gradients
#   scripts/dev.sh test   [pytest options]           lint, type-check, the suite but `slow` (CI),
#                                                    at both ends of the tested torch range
# and the rest:
#   scripts/dev.sh test-oldest | test-newest [pytest options]   the suite on one end only
#   scripts/dev.sh test-slow [pytest options]        the `slow` tests: verify --compile, the
#                                                    benchmark scripts' smoke runs, FSDP variants
#
# Two virtualenvs, with the Python of .python-version (found through pyenv), one per end of the
# range pyproject.toml declares (docs/compatibility.md):
#   .venv         oldest: constraints.txt (torch 2.11, numpy 2.0, lerobot 0.6.1), extras
#                 lerobot,lingbot,hf,dev,diffusers,plot,serve; `verify`, lint, mypy and `test-slow` run here
#   .venv-newest  newest: constraints-newest.txt (torch 2.15, numpy 2.5), extras
#                 hf,dev,diffusers,plot,serve; no lerobot (0.6.1 needs torch < 2.12), so the tests
#                 that need lerobot's writer skip there, saying so
# and a third, for the robot's side of the policy server:
#   .venv-openpi  the unmodified openpi-client 0.1.2 (numpy < 2, so a venv of its own, as a robot
#                 computer has), which tests/test_serve_openpi.py runs as real clients; its
#                 python is exported as PACKING_OPENPI_PYTHON (PACKING_VENV_OPENPI moves it)
# Each is made on first use and redone when pyproject.toml, its constraints file or this script
# change, printing a line per stage and pip's line for each file it downloads (the whole pip
# output is in the venv's install.log). PACKING_VENV and PACKING_VENV_NEWEST move them. A torch venv is about 6 GB (PyPI has
# only the CUDA build for Linux x86_64) and its install downloads about 3 GB more;
# PACKING_ONE_VENV_AT_A_TIME=1 makes `test` remove .venv after its suite, before .venv-newest is
# made, so that one of them is on disk at a time (.ci/run sets it: CI's clean clone has no use
# for a venv after its suite, and its disk is shared).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
want=$(tr -d '[:space:]' < .python-version)

find_python() {
  if command -v pyenv >/dev/null 2>&1 && pyenv prefix "$want" >/dev/null 2>&1; then
    echo "$(pyenv prefix "$want")/bin/python"; return
  fi
  for p in "${PYENV_ROOT:-$HOME/.pyenv}/versions/$want/bin/python" "python${want%.*}"; do
    if command -v "$p" >/dev/null 2>&1; then command -v "$p"; return; fi
  done
  echo "error: Python $want not found (install it with 'pyenv install $want')" >&2
  exit 1
}

# pip_logged PYTHON LOG ARGS...: `pip install ARGS` with its whole output appended to LOG and,
# on the terminal, pip's line for each file it downloads (name and size) and for what it
# installs: a long install shows it is moving. Returns pip's exit status.
pip_logged() {
  local py=$1 log=$2
  shift 2
  "$py" -m pip install --progress-bar off "$@" 2>&1 | tee -a "$log" |
    { grep --line-buffered -E '^ *(Downloading|Installing collected|Successfully installed)' | cut -c1-160 >&2 || true; }
  return "${PIPESTATUS[0]}"
}

# pinned NAME CONSTRAINTS: the version CONSTRAINTS pins NAME to, or "as pip resolves".
pinned() {
  grep -E "^$1==" "$2" | cut -d= -f3 | grep . || echo "as pip resolves"
}

# setup VENV CONSTRAINTS EXTRAS: make VENV (once per content of the files it is made from).
setup() {
  local venv=$1 constraints=$2 extras=$3
  local stamp_want
  stamp_want=$(cat pyproject.toml "$constraints" scripts/dev.sh | sha256sum | cut -c1-16)
  if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.packing-stamp" 2>/dev/null)" = "$stamp_want" ]; then
    return
  fi
  local py log start what
  py=$(find_python)
  start=$SECONDS
  echo "setting up $venv with $("$py" --version) and $constraints ..." >&2
  # A venv made from other pins would keep packages the new pins don't want: start afresh
  # (only where a venv is: PACKING_VENV may name any folder).
  if [ -f "$venv/pyvenv.cfg" ]; then rm -rf "$venv"; fi
  echo "  [1/3] creating the venv" >&2
  "$py" -m venv "$venv"
  log="$venv/install.log"
  : >"$log"
  what="torch $(pinned torch "$constraints")"
  case ",$extras," in *,lerobot,*) what="$what and lerobot $(pinned lerobot "$constraints")" ;; esac
  if ! { echo "  [2/3] upgrading pip" >&2 &&
         pip_logged "$venv/bin/python" "$log" --no-cache-dir --upgrade pip &&
         echo "  [3/3] installing $what, then packing with [$extras] (a first run downloads about 3 GB; the whole log: $log)" >&2 &&
         pip_logged "$venv/bin/python" "$log" --no-cache-dir -c "$constraints" -e ".[$extras]"; }; then
    grep -v '^WARNING: Location' "$log" | tail -n 40 >&2
    if grep -q "(constraint) torch<=" "$log"; then
      echo "note: a pip constraint of this machine caps torch below $constraints's pin" >&2
    fi
    if grep -q "No space left on device" "$log"; then
      echo "note: the disk ran out: $(df -Ph "$venv" | awk 'NR == 2 {print $4 " free on " $6}')." \
           "A torch venv takes about 6 GB and its install downloads about 3 GB more; free" \
           "space, move the venvs (PACKING_VENV, PACKING_VENV_NEWEST), or set" \
           "PACKING_ONE_VENV_AT_A_TIME=1 (what .ci/run does)" >&2
    fi
    echo "error: installing into $venv failed; the whole log is $log" >&2
    exit 1
  fi
  echo "$stamp_want" > "$venv/.packing-stamp"
  echo "$venv ready in $((SECONDS - start)) s" >&2
}

venv=${PACKING_VENV:-$root/.venv}
venv_newest=${PACKING_VENV_NEWEST:-$root/.venv-newest}
venv_openpi=${PACKING_VENV_OPENPI:-$root/.venv-openpi}
setup_oldest() { setup "$venv" constraints.txt lerobot,lingbot,hf,dev,diffusers,plot,serve; }
setup_newest() { setup "$venv_newest" constraints-newest.txt hf,dev,diffusers,plot,serve; }

# The robot's venv: openpi-client as published (0.1.2 imports typing_extensions without
# declaring it, so that is installed beside it), remade when this script changes.
OPENPI_PINS="openpi-client==0.1.2 numpy==1.26.4 websockets==17.4 msgpack==1.2.4 typing_extensions==4.16.0"
setup_openpi() {
  local stamp_want
  stamp_want=$(echo "$OPENPI_PINS" | cat - scripts/dev.sh | sha256sum | cut -c1-16)
  if ! [ -x "$venv_openpi/bin/python" ] || [ "$(cat "$venv_openpi/.packing-stamp" 2>/dev/null)" != "$stamp_want" ]; then
    if [ -f "$venv_openpi/pyvenv.cfg" ]; then rm -rf "$venv_openpi"; fi
    echo "setting up $venv_openpi: the robot's side, $OPENPI_PINS ..." >&2
    "$(find_python)" -m venv "$venv_openpi"
    : >"$venv_openpi/install.log"
    # shellcheck disable=SC2086  # the pins are words
    if ! pip_logged "$venv_openpi/bin/python" "$venv_openpi/install.log" $OPENPI_PINS; then
      tail -n 20 "$venv_openpi/install.log" >&2
      echo "error: installing openpi-client into $venv_openpi failed" >&2
      exit 1
    fi
    echo "$stamp_want" > "$venv_openpi/.packing-stamp"
  fi
  export PACKING_OPENPI_PYTHON="$venv_openpi/bin/python"
}

# suite VENV [pytest options]: the suite but `slow` on one end of the range, headed by the
# versions it runs (the suite's own closing line follows).
suite() {
  local py=$1/bin/python start=$SECONDS rc=0
  shift
  echo "== suite on $("$py" -c 'import sys, numpy, torch; print(f"torch {torch.__version__}, numpy {numpy.__version__}, Python {sys.version.split()[0]}")') ($1) ==" >&2
  "$py" -m pytest -n 2 -q -m "not slow" "${@:2}" || rc=$?
  echo "== $((SECONDS - start)) s, exit $rc ==" >&2
  return $rc
}

# Everything runs offline: datasets are local, nothing may reach a hub.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
cmd=${1:-}
shift || true
case "$cmd" in
  verify)
    setup_oldest
    exec "$venv/bin/packing" verify "$@"
    ;;
  test)
    # Lint and types once (they do not depend on torch's version); the suite on both ends,
    # the second even when the first fails, so one run shows both.
    setup_oldest
    setup_openpi
    echo "== ruff check, ruff format --check, mypy ==" >&2
    "$venv/bin/ruff" check packing tests benchmarks
    "$venv/bin/ruff" format --check packing tests benchmarks
    "$venv/bin/mypy" packing
    rc=0
    suite "$venv" constraints.txt "$@" || rc=$?
    if [ "${PACKING_ONE_VENV_AT_A_TIME:-0}" = 1 ] && [ -f "$venv/pyvenv.cfg" ]; then
      echo "removing $venv before making the next (PACKING_ONE_VENV_AT_A_TIME=1)" >&2
      rm -rf "$venv"
    fi
    setup_newest
    suite "$venv_newest" constraints-newest.txt "$@" || rc=$?
    exit $rc
    ;;
  test-oldest)
    setup_oldest
    setup_openpi
    suite "$venv" constraints.txt "$@"
    ;;
  test-newest)
    setup_newest
    setup_openpi
    suite "$venv_newest" constraints-newest.txt "$@"
    ;;
  test-slow)
    setup_oldest
    exec "$venv/bin/python" -m pytest -n 2 -q -m slow "$@"
    ;;
  *)
    echo "usage: scripts/dev.sh {verify|test|test-oldest|test-newest|test-slow} [options]" >&2
    exit 2
    ;;
esac
