"""A tensor-parallel MLP block (Megatron style) with Purlin's all-reduce, beside NCCL's.

    torchrun --nproc_per_node=2 examples/tp_mlp.py --out /tmp/out

Each rank holds a column slice of W1 (hidden -> ffn / R) and a row slice of W2 (ffn / R ->
hidden); a step is ``y = all_reduce(silu(x @ W1) @ W2)``: two matmuls and one all-reduce of
``tokens x hidden`` elements.  The same block runs with ``purlinc.torch.functional.all_reduce``
and with NCCL (``torch.distributed._functional_collectives.all_reduce``, the traceable form),
eagerly, under ``torch.compile(fullgraph=True)`` and under ``mode="reduce-overhead"`` (CUDA
graphs).  Every mode's output is checked against NCCL's on the same inputs; the Purlin graph
must have no graph break.  Times are per step (CUDA events, median of repeats, slowest rank).
Rank 0 writes ``tp_mlp.json`` (and prints a Markdown table); the exit status is 1 if a check
failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

# Ranks compile their graphs (inductor) at slightly different times, and a Purlin kernel on the
# faster rank waits on the device for the slower one: give that wait room (before purlinc loads).
os.environ.setdefault("PURLIN_WAIT_TIMEOUT_S", "120")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import purlinc  # noqa: E402
import purlinc.torch as pt  # noqa: E402


def block(all_reduce):
    def step(x, w1, w2):
        h = torch.nn.functional.silu(x @ w1)
        return all_reduce(h @ w2)
    return step


def timed(fn, args, steps: int, repeats: int, graphs: bool) -> float:
    """Median over ``repeats`` of the mean per-step time (us) of ``steps`` back-to-back steps."""
    samples = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            fn(*args)
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / steps)
    return statistics.median(samples)


def run_mode(mode, tokens, x, w1, w2, purlin_ar, nccl_ar, nccl_traced, args, world) -> dict:
    """One (tokens, mode) row: correctness against NCCL, then the time per step of both."""
    torch._dynamo.reset()
    if mode == "eager":
        fp, fn = purlin_ar, nccl_ar
    else:
        kw = {"fullgraph": True, "mode": None if mode == "compile" else mode}
        fp, fn = torch.compile(purlin_ar, **kw), torch.compile(nccl_traced, **kw)
    graphs = mode == "reduce-overhead"
    breaks = None
    if mode == "compile":
        breaks = torch._dynamo.explain(purlin_ar)(x, w1, w2).graph_break_count
        torch._dynamo.reset()
        fp = torch.compile(purlin_ar, fullgraph=True)
    # correctness: fresh activations each time, Purlin vs NCCL on the same inputs
    equal, max_diff = True, 0.0
    for it in range(3):
        xi = torch.randn(tokens, args.hidden, device="cuda", generator=torch.Generator(device="cuda")
                         .manual_seed(99 + it)).bfloat16()
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        a = fp(xi, w1, w2).clone()
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        b = fn(xi, w1, w2).clone()
        torch.cuda.synchronize()
        equal &= torch.equal(a, b)
        max_diff = max(max_diff, float((a.float() - b.float()).abs().max()))
    purlin_us = timed(fp, (x, w1, w2), args.steps, args.repeats, graphs)
    nccl_us = timed(fn, (x, w1, w2), args.steps, args.repeats, graphs)
    # the slowest rank's time is the step time
    times = [None] * world
    dist.all_gather_object(times, (purlin_us, nccl_us, equal, max_diff))
    row = {
        "tokens": tokens, "mode": mode, "allreduce_bytes": tokens * args.hidden * 2,
        "purlin_us": round(max(t[0] for t in times), 2), "nccl_us": round(max(t[1] for t in times), 2),
        "outputs_equal_all_ranks": all(t[2] for t in times), "max_abs_diff": max(t[3] for t in times),
        "graph_breaks": breaks,
    }
    row["speedup"] = round(row["nccl_us"] / row["purlin_us"], 3)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="directory for tp_mlp.json")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--tokens", default="8,128", help="comma-separated token counts (rows of x)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--modes", default="eager,compile,reduce-overhead")
    args = parser.parse_args()

    dist.init_process_group("nccl")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.ffn % world:
        raise SystemExit(f"--ffn {args.ffn} must be a multiple of the world size {world}")
    comm = purlinc.Communicator.from_torch()
    group = pt.init(comm)
    dist.all_reduce(torch.ones(1, device="cuda"))

    def nccl_eager(y):
        dist.all_reduce(y)  # on the current stream, like a synchronous torch.distributed call
        return y

    purlin_ar = block(lambda y: pt.functional.all_reduce(y, group=group))
    nccl_ar = block(nccl_eager)  # eager
    nccl_traced = block(lambda y: funcol.all_reduce(y, "sum", dist.group.WORLD))  # what torch.compile takes
    gen = torch.Generator(device="cuda")
    gen.manual_seed(7 + rank)
    scale = args.hidden ** -0.5
    w1 = (torch.randn(args.hidden, args.ffn // world, device="cuda", generator=gen) * scale).bfloat16()
    w2 = (torch.randn(args.ffn // world, args.hidden, device="cuda", generator=gen) * scale).bfloat16()
    for w in (w1, w2):  # weights: static inputs, so CUDA graphs do not copy them in every replay
        torch._dynamo.mark_static_address(w)

    rows, failures = [], []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        torch.manual_seed(1234 + tokens)  # the same activations on every rank (replicated input)
        x = torch.randn(tokens, args.hidden, device="cuda").bfloat16()
        for mode in args.modes.split(","):
            try:
                rows.append(run_mode(mode, tokens, x, w1, w2, purlin_ar, nccl_ar, nccl_traced, args, world))
            except Exception as error:  # noqa: BLE001 - one mode failing is reported, the others still run
                rows.append({"tokens": tokens, "mode": mode, "error": f"{type(error).__name__}: {error}"[:500]})
            row = rows[-1]
            if "error" in row or row["max_abs_diff"] > 1e-2 or (row["graph_breaks"] or 0) != 0:
                failures.append(row)
    comm.check()
    comm.check()
    if rank == 0:
        report = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "world_size": world, "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "NCCL_GRAPH_MIXING_SUPPORT": os.environ.get("NCCL_GRAPH_MIXING_SUPPORT", "(unset: NCCL default)"),
            "config": {"hidden": args.hidden, "ffn": args.ffn, "dtype": "bfloat16", "steps": args.steps,
                       "repeats": args.repeats},
            "rows": rows, "failures": len(failures),
        }
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "tp_mlp.json").write_text(json.dumps(report, indent=1))
        print("| tokens | mode | all-reduce bytes | Purlin us/step | NCCL us/step | speedup | equal | graph breaks |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            if "error" in r:
                print(f"| {r['tokens']} | {r['mode']} | error: {r['error'][:200]} |", flush=True)
                continue
            print(f"| {r['tokens']} | {r['mode']} | {r['allreduce_bytes']} | {r['purlin_us']} | {r['nccl_us']} | "
                  f"{r['speedup']}x | {r['outputs_equal_all_ranks']} | {r['graph_breaks']} |", flush=True)
    group.close()
    comm.close()
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
