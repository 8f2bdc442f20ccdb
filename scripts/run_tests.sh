#!/usr/bin/env bash
# Run the test suite in each named lane: `scripts/run_tests.sh prod compat bridge -- [pytest options]`.
# Each lane first gets its environment (scripts/make_env.sh: returns at once when it is current), then
# runs its own tests: prod the whole suite but tests/bridge; compat only the tests marked `compat`
# there (those exercising code that differs between the lanes' pins: pytest.ini, tests/test_compat_marks.py);
# bridge only tests/bridge (Megatron-Bridge is installed in that lane alone). Options after `--` go to
# every lane; a `-m EXPR` of them is joined to the compat lane's own (`compat and (EXPR)`).
# A lane can run in two shards, each its own pytest beside the others: LANE:runs (the folders whose
# tests train models in several processes, RUN_FOLDERS) and LANE:units (the rest); `make test` runs
# prod and compat so, which packs the suite onto two cores better than two long lanes would.
#
# Lanes run side by side, SNIP_TEST_JOBS at a time (default 2): one lane alone leaves about a third
# of two cores idle while its tests wait on the processes they start. Each lane's output is printed
# whole when the lane ends, then a summary of every lane.
# Fails if any lane fails or collects no test (pytest exit 5 counts as a failure).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
lanes=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do lanes+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#lanes[@]} -gt 0 ] || { echo "usage: scripts/run_tests.sh LANE [LANE ...] [-- pytest options]" >&2; exit 2; }
# The model-training runs of Megatron-LM's loop and TE's: the longest shard, so snip-analyze's and the
# compact loop's runs (tests/analyze, tests/train) go to LANE:units, which then ends about with it.
RUN_FOLDERS=(tests/te tests/pretrain)
lane_paths() {  # $1 lane -> `paths`, what its pytest runs; fails for an unknown lane
  local ignore=() folder
  case "$1" in
    prod|compat) paths=(tests --ignore=tests/bridge) ;;
    prod:runs|compat:runs) paths=("${RUN_FOLDERS[@]}") ;;
    prod:units|compat:units)
      for folder in "${RUN_FOLDERS[@]}"; do ignore+=("--ignore=$folder"); done
      paths=(tests --ignore=tests/bridge "${ignore[@]}") ;;
    bridge) paths=(tests/bridge) ;;
    *) return 1 ;;
  esac
}
lane_options() {  # $1 lane, then pytest options -> `options`: with the lane's marker (compat) joined in
  local marker="" joined=0
  case "$1" in compat|compat:*) marker=compat ;; esac
  shift
  options=()
  while [ $# -gt 0 ]; do
    if [ -n "$marker" ] && [ "$1" = "-m" ] && [ $# -gt 1 ]; then
      options+=(-m "$marker and ($2)")
      joined=1
      shift 2
      continue
    fi
    options+=("$1")
    shift
  done
  if [ -n "$marker" ] && [ $joined -eq 0 ]; then options=(-m "$marker" ${options[@]+"${options[@]}"}); fi
}
for lane in "${lanes[@]}"; do
  lane_paths "$lane" || { echo "unknown lane '$lane' (valid: prod, compat, bridge; prod:runs, prod:units, compat:runs, compat:units)" >&2; exit 2; }
done
max_jobs=${SNIP_TEST_JOBS:-2}
case "$max_jobs" in
  ''|*[!0-9]*|0) echo "SNIP_TEST_JOBS must be a positive integer, got '$max_jobs'" >&2; exit 2 ;;
esac
# Threads per lane: the cores shared among the lanes running at once. More oversubscribes the cores,
# and torch's OpenMP threads then wait on each other (a measure_scale --quick beside another took 168 s
# at 2 threads each against 29 s at 1 thread each, on two cores).
side_by_side=$(( max_jobs < ${#lanes[@]} ? max_jobs : ${#lanes[@]} ))
threads=$(( $(nproc) / side_by_side ))
[ "$threads" -ge 1 ] || threads=1
export PYTHONWARNINGS=ignore OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

run_lane() {  # $1 lane, then pytest options; writes $logs/LANE.log, then $logs/LANE.rc
  local lane=$1 rc start=$SECONDS paths options env=${1%%:*}
  shift
  lane_paths "$lane"
  lane_options "$lane" "$@"
  {
    # Shards of one lane share its environment: one creates it while the other waits.
    if flock "$logs/$env.lock" scripts/make_env.sh "$env"; then
      echo "=== lane: $lane ($(".venv-$env/bin/python" --version 2>&1))"
      ".venv-$env/bin/python" -m pytest "${paths[@]}" ${options[@]+"${options[@]}"}
      rc=$?
      if [ $rc -eq 5 ]; then echo "lane $lane: no tests collected -- failing"; rc=1; fi
    else
      rc=$?
      echo "lane $lane: its environment could not be created (scripts/make_env.sh $lane)"
    fi
    echo "=== lane $lane: exit $rc in $((SECONDS - start)) s"
  } > "$logs/$lane.log" 2>&1
  echo "$rc" > "$logs/$lane.rc"
}

status=0
print_finished() {  # each lane that has ended and is not printed yet
  local lane
  for lane in "${lanes[@]}"; do
    if [ -f "$logs/$lane.rc" ] && [ ! -f "$logs/$lane.printed" ]; then
      cat "$logs/$lane.log"
      touch "$logs/$lane.printed"
      [ "$(cat "$logs/$lane.rc")" -eq 0 ] || status=1
    fi
  done
}

echo "=== lanes ${lanes[*]}, $max_jobs at a time, OMP_NUM_THREADS=$OMP_NUM_THREADS; each lane's output follows when it ends"
for lane in "${lanes[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$max_jobs" ]; do wait -n; print_finished; done
  run_lane "$lane" "$@" &
done
wait
print_finished
echo "=== summary"
for lane in "${lanes[@]}"; do tail -n 1 "$logs/$lane.log"; done
exit $status
