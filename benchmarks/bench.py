#!/usr/bin/env python3
"""Collective benchmark: NCCL (default, graph mixing off, symmetric kernels), torch symmetric
memory and Purlin (staged and zero-copy) in one run, on the same sizes, eager and CUDA-graph
timings with fixed calls per graph, correctness checked after timing.

    torchrun --nproc_per_node=2 benchmarks/bench.py [--quick] [--out DIR]

NCCL reads NCCL_GRAPH_MIXING_SUPPORT once per process (an NCCL_PARAM, cached on first use,
then copied into every communicator's config), so the ``nomix`` and ``symm`` NCCL variants run
in a child process group: every rank starts one child with the variable set to 0 (a new
rendezvous port, the same RANK/WORLD_SIZE), waits for it, and rank 0 merges its rows.
    python benchmarks/bench.py --dry-run --world-size 2 [--quick]     # the plan and estimate, no GPU

Rank 0 writes benchmarks/results/<date>-<machine>.json (+ .md, -tuning.json, PNGs), copies
them to --out, and prints the Markdown report last.  See benchmarks/README.md.

This file is the command line; the run lives in ``benchlib`` (plan, cases, check, timing,
measure, setup, peaks, nccl_child, meta, output, affinity; the report's modules beside them).
Only ``plan`` and ``affinity`` are imported up front: a dry run needs neither torch nor a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(HERE), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

import report  # noqa: E402
from benchlib import argtypes, needs  # noqa: E402
from benchlib.affinity import cpu_cores_for  # noqa: E402,F401  (re-exported)
from benchlib.plan import (  # noqa: E402,F401  (re-exported)
    HIER, NCCL_SYMM_COLLECTIVES, NCCL_VARIANTS, SYSTEMS, Plan, PlanError, describe_plan, estimate_s,
    hier_gpus_per_node, make_plan, measured_sizes, plan_world,
)

# Multicast (NVLS) can take the host's GPUs down: never let it be enabled, whatever the caller set.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
for _k, _v in SAFE_ENV.items():
    if os.environ.get(_k) != _v:
        if _k in os.environ:
            print(f"bench: overriding {_k}={os.environ[_k]!r} -> {_v!r} (multicast stays off)", file=sys.stderr)
        os.environ[_k] = _v

torch = None  # imported in main(), after the environment above is fixed
dist = None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1K, 16K, 64K, 1M, 16M, 256M and fewer Purlin variants")
    ap.add_argument("--out", type=argtypes.output_dir, default=None,
                    help="also copy every output file here (e.g. $OUT)")
    ap.add_argument("--results-dir", type=argtypes.output_dir, default=HERE / "results")
    ap.add_argument("--machine", type=argtypes.file_tag, default=None, help="machine tag in file names (default: <gpu>x<R>, e.g. h200x2)")
    ap.add_argument("--collectives", default=",".join(report.COLLECTIVES), help="comma-separated subset")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    ap.add_argument("--hier-gpus-per-node", default="R,1",
                    help=f"{HIER} rows: gpus_per_node values, one variant g<G> each (R = the world: one node; "
                         "1: every rank a node, NCCL between them)")
    ap.add_argument("--variants", default=None, help="comma-separated Purlin variant names (default: all, or the quick set)")
    ap.add_argument("--variant-spec", action="append", default=[],
                    help="extra Purlin variant 'name:algorithm=ring,atom=ldst,channels=8,slices=2' (repeatable)")
    ap.add_argument("--modes", default="eager,graph",
                    help="eager, graph (calls back to back in a CUDA graph) and insitu (each call between a "
                         "producer and a consumer kernel, plain launches: the time it adds; benchlib/insitu.py)")
    ap.add_argument("--calls-per-graph", type=argtypes.positive_int_list, default="20,100",
                    help="calls captured per CUDA graph, the same for every system (one graph row each)")
    ap.add_argument("--many-calls-max-bytes", type=argtypes.positive_byte_size, default=None,
                    help="graphs with the later --calls-per-graph values only up to this size, for every system "
                         "(default 1M with --quick, 16M otherwise: above it launches are noise and replays long)")
    ap.add_argument("--nccl-variants", default="default,nomix,symm",
                    help="NCCL rows: default (the environment as given), nomix (NCCL_GRAPH_MIXING_SUPPORT=0), "
                         "symm (mixing off + NCCL symmetric buffers); nomix/symm run in a child process group")
    ap.add_argument("--child-timeout-s", type=argtypes.positive_float, default=None,
                    help="bound on the NCCL child run (default 150, quick 110)")
    ap.add_argument("--nccl-child", action="store_true", help=argparse.SUPPRESS)  # internal: the child
    ap.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--sizes", type=argtypes.byte_size_list, default=None,
                    help="explicit comma-separated sizes, e.g. 1K,64K,1M")
    ap.add_argument("--min-bytes", type=argtypes.byte_size, default=0)
    ap.add_argument("--max-bytes", type=argtypes.positive_byte_size, default=None)
    ap.add_argument("--peak-bytes", type=argtypes.positive_byte_size, default=1 * report.GiB,
                    help="largest size of the one-way peer peak measurement")
    ap.add_argument("--no-peak", action="store_true")
    ap.add_argument("--reps", type=argtypes.positive_int, default=None,
                    help="timed repeats per mode, the median kept (default 5, quick 3)")
    ap.add_argument("--target-rep-us", type=argtypes.positive_float, default=None,
                    help="calls per repeat fill about this long (default 5000, quick 3000)")
    ap.add_argument("--budget-s", type=argtypes.positive_float, default=None,
                    help="stop adding sizes once this much wall time has passed (default 330, quick 230)")
    ap.add_argument("--timeout-s", type=argtypes.positive_float, default=450.0,
                    help="global guard: write what was measured and exit after this long")
    ap.add_argument("--pg-timeout-s", type=argtypes.positive_float, default=600.0, help="torch.distributed timeout")
    ap.add_argument("--no-precompile", action="store_true",
                    help="skip warming Purlin's compile cache in parallel before loading")
    ap.add_argument("--precompile-workers", type=argtypes.positive_int, default=8)
    ap.add_argument("--precompile-timeout-s", type=argtypes.positive_float, default=120.0)
    ap.add_argument("--merge", type=Path, action="append", default=[],
                    help="results JSON of an earlier (split) run to merge in; this run's rows win")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--cpu-affinity", choices=("none", "cores"), default="none",
                    help="cores: each local rank's process (and the NCCL child processes it starts) runs on "
                         "its own physical cores, every system alike (cpu_cores_for)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--git-commit", default=None, help="recorded when the tree has no .git (device copies)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the time estimate; no GPU")
    ap.add_argument("--world-size", type=argtypes.positive_int, default=None,
                    help="for --dry-run (default: torchrun's WORLD_SIZE, else 2)")
    args = ap.parse_args(argv)
    if args.target_rep_us is None:
        args.target_rep_us = 3000.0 if args.quick else 5000.0
    if args.budget_s is None:
        args.budget_s = 230.0 if args.quick else 330.0
    if args.many_calls_max_bytes is None:
        args.many_calls_max_bytes = report.MiB if args.quick else 16 * report.MiB
    if args.reps is None:  # an explicit --reps is kept, --quick or not
        args.reps = 3 if args.quick else 5
    if args.child_timeout_s is None:
        args.child_timeout_s = 110.0 if args.quick else 150.0
    args.calls_list = list(args.calls_per_graph)  # positive integers (argtypes.positive_int_list)
    if args.variants is not None and not args.variants.strip():  # '' is no list, not "all" (leave it out)
        ap.error(f"--variants: no Purlin variants given ({args.variants!r}); leave --variants out for all")
    if HIER not in _selected(args.systems):  # the option only shapes the purlin/hierarchical rows
        args.hier_gpus_per_node = ""
    try:
        args.nccl_list = _nccl_variants(args.nccl_variants)
        _check_files(args)
        make_plan(args)  # every choice checked now, before torch, a GPU or the run's time is spent
    except ValueError as error:  # PlanError, ResultsError: one line naming the option or file
        ap.error(str(error))
    return args


def _selected(systems: str) -> list[str]:
    """--systems' names, or every system where the list is bad (make_plan says what is wrong)."""
    try:
        return argtypes.names(systems, SYSTEMS, "systems")
    except ValueError:
        return list(SYSTEMS)


