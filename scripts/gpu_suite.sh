#!/usr/bin/env bash
# The GPU suite, on the two-GPU machine (the loopback step needs only one).  Every step runs
# under `timeout`; logs, JUnit files and a JSON + Markdown summary land in $OUT.
#
# Steps (PURLIN_STEPS picks some, in this order; default: all but `slow`):
#   precompile        every kernel the tests use, parallel NVRTC
#   loopback          ranks sharing one GPU (R=2 and R=4 on cuda:0): slices, zero-copy, graphs;
#                     the one step a one-GPU machine runs (PURLIN_STEPS=loopback)
#   fuzz_specs        random collectives (tests/gpu/fuzz_specs.py: layouts, options, counts, dtypes and ops
#                     drawn from a seed) in loopback on cuda:0, each rank bit for bit against the
#                     simulator; PURLIN_FUZZ_CASES cases, compiled within PURLIN_FUZZ_COMPILE_S, run
#                     within PURLIN_FUZZ_RUN_S, from seed PURLIN_FUZZ_FIRST; summary in fuzz_specs.json
#   sized             run-time sizes (alltoallv) in loopback on cuda:0, R=1..8, every dtype, graphs
#                     replayed with new sizes, size errors; then R=1 under compute-sanitizer memcheck
#                     (one GPU is enough: PURLIN_STEPS=sized)
#   moe               purlinc.moe dispatch/combine in loopback on cuda:0 (R=2..8, graphs) against a
#                     plain torch exchange
#   moe_stress        scripts/stress_moe.py: the moe step repeated for 20 s at each of R = 2, 3, 4, 8, each
#                     exchange (dispatched rows, counts, result) checked against the routing itself
#   moe_bench         benchmarks/moe_dispatch.py in loopback (writes $OUT)
#   graph_buffers     loopback too: captured calls on ordinary buffers run without staging
#   insitu            loopback too: the in-situ benchmark and the e2e decode step run, checked
#   loopback_scale    node scale on one GPU: every example and many-unit spec at R = 2, 3, 4, 5, 8
#                     (16 for two), plain loads across buckets, pinned options, dtypes x ops, graphs,
#                     hierarchical intra-node phases, the R=8 first call, the residency refusal; its
#                     kernels compiled in parallel first within PURLIN_SCALE_COMPILE_S (240), the cases
#                     run within PURLIN_SCALE_RUN_S (300); summary in loopback_scale.{json,md}
#   epilogue          fused all-reduce + add + RMSNorm (and its fp8 variant), loopback R=2..8,
#                     against torch's unfused reference (one GPU); then the epilogue's row loop at
#                     R=1 under compute-sanitizer memcheck, racecheck and synccheck
#                     (tests/gpu/epilogue_sanitize.py, each output against the evaluator)
#   epilogue_bench    benchmarks/epilogue_overhead.py in loopback: what the fused epilogue adds over
#                     the plain all-reduce at [1 and 16 x 4096] bf16, R = 2, 4, 8 (writes $OUT)
#   insitu_bench      benchmarks/insitu_loopback.py, all-reduce 1 KiB-4 MiB at R=2 and 4: captured calls
#                     staged, registered, and as auto picks; each point's kernels listed (--profile; writes $OUT)
#   e2e_loopback      benchmarks/e2e/run.py --loopback 4: the decode step, batches 1/16/128, every
#                     system checked against the reference (writes $OUT)
#   local             LocalGroup tests, ldst and tma atoms
#   local_ce          LocalGroup tests, ce atom
#   trace             traced kernels: monotone stamps, waits after their notifies
#   torchrun          one process per GPU: bootstrap, NCCL comparison, 1,000 calls, graphs
#   zerocopy          heap buffers -> registered schedules, LocalGroup
#   zerocopy_torchrun the same under torchrun
#   graph_buffers_torchrun  captured calls on ordinary tensors under torchrun (CUDA IPC at capture)
#   edges             scripts/probe_edges.py: ~360 runtime edge cases in loopback (counts, misaligned and
#                     strided views, aliasing, wrong arguments, special values per op, tuned buckets
#                     1 B-64 MiB, graphs, lifecycle after close and timeout); fails on any unexpected
#   faults            mismatches before launch and timeouts (two GPUs and loopback); a rank that
#                     dies mid-loop -> PurlinTimeoutError (torchrun, two GPUs)
#   torch             purlinc.torch: custom ops, eager / torch.compile / CUDA graphs vs NCCL
#   torch_backend     the `purlin` torch.distributed backend, one process per GPU (one GPU is enough:
#                     a world of one) and two processes sharing cuda:0; purlinc.torch on an NCCL
#                     group; autograd and compiled backward; the serving adapter in a CUDA graph
#   hier              hierarchical plans: 2 nodes x 1 GPU and 1 node x 2 GPUs, vs NCCL
#   slow              the CPU sweeps the default test run deselects (many cores here)
# Usage: OUT=/some/dir [PURLIN_STEPS="local torchrun"] scripts/gpu_suite.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/purlin_gpu_suite}
mkdir -p "$OUT"
export OUT PURLIN_RESULTS="$OUT" PURLIN_CACHE_DIR=${PURLIN_CACHE_DIR:-/tmp/purlin_cache}
export PURLIN_WAIT_TIMEOUT_S=${PURLIN_WAIT_TIMEOUT_S:-5} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$PWD"
STEPS=${PURLIN_STEPS:-"precompile loopback loopback_scale fuzz_specs sized edges moe moe_stress moe_bench graph_buffers insitu epilogue epilogue_bench insitu_bench e2e_loopback local local_ce trace torchrun zerocopy zerocopy_torchrun graph_buffers_torchrun faults torch torch_backend hier"}
T0=$(date +%s)
. scripts/source_links.sh  # grammar/ and templates/ linked into purlinc/ for the run
RAN=()
: > "$OUT/steps.tsv"

