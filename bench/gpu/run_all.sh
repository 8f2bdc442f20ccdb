#!/usr/bin/env bash
# The first GPU check of SNIP in one call: one H100 or H200, no network, under ten minutes.
#
#   bench/gpu/run_all.sh [OUT_DIR] [--device cuda|cpu] [--deadline SECONDS] [--only 1,3,...]
#
# Installs the wheels in .whl/ that this Python lacks (megatron-core is needed; PuLP is optional),
# probes the machine, then runs six checks in order of value, each with its own time cap, within
# the deadline (default 510 s): a check starts only with enough time left for it, else it is
# SKIPPED. Prints one line per check and writes at most 8 files to OUT_DIR (default
# runs/gpu_check/<time>): summary.txt (the lines printed), one log per check, and quality's
# results.jsonl. Exit status: 0 when no check failed or timed out, 1 otherwise, 2 on bad usage or
# a missing GPU. --device cpu is the dry run (tiny sizes; the TE check needs a GPU and is skipped).
# What each line means: bench/gpu/README.md.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="" DEVICE=cuda DEADLINE=510 ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="${2:-}"; shift 2 || shift ;;
    --deadline) DEADLINE="${2:-}"; shift 2 || shift ;;
    --only) ONLY="${2:-}"; shift 2 || shift ;;
    -h|--help) sed -n '2,13s/^# \{0,1\}//p' "$0"; exit 0 ;;
    -*) echo "run_all.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) OUT="$1"; shift ;;
  esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "run_all.sh: --device cuda or cpu, not '$DEVICE'" >&2; exit 2 ;; esac
case "$DEADLINE" in ''|*[!0-9]*) echo "run_all.sh: --deadline takes whole seconds, not '$DEADLINE'" >&2; exit 2 ;; esac

PY="${PYTHON:-python3}"
OUT="${OUT:-$ROOT/runs/gpu_check/$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT" || exit 2
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
START=$(date +%s)
FAILED=0
say() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }

