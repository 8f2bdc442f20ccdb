#!/usr/bin/env bash
# Run the test suite in each named lane: `scripts/run_tests.sh prod compat bridge -- [pytest options]`.
# Each lane runs its own tests: prod and compat the whole suite but tests/bridge, bridge only
# tests/bridge (Megatron-Bridge is installed in that lane alone). Options after `--` go to every lane.
# Fails if any lane fails or collects no test (pytest exit 5 counts as a failure).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
lanes=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do lanes+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
export PYTHONWARNINGS=ignore OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
status=0
for lane in "${lanes[@]}"; do
  case "$lane" in
    prod|compat) paths=(tests --ignore=tests/bridge) ;;
    bridge) paths=(tests/bridge) ;;
    *) echo "unknown lane '$lane' (valid: prod, compat, bridge)" >&2; exit 2 ;;
  esac
  echo "=== lane: $lane ($(".venv-$lane/bin/python" --version 2>&1))"
  start=$SECONDS
  ".venv-$lane/bin/python" -m pytest "${paths[@]}" "$@"
  rc=$?
  if [ $rc -eq 5 ]; then echo "lane $lane: no tests collected -- failing"; rc=1; fi
  echo "=== lane $lane: exit $rc in $((SECONDS - start)) s"
  [ $rc -eq 0 ] || status=1
done
exit $status
