"""Random collectives through the real kernels: specs no example or test wrote, each rank's
layout chosen at random (chunks in any order, ranks with empty buffers, an output naming a
chunk several times, a reduce input naming one twice), lowered with random orchestration
options and run in a loopback group; every rank's output, poisoned first, equals the SNAC
simulator's bit for bit.  tests/test_fuzz_specs.py checks the same specs on the CPU (spec,
lowering, verifier, simulator against the evaluator); tests/gpu/test_fuzz_specs.py runs them.

    python3 tests/gpu/fuzz_specs.py precompile   # the cases' kernels in parallel, within
                                                 # PURLIN_FUZZ_COMPILE_S; writes $OUT/fuzz_specs_compiled.json
                                                 # (PURLIN_FUZZ_CASES cases from seed PURLIN_FUZZ_FIRST)
    python3 tests/gpu/fuzz_specs.py show SEED    # one case: its spec text, world, options and calls

A case is a pure function of its seed, so a failure's seed (in $OUT/fuzz_specs.json) replays it.
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
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

WORLDS = (2, 2, 3, 4, 5, 6, 7, 8)  # R=2 twice as often: the size most kernels serve
ALGORITHMS = ("direct-push", "direct-pull", "two-shot", "ring")
COUNTS = (1, 3, 7, 129, 4097, 65_537)
COPY_DTYPES = ("float32", "bfloat16", "float16", "int32", "int64", "float8_e4m3")
REDUCE_DTYPES = ("float32", "bfloat16", "float16", "int32")
OPS = ("sum", "max", "min", "prod")
FIRST_SEED = 1_000


@dataclass(frozen=True)
class FuzzCase:
    seed: int
    world: int
    text: str  # the .pln source
    reduce: bool
    options: tuple = ()  # (("algorithm", ...), ("channels", ...), ...); () is a plain (tuned) load
    calls: tuple = ()  # ((count, dtype, op), ...); op is None for a copy

    @property
    def id(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options) or "tuned"
        return f"seed{self.seed}-R{self.world}-{'reduce' if self.reduce else 'copy'}-{opts}"


def _chunk(name: str, index: tuple[int, ...]) -> str:
    return name + "".join(f"[{i}]" for i in index)


def _copy_layouts(rng: random.Random, world: int) -> tuple[list[list[str]], list[list[str]]]:
    """Every chunk has one producer; outputs pick chunks with repetition, in any order."""
    two_d = rng.random() < 0.4
    labels = rng.sample(range(4 * world + 4), 4 * world + 4)  # indices in no particular order
    inputs, pool = [], []
    for _ in range(world):
        n = rng.choice((0, 1, 1, 1, 2, 3))
        mine = []
        for _ in range(n):
            k = labels.pop()
            name = "y" if k % 3 == 0 else "x"  # two names: each its own chunks
            mine.append(_chunk(name, (k // 4, k % 4)) if two_d else _chunk(name, (k,)))
        inputs.append(mine)
        pool += mine
    if not pool:  # at least one chunk
        inputs[rng.randrange(world)].append(_chunk("x", (0, 0)) if two_d else _chunk("x", (0,)))
        pool = [c for layout in inputs for c in layout]
    outputs = [[rng.choice(pool) for _ in range(rng.choice((0, 1, 1, 2, 3, 5)))] for _ in range(world)]
    return inputs, outputs


def _reduce_layouts(rng: random.Random, world: int) -> tuple[list[list[str]], list[list[str]]]:
    """Each rank's input names chunks of a small pool, a name possibly twice; outputs pick
    produced chunks with repetition."""
    pool = [_chunk("z", (j,)) for j in range(rng.randint(1, 4))]
    inputs = [[rng.choice(pool) for _ in range(rng.choice((0, 1, 2, 2, 3, 4)))] for _ in range(world)]
    produced = sorted({c for layout in inputs for c in layout})
    if not produced:
        inputs[rng.randrange(world)].append(pool[0])
        produced = [pool[0]]
    outputs = [[rng.choice(produced) for _ in range(rng.choice((0, 1, 1, 2, 3)))] for _ in range(world)]
    return inputs, outputs


def _source(name: str, inputs, outputs, reduce: bool) -> str:
    lines = [f"collective {name} {{"]
    for buffer, layouts in (("in", inputs), ("out", outputs)):
        for rank, layout in enumerate(layouts):
            if layout:
                lines.append(f"    {buffer}[{rank}] = {', '.join(layout)}")
    lines += ["    reduce" if reduce else "    copy", "}", ""]
    return "\n".join(lines)


def _options(rng: random.Random, reduce: bool) -> tuple:
    if rng.random() < 0.25:
        return ()
    algorithm = rng.choice(ALGORITHMS if reduce else tuple(a for a in ALGORITHMS if a != "two-shot"))
    options = [("algorithm", algorithm), ("atom", rng.choice(("ldst", "ldst", "tma"))),
               ("channels", rng.randint(1, 4)), ("slices", rng.randint(1, 2))]
    if algorithm == "direct-push":
        options.append(("packed", rng.random() < 0.5))
    return tuple(options)


def case(seed: int) -> FuzzCase:
    """The case of ``seed`` (a pure function of it)."""
    rng = random.Random(seed)
    world = rng.choice(WORLDS)
    reduce = rng.random() < 0.5
    inputs, outputs = (_reduce_layouts if reduce else _copy_layouts)(rng, world)
    if not any(outputs):
        outputs[rng.randrange(world)].append(inputs[next(r for r in range(world) if inputs[r])][0])
    dtypes = REDUCE_DTYPES if reduce else COPY_DTYPES
    calls = tuple((rng.choice(COUNTS), rng.choice(dtypes), rng.choice(OPS) if reduce else None)
                  for _ in range(2))
    return FuzzCase(seed, world, _source(f"fuzz_{seed}", inputs, outputs, reduce), reduce, _options(rng, reduce), calls)


# A directed case beside the random ones: ranks 2 and 3 have no chunks, yet a ring relays rank
# 1's x[1] to rank 0 through them, so they must run the others' count.
CHUNKLESS = """collective chunkless {
    in[0] = x[0]
    in[1] = x[1]
    out[0] = x[1]
    out[1] = x[0]
    copy
}
"""


def cases(n: int, first: int | None = None) -> list[FuzzCase]:
    """``n`` cases from seed ``first`` (default: $PURLIN_FUZZ_FIRST, else FIRST_SEED)."""
    first = int(os.environ.get("PURLIN_FUZZ_FIRST", FIRST_SEED)) if first is None else first
    return [case(s) for s in range(first, first + n)]


# ------------------------------------------------------------------------------------------
# what a case compiles (the precompile and the run derive it alike)

def loopback_cap(world: int, sms: int) -> int:
    from purlinc.runtime import residency

    return residency.max_channels([0] * world, lambda device: sms)


def case_kernels(c: FuzzCase, arch: str, sms: int):
    """(Compiled, dtype, op) of every kernel the case launches; raises PurlinError where the
    options do not apply (the run records the case as such for the same reason)."""
    from purlinc.dtypes import DType
    from purlinc.runtime import tuning
    from purlinc.runtime.collective import prepare
    from purlinc.runtime.tuned import prepare_tuned

    if c.options:
        compiled = prepare(c.text, c.world, arch=arch, **dict(c.options))
        return [(compiled, d, o) for d, o in sorted({(d, o or "") for _, d, o in c.calls})]
    prepared, units = prepare_tuned(c.text, c.world, arch=arch, max_channels=loopback_cap(c.world, sms))
    buckets = tuple(p.bucket for p in prepared)
    jobs = {}
    for count, dtype, op in c.calls:
        compiled = prepared[tuning.choose(buckets, count * DType.parse(dtype).itemsize * units)].compiled
        jobs[(compiled.key, dtype, op)] = (compiled, dtype, op or "")
    return list(jobs.values())


def _compile_case(args):
    """Compile a case's kernels: (case id, "ok" | "n/a" | "error", note)."""
    c, arch, sms = args
    from purlinc.dtypes import DType, ReduceOp
    from purlinc.errors import PurlinError

    try:
        kernels = case_kernels(c, arch, sms)
    except PurlinError as error:
        return c.id, "n/a", str(error).splitlines()[0]
    try:
        for compiled, dtype, op in kernels:
            if compiled.plan is None:  # a host-driven atom (ce) has a host plan, not a kernel
                compiled.kernel(DType.parse(dtype), ReduceOp.parse(op) if op else None)
    except Exception as error:  # reported: the run shows it again
        return c.id, "error", f"{type(error).__name__}: {str(error)[:300]}"
    return c.id, "ok", ""