cd "$ROOT" || exit 2
SITE="$ROOT/.whl/site"
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 SNIP_CPU_KERNEL=0   # the CPU kernel's build (20-60 s) serves no GPU check
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}" NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"
[ "$DEVICE" = cpu ] && export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# -- 0. a GPU first (nothing to install without one), then the wheels this Python cannot import ---
if [ "$DEVICE" = cuda ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  say "[0/6] machine: --device cuda but $PY sees no GPU (or no torch); use --device cpu for the dry run"
  exit 2
fi
WHEELS=$("$ROOT/bench/gpu/install_wheels.sh" "$PY" "$ROOT/.whl" "$SITE" megatron.core:megatron_core pulp:pulp \
  pulp:PuLP | grep 'installed from' | tr '\n' ' ')

# -- the machine, in one line ---------------------------------------------------------------------
"$PY" - "$DEVICE" "$WHEELS" >> "$SUMMARY" <<'EOF'
import importlib.metadata, importlib.util, shutil, sys, sysconfig, os
device, wheels = sys.argv[1], sys.argv[2].strip()
try:
    import torch
except Exception as e:
    print(f"[0/6] machine: {sys.executable} cannot import torch ({e}); set PYTHON to the one that can")
    sys.exit(2)
def version(module, dist):
    # the installed distribution's version, without importing it (megatron.core takes seconds)
    try:
        return importlib.metadata.version(dist)
    except Exception:
        return "(no version)" if importlib.util.find_spec(module) is not None else None
if device == "cuda":
    p = torch.cuda.get_device_properties(0)
    where = f"{p.name} SM{p.major}{p.minor} {p.total_memory / 2**30:.0f} GiB; CUDA {torch.version.cuda}"
else:
    where = "CPU (dry run)"
mc = version("megatron.core", "megatron-core")
mc = f"megatron-core {mc}" if mc else "megatron-core MISSING (put megatron_core-0.19.2-*.whl in .whl/)"
header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
print(f"[0/6] machine: {where}; torch {torch.__version__}; Triton {version('triton', 'triton') or 'absent'}; "
      f"{mc}; PuLP {version('pulp', 'PuLP') or 'absent (exact solver)'}; "
      f"g++ {'yes' if shutil.which('g++') else 'no'}; "
      f"Python.h {'yes' if os.path.exists(header) else 'no'}" + (f"; {wheels}" if wheels else ""))
EOF
PROBE=$?
tail -n 1 "$SUMMARY"
[ "$PROBE" -eq 0 ] || exit 2

# -- the checks -------------------------------------------------------------------------------------
# run_step N NAME CAP MIN_START COMMAND...: start with at least MIN_START seconds left, stop at CAP
run_step() {
  local n="$1" name="$2" cap="$3" need="$4"; shift 4
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$n,"* ]]; then return 0; fi
  local remaining; remaining=$(left)
  if [ "$remaining" -lt "$need" ]; then
    say "[$n/6] $name: SKIPPED (${remaining} s of the ${DEADLINE} s deadline left, it needs ${need} s)"
    return 0
  fi
  [ "$cap" -gt "$remaining" ] && cap="$remaining"
  local log="$OUT/$n-$name.log" t0 rc took verdict result
  t0=$(date +%s)
  timeout --kill-after=10 "$cap" "$@" > "$log" 2>&1
  rc=$?
  took=$(( $(date +%s) - t0 ))
  result=$(grep -a '^RESULT' "$log" | tail -n 1)
  [ -n "$result" ] || result=$(grep -av '^[[:space:]]*$' "$log" | tail -n 1)
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    verdict="TIMEOUT after ${took} s (cap ${cap} s)"; FAILED=$((FAILED + 1))
  elif [ "$rc" -eq 0 ]; then
    verdict="ok in ${took} s"
  else
    verdict="FAILED (exit ${rc}) in ${took} s"; FAILED=$((FAILED + 1))
  fi
  say "[$n/6] $name: $verdict | ${result:0:400}"
}

G="$ROOT/bench/gpu"
QUALITY_DIR=$(mktemp -d)
trap 'rm -rf "$QUALITY_DIR"' EXIT
if [ "$DEVICE" = cuda ]; then
  run_step 1 cast_bits 60 20 "$PY" "$G/cast_bits_check.py"
  run_step 2 emulation 150 60 "$PY" "$G/emulation_cuda_check.py"
  run_step 3 te_check 60 20 "$PY" "$G/te_check.py" --only availability,timing
  run_step 4 pretrain_local 110 50 "$PY" "$G/pretrain_local_check.py"
  run_step 5 compiled_cast 150 60 env SNIP_COMPILED_CAST=1 "$PY" "$G/compiled_cast_check.py" --only \
    nvfp4:fprop_input,nvfp4:fprop_weight,nvfp4:wgrad_grad_output,mxfp8:fprop_input,blockwise:fprop_input,blockwise:fprop_weight,tensorwise:fprop_input,mxfp4:wgrad_input
  run_step 6 quality 600 90 "$PY" "$G/quality_gpu.py" --seeds 1 --methods snip_periodic \
    --run-dir "$QUALITY_DIR" --out "$QUALITY_DIR/results_gpu.md"
else  # the dry run: the same scripts on CPU at tiny sizes
  run_step 1 cast_bits 60 10 "$PY" "$G/cast_bits_check.py" --device cpu
  run_step 2 emulation 90 20 "$PY" "$G/emulation_cuda_check.py" --device cpu --tiny --steps-before 1 \
    --steps-after 2 --timing-steps 0
  if [ -z "$ONLY" ] || [[ ",$ONLY," == *",3,"* ]]; then
    say "[3/6] te_check: SKIPPED (needs a GPU; its parts run on CPU in tests/bench/test_te_check.py)"
  fi
  run_step 4 pretrain_local 120 40 "$PY" "$G/pretrain_local_check.py" --device cpu --tiny --steps 4
  run_step 5 compiled_cast 120 40 "$PY" "$G/compiled_cast_check.py" --device cpu --size 256 --repeats 2 \
    --only nvfp4:fprop_input
  run_step 6 quality 150 40 "$PY" "$G/quality_gpu.py" --device cpu --seeds 1 --methods snip_periodic \
    --layers 2 --hidden 64 --ffn 128 --heads 4 --groups 2 --seq 32 --vocab 512 --micro-batch-size 2 \
    --steps 12 --prefix-steps 6 --max-bytes 300000 --jobs 1 --run-dir "$QUALITY_DIR" --out "$QUALITY_DIR/results_gpu.md"
fi
[ -f "$QUALITY_DIR/results.jsonl" ] && cp "$QUALITY_DIR/results.jsonl" "$OUT/6-quality_results.jsonl"

say "done in $(( $(date +%s) - START )) s: ${FAILED} failed or timed out; files in $OUT"
[ "$FAILED" -eq 0 ]
