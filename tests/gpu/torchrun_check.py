"""Run under ``torchrun --nproc_per_node=2``: Purlin through Communicator.from_torch, checked
against the reference evaluator and against NCCL, 1,000 consecutive calls, graph replay, and
latency (CUDA-graph replay and eager) beside NCCL.  Rank 0 writes a JSON report."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import EXAMPLES, expected, inputs_for, poison, to_numpy, to_torch, torch_dtype  # noqa: E402
from purlinc.dtypes import DType  # noqa: E402

results: dict = {"checks": [], "failures": [], "latency": []}


def note(ok: bool, what: str, detail: str = "") -> None:
    results["checks"].append([what, ok])
    if not ok:
        results["failures"].append(f"{what}: {detail}")
        print(f"[rank {dist.get_rank()}] FAIL {what}: {detail}", flush=True)


def check_against_reference(comm, name, algorithm, atom, dtype, op, count, rng_seed):
    import purlinc

    coll = purlinc.load(EXAMPLES / name, comm, algorithm=algorithm, atom=atom)
    spec = coll.compiled.spec
    rank = comm.rank
    rng = np.random.default_rng(rng_seed)  # same seed everywhere: every rank knows every input
    try:
        for it in range(3):
            inputs = inputs_for(spec, count, dtype, rng)
            x = to_torch(inputs[rank], dtype, comm.device) if len(spec.inputs[rank]) else None
            out = torch.empty(len(spec.outputs[rank]) * count, dtype=torch_dtype(dtype), device=comm.device) \
                if len(spec.outputs[rank]) else None
            if out is not None:
                poison(out)
            coll(x, out, op=op)
            torch.cuda.synchronize()
            coll.check()
            if out is not None:
                want = expected(spec, inputs, count, dtype, op)[rank]
                got = to_numpy(out, dtype)
                note(np.array_equal(got.view(np.uint8), want.view(np.uint8)),
                     f"{name}/{algorithm}/{atom}/{dtype.value}/{op}/n={count}/it{it} vs reference",
                     f"{np.sum(got.view(dtype.storage) != want)} elements differ")
            nccl = nccl_result(name, x, count, dtype, op)
            if nccl is not None and out is not None:
                note(torch.equal(nccl.view(torch.uint8), out.view(torch.uint8)),
                     f"{name}/{algorithm}/{atom}/{dtype.value}/{op}/n={count}/it{it} vs NCCL")
    finally:
        coll.close()


def nccl_result(name, x, count, dtype, op):
    """NCCL's answer for the collectives it has (sum only, no fp8)."""
    if dtype not in (DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16, DType.INT32) or op != "sum":
        return None
    world = dist.get_world_size()
    if name == "allreduce.pln":
        y = x.clone()
        dist.all_reduce(y)
        return y
    if name == "allgather.pln":
        y = torch.empty(world * count, dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(y, x)
        return y
    if name == "reduce_scatter.pln":
        y = torch.empty(count, dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(y, x)
        return y
    if name == "alltoall.pln":
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x)
        return y
    return None


def thousand_calls(comm):
    import purlinc

    coll = purlinc.load(EXAMPLES / "allreduce.pln", comm)
    g = torch.Generator(device=comm.device)
    g.manual_seed(1234 + comm.rank)
    bad = 0
    try:
        out = torch.empty(2 * 1000, device=comm.device)
        for i in range(1000):
            x = torch.randn(2 * 1000, device=comm.device, generator=g)
            poison(out)
            coll(x, out)
            ref = x.clone()
            dist.all_reduce(ref)
            if not torch.equal(ref, out):
                bad += 1
        torch.cuda.synchronize()
        coll.check()
    finally:
        coll.close()
    note(bad == 0, "allreduce 1000 consecutive calls with fresh inputs vs NCCL", f"{bad} calls differ")


def graph_replay(comm):
    import purlinc

    for name, algorithm, atom in (("allreduce.pln", "direct-push", "ldst"), ("allgather.pln", "direct-push", "ce")):
        coll = purlinc.load(EXAMPLES / name, comm, algorithm=algorithm, atom=atom)
        units_in, units_out = coll.in_units, coll.out_units
        count = 4097
        x = torch.randn(units_in * count, device=comm.device)
        out = torch.empty(units_out * count, device=comm.device)
        coll(x, out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            coll(x, out)
        bad = 0
        for it in range(20):
            x.copy_(torch.randn_like(x))
            poison(out)
            graph.replay()
            ref = nccl_result(name, x, count, DType.FLOAT32, "sum")
            torch.cuda.synchronize()
            bad += not torch.equal(ref, out)
        coll.check()
        coll.close()
        note(bad == 0, f"{name}/{atom} CUDA-graph replay x20 vs NCCL", f"{bad} replays differ")


def time_graph(fn, stream, calls=100, reps=10):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return float(np.median(times))


def time_eager(fn, calls=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / calls


def latency(comm):
    import purlinc

    dtype = torch.bfloat16
    cases = [("allreduce.pln", "direct-push", "ldst"), ("allreduce.pln", "two-shot", "ldst"),
             ("allgather.pln", "direct-push", "ldst"), ("allgather.pln", "direct-push", "tma"),
             ("allgather.pln", "direct-push", "ce")]
    for size in (1 << 10, 64 << 10, 4 << 20):
        for name, algorithm, atom in cases:
            coll = purlinc.load(EXAMPLES / name, comm, algorithm=algorithm, atom=atom)
            n_in = size // 2  # bytes of each rank's input, bf16
            x = torch.randn(n_in, device=comm.device).to(dtype)
            count = n_in // coll.in_units
            out = torch.empty(coll.out_units * count, dtype=dtype, device=comm.device)
            coll(x, out)
            torch.cuda.synchronize()
            stream = torch.cuda.Stream()
            purlin_graph = time_graph(lambda: coll(x, out), stream)
            purlin_eager = time_eager(lambda: coll(x, out))
            coll.check()
            if name == "allreduce.pln":
                y = x.clone()
                ref = lambda: dist.all_reduce(y)  # noqa: E731
            else:
                y = torch.empty(2 * n_in, dtype=dtype, device=comm.device)
                ref = lambda: dist.all_gather_into_tensor(y, x)  # noqa: E731
            nccl_graph = time_graph(ref, stream)
            nccl_eager = time_eager(ref)
            coll.close()
            results["latency"].append({
                "collective": name.removesuffix(".pln"), "algorithm": algorithm, "atom": atom,
                "input_bytes_per_rank": size, "dtype": "bf16",
                "purlin_graph_us": round(purlin_graph, 2), "nccl_graph_us": round(nccl_graph, 2),
                "purlin_eager_us": round(purlin_eager, 2), "nccl_eager_us": round(nccl_eager, 2),
            })


def main():
    import purlinc

    dist.init_process_group("nccl")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    comm = purlinc.Communicator.from_torch()
    dist.all_reduce(torch.ones(1, device=local))  # NCCL up before any timing
    stages = {}
    t = time.time()
    for name, algorithm, atom in [
        ("allreduce.pln", "direct-push", "ldst"), ("allreduce.pln", "two-shot", "ldst"),
        ("allreduce.pln", "ring", "tma"), ("allgather.pln", "direct-push", "ldst"),
        ("allgather.pln", "ring", "ce"), ("reduce_scatter.pln", "direct-push", "ldst"),
        ("alltoall.pln", "direct-push", "ce"), ("alltoall.pln", "direct-pull", "ldst"),
        ("broadcast.pln", "direct-push", "ldst"), ("gather.pln", "direct-push", "tma"),
        ("scatter.pln", "direct-pull", "ce"), ("reduce.pln", "direct-push", "ldst"),
    ]:
        for count in (1, 1000, 4097):
            check_against_reference(comm, name, algorithm, atom, DType.FLOAT32, "sum", count, 99 + count)
    check_against_reference(comm, "allreduce.pln", "two-shot", "ldst", DType.BFLOAT16, "sum", 4097, 5)
    check_against_reference(comm, "allreduce.pln", "direct-push", "ldst", DType.FLOAT16, "max", 4097, 6)
    stages["reference_and_nccl_s"] = round(time.time() - t, 1)
    t = time.time()
    thousand_calls(comm)
    stages["thousand_calls_s"] = round(time.time() - t, 1)
    t = time.time()
    graph_replay(comm)
    stages["graph_replay_s"] = round(time.time() - t, 1)
    if os.environ.get("PURLIN_SKIP_LATENCY") != "1":
        t = time.time()
        latency(comm)
        stages["latency_s"] = round(time.time() - t, 1)
    results["stages"] = stages
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results["failures"])
    results["failures_all_ranks"] = gathered
    if comm.rank == 0:
        out = os.environ.get("PURLIN_RESULTS", ".")
        results["passed"] = sum(ok for _, ok in results["checks"])
        results["total"] = len(results["checks"])
        json.dump(results, open(os.path.join(out, "torchrun_results.json"), "w"), indent=1)
        print(json.dumps({k: results[k] for k in ("passed", "total", "stages")}), flush=True)
        for row in results["latency"]:
            print(row, flush=True)
    comm.close()
    dist.destroy_process_group()
    sys.exit(1 if any(gathered) else 0)


if __name__ == "__main__":
    main()
