#!/usr/bin/env bash
# Install, from a folder of wheels, each listed module this Python cannot import (no network).
#
#   bench/gpu/install_wheels.sh PYTHON WHEEL_DIR TARGET MODULE:WHEEL_PREFIX...
#
# For each MODULE:WHEEL_PREFIX (e.g. megatron.core:megatron_core) that PYTHON cannot find, the
# newest WHEEL_DIR/WHEEL_PREFIX-*.whl goes into TARGET (put TARGET on PYTHONPATH): with
# `pip install --no-index --no-deps --target`, or, where pip is missing, unzipped; either way each
# file keeps the wheel's mode (PuLP's CBC binary stays executable). One line per module; exit status 0 when every listed
# module imports at the end (a module listed twice under two prefixes counts once), 1 otherwise.
set -uo pipefail
[ $# -ge 4 ] || { sed -n '2,10s/^# \{0,1\}//p' "$0" >&2; exit 2; }
PY="$1" WHEELS="$2" TARGET="$3"
shift 3
export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
missing=""
# found without importing it (megatron.core's import takes seconds; the machine line imports it)
found() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null; }
for pair in "$@"; do
  module="${pair%%:*}" prefix="${pair#*:}"
  if found "$module"; then
    echo "$module: importable"
    missing="${missing// $module /}"
    continue
  fi
  wheel=$(find "$WHEELS" -maxdepth 1 -name "$prefix-*.whl" 2>/dev/null | sort | tail -n 1)
  if [ -z "$wheel" ]; then
    echo "$module: missing, and no $prefix-*.whl in $WHEELS"
    missing="$missing $module "
    continue
  fi
  mkdir -p "$TARGET"
  unpack=1
  "$PY" -m pip install --quiet --no-index --no-deps --target "$TARGET" "$wheel" >/dev/null 2>&1 && unpack=0
  # pip --target drops executable bits: give each file the wheel's mode (unpacking it without pip)
  "$PY" - "$wheel" "$TARGET" "$unpack" <<'PYEOF'
import os, sys, zipfile
wheel, target, unpack = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        path = z.extract(info, target) if unpack else os.path.join(target, info.filename)
        mode = (info.external_attr >> 16) & 0o777
        if mode and os.path.isfile(path):
            os.chmod(path, mode)
PYEOF
  if found "$module"; then
    echo "$module: installed from $(basename "$wheel")"
    missing="${missing// $module /}"
  else
    echo "$module: $(basename "$wheel") did not make it importable"
    missing="$missing $module "
  fi
done
[ -z "${missing// /}" ]
