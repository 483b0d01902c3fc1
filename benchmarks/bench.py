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
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(HERE), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

import purlin_api  # noqa: E402  (pure Python; purlinc itself is imported lazily)
import report  # noqa: E402

# Multicast (NVLS) can take the host's GPUs down: never let it be enabled, whatever the caller set.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
for _k, _v in SAFE_ENV.items():
    if os.environ.get(_k) != _v:
        if _k in os.environ:
            print(f"bench: overriding {_k}={os.environ[_k]!r} -> {_v!r} (multicast stays off)", file=sys.stderr)
        os.environ[_k] = _v

torch = None  # imported in main(), after the environment above is fixed
dist = None

HIER = "purlin/hierarchical"  # Purlin inside nodes of G ranks, NCCL between them (docs/HIERARCHY.md)
SYSTEMS = ("nccl", "symm_mem", "purlin", HIER)
NCCL_VARIANTS = ("default", "nomix", "symm")
# The collectives NCCL 2.28 has symmetric kernels for (all-to-all runs its ordinary kernels on
# the registered buffers; measured too, the row says which method registered them).
NCCL_SYMM_COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "alltoall")
CHECK_RTOL = 1e-2  # bf16 reductions: relative L2 error; copies must be bit-exact
PROBE_LIMIT_US = 1e6  # a single call slower than 1 s is a hang (a device wait timing out)


# =========================================================================== arguments


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1K, 64K, 1M, 16M, 256M and fewer Purlin variants")
    ap.add_argument("--out", type=Path, default=None, help="also copy every output file here (e.g. $OUT)")
    ap.add_argument("--results-dir", type=Path, default=HERE / "results")
    ap.add_argument("--machine", default=None, help="machine tag in file names (default: <gpu>x<R>, e.g. h200x2)")
    ap.add_argument("--collectives", default=",".join(report.COLLECTIVES), help="comma-separated subset")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    ap.add_argument("--hier-gpus-per-node", default="R,1",
                    help=f"{HIER} rows: gpus_per_node values, one variant g<G> each (R = the world: one node; "
                         "1: every rank a node, NCCL between them)")
    ap.add_argument("--variants", default=None, help="comma-separated Purlin variant names (default: all, or the quick set)")
    ap.add_argument("--variant-spec", action="append", default=[],
                    help="extra Purlin variant 'name:algorithm=ring,atom=ldst,channels=8,slices=2' (repeatable)")
    ap.add_argument("--modes", default="eager,graph")
    ap.add_argument("--calls-per-graph", default="20,100",
                    help="calls captured per CUDA graph, the same for every system (one graph row each)")
    ap.add_argument("--many-calls-max-bytes", type=report.parse_bytes, default=None,
                    help="graphs with the later --calls-per-graph values only up to this size, for every system "
                         "(default 1M with --quick, 16M otherwise: above it launches are noise and replays long)")
    ap.add_argument("--nccl-variants", default="default,nomix,symm",
                    help="NCCL rows: default (the environment as given), nomix (NCCL_GRAPH_MIXING_SUPPORT=0), "
                         "symm (mixing off + NCCL symmetric buffers); nomix/symm run in a child process group")
    ap.add_argument("--child-timeout-s", type=float, default=None,
                    help="bound on the NCCL child run (default 150, quick 110)")
    ap.add_argument("--nccl-child", action="store_true", help=argparse.SUPPRESS)  # internal: the child
    ap.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default=None, help="explicit comma-separated sizes, e.g. 1K,64K,1M")
    ap.add_argument("--min-bytes", type=report.parse_bytes, default=0)
    ap.add_argument("--max-bytes", type=report.parse_bytes, default=None)
    ap.add_argument("--peak-bytes", type=report.parse_bytes, default=1 * report.GiB,
                    help="largest size of the one-way peer peak measurement")
    ap.add_argument("--no-peak", action="store_true")
    ap.add_argument("--reps", type=int, default=5, help="timed repeats per mode (the median is kept)")
    ap.add_argument("--target-rep-us", type=float, default=None,
                    help="calls per repeat fill about this long (default 5000, quick 3000)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop adding sizes once this much wall time has passed (default 330, quick 200)")
    ap.add_argument("--timeout-s", type=float, default=450.0,
                    help="global guard: write what was measured and exit after this long")
    ap.add_argument("--pg-timeout-s", type=float, default=600.0, help="torch.distributed timeout")
    ap.add_argument("--no-precompile", action="store_true",
                    help="skip warming Purlin's compile cache in parallel before loading")
    ap.add_argument("--precompile-workers", type=int, default=8)
    ap.add_argument("--precompile-timeout-s", type=float, default=120.0)
    ap.add_argument("--merge", type=Path, action="append", default=[],
                    help="results JSON of an earlier (split) run to merge in; this run's rows win")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--cpu-affinity", choices=("none", "cores"), default="none",
                    help="cores: each local rank's process (and the NCCL child processes it starts) runs on "
                         "its own physical cores, every system alike (cpu_cores_for)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--git-commit", default=None, help="recorded when the tree has no .git (device copies)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the time estimate; no GPU")
    ap.add_argument("--world-size", type=int, default=None, help="for --dry-run")
    args = ap.parse_args(argv)
    if args.target_rep_us is None:
        args.target_rep_us = 3000.0 if args.quick else 5000.0
    if args.budget_s is None:
        args.budget_s = 230.0 if args.quick else 330.0
    if args.many_calls_max_bytes is None:
        args.many_calls_max_bytes = report.MiB if args.quick else 16 * report.MiB
    if args.quick and args.reps == 5:
        args.reps = 3
    if args.child_timeout_s is None:
        args.child_timeout_s = 110.0 if args.quick else 150.0
    args.calls_list = [int(c) for c in str(args.calls_per_graph).split(",") if c.strip()]
    args.nccl_list = [v.strip() for v in args.nccl_variants.split(",") if v.strip()]
    bad = [v for v in args.nccl_list if v not in NCCL_VARIANTS]
    if bad:
        raise SystemExit(f"unknown NCCL variants {bad}; choose from {NCCL_VARIANTS}")
    return args


@dataclass(frozen=True)
class Plan:
    collectives: list[str]
    systems: list[str]
    variants: list[purlin_api.Variant]
    sizes: list[int]
    modes: list[str]
    nccl: tuple[str, ...] = ("default",)
    calls: tuple[int, ...] = (20, 100)
    many_calls_max_bytes: int | None = None  # graphs beyond the first calls value only up to here
    hier: tuple[int, ...] = ()  # gpus_per_node of the purlin/hierarchical variants (g<G>)

    def views(self, nbytes: int | None = None) -> list[tuple[str, int | None]]:
        """(mode, calls per graph) of the rows every case of size ``nbytes`` gets (the same
        for every system: the bound is on the size, never on a system's speed)."""
        out = [("eager", None)] if "eager" in self.modes else []
        if "graph" in self.modes:
            out += [("graph", c) for i, c in enumerate(self.calls)
                    if i == 0 or nbytes is None or self.many_calls_max_bytes is None or nbytes <= self.many_calls_max_bytes]
        return out

    def cases(self, collective: str) -> int:
        n = 0
        if "nccl" in self.systems:
            n += sum(1 for v in self.nccl if v != "symm" or collective in NCCL_SYMM_COLLECTIVES)
        if "symm_mem" in self.systems and collective == "allreduce":
            n += 2
        if "purlin" in self.systems:
            n += sum(1 for v in self.variants if v.applies(collective))
        if HIER in self.systems:
            n += len(self.hier)
        return n

    def hier_loads(self) -> int:
        return len(self.collectives) * len(self.hier) if HIER in self.systems else 0

    def loads(self) -> int:
        if "purlin" not in self.systems:
            return 0
        keys = {(c, purlin_api.load_key(v)) for c in self.collectives for v in self.variants if v.applies(c)}
        return len(keys)


