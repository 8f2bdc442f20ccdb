#!/usr/bin/env bash
# Check a Megatron-LM checkout against what snip-megatron relies on, in one command:
#
#   scripts/check_megatron_drift.sh MEGATRON_LM_CHECKOUT
#
# 1. each patch in patches/*.patch applies to the checkout (`git apply --check`, nothing written);
# 2. every seam of Megatron-LM's loop and of Megatron-Core (snip_megatron/megatron/seams.py, the
#    table of docs/seams.md) holds in the checkout's own sources: the checkout first on PYTHONPATH,
#    and megatron.core and megatron.training must be imported from it.
# Prints one line per patch and per seam; exits 1 if any fails, 2 on bad usage. PYTHON picks the
# interpreter (default: python), which needs torch and Megatron-Core's dependencies.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ $# -ne 1 ]; then
  echo "usage: scripts/check_megatron_drift.sh MEGATRON_LM_CHECKOUT" >&2; exit 2
fi
checkout=$(cd "$1" 2>/dev/null && pwd) || { echo "$1: no such folder" >&2; exit 2; }
if [ ! -d "$checkout/megatron/core" ]; then
  echo "$checkout: not a Megatron-LM checkout (no megatron/core in it)" >&2; exit 2
fi
python=${PYTHON:-python}
failed=0
echo "== patches (git apply --check in $checkout)"
for patch in "$root"/patches/*.patch; do
  if out=$(git -C "$checkout" apply --check --verbose "$patch" 2>&1); then
    echo "ok   $(basename "$patch")"
    echo "$out" | grep "offset" | sed 's/^/       /'  # hunks that applied away from their line
  else
    echo "FAIL $(basename "$patch")"; printf "       %s\n" "${out//$'\n'/$'\n       '}"; failed=1
  fi
done
echo "== seams (snip_megatron/megatron/seams.py)"
PYTHONPATH="$checkout:$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore PYTHONDONTWRITEBYTECODE=1 \
  "$python" -m snip_megatron.megatron.seam_check --loop megatron-lm --megatron-root "$checkout" 2>&1 \
  | grep -v "^W[0-9]\{4\} .*cpp_extension.py"
status=${PIPESTATUS[0]}
[ "$status" -eq 0 ] || failed=$(( status > failed ? status : failed ))
exit "$failed"
