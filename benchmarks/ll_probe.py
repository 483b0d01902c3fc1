"""Where a small packed (LL) call's time goes: the shipped kernel against edited copies of it.

    python3 benchmarks/ll_probe.py --out DIR [--probes base,geom,prefetch,floor]

A diagnostic, not a benchmark of record.  For each collective, size and channel count it
loads the packed direct-push schedule once per probe; a probe is an edit of the generated
CUDA source applied just before NVRTC compiles it (so the runtime, the ABI and the
buffers are the shipped ones).  Every probe but ``floor`` and ``empty`` is checked against
the reference on fresh random data (poisoned outputs, every rank) before it is timed.  All probes of a
case are captured in CUDA graphs of ``--calls`` calls and replayed in turn, ``--reps``
rounds, so drift of the machine hits them alike; the slowest device's median per call is
reported with the range.

Probes:
  base      the generated kernel as shipped
  geom      the call's round geometry (purlin_args' header) as compile-time constants: what
            specializing a kernel for one call shape could still save
  prefetch  base, plus an L1 prefetch of this thread's first input words at kernel entry, ahead
            of the call counter's load
  floor     the kernel body replaced by the launch-order wait and the counter update alone:
            launch cost in a graph
  empty     the kernel body removed: launch cost without the counter
  minimal   (all-reduce and all-gather, 2 ranks, 1 channel, one round) the body replaced by a
            hand-written LL exchange: every thread loads its 8 bytes, stores one packet to the
            peer, spins on its own packet, reduces or copies, one barrier, the counter; the
            same packets, flags and staging copies as the generated kernel, no timeout path
  fast      the shipped kernel with the packet gather/scatter cut to their aligned 8-byte case
            (only valid for aligned buffers of whole packets, which the probe's sizes are):
            what the byte-wise fallback's branches and code cost on the hot path
  minimal_poll   minimal, waiting through the shipped bounded wait (purlin_ll_wait: the
                 clock, the error record) instead of a bare spin
Threads per block: ``--threads`` (the code generator's THREADS_PACKED).  The edits live in
benchmarks/ll_edits.py (checked against the current generated source by tests/test_ll_edits.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ["PURLIN_NO_CACHE"] = "1"  # each probe is its own source: nothing may be reused
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import purlinc  # noqa: E402
from purlinc.atom import abi as abi_module  # noqa: E402
from purlinc.atom import nvrtc  # noqa: E402
from purlinc.atom.codegen import limits  # noqa: E402
from purlinc.dtypes import DType  # noqa: E402
from _graph_timing import capture, checked_call, replay_us, spread, write_results  # noqa: E402
from ll_edits import PROBES  # noqa: E402

EXAMPLES = ROOT / "examples"
_active: dict = {"edit": None, "call": None}
_compile = nvrtc.compile_cubin


def _edited_compile(source, filename, arch, options=()):
    if _active["edit"] is not None:
        source = _active["edit"](source, _active["call"])
    return _compile(source, filename, arch, options)


nvrtc.compile_cubin = _edited_compile
_pack = abi_module.KernelABI.pack_args
_seen: dict = {}


def _recording_pack(self, **kw):
    _seen["geometry"] = self.geometry(kw["count"], kw["piece"])
    return _pack(self, **kw)


abi_module.KernelABI.pack_args = _recording_pack


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--collectives", default="allreduce,allgather,reduce_scatter")
    ap.add_argument("--bytes", default="1024,16384")
    ap.add_argument("--channels", default="1")
    ap.add_argument("--threads", default=str(limits.THREADS_PACKED))
    ap.add_argument("--probes", default="base,geom,prefetch,floor")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    devices = list(range(torch.cuda.device_count()))
    group = purlinc.LocalGroup(devices)
    rng = np.random.default_rng(5)
    dtype = DType.BFLOAT16
    rows = []
    for name in args.collectives.split(","):
        for nbytes in map(int, args.bytes.split(",")):
            for channels in map(int, args.channels.split(",")):
                variants, opened = [], []
                try:
                    for threads in map(int, args.threads.split(",")):
                        for probe in args.probes.split(","):
                            limits.THREADS_PACKED = threads
                            # The call's geometry, as the runtime packs it, for probes that bake
                            # it in: from a first call of the shipped kernel.
                            if probe != "base" and "geometry" not in _seen:
                                raise SystemExit("list 'base' first: other probes need its call's geometry")
                            call = {**_seen, "collective": name, "world": len(devices), "channels": channels}
                            if PROBES[probe]("", call) is None:
                                continue  # this probe has no form for this collective or size
                            _active["edit"], _active["call"] = PROBES[probe], call
                            coll = purlinc.load(EXAMPLES / f"{name}.pln", group, algorithm="direct-push",
                                                packed=True, channels=channels)
                            opened.append(coll)
                            xs, outs, ok = checked_call(coll, nbytes, dtype, rng, devices)
                            if probe in ("floor", "empty"):
                                ok = None  # no exchange left to check
                            graphs = capture(coll, xs, outs, devices, args.calls)
                            variants.append((probe, threads, ok, graphs, []))
                    _active["edit"] = None
                    for _ in range(args.reps):
                        for probe, threads, ok, graphs, times in variants:
                            times.append(replay_us(graphs, devices, args.calls))
                finally:
                    _active["edit"] = None
                    _seen.clear()
                    for coll in opened:
                        coll.close()
                for probe, threads, ok, graphs, times in variants:
                    row = {"collective": name, "bytes": nbytes, "channels": channels, "threads": threads,
                           "probe": probe, **spread(times), "checked": ok}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    meta = {"gpus": [torch.cuda.get_device_name(r) for r in devices], "calls_per_graph": args.calls,
            "reps": args.reps, "dtype": dtype.value}
    write_results(args.out, "ll_probe", meta, rows, [
        ("collective", "collective"), ("bytes", "bytes"), ("channels", "channels"), ("threads", "threads"),
        ("probe", "probe"), ("median us", "median_us"), ("range us", "range"), ("checked", "checked")])
    return 0 if all(r["checked"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