def make_plan(args) -> Plan:
    colls = [c.strip() for c in args.collectives.split(",") if c.strip()]
    bad = [c for c in colls if c not in report.COLLECTIVES]
    if bad:
        raise SystemExit(f"unknown collectives {bad}; choose from {report.COLLECTIVES}")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        raise SystemExit(f"unknown systems {bad}; choose from {SYSTEMS}")
    by_name = {v.name: v for v in purlin_api.VARIANTS}
    if args.variants:
        names = [n.strip() for n in args.variants.split(",") if n.strip()]
    else:
        names = list(purlin_api.QUICK_VARIANTS if args.quick else by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {list(by_name)} (or use --variant-spec)")
    variants = [by_name[n] for n in names] + [purlin_api.parse_variant(s) for s in args.variant_spec]
    explicit = [report.parse_bytes(s) for s in args.sizes.split(",")] if args.sizes else None
    sizes = report.select_sizes(quick=args.quick, min_bytes=args.min_bytes, max_bytes=args.max_bytes,
                                explicit=explicit)
    modes = [m.strip() for m in args.modes.split(",") if m.strip() in report.MODES]
    world = args.world_size or int(os.environ.get("WORLD_SIZE", "2"))
    return Plan(colls, systems, variants, sizes, modes, tuple(args.nccl_list), tuple(args.calls_list),
                args.many_calls_max_bytes, hier_gpus_per_node(args.hier_gpus_per_node, world))


def hier_gpus_per_node(text: str, world: int) -> tuple[int, ...]:
    """'R,1' -> (R, 1) for this world, duplicates dropped; a G that does not divide R stays
    (its load fails with the TopologyError, recorded as the variant's error row)."""
    out: list[int] = []
    for token in filter(None, (t.strip() for t in text.split(","))):
        g = world if token.upper() == "R" else int(token)
        if g < 1:
            raise SystemExit(f"--hier-gpus-per-node: {token!r} is not a positive number of GPUs")
        if g not in out:
            out.append(g)
    return tuple(out)


def estimate_s(plan: Plan, args) -> float:
    est = report.estimate_run_s([], reps=args.reps, target_rep_us=args.target_rep_us, modes=1,
                                loads=plan.loads() + plan.hier_loads())
    for s in plan.sizes:
        triples = [(c, s, plan.cases(c)) for c in plan.collectives]
        est += report.estimate_run_s(triples, reps=args.reps, target_rep_us=args.target_rep_us,
                                     modes=len(plan.views(s)), loads=0, startup_s=0.0)
    if "nccl" in plan.systems and set(plan.nccl) - {"default"}:
        est += 25.0  # the NCCL child's start-up (torch import, communicator)
    return est


def describe_plan(plan: Plan, args, world: int) -> str:
    est = estimate_s(plan, args)
    lines = [
        f"plan: R={world}, {len(plan.collectives)} collectives x {len(plan.sizes)} sizes "
        f"({report.fmt_bytes(plan.sizes[0]) if plan.sizes else '-'} .. "
        f"{report.fmt_bytes(plan.sizes[-1]) if plan.sizes else '-'}), modes {','.join(plan.modes)}",
        f"  systems: {', '.join(plan.systems)}; NCCL variants: {', '.join(plan.nccl)}; "
        f"Purlin variants: {', '.join(v.name for v in plan.variants)}; calls per graph: "
        f"{', '.join(str(c) for c in plan.calls)}",
        f"  cases: {sum(plan.cases(c) for c in plan.collectives) * len(plan.sizes)}; Purlin loads: {plan.loads()}"
        + (f"; {HIER}: gpus_per_node {', '.join(str(g) for g in plan.hier)} "
           f"({', '.join(f'{world // g} x {g}' if world % g == 0 else f'{g} (not a divisor of R)' for g in plan.hier)}"
           f" nodes x GPUs), {plan.hier_loads()} loads" if HIER in plan.systems and plan.hier else ""),
        f"  estimated wall time: {est:.0f} s (model in report.estimate_case_s; first-run NVRTC compiles "
        f"counted at 2 s per load); budget {args.budget_s:.0f} s, hard guard {args.timeout_s:.0f} s",
    ]
    return "\n".join(lines)


# =========================================================================== context


@dataclass
class Ctx:
    args: argparse.Namespace
    plan: Plan
    rank: int
    world: int
    local_rank: int
    device: object
    group_name: str
    t0: float
    meta: dict
    rows: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stem: str = ""
    symm: object = None  # (tensor, handle) of the symmetric buffer, or None
    nccl_here: tuple = ("default",)  # the NCCL variants this process measures (the child: nomix, symm)
    nsymm: object = None  # (input, output) flat buffers registered as NCCL symmetric windows, or None
    comm: object = None  # Purlin communicator
    colls: dict = field(default_factory=dict)  # (collective, variant name) -> loaded Purlin collective
    hcolls: dict = field(default_factory=dict)  # (collective, gpus_per_node) -> loaded hierarchical collective
    failures: list = field(default_factory=list)  # correctness failures, for the exit status
    hung: dict = field(default_factory=dict)  # (system, variant, collective) -> why it is skipped from now on
    finished: bool = False
    finish_lock: threading.Lock = field(default_factory=threading.Lock)

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[{time.time() - self.t0:6.1f}s] {msg}", flush=True)

    def add(self, row: dict) -> None:
        with self.lock:
            self.rows.append(row)


def sync() -> None:
    torch.cuda.synchronize()


def barrier(ctx: Ctx) -> None:
    dist.barrier(device_ids=[ctx.local_rank])
    sync()


def allreduce_max(ctx: Ctx, values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def guarded(ctx: Ctx, fn: Callable):
    """Run ``fn`` on every rank; all ranks learn whether any failed, so they stay in step.

    Returns (ok, value, error text naming the failing ranks)."""
    err, value = None, None
    try:
        value = fn()
        sync()
    except Exception as e:  # noqa: BLE001 - any failure becomes an error row
        err = f"{type(e).__name__}: {e}".strip()
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()
    flag = allreduce_max(ctx, [1.0 if err else 0.0])[0]
    if not flag:
        return True, value, None
    msgs = [None] * ctx.world
    dist.all_gather_object(msgs, err)
    text = "; ".join(f"rank {r}: {m}" for r, m in enumerate(msgs) if m) or "failed on another rank"
    return False, value, text[:2000]


# =========================================================================== cases


@dataclass
class Case:
    system: str
    variant: str
    load: Callable  # load(x): poison the output, then put this rank's input x in place
    call: Callable  # one collective call on the current stream
    output: Callable  # () -> the tensor to check on this rank, or None
    repeat_safe: bool  # repeated calls leave the same output (so a graph replay can be checked)
    sms: int | None = None
    sms_note: str = ""
    options: dict = field(default_factory=dict)
    after: Callable | None = None  # e.g. raise a device-side error the runtime recorded


def poison(t) -> None:
    if t is not None:
        t.fill_(float("nan"))


def nccl_sms() -> tuple[int | None, str]:
    lo, hi = os.environ.get("NCCL_MIN_NCHANNELS"), os.environ.get("NCCL_MAX_NCHANNELS")
    if lo and hi and lo == hi:
        return int(lo), "NCCL_MIN_NCHANNELS = NCCL_MAX_NCHANNELS (one CTA per channel)"
    if hi:
        return None, f"at most NCCL_MAX_NCHANNELS={hi} CTAs; NCCL picks per size"
    return None, "NCCL picks channels (one CTA each) per size; not exposed through torch"


def nccl_env() -> dict:
    return {k: os.environ[k] for k in ("NCCL_GRAPH_MIXING_SUPPORT", "NCCL_NVLS_ENABLE") if k in os.environ}


def nccl_case(ctx: Ctx, coll: str, lay: report.Layout, X, Y, variant: str = "default") -> Case:
    rank, root, R = ctx.rank, 0, ctx.world
    is_root = rank == root
    sms, note = nccl_sms()

    def load_out_of_place(x):
        poison(Y)
        X.copy_(x)

    def load_in_place(x):  # torch's all_reduce / reduce / broadcast work in place on Y
        poison(Y)
        if coll != "broadcast" or is_root:
            Y.copy_(x)

    out = lambda: Y  # noqa: E731
    if coll == "allreduce":
        call, load, safe = (lambda: dist.all_reduce(Y)), load_in_place, False
    elif coll == "allgather":
        call, load, safe = (lambda: dist.all_gather_into_tensor(Y, X)), load_out_of_place, True
    elif coll == "reduce_scatter":
        call, load, safe = (lambda: dist.reduce_scatter_tensor(Y, X)), load_out_of_place, True
    elif coll == "alltoall":
        call, load, safe = (lambda: dist.all_to_all_single(Y, X)), load_out_of_place, True
    elif coll == "broadcast":
        call, load, safe = (lambda: dist.broadcast(Y, src=root)), load_in_place, True
    elif coll == "reduce":
        call, load, safe = (lambda: dist.reduce(Y, dst=root)), load_in_place, False
        out = lambda: Y if is_root else None  # noqa: E731
    elif coll == "gather":
        glist = list(Y.chunk(R)) if is_root else None
        call, load, safe = (lambda: dist.gather(X, gather_list=glist, dst=root)), load_out_of_place, True
        out = lambda: Y if is_root else None  # noqa: E731
    elif coll == "scatter":
        slist = list(X.chunk(R)) if is_root else None
        call, load, safe = (lambda: dist.scatter(Y, scatter_list=slist, src=root)), load_out_of_place, True
    else:
        raise ValueError(coll)
    options = {"env": nccl_env()}
    if variant == "symm":
        options["symmetric_buffers"] = (ctx.meta.get("nccl_symm") or {}).get("method")
    return Case("nccl", variant, load, call, out, safe, sms, note, options)


def nccl_symm_case(ctx: Ctx, coll: str, lay: report.Layout) -> Case:
    """NCCL on buffers registered as symmetric windows (views at offset 0 of two big ones)."""
    SX, SY = ctx.nsymm
    if SX.numel() < lay.in_elems or SY.numel() < lay.out_elems:
        raise RuntimeError(f"NCCL symmetric buffers hold {SX.numel()}/{SY.numel()} elements, "
                           f"{lay.in_elems}/{lay.out_elems} needed")
    return nccl_case(ctx, coll, lay, SX[: lay.in_elems], SY[: lay.out_elems], variant="symm")


def symm_cases(ctx: Ctx, lay: report.Layout, Y) -> list[Case]:
    """torch symmetric memory one-shot and two-shot all-reduce (input in the symmetric buffer)."""
    S, _ = ctx.symm
    n = lay.in_elems
    if S.numel() < n:
        raise RuntimeError(f"symmetric buffer holds {S.numel()} elements, {n} needed")
    Sv = S[:n]
    ops = torch.ops.symm_mem
    g = ctx.group_name
    note = "torch symm_mem kernel grid not exposed"

    def load(x):
        poison(Y)
        Sv.copy_(x)

    cases = []
    if hasattr(ops, "one_shot_all_reduce_out"):
        cases.append(Case("symm_mem", "one-shot", load, lambda: ops.one_shot_all_reduce_out(Sv, "sum", g, Y),
                          lambda: Y, True, None, note))
    else:
        cases.append(Case("symm_mem", "one-shot", load, lambda: Y.copy_(ops.one_shot_all_reduce(Sv, "sum", g)),
                          lambda: Y, True, None, note + "; one_shot_all_reduce + copy (no _out op)"))
    # two-shot reduces in the symmetric input as well, so repeated calls grow the values.
    if hasattr(ops, "two_shot_all_reduce_out"):
        cases.append(Case("symm_mem", "two-shot", load, lambda: ops.two_shot_all_reduce_out(Sv, "sum", g, Y),
                          lambda: Y, False, None, note))
    else:
        cases.append(Case("symm_mem", "two-shot", load, lambda: ops.two_shot_all_reduce_(Sv, "sum", g),
                          lambda: Sv, False, None, note + "; in place"))
    return cases


def _purlin_io(coll: str, rank: int, X, Y):
    """(load, output) of a Purlin case, flat or hierarchical: fresh input into X, Y poisoned;
    the output is Y except on the non-roots of the rooted gathers."""

    def load(x):
        poison(Y)
        X.copy_(x)

    def output():
        return None if coll in ("reduce", "gather") and rank != 0 else Y

    return load, output


def purlin_case(ctx: Ctx, coll: str, variant: purlin_api.Variant, X, Y) -> Case:
    loaded = ctx.colls[(coll, variant.name)]
    reduce = coll in report.REDUCE_COLLECTIVES
    rank = ctx.rank
    load, output = _purlin_io(coll, rank, X, Y)

    call = purlin_api.bind_call(loaded, coll, X, Y, rank=rank, root=0, reduce=reduce)
    sms, note = purlin_api.grid_sms(loaded, variant.options, X, Y)
    return Case("purlin", variant.name, load, call, output, True, sms, note, dict(variant.options),
                after=lambda: purlin_api.check_errors(ctx.comm, loaded))


def hier_variant(g: int) -> str:
    return f"g{g}"


def hier_case(ctx: Ctx, coll: str, g: int, lay: report.Layout, X, Y) -> Case:
    """purlin/hierarchical g<G>: the world as R/G nodes of G ranks, on ordinary torch buffers
    (the same X, Y as NCCL).  Every rank passes count= (a rank without input or output still
    takes part in the phases) and the same buffer conventions as the flat Purlin call."""
    loaded = ctx.hcolls[(coll, g)]
    reduce = coll in report.REDUCE_COLLECTIVES
    rank = ctx.rank
    load, output = _purlin_io(coll, rank, X, Y)

    call = purlin_api.bind_call(loaded, coll, X, Y, rank=rank, root=0, reduce=reduce, count=lay.count)
    options = {"gpus_per_node": g, "nodes": ctx.world // g}
    note = "Purlin kernels per intra phase + NCCL per inter phase; not summed"
    return Case(HIER, hier_variant(g), load, call, output, True, None, note, options,
                after=lambda: purlin_api.check_errors(None, loaded))


# =========================================================================== reference and check


def fresh_input(ctx: Ctx, n: int, salt: int):
    g = torch.Generator(device=ctx.device)
    g.manual_seed((ctx.args.seed * 1_000_003 + salt * 7919 + ctx.rank * 104_729) % (2**63))
    return torch.randn(n, generator=g, device=ctx.device, dtype=torch.float32).to(torch.bfloat16)


def _fsum(rows):
    acc = rows[0].float()
    for r in rows[1:]:
        acc += r.float()
    return acc.to(torch.bfloat16)


def reference(ctx: Ctx, lay: report.Layout, x):
    """This rank's expected output, from every rank's input (gathered by NCCL) computed locally
    in float32: independent of every system under test, NCCL's collective included."""
    R, rank, root, c = ctx.world, ctx.rank, 0, lay.count
    allx = torch.empty(R * lay.in_elems, dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(allx, x)
    ins = allx.view(R, lay.in_elems)
    coll = lay.collective
    if coll == "allreduce":
        return _fsum(list(ins))
    if coll == "allgather":
        return allx
    if coll == "reduce_scatter":
        return _fsum([ins[p].view(R, c)[rank] for p in range(R)])
    if coll == "alltoall":
        return ins.view(R, R, c)[:, rank, :].reshape(-1).clone()
    if coll == "broadcast":
        return ins[root].clone()
    if coll == "reduce":
        return _fsum(list(ins)) if rank == root else None
    if coll == "gather":
        return allx if rank == root else None
    if coll == "scatter":
        return ins[root].view(R, c)[rank].clone()
    raise ValueError(coll)


def compare(out, ref, reduce: bool) -> tuple[bool, str]:
    if ref is None:
        return True, "no output on this rank"
    if out is None or out.shape != ref.shape:
        return False, f"output shape {None if out is None else tuple(out.shape)} != {tuple(ref.shape)}"
    if reduce:
        o, r = out.float(), ref.float()
        if not bool(torch.isfinite(o).all()):
            bad = int((~torch.isfinite(o)).sum())
            return False, f"{bad} of {o.numel()} elements not finite (unwritten?)"
        err = float((o - r).norm() / r.norm().clamp_min(1e-30))
        return err <= CHECK_RTOL, f"rel L2 error {err:.2e}"
    if torch.equal(out, ref):
        return True, "bit-exact"
    bad = int((out != ref).sum())
    return False, f"{bad} of {out.numel()} elements differ"


def check_case(ctx: Ctx, lay: report.Layout, case: Case, salt: int, graph) -> dict[str, tuple]:
    """Fresh random input, poisoned output, one call (and one graph replay where repeat-safe)."""
    reduce = lay.collective in report.REDUCE_COLLECTIVES
    x = fresh_input(ctx, lay.in_elems, salt)
    ref = reference(ctx, lay, x)
    results = {}

    def eager():
        case.load(x)
        case.call()
        sync()
        if case.after:
            case.after()
        return compare(case.output(), ref, reduce)

    results["eager"] = _agree_check(ctx, *guarded(ctx, eager))
    if graph is not None and case.repeat_safe:
        def replay():
            case.load(x)
            graph.replay()
            sync()
            return compare(case.output(), ref, reduce)

        results["graph"] = _agree_check(ctx, *guarded(ctx, replay))
    elif graph is not None:
        ok_, note = results["eager"]
        results["graph"] = (ok_, f"eager check ({note}); calls not repeat-safe, graph replay not checked")
    return results


def _agree_check(ctx: Ctx, ran: bool, value, err) -> tuple[bool | None, str]:
    if not ran:
        return None, f"check could not run: {err}"
    good, note = value
    flags = allreduce_max(ctx, [0.0 if good else 1.0])
    if not flags[0]:
        return True, note
    notes = [None] * ctx.world
    dist.all_gather_object(notes, None if good else note)
    return False, "; ".join(f"rank {r}: {n}" for r, n in enumerate(notes) if n)


# =========================================================================== timing


def _events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def calls_us(call: Callable[[], object], calls: int, warm: int = 0) -> float:
    """Device time per call of ``calls`` calls of ``call`` back to back, between CUDA events
    (after ``warm`` untimed calls and a device sync, when asked)."""
    if warm:
        for _ in range(warm):
            call()
        sync()
    start, end = _events()
    start.record()
    for _ in range(calls):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def probe_us(case: Case) -> float:
    value = calls_us(case.call, 1, warm=2)
    if case.after:
        case.after()
    return value


def eager_iters(call_us: float, target_rep_us: float) -> int:
    """Eager calls per timed repeat: enough that a repeat lasts about ``target_rep_us`` by
    ``call_us``, the slowest rank's measured time per back-to-back call (every rank must make the
    same number of calls), 2 to 1,000.

    Lining the ranks up before a repeat (a barrier, then a device sync) still releases them a
    few tens of microseconds apart, and that lag lands in the repeat.  Sized from the one-call
    probe (an event pair around a single call: 30-150 us where a call issues in 6), a repeat
    held only 19-100 calls of a 1 KiB collective (run 19); sized from a measured loop it holds
    about 300-500 (runs 20-21), over which that lag spreads thin.  What remains between rows is
    the host's own drift (benchmarks/results/2026-12-01-h200x2-affinity-ab.md)."""
    return max(2, min(1000, int(target_rep_us / max(call_us, 0.5))))


def time_eager(case: Case, iters: int, reps: int, line_up: Callable[[], None]) -> list[float]:
    """Device time per call of ``iters`` calls issued back to back.  The ranks line up
    (``line_up``: a barrier, then a device sync) before each timed loop, for every system
    alike: a rank that enters its loop late would otherwise put its lag -- Python's, not the
    library's -- into the other rank's first call (measured 2026-11-30 with
    benchmarks/host_path.py: lined up, a Purlin 1 KiB all-reduce issues at 5.3-5.6 us per
    call, its host time).  ``eager_iters`` says how many calls make a repeat long enough."""
    for _ in range(min(iters, 100)):
        case.call()
    sync()
    out = []
    for _ in range(reps):
        line_up()
        out.append(calls_us(case.call, iters))
    if case.after:
        case.after()
    return out


def capture(case: Case, iters: int):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch recommends before capture
        for _ in range(2):
            case.call()
    torch.cuda.current_stream().wait_stream(side)
    sync()
    graph = torch.cuda.CUDAGraph()
    # thread_local: NCCL's watchdog thread keeps querying events while we capture.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(iters):
            case.call()
    return graph


def graph_replays(replay_us: float, target_rep_us: float) -> int:
    """Replays of one graph per timed repeat: enough that a repeat lasts about
    ``target_rep_us`` by ``replay_us``, one replay's time (the slowest rank's: every rank must
    replay the same number of times, or one would wait for a peer that has stopped), 1 to 100.

    The ranks' host loops are not lined up between repeats, so a rank's first call waits for
    the other rank to reach its replay: that lag lands in the repeat's time.  One replay of 20
    small calls lasts about 40 us, and a few microseconds of host lag then moved the per-call
    figure by 0.3-1.3 us from one row to the next (run 15: the same kernel as the default and as
    an explicit variant).  Replaying the graph back to back spreads the lag over every replay;
    each replay is still the same graph of ``calls`` calls, for every system alike.  (Runs 16-17
    sized this from the eager probe's one-call time, which the host's launch and the events
    dominate: 1-7 replays where 50 were meant, and the same kernel still differed by up to
    0.9 us between rows.)"""
    return max(1, min(100, int(target_rep_us / max(replay_us, 1.0))))


def capture_graph(case: Case, iters: int) -> tuple[object, float]:
    """The captured graph, replayed once untimed, and one more replay's time in us."""
    graph = capture(case, iters)
    graph.replay()
    sync()
    start, end = _events()
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return graph, start.elapsed_time(end) * 1e3


def time_graph(case: Case, graph, iters: int, reps: int, replays: int) -> list[float]:
    """Per-call time of ``reps`` repeats, each ``replays`` replays of ``graph`` back to back."""
    out = []
    for _ in range(reps):
        start, end = _events()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / (iters * replays))
    if case.after:
        case.after()
    return out


def run_case(ctx: Ctx, lay: report.Layout, case: Case, x_time, salt: int) -> list[dict]:
    args = ctx.args
    base = {"system": case.system, "variant": case.variant, "collective": lay.collective, "dtype": "bfloat16",
            "bytes": lay.bytes, "count": lay.count, "world_size": ctx.world, "sms": case.sms,
            "sms_note": case.sms_note, "options": case.options or None, "repeat_safe": case.repeat_safe,
            "limit_us": round(report.limit_us(lay.collective, ctx.world, lay.bytes), 3)}
    views = ctx.plan.views(lay.bytes)

    def view_base(mode, calls):
        return {**base, "mode": mode, "calls_per_graph": calls}

    def error_rows(msg):
        return [{**view_base(m, c), "time_us": None, "algbw_gbps": None, "busbw_gbps": None, "pct_of_limit": None,
                 "checked": None, "error": msg} for m, c in views]

    key = (case.system, case.variant, lay.collective)
    if key in ctx.hung:
        return error_rows(f"skipped: {ctx.hung[key]}")
    barrier(ctx)
    t_probe = time.time()
    ran, t1, err = guarded(ctx, lambda: (case.load(x_time), probe_us(case))[1])
    if not ran:
        if time.time() - t_probe > PROBE_LIMIT_US / 1e6 or "timeout" in err.lower() or "timed out" in err.lower():
            ctx.hung[key] = f"hung at {report.fmt_bytes(lay.bytes)}: {err[:300]}"
        return error_rows(f"probe: {err}")
    t1 = allreduce_max(ctx, [t1])[0]
    if t1 > PROBE_LIMIT_US:
        ctx.hung[key] = f"a call took {t1 / 1e3:.0f} ms at {report.fmt_bytes(lay.bytes)}"
        return error_rows(f"probe: one call took {t1 / 1e3:.0f} ms (a device-side wait timing out?)")
    iters = None  # eager calls per repeat (eager_iters), set when the eager view is timed
    replays: dict = {}
    measured, graph, errors = {}, None, {}
    for mode, calls in views:
        barrier(ctx)
        if mode == "eager":
            ran, value, err = guarded(ctx, lambda: calls_us(case.call, 20, warm=20))
            if ran:
                iters = eager_iters(allreduce_max(ctx, [value])[0], args.target_rep_us)
                barrier(ctx)
                ran, value, err = guarded(ctx, lambda: time_eager(case, iters, args.reps, lambda: barrier(ctx)))
        else:
            ran, value, err = guarded(ctx, lambda: capture_graph(case, calls))
            if ran:
                g, one_us = value
                # Every rank replays as often as the slowest rank's replay time says.
                replays[calls] = graph_replays(allreduce_max(ctx, [one_us])[0], args.target_rep_us)
                barrier(ctx)
                ran, value, err = guarded(ctx, lambda: time_graph(case, g, calls, args.reps, replays[calls]))
                if ran and graph is None:
                    graph = g  # the first (primary) graph that timed cleanly is checked
                del g
        if ran:
            measured[(mode, calls)] = value
        else:
            errors[(mode, calls)] = err
    # One collective for all numbers: the slowest rank's median (and its spread).
    flat = []
    for view in views:
        v = measured.get(view)
        flat += [statistics.median(v), min(v), max(v)] if v else [-1.0, -1.0, -1.0]
    flat = allreduce_max(ctx, flat)

    barrier(ctx)
    try:
        checks = check_case(ctx, lay, case, salt, graph)
    except Exception as e:  # noqa: BLE001
        checks = {m: (None, f"check failed to run: {type(e).__name__}: {e}") for m in ctx.plan.modes}
    del graph

    rows = []
    for i, (mode, calls) in enumerate(views):
        if (mode, calls) in errors:
            rows.append({**view_base(mode, calls), "time_us": None, "algbw_gbps": None, "busbw_gbps": None,
                         "pct_of_limit": None, "checked": None, "error": f"{mode}: {errors[(mode, calls)]}"})
            continue
        med, lo, hi = flat[3 * i: 3 * i + 3]
        checked, note = checks.get(mode, checks.get("eager", (None, "not checked")))
        if mode == "graph" and calls != views[[m for m, _ in views].index("graph")][1]:
            note = f"{note} (checked on the {ctx.plan.calls[0]}-call graph)"
        row = {**view_base(mode, calls), "time_us": med, "time_us_min": lo, "time_us_max": hi,
               "iters": iters if mode == "eager" else calls, "reps": args.reps,
               "replays": replays.get(calls) if mode == "graph" else None,
               "algbw_gbps": report.algbw_gbps(lay.bytes, med),
               "busbw_gbps": report.busbw_gbps(lay.collective, ctx.world, lay.bytes, med),
               "pct_of_limit": report.pct_of_limit(lay.collective, ctx.world, lay.bytes, med),
               "checked": checked, "check_note": note, "error": None}
        rows.append(row)
        if checked is False:
            msg = (f"CHECK FAILED: {case.system}/{case.variant} {lay.collective} "
                   f"{report.fmt_bytes(lay.bytes)} {mode}{'' if calls is None else f' x{calls}'}: {note}")
            ctx.failures.append(msg)
            if ctx.rank == 0:
                print("!" * 8 + " " + msg, file=sys.stderr, flush=True)
    return rows


# =========================================================================== peaks


def measure_peaks(ctx: Ctx) -> dict:
    """One-way peer bandwidth from rank 0 into rank 1: copy engine, SM stores, NCCL send/recv."""
    sizes = [s for s in (1 * report.MiB, 16 * report.MiB, 256 * report.MiB, 1 * report.GiB)
             if s <= ctx.args.peak_bytes] or [ctx.args.peak_bytes]
    peaks = {}
    if ctx.world < 2:
        return {"error": "one rank: no peer"}
    remote = None
    if ctx.symm is not None:
        S, handle = ctx.symm

        def get_remote(n):
            return handle.get_buffer(1, (n,), torch.uint8, 0)

        remote = get_remote
    ce_how = ("torch copy_ into rank 1's symmetric buffer (torch symm_mem get_buffer): "
              "cudaMemcpyAsync over a peer mapping = copy engine")
    sm_how = "torch elementwise kernel (mul by 1) writing rank 1's symmetric buffer: SM stores"
    raw = purlin_api.raw_peer_copy(ctx.comm) if ctx.comm is not None else None
    if remote is not None:
        peaks["ce_one_way"] = _peak(ctx, sizes, remote, "ce", ce_how)
        peaks["sm_store_one_way"] = _peak(ctx, sizes, remote, "sm", sm_how)
    else:
        peaks["ce_one_way"] = {"how": ce_how, "error": "no symmetric buffer (symm_mem unavailable)"}
    if raw is not None:
        peaks["purlin_raw_copy"] = {"how": f"comm.{raw[0]} exists; not measured (its signature is not fixed yet)"}
    peaks["nccl_sendrecv_one_way"] = _peak_sendrecv(ctx, sizes[-1])
    return peaks


def _peak(ctx: Ctx, sizes, remote, kind: str, how: str) -> dict:
    points = []
    for n in sizes:
        def body():
            if ctx.rank != 0:
                return None
            dst = remote(n)
            src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=ctx.device)
            if kind == "ce":
                op = lambda: dst.copy_(src)  # noqa: E731
            else:
                d16, s16 = dst.view(torch.bfloat16), src.view(torch.bfloat16)
                op = lambda: torch.mul(s16, 1, out=d16)  # noqa: E731
            iters = max(3, min(50, int(20 * report.MiB * 50 / n) or 3))
            times = [calls_us(op, iters, warm=3 if i == 0 else 0) for i in range(5)]
            return statistics.median(times)

        barrier(ctx)
        ran, t, err = guarded(ctx, body)
        if not ran:
            return {"how": how, "error": err, "points": points}
        t = allreduce_max(ctx, [t or 0.0])[0]
        points.append({"bytes": n, "time_us": t, "gbps": report.algbw_gbps(n, t)})
    barrier(ctx)
    return {"how": how, "points": points}


def _peak_sendrecv(ctx: Ctx, n: int) -> dict:
    how = "dist.send rank 0 -> dist.recv rank 1 (NCCL), timed on both, slowest kept: the documented fallback"

    def body():
        buf = torch.empty(n, dtype=torch.uint8, device=ctx.device)
        if ctx.rank == 0:
            buf.random_(0, 255)
        op = None
        if ctx.rank == 0:
            op = lambda: dist.send(buf, dst=1)  # noqa: E731
        elif ctx.rank == 1:
            op = lambda: dist.recv(buf, src=0)  # noqa: E731
        if op is None:
            return 0.0
        for _ in range(2):
            op()
        sync()
        times = []
        for _ in range(3):
            start, end = _events()
            start.record()
            for _ in range(3):
                op()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / 3)
        return statistics.median(times)

    barrier(ctx)
    ran, t, err = guarded(ctx, body)
    if not ran:
        return {"how": how, "error": err}
    t = allreduce_max(ctx, [t or 0.0])[0]
    return {"how": how, "points": [{"bytes": n, "time_us": t, "gbps": report.algbw_gbps(n, t)}]}


# =========================================================================== setup


def setup_symm(ctx: Ctx, nbytes: int) -> None:
    def body():
        import torch.distributed._symmetric_memory as symm_mem

        try:
            with warnings.catch_warnings():  # needed by older torch; deprecated (a no-op) in newer
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(ctx.group_name)
        except Exception:  # noqa: BLE001
            pass
        S = symm_mem.empty(max(nbytes // 2, 8), dtype=torch.bfloat16, device=ctx.device)
        handle = symm_mem.rendezvous(S, ctx.group_name)
        return S, handle

    ran, value, err = guarded(ctx, body)
    ctx.symm = value if ran else None
    ctx.meta["symm_mem"] = {"buffer_bytes": nbytes} if ran else {"error": err}
    ctx.log(f"symm_mem buffer {report.fmt_bytes(nbytes)}: {'ok' if ran else err}")


def setup_nccl_symm(ctx: Ctx, in_bytes: int, out_bytes: int) -> None:
    """Two flat bf16 buffers registered with NCCL as symmetric windows, so that ordinary
    dist.all_reduce / all_gather_into_tensor / reduce_scatter_tensor on views of them take
    NCCL's symmetric kernels.  Two ways (torch 2.11, NCCL 2.28), tried in order; the one that
    worked, or why neither did, goes into meta.nccl_symm (a failure never stops the run)."""
    n_in, n_out = max(in_bytes // 2, 8), max(out_bytes // 2, 8)
    tried = {}

    def via_symm_mem():
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.set_backend("NCCL")
        SX = symm_mem.empty(n_in, dtype=torch.bfloat16, device=ctx.device)
        SY = symm_mem.empty(n_out, dtype=torch.bfloat16, device=ctx.device)
        symm_mem.rendezvous(SX, ctx.group_name)
        symm_mem.rendezvous(SY, ctx.group_name)
        return SX, SY

    def via_mem_pool():
        backend = dist.group.WORLD._get_backend(ctx.device)
        pool = torch.cuda.MemPool(backend.mem_allocator)
        with torch.cuda.use_mem_pool(pool):
            SX = torch.empty(n_in, dtype=torch.bfloat16, device=ctx.device)
            SY = torch.empty(n_out, dtype=torch.bfloat16, device=ctx.device)
        try:
            backend.register_mem_pool(pool, symm=True)
        except TypeError as e:  # no symm= in this torch: plain registration is not what we measure
            raise RuntimeError(f"register_mem_pool(pool, symm=True) unsupported: {e}") from e
        ctx.meta.setdefault("_keep", []).append(pool)  # the pool must outlive the buffers
        return SX, SY

    for name, how in (("symm_mem.set_backend('NCCL') + symm_mem.empty + rendezvous", via_symm_mem),
                      ("MemPool(backend.mem_allocator) + register_mem_pool(symm=True)", via_mem_pool)):
        ran, value, err = guarded(ctx, how)
        if ran:
            ctx.nsymm = value
            ctx.meta["nccl_symm"] = {"method": name, "in_bytes": in_bytes, "out_bytes": out_bytes,
                                     **({"failed_first": tried} if tried else {})}
            ctx.log(f"NCCL symmetric buffers: {name}")
            return
        tried[name] = err
    ctx.meta["nccl_symm"] = {"error": "; ".join(f"{k}: {v}" for k, v in tried.items())[:2000]}
    ctx.log(f"NCCL symmetric buffers unavailable: {ctx.meta['nccl_symm']['error'][:300]}")


def run_nccl_child(ctx: Ctx) -> None:
    """Measure the nomix / symm NCCL variants in a child process group with
    NCCL_GRAPH_MIXING_SUPPORT=0 (read once per process by NCCL), then merge its rows."""
    wanted = [v for v in ctx.plan.nccl if v != "default"]
    if not wanted:
        return
    import socket
    import tempfile

    info = [None]
    if ctx.rank == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        info = [{"port": port, "out": str(Path(tempfile.mkdtemp(prefix="bench-nccl-")) / "child.json")}]
    dist.broadcast_object_list(info, src=0)
    port, out = info[0]["port"], Path(info[0]["out"])
    args = ctx.args
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env.update(NCCL_GRAPH_MIXING_SUPPORT="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world), LOCAL_RANK=str(ctx.local_rank),
               LOCAL_WORLD_SIZE=os.environ.get("LOCAL_WORLD_SIZE", str(ctx.world)))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--nccl-child", "--child-out", str(out),
           "--systems", "nccl", "--nccl-variants", ",".join(wanted), "--collectives", ",".join(ctx.plan.collectives),
           "--sizes", ",".join(str(b) for b in ctx.plan.sizes), "--modes", ",".join(ctx.plan.modes),
           "--calls-per-graph", ",".join(str(c) for c in ctx.plan.calls), "--reps", str(args.reps),
           "--many-calls-max-bytes", str(ctx.plan.many_calls_max_bytes),
           "--target-rep-us", str(args.target_rep_us), "--seed", str(args.seed), "--no-peak", "--no-plots",
           "--budget-s", str(max(10.0, args.child_timeout_s - 30)), "--timeout-s", str(args.child_timeout_s),
           "--pg-timeout-s", str(args.pg_timeout_s)]
    barrier(ctx)
    t = time.time()
    ctx.log(f"NCCL child ({', '.join(wanted)}; NCCL_GRAPH_MIXING_SUPPORT=0) started")
    status = "ok"
    try:
        done = subprocess.run(cmd, env=env, timeout=args.child_timeout_s + 90,
                              stdout=None if ctx.rank == 0 else subprocess.DEVNULL)
        status = f"exit {done.returncode}"
    except Exception as e:  # noqa: BLE001
        status = f"{type(e).__name__}: {e}"
    barrier(ctx)
    ctx.meta["nccl_variants"] = {"default": f"this process, env {nccl_env() or '(NCCL defaults)'}"}
    if ctx.rank == 0:
        try:
            child = json.loads(out.read_text())
            for row in child.get("rows", []):
                ctx.add(row)
                if row.get("checked") is False:
                    ctx.failures.append(f"CHECK FAILED: nccl/{row.get('variant')} {row.get('collective')} "
                                        f"{report.fmt_bytes(row.get('bytes'))} {row.get('mode')}: {row.get('check_note')}")
            cmeta = child.get("meta", {})
            for v in wanted:
                ctx.meta["nccl_variants"][v] = ("child process group, NCCL_GRAPH_MIXING_SUPPORT=0"
                                                + (f"; buffers: {cmeta.get('nccl_symm')}" if v == "symm" else ""))
            ctx.meta["nccl_child"] = {"status": status, "seconds": round(time.time() - t, 1),
                                      "child_status": cmeta.get("status"), "nccl_symm": cmeta.get("nccl_symm")}
        except Exception as e:  # noqa: BLE001
            ctx.meta["nccl_child"] = {"status": status, "error": f"no child results: {type(e).__name__}: {e}"}
            for v in wanted:
                ctx.meta["nccl_variants"][v] = f"FAILED: {status}; {e}"
        shutil.rmtree(out.parent, ignore_errors=True)
    ctx.log(f"NCCL child: {status} in {time.time() - t:.0f} s")


def precompile(ctx: Ctx) -> None:
    """Warm Purlin's on-disk compile cache with a process pool on one rank per host."""
    plan = ctx.plan
    jobs = purlin_api.precompile_jobs(plan.collectives, plan.variants if "purlin" in plan.systems else (), ctx.world)
    if HIER in plan.systems:
        jobs += purlin_api.hier_precompile_jobs(plan.collectives, plan.hier, ctx.world)
    info = {"jobs": len(jobs)}
    if ctx.local_rank == 0 and jobs:
        import concurrent.futures as cf
        import multiprocessing as mp

        major, minor = torch.cuda.get_device_capability(ctx.device)
        arch = f"sm_{major}{minor}"
        t = time.time()
        done, failed = 0, []
        pool = cf.ProcessPoolExecutor(max_workers=max(1, min(ctx.args.precompile_workers, len(jobs))),
                                      mp_context=mp.get_context("spawn"))
        try:
            futs = {pool.submit(purlin_api.precompile_one, j, arch): j for j in jobs}
            for f in cf.as_completed(futs, timeout=ctx.args.precompile_timeout_s):
                try:
                    f.result()
                    done += 1
                except Exception as e:  # noqa: BLE001
                    j = futs[f]
                    failed.append(f"{j['collective']}/{j['variant']}: {type(e).__name__}: {str(e)[:200]}")
        except Exception as e:  # noqa: BLE001 - a pool failure (or timeout) only loses the warm-up
            failed.append(f"pool: {type(e).__name__}: {e}")
        finally:
            # Never wait for a stuck worker: cancel what is queued, stop what runs.
            workers = list(getattr(pool, "_processes", {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            for w in workers:
                if w.is_alive():
                    w.terminate()
        info.update(arch=arch, compiled=done, failed=failed[:20], seconds=round(time.time() - t, 1))
        ctx.log(f"precompile: {done}/{len(jobs)} compiled in {info['seconds']} s"
                + (f", {len(failed)} failed (first: {failed[0]})" if failed else ""))
    barrier(ctx)
    ctx.meta["precompile"] = info


def setup_purlin(ctx: Ctx) -> None:
    free0 = torch.cuda.mem_get_info(ctx.device)[0]
    heap = purlin_api.heap_bytes_for(ctx.plan.loads())
    ctx.meta["purlin_heap"] = {"heap_bytes": heap or "PURLIN_HEAP_MB", "stage_bytes_per_collective":
                               purlin_api.stage_bytes(), "loads": ctx.plan.loads()}
    ran, comm, err = guarded(ctx, lambda: purlin_api.communicator(heap))
    if not ran:
        ctx.meta["purlin_error"] = f"Communicator.from_torch: {err}"
        ctx.log(f"Purlin communicator failed: {err}")
        for coll in ctx.plan.collectives:
            for v in ctx.plan.variants:
                if v.applies(coll):
                    ctx.add(_load_error_row(ctx, coll, v, f"communicator: {err}"))
        return
    ctx.comm = comm
    free1 = torch.cuda.mem_get_info(ctx.device)[0]
    load_times = {}
    for coll in ctx.plan.collectives:
        shared: dict = {}  # load_key -> loaded (zerocopy uses the default's collective)
        for v in ctx.plan.variants:
            if not v.applies(coll):
                continue
            key = purlin_api.load_key(v)
            if key in shared:
                ctx.colls[(coll, v.name)] = shared[key]
                continue
            t = time.time()
            ran, loaded, err = guarded(ctx, lambda: purlin_api.load(comm, coll, v.options))
            load_times[f"{coll}/{v.name}"] = round(time.time() - t, 2)
            if ran:
                ctx.colls[(coll, v.name)] = shared[key] = loaded
            else:
                ctx.add(_load_error_row(ctx, coll, v, f"load: {err}"))
    free2 = torch.cuda.mem_get_info(ctx.device)[0]
    ctx.meta["purlin_load_s"] = load_times
    ctx.meta["purlin_footprint"] = {"after_communicator": free0 - free1, "after_loads": free0 - free2,
                                    **purlin_api.device_bytes(comm)}
    ctx.log(f"Purlin: {len(ctx.colls)} collectives loaded in {sum(load_times.values()):.1f} s "
            f"({sum(1 for r in ctx.rows if r.get('phase') == 'load')} failed)")


def setup_hierarchical(ctx: Ctx) -> None:
    """Load every collective as purlin/hierarchical for each gpus_per_node of the plan (every
    rank, same order: each load is a collective).  A load that fails (no plan, a topology
    error) becomes one error row, and that variant is skipped for that collective."""
    load_times = {}
    for coll in ctx.plan.collectives:
        for g in ctx.plan.hier:
            t = time.time()
            ran, loaded, err = guarded(ctx, lambda: purlin_api.load_hierarchical(coll, g))
            load_times[f"{coll}/{hier_variant(g)}"] = round(time.time() - t, 2)
            if ran:
                ctx.hcolls[(coll, g)] = loaded
            else:
                ctx.add({"system": HIER, "variant": hier_variant(g), "collective": coll, "dtype": "bfloat16",
                         "bytes": None, "world_size": ctx.world, "mode": None, "time_us": None, "checked": None,
                         "options": {"gpus_per_node": g}, "error": f"load: {err}", "phase": "load"})
    ctx.meta["hier_load_s"] = load_times
    ctx.log(f"{HIER}: {len(ctx.hcolls)} of {ctx.plan.hier_loads()} loaded in {sum(load_times.values()):.1f} s")


def _load_error_row(ctx: Ctx, coll: str, v: purlin_api.Variant, err: str) -> dict:
    return {"system": "purlin", "variant": v.name, "collective": coll, "dtype": "bfloat16", "bytes": None,
            "world_size": ctx.world, "mode": None, "time_us": None, "checked": None, "options": v.options or None,
            "error": err, "phase": "load"}


def collect_meta(ctx: Ctx) -> None:
    m = ctx.meta
    props = torch.cuda.get_device_properties(ctx.device)
    names = [None] * ctx.world
    dist.all_gather_object(names, props.name)
    m.update(gpus=names, sm_count=props.multi_processor_count,
             capability=f"{props.major}.{props.minor}", torch=torch.__version__)
    try:
        m["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
    except Exception as e:  # noqa: BLE001
        m["nccl"] = f"unknown ({e})"
    m["nvidia_driver"] = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i",
                               str(ctx.local_rank)])
    try:
        from importlib.metadata import version

        m["cuda_bindings"] = version("cuda-bindings")
    except Exception:  # noqa: BLE001
        try:
            import cuda.bindings

            m["cuda_bindings"] = getattr(cuda.bindings, "__version__", "unknown")
        except Exception as e:  # noqa: BLE001
            m["cuda_bindings"] = f"not importable ({e})"
    try:
        m["purlinc"] = purlin_api.version()
    except Exception as e:  # noqa: BLE001
        m["purlinc"] = f"not importable ({e})"
    # An explicit --git-commit wins: the device machine's copy of the tree can carry a stale .git.
    commit = ctx.args.git_commit or _run(["git", "-C", str(ROOT), "rev-parse", "HEAD"])
    if commit and not ctx.args.git_commit:
        dirty = _run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])
        commit += "-dirty" if dirty else ""
    m["git_commit"] = commit
    m["env"] = {k: v for k, v in sorted(os.environ.items())
                if k.startswith(("NCCL_", "TORCH_SYMM_MEM", "PURLIN_", "CUDA_VISIBLE", "TORCH_NCCL"))}


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except Exception:  # noqa: BLE001
        return None


def machine_tag(ctx: Ctx) -> str:
    if ctx.args.machine:
        return ctx.args.machine
    name = torch.cuda.get_device_name(ctx.device).lower()
    short = next((t for t in reversed(name.replace("-", " ").split()) if any(ch.isdigit() for ch in t)), "gpu")
    return f"{''.join(ch for ch in short if ch.isalnum())}x{ctx.world}"


# =========================================================================== the run


def run(ctx: Ctx) -> None:
    plan, args = ctx.plan, ctx.args
    collect_meta(ctx)
    ctx.log(describe_plan(plan, args, ctx.world))
    ctx.meta["estimate_s"] = round(estimate_s(plan, args))
    if args.nccl_child:
        ctx.nccl_here = tuple(plan.nccl)
        if "symm" in plan.nccl:
            lays = [report.layout(c, ctx.world, s) for c in plan.collectives if c in NCCL_SYMM_COLLECTIVES
                    for s in plan.sizes]
            if lays:
                setup_nccl_symm(ctx, 2 * max(l.in_elems for l in lays), 2 * max(l.out_elems for l in lays))
    elif "nccl" in plan.systems:
        ctx.nccl_here = tuple(v for v in plan.nccl if v == "default")
        run_nccl_child(ctx)  # first, while nothing else of this run holds the GPUs or the CPUs

    need_symm = "symm_mem" in plan.systems or not args.no_peak
    if need_symm:
        ar_max = max((report.layout("allreduce", ctx.world, s).bytes for s in plan.sizes), default=0)
        symm_bytes = max(ar_max if "allreduce" in plan.collectives else 0, 0 if args.no_peak else args.peak_bytes)
        setup_symm(ctx, max(symm_bytes, report.MiB))
    if "purlin" in plan.systems or HIER in plan.systems:
        if not args.no_precompile:
            precompile(ctx)
    if "purlin" in plan.systems:
        setup_purlin(ctx)
    if HIER in plan.systems and plan.hier:
        setup_hierarchical(ctx)
    if not args.no_peak:
        ctx.meta["peaks"] = measure_peaks(ctx)
        best, how = report.measured_peak_gbps(ctx.meta)
        ctx.log(f"one-way peak: {report._num(best)} GB/s ({how})")
    write_partial(ctx)

    skipped = []
    for si, nbytes in enumerate(plan.sizes):
        elapsed = allreduce_max(ctx, [time.time() - ctx.t0])[0]
        if args.budget_s and elapsed > args.budget_s:
            skipped = plan.sizes[si:]
            ctx.meta["stopped_by_budget"] = {"elapsed_s": round(elapsed, 1), "budget_s": args.budget_s,
                                             "skipped_bytes": skipped}
            ctx.log(f"budget {args.budget_s:.0f} s exceeded ({elapsed:.0f} s): skipping "
                    + ", ".join(report.fmt_bytes(s) for s in skipped))
            break
        for ci, coll in enumerate(plan.collectives):
            run_size(ctx, coll, nbytes, salt=1000 * si + 10 * ci)
        write_partial(ctx)


def run_size(ctx: Ctx, coll: str, nbytes: int, salt: int) -> None:
    lay = report.layout(coll, ctx.world, nbytes)
    plan = ctx.plan
    ran, bufs, err = guarded(ctx, lambda: (torch.empty(lay.in_elems, dtype=torch.bfloat16, device=ctx.device),
                                           torch.empty(lay.out_elems, dtype=torch.bfloat16, device=ctx.device),
                                           fresh_input(ctx, lay.in_elems, salt)))
    if not ran:
        ctx.log(f"{coll} {report.fmt_bytes(lay.bytes)}: buffers failed: {err}")
        return
    X, Y, x_time = bufs
    cases: list[Case] = []
    build_errors = []
    if "nccl" in plan.systems:
        for variant in ctx.nccl_here:
            if variant != "symm":
                cases.append(nccl_case(ctx, coll, lay, X, Y, variant))
            elif coll in NCCL_SYMM_COLLECTIVES:
                if ctx.nsymm is None:
                    why = (ctx.meta.get("nccl_symm") or {}).get("error", "unavailable")
                    build_errors.append(("nccl", "symm", f"NCCL symmetric buffers: {why}"))
                else:
                    try:
                        cases.append(nccl_symm_case(ctx, coll, lay))
                    except Exception as e:  # noqa: BLE001
                        build_errors.append(("nccl", "symm", f"{type(e).__name__}: {e}"))
    if "symm_mem" in plan.systems and coll == "allreduce":
        if ctx.symm is None:
            why = (ctx.meta.get("symm_mem") or {}).get("error", "unavailable")
            build_errors += [("symm_mem", v, f"symmetric memory: {why}") for v in ("one-shot", "two-shot")]
        else:
            try:
                cases += symm_cases(ctx, lay, Y)
            except Exception as e:  # noqa: BLE001
                build_errors.append(("symm_mem", "one-shot", f"{type(e).__name__}: {e}"))
    heap_bufs = None
    if "purlin" in plan.systems and any(v.heap and v.applies(coll) and (coll, v.name) in ctx.colls
                                        for v in plan.variants):
        # Zero-copy buffers: a collective allocation in Purlin's symmetric heap (every rank is here).
        ran, heap_bufs, err = guarded(ctx, lambda: (purlin_api.empty(ctx.comm, lay.in_elems, torch.bfloat16),
                                                    purlin_api.empty(ctx.comm, lay.out_elems, torch.bfloat16)))
        if not ran:
            heap_bufs = None
            build_errors += [("purlin", v.name, f"comm.empty: {err}") for v in plan.variants
                             if v.heap and v.applies(coll)]
    if "purlin" in plan.systems:
        for v in plan.variants:
            if v.applies(coll) and (coll, v.name) in ctx.colls:
                if v.heap and heap_bufs is None:
                    continue
                try:
                    cases.append(purlin_case(ctx, coll, v, *(heap_bufs if v.heap else (X, Y))))
                except Exception as e:  # noqa: BLE001
                    build_errors.append(("purlin", v.name, f"{type(e).__name__}: {e}"))
    if HIER in plan.systems:
        for g in plan.hier:
            if (coll, g) in ctx.hcolls:  # a failed load has its error row already: no row per size
                try:
                    cases.append(hier_case(ctx, coll, g, lay, X, Y))
                except Exception as e:  # noqa: BLE001
                    build_errors.append((HIER, hier_variant(g), f"{type(e).__name__}: {e}"))
    for system, variant, err in build_errors:
        for mode, calls in plan.views(lay.bytes):
            ctx.add({"system": system, "variant": variant, "collective": coll, "dtype": "bfloat16",
                     "bytes": lay.bytes, "count": lay.count, "world_size": ctx.world, "mode": mode,
                     "calls_per_graph": calls, "time_us": None, "checked": None, "error": err})
    for k, case in enumerate(cases):
        for row in run_case(ctx, lay, case, x_time, salt * 100 + k + 1):
            ctx.add(row)
    progress(ctx, coll, lay.bytes)
    del X, Y, x_time, cases, heap_bufs  # the heap blocks are freed alike on every rank
    sync()
    for g in plan.hier:  # this size's scratch (its graphs are gone): memory stays flat over the sizes
        if (coll, g) in ctx.hcolls:
            purlin_api.free_scratch(ctx.hcolls[(coll, g)])
    torch.cuda.empty_cache()


def progress(ctx: Ctx, coll: str, nbytes: int) -> None:
    if ctx.rank != 0:
        return
    rows = [r for r in ctx.rows if r.get("collective") == coll and r.get("bytes") == nbytes]
    parts = []
    for mode in ("graph", "eager"):
        sub = report.select(rows, mode)
        n = report.best_nccl(sub, coll, nbytes, mode)
        d = report.one(sub, system="purlin", variant="default", mode=mode)
        z = report.one(sub, system="purlin", variant="zerocopy", mode=mode)
        b = report.best_purlin(sub, coll, nbytes, mode)
        s = report.best_of(sub, "symm_mem", coll, nbytes, mode)
        bit = (f"{mode[0]}: nccl {n['variant'] + ' ' + report._cell_time(n) if n else '-'} "
               f"default {report._cell_time(d)}" + (f" zc {report._cell_time(z)}" if z else ""))
        if b:
            bit += f" best {b['variant']} {report._num(b['time_us'])}"
        if s:
            bit += f" symm {report._num(s['time_us'])}"
        for h in sorted(report.rows_for(sub, system=HIER), key=lambda r: r["variant"]):
            bit += f" hier/{h['variant']} {report._cell_time(h)}"
        parts.append(bit)
    errs = sum(1 for r in rows if r.get("error"))
    wrong = sum(1 for r in rows if r.get("checked") is False)
    tail = (f" [{errs} error rows]" if errs else "") + (f" [{wrong} WRONG]" if wrong else "")
    ctx.log(f"{coll:>14} {report.fmt_bytes(nbytes):>8} us | " + " | ".join(parts) + tail)


# =========================================================================== output


def document(ctx: Ctx) -> dict:
    with ctx.lock:
        rows = list(ctx.rows)
    meta = {k: v for k, v in ctx.meta.items() if not k.startswith("_")}
    doc = {"meta": dict(meta, elapsed_s=round(time.time() - ctx.t0, 1)), "rows": rows}
    if ctx.args.merge:
        olds = [json.loads(p.read_text()) for p in ctx.args.merge if p.exists()]
        doc = report.merge(olds + [doc])
        doc["meta"] = dict(meta, elapsed_s=round(time.time() - ctx.t0, 1),
                           merged_from=[str(p) for p in ctx.args.merge])
    return doc


def write_partial(ctx: Ctx) -> None:
    if ctx.rank != 0:
        return
    if ctx.args.nccl_child:
        if ctx.args.child_out:
            report._atomic_write(ctx.args.child_out, json.dumps(document(ctx), default=str))
        return
    try:
        ctx.args.results_dir.mkdir(parents=True, exist_ok=True)
        path = ctx.args.results_dir / f"{ctx.stem}.json"
        report._atomic_write(path, json.dumps(document(ctx), indent=1, default=str))
        if ctx.args.out:
            ctx.args.out.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, ctx.args.out / path.name)
    except Exception as e:  # noqa: BLE001
        print(f"bench: partial write failed: {e}", file=sys.stderr)


def finish(ctx: Ctx, status: str) -> None:
    """Rank 0 writes everything once; a second caller (main thread vs. the timeout guard) waits."""
    if ctx.rank != 0:
        return
    with ctx.finish_lock:
        if ctx.finished:
            return
        ctx.finished = True
        _finish(ctx, status)


def _finish(ctx: Ctx, status: str) -> None:
    ctx.meta["status"] = status
    ctx.meta.pop("_keep", None)
    doc = document(ctx)
    if ctx.args.nccl_child:  # the parent merges these rows and writes the reports
        if ctx.args.child_out:
            report._atomic_write(ctx.args.child_out, json.dumps(doc, default=str))
        return
    try:
        paths = report.write_all(doc, ctx.args.results_dir, ctx.stem, plots=not ctx.args.no_plots)
        if ctx.args.out:
            ctx.args.out.mkdir(parents=True, exist_ok=True)
            for p in paths.values():
                shutil.copy(p, ctx.args.out / p.name)
        print(report.markdown(doc), flush=True)
        print("wrote: " + ", ".join(str(p) for p in paths.values())
              + (f" (copied to {ctx.args.out})" if ctx.args.out else ""), flush=True)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        write_partial(ctx)
    if ctx.failures:
        print(f"{len(ctx.failures)} CORRECTNESS FAILURES:\n  " + "\n  ".join(ctx.failures[:30]),
              file=sys.stderr, flush=True)


def install_guards(ctx: Ctx) -> None:
    def on_timeout():
        ctx.log(f"global timeout {ctx.args.timeout_s:.0f} s reached: writing what was measured and exiting")
        finish(ctx, f"timeout after {ctx.args.timeout_s:.0f} s (global guard)")
        sys.stdout.flush()
        os._exit(124)

    # Rank 0 writes the results; the others wait a little longer, so that their exit (which makes
    # torchrun stop every worker) cannot cut rank 0's writing short.
    grace = 0.0 if ctx.rank == 0 else 60.0
    timer = threading.Timer(ctx.args.timeout_s + grace, on_timeout)
    timer.daemon = True
    timer.start()

    def on_term(signum, _frame):
        if ctx.finished:  # already writing the results: let that complete
            return
        finish(ctx, f"killed by signal {signum}")
        sys.stdout.flush()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)


def _physical_cores(cpus: list[int]) -> list[tuple[int, ...]]:
    """``cpus`` grouped by physical core (SMT siblings together, from sysfs), in order of each
    core's first CPU; one group per CPU where the topology is not readable."""
    groups: dict[tuple[int, ...], None] = {}
    for cpu in cpus:
        try:
            text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
            siblings = set(report.parse_cpu_list(text))
        except (OSError, ValueError):
            siblings = {cpu}
        groups[tuple(sorted(siblings & set(cpus)) or [cpu])] = None
    return sorted(groups, key=lambda g: g[0])


def cpu_cores_for(local_rank: int, local_world: int, cpus: list[int]) -> list[int]:
    """The CPUs of ``local_rank``'s share of the physical cores: core i goes to rank
    i % local_world, so no two ranks share a core (or its SMT sibling) and each gets an equal
    share.  With fewer cores than ranks, every rank keeps them all."""
    cores = _physical_cores(cpus)
    if len(cores) < local_world:
        return sorted(cpus)
    return sorted(cpu for i, core in enumerate(cores) if i % local_world == local_rank for cpu in core)


def main(argv=None) -> int:
    args = parse_args(argv)
    plan = make_plan(args)
    if args.dry_run:
        world = args.world_size or int(os.environ.get("WORLD_SIZE", "2"))
        print(describe_plan(plan, args, world))
        for c in plan.collectives:
            lays = [report.layout(c, world, s) for s in plan.sizes]
            print(f"  {c:>14}: count per size " + ", ".join(f"{report.fmt_bytes(l.bytes)}={l.count}" for l in lays))
        return 0

    global torch, dist
    import torch as _torch
    import torch.distributed as _dist

    torch, dist = _torch, _dist
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
