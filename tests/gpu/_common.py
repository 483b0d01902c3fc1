"""Shared by the GPU tests, the torchrun script and the suite's precompile step: the test
matrix, buffer helpers (NumPy storage <-> torch) and the reference."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from purlinc.dtypes import DType, ReduceOp, random_values  # noqa: E402
from purlinc.frontend.evaluate import evaluate  # noqa: E402

EXAMPLES = ROOT / "examples"
ALGORITHMS = ("direct-push", "direct-pull", "two-shot", "ring")
ATOMS = ("ldst", "tma", "ce")
COUNTS = (1, 7, 1000, 4097)


def _world() -> int:
    """Every visible GPU is a rank (2 where none is visible, for collection on the CPU)."""
    try:
        import torch

        return max(torch.cuda.device_count(), 2)
    except Exception:  # noqa: BLE001 - no torch, no driver: the GPU tests skip anyway
        return 2


WORLD = _world()


def examples() -> list[str]:
    return sorted(p.name for p in EXAMPLES.glob("*.pln"))


def applicable(name: str, algorithm: str, atom: str):
    """The prepared collective, or the reason it does not apply (a string)."""
    from purlinc.errors import PurlinError
    from purlinc.runtime.collective import prepare

    try:
        return prepare(EXAMPLES / name, WORLD, algorithm=algorithm, atom=atom, arch="sm_90")
    except PurlinError as error:
        return str(error).splitlines()[0]


# (example, algorithm, atom, dtype, op) for the dtype/op sweep
def dtype_matrix():
    rows = []
    for name, algorithms in (("allreduce.pln", ("direct-push", "two-shot")), ("reduce_scatter.pln", ("direct-push",))):
        for algorithm in algorithms:
            for dtype in ("float32", "float16", "bfloat16", "int32"):
                for op in ("sum", "max", "min"):
                    rows.append((name, algorithm, "ldst", dtype, op))
    for atom in ("ldst", "tma", "ce"):
        for dtype in ("float16", "bfloat16", "int32", "float8_e4m3"):
            rows.append(("allgather.pln", "direct-push", atom, dtype, None))
    return rows


def kernel_jobs():
    jobs = []
    for name in examples():
        for algorithm in ALGORITHMS:
            for atom in ("ldst", "tma"):
                jobs.append((name, algorithm, atom, "float32", "sum"))
    for name, algorithm, atom, dtype, op in dtype_matrix():
        if atom != "ce":
            jobs.append((name, algorithm, atom, dtype, op or "sum"))
    jobs.append(("allreduce.pln", "direct-push", "ldst", "bfloat16", "sum"))
    jobs.append(("allreduce.pln", "two-shot", "ldst", "bfloat16", "sum"))
    # The zero-copy twins (registered schedules) the zero-copy tests run.
    for name in examples():
        for algorithm in ALGORITHMS:
            for dtype in ("float32", "bfloat16"):
                jobs.append((name, algorithm, "ldst+zerocopy", dtype, "sum"))
    return sorted(set(jobs))


# tests/gpu/test_loopback.py: ranks sharing one GPU, R=2 and R=4, two channels.
LOOPBACK_WORLDS = (2, 4)
LOOPBACK_SLICES = (1, 2, 3, 4)  # direct-push, every example
LOOPBACK_OTHER = (("direct-push", "tma"), ("direct-pull", "ldst"), ("two-shot", "ldst"), ("ring", "ldst"))
LOOPBACK_OTHER_NAMES = ("allreduce.pln", "allgather.pln", "reduce_scatter.pln", "alltoall.pln")
LOOPBACK_ZC_SLICES = (1, 3)
LOOPBACK_ZC_NAMES = ("allgather.pln", "alltoall.pln", "allreduce.pln", "broadcast.pln")


def loopback_jobs():
    """The loopback tests' kernels: (name, algorithm, atom, dtype, op, world, channels, slices)."""
    jobs = []
    for world in LOOPBACK_WORLDS:
        for name in examples():
            for slices in LOOPBACK_SLICES:
                for dtype, op in (("float32", "sum"), ("bfloat16", "sum"), ("float32", "max")):
                    jobs.append((name, "direct-push", "ldst", dtype, op, world, 2, slices))
        for name in LOOPBACK_OTHER_NAMES:
            for algorithm, atom in LOOPBACK_OTHER:
                jobs.append((name, algorithm, atom, "bfloat16", "sum", world, 2, 2))
        for name in LOOPBACK_ZC_NAMES:
            for slices in LOOPBACK_ZC_SLICES:
                jobs.append((name, "direct-push", "ldst+zerocopy", "bfloat16", "sum", world, 2, slices))
    return sorted(set(jobs))


