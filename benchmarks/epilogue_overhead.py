"""What the fused epilogue (residual add + RMSNorm) adds over the plain all-reduce, on ONE GPU:
a loopback group (R ranks on cuda:0, one stream each) replays per-rank CUDA graphs of the
fused collective (examples/fused/allreduce_add_rmsnorm.pln) and of the same all-reduce
without an epilogue, with the same schedule (algorithm, LL, channels), at [rows x 4096] bf16.

    python3 benchmarks/epilogue_overhead.py [--out DIR] [--ranks 2 4 8] [--rows 16] [--label run]

The ranks share the GPU and their "remote" stores never leave it, so the numbers are local
work only: what the epilogue costs inside the kernel, not what NVLink does.  Each point: the
fused output checked against torch (all-reduce in float32 rounded to bf16, then the add and
RMSNorm in float32, rounded) before the timing; then ``--reps`` timed repeats of ``--replays``
replays of every rank's graph of ``--calls`` calls (device time by events, the slower rank's),
the plain and the fused graphs in alternation, median, min and max per call.  Captured calls
run the staged schedule the row names (PURLIN_GRAPH_BUFFERS=stage unless set).  Writes
DIR/epilogue_overhead_<label>.json and .md (DIR: --out, else $OUT, else the current
directory); ``added_us`` is the median of fused minus plain, repeat by repeat, and
``added_range_us`` their range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # benchlib
sys.path.insert(0, str(ROOT / "tests" / "gpu"))  # _common: the GPU tests' helpers (via _graph_timing)

# Captured calls on ordinary buffers would otherwise run each collective's registered twin
# (runtime graph buffers): stage them, so both sides time the schedule the row names.
os.environ.setdefault("PURLIN_GRAPH_BUFFERS", "stage")

from benchlib import argtypes, needs  # noqa: E402  (no torch: the arguments are checked without it)

try:  # the measuring half; main() says in one line what is missing (torch, a GPU) before using it
    import torch  # noqa: E402

    import purlinc  # noqa: E402
    from _graph_timing import capture, issue, replay_us, spread, write_results  # noqa: E402
except ImportError as error:
    _IMPORT_ERROR: ImportError | None = error
else:
    _IMPORT_ERROR = None

FUSED = ROOT / "examples" / "fused" / "allreduce_add_rmsnorm.pln"
PLAIN = "collective allreduce_one_chunk { in[r] = x  out[r] = x  reduce }"  # the same, without the epilogue
HIDDEN = 4096
# LL on one and on 8 blocks, the fused direct-push pass on 8 and 16, two-shot: what the tuned
# model picks by rows (tuning.epilogue_model), within what 8 loopback ranks can hold at once
SCHEDULES = (("direct-push", True, 1), ("direct-push", True, 8), ("direct-push", False, 8),
             ("direct-push", False, 16), ("two-shot", False, 8))


def _schedule(text: str) -> tuple:
    """--schedules item: ALGORITHM[-ll]:CHANNELS, e.g. direct-push-ll:8 or two-shot:8."""
    name, _, channels = text.partition(":")
    packed = name.endswith("-ll")
    return (name[:-3] if packed else name, packed, argtypes.positive_int(channels or "1"))


# --parts: the fused epilogue taken apart, each part its own spec timed like the whole (what
# each costs over the plain all-reduce): the fused pass itself (a scale), the residual read, its
# store, the norm's row reduction.
_PART = "collective {name}(hidden = 4096) with {operands} {{ in[r] = x  out[r] = x  reduce  epilogue rows(hidden) {{ {body} }} }}"
PARTS = (
    ("scale", _PART.format(name="ar_scale", operands="scalar s", body="out = out * s"), ("s",)),
    ("add", _PART.format(name="ar_add", operands="rows residual", body="out = out + residual"), ("residual",)),
    ("add_store", _PART.format(name="ar_add_store", operands="rows residual",
                               body="h = out + residual  residual = h  out = h"), ("residual",)),
    ("norm", _PART.format(name="ar_norm", operands="row weight, scalar eps", body="out = rmsnorm(out, weight, eps)"),
     ("weight", "eps")),
)


class _Bound:
    """A group collective with its operands bound, as _graph_timing calls one: ``b(xs, outs,
    streams=...)`` and ``b[r](x, out)``."""

    def __init__(self, coll, operands: dict):
        self.coll, self.operands = coll, operands

    def __call__(self, xs, outs, streams=None):
        return self.coll(xs, outs, streams=streams, **self.operands)

    def __getitem__(self, rank: int):
        mine = {k: (v[rank] if isinstance(v, list) else v) for k, v in self.operands.items()}
        return lambda x, out: self.coll[rank](x, out, **mine)


def _reference(xs, residual, weight, eps=1e-6):
    h = (torch.stack([x.float() for x in xs]).sum(0).to(torch.bfloat16).float() + residual.float()).view(-1, HIDDEN)
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(torch.bfloat16).view(-1)


def _group_call(bound, xs, outs, streams) -> None:
    """One call of every rank, each on its stream, ordered after and before the current one."""
    issue(lambda: bound(xs, outs, streams=streams), [0] * len(streams), streams)


def _graphs(bound, xs, outs, devices, streams, args) -> list:
    _group_call(bound, xs, outs, streams)  # loads the kernel: a capture cannot
    return capture(bound, xs, outs, devices, args.calls, streams)


def _paired(plain, other, xs, outs, devices, streams, args) -> tuple[dict, dict, dict]:
    """The plain all-reduce and ``other`` (fused, or a part), each captured once and then timed
    in alternation, repeat by repeat: the spread of each, and of ``other - plain`` per repeat
    (so that the machine drifting between repeats, as it does by tenths of a microsecond, falls
    out of the difference rather than into it)."""
    graphs = [_graphs(b, xs, outs, devices, streams, args) for b in (plain, other)]
    times: tuple[list, list] = ([], [])
    for _ in range(args.reps):
        for g, series in zip(graphs, times):
            series.append(replay_us(g, devices, args.calls, streams, args.replays))
    return spread(times[0]), spread(times[1]), spread([b - a for a, b in zip(*times)])


def _cycles(source, operands: dict, group, opts: dict, xs, outs, streams, calls: int) -> dict:
    """Device cycles (clock64 stamps of a traced build, every rank and channel, ``calls`` calls):
    the median of the last block with steps (the reduce, or the reduce fused with the epilogue:
    local work after the wait; an LL build's receive loop, which waits too) and of the whole
    round, in cycles."""
    from purlinc.runtime.trace import read_stamps

    bound = _Bound(purlinc.load(source, group, trace=True, **opts), operands)
    last, whole = [], []
    try:
        for _ in range(calls + 1):
            _group_call(bound, xs, outs, streams)
            for rank in range(len(xs)):
                for channel in read_stamps(bound.coll[rank])["channels"]:
                    row = channel["stamps"][0]  # (globaltimer, clock64) after each block of round 0
                    b = max(i for i, steps in enumerate(channel["blocks"]) if steps)  # the last with steps
                    last.append(row[b + 1][1] - row[b][1])
                    whole.append(row[-1][1] - row[0][1])
        bound.coll.check()
    finally:
        bound.coll.close()
    skip = len(last) // (calls + 1)  # the first call's stamps: loading, cold caches
    return {"last_block": statistics.median(last[skip:]), "round": statistics.median(whole[skip:])}


def point(world: int, rows: int, schedule: tuple, args) -> dict:
    algorithm, packed, channels = schedule
    devices = [0] * world
    group = purlinc.LocalGroup(devices, share_devices=True)
    streams = [torch.cuda.Stream(device=0) for _ in devices]
    try:
        opts = dict(algorithm=algorithm, packed=packed, channels=channels, slices=1)
        n = rows * HIDDEN
        xs = [torch.randn(n, device="cuda:0").to(torch.bfloat16) for _ in devices]
        outs = [torch.empty(n, device="cuda:0", dtype=torch.bfloat16) for _ in devices]
        res = [torch.randn(n, device="cuda:0").to(torch.bfloat16) for _ in devices]
        weight = [(1 + 0.1 * torch.randn(HIDDEN, device="cuda:0")).to(torch.bfloat16) for _ in devices]
        fused = _Bound(purlinc.load(FUSED, group, **opts), {"residual": res, "weight": weight, "eps": 1e-6})
        plain = _Bound(purlinc.load(PLAIN, group, **opts), {})
        before = [r.clone() for r in res]
        _group_call(fused, xs, outs, streams)
        for r in range(world):  # checked before it is timed
            torch.testing.assert_close(outs[r].float(), _reference(xs, before[r], weight[r]).float(),
                                       rtol=2**-6, atol=2**-5)
        row = {"ranks": world, "rows": rows, "hidden": HIDDEN, "dtype": "bfloat16", "algorithm": algorithm,
               "packed": packed, "channels": channels, "checked": True}
        # the residual grows by one all-reduce per call while timed: nothing reads it afterwards
        row["plain"], row["fused"], row["added"] = _paired(plain, fused, xs, outs, devices, streams, args)
        row["plain_us"], row["fused_us"] = row["plain"]["median_us"], row["fused"]["median_us"]
        row["added_us"] = row["added"]["median_us"]
        row["added_range_us"] = f"{row['added']['min_us']}..{row['added']['max_us']}"
        operands = {"residual": res, "weight": weight, "eps": 1e-6, "s": 1.0}
        for label, source, names in PARTS if args.parts else ():
            part = _Bound(purlinc.load(source, group, **opts), {n: operands[n] for n in names})
            row[f"{label}_added_us"] = _paired(plain, part, xs, outs, devices, streams, args)[2]["median_us"]
            part.coll.check()
        fused.coll.check()
        if args.cycles:
            variants = [("plain", PLAIN, {}), ("fused", FUSED, fused.operands)]
            variants += [(label, source, {n: operands[n] for n in names}) for label, source, names in PARTS]
            for label, source, bound_operands in variants:
                cycles = _cycles(source, bound_operands, group, opts, xs, outs, streams, args.cycles)
                row[f"{label}_block_cycles"], row[f"{label}_round_cycles"] = cycles["last_block"], cycles["round"]
        return row
    finally:
        group.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=argtypes.output_dir, default=os.environ.get("OUT", "."))
    parser.add_argument("--label", type=argtypes.file_tag, default="run")
    parser.add_argument("--ranks", type=argtypes.positive_int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rows", type=argtypes.positive_int, nargs="+", default=[16])
    parser.add_argument("--calls", type=argtypes.positive_int, default=20)
    parser.add_argument("--replays", type=argtypes.positive_int, default=10)
    parser.add_argument("--reps", type=argtypes.positive_int, default=5)
    parser.add_argument("--schedules", type=_schedule, nargs="+", default=list(SCHEDULES),
                        help="ALGORITHM[-ll]:CHANNELS each (default: LL c1 and c8, direct-push c8 and c16, two-shot c8)")
    parser.add_argument("--parts", action="store_true", help="also time the epilogue's parts (PARTS), each alone")
    parser.add_argument("--cycles", type=argtypes.nonnegative_int, default=0, metavar="CALLS",
                        help="also trace CALLS calls of each variant (traced builds) and report the device cycles of "
                             "the reduce block (with the epilogue, when fused) and of the whole round, medians")
    args = parser.parse_args(argv)
    # before the first CUDA call (not after every point, losing the rows): one line, exit 2
    needs.require("epilogue_overhead.py", "python benchmarks/epilogue_overhead.py, every rank on cuda:0",
                  torchrun=False)
    if _IMPORT_ERROR is not None:  # torch is there, so this is something else: show it whole
        raise _IMPORT_ERROR
    rows, errors = [], []
    for world in args.ranks:
        for n in args.rows:
            for schedule in args.schedules:
                try:
                    rows.append(point(world, n, schedule, args))
                    print(json.dumps(rows[-1]), flush=True)
                except Exception as error:  # one point's failure is recorded, the others still run
                    errors.append({"ranks": world, "rows": n, "schedule": schedule,
                                   "error": f"{type(error).__name__}: {str(error)[:300]}"})
                    print(json.dumps(errors[-1]), flush=True)
    meta = {"label": args.label, "mode": "loopback, one GPU (local work only)", "calls": args.calls,
            "graph_buffers": os.environ["PURLIN_GRAPH_BUFFERS"],
            "replays": args.replays, "reps": args.reps, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0), "errors": errors}
    stem = f"epilogue_overhead_{args.label}"
    write_results(args.out, stem, meta, rows, [
        ("R", "ranks"), ("rows", "rows"), ("algorithm", "algorithm"), ("LL", "packed"), ("channels", "channels"),
        ("plain us", "plain_us"), ("fused us", "fused_us"), ("added us", "added_us"),
        ("added range", "added_range_us"), ("checked", "checked"),
        *([(f"{label} adds us", f"{label}_added_us") for label, _, _ in PARTS] if args.parts else []),
        *([(f"{label} block cyc", f"{label}_block_cycles") for label in ("plain", "fused", *(p[0] for p in PARTS))]
          if args.cycles else [])])
    print((Path(args.out) / f"{stem}.md").read_text())
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
