#!/usr/bin/env bash
# Single-node launch of a recipe: torchrun with one process per GPU (or CPU rank).
#
#   launch/torchrun.sh [--dry-run] [--nproc N] [recipe overrides...]
#   launch/torchrun.sh --nproc 8 model=llama_7b parallel=tp4_pp2 train=pretrain
#   launch/torchrun.sh --dry-run --nproc 2 parallel=dp2        # print the command, run nothing
#
# The recipe (configs/, composed by snip-train) fixes the layout; --nproc N sets
# parallel.nproc_per_node=N on one node. DRY_RUN=1 is the same as --dry-run. PYTHON picks the
# interpreter (default: python3).
set -euo pipefail

usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; }

dry_run=${DRY_RUN:-0}
nproc=""
python=${PYTHON:-python3}
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1; shift ;;
    --nproc) nproc=${2:?--nproc needs a number}; shift 2 ;;
    --nproc=*) nproc=${1#--nproc=}; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done

overrides=("$@")
overrides+=("parallel.nnodes=1")
if [ -n "$nproc" ]; then
  overrides+=("parallel.nproc_per_node=$nproc")
fi

# snip-train validates the recipe and prints the exact command, one argument a line.
text=$("$python" -m snip_megatron.cli.train --print-command "${overrides[@]}")
mapfile -t cmd <<< "$text"

if [ "$dry_run" = 1 ]; then
  printf '%q ' "${cmd[@]}"
  printf '\n'
  exit 0
fi
exec "${cmd[@]}"
