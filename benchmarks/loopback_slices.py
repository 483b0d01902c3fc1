"""Slice counts side by side on ONE GPU: a loopback group (two ranks on cuda:0, one stream
each) replays per-rank CUDA graphs of one direct-push schedule for each slice count.

    python3 benchmarks/loopback_slices.py --out DIR [--label new] [--bytes 16777216]
        [--collectives allgather,allreduce,alltoall] [--slices 1,2,4] [--channels 64]

Both ranks share the GPU's SMs and memory and their "remote" stores never leave it, so the
numbers say how a schedule's order uses one GPU (e.g. whether a slice's copy-out overlaps
the next slice's stores), not what it does over NVLink.  Each point: every rank checked bit
for bit on fresh data before and after the timing; then ``--reps`` timed repeats of
``--replays`` replays of both ranks' graphs (``--calls`` calls each), device time by events
(the slower rank's); median, min and max per call.  Writes DIR/loopback_slices_<label>.json
and .md (benchmarks/_graph_timing.py; points that failed are listed under meta.errors).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # benchlib
sys.path.insert(0, str(ROOT / "tests" / "gpu"))  # _common: the GPU tests' reference and data helpers

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

DEVICES = [0, 0]  # rank r's GPU: both on cuda:0
COLLECTIVES = sorted(p.stem for p in (ROOT / "examples").glob("*.pln"))


def time_point(group, streams, name, channels, slices, nbytes, args, rng):
    coll = purlinc.load(ROOT / "examples" / f"{name}.pln", group, algorithm="direct-push", atom="ldst",
                        channels=channels, slices=slices)
    try:
        xs, outs, ok = checked_call(coll, nbytes, DType.BFLOAT16, rng, DEVICES, streams)
        graphs = capture(coll, xs, outs, DEVICES, args.calls, streams)
        times = [replay_us(graphs, DEVICES, args.calls, streams, args.replays) for _ in range(args.reps)]
        coll.check()
        _, _, still_ok = checked_call(coll, nbytes, DType.BFLOAT16, rng, DEVICES, streams)
        return {"collective": name, "channels": channels, "slices": slices, "bytes": nbytes, **spread(times),
                "checked": ok and still_ok}
    finally:
        coll.close()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=argtypes.output_dir, required=True)
    parser.add_argument("--label", type=argtypes.file_tag, default="run")
    parser.add_argument("--bytes", type=argtypes.positive_byte_size, default=16 << 20, help="e.g. 16777216 or 16M")
    parser.add_argument("--collectives", default="allgather,allreduce,alltoall",
                        help=f"comma-separated examples/*.pln names: {', '.join(COLLECTIVES)}")
    parser.add_argument("--slices", type=argtypes.positive_int_list, default="1,2,4")
    parser.add_argument("--channels", type=argtypes.positive_int, default=64)
    parser.add_argument("--calls", type=argtypes.positive_int, default=20)
    parser.add_argument("--replays", type=argtypes.positive_int, default=10)
    parser.add_argument("--reps", type=argtypes.positive_int, default=5)
    args = parser.parse_args(argv)
    try:
        args.collective_list = argtypes.names(args.collectives, COLLECTIVES, "collectives")
    except ValueError as error:
        parser.error(f"--collectives: {error}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # before the first CUDA call: one line, exit 2, where torch or the GPU is missing
    needs.require("loopback_slices.py", "python benchmarks/loopback_slices.py --out DIR, both ranks on cuda:0",
                  torchrun=False, devices=max(DEVICES) + 1)
    if _IMPORT_ERROR is not None:  # torch is there, so this is something else: show it whole
        raise _IMPORT_ERROR
    group = purlinc.LocalGroup(DEVICES, share_devices=True)
    streams = [torch.cuda.Stream(device=d) for d in DEVICES]
    rng = np.random.default_rng(17)
    rows = []
    try:
        for name in args.collective_list:
            for slices in args.slices:
                try:
                    rows.append(time_point(group, streams, name, args.channels, slices, args.bytes, args, rng))
                except Exception as error:  # one point's failure is recorded, the others still run
                    rows.append({"collective": name, "channels": args.channels, "slices": slices,
                                 "error": f"{type(error).__name__}: {str(error)[:300]}"})
                    if getattr(group[0], "failed", None) is not None:  # the group is out of step: stop
                        break
                print(json.dumps(rows[-1]), flush=True)
    finally:
        group.close()
    done = [row for row in rows if "error" not in row]
    meta = {"label": args.label, "devices": DEVICES, "calls": args.calls, "replays": args.replays, "reps": args.reps,
            "errors": [row for row in rows if "error" in row]}
    write_results(args.out, f"loopback_slices_{args.label}", meta, done, [
        ("collective", "collective"), ("slices", "slices"), ("us per call", "median_us"), ("min-max", "range"),
        ("checked", "checked")])
    print((Path(args.out) / f"loopback_slices_{args.label}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
