#!/usr/bin/env python3
"""Purlin in situ on ONE GPU: a loopback LocalGroup (R ranks on cuda:0, one stream each) runs
each call between a producer kernel that writes its input and a consumer kernel that reads its
output, plain launches, the whole step of every rank in one CUDA graph; rows of the usual
results (bench.py's schema, ``insitu`` and back-to-back ``graph`` views).

    python benchmarks/insitu_loopback.py [--ranks 2] [--sizes 1K,64K,1M] [--out DIR]
        [--collectives allreduce,allgather] [--variants default,zerocopy,graph-staged] [--calls 20]

Variants: ``default`` (a plain load on ordinary tensors: captured calls run on the caller's
buffers where PURLIN_GRAPH_BUFFERS says), ``zerocopy`` (the same load on heap tensors from
``group.empty``), ``graph-staged`` (ordinary tensors, captured with PURLIN_GRAPH_BUFFERS=stage:
the staging every captured call paid before), and any pinned variant of purlin_api.VARIANTS.
Every row's variant carries ``@loopback`` and ``loopback: true``: all ranks share one GPU's SMs
and memory and their "remote" traffic never leaves it, so these times say what staging and the
producer/consumer ordering cost on one GPU, never what NVLink does.  NVTX ranges name each
timed graph (for ``nsys profile -t cuda,nvtx``); ``--profile`` lists, per point, the kernels
one in-situ step runs and their durations (torch.profiler), beside the staging writes of the
Purlin kernel that ran (``staging_writes``: 0 for a registered twin).  Each point is checked after timing: one
replay of the in-situ graph on fresh inputs, every rank against the float32 reference.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (str(HERE), str(HERE.parent)):
    if p not in sys.path:
        sys.path.insert(0, p)

import purlin_api  # noqa: E402
import report  # noqa: E402
from benchlib import argtypes, needs  # noqa: E402
from benchlib.plan import measured_sizes  # noqa: E402

DEVICE = 0
SIZES = "1K,16K,64K,1M,16M"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=argtypes.positive_int, default=2, help="ranks sharing cuda:0")
    ap.add_argument("--collectives", default="allreduce,allgather,reduce_scatter")
    ap.add_argument("--sizes", type=argtypes.byte_size_list, default=SIZES)
    ap.add_argument("--variants", default="default,zerocopy,graph-staged")
    ap.add_argument("--calls", type=argtypes.positive_int, default=20, help="steps per CUDA graph")
    ap.add_argument("--reps", type=argtypes.positive_int, default=5)
    ap.add_argument("--target-rep-us", type=argtypes.positive_float, default=3000.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--results-dir", type=argtypes.output_dir, default=HERE / "results")
    ap.add_argument("--out", type=argtypes.output_dir, default=None, help="also copy the files here")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="list every point's device activities per in-situ step (torch.profiler), in the rows")
    args = ap.parse_args(argv)
    by_name = {v.name: v for v in purlin_api.VARIANTS}
    args.size_list = list(args.sizes)  # bytes, each at least 1 (argtypes.byte_size_list)
    try:
        args.variant_list = [by_name[n] for n in argtypes.flag_names(args.variants, list(by_name), "variants")]
        args.collective_list = argtypes.flag_names(args.collectives, report.COLLECTIVES, "collectives")
    except ValueError as error:
        ap.error(str(error))
    # per collective, the sizes that make a call of their own (one call, one row: two rows with
    # one key would make the results file one the report refuses)
    args.sizes_of = {coll: measured_sizes(args.size_list, coll, args.ranks) for coll in args.collective_list}
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # before the first CUDA call: one line, exit 2, where torch or the GPU is missing
    needs.require("insitu_loopback.py", "python benchmarks/insitu_loopback.py, every rank on cuda:0",
                  torchrun=False, devices=DEVICE + 1)
    import torch

    from benchlib.loopback import Point, run_point

    import purlinc

    group = purlinc.LocalGroup([DEVICE] * args.ranks, share_devices=True)
    streams = [torch.cuda.Stream(device=DEVICE) for _ in range(args.ranks)]
    rows = []
    try:
        for coll in args.collective_list:
            loads: dict = {}
            for size in args.sizes_of[coll]:
                lay = report.layout(coll, args.ranks, size)
                for variant in args.variant_list:
                    if not variant.applies(coll):
                        continue
                    point = Point(lay, variant, args.calls, args.reps, args.target_rep_us, args.seed, args.profile)
                    rows += run_point(group, streams, loads, point)
                    for row in rows[-2:]:
                        how = f" [{row['kernel']}{', registered' if row.get('registered') else ', staged'}" \
                              f", {row.get('staging_writes')} staging writes]" if row.get("kernel") else ""
                        print(f"{coll:>14} {report.fmt_bytes(size):>8} {row['variant']:>24} {row['mode']:>6}: "
                              f"{report._num(row.get('time_us'))} us{how}" + (f" (error: {row['error'][:120]})"
                                                                              if row.get("error") else ""), flush=True)
                    for activity in rows[-1].get("trace", ()):
                        print(f"{'':>16}{activity['per_step']:>6} x {activity['mean_us']:>8.2f} us  "
                              f"{activity['name'][:90]}", flush=True)
                    if getattr(group[0], "failed", None) is not None:
                        raise SystemExit("the group stopped after a timeout: see the error rows")
            for loaded in {id(v): v for v in loads.values()}.values():
                loaded.close()
    finally:
        group.close()
    return _write(args, rows, torch)


def _write(args, rows, torch) -> int:
    now = datetime.datetime.now()
    name = torch.cuda.get_device_name(DEVICE)
    meta = {"date": now.date().isoformat(), "machine": f"{name} loopback x{args.ranks}", "world_size": args.ranks,
            "loopback": True, "dtype": "bfloat16", "torch": torch.__version__,
            "note": f"{args.ranks} ranks on one GPU (loopback LocalGroup): no link speed in any row",
            "args": {k: str(v) for k, v in vars(args).items() if not k.endswith("_list")},
            "purlinc": purlin_api.version()}
    doc = {"meta": meta, "rows": rows}
    stem = f"{meta['date']}-loopback-r{args.ranks}-insitu"
    paths = report.write_all(doc, args.results_dir, stem, plots=not args.no_plots)
    if args.out:
        import shutil

        args.out.mkdir(parents=True, exist_ok=True)
        for p in paths.values():
            shutil.copy(p, args.out / p.name)
    in_situ = [line for calls in report.insitu_counts(report.prepared(doc)["rows"])
               for line in report.insitu_table(report.prepared(doc)["rows"], calls)]
    print("\n".join(in_situ))
    print("wrote: " + ", ".join(str(p) for p in paths.values()))
    failed = [r for r in rows if r.get("checked") is False]
    for r in failed:
        print(f"CHECK FAILED: {r['variant']} {r['collective']} {report.fmt_bytes(r['bytes'])} {r['mode']}: "
              f"{r.get('check_note')}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
