"""Node scale on one GPU: the loopback matrix at R = 2, 3, 4, 5, 8 (and 16 for a few), its
parallel precompile under a time budget, the fresh-process first-call check and the summary.

    python3 tests/gpu/scale.py precompile      # every case's kernels, in priority order, within
                                               # PURLIN_SCALE_COMPILE_S; writes $OUT/loopback_scale_compiled.json
    python3 tests/gpu/scale.py first-call SPEC R [OPTIONS_JSON [DTYPE...]]
                                               # a fresh process's first group call (the R=8 hang)

tests/gpu/test_loopback_scale.py runs the cases (those precompiled, within PURLIN_SCALE_RUN_S)
and writes $OUT/loopback_scale.json and .md.  Cases are plain data; which kernels a case needs
follows from its calls, so the precompile and the run agree on them by construction.

Kinds of case (every one checks every rank bit for bit against the SNAC simulator of the
schedule that ran, outputs poisoned first):
  tuned   plain ``load()``: counts at both sides of every size bucket's bound
  pinned  every algorithm x atom (ldst, tma, ce) x packed option that applies, 2 channels
  dtypes  every dtype x op at a small count (plain load)
  graph   per-rank CUDA graphs (two calls each) replayed with fresh inputs
  hier    the intra-node phases of hierarchical plans at G = 4 and 8 (2 nodes), plain load
  big     plain load at R=8 with about a million elements per chunk
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from _common import EXAMPLES, examples  # noqa: E402

WORLDS = (2, 3, 4, 5, 8)
WORLDS_16 = ("allreduce.pln", "allgather.pln")  # R=16: 8 channels per rank fit 132 SMs
DTYPES = ("float32", "bfloat16", "float16", "int32")
OPS = ("sum", "max", "min")
ALGORITHMS = ("direct-push", "direct-pull", "two-shot", "ring")
ATOMS = ("ldst", "tma")
HIER_SPECS = ("allreduce.pln", "reduce_scatter.pln", "allgather.pln", "alltoall.pln")
GRAPH_SPECS = ("allreduce.pln", "alltoall.pln", "ar_2d")
SMALL_LIMIT = 4 << 20  # bytes per rank buffer: larger bucket bounds are sampled (one case in three)

# Collectives users write with many units per rank (2R to 4R chunks) and uneven layouts.
USER_SPECS = {
    "ar_2d": "collective ar_2d { in[r] = x[0..2][0..R]  out[r] = x[0..2][0..R]  reduce }",
    "ag_3": "collective ag_3 { in[r] = x[r][0..3]  out[r] = x[0..R][0..3]  copy }",
    "rs_4": "collective rs_4 { in[r] = x[0..R][0..4]  out[r] = x[r][0..4]  reduce }",
    "ag_uneven": ("collective ag_uneven { in[r] = x[r][0..r%2+1]  "
                  "out[r] = x[i][j] for i in 0..R for j in 0..i%2+1  copy }"),
    "rs_uneven": "collective rs_uneven { in[r] = x[0..R][0..3]  out[r] = x[r][0..r%3+1]  reduce }",
}
ROOTED = {"broadcast.pln", "reduce.pln", "gather.pln", "scatter.pln"}
FIRST_PINNED = (("algorithm", "direct-push"), ("atom", "ldst"), ("channels", 1), ("packed", True))
REFUSED = (("algorithm", "direct-push"), ("atom", "ldst"), ("channels", 264))  # the tuned table's large all-reduce
FITS_AFTER_REFUSAL = (("algorithm", "direct-push"), ("atom", "ldst"), ("channels", 16))


@dataclass(frozen=True)
class Case:
    kind: str
    world: int
    spec: str  # an example's file name, a USER_SPECS name, or "hier:<example>:G<g>:h<phase>"
    options: tuple = ()  # pinned: (("algorithm", ...), ("atom", ...), ("packed", ...), ...)
    calls: tuple = ()  # ((count, dtype, op), ...); tuned cases: derived from the buckets
    priority: int = 0
    seed: int = 0

    @property
    def id(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        dtype = f"-{self.calls[0][1]}" if self.kind == "first" else ""
        return f"{self.kind}-R{self.world}-{self.spec.removesuffix('.pln')}" + (f"-{opts}" if opts else "") + dtype


def spec_names() -> list[str]:
    return examples() + sorted(USER_SPECS)


def params_for(spec: str, world: int) -> dict | None:
    """A rooted example's root: the last rank at odd R (a root other than 0), else 0."""
    if spec in ROOTED:
        return {"root": world - 1 if world % 2 else 0}
    return None


