#!/usr/bin/env bash
# Run the test suite in each named lane: `scripts/run_tests.sh prod compat -- [pytest args]`.
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
  echo "=== lane: $lane ($(".venv-$lane/bin/python" --version 2>&1))"
  start=$SECONDS
  ".venv-$lane/bin/python" -m pytest "$@"
  rc=$?
  if [ $rc -eq 5 ]; then echo "lane $lane: no tests collected -- failing"; rc=1; fi
  echo "=== lane $lane: exit $rc in $((SECONDS - start)) s"
  [ $rc -eq 0 ] || status=1
done
exit $status
