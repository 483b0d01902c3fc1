"""Edits of a generated LL module's CUDA source, for benchmarks/ll_probe.py (see its
docstring for what each probe measures).  Torch-free, so tests/test_ll_edits.py can check on
any machine that every edit still finds what it edits in the current generated source and
compiles.

Each probe is ``probe(source, call) -> str | None``: the edited source, or None where the
probe has no form for that collective or call (``call``: ``geometry`` = the header's round
geometry (``KernelABI.geometry``), ``collective``, ``world``, ``channels``).
"""

from __future__ import annotations

import re

from purlinc.atom import abi as abi_module
from purlinc.atom.codegen import limits

# A rank's program is one template function, instantiated by its wide and lean entries
# (body.cu.j2): an edit of that body applies to both.
ENTRY = re.compile(r"(purlin_\w+_b\d+_body\(const purlin_args& args\)\n\{\n)")
BODY = re.compile(r"(purlin_\w+_b\d+_body\(const purlin_args& args\)\n\{\n)(.*?)(\n\}\n)", re.S)


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
    # The launch-order wait stays (prelude.cuh): under PDL the counter's read-modify-write must
    # not overlap the previous call's.
    body = "    purlin_launch_order();\n    if (threadIdx.x == 0) args.counters[blockIdx.x] += 1;"
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
    purlin_launch_order();  // as every generated body (PDL: wait for the previous call)
    const unsigned me = (unsigned)args.rank, other = 1 - me;  // one body serves both ranks
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
        const purlin_ll_batch<Geo, 1, 1> batch = {{ {{nullptr}}, {{nbytes}}, {{ {{mine}} }}, {{ {{(purlin_i64)epoch * 2 + 2}} }}, {{ {{0u}} }}, {{ {{0u}} }} }};
        uint4 q[1][1][1];
        q[0][0][0] = purlin_ll_load(mine + 16 * i);
        failed = !purlin_ll_ready(q[0][0][0], flag) && purlin_ll_wait<Geo, 1, 1, 1>(q, batch, i, 1u, site);
        theirs = make_uint2(q[0][0][0].x, q[0][0][0].z);"""
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
    if in_units * call["geometry"][1] > 2 * 8 * limits.THREADS_PACKED:  # two packets per thread
        return None

    def body(m):
        rank, peer = "me", "other"  # the body's own variables (_MINIMAL)
        if kind == "allreduce":  # rank 0's data first, as the spec sums (bitwise the reference)
            finish = _REDUCE.format(first="(me == 0 ? d[u] : theirs)", second="(me == 0 ? theirs : d[u])")
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