wanted() { [[ " $STEPS " == *" $1 "* ]]; }
step() {  # step NAME SECONDS command...   (log $OUT/NAME.log, JUnit /tmp/purlin_NAME.xml if pytest)
  local name=$1 limit=$2; shift 2
  wanted "$name" || return 0
  rm -f "/tmp/purlin_$name.xml"
  local s=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - s ))" >> "$OUT/steps.tsv"
  echo "== $name: rc=$rc in $(( $(date +%s) - s )) s (log $name.log)"
  tail -n 5 "$OUT/$name.log"
}
pytest_step() {  # pytest_step NAME SECONDS pytest-args...
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" python3 -m pytest -q -rs -p no:cacheprovider --junitxml="/tmp/purlin_$name.xml" "$@"
}

step precompile 120 python3 tests/gpu/_common.py precompile
wanted loopback && STEPS="$STEPS loopback_precompile"  # the loopback step's kernels, first
step loopback_precompile 90 python3 tests/gpu/_common.py precompile loopback
pytest_step loopback 300 tests/gpu/test_loopback.py
export PURLIN_SCALE_COMPILE_S=${PURLIN_SCALE_COMPILE_S:-240} PURLIN_SCALE_RUN_S=${PURLIN_SCALE_RUN_S:-300}
wanted loopback_scale && STEPS="$STEPS loopback_scale_precompile"
step loopback_scale_precompile $(( PURLIN_SCALE_COMPILE_S + 30 )) python3 tests/gpu/scale.py precompile
# Each case compiles what its calls run (the precompile step above did that); a plain load's own
# precompile of every bucket for the common dtypes would add the rest to every case.
PURLIN_PRECOMPILE=${PURLIN_SCALE_LOAD_PRECOMPILE:-0} \
  pytest_step loopback_scale $(( PURLIN_SCALE_RUN_S + 150 )) tests/gpu/test_loopback_scale.py
export PURLIN_FUZZ_CASES=${PURLIN_FUZZ_CASES:-1000} PURLIN_FUZZ_COMPILE_S=${PURLIN_FUZZ_COMPILE_S:-200} \
  PURLIN_FUZZ_RUN_S=${PURLIN_FUZZ_RUN_S:-240}
wanted fuzz_specs && STEPS="$STEPS fuzz_specs_precompile"
step fuzz_specs_precompile $(( PURLIN_FUZZ_COMPILE_S + 30 )) python3 tests/gpu/fuzz_specs.py precompile
PURLIN_PRECOMPILE=0 pytest_step fuzz_specs $(( PURLIN_FUZZ_RUN_S + 120 )) tests/gpu/test_fuzz_specs.py
pytest_step sized 420 tests/gpu/test_sized.py
OUT="$OUT" step edges 330 python3 scripts/probe_edges.py
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
if wanted sized && [ -n "$SAN" ]; then
  STEPS="$STEPS sized_memcheck"
  PURLIN_WAIT_TIMEOUT_S=30 step sized_memcheck 300 "$SAN" --tool memcheck --error-exitcode 3 python3 tests/gpu/sized_sanitize.py
