#!/usr/bin/env bash
# Several step lists of scripts/gpu_suite.sh at once, one process tree per lane, on one machine:
# for correctness steps whose kernels spin on signals but leave most of the GPU idle (loopback
# tests, sanitizer runs).  Lanes share the GPU's time, so never time anything in a lane beside
# another one: run benchmarks through gpu_suite.sh alone.
#
#   OUT=DIR scripts/gpu_lanes.sh "moe insitu" "sized" "torch_backend"
#
# Lane i writes DIR/lane<i>/ (gpu_suite.sh's logs, steps.tsv and summary) and DIR/lane<i>.log;
# the exit status is 1 when any lane's step failed.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/purlin_gpu_lanes}
mkdir -p "$OUT"
# Linked here once, so no lane's gpu_suite.sh removes the links under another.
. scripts/source_links.sh
PIDS=()
i=0
for steps in "$@"; do
  i=$((i + 1))
  mkdir -p "$OUT/lane$i"
  OUT="$OUT/lane$i" PURLIN_STEPS="$steps" scripts/gpu_suite.sh >"$OUT/lane$i.log" 2>&1 &
  PIDS+=($!)
done
for pid in "${PIDS[@]}"; do wait "$pid"; done
rc=0
for tsv in "$OUT"/lane*/steps.tsv; do
  echo "== ${tsv%/steps.tsv}"
  cat "$tsv"
  awk -F'\t' '$2 != 0 { bad = 1 } END { exit bad }' "$tsv" || rc=1
done
exit $rc