def precompile(n: int, budget_s: float, processes: int, out: Path) -> dict:
    """Compile the first ``n`` cases' kernels in parallel until ``budget_s``; the run skips
    cases not finished by then (and counts them)."""
    import multiprocessing as mp

    from scale import _until, device_facts

    start = time.time()
    arch, sms = device_facts()
    todo = cases(n)
    done: dict[str, list[str]] = {"ok": [], "n/a": [], "error": []}
    notes: dict[str, str] = {}
    pool = mp.get_context("fork").Pool(processes)
    try:
        for case_id, status, note in _until(pool.imap_unordered(_compile_case, [(c, arch, sms) for c in todo]),
                                            start, budget_s):
            done[status].append(case_id)
            if note:
                notes[case_id] = note
    finally:
        pool.terminate()
    report = {"arch": arch, "sms": sms, "cases": n, "budget_s": budget_s, "seconds": round(time.time() - start, 1),
              "counts": {k: len(v) for k, v in done.items()}, "notes": notes, "checks": done}
    out.mkdir(parents=True, exist_ok=True)
    (out / "fuzz_specs_compiled.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    command = sys.argv[1:2]
    if command == ["precompile"]:
        report = precompile(int(os.environ.get("PURLIN_FUZZ_CASES", "1000")),
                            float(os.environ.get("PURLIN_FUZZ_COMPILE_S", "200")),
                            int(os.environ.get("PURLIN_FUZZ_JOBS", str(os.cpu_count() or 4))),
                            Path(os.environ.get("OUT", "/tmp/purlin_gpu_suite")))
        print(json.dumps({k: v for k, v in report.items() if k != "checks"}, indent=1))
    elif command == ["show"] and len(sys.argv) == 3:
        c = case(int(sys.argv[2]))
        print(c.text)
        print(json.dumps({"id": c.id, "world": c.world, "options": dict(c.options), "calls": c.calls}))
    else:
        sys.exit(__doc__)