def _compile_job(job):
    import time

    from purlinc.errors import PurlinError
    from purlinc.runtime.collective import prepare

    name, algorithm, atom, dtype, op = job[:5]
    start = time.time()
    if len(job) == 8:  # a loopback job: its own world size, channels and slices
        world, channels, slices = job[5:]
        try:
            c = prepare(EXAMPLES / name, world, algorithm=algorithm, atom=atom.split("+")[0], channels=channels,
                        slices=slices, arch="sm_90")
        except PurlinError:
            return job, "n/a", 0.0
    else:
        c = applicable(name, algorithm, atom.split("+")[0])
    if isinstance(c, str):
        return job, "n/a", 0.0
    if atom.endswith("+zerocopy"):
        from purlinc.runtime.zerocopy import twin_compiled

        c = twin_compiled(c)
        if c is None:
            return job, "n/a", 0.0
    try:
        c.kernel(DType.parse(dtype), ReduceOp.parse(op) if c.spec.is_reduce else None)
    except Exception as error:  # reported, the tests will show it too
        return job, f"error: {type(error).__name__}: {str(error)[:300]}", time.time() - start
    return job, "ok", time.time() - start


def precompile(processes: int = 24, jobs=None) -> None:
    """Fill the disk cache with every kernel the suite launches (or ``jobs``), in parallel."""
    import json
    import multiprocessing as mp
    import time

    start = time.time()
    jobs = kernel_jobs() if jobs is None else jobs
    with mp.get_context("fork").Pool(processes) as pool:
        results = pool.map(_compile_job, jobs, chunksize=1)
    summary = {"kernels": len(jobs), "ok": sum(r[1] == "ok" for r in results),
               "n/a": sum(r[1] == "n/a" for r in results), "seconds": round(time.time() - start, 1),
               "errors": [[*r[0], r[1]] for r in results if r[1].startswith("error")]}
    print(json.dumps(summary, indent=1))


# ------------------------------------------------------------------------------------------
# torch <-> NumPy storage

def torch_dtype(dtype: DType):
    import torch

    return {
        DType.FLOAT32: torch.float32, DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16,
        DType.INT32: torch.int32, DType.INT64: torch.int64,
        DType.FLOAT8_E4M3: torch.float8_e4m3fn, DType.FLOAT8_E5M2: torch.float8_e5m2,
    }[dtype]


_SAME_SIZE_INT = {2: "int16", 1: "uint8", 4: "int32"}
_NATIVE = (DType.FLOAT32, DType.FLOAT16, DType.INT32, DType.INT64)  # NumPy and torch share these


def to_torch(array: np.ndarray, dtype: DType, device: int):
    import torch

    if dtype in _NATIVE:
        return torch.from_numpy(np.ascontiguousarray(array)).to(f"cuda:{device}")
    carrier = np.ascontiguousarray(array).view(_SAME_SIZE_INT[dtype.itemsize])
    return torch.from_numpy(carrier).to(f"cuda:{device}").view(torch_dtype(dtype))


def to_numpy(tensor, dtype: DType) -> np.ndarray:
    import torch

    if dtype in _NATIVE:
        return tensor.detach().cpu().numpy()
    carrier = {2: torch.int16, 1: torch.uint8}[dtype.itemsize]
    return tensor.detach().view(carrier).cpu().numpy().view(dtype.storage)


def poison(tensor) -> None:
    import torch

    tensor.view(torch.uint8).fill_(0xFF)


