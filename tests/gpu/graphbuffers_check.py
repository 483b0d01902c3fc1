"""Run under ``torchrun --nproc_per_node=N``: captured calls on ordinary torch tensors run the
registered schedule on them (CUDA IPC exports exchanged at capture, purlinc/runtime/graphbuffers.py).

For a few examples (pinned unpacked direct-push, and the size-bucketed default with
PURLIN_GRAPH_BUFFERS=register): plain torch.empty buffers, one eager call (staged), the staging
space filled with a pattern, a graph of three calls captured, two replays on fresh data (the same
seed on every rank, so every rank knows every input), every rank's output checked bit for bit
against the evaluator (reductions: the simulator of the schedule that ran), the captured calls counted as
registered, and the staging space still holding the pattern.  Then the same capture with
PURLIN_GRAPH_BUFFERS=stage must overwrite it.  Rank 0 writes
``$PURLIN_RESULTS/graphbuffers_torchrun.json``; the exit status is 1 on any failure."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import CheckLog, EXAMPLES, expected, fill_rank, to_numpy, torch_dtype  # noqa: E402
from purlinc.dtypes import DType  # noqa: E402

LOG = CheckLog()
note = LOG.note
PATTERN = 0x5A


def staged_of(coll, count, itemsize):
    return coll.variant_for(count, itemsize) if hasattr(coll, "variant_for") else coll


def fill_staging(coll) -> list:
    from purlinc.runtime import driver

    regions = []
    for c in getattr(coll, "_distinct", None) or [coll]:
        n = min(c.layout.stage_bytes, 1 << 20)
        if n:
            ptr = c.comm.heap.ptr(c.rank, c.layout.stage)
            driver.memset_d8(ptr, PATTERN, n)
            regions.append((ptr, n))
    torch.cuda.synchronize()
    return regions


def untouched(regions) -> bool:
    from purlinc.runtime import driver

    torch.cuda.synchronize()
    return all(set(driver.copy_dtoh(ptr, n)) == {PATTERN} for ptr, n in regions)


def reference(ran, spec, inputs, count, dtype):
    """What every rank's output must hold, bit for bit: the evaluator for copies, the SNAC
    simulator of the schedule that ran for reductions (its order of additions)."""
    if not spec.is_reduce:
        return expected(spec, inputs, count, dtype, None)
    from purlinc.snac.simulate import simulate

    return simulate(ran.compiled.schedule, spec, inputs, count, dtype, "sum", calls=1)


def check(comm, name, options, mode, count, dtype, seed):
    import purlinc

    os.environ["PURLIN_GRAPH_BUFFERS"] = mode
    coll = purlinc.load(EXAMPLES / name, comm, **options)
    label = f"{name}/{options or 'default'}/{mode}/{dtype.value}/n={count}"
    rank = comm.rank
    try:
        staged = staged_of(coll, count, dtype.itemsize)
        spec = staged.compiled.spec
        rng = np.random.default_rng(seed)
        tdtype = torch_dtype(dtype)
        x = torch.empty(len(spec.inputs[rank]) * count, dtype=tdtype, device=comm.device) if len(spec.inputs[rank]) else None
        out = torch.empty(len(spec.outputs[rank]) * count, dtype=tdtype, device=comm.device) if len(spec.outputs[rank]) else None
        kwargs = {"op": "sum"}

        def fill():
            return fill_rank(spec, rank, count, dtype, rng, x, out, comm.device)

        fill()
        coll(x, out, **kwargs)  # eager: staged
        torch.cuda.synchronize()
        coll.check()
        regions = fill_staging(coll)
        before = staged._zc.graph_registered
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(3):
                coll(x, out, **kwargs)
        registered = staged._zc.graph_registered - before
        for it in range(2):
            inputs = fill()
            dist.barrier()
            graph.replay()
            torch.cuda.synchronize()
            coll.check()
            if out is not None:
                want = reference(staged._zc.twin if registered else staged, spec, inputs, count, dtype)[rank]
                got = to_numpy(out, dtype)
                note(np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"{label} replay {it}",
                     f"{np.sum(got.view(dtype.storage) != want)} of {got.size} elements differ")
        clean = untouched(regions)
        if mode == "stage":
            note(registered == 0 and not clean, f"{label}: staged, and the check sees the staging copies",
                 f"registered {registered}, staging untouched {clean}")
        else:
            note(registered == 3 and clean, f"{label}: registered, no staging copy",
                 f"registered {registered} of 3 captured calls, staging untouched {clean}")
        del graph
    finally:
        dist.barrier()
        coll.close()


def main() -> int:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    import purlinc

    comm = purlinc.Communicator.from_torch()
    start = time.time()
    pinned = {"algorithm": "direct-push", "atom": "ldst", "channels": 2}
    cases = [(name, pinned, mode, count, dtype) for name in ("allreduce.pln", "allgather.pln", "reduce_scatter.pln",
                                                             "broadcast.pln")
             for mode in ("auto", "stage") for count, dtype in ((4097, DType.FLOAT32), (300_000, DType.BFLOAT16))]
    cases += [("allreduce.pln", {}, "register", count, DType.BFLOAT16) for count in (256, 65536, 1 << 20)]
    for seed, case in enumerate(cases):
        try:
            check(comm, *case, seed)
        except Exception as error:  # noqa: BLE001 - recorded, the run goes on
            LOG.raised(f"{case[0]}/{case[1]}/{case[2]}", error)
    failed = LOG.finish("graphbuffers_torchrun.json", "graph buffers torchrun", time.time() - start)
    comm.close()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
