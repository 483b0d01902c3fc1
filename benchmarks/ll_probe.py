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
  floor     the kernel body replaced by the counter update alone: launch cost in a graph
  empty     the kernel body removed: launch cost without the counter
Threads per block: ``--threads`` (the code generator's THREADS_PACKED).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from pathlib import Path

os.environ["PURLIN_NO_CACHE"] = "1"  # each probe is its own source: nothing may be reused
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import purlinc  # noqa: E402
from purlinc.atom import abi as abi_module  # noqa: E402
from purlinc.atom import codegen, nvrtc  # noqa: E402
from purlinc.dtypes import DType  # noqa: E402
from _common import expected, inputs_for, poison, to_numpy, to_torch  # noqa: E402

EXAMPLES = ROOT / "examples"
ENTRY = re.compile(r"(purlin_\w+_r\d+\(const purlin_args args\)\n\{\n)")
BODY = re.compile(r"(purlin_\w+_r\d+\(const purlin_args args\)\n\{\n)(.*?)(\n\}\n)", re.S)


def probe_base(source: str, call: dict) -> str:
    return source


def probe_geom(source: str, call: dict) -> str:
    for name, value in zip(abi_module.HEADER_FIELDS, call["geometry"]):
        source = re.sub(rf"\bargs\.{name}\b", f"((purlin_u64){value}ull)", source)
    return source


def probe_prefetch(source: str, call: dict) -> str:
    line = ('    asm volatile("prefetch.global.L1 [%0];" :: "l"(args.in + 8 * threadIdx.x));\n')
    return ENTRY.sub(lambda m: m.group(1) + line, source)


def probe_floor(source: str, call: dict) -> str:
    body = "    if (threadIdx.x == 0) args.counters[blockIdx.x] += 1;"
    return BODY.sub(lambda m: m.group(1) + body + m.group(3), source)


def probe_empty(source: str, call: dict) -> str:
    return BODY.sub(lambda m: m.group(1) + m.group(3), source)


PROBES = {"base": probe_base, "geom": probe_geom, "prefetch": probe_prefetch, "floor": probe_floor,
          "empty": probe_empty}
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


def capture(coll, xs, outs, devices, calls):
    graphs = []
    for r in devices:
        with torch.cuda.device(r):
            stream = torch.cuda.Stream(device=r)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(calls):
                    coll[r](xs[r], outs[r])
            graphs.append(graph)
    for g in graphs:
        g.replay()
    for r in devices:
        torch.cuda.synchronize(r)
    return graphs


def replay_us(graphs, devices, calls) -> float:
    events = []
    for r, graph in zip(devices, graphs):
        with torch.cuda.device(r):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            events.append((start, end))
    for r in devices:
        torch.cuda.synchronize(r)
    return max(s.elapsed_time(e) for s, e in events) * 1e3 / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--collectives", default="allreduce,allgather,reduce_scatter")
    ap.add_argument("--bytes", default="1024,16384")
    ap.add_argument("--channels", default="1")
    ap.add_argument("--threads", default=str(codegen.THREADS_PACKED))
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
                            codegen.THREADS_PACKED = threads
                            # The call's geometry, as the runtime packs it, for probes that bake
                            # it in: from a first call of the shipped kernel.
                            if probe != "base" and "geometry" not in _seen:
                                raise SystemExit("list 'base' first: other probes need its call's geometry")
                            _active["edit"], _active["call"] = PROBES[probe], dict(_seen)
                            coll = purlinc.load(EXAMPLES / f"{name}.pln", group, algorithm="direct-push",
                                                packed=True, channels=channels)
                            opened.append(coll)
                            spec = coll[0].compiled.spec
                            units = max(max(len(spec.inputs[r]), len(spec.outputs[r])) for r in range(spec.world_size))
                            count = max(1, nbytes // (units * dtype.itemsize))
                            inputs = inputs_for(spec, count, dtype, rng)
                            xs = [to_torch(inputs[r], dtype, r) if len(spec.inputs[r]) else None for r in devices]
                            outs = [torch.empty(len(spec.outputs[r]) * count, dtype=torch.bfloat16, device=f"cuda:{r}")
                                    if len(spec.outputs[r]) else None for r in devices]
                            for o in outs:
                                if o is not None:
                                    poison(o)
                            coll(xs, outs)
                            for r in devices:
                                torch.cuda.synchronize(r)
                            want = expected(spec, inputs, count, dtype, "sum" if spec.is_reduce else None)
                            ok = None if probe in ("floor", "empty") else all(
                                o is None or np.array_equal(to_numpy(o, dtype).view(np.uint16), w.view(np.uint16))
                                for o, w in zip(outs, want))
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
                           "probe": probe, "median_us": round(statistics.median(times), 3),
                           "min_us": round(min(times), 3), "max_us": round(max(times), 3), "checked": ok}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"gpus": [torch.cuda.get_device_name(r) for r in devices], "calls_per_graph": args.calls,
            "reps": args.reps, "dtype": dtype.value}
    (out / "ll_probe.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    lines = ["| collective | bytes | channels | threads | probe | median us | range us | checked |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['collective']} | {r['bytes']} | {r['channels']} | {r['threads']} | {r['probe']} | "
              f"{r['median_us']} | {r['min_us']}-{r['max_us']} | {r['checked']} |" for r in rows]
    (out / "ll_probe.md").write_text("\n".join(lines) + "\n")
    return 0 if all(r["checked"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
