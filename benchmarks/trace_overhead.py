"""Traced vs untraced kernel time per call, in CUDA-graph replay (torchrun, one GPU per process).

    torchrun --nproc_per_node=2 benchmarks/trace_overhead.py --out /tmp/out

For each (collective, size), loads the same pinned schedule twice (trace off / on), captures
``--calls`` calls in one CUDA graph per variant, replays it ``--repeats`` times and reports the
median per-call time of the slowest rank; writes trace_overhead.json (and .md) into --out, plus
one trace of each collective (trace_<name>.json) for ``purlinc draw --trace``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # benchlib

from benchlib import argtypes, needs  # noqa: E402  (no torch: the arguments are checked without it)

try:  # the measuring half; main() says in one line what is missing (torch, a GPU) before using it
    import torch  # noqa: E402
    import torch.distributed as dist  # noqa: E402

    import purlinc  # noqa: E402
except ImportError as error:
    _IMPORT_ERROR: ImportError | None = error
else:
    _IMPORT_ERROR = None

CASES = {
    "allreduce": {"algorithm": "direct-push", "channels": 1, "packed": True},
    "allgather": {"algorithm": "direct-push", "channels": 1, "packed": True},
}
SIZES = (1024, 65536, 1 << 20)


def graph_us(call, calls: int, repeats: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    mine = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine.item())


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=argtypes.output_dir, default="/tmp/purlin_trace")
    ap.add_argument("--calls", type=argtypes.positive_int, default=20)
    ap.add_argument("--repeats", type=argtypes.positive_int, default=20)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # before the first CUDA call: one line, exit 2, where torchrun, torch or the GPUs are missing
    needs.require("trace_overhead.py", "torchrun --nproc_per_node=2 benchmarks/trace_overhead.py --out DIR",
                  torchrun=True)
    if _IMPORT_ERROR is not None:  # torch is there, so this is something else: show it whole
        raise _IMPORT_ERROR
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    comm = purlinc.Communicator.from_torch()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, options in CASES.items():
        path = ROOT / "examples" / f"{name}.pln"
        variants = {flag: purlinc.load(path, comm, trace=flag, **options) for flag in (False, True)}
        units_in = variants[False].in_units
        for size in SIZES:
            units = max(units_in, variants[False].out_units)
            count = max(size // 2 // units, 1)
            x = torch.randn(units_in * count, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(variants[False].out_units * count, device="cuda", dtype=torch.bfloat16)
            row = {"collective": name, "bytes": size, "options": options}
            for flag, coll in variants.items():
                row["traced_us" if flag else "untraced_us"] = graph_us(lambda: coll(x, y), args.calls, args.repeats)
            row["overhead_us"] = row["traced_us"] - row["untraced_us"]
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
        traced = variants[True]
        traced(x, y)
        torch.cuda.synchronize()
        data = traced.trace()  # a collective: every rank calls it
        if rank == 0:
            (out / f"trace_{name}.json").write_text(json.dumps(data, indent=1))
        for coll in variants.values():
            coll.close()
    if rank == 0:
        meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "device": torch.cuda.get_device_name(), "world_size": world, "torch": torch.__version__,
                "calls_per_graph": args.calls, "repeats": args.repeats, "dtype": "bfloat16",
                "method": "CUDA-graph replay, median per-call time, slowest rank"}
        (out / "trace_overhead.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        lines = ["| collective | bytes | untraced us | traced us | overhead us |", "|---|---|---|---|---|"]
        lines += [f"| {r['collective']} | {r['bytes']} | {r['untraced_us']:.2f} | {r['traced_us']:.2f} | "
                  f"{r['overhead_us']:+.2f} |" for r in rows]
        (out / "trace_overhead.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    dist.barrier()
    comm.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