def _nccl_variants(text: str) -> list[str]:
    try:
        return argtypes.names(text, NCCL_VARIANTS, "NCCL variants")
    except ValueError as error:
        raise ValueError(f"--nccl-variants: {error}") from None


def _check_files(args) -> None:
    """--merge files are read at the end of the run: a missing or unreadable one, or one of
    another world size than this run's (one report is one world size), is found now."""
    docs = [report.load_results(path) for path in args.merge]
    if docs:
        this_run = {"meta": {"world_size": plan_world(args)}, "rows": []}
        report.check_mergeable([this_run, *docs], ["this run", *args.merge])



def main(argv=None) -> int:
    args = parse_args(argv)
    plan = make_plan(args)
    if args.dry_run:
        world = plan_world(args)
        print(describe_plan(plan, args, world))
        for c in plan.collectives:
            own = measured_sizes(plan.sizes, c, world)
            lays = [report.layout(c, world, s) for s in own]
            same = [s for s in plan.sizes if s not in own]
            print(f"  {c:>14}: count per size " + ", ".join(f"{report.fmt_bytes(l.bytes)}={l.count}" for l in lays)
                  + (f" ({', '.join(report.fmt_bytes(s) for s in same)}: the same call as a size before, "
                     "measured once)" if same else ""))
        return 0

    # before the first CUDA call: one line, exit 2, where torch, a GPU or torchrun is missing
    needs.require("bench.py", "torchrun --nproc_per_node=2 benchmarks/bench.py; --dry-run plans without them",
                  torchrun=True)
    global torch, dist
    import torch as _torch
    import torch.distributed as _dist

    torch, dist = _torch, _dist
    from benchlib.context import Ctx, barrier
    from benchlib.measure import run
    from benchlib.meta import machine_tag
    from benchlib.output import finish, install_guards

    # torch renames c10d functions now and then (all_gather_into_tensor -> ...); the old names work.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cpus = None
    if args.cpu_affinity == "cores" and hasattr(os, "sched_setaffinity"):
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        cpus = cpu_cores_for(local_rank, local_world, sorted(os.sched_getaffinity(0)))
        os.sched_setaffinity(0, cpus)  # before torch starts its threads, which inherit it
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=args.pg_timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    now = datetime.datetime.now()
    meta = {"date": now.date().isoformat(), "run_id": now.strftime("%Y-%m-%dT%H:%M:%S") + f"-{os.getpid()}",
            "world_size": world, "quick": args.quick, "dtype": "bfloat16",
            "args": {k: str(v) for k, v in vars(args).items()},
            "cpu_affinity": {"mode": args.cpu_affinity, "cpus": cpus},
            "plan": {"collectives": plan.collectives, "systems": plan.systems,
                     "variants": {v.name: v.options for v in plan.variants}, "sizes": plan.sizes,
                     "modes": plan.modes, "nccl_variants": list(plan.nccl), "calls_per_graph": list(plan.calls),
                     "hier_gpus_per_node": list(plan.hier)},
            "wire_model": {"launch_us": report.LAUNCH_US, "signal_us": report.SIGNAL_US,
                           "two_way_gbps": report.TWO_WAY_GBPS, "one_way_gbps": report.ONE_WAY_GBPS}}
    ctx = Ctx(args, plan, rank, world, local_rank, device, dist.group.WORLD.group_name, time.time(), meta)
    ctx.meta["machine"] = machine_tag(ctx)
    ctx.stem = f"{ctx.meta['date']}-{ctx.meta['machine']}"
    install_guards(ctx)
    status = "complete"
    try:
        run(ctx)
        if ctx.meta.get("stopped_by_budget"):
            status = "stopped by budget"
    except BaseException as e:  # noqa: BLE001 - keep what was measured
        status = f"fatal: {type(e).__name__}: {e}"
        traceback.print_exc()
    finish(ctx, status)
    try:  # keep every rank alive until rank 0 has written: torchrun stops the rest when one exits non-zero
        if not status.startswith("fatal"):
            barrier(ctx)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    if ctx.rank != 0:
        return 0
    if status.startswith("fatal"):
        return 3
    return 1 if ctx.failures else 0


if __name__ == "__main__":
    sys.exit(main())
