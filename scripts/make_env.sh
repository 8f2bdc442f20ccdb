#!/usr/bin/env bash
# Create (or reuse) the virtual environment of one lane: `scripts/make_env.sh prod|compat|bridge`.
# Idempotent: a stamp holding the hash of the lane's pinned file marks a finished install, so a
# second call returns at once and a changed pin file rebuilds the environment.
#
# Install order, read from the pin file: the `torch==` line first (so pip never resolves another,
# multi-GB build), then every line not marked [no-deps] (resolved together, so pip checks them
# against each other), then the lines marked `# [no-deps]`, with --no-deps.
#
# `scripts/make_env.sh --lock LANE` writes requirements/LANE.txt instead: it installs
# requirements/LANE.in the same way into a scratch environment and pins what is there (pip freeze),
# carrying the [no-deps] markers over.
set -euo pipefail
lock=0
if [ "${1:-}" = "--lock" ]; then lock=1; shift; fi
lane=${1:?usage: make_env.sh [--lock] prod|compat|bridge}
root=$(cd "$(dirname "$0")/.." && pwd)
case "$lane" in
  prod|bridge) want=3.12 ;;
  compat) want=3.11 ;;
  *) echo "unknown lane '$lane' (valid: prod, compat, bridge)" >&2; exit 2 ;;
esac
venv="$root/.venv-$lane"
pins="$root/requirements/$lane.txt"
stamp="$venv/.snip-stamp"            # pins installed
pkg_stamp="$venv/.snip-package-stamp"  # this package installed (editable), entry points current
pkg_hash=$(sha256sum "$root/setup.py" | cut -c1-16)
if [ $lock -eq 0 ]; then
  hash=$(sha256sum "$pins" | cut -c1-16)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$hash" ]; then
    if [ ! -f "$pkg_stamp" ] || [ "$(cat "$pkg_stamp")" != "$pkg_hash" ]; then
      "$venv/bin/python" -m pip install -q --no-deps -e "$root" >/dev/null 2>&1 \
        || { echo "[make_env] $lane: installing the package failed" >&2; exit 1; }
      echo "$pkg_hash" > "$pkg_stamp"
    fi
    exit 0
  fi
fi

# Find the interpreter: pythonX.Y on PATH, else pyenv's newest X.Y.
py=""
if command -v "python$want" >/dev/null 2>&1 && "python$want" -c 'import sys' >/dev/null 2>&1; then
  py=$(command -v "python$want")
else
  pyenv_root=${PYENV_ROOT:-$HOME/.pyenv}
  for cand in $(printf '%s\n' "$pyenv_root"/versions/"$want".* | sort -V -r); do
    if [ -x "$cand/bin/python" ]; then py="$cand/bin/python"; break; fi
  done
fi
[ -n "$py" ] || { echo "no Python $want found (PATH or pyenv); install it first" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ $lock -eq 1 ]; then
  venv="$work/venv"
  echo "[make_env] $lane: locking requirements/$lane.in in a scratch environment"
else
  echo "[make_env] $lane: creating $venv with $py"
  rm -rf "$venv"
fi
"$py" -m venv "$venv"
pip_install() {  # quiet pip; keeps its exit status, drops the noise about absent local indexes
  local log rc=0
  log=$(mktemp)
  "$venv/bin/python" -m pip install -q "$@" >"$log" 2>&1 || rc=$?
  grep -v '^WARNING: Location' "$log" >&2 || true
  rm -f "$log"
  return $rc
}
# Split a requirements file into the two install steps (comments and blank lines dropped).
split_requirements() {  # $1 file -> $work/resolved.txt, $work/no-deps.txt
  sed -e 's/[[:space:]]*$//' "$1" | grep -vE '^(#|$)' | grep -v '\[no-deps\]' \
    | sed -e 's/[[:space:]]\+#.*$//' > "$work/resolved.txt" || true
  grep -E '^[^#].*#.*\[no-deps\]' "$1" | sed -e 's/[[:space:]]\+#.*$//' > "$work/no-deps.txt" || true
}
install_requirements() {  # $1 file
  split_requirements "$1"
  local torch_line
  torch_line=$(grep -E '^torch([=<>!~ ]|$)' "$work/resolved.txt" || true)
  if [ -n "$torch_line" ]; then pip_install "$torch_line"; fi
  pip_install -r "$work/resolved.txt"
  if [ -s "$work/no-deps.txt" ]; then pip_install --no-deps -r "$work/no-deps.txt"; fi
}

if [ $lock -eq 1 ]; then
  src="$root/requirements/$lane.in"
  install_requirements "$src"
  {
    echo "# $lane lane, pinned (generated from $lane.in by \`scripts/make_env.sh --lock $lane\`: pip freeze). Python $want."
    "$venv/bin/python" -m pip freeze 2>/dev/null | grep -vE '^(-e |#)' | while read -r line; do
      name=$(echo "${line%%==*}" | tr '[:upper:]_.' '[:lower:]--')
      if grep -iE "^${name}[=<>!~ ]" <(tr '_.' '--' < "$work/no-deps.txt") >/dev/null; then
        echo "$line  # [no-deps] (see $lane.in)"
      else
        echo "$line"
      fi
    done
  } > "$pins.new"
  mv "$pins.new" "$pins"
  echo "[make_env] $lane: wrote requirements/$lane.txt ($(grep -cvE '^#' "$pins") pins)"
  exit 0
fi

install_requirements "$pins"
pip_install --no-deps -e "$root"
"$venv/bin/python" -W ignore - "$lane" <<'EOF'
import importlib.metadata as md, sys
import megatron.core, pulp, snip_megatron, torch  # noqa: F401  (megatron.bridge needs the TE stand-in)
extra = " megatron-bridge " + md.version("megatron-bridge") if sys.argv[1] == "bridge" else ""
print(f"[make_env] {sys.argv[1]} ok: torch {torch.__version__} megatron-core {megatron.core.__version__}{extra}")
EOF
echo "$hash" > "$stamp"
echo "$pkg_hash" > "$pkg_stamp"