def source_of(spec: str):
    """What ``load`` takes for a case's spec: a path, or .pln text."""
    if spec in USER_SPECS:
        return USER_SPECS[spec] + "\n"
    if spec.startswith("hier:"):
        _, example, g, phase = spec.split(":")
        from purlinc.runtime.hierarchical import intra_sources, plan_for

        G = int(g[1:])
        plan = plan_for(EXAMPLES / example, 2 * G, G)
        return intra_sources(plan, 0)[int(phase[1:])]
    return EXAMPLES / spec


def _rotate(i: int) -> tuple[str, str]:
    return DTYPES[i % len(DTYPES)], OPS[(i // len(DTYPES)) % len(OPS)]


def cases() -> list[Case]:
    """The whole matrix, highest priority first (a budget cuts it from the end)."""
    out: list[Case] = [
        # issue 25's hang: the first group call of a fresh process (plain load, then its bucket pinned)
        *(Case("first", 8, "ar_2d", options, calls=((1, dtype, "sum"),), priority=-1, seed=i)
          for i, (options, dtype) in enumerate((o, d) for o in ((), FIRST_PINNED) for d in ("float32", "bfloat16"))),
        # more blocks than one GPU holds for 8 ranks: refused before launch, then a fitting load runs
        Case("refuse", 8, "allreduce.pln", REFUSED, calls=((4097, "float32", "sum"),), priority=-1),
    ]
    n = 0
    for world in WORLDS:
        for spec in spec_names():
            out.append(Case("tuned", world, spec, priority=0, seed=n))
            n += 1
    for spec in WORLDS_16:
        out.append(Case("tuned", 16, spec, priority=2, seed=n))
        n += 1
    for world in WORLDS:
        for spec in spec_names():
            for algorithm in ALGORITHMS:
                for atom in ATOMS:  # the ce atom is refused where ranks share a GPU (test_loopback.py)
                    for packed in ((False, True) if algorithm == "direct-push" else (False,)):
                        dtype, op = _rotate(n)
                        slices = 1 if packed else 2
                        counts = (1, 4097, 100_003) if n % 3 == 0 else (1, 4097)
                        options = (("algorithm", algorithm), ("atom", atom), ("packed", packed), ("channels", 2),
                                   ("slices", slices))
                        # test_loopback.py covers the examples' pinned paths at R=2 and 4 already
                        covered = world in (2, 4) and spec in examples()
                        out.append(Case("pinned", world, spec, options, tuple((c, dtype, op) for c in counts),
                                        priority=4 if covered else 2, seed=n))
                        n += 1
    for world in WORLDS:
        for spec in ("allreduce.pln", "reduce_scatter.pln", "allgather.pln", "ar_2d"):
            calls = tuple((7, d, o) for d in DTYPES for o in OPS) if spec != "allgather.pln" else \
                tuple((7, d, "sum") for d in DTYPES)
            out.append(Case("dtypes", world, spec, calls=calls, priority=3, seed=n))
            n += 1
    for world in (2, 4, 8):
        for spec in GRAPH_SPECS:
            out.append(Case("graph", world, spec, calls=((4097, "float32", "sum"),), priority=1, seed=n))
            n += 1
    for G in (4, 8):
        for example in HIER_SPECS:
            for phase in hier_phases(example, G):
                out.append(Case("hier", G, f"hier:{example}:G{G}:h{phase}",
                                calls=((7, "float32", "sum"), (4097, "bfloat16", "max"), (100_003, "float32", "sum")),
                                priority=1, seed=n))
                n += 1
    for spec, count in (("allreduce.pln", 1_048_579), ("ar_2d", 262_147)):
        # issue 25: the default load at R=8 with about a million elements per chunk timed out
        out.append(Case("big", 8, spec, calls=((count, "float32", "sum"),), priority=-1, seed=n))
        n += 1
    # Within a priority, a fixed shuffle: a budget that cuts the list leaves an even sample of
    # worlds, specs and options rather than dropping the last world whole.
    shuffled = random.Random(25).sample(out, len(out))
    return sorted(shuffled, key=lambda c: c.priority)


_PHASES: dict = {}


def hier_phases(example: str, G: int) -> list[int]:
    """The intra-node phases with work of ``example`` on 2 nodes of G (derived on the CPU)."""
    key = (example, G)
    if key not in _PHASES:
        from purlinc.runtime.hierarchical import intra_sources, plan_for

        _PHASES[key] = sorted(intra_sources(plan_for(EXAMPLES / example, 2 * G, G), 0))
    return _PHASES[key]


def tuned_calls(case: Case, buckets, units: int) -> list[tuple[int, str, str]]:
    """A tuned case's calls: counts 1 and 7, and both sides of every finite bucket bound (the
    bounds above SMALL_LIMIT in one case of three), each pair in one dtype and op, which
    rotate from call to call."""
    from purlinc.dtypes import DType

    calls = [(1, *_rotate(case.seed)), (7, *_rotate(case.seed + 1))]
    for i, bucket in enumerate(b for b in buckets if b.max_bytes is not None):
        dtype, op = _rotate(case.seed + 2 + i)
        itemsize = DType.parse(dtype).itemsize
        inside = max(1, bucket.max_bytes // (itemsize * units))
        if inside * itemsize * units <= SMALL_LIMIT or case.seed % 3 == 0:
            calls += [(inside, dtype, op), (inside + 1, dtype, op)]
    return calls


def case_calls(case: Case, buckets=None, units: int = 1) -> list[tuple[int, str, str]]:
    return tuned_calls(case, buckets, units) if case.kind == "tuned" else list(case.calls)


# ------------------------------------------------------------------------------------------
# what a case compiles (the precompile and the run derive it alike)

def loopback_cap(world: int, sms: int) -> int:
    from purlinc.runtime import residency

    return residency.max_channels([0] * world, lambda device: sms)


def case_kernels(case: Case, arch: str, sms: int):
    """(Compiled, dtype, op) of every kernel the case launches; raises PurlinError where the
    options do not apply (the run skips the case for the same reason)."""
    from purlinc.dtypes import DType
    from purlinc.runtime import tuning
    from purlinc.runtime.collective import prepare
    from purlinc.runtime.tuned import prepare_tuned

    source, params = source_of(case.spec), params_for(case.spec, case.world)
    if case.options:
        pins = [case.options] + ([FITS_AFTER_REFUSAL] if case.kind == "refuse" else [])
        compileds = [prepare(source, case.world, params=params, arch=arch, **dict(p)) for p in pins]
        return [(c, d, o) for c in compileds for d, o in sorted({(d, o) for _, d, o in case.calls})]
    prepared, units = prepare_tuned(source, case.world, params=params, arch=arch,
                                    max_channels=loopback_cap(case.world, sms))
    buckets = tuple(p.bucket for p in prepared)
    jobs = {}
    for count, dtype, op in case_calls(case, buckets, units):
        index = tuning.choose(buckets, count * DType.parse(dtype).itemsize * units)
        compiled = prepared[index].compiled
        jobs[(compiled.key, dtype, op)] = (compiled, dtype, op)
    return list(jobs.values())


def _count_kernels(args):
    """(case id, how many kernels it compiles, or the reason it does not apply)."""
    case, arch, sms = args
    from purlinc.errors import PurlinError

    try:
        return case.id, len(case_kernels(case, arch, sms)), ""
    except PurlinError as error:
        return case.id, -1, str(error).splitlines()[0]


def _compile_kernel(args):
    """Compile kernel ``index`` of a case (each kernel is a job of its own: a case's kernels
    compile in parallel).  Returns (case id, "ok" | "error", note, seconds)."""
    case, index, arch, sms = args
    from purlinc.dtypes import DType, ReduceOp

    start = time.time()
    try:
        compiled, dtype, op = case_kernels(case, arch, sms)[index]
        if compiled.plan is None:  # a host-driven atom (ce) has no kernel
            compiled.kernel(DType.parse(dtype), ReduceOp.parse(op) if compiled.spec.is_reduce else None)
    except Exception as error:  # reported; the run shows it again
        return case.id, "error", f"{type(error).__name__}: {str(error)[:300]}", time.time() - start
    return case.id, "ok", "", time.time() - start


def device_facts() -> tuple[str, int]:
    """(arch, SM count) of cuda:0, asked in a child process: the compile workers fork from
    this one, which must not have touched CUDA."""
    import subprocess

    code = ("from purlinc.runtime import driver; print(driver.arch_of(0), driver.sm_count(0))")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    try:
        arch, sms = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                                   timeout=60, check=True).stdout.split()
        return arch, int(sms)
    except Exception:  # no GPU here: compile for an H200
        return "sm_90", 132


def precompile(budget_s: float, processes: int, out: Path) -> dict:
    """Compile the cases' kernels, in the cases' priority order, until ``budget_s``: first how
    many kernels each case has (lowering, in parallel), then every kernel as a job of its own.
    Cases not finished by then are listed as such (the run skips them; the summary counts them)."""
    import multiprocessing as mp

    start = time.time()
    arch, sms = device_facts()
    todo = cases()
    by_id = {c.id: c for c in todo}
    sizes: dict[str, int] = {}
    not_applicable: dict[str, str] = {}
    left: dict[str, int] = {}
    errors: dict[str, str] = {}
    pool = mp.get_context("fork").Pool(processes)
    try:
        for case_id, n, why in _until(pool.imap(_count_kernels, [(c, arch, sms) for c in todo]), start, budget_s):
            if n < 0:
                not_applicable[case_id] = why
            else:
                sizes[case_id] = left[case_id] = n
        jobs = [(by_id[i], k, arch, sms) for i in sizes for k in range(sizes[i])]
        for case_id, status, note, _ in _until(pool.imap_unordered(_compile_kernel, jobs), start, budget_s):
            if status == "ok":
                left[case_id] -= 1
            else:
                errors[case_id] = note
    finally:
        pool.terminate()
    lists = {"compiled": [i for i, n in left.items() if n == 0 and i not in errors],
             "not_applicable": not_applicable,
             "not_reached": [c.id for c in todo if c.id not in not_applicable and left.get(c.id, 1) > 0
                             and c.id not in errors]}
    report = {"arch": arch, "sms": sms, "budget_s": budget_s, "seconds": round(time.time() - start, 1),
              "cases": len(todo), "kernels_counted": sum(sizes.values()),
              "counts": {k: len(v) for k, v in lists.items()} | {"errors": len(errors)}, "errors": errors,
              "checks": lists}  # the per-case lists (gpu_summary.py leaves "checks" out of summary.json)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loopback_scale_compiled.json").write_text(json.dumps(report, indent=1))
    return report


def _until(results, start: float, budget_s: float):
    """The results of a pool's iterator, as long as the budget lasts."""
    import multiprocessing as mp

    while True:
        remaining = budget_s - (time.time() - start)
        if remaining <= 0:
            return
        try:
            yield results.next(timeout=remaining)
        except StopIteration:
            return
        except mp.TimeoutError:
            return


# ------------------------------------------------------------------------------------------
# a fresh process's first group call (issue 25: the R=8 hang)

def first_call(spec: str, world: int, options: dict, dtypes=("float32",)) -> dict:
    """Load ``spec`` on a new loopback group in this (fresh) process, make its first calls
    (count 1, one per dtype) and check them; report the context's stack limit before, after
    loading every rank's kernel, and after the launches."""
    import numpy as np
    import torch

    import purlinc
    from purlinc.runtime import driver

    from _common import compare_outputs, inputs_for, poison, to_torch, torch_dtype
    from purlinc.dtypes import DType, ReduceOp
    from purlinc.snac.simulate import simulate

    group = purlinc.LocalGroup([0] * world, share_devices=True)
    driver.set_current(0)
    report = {"spec": spec, "world": world, "options": options, "stack_before": driver.stack_limit(), "calls": []}
    coll = purlinc.load(source_of(spec), group, params=params_for(spec, world), **options)
    streams = [torch.cuda.Stream(device=0) for _ in range(world)]
    rng = np.random.default_rng(25)
    for dtype in map(DType.parse, dtypes):
        runs = coll[0].variant_for(1, dtype.itemsize) if hasattr(coll[0], "variant_for") else coll[0]
        spec_ = runs.compiled.spec
        inputs = inputs_for(spec_, 1, dtype, rng)
        xs = [to_torch(inputs[r], dtype, 0) if len(spec_.inputs[r]) else None for r in range(world)]
        outs = [torch.empty(len(spec_.outputs[r]), dtype=torch_dtype(dtype), device="cuda:0")
                if len(spec_.outputs[r]) else None for r in range(world)]
        for o in outs:
            if o is not None:
                poison(o)
        op = ReduceOp.SUM if spec_.is_reduce else None
        for r in range(world):  # what the group call's prime does, so the stack can be read in between
            (coll[r].variant_for(1, dtype.itemsize) if hasattr(coll[r], "variant_for") else coll[r]).variant(dtype, op)
        loaded = driver.stack_limit()
        for s in streams:
            s.wait_stream(torch.cuda.current_stream(0))
        coll(xs, outs, streams=streams)
        launched = driver.stack_limit()  # a launch that grew the stack would show here
        torch.cuda.synchronize(0)
        coll.check()
        want = simulate(runs.compiled.schedule, spec_, inputs, 1, dtype, op, calls=1)
        compare_outputs(spec_, outs, want, dtype, f"{spec}/R{world}/{dtype.value} first call")
        report["calls"].append({"dtype": dtype.value, "stack_after_load": loaded, "stack_after_launch": launched})
    coll.close()
    group.close()
    return report


if __name__ == "__main__":
    command = sys.argv[1:2]
    if command == ["precompile"]:
        out = Path(os.environ.get("OUT", "/tmp/purlin_gpu_suite"))
        report = precompile(float(os.environ.get("PURLIN_SCALE_COMPILE_S", "300")),
                            int(os.environ.get("PURLIN_SCALE_JOBS", str(os.cpu_count() or 4))), out)
        print(json.dumps({k: v for k, v in report.items() if k != "checks"}, indent=1))
    elif command == ["first-call"]:
        opts = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
        print(json.dumps(first_call(sys.argv[2], int(sys.argv[3]), opts, tuple(sys.argv[5:]) or ("float32",))))
    else:
        sys.exit(__doc__)
