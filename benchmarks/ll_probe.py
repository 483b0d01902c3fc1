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
  minimal   (all-reduce and all-gather, 2 ranks, 1 channel, one round) the body replaced by a
            hand-written LL exchange: every thread loads its 8 bytes, stores one packet to the
            peer, spins on its own packet, reduces or copies, one barrier, the counter; the
            same packets, flags and staging copies as the generated kernel, no timeout path
  fast      the shipped kernel with the packet gather/scatter cut to their aligned 8-byte case
            (only valid for aligned buffers of whole packets, which the probe's sizes are):
            what the byte-wise fallback's branches and code cost on the hot path
  minimal_poll   minimal, waiting through the shipped first look and bounded poll
                 (purlin_ll_arrive: the clock, the error record) instead of a bare spin
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
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import purlinc  # noqa: E402
from purlinc.atom import abi as abi_module  # noqa: E402
from purlinc.atom import codegen, nvrtc  # noqa: E402
from purlinc.dtypes import DType  # noqa: E402
from _graph_timing import capture, checked_call, replay_us  # noqa: E402

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


_GATHER_FN = re.compile(r"(__device__ __forceinline__ uint2 purlin_ll_gather\(const char\* src, unsigned n\)\n\{\n)(.*?)(\n\}\n)", re.S)
_SCATTER_FN = re.compile(r"(__device__ __forceinline__ void purlin_ll_scatter\(char\* dst, const uint2 d, unsigned n\)\n\{\n)(.*?)(\n\}\n)", re.S)


def probe_fast(source: str, call: dict) -> str:
    if call.get("geometry") and call["geometry"][1] % 8:
        return None
    source = _GATHER_FN.sub(lambda m: m.group(1) + "    return *(const uint2*)src;" + m.group(3), source)
    return _SCATTER_FN.sub(lambda m: m.group(1) + "    *(uint2*)dst = d;" + m.group(3), source)


def probe_empty(source: str, call: dict) -> str:
    return BODY.sub(lambda m: m.group(1) + m.group(3), source)


_MINIMAL = """
    // probe: a hand-written LL {kind} for 2 ranks, one channel, one round
    const unsigned t = threadIdx.x;
    const unsigned nbytes = (unsigned)({in_units} * args.io_unit);  // this rank's input, every chunk
    const purlin_u64 epoch = args.counters[0];
    uint2 d[2];
    for (unsigned u = 0; u < 2; ++u) {{
        const unsigned i = t + u * PURLIN_THREADS;
        d[u] = 8 * i < nbytes ? *(const uint2*)(args.in + 8 * i) : make_uint2(0u, 0u);
    }}
    const unsigned flag = (unsigned)(epoch * 2 + 2);
    char* const peer = args.stage[{peer}] + (epoch & 1) * args.copy_bytes;
    const char* const mine = args.stage[{rank}] + (epoch & 1) * args.copy_bytes;
    for (unsigned u = 0; u < 2; ++u) {{
        const unsigned i = t + u * PURLIN_THREADS;
        if (8 * i < nbytes) purlin_ll_store(peer + 16 * i, d[u], flag);
    }}
    int failed = 0;
    for (unsigned u = 0; u < 2 && !failed; ++u) {{
        const unsigned i = t + u * PURLIN_THREADS;
        if (8 * i >= nbytes) break;
        uint2 theirs;
{wait}
{finish}
    }}
    if (__syncthreads_or(failed)) return;
    if (t == 0) args.counters[0] = epoch + 1;"""
_SPIN = """        uint4 v;
        unsigned spins = 0;
        do {{ v = purlin_ll_load(mine + 16 * i); }} while (!purlin_ll_ready(v, flag) && ++spins < (1u << 24));
        failed = !purlin_ll_ready(v, flag);
        theirs = make_uint2(v.x, v.z);"""
_ARRIVE = """        const purlin_ll_site site = {{args.timeout_ns, args.error, {rank}}};
        const uint4 q = purlin_ll_load(mine + 16 * i);
        failed = purlin_ll_arrive(q, mine, i, (purlin_i64)epoch * 2 + 2, theirs, site, 0, 0);"""
_REDUCE = """        purlin_ll_word a, b, r;
        a.raw = {first};
        b.raw = {second};
        for (unsigned e = 0; e < 8 / sizeof(purlin_elem); ++e)
            r.e[e] = purlin_from_acc(purlin_combine(purlin_to_acc(a.e[e]), purlin_to_acc(b.e[e])));
        *(uint2*)(args.out + 8 * i) = r.raw;"""
_GATHER = """        *(uint2*)(args.out + {rank} * args.io_unit + 8 * i) = d[u];
        *(uint2*)(args.out + {peer} * args.io_unit + 8 * i) = theirs;"""


def _minimal(source: str, call: dict, wait: str):
    """The minimal exchange for the collective ``call`` names, or None where it has none."""
    kind = call.get("collective")
    if kind not in ("allreduce", "allgather") or call.get("world") != 2 or call.get("channels") != 1 \
            or call["geometry"][0] != 1 or call["geometry"][1] % 8:
        return None
    in_units = 2 if kind == "allreduce" else 1
    if in_units * call["geometry"][1] > 2 * 8 * codegen.THREADS_PACKED:  # two packets per thread
        return None

    def body(m):
        rank = int(re.search(r"_r(\d+)\(", m.group(1)).group(1))
        peer = 1 - rank
        if kind == "allreduce":  # rank 0's data first, as the spec sums (bitwise the reference)
            first, second = ("d[u]", "theirs") if rank == 0 else ("theirs", "d[u]")
            finish = _REDUCE.format(first=first, second=second)
        else:
            finish = _GATHER.format(rank=rank, peer=peer)
        text = _MINIMAL.format(kind=kind, in_units=in_units, rank=rank, peer=peer,
                               wait=wait.format(rank=rank), finish=finish)
        return m.group(1) + text + m.group(3)

    return BODY.sub(body, source)


def probe_minimal(source: str, call: dict):
    return _minimal(source, call, _SPIN)


def probe_minimal_poll(source: str, call: dict):
    return _minimal(source, call, _ARRIVE)


PROBES = {"base": probe_base, "geom": probe_geom, "prefetch": probe_prefetch, "floor": probe_floor,
          "empty": probe_empty, "fast": probe_fast, "minimal": probe_minimal, "minimal_poll": probe_minimal_poll}
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
