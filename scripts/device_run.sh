#!/usr/bin/env bash
# One call on the lent GPU machine (see /work/.library/device): install the carried lark wheel,
# run the given command with $OUT set to a scratch folder, then pack that folder into
# $OUT/results.tgz (the device tool returns at most 8 files) beside a copy of summary.md.
# Usage (from the repository root, on the device machine):
#   scripts/device_run.sh scripts/gpu_suite.sh
#   scripts/device_run.sh torchrun --nproc_per_node=2 benchmarks/bench.py --quick --out '$RUN'
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
FINAL=$OUT
export RUN=/tmp/purlin_run OUT=/tmp/purlin_run
rm -rf "$RUN"; mkdir -p "$RUN"
eval "$@"
rc=$?
cp "$RUN/summary.md" "$FINAL/" 2>/dev/null
tar -czf "$FINAL/results.tgz" -C "$RUN" .
echo "device_run: rc=$rc, $(du -sh "$FINAL/results.tgz" | cut -f1) of results"
exit $rc
