"""Slice counts side by side on ONE GPU: a loopback group (two ranks on cuda:0, one stream
each) replays per-rank CUDA graphs of one direct-push schedule for each slice count.

    python3 benchmarks/loopback_slices.py --out DIR [--label new] [--bytes 16777216]
        [--collectives allgather,allreduce,alltoall] [--slices 1,2,4] [--channels 64]

Both ranks share the GPU's SMs and memory and their "remote" stores never leave it, so the
numbers say how a schedule's order uses one GPU (e.g. whether a slice's copy-out overlaps
the next slice's stores), not what it does over NVLink.  Each point: every rank checked bit
for bit on fresh data first; then ``--reps`` timed repeats of ``--replays`` replays of both
ranks' graphs (``--calls`` calls each), device time by events; median, min and max per call.
Writes DIR/loopback_slices_<label>.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import purlinc  # noqa: E402
from purlinc.dtypes import DType  # noqa: E402
from purlinc.frontend.evaluate import evaluate  # noqa: E402

DEVICE = 0


def _buffers(spec, count):
    xs = [torch.randn(len(spec.inputs[r]) * count, device=f"cuda:{DEVICE}").to(torch.bfloat16)
          for r in range(spec.world_size)]
    outs = [torch.empty(len(spec.outputs[r]) * count, dtype=torch.bfloat16, device=f"cuda:{DEVICE}")
            for r in range(spec.world_size)]
    return xs, outs


def _on_streams(streams, work):
    """``work()`` issued after the current stream's work, and the current stream after it."""
    current = torch.cuda.current_stream(DEVICE)
    for s in streams:
        s.wait_stream(current)
    work()
    for s in streams:
        current.wait_stream(s)


def _check(coll, spec, xs, outs, streams, label):
    for o in outs:
        o.view(torch.uint8).fill_(0xFF)
    _on_streams(streams, lambda: coll(xs, outs, streams=streams))
    torch.cuda.synchronize(DEVICE)
    coll.check()
    ins = [x.view(torch.int16).cpu().numpy().view(np.uint16) for x in xs]  # bf16 storage
    count = xs[0].numel() // max(len(spec.inputs[0]), 1)
    want = evaluate(spec, ins, count, DType.BFLOAT16, "sum" if spec.is_reduce else None)
    for r, o in enumerate(outs):
        if not np.array_equal(o.view(torch.int16).cpu().numpy().view(np.uint16), want[r]):
            raise AssertionError(f"{label}: rank {r} differs from the reference")


def time_point(group, streams, name, channels, slices, nbytes, args):
    coll = purlinc.load(ROOT / "examples" / f"{name}.pln", group, algorithm="direct-push", atom="ldst",
                        channels=channels, slices=slices)
    try:
        spec = coll[0].compiled.spec
        count = max(1, nbytes // (2 * max(len(spec.outputs[0]), 1)))  # bytes of each rank's output
        xs, outs = _buffers(spec, count)
        label = f"{name}/c{channels}/s{slices}"
        _check(coll, spec, xs, outs, streams, label)
        graphs = []
        for r, s in enumerate(streams):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                for _ in range(args.calls):
                    coll[r](xs[r], outs[r])
            graphs.append(g)

        def replay():
            for g, s in zip(graphs, streams):
                with torch.cuda.stream(s):
                    g.replay()

        _on_streams(streams, replay)  # warm
        torch.cuda.synchronize(DEVICE)
        per_call = []
        for _ in range(args.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.replays):
                _on_streams(streams, replay)
            end.record()
            torch.cuda.synchronize(DEVICE)
            per_call.append(start.elapsed_time(end) * 1e3 / (args.replays * args.calls))
        coll.check()
        _check(coll, spec, xs, outs, streams, label + " after the replays")
        return {"collective": name, "channels": channels, "slices": slices, "bytes": nbytes, "count": count,
                "us": round(statistics.median(per_call), 2), "min_us": round(min(per_call), 2),
                "max_us": round(max(per_call), 2), "checked": True}
    finally:
        coll.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--label", default="run")
    parser.add_argument("--bytes", type=int, default=16 << 20)
    parser.add_argument("--collectives", default="allgather,allreduce,alltoall")
    parser.add_argument("--slices", default="1,2,4")
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    group = purlinc.LocalGroup([DEVICE, DEVICE], share_devices=True)
    streams = [torch.cuda.Stream(device=DEVICE) for _ in range(2)]
    rows = []
    try:
        for name in args.collectives.split(","):
            for slices in map(int, args.slices.split(",")):
                try:
                    rows.append(time_point(group, streams, name, args.channels, slices, args.bytes, args))
                except Exception as error:  # one point's failure is recorded, the others still run
                    rows.append({"collective": name, "channels": args.channels, "slices": slices,
                                 "error": f"{type(error).__name__}: {str(error)[:300]}"})
                    if getattr(group[0], "failed", None) is not None:  # the group is out of step: stop
                        break
                print(json.dumps(rows[-1]), flush=True)
    finally:
        group.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"loopback_slices_{args.label}.json").write_text(json.dumps({"label": args.label, "rows": rows}) + "\n")
    print("\n| collective | slices | us per call (median, min-max) |\n|---|---|---|")
    for row in rows:
        cell = f"{row['us']} ({row['min_us']}-{row['max_us']})" if "us" in row else row["error"]
        print(f"| {row['collective']} | {row['slices']} | {cell} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
