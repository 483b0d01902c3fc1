"""Run under ``torchrun --nproc_per_node=2``: hierarchical collectives (purlinc.load(path, None,
gpus_per_node=G)) as 2 nodes x 1 GPU (NCCL between the "nodes") and 1 node x 2 GPUs (Purlin
only, the NCCL phases are local copies), every standard collective, fresh random data each
call, poisoned outputs, every rank checked against the evaluator and against NCCL where it has
the collective; CUDA-graph capture and replay of every collective (every rank, those without
input or output included); a latency row ``purlin/hierarchical`` beside NCCL (the benchmark's
``purlin/hierarchical`` rows cover every collective: benchmarks/bench.py).  Exit status 1 on
any failure (rank 0 prints the summary)."""

from __future__ import annotations

import json
import os
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import EXAMPLES, expected, inputs_for, poison, to_numpy, to_torch, torch_dtype  # noqa: E402
from purlinc.dtypes import DType  # noqa: E402

STANDARD = ("allgather", "allreduce", "alltoall", "broadcast", "gather", "reduce", "reduce_scatter", "scatter")
failures: list[str] = []
checks = 0


def note(ok: bool, what: str, detail: str = "") -> None:
    global checks
    checks += 1
    if not ok:
        failures.append(f"rank {dist.get_rank()}: {what}: {detail}")
        print(f"[rank {dist.get_rank()}] FAIL {what}: {detail}", flush=True)


def same(got: np.ndarray, want: np.ndarray, exact: bool) -> tuple[bool, str]:
    if exact:
        bad = int(np.sum(got.view(np.uint8) != want.view(np.uint8)))
        return bad == 0, f"{bad} bytes differ"
    g, w = got.astype(np.float64), want.astype(np.float64)
    tolerance = 1e-5 * dist.get_world_size()
    ok = np.allclose(g, w, rtol=tolerance, atol=tolerance)
    return bool(ok), f"max abs diff {np.max(np.abs(g - w)) if g.size else 0}"