class CheckLog:
    """The record of a torchrun check script (zerocopy_check.py, graphbuffers_check.py): every
    check, the failures (printed as they happen), and at the end every rank's failures gathered
    into one JSON file on rank 0."""

    def __init__(self):
        self.results: dict = {"checks": [], "failures": []}

    def note(self, ok: bool, what: str, detail: str = "") -> None:
        import torch.distributed as dist

        self.results["checks"].append([what, bool(ok)])
        if not ok:
            self.results["failures"].append(f"{what}: {detail}")
            print(f"[rank {dist.get_rank()}] FAIL {what}: {detail}", flush=True)

    def raised(self, what: str, error: Exception) -> None:
        """A check that raised: recorded with the end of its traceback, and the run goes on."""
        import traceback

        self.note(False, what, f"{type(error).__name__}: {error}\n{traceback.format_exc()[-1500:]}")

    def finish(self, filename: str, label: str, seconds: float) -> bool:
        """Gather every rank's failures (a collective), write ``filename`` under
        $PURLIN_RESULTS on rank 0 and print a summary there; whether any rank failed."""
        import json
        import os

        import torch.distributed as dist

        results = self.results
        results["seconds"] = round(seconds, 1)
        results["total"] = len(results["checks"])
        results["passed"] = sum(1 for _, ok in results["checks"] if ok)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, results["failures"])
        if dist.get_rank() == 0:
            results["failures_all_ranks"] = [f"rank {r}: {f}" for r, fs in enumerate(gathered) for f in fs]
            out = Path(os.environ.get("PURLIN_RESULTS", "/tmp"))
            out.mkdir(parents=True, exist_ok=True)
            (out / filename).write_text(json.dumps(results, indent=1))
            print(f"{label}: {results['passed']}/{results['total']} checks passed on rank 0, "
                  f"{len(results['failures_all_ranks'])} failures on all ranks, {results['seconds']} s", flush=True)
            for f in results["failures_all_ranks"][:40]:
                print("  " + f[:400], flush=True)
        return any(gathered)


class LoopbackGroups:
    """Loopback groups (every rank on ``device``, a stream each) for tests that walk world
    sizes: one at a time (a group of another size closes the one before: heaps of several R
    add up), and a group a failure stopped is made again."""

    def __init__(self, device: int):
        self.device = device
        self._groups: dict = {}

    def get(self, world: int):
        import purlinc
        import torch

        g = self._groups.get(world)
        if g is not None and any(getattr(c, "failed", None) is not None for c in g.comms):
            self._groups.pop(world).close()
            g = None
        if g is None:
            self.close()
            g = purlinc.LocalGroup([self.device] * world, share_devices=True)
            g.streams = [torch.cuda.Stream(device=self.device) for _ in range(world)]
            self._groups[world] = g
        return g

    def close(self) -> None:
        for world in list(self._groups):
            self._groups.pop(world).close()


def capture_per_rank(streams, calls) -> list:
    """One CUDA graph per rank, each captured on the rank's own stream: ``calls(r)`` issues
    rank r's work (a loopback group's ranks run at once, each on its stream)."""
    import torch

    graphs = []
    for r, s in enumerate(streams):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            calls(r)
        graphs.append(g)
    return graphs


def on_rank_streams(streams, device: int, work) -> None:
    """``work()`` (a group call given ``streams=``) with every rank's stream ordered after the
    device's current stream and the current stream after them, then the device synchronized: a
    loopback group's ranks run at once, each on its own stream."""
    import torch

    current = torch.cuda.current_stream(device)
    for s in streams:
        s.wait_stream(current)
    work()
    for s in streams:
        current.wait_stream(s)
    torch.cuda.synchronize(device)


def each_on_own_stream(streams, device: int, fns) -> list:
    """``fns[r]()`` on rank r's stream, all issued before any is waited for (a loopback group's
    ranks wait for each other), then the device synchronized; returns their results."""
    import torch

    results = []

    def issue():
        for s, fn in zip(streams, fns):
            with torch.cuda.stream(s):
                results.append(fn())
    on_rank_streams(streams, device, issue)
    return results


def replay_per_rank(graphs, streams, device: int) -> None:
    """Every rank's graph replayed on its own stream, after the work before it and waited for
    (the ranks wait for each other on the device)."""
    import torch

    torch.cuda.synchronize(device)
    for g, s in zip(graphs, streams):
        with torch.cuda.stream(s):
            g.replay()
    torch.cuda.synchronize(device)


