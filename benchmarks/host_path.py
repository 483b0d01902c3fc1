"""Host time of one eager call, piece by piece (what the eager latency is made of).

    torchrun --nproc_per_node=2 benchmarks/host_path.py --out DIR

An eager call of a small collective is bound by the host: the GPU finishes each kernel in
about 3 us, the host takes longer to issue the next.  This times, on rank 0's host thread,
each piece of the call path in a loop of ``--iters`` (median of ``--reps`` loops, ns per
iteration), beside a whole call of the default (size-tuned) collective, of one fixed
schedule, and of NCCL's all_reduce.  Both ranks run every loop (the kernels need their
peer), and synchronize between loops.  Writes host_path.json and host_path.md into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # benchlib

from benchlib import argtypes, needs  # noqa: E402  (no torch: the arguments are checked without it)

try:  # the measuring half; main() says in one line what is missing (torch, a GPU) before using it
    import torch  # noqa: E402
    import torch.distributed as dist  # noqa: E402

    import purlinc  # noqa: E402
    from purlinc.runtime import driver, interop  # noqa: E402
    from cuda.bindings import driver as cu  # noqa: E402
except ImportError as error:
    _IMPORT_ERROR: ImportError | None = error
else:
    _IMPORT_ERROR = None

EXAMPLES = ROOT / "examples"


def per_iter_ns(fn, iters: int, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter_ns()
        for _ in range(iters):
            fn()
        out.append((time.perf_counter_ns() - start) / iters)
    torch.cuda.synchronize()
    return out


def gpu_per_call_us(fn, iters: int, reps: int) -> list[float]:
    """Device time per call of ``iters`` calls issued back to back (events on the current
    stream, as benchmarks/bench.py times eager calls), the ranks lined up before each loop."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / iters)
    return out


EMPTY_KERNEL = 'extern "C" __global__ void purlin_empty(const unsigned long long* args) {}'


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=argtypes.output_dir, required=True)
    ap.add_argument("--bytes", type=argtypes.positive_int, default=1024)
    ap.add_argument("--iters", type=argtypes.positive_int, default=2000)
    ap.add_argument("--reps", type=argtypes.positive_int, default=5)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # before the first CUDA call: one line, exit 2, where torchrun, torch or the GPUs are missing
    needs.require("host_path.py", "torchrun --nproc_per_node=2 benchmarks/host_path.py --out DIR", torchrun=True)
    if _IMPORT_ERROR is not None:  # torch is there, so this is something else: show it whole
        raise _IMPORT_ERROR
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    comm = purlinc.Communicator.from_torch()
    world = dist.get_world_size()
    n = args.bytes // 2
    x = torch.randn(n, device="cuda").to(torch.bfloat16)
    y = torch.empty_like(x)
    default = purlinc.load(str(EXAMPLES / "allreduce.pln"), comm)
    fixed = purlinc.load(str(EXAMPLES / "allreduce.pln"), comm, algorithm="direct-push", packed=True, channels=1)
    for coll in (default, fixed):
        for _ in range(3):
            coll(x, out=y, op="sum")
    torch.cuda.synchronize()
    fast = fixed._fast
    assert fast is not None, "the fixed collective's fast path was not set up"
    function, grid, block, shared, packed = fast.target
    stream = interop.current_stream(interop.TORCH, rank)
    cu_stream = cu.CUstream(stream)
    cu_function = function if not isinstance(function, int) else cu.CUfunction(function)
    flag = fixed._flag

    def nothing(x=None, out=None, op="sum"):
        return out

    pieces = {
        "python call (no work)": lambda: nothing(x, out=y, op="sum"),
        "FastPath.matches": lambda: fast.matches(x, y, "sum", None),
        "current stream (torch raw)": lambda: interop.current_stream(interop.TORCH, rank),
        "error flag read": lambda: flag.value,
        "driver.launch (int stream)": lambda: driver.launch(function, grid, block, shared, stream, packed),
        "cuLaunchKernel (CUstream object)": lambda: cu.cuLaunchKernel(cu_function, grid, 1, 1, block, 1, 1, shared,
                                                                      cu_stream, packed.kernel_params, 0),
        "fixed schedule: coll(x, out=y)": lambda: fixed(x, out=y, op="sum"),
        "default (tuned): coll(x, out=y)": lambda: default(x, out=y, op="sum"),
        "NCCL all_reduce (in place)": lambda: dist.all_reduce(y),
    }
    from purlinc.atom.nvrtc import compile_cubin

    major, minor = torch.cuda.get_device_capability()
    module = driver.module_load(compile_cubin(EMPTY_KERNEL, "purlin_empty.cu", f"sm_{major}{minor}"))
    empty = driver.get_function(module, "purlin_empty")
    pieces["empty kernel: driver.launch"] = lambda: driver.launch(empty, 1, 32, 0, stream, packed)
    rows = []
    for name, fn in pieces.items():
        times = per_iter_ns(fn, args.iters, args.reps)
        rows.append({"piece": name, "median_ns": round(statistics.median(times)), "min_ns": round(min(times)),
                     "max_ns": round(max(times))})
    # The same calls timed on the device, as bench.py times eager calls: is the eager time the
    # host's issue rate, or the device's?
    for name in ("empty kernel: driver.launch", "fixed schedule: coll(x, out=y)",
                 "default (tuned): coll(x, out=y)", "NCCL all_reduce (in place)"):
        for iters in (50, 1000):
            times = [1e3 * t for t in gpu_per_call_us(pieces[name], iters, args.reps)]
            rows.append({"piece": f"device time per call, {iters} back to back: {name}",
                         "median_ns": round(statistics.median(times)), "min_ns": round(min(times)),
                         "max_ns": round(max(times))})
    for coll in (default, fixed):
        coll.close()
    dist.barrier()
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"gpus": [torch.cuda.get_device_name(0)] * world, "bytes": args.bytes, "iters": args.iters,
                "reps": args.reps, "torch": torch.__version__}
        (out / "host_path.json").write_text(json.dumps({"meta": meta, "rows": rows}))
        lines = ["| piece | median ns | range ns |", "|---|---|---|"]
        lines += [f"| {r['piece']} | {r['median_ns']} | {r['min_ns']}-{r['max_ns']} |" for r in rows]
        (out / "host_path.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