def nccl_result(name: str, x, count: int, dtype: DType):
    """NCCL's answer (sum) for the collectives it has, on this rank (None: no answer here)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if name == "allreduce":
        y = x.clone()
        dist.all_reduce(y)
        return y
    if name == "allgather":
        y = torch.empty(world * count, dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(y, x)
        return y
    if name == "reduce_scatter":
        y = torch.empty(count, dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(y, x)
        return y
    if name == "alltoall":
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x)
        return y
    if name == "broadcast":
        y = x.clone() if x is not None else torch.empty(count, dtype=torch_dtype(dtype), device=f"cuda:{rank}")
        dist.broadcast(y, src=0)
        return y
    if name == "reduce":
        y = x.clone()
        dist.reduce(y, dst=0)
        return y if rank == 0 else None
    return None


def check_collective(coll, name: str, G: int, dtype: DType, op: str | None, count: int, seed: int) -> None:
    spec, rank, device = coll.plan.spec, dist.get_rank(), torch.cuda.current_device()
    rng = np.random.default_rng(seed)  # the same on every rank: each knows every input
    exact = dtype is not DType.FLOAT32 or not spec.is_reduce
    tag = f"{name}/G={G}/{dtype.value}/{op}/n={count}"
    for it in range(3):
        inputs = inputs_for(spec, count, dtype, rng)
        x = to_torch(inputs[rank], dtype, device) if len(spec.inputs[rank]) else None
        out = torch.empty(len(spec.outputs[rank]) * count, dtype=torch_dtype(dtype), device=device) \
            if len(spec.outputs[rank]) else None
        if out is not None:
            poison(out)
        coll(x, out, op=op or "sum", count=count)
        torch.cuda.synchronize()
        if out is not None:
            ok, detail = same(to_numpy(out, dtype), expected(spec, inputs, count, dtype, op)[rank], exact)
            note(ok, f"{tag}/it{it} vs evaluator", detail)
        if op in (None, "sum") and dtype in (DType.FLOAT32, DType.INT32):
            reference = nccl_result(name, x, count, dtype)
            if reference is not None and out is not None:
                ok, detail = same(to_numpy(out, dtype), to_numpy(reference, dtype), exact)
                note(ok, f"{tag}/it{it} vs NCCL", detail)
    if count > 1:
        check_graph(coll, spec, tag, dtype, op, count, rng)


def check_graph(coll, spec, tag, dtype, op, count, rng) -> None:
    """Capture one call in a CUDA graph (after a warm call: scratch, kernels, NCCL), then replay
    it on fresh inputs with poisoned outputs.  Ranks without input or output take part too."""
    rank, device = dist.get_rank(), torch.cuda.current_device()
    n_in, n_out = len(spec.inputs[rank]), len(spec.outputs[rank])
    inputs = inputs_for(spec, count, dtype, rng)
    x = to_torch(inputs[rank], dtype, device) if n_in else None
    out = torch.empty(n_out * count, dtype=torch_dtype(dtype), device=device) if n_out else None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        coll(x, out, op=op or "sum", count=count)  # warm: scratch buffers, kernels, NCCL
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    captured = True
    try:
        with torch.cuda.graph(graph):
            coll(x, out, op=op or "sum", count=count)
    except Exception as error:  # noqa: BLE001 - reported as a failure with its cause
        note(False, f"{tag}/graph capture", f"{type(error).__name__}: {error}")
        captured = False
    # Replay only if every rank captured: a lone replay would wait for peers that never come
    # (NCCL has no bound on that wait).
    everyone = torch.tensor([1 if captured else 0], device=device)
    dist.all_reduce(everyone, op=dist.ReduceOp.MIN)
    if not int(everyone.item()):
        if captured:
            note(False, f"{tag}/graph capture", "another rank failed to capture; not replayed")
        return
    exact = dtype is not DType.FLOAT32 or not spec.is_reduce
    for it in range(3):
        inputs = inputs_for(spec, count, dtype, rng)
        if x is not None:
            x.copy_(to_torch(inputs[rank], dtype, device))
        if out is not None:
            poison(out)
        graph.replay()
        torch.cuda.synchronize()
        if out is not None:
            ok, detail = same(to_numpy(out, dtype), expected(spec, inputs, count, dtype, op)[rank], exact)
            note(ok, f"{tag}/graph replay {it}", detail)


def latency(G: int) -> list[dict]:
    """purlin/hierarchical vs NCCL all-reduce, bf16 sum, CUDA-graph replay of 20 calls, median of 10."""
    import purlinc

    rows = []
    coll = purlinc.load(EXAMPLES / "allreduce.pln", None, gpus_per_node=G)
    world, device = dist.get_world_size(), torch.cuda.current_device()
    for nbytes in (4096, 65536, 1 << 20, 16 << 20):
        count = max(1, nbytes // 2 // world)
        x = torch.randn(world * count, device=device).to(torch.bfloat16)
        out = torch.empty_like(x)
        row = {"G": G, "bytes": world * count * 2}
        calls = (("purlin/hierarchical", lambda: coll(x, out, count=count)), ("nccl", lambda: dist.all_reduce(out)))
        for label, call in calls:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                call()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(20):
                    call()
            times = []
            for _ in range(10):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) * 1000 / 20)
            row[label + " us"] = round(float(np.median(times)), 2)
        rows.append(row)
    coll.close()
    return rows


def main() -> int:
    import purlinc

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device(f"cuda:{local}"))
    world = dist.get_world_size()
    start = time.time()
    for G in (1, world):  # world nodes of one GPU (NCCL between them), one node of world GPUs
        for name in STANDARD:
            try:
                coll = purlinc.load(EXAMPLES / f"{name}.pln", None, gpus_per_node=G)
            except Exception as error:  # noqa: BLE001 - every case reports, the run goes on
                note(False, f"{name}/G={G}/load", f"{type(error).__name__}: {error}")
                continue
            if dist.get_rank() == 0:
                print(f"[{time.time() - start:6.1f} s] {name}, {world // G} node(s) x {G} GPU(s), "
                      f"{len(failures)} failures so far", flush=True)
            reduce = name in ("allreduce", "reduce", "reduce_scatter")
            cases = [(DType.FLOAT32, "sum"), (DType.INT32, "sum"), (DType.BFLOAT16, "max")] if reduce \
                else [(DType.FLOAT32, None), (DType.BFLOAT16, None)]
            for dtype, op in cases:
                for count in (1, 1000, 4097):
                    seed = zlib.crc32(f"{name}/{G}/{dtype.value}/{op}/{count}".encode())  # the same on every rank
                    try:
                        check_collective(coll, name, G, dtype, op, count, seed)
                    except Exception as error:  # noqa: BLE001 - every case reports, the run goes on
                        note(False, f"{name}/G={G}/{dtype.value}/{op}/n={count}", f"{type(error).__name__}: {error}")
            coll.close()
    rows = []
    try:
        rows = latency(1) + latency(world)
    except Exception as error:  # noqa: BLE001
        note(False, "latency", f"{type(error).__name__}: {error}")
    everyone = [None] * world
    dist.all_gather_object(everyone, {"checks": checks, "failures": failures})
    if dist.get_rank() == 0:
        total = sum(e["checks"] for e in everyone)
        bad = [f for e in everyone for f in e["failures"]]
        print(json.dumps({"checks": total, "failures": len(bad), "seconds": round(time.time() - start, 1),
                          "latency": rows}, indent=1))
        for f in bad[:40]:
            print("FAIL", f)
        print("| G | bytes | purlin/hierarchical us | nccl us |\n| --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['G']} | {r['bytes']} | {r.get('purlin/hierarchical us')} | {r.get('nccl us')} |")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if any(e["failures"] for e in everyone) else 0


if __name__ == "__main__":
    sys.exit(main())
