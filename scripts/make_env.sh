#!/usr/bin/env bash
# Create (or reuse) the virtual environment of one lane: `scripts/make_env.sh prod|compat`.
# Idempotent: a stamp holding the hash of the lane's pinned file marks a finished install, so a
# second call returns at once and a changed pin file rebuilds the environment.
set -euo pipefail
lane=${1:?usage: make_env.sh prod|compat}
root=$(cd "$(dirname "$0")/.." && pwd)
case "$lane" in
  prod) want=3.12 ;;
  compat) want=3.11 ;;
  *) echo "unknown lane '$lane' (valid: prod, compat)" >&2; exit 2 ;;
esac
venv="$root/.venv-$lane"
pins="$root/requirements/$lane.txt"
stamp="$venv/.snip-stamp"            # pins installed
pkg_stamp="$venv/.snip-package-stamp"  # this package installed (editable), entry points current
hash=$(sha256sum "$pins" | cut -c1-16)
pkg_hash=$(sha256sum "$root/setup.py" | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$hash" ]; then
  if [ ! -f "$pkg_stamp" ] || [ "$(cat "$pkg_stamp")" != "$pkg_hash" ]; then
    "$venv/bin/python" -m pip install -q --no-deps -e "$root" >/dev/null 2>&1 \
      || { echo "[make_env] $lane: installing the package failed" >&2; exit 1; }
    echo "$pkg_hash" > "$pkg_stamp"
  fi
  exit 0
fi

# Find the interpreter: pythonX.Y on PATH, else pyenv's newest X.Y.
py=""
if command -v "python$want" >/dev/null 2>&1 && "python$want" -c 'import sys' >/dev/null 2>&1; then
  py=$(command -v "python$want")
else
  pyenv_root=${PYENV_ROOT:-$HOME/.pyenv}
  for cand in $(ls -d "$pyenv_root"/versions/"$want".* 2>/dev/null | sort -V -r); do
    if [ -x "$cand/bin/python" ]; then py="$cand/bin/python"; break; fi
  done
fi
[ -n "$py" ] || { echo "no Python $want found (PATH or pyenv); install it first" >&2; exit 1; }

echo "[make_env] $lane: creating $venv with $py"
rm -rf "$venv"
"$py" -m venv "$venv"
pip_install() {  # quiet pip; keeps its exit status, drops the noise about absent local indexes
  local log rc=0
  log=$(mktemp)
  "$venv/bin/python" -m pip install -q "$@" >"$log" 2>&1 || rc=$?
  grep -v '^WARNING: Location' "$log" >&2 || true
  rm -f "$log"
  return $rc
}
# torch first, from the pinned line, so pip never resolves a different (multi-GB) build.
pip_install "$(grep -E '^torch==' "$pins")"
pip_install -r "$pins"
pip_install --no-deps -e "$root"
"$venv/bin/python" -c "import torch, megatron.core, pulp, snip_megatron; print('[make_env] $lane ok: torch', torch.__version__, 'megatron-core', megatron.core.__version__)"
echo "$hash" > "$stamp"
echo "$pkg_hash" > "$pkg_stamp"
