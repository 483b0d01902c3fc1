"""Run under ``torchrun --nproc_per_node=2``: purlinc.torch on real GPUs, every result compared
with NCCL (torch.distributed) on the same fresh random inputs, on every rank.

Modes: eager (the torch.distributed-shaped calls and the custom ops called directly),
``torch.compile(fullgraph=True)`` (inductor; ``torch._dynamo.explain`` must report zero graph
breaks), ``mode="reduce-overhead"`` (CUDA graphs through inductor; no cudagraph skips), and a
hand-captured ``torch.cuda.graph`` of eager calls replayed on new data.  Bad input: a tensor
of another device, a wrong shape, a wrong dtype, a capture before the warm-up call.

Rank 0 writes ``$PURLIN_RESULTS/torch_results.json`` and prints a summary; the exit status is
non-zero if any check failed on any rank.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import purlinc  # noqa: E402
import purlinc.torch as pt  # noqa: E402
from purlinc.runtime.errors import ArgumentError  # noqa: E402

results: dict = {"checks": [], "failures": [], "stages": {}}
RANK = 0
R = 1
GEN = None


def note(ok: bool, what: str, detail: str = "") -> None:
    results["checks"].append([what, bool(ok)])
    if not ok:
        results["failures"].append(f"{what}: {detail}")
        print(f"[rank {RANK}] FAIL {what}: {detail}", flush=True)


def fresh(*shape, dtype=torch.bfloat16):
    """New random data every call, different on every rank (never zeros)."""
    return torch.randn(*shape, device="cuda", generator=GEN).to(dtype)


def poison(t):
    t.view(torch.uint8).fill_(0xFF)
    return t


def same(a, b, exact=True) -> tuple[bool, str]:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, f"shape/dtype {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}"
    if exact:
        ok = torch.equal(a, b)  # bitwise for these data (no NaN): R=2 sums round once, as NCCL's do
        return ok, "" if ok else f"{int((a != b).sum())} of {a.numel()} elements differ"
    ok = torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)
    return ok, "" if ok else f"max abs diff {float((a.float() - b.float()).abs().max())}"


def nccl_op(op):
    return {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}[op]


# ---------------------------------------------------------------------------------------------
# the eight collectives: Purlin (through a caller) beside NCCL, one input


def references(x, op, root):
    """NCCL's answers for input x (this rank's), in the program's order."""
    n0 = x.shape[0]
    ref = {}
    t = x.clone()
    dist.all_reduce(t, op=nccl_op(op))
    ref["all_reduce"] = t
    t = x.new_empty(R * n0, *x.shape[1:])
    dist.all_gather_into_tensor(t, x)
    ref["all_gather_into_tensor"] = t
    t = x.new_empty(n0 // R, *x.shape[1:])
    dist.reduce_scatter_tensor(t, x, op=nccl_op(op))
    ref["reduce_scatter_tensor"] = t
    t = torch.empty_like(x)
    dist.all_to_all_single(t, x)
    ref["all_to_all_single"] = t
    t = x.clone()
    dist.broadcast(t, src=root)
    ref["broadcast"] = t
    t = x.clone()
    dist.reduce(t, dst=root, op=nccl_op("sum" if op == "avg" else op))
    ref["reduce"] = t if RANK == root else x  # only the destination's result is defined
    gl = [torch.empty_like(x) for _ in range(R)] if RANK == root else None
    dist.gather(x, gl, dst=root)
    ref["gather"] = torch.cat(gl) if RANK == root else None
    t = x.new_empty(n0 // R, *x.shape[1:])
    dist.scatter(t, list(x.chunk(R)) if RANK == root else None, src=root)
    ref["scatter"] = t
    return ref


def program(group, op, root):
    """All eight through the torch.distributed-shaped API; returns what each produced."""
    def f(x):
        n0 = x.shape[0]
        got = {}
        t = x.clone()
        group.all_reduce(t, op=op)
        got["all_reduce"] = t
        t = x.new_empty(R * n0, *x.shape[1:])
        group.all_gather_into_tensor(t, x)
        got["all_gather_into_tensor"] = t
        t = x.new_empty(n0 // R, *x.shape[1:])
        group.reduce_scatter_tensor(t, x, op=op)
        got["reduce_scatter_tensor"] = t
        t = torch.empty_like(x)
        group.all_to_all_single(t, x)
        got["all_to_all_single"] = t
        t = x.clone()
        group.broadcast(t, src=root)
        got["broadcast"] = t
        t = x.clone()
        group.reduce(t, dst=root, op="sum" if op == "avg" else op)
        got["reduce"] = t
        gl = [torch.empty_like(x) for _ in range(R)] if RANK == root else None
        group.gather(x, gl, dst=root)
        got["gather"] = torch.cat(gl) if RANK == root else None
        t = x.new_empty(n0 // R, *x.shape[1:])
        group.scatter(t, list(x.chunk(R)) if RANK == root else None, src=root)
        got["scatter"] = t
        got["functional.all_reduce"] = pt.functional.all_reduce(x, op=op, group=group)
        got["functional.all_gather_tensor"] = pt.functional.all_gather_tensor(x, group=group)
        got["functional.reduce_scatter_tensor"] = pt.functional.reduce_scatter_tensor(x, op=op, group=group)
        got["functional.all_to_all_single"] = pt.functional.all_to_all_single(x, group=group)
        return got
    return f


def compare(mode, got, ref, op, dtype, n):
    reduced = {"all_reduce", "reduce_scatter_tensor", "reduce"}
    for name, value in got.items():
        base = name.removeprefix("functional.")
        base = {"all_gather_tensor": "all_gather_into_tensor"}.get(base, base)
        want = ref[base]
        if want is None:
            continue
        exact = not (base in reduced and (op == "avg" or R > 2))
        ok, detail = same(value, want, exact)
        note(ok, f"{mode}/{name}/{str(dtype).removeprefix('torch.')}/{op}/rows={n} vs NCCL", detail)


def eager_checks(group):
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (R * 3, R * 512):
            for op in ("sum", "avg", "max") if dtype == torch.bfloat16 and rows == R * 3 else ("sum",):
                for it in range(2):
                    x = fresh(rows, 8, dtype=dtype)
                    got = program(group, op, R - 1)(x)
                    ref = references(x, op, R - 1)
                    torch.cuda.synchronize()
                    compare(f"eager/it{it}", got, ref, op, dtype, rows)
    # the custom ops called directly, eagerly (the dispatcher path)
    x = fresh(R * 16, dtype=torch.bfloat16)
    h = group._handle("allgather")
    y = torch.ops.purlin.allgather(x, h, "sum", -1)
    out = poison(x.new_empty(R * x.numel()))
    torch.ops.purlin.allgather_out(x, out, h, "sum")
    ref = x.new_empty(R * x.numel())
    dist.all_gather_into_tensor(ref, x)
    note(same(y, ref)[0] and same(out, ref)[0], "eager/torch.ops.purlin.allgather(+_out) vs NCCL")
    t = x.clone()
    torch.ops.purlin.allreduce_inplace(t, group._handle("allreduce"), "sum")
    ref = x.clone()
    dist.all_reduce(ref)
    note(same(t, ref)[0], "eager/torch.ops.purlin.allreduce_inplace vs NCCL", same(t, ref)[1])
    # async_op: a Work whose wait() orders the current stream after the side stream
    x = fresh(R * 4096, dtype=torch.bfloat16)
    t = x.clone()
    work = group.all_reduce(t, async_op=True)
    work.wait()
    ref = x.clone()
    dist.all_reduce(ref)
    torch.cuda.synchronize()
    note(work.is_completed() and same(t, ref)[0], "eager/all_reduce(async_op=True).wait() vs NCCL")
    out = x.new_empty(R * x.numel())
    work = group.all_gather_into_tensor(out, x, async_op=True)
    work.wait()
    ref = x.new_empty(R * x.numel())
    dist.all_gather_into_tensor(ref, x)
    torch.cuda.synchronize()
    note(same(out, ref)[0], "eager/all_gather_into_tensor(async_op=True).wait() vs NCCL")


def compiled_checks(group):
    from torch._dynamo.utils import counters

    note(pt.ops.ORDERED, "functional ops registered as ORDERED effects (no per-rank reordering)")
    dtype, rows, op, root = torch.bfloat16, R * 256, "sum", R - 1
    f = program(group, op, root)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(f)(fresh(rows, 8, dtype=dtype))
    note(explanation.graph_break_count == 0 and explanation.graph_count == 1,
         "torch._dynamo.explain: zero graph breaks, one graph",
         f"{explanation.graph_break_count} breaks: {explanation.break_reasons}")
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(f, fullgraph=True, mode=None if mode == "default" else mode)
        for it in range(4):  # reduce-overhead: warm-up run, recording run, then replays
            torch.compiler.cudagraph_mark_step_begin()
            x = fresh(rows, 8, dtype=dtype)
            got = {k: (v.clone() if v is not None else None) for k, v in compiled(x).items()}
            ref = references(x, op, root)
            torch.cuda.synchronize()
            compare(f"compile[{mode}]/it{it}", got, ref, op, dtype, rows)
        if mode == "reduce-overhead":
            skips = counters["inductor"]["cudagraph_skips"]
            note(skips == 0, "compile[reduce-overhead]: no cudagraph skips", f"{skips} skips")
        note(counters["stats"]["unique_graphs"] <= 1, f"compile[{mode}]: one graph, no recompiles",
             f"unique_graphs={counters['stats']['unique_graphs']}")


def graph_checks(group):
    """Eager calls captured into one torch.cuda.graph after a warm-up, replayed on new data."""
    dtype, rows, root = torch.bfloat16, R * 128, R - 1
    x = fresh(rows, 8, dtype=dtype)
    f = program(group, "sum", root)
    f(x)  # warm-up: loads and compiles what the capture replays
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        got = f(x)
    for it in range(3):
        x.copy_(fresh(rows, 8, dtype=dtype))
        for v in got.values():
            if v is not None:
                poison(v)
        graph.replay()
        ref = references(x, "sum", root)
        torch.cuda.synchronize()
        compare(f"cuda-graph/replay{it}", got, ref, "sum", dtype, rows)


def bad_input_checks(group, comm):
    def expect(what, words, fn):
        try:
            fn()
        except ArgumentError as error:
            text = str(error)
            note(all(w in text for w in words), f"bad input: {what}", text[:300])
            return
        except Exception as error:  # noqa: BLE001
            note(False, f"bad input: {what}", f"{type(error).__name__}: {str(error)[:300]}")
            return
        note(False, f"bad input: {what}", "no error raised")

    other = (comm.device + 1) % torch.cuda.device_count()
    if other != comm.device:
        t = torch.randn(16, device=f"cuda:{other}")
        expect("tensor of another device/communicator", ["tensor is on cuda:" + str(other),
                                                         f"expected cuda:{comm.device}"], lambda: group.all_reduce(t))
    x = fresh(8, dtype=torch.bfloat16)
    expect("wrong shape", ["output_tensor has 10 elements", f"expected {8 * R}"],
           lambda: group.all_gather_into_tensor(x.new_empty(10), x))
    expect("wrong dtype", ["tensor has dtype float64", "does not support"],
           lambda: group.all_reduce(torch.randn(8, device="cuda", dtype=torch.float64)))
    expect("avg on int32", ["op='avg' needs a floating dtype"],
           lambda: group.all_reduce(torch.ones(8, device="cuda", dtype=torch.int32), op="avg"))

    def capture_cold():
        fresh_group = pt.Group(comm)  # never called: nothing loaded
        t = fresh(64, dtype=torch.float16)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.graph(g, stream=s):
                fresh_group.all_reduce(t, op="min")
        finally:
            fresh_group.close()
    expect("capture before the warm-up call", ["CUDA graph capture before", "warm-up call"], capture_cold)


def cold_warm_capture_check(group):
    """Loaded (warm for bf16 sum) but never called with float16 max: a capture is refused,
    and after one eager call the same capture works."""
    t = fresh(R * 64, dtype=torch.float16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    refused = False
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=s):
            group.all_reduce(t.clone(), op="max")
    except ArgumentError as error:
        refused = "reached a CUDA graph capture before a warm-up call" in str(error) and "op max" in str(error)
    note(refused, "capture of a cold (dtype, op) refused, naming dtype and op")
    group.all_reduce(t.clone(), op="max")  # the warm-up
    torch.cuda.synchronize()
    y = t.clone()
    g = torch.cuda.CUDAGraph()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(g, stream=s):
        group.all_reduce(y, op="max")
    y.copy_(t)
    g.replay()
    ref = t.clone()
    dist.all_reduce(ref, op=dist.ReduceOp.MAX)
    torch.cuda.synchronize()
    note(same(y, ref)[0], "capture after the warm-up replays right vs NCCL")


def main():
    global RANK, R, GEN
    dist.init_process_group("nccl")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    RANK, R = dist.get_rank(), dist.get_world_size()
    GEN = torch.Generator(device="cuda")
    GEN.manual_seed(4242 + 17 * RANK)
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    comm = purlinc.Communicator.from_torch()
    group = pt.init(comm)
    dist.all_reduce(torch.ones(1, device="cuda"))
    for name, fn in (("eager", lambda: eager_checks(group)), ("compiled", lambda: compiled_checks(group)),
                     ("cuda_graph", lambda: graph_checks(group)), ("bad_input", lambda: bad_input_checks(group, comm)),
                     ("warm_capture", lambda: cold_warm_capture_check(group))):
        start = time.time()
        try:
            fn()
        except Exception as error:  # noqa: BLE001 - a stage that crashes is a failed check, not a hang
            note(False, f"stage {name} crashed", f"{type(error).__name__}: {error}\n{traceback.format_exc()[-2000:]}")
        try:
            torch.cuda.synchronize()
            comm.check()  # a device-side timeout of any call in the stage
        except Exception as error:  # noqa: BLE001
            note(False, f"stage {name}: device-side check", f"{type(error).__name__}: {error}")
        dist.barrier()
        results["stages"][name] = round(time.time() - start, 1)
    gathered = [None] * R
    dist.all_gather_object(gathered, {"checks": results["checks"], "failures": results["failures"]})
    total = sum(len(g["checks"]) for g in gathered)
    passed = sum(ok for g in gathered for _, ok in g["checks"])
    if RANK == 0:
        summary = {"passed": passed, "total": total, "stages": results["stages"],
                   "per_rank": [len(g["checks"]) for g in gathered],
                   "failures": [f for g in gathered for f in g["failures"]],
                   "checks": results["checks"], "torch": torch.__version__}  # rank 0's list (the summary drops it)
        out = os.environ.get("PURLIN_RESULTS", ".")
        with open(os.path.join(out, "torch_results.json"), "w") as fh:
            json.dump(summary, fh, indent=1)
        print(json.dumps({k: summary[k] for k in ("passed", "total", "stages", "per_rank")}), flush=True)
        for f in summary["failures"][:40]:
            print("FAIL", f, flush=True)
    failed = passed != total
    group.close()
    comm.close()
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