def compare_outputs(spec, outs, want, dtype: DType, label: str) -> None:
    """Every rank's output (a torch tensor, None where the rank has none) equals ``want[r]``
    bit for bit; the error names the rank, how many elements differ and the first ones."""
    for r, out in enumerate(outs):
        if out is None:
            continue
        got = to_numpy(out, dtype)
        if not np.array_equal(got.view(np.uint8), want[r].view(np.uint8)):
            bad = np.flatnonzero(got.view(dtype.storage) != want[r])
            raise AssertionError(f"{label}: rank {r} differs at {bad.size} of {got.size} elements, first at "
                                 f"{bad[:5].tolist()}: got {got[bad[:5]].tolist()}, want {want[r][bad[:5]].tolist()}")


def rank_runs(coll, r: int, count: int, itemsize: int):
    """Rank r's Collective that a call of ``count`` runs (a plain load's bucket)."""
    rank = coll[r]
    return rank.variant_for(count, itemsize) if hasattr(rank, "variant_for") else rank


def simulated(runs, spec, inputs, count: int, dtype: DType, op) -> list[np.ndarray]:
    """What the SNAC simulator gives for one call of the schedule ``runs`` ran, in the pieces its
    staging space cuts the call into."""
    from purlinc.runtime.validate import choose_piece
    from purlinc.snac.simulate import simulate

    piece = choose_piece(count, runs.layout.staging, dtype.itemsize)
    return simulate(runs.compiled.schedule, spec, inputs, count, dtype, op, calls=1, piece=piece)


def check_group_call(coll, streams, device: int, count: int, dtype: DType, op, rng, label: str, *,
                     pass_count: bool = True):
    """One group call of a loopback group's collective on fresh inputs and poisoned outputs (a
    rank with no chunks passes None), every rank checked bit for bit against the simulator;
    returns the rank-0 Collective that ran.  ``pass_count=False``: the call derives the count
    from the buffers, as a user's call does."""
    import torch

    runs = rank_runs(coll, 0, count, dtype.itemsize)
    spec = runs.compiled.spec
    op = op if spec.is_reduce else None
    inputs = inputs_for(spec, count, dtype, rng)
    xs = [to_torch(inputs[r], dtype, device) if len(spec.inputs[r]) else None for r in range(spec.world_size)]
    outs = [torch.empty(len(spec.outputs[r]) * count, dtype=torch_dtype(dtype), device=f"cuda:{device}")
            if len(spec.outputs[r]) else None for r in range(spec.world_size)]
    for o in outs:
        if o is not None:
            poison(o)
    given = {"count": count} if pass_count else {}
    on_rank_streams(streams, device, lambda: coll(xs, outs, op=op or "sum", streams=streams, **given))
    coll.check()
    compare_outputs(spec, outs, simulated(runs, spec, inputs, count, dtype, op), dtype, label)
    return runs


def inputs_for(spec, count: int, dtype: DType, rng) -> list[np.ndarray]:
    return [random_values(rng, len(spec.inputs[r]) * count, dtype) for r in range(spec.world_size)]


def fill_rank(spec, rank: int, count: int, dtype: DType, rng, x, out, device: int) -> list[np.ndarray]:
    """Fresh inputs of every rank (each torchrun process draws them all from the same seeded
    ``rng``), rank ``rank``'s copied into ``x``; ``out`` poisoned; the device synchronized.
    Returns the inputs (what the reference needs)."""
    import torch

    inputs = inputs_for(spec, count, dtype, rng)
    if x is not None:
        x.copy_(to_torch(inputs[rank], dtype, device))
    if out is not None:
        poison(out)
    torch.cuda.synchronize()
    return inputs


def expected(spec, inputs, count, dtype, op):
    return evaluate(spec, inputs, count, dtype, op if spec.is_reduce else None)


if __name__ == "__main__" and sys.argv[1:2] == ["precompile"]:
    # precompile: the suite's kernels; precompile loopback: test_loopback.py's
    precompile(jobs=loopback_jobs() if sys.argv[2:] == ["loopback"] else None)
