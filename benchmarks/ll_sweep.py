"""One-shot kernels: CUDA-graph time per call against algorithm, block size, channels and slices.

    python3 benchmarks/ll_sweep.py --out DIR        (one process, every visible GPU a rank)
    python3 benchmarks/ll_sweep.py --out DIR --loopback 8 --messages 16,1000
                                                    (8 ranks on cuda:0: code-generation A/B only)

For each collective and size, each algorithm (``--algorithms``: direct-push by default, or
direct-pull), each block size (the code generator's ``THREADS_PACKED``
for packed LL kernels, ``THREADS`` for plain ldst ones, set here before each load), channel
count and slice count, loads the schedule (packed by default), checks one call
against the reference on fresh random data (poisoned outputs, every rank), captures
``--calls`` calls per device in one CUDA graph, replays them ``--reps`` times and reports the
slowest device's median per call, with the range over repeats.  Writes ll_sweep.json and ll_sweep.md into --out.  The measurement
behind the choice of ``THREADS_PACKED`` (see purlinc/atom/codegen/limits.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

# The block size is a code-generator constant set per variant below: no compile cache (it
# keys on the request, not on that constant) and no in-process memo of compiled collectives.
os.environ["PURLIN_NO_CACHE"] = "1"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchlib import argtypes, needs  # noqa: E402  (no torch: the arguments are checked without it)

try:  # the measuring half; main() says in one line what is missing (torch, a GPU) before using it
    import numpy as np  # noqa: E402
    import torch  # noqa: E402

    import purlinc  # noqa: E402
    from purlinc.dtypes import DType  # noqa: E402
    from _graph_timing import capture, checked_call, replay_us, spread, write_results  # noqa: E402
except ImportError as error:
    _IMPORT_ERROR: ImportError | None = error
else:
    _IMPORT_ERROR = None
from purlinc.atom.codegen import limits  # noqa: E402  (the defaults below; no torch)

EXAMPLES = ROOT / "examples"
COLLECTIVES = sorted(p.stem for p in EXAMPLES.glob("*.pln"))
ALGORITHMS = ("direct-push", "direct-pull")


def per_call_us(coll, xs, outs, devices, calls: int, reps: int, streams=None) -> list[float]:
    graphs = capture(coll, xs, outs, devices, calls, streams)
    return [replay_us(graphs, devices, calls, streams) for _ in range(reps)]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=argtypes.output_dir, required=True)
    ap.add_argument("--collectives", default="allreduce,allgather,reduce_scatter",
                    help=f"comma-separated examples/*.pln names: {', '.join(COLLECTIVES)}")
    ap.add_argument("--bytes", type=argtypes.byte_size_list, default="1024,16384,65536",
                    help="comma-separated sizes (e.g. 1K,16K,64K)")
    ap.add_argument("--algorithms", default="direct-push", help="comma-separated: direct-push, direct-pull "
                    "(pull stages are never packed: --packed 0)")
    ap.add_argument("--threads", type=argtypes.positive_int_list, default="64,128,256,512")
    ap.add_argument("--channels", type=argtypes.positive_int_list, default="1", help="comma-separated channel counts")
    ap.add_argument("--packed", type=argtypes.switch_list, default="1",
                    help="comma-separated 1 (LL packets; --threads sets THREADS_PACKED) and/or 0 (plain "
                         "ldst staging; --threads sets THREADS)")
    ap.add_argument("--slices", type=argtypes.positive_int_list, default="1", help="comma-separated slices per channel")
    ap.add_argument("--inline-loops", type=argtypes.nonnegative_int_list, default=str(limits.LL_INLINE_LOOPS),
                    help="comma-separated values of limits.LL_INLINE_LOOPS (0: receive loops out of line)")
    ap.add_argument("--messages", type=argtypes.positive_int_list, default=str(limits.LL_SEND_MESSAGES),
                    help="comma-separated values of limits.LL_SEND_MESSAGES (messages per fused send loop)")
    ap.add_argument("--loopback", type=argtypes.nonnegative_int, default=0,
                    help="R > 0: R ranks on cuda:0 (a loopback group, one stream each): compares generated code "
                         "on one GPU, says nothing of NVLink")
    ap.add_argument("--calls", type=argtypes.positive_int, default=100)
    ap.add_argument("--reps", type=argtypes.positive_int, default=7)
    args = ap.parse_args(argv)
    try:
        args.collective_list = argtypes.flag_names(args.collectives, COLLECTIVES, "collectives")
        args.algorithm_list = argtypes.flag_names(args.algorithms, ALGORITHMS, "algorithms")
    except ValueError as error:
        ap.error(str(error))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # before the first CUDA call: one line, exit 2, where torch or the GPU is missing
    needs.require("ll_sweep.py", "python benchmarks/ll_sweep.py --out DIR [--loopback R]", torchrun=False)
    if _IMPORT_ERROR is not None:  # torch is there, so this is something else: show it whole
        raise _IMPORT_ERROR
    devices = [0] * args.loopback if args.loopback else list(range(torch.cuda.device_count()))
    group = purlinc.LocalGroup(devices, share_devices=bool(args.loopback))
    streams = [torch.cuda.Stream(device=d) for d in devices] if args.loopback else None
    rng = np.random.default_rng(11)
    dtype = DType.BFLOAT16
    rows = []
    for name in args.collective_list:
        for algorithm, packed, threads, channels, slices, inline, messages in itertools.product(
                args.algorithm_list, args.packed, args.threads, args.channels, args.slices, args.inline_loops,
                args.messages):
            if packed:
                limits.THREADS_PACKED = threads
            else:
                limits.THREADS = threads
            limits.LL_INLINE_LOOPS = inline
            limits.LL_SEND_MESSAGES = messages
            coll = purlinc.load(EXAMPLES / f"{name}.pln", group, algorithm=algorithm, packed=packed,
                                channels=channels, slices=slices)
            try:
                for nbytes in args.bytes:
                    xs, outs, ok = checked_call(coll, nbytes, dtype, rng, devices, streams)
                    times = per_call_us(coll, xs, outs, devices, args.calls, args.reps, streams)
                    _, _, still_ok = checked_call(coll, nbytes, dtype, rng, devices, streams)
                    row = {"collective": name, "bytes": nbytes, "algorithm": algorithm, "packed": packed,
                           "threads": threads, "channels": channels, "slices": slices, "inline_loops": inline,
                           "send_messages": messages, **spread(times), "checked": ok and still_ok}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                coll.close()
    meta = {"gpus": [torch.cuda.get_device_name(r) for r in devices], "calls_per_graph": args.calls,
            "reps": args.reps, "dtype": dtype.value, "loopback": args.loopback}
    write_results(args.out, "ll_sweep", meta, rows, [
        ("collective", "collective"), ("bytes", "bytes"), ("algorithm", "algorithm"), ("packed", "packed"),
        ("threads", "threads"), ("channels", "channels"), ("slices", "slices"),
        ("inline loops", "inline_loops"), ("send messages", "send_messages"), ("median us", "median_us"), ("range us", "range"), ("checked", "checked")])
    return 0 if all(r["checked"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