fi
pytest_step moe 420 tests/gpu/test_moe.py
step moe_stress 240 python3 scripts/stress_moe.py --seconds 20 --worlds 2 3 4 8 --json "$OUT/moe_stress.json"
step moe_bench 300 python3 benchmarks/moe_dispatch.py --out "$OUT" --devices 0,0 --channels 16 --reps 3
pytest_step graph_buffers 300 tests/gpu/test_graph_buffers.py
pytest_step insitu 400 -s tests/gpu/test_insitu_loopback.py
pytest_step epilogue 560 tests/gpu/test_epilogue.py  # fused all-reduce + add + RMSNorm, loopback R=2..8
if wanted epilogue && [ -n "$SAN" ]; then  # the epilogue's row loop at R=1 under each sanitizer
  STEPS="$STEPS epilogue_memcheck epilogue_racecheck epilogue_synccheck"
  PURLIN_WAIT_TIMEOUT_S=30 step epilogue_memcheck 300 "$SAN" --tool memcheck --error-exitcode 3 \
    python3 tests/gpu/epilogue_sanitize.py
  PURLIN_WAIT_TIMEOUT_S=30 step epilogue_racecheck 400 "$SAN" --tool racecheck --racecheck-report hazard \
    --error-exitcode 3 python3 tests/gpu/epilogue_sanitize.py
  PURLIN_WAIT_TIMEOUT_S=30 step epilogue_synccheck 300 "$SAN" --tool synccheck --error-exitcode 3 \
    python3 tests/gpu/epilogue_sanitize.py
fi
step epilogue_bench 240 python3 benchmarks/epilogue_overhead.py --out "$OUT" --ranks 2 4 8 --rows 1 16 --parts --label loopback
for R in 2 4; do
  wanted insitu_bench && STEPS="$STEPS insitu_bench_r$R"
  step insitu_bench_r$R 240 python3 benchmarks/insitu_loopback.py --ranks $R --collectives allreduce \
    --sizes 1K,16K,64K,256K,1M,4M --variants default,graph-staged,graph-registered --profile --reps 5 --no-plots \
    --results-dir "$OUT/insitu" --out "$OUT"
done
step e2e_loopback 300 python3 benchmarks/e2e/run.py --loopback 4 --batches 1,16,128 --layers 2 --reps 3 \
  --results-dir "$OUT/e2e" --out "$OUT"
PURLIN_TEST_ATOMS=ldst,tma pytest_step local 170 tests/gpu/test_local.py
PURLIN_TEST_ATOMS=ce pytest_step local_ce 70 tests/gpu/test_local.py \
  -k "test_collective or test_dtypes or test_graph or test_large"
pytest_step trace 90 -s tests/gpu/test_trace.py
PURLIN_TORCHRUN_TIMEOUT=150 pytest_step torchrun 165 -s tests/gpu/test_torchrun.py
pytest_step zerocopy 240 tests/gpu/test_zerocopy_local.py
PURLIN_TORCHRUN_TIMEOUT=200 pytest_step zerocopy_torchrun 215 -s tests/gpu/test_zerocopy_torchrun.py
PURLIN_TORCHRUN_TIMEOUT=200 pytest_step graph_buffers_torchrun 215 -s tests/gpu/test_graph_buffers_torchrun.py
pytest_step faults 200 -s tests/gpu/test_faults.py
PURLIN_HIER_TIMEOUT=${PURLIN_HIER_TIMEOUT:-380} pytest_step hier $(( ${PURLIN_HIER_TIMEOUT:-380} + 20 )) -s tests/gpu/test_hier.py
# purlinc.torch under torchrun (writes torch_results.json) and CuPy ranks without torch (cupy_results.json)
PURLIN_TORCH_TIMEOUT=${PURLIN_TORCH_TIMEOUT:-480} pytest_step torch $(( ${PURLIN_TORCH_TIMEOUT:-480} + 120 )) -s tests/gpu/test_torch_api.py
PURLIN_TORCH_TIMEOUT=540 pytest_step torch_backend 1140 -s tests/gpu/test_torch_backend.py
if python3 -c "import hypothesis" 2>/dev/null; then
  pytest_step slow 420 -m slow tests --ignore=tests/gpu
fi

export SUITE_SECONDS=$(( $(date +%s) - T0 ))
python3 scripts/gpu_summary.py "$OUT"
