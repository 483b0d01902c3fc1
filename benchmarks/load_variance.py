"""Does a loaded collective's speed depend on where it was loaded?  The same schedule loaded
several times at once, timed side by side.

    python3 benchmarks/load_variance.py --out DIR [--loads 4] [--collectives allreduce,allgather]

A diagnostic, not a benchmark of record.  In one process driving every visible GPU
(``purlinc.LocalGroup``), loads ``--loads`` copies of one packed (LL) schedule per collective
(``--channels``), all alive together, so each takes its own staging, signal pad and call
counters from the heap (later ones from the segments the heap grows).  Each copy is checked
on fresh random data, then every copy's CUDA graph of ``--calls`` calls is replayed in turn,
``--reps`` rounds, so drift of the machine hits them alike.  Reported per copy: the slowest
device's median per call with the range, and the heap offsets of its staging and counters.
Why: in bench runs the default call and an explicit variant that compile the same kernel
differed by 0.3-0.8 us at 1-64 KiB, in either direction between runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import purlinc  # noqa: E402
from purlinc.dtypes import DType  # noqa: E402
from _graph_timing import capture, checked_call, replay_us, spread, write_results  # noqa: E402

EXAMPLES = ROOT / "examples"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--collectives", default="allreduce,allgather")
    ap.add_argument("--bytes", default="1024,65536")
    ap.add_argument("--channels", type=int, default=16)
    ap.add_argument("--loads", type=int, default=4)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    devices = list(range(torch.cuda.device_count()))
    group = purlinc.LocalGroup(devices)
    rng = np.random.default_rng(13)
    dtype = DType.BFLOAT16
    rows = []
    for name in args.collectives.split(","):
        colls = [purlinc.load(EXAMPLES / f"{name}.pln", group, algorithm="direct-push", packed=True,
                              channels=args.channels) for _ in range(args.loads)]
        try:
            heap = group.comms[0].heap
            for nbytes in map(int, args.bytes.split(",")):
                cases = []
                for i, coll in enumerate(colls):
                    xs, outs, ok = checked_call(coll, nbytes, dtype, rng, devices)
                    cases.append((i, coll, capture(coll, xs, outs, devices, args.calls), ok))
                times = {i: [] for i, *_ in cases}
                for _ in range(args.reps):
                    for i, _, graphs, _ in cases:
                        times[i].append(replay_us(graphs, devices, args.calls))
                for i, coll, _, ok in cases:
                    layout = coll[0].layout
                    row = {"collective": name, "bytes": nbytes, "channels": args.channels, "load": i,
                           **spread(times[i]), "checked": ok,
                           "stage_offset_mib": round(layout.stage / (1 << 20), 1),
                           "counters_offset_mib": round(layout.counters / (1 << 20), 3),
                           "segment": heap.segments.index(heap.segment_of(layout.stage))}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            for coll in colls:
                coll.close()
    meta = {"gpus": [torch.cuda.get_device_name(r) for r in devices], "calls_per_graph": args.calls,
            "reps": args.reps, "dtype": dtype.value}
    write_results(args.out, "load_variance", meta, rows, [
        ("collective", "collective"), ("bytes", "bytes"), ("channels", "channels"), ("load", "load"),
        ("median us", "median_us"), ("range us", "range"), ("staging at MiB", "stage_offset_mib"),
        ("counters at MiB", "counters_offset_mib"), ("heap segment", "segment"), ("checked", "checked")])
    return 0 if all(r["checked"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
