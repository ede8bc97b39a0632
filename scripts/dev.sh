#!/usr/bin/env bash
# The two commands of the README, on a fresh machine:
#   scripts/dev.sh verify [packing verify options]   packed vs unpacked loss and gradients
#   scripts/dev.sh test   [pytest options]           lint, type-check, the suite but `slow` (CI)
# and the rest of the suite:
#   scripts/dev.sh test-slow [pytest options]        the `slow` tests: verify --compile, the
#                                                    benchmark scripts' smoke runs, FSDP variants
# Both create .venv with the Python of .python-version (found through pyenv) and install
# the package with its lerobot/hf/dev/diffusers/plot extras; the install is redone when pyproject.toml,
# constraints.txt or this script change.
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

venv=${PACKING_VENV:-$root/.venv}
stamp_want=$(cat pyproject.toml constraints.txt scripts/dev.sh | sha256sum | cut -c1-16)
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.packing-stamp" 2>/dev/null)" != "$stamp_want" ]; then
  py=$(find_python)
  echo "setting up $venv with $("$py" --version) ..." >&2
  "$py" -m venv "$venv"
  log="$venv/install.log"
  if ! { "$venv/bin/python" -m pip install --upgrade pip &&
         "$venv/bin/python" -m pip install -c constraints.txt -e ".[lerobot,hf,dev,diffusers,plot]"; } >"$log" 2>&1; then
    grep -v '^WARNING: Location' "$log" | tail -n 40 >&2
    echo "error: installing into $venv failed; the whole log is $log" >&2
    exit 1
  fi
  echo "$stamp_want" > "$venv/.packing-stamp"
fi

# Everything runs offline: datasets are local, nothing may reach a hub.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
cmd=${1:-}
shift || true
case "$cmd" in
  verify)
    exec "$venv/bin/packing" verify "$@"
    ;;
  test)
    "$venv/bin/ruff" check packing tests benchmarks
    "$venv/bin/ruff" format --check packing tests benchmarks
    "$venv/bin/mypy" packing
    exec "$venv/bin/python" -m pytest -n 2 -q -m "not slow" "$@"
    ;;
  test-slow)
    exec "$venv/bin/python" -m pytest -n 2 -q -m slow "$@"
    ;;
  *)
    echo "usage: scripts/dev.sh {verify|test|test-slow} [options]" >&2
    exit 2
    ;;
esac
