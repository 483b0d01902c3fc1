"""Benchmark bookkeeping that needs no GPU and no torch: sizes, buffer layouts, bandwidth
conventions, and turning a results JSON into Markdown, plots and a tuning table.

``bench.py`` measures and writes ``{"meta": {...}, "rows": [...]}``; everything here reads
that document, so a report can be rebuilt (or several split runs merged) on any machine:

    python benchmarks/report.py benchmarks/results/2026-11-30-h200x2.json [more.json ...]

Row fields (one row per system, variant, collective, size, mode and calls per graph):
    system, variant, collective, dtype, bytes, count, world_size, mode ("eager" | "graph"),
    calls_per_graph (graph rows: calls captured in one graph, the same for every system;
    eager rows: None), time_us (max over ranks of each rank's median), time_us_min /
    time_us_max (spread of the repeats on the slowest rank), iters, reps, replays (graph rows:
    back-to-back replays of the graph per timed repeat, bench.graph_replays), algbw_gbps,
    busbw_gbps, limit_us and pct_of_limit (the wire model below), sms, sms_note,
    checked (True | False | None = not checkable), check_note, error (None or text),
    options (Purlin variant options), repeat_safe, nccl_env (NCCL rows: the settings used).

``purlin/hierarchical`` rows (variant ``g<G>``, options ``gpus_per_node`` and ``nodes``): the
collective loaded with ``purlinc.load(path, None, gpus_per_node=G)``, the world as R/G nodes of G
ranks.  They are a system of their own: never a "best Purlin variant", never in the tuning
table or the targets; the report gives them one table per view beside NCCL.

NCCL variants: ``default`` (NCCL as the caller's environment sets it up), ``nomix``
(``NCCL_GRAPH_MIXING_SUPPORT=0``), ``symm`` (mixing off, buffers registered as NCCL symmetric
windows: NCCL's symmetric kernels where it has them).  Speed-ups are quoted against the
*best* NCCL row of each size and mode (``best_nccl``), which the tables name.

The wire model (``limit_us``): launch of a kernel inside a CUDA graph (0.56 us) + one NVLink
signal (1.26 us) + the bytes one rank must move over its busiest link direction
(``busbw_factor * bytes``, nccl-tests' bus bytes) at 365 GB/s when every rank sends at once
(all-reduce, all-gather, reduce-scatter, all-to-all) or 396 GB/s when one direction carries it
(broadcast, reduce, gather, scatter); all measured on 2 x H200 (DESIGN.md, section 5b).  It is
a floor for graph replays; eager rows carry the same figure (their launch costs more).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

COLLECTIVES = (
    "allreduce", "allgather", "reduce_scatter", "alltoall",
    "broadcast", "reduce", "gather", "scatter",
)
REDUCE_COLLECTIVES = frozenset({"allreduce", "reduce_scatter", "reduce"})
ROOTED = frozenset({"broadcast", "reduce", "gather", "scatter"})
# The collectives whose large-message target asks for >= 1.1x NCCL and >= 90 % of peak.
BANDWIDTH_BOUND = ("allgather", "reduce_scatter", "alltoall")
MODES = ("eager", "graph")
HIER = "purlin/hierarchical"  # Purlin inside nodes of G ranks, NCCL between them; variants g<G>
SYSTEMS = ("nccl", "symm_mem", "purlin", HIER)

# Alignment: every chunk a multiple of 16 bytes (the ldst atom moves 16-byte vectors).
ALIGN_BYTES = 16


# --------------------------------------------------------------------------- sizes


def quick_sizes() -> list[int]:
    return [1 * KiB, 16 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 256 * MiB]


def full_sizes() -> list[int]:
    """1 KiB .. 1 GiB by powers of 4, plus the powers of 2 between 1 and 16 MiB."""
    sizes = {KiB * 4**k for k in range(11)}  # 1 KiB .. 1 GiB
    sizes |= {2 * MiB, 8 * MiB}
    return sorted(sizes)


def select_sizes(*, quick: bool, min_bytes: int = 0, max_bytes: int | None = None,
                 explicit: list[int] | None = None) -> list[int]:
    sizes = explicit if explicit else (quick_sizes() if quick else full_sizes())
    return sorted(s for s in set(sizes) if s >= min_bytes and (max_bytes is None or s <= max_bytes))


def parse_bytes(text: str) -> int:
    """'64K', '1MiB', '1G', '4096' -> bytes (binary units)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": KiB, "M": MiB, "G": GiB}.get(t[-1:], 1)
    number = t[:-1] if scale != 1 else t
    return int(float(number) * scale)


def parse_cpu_list(text: str) -> list[int]:
    """A kernel CPU list ('0-3,8,10-11', as sysfs writes it) -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# --------------------------------------------------------------------------- layouts


@dataclass(frozen=True, slots=True)
class Layout:
    """Element counts of one call, as Purlin's .pln specs and NCCL both see them."""

    collective: str
    world_size: int
    count: int  # elements per chunk (the .pln ``count``)
    in_elems: int  # one rank's input (the root's, for rooted collectives)
    out_elems: int  # one rank's output (the root's, for gather)
    itemsize: int

    @property
    def bytes(self) -> int:
        """nccl-tests' size: the larger of one rank's input and output."""
        return max(self.in_elems, self.out_elems) * self.itemsize


def layout(collective: str, world_size: int, nbytes: int, itemsize: int = 2) -> Layout:
    """Map the benchmark's ``bytes`` to the chunk count, rounding down to 16-byte chunks.

    allreduce / alltoall: in = out = R*count; allgather / gather: in = count, out = R*count;
    reduce_scatter / scatter: in = R*count, out = count; broadcast / reduce: in = out = count.
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}")
    r = world_size
    per_chunk = ALIGN_BYTES // itemsize
    chunks = 1 if collective in ("broadcast", "reduce") else r
    count = max(per_chunk, (nbytes // (itemsize * chunks)) // per_chunk * per_chunk)
    in_chunks, out_chunks = {
        "allreduce": (r, r), "alltoall": (r, r),
        "allgather": (1, r), "gather": (1, r),
        "reduce_scatter": (r, 1), "scatter": (r, 1),
        "broadcast": (1, 1), "reduce": (1, 1),
    }[collective]
    return Layout(collective, r, count, in_chunks * count, out_chunks * count, itemsize)


def busbw_factor(collective: str, world_size: int) -> float:
    """nccl-tests' doc/PERFORMANCE.md (gather/scatter as in its gather.cu / scatter.cu)."""
    r = world_size
    if collective == "allreduce":
        return 2 * (r - 1) / r
    if collective in ("broadcast", "reduce"):
        return 1.0
    return (r - 1) / r  # allgather, reduce_scatter, alltoall, gather, scatter


def algbw_gbps(nbytes: int, time_us: float | None) -> float | None:
    if not time_us or time_us <= 0:
        return None
    return nbytes / (time_us * 1e3)  # bytes / (us * 1e-6) / 1e9


def busbw_gbps(collective: str, world_size: int, nbytes: int, time_us: float | None) -> float | None:
    alg = algbw_gbps(nbytes, time_us)
    return None if alg is None else alg * busbw_factor(collective, world_size)


# --------------------------------------------------------------------------- run-time estimate


def estimate_case_s(nbytes: int, *, reps: int, target_rep_us: float, modes: int = 2) -> float:
    """A rough wall-clock cost of one (system, variant, size) case: both modes + the check.

    Model: a call costs 15 us + bytes / 150 GB/s; iterations per repeat are chosen to fill
    ``target_rep_us`` (2..100 here; the bench's eager loops and graph replays fill it by measured
    times, bench.eager_iters and bench.graph_replays); fixed overheads (barriers, graph capture,
    the check's reference) about 40 ms per case.  Runs 18-21 (--quick) took 155-185 s against
    this model's 264 s.
    """
    call_us = 15.0 + nbytes / 150e3
    iters = min(100, max(2, int(target_rep_us / call_us)))
    calls = 4 + reps * iters + (iters + 1)  # warm-up + repeats + graph capture/warm replay
    check_us = 3 * call_us + 2 * nbytes / 100e3
    return 0.04 + (modes * calls * call_us + check_us) * 1e-6


def estimate_run_s(plan: list[tuple[str, int, int]], *, reps: int, target_rep_us: float,
                   modes: int, loads: int, load_s: float = 2.0, startup_s: float = 20.0) -> float:
    """``plan``: (collective, bytes, cases) triples."""
    cases = sum(estimate_case_s(b, reps=reps, target_rep_us=target_rep_us, modes=modes) * n
                for _, b, n in plan)
    return startup_s + loads * load_s + cases


# --------------------------------------------------------------------------- the wire model

LAUNCH_US = 0.56  # an empty kernel inside a CUDA graph (H200)
SIGNAL_US = 1.26  # one release store -> acquire poll across NVLink
TWO_WAY_GBPS = 365.0  # each way, with both directions busy (730 GB/s together)
ONE_WAY_GBPS = 396.0  # one direction alone (copy-engine peak at 1 GiB)
TWO_WAY = frozenset({"allreduce", "allgather", "reduce_scatter", "alltoall"})


def wire_bytes(collective: str, world_size: int, nbytes: int) -> float:
    """Bytes the busiest link direction of one rank must carry (nccl-tests' bus bytes)."""
    return busbw_factor(collective, world_size) * nbytes


def limit_us(collective: str, world_size: int, nbytes: int) -> float:
    gbps = TWO_WAY_GBPS if collective in TWO_WAY else ONE_WAY_GBPS
    return LAUNCH_US + SIGNAL_US + wire_bytes(collective, world_size, nbytes) / (gbps * 1e3)


def pct_of_limit(collective: str, world_size: int, nbytes: int, time_us: float | None) -> float | None:
    """100 = at the wire limit; lower is slower."""
    if not time_us or time_us <= 0:
        return None
    return 100.0 * limit_us(collective, world_size, nbytes) / time_us


# --------------------------------------------------------------------------- row access

PRIMARY_CALLS_PER_GRAPH = 20  # graph rows the tables and targets quote first


def normalize(row: dict) -> dict:
    """Rows of older runs: NCCL's plain row was variant ``nccl``; no calls_per_graph."""
    if row.get("system") == "nccl" and row.get("variant") == "nccl":
        row = {**row, "variant": "default"}
    if "calls_per_graph" not in row:
        row = {**row, "calls_per_graph": None}
    return row


def ok(row: dict) -> bool:
    """A row that ran and was not found wrong."""
    return row.get("error") is None and row.get("time_us") is not None and row.get("checked") is not False


def rows_for(rows: list[dict], **match) -> list[dict]:
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def one(rows: list[dict], **match) -> dict | None:
    found = [r for r in rows_for(rows, **match) if r.get("time_us") is not None or r.get("error")]
    return found[0] if found else None


def graph_counts(rows: list[dict]) -> list[int | None]:
    """The calls-per-graph values of the graph rows, the primary one first."""
    found = sorted({r.get("calls_per_graph") for r in rows if r.get("mode") == "graph"},
                   key=lambda c: (c != PRIMARY_CALLS_PER_GRAPH, c is None, c or 0))
    return found


def views(rows: list[dict]) -> list[tuple[str, int | None]]:
    """(mode, calls_per_graph) pairs present, graph (primary first) then eager."""
    out = [("graph", c) for c in graph_counts(rows)]
    if any(r.get("mode") == "eager" for r in rows):
        out.append(("eager", None))
    return out


def select(rows: list[dict], mode: str, calls: int | None = None) -> list[dict]:
    """The rows of one timing view; for graph rows ``calls`` picks the calls per graph
    (default: the primary one present)."""
    if mode == "graph" and calls is None:
        counts = graph_counts(rows)
        calls = counts[0] if counts else None
    return [r for r in rows if r.get("mode") == mode and (mode != "graph" or r.get("calls_per_graph") == calls)]


NOT_SCHEDULES = ("default", "zerocopy")  # Purlin rows that are a choice, not one pinned schedule


def best_purlin(rows: list[dict], collective: str, nbytes: int, mode: str) -> dict | None:
    """The fastest correct explicit Purlin variant (``default``/``zerocopy`` excluded: choices)."""
    cands = [r for r in rows_for(rows, system="purlin", collective=collective, bytes=nbytes, mode=mode)
             if r.get("variant") not in NOT_SCHEDULES and ok(r) and r.get("checked") is True]
    return min(cands, key=lambda r: r["time_us"]) if cands else None


def best_of(rows: list[dict], system: str, collective: str, nbytes: int, mode: str) -> dict | None:
    cands = [r for r in rows_for(rows, system=system, collective=collective, bytes=nbytes, mode=mode) if ok(r)]
    return min(cands, key=lambda r: r["time_us"]) if cands else None


def best_nccl(rows: list[dict], collective: str, nbytes: int, mode: str) -> dict | None:
    """The fastest NCCL row (default, nomix or symm) that ran and was not found wrong."""
    return best_of(rows, "nccl", collective, nbytes, mode)


def sizes_of(rows: list[dict], collective: str) -> list[int]:
    return sorted({r["bytes"] for r in rows if r.get("collective") == collective and r.get("bytes")})


def collectives_of(rows: list[dict]) -> list[str]:
    present = {r.get("collective") for r in rows}
    return [c for c in COLLECTIVES if c in present]


def world_size_of(doc: dict) -> int:
    ws = doc.get("meta", {}).get("world_size")
    if ws:
        return int(ws)
    sizes = {r.get("world_size") for r in doc.get("rows", []) if r.get("world_size")}
    return int(next(iter(sizes))) if sizes else 0


def ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


def with_limits(row: dict) -> dict:
    """``limit_us`` and ``pct_of_limit`` filled in (rows of older runs lack them)."""
    if row.get("bytes") and row.get("collective") in COLLECTIVES and row.get("world_size"):
        lim = limit_us(row["collective"], row["world_size"], row["bytes"])
        row = {**row, "limit_us": round(lim, 3),
               "pct_of_limit": None if not ok(row) else round(100.0 * lim / row["time_us"], 1)}
    return row


# --------------------------------------------------------------------------- merge


def merge(docs: list[dict]) -> dict:
    """Later documents win for the same (system, variant, collective, bytes, mode, calls) key."""
    if not docs:
        return {"meta": {}, "rows": []}
    meta = dict(docs[0].get("meta", {}))
    keyed: dict[tuple, dict] = {}
    for doc in docs:
        for row in doc.get("rows", []):
            row = normalize(row)
            key = (row.get("system"), row.get("variant"), row.get("collective"), row.get("bytes"), row.get("mode"),
                   row.get("calls_per_graph"))
            keyed[key] = row
    if len(docs) > 1:
        meta["merged_from"] = [d.get("meta", {}).get("run_id") for d in docs]
        for d in docs[1:]:  # keep the best peak measurements any run made
            for k, v in (d.get("meta", {}).get("peaks") or {}).items():
                meta.setdefault("peaks", {}).setdefault(k, v)
    return {"meta": meta, "rows": list(keyed.values())}


def prepared(doc: dict) -> dict:
    """The document with rows normalised and limits filled in (what the report reads)."""
    return {"meta": doc.get("meta", {}), "rows": [with_limits(normalize(r)) for r in doc.get("rows", [])]}


# --------------------------------------------------------------------------- tuning table


def variant_options(row: dict) -> dict:
    opts = dict(row.get("options") or {})
    return {k: opts.get(k) for k in ("algorithm", "atom", "channels", "slices", "packed") if opts.get(k) is not None}


def tuning_table(doc: dict, *, prefer_mode: str = "graph") -> dict:
    """{collective: {world_size: [{max_bytes, variant, options...}, ...]}}.

    Per measured size the fastest correct explicit Purlin variant (``prefer_mode`` timings,
    the primary calls per graph; eager where that mode has none); neighbouring sizes with the
    same winner are merged.  An entry applies to calls of at most ``max_bytes``; the last has
    ``max_bytes: null``.
    """
    rows = prepared(doc)["rows"]
    ws = str(world_size_of(doc))
    other = "eager" if prefer_mode == "graph" else "graph"
    first, second = select(rows, prefer_mode), select(rows, other)
    table: dict[str, dict[str, list[dict]]] = {}
    for coll in collectives_of(rows):
        picks: list[tuple[int, dict]] = []
        for nbytes in sizes_of(rows, coll):
            best = best_purlin(first, coll, nbytes, prefer_mode) or best_purlin(second, coll, nbytes, other)
            if best is not None:
                picks.append((nbytes, best))
        entries: list[dict] = []
        for nbytes, row in picks:
            entry = {"max_bytes": nbytes, "variant": row["variant"], **variant_options(row),
                     "time_us": round(row["time_us"], 3), "mode": row["mode"]}
            if entries and entries[-1]["variant"] == entry["variant"]:
                entries[-1].update(max_bytes=nbytes, time_us=entry["time_us"])
            else:
                entries.append(entry)
        if entries:
            entries[-1]["max_bytes"] = None
            table[coll] = {ws: entries}
    return table


# --------------------------------------------------------------------------- targets


@dataclass
class Target:
    name: str
    status: str  # "met" | "missed" | "no data" | "report"
    lines: list[str]
    # One per checked point, beside its line: (point, met, {measure: value}), e.g.
    # ("allreduce 1 KiB", True, {"us": 1.7, "x best NCCL": 1.6}); what scripts/target_ranges.py
    # gathers over several runs.
    points: list[tuple[str, bool, dict]] = field(default_factory=list)


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _why(row: dict) -> str:
    if row.get("error"):
        return str(row["error"]).splitlines()[0][:100]
    if row.get("checked") is False:
        return "wrong result"
    return "no time"


def _num(x: float | None, digits: int = 2) -> str:
    if x is None:
        return "-"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.{digits}f}"


def _name(row: dict | None) -> str:
    return "-" if row is None else f"{row['system']}/{row['variant']}"


def _default(rows: list[dict], coll: str, nbytes: int, mode: str) -> dict | None:
    return one(rows, system="purlin", variant="default", collective=coll, bytes=nbytes, mode=mode)


def _judge(name: str, checks: list[tuple[bool, str, str, dict]]) -> Target:
    """``checks``: (met, line, point, values) per checked point."""
    if not checks:
        return Target(name, "no data", [])
    missed = [line for good, line, _, _ in checks if not good]
    lines = [("met: " if good else "MISSED: ") + line for good, line, _, _ in checks]
    points = [(point, good, values) for good, _, point, values in checks]
    return Target(name, "missed" if missed else "met", lines, points)


def _latency_target(rows, colls, lo, hi, limit: dict[str, float], speedup: float | None, name: str) -> Target:
    """graph: the Purlin default <= limit[coll] us and (optionally) >= speedup x best NCCL."""
    checks = []
    for coll in colls:
        for nbytes in sizes_of(rows, coll):
            if not lo <= nbytes <= hi:
                continue
            d, n = _default(rows, coll, nbytes, "graph"), best_nccl(rows, coll, nbytes, "graph")
            if d is None:
                continue
            bound = limit.get(coll, limit.get("*"))
            t = d["time_us"] if ok(d) else None
            good = t is not None and (bound is None or t <= bound)
            r = ratio(n["time_us"], t) if n is not None and t else None
            if speedup is not None:
                good = good and r is not None and r >= speedup
            line = (f"{coll} {fmt_bytes(nbytes)}: Purlin {_num(t)} us" + (f" (<= {bound})" if bound else "")
                    + (f", {_fmt_ratio(r)} best NCCL ({_name(n)} {_num(n['time_us'])} us)" if n else ", no NCCL row"))
            if not ok(d):
                line += f" (Purlin row failed: {_why(d)})"
            checks.append((good, line, f"{coll} {fmt_bytes(nbytes)}", {"us": t, "x best NCCL": r}))
    return _judge(name, checks)


def _speedup_target(rows, colls, lo, hi, need: float, name: str, only=None) -> Target:
    checks = []
    for coll in (only or colls):
        if coll not in colls:
            continue
        for nbytes in sizes_of(rows, coll):
            if not lo <= nbytes <= hi:
                continue
            d, n = _default(rows, coll, nbytes, "graph"), best_nccl(rows, coll, nbytes, "graph")
            if d is None or n is None:
                continue
            r = ratio(n["time_us"], d["time_us"]) if ok(d) else None
            checks.append((r is not None and r >= need,
                           f"{coll} {fmt_bytes(nbytes)}: {_fmt_ratio(r)} best NCCL ({_name(n)} {_num(n['time_us'])} us, "
                           f"Purlin {_num(d.get('time_us'))} us)" + ("" if ok(d) else f" (Purlin: {_why(d)})"),
                           f"{coll} {fmt_bytes(nbytes)}", {"x best NCCL": r, "us": d["time_us"] if ok(d) else None}))
    return _judge(name, checks)


def _wire_target(rows, colls, nbytes_at: int, within: float, name: str) -> Target:
    checks = []
    for coll in colls:
        d = _default(rows, coll, nbytes_at, "graph")
        if d is None:
            continue
        pct = d.get("pct_of_limit") if ok(d) else None
        checks.append((pct is not None and pct >= 100.0 * (1 - within),
                       f"{coll} {fmt_bytes(nbytes_at)}: {_num(pct)}% of the wire limit "
                       f"({_num(d.get('limit_us'))} us; Purlin {_num(d.get('time_us'))} us)",
                       f"{coll} {fmt_bytes(nbytes_at)}", {"% of limit": pct, "us": d["time_us"] if ok(d) else None}))
    return _judge(name, checks)


def _busbw_target(rows, colls, need_gbps: float, name: str) -> Target:
    checks = []
    for coll in [c for c in BANDWIDTH_BOUND if c in colls]:
        for nbytes in sizes_of(rows, coll):
            if nbytes < 256 * MiB:
                continue
            d = _default(rows, coll, nbytes, "graph")
            if d is None:
                continue
            bus = d.get("busbw_gbps") if ok(d) else None
            checks.append((bus is not None and bus >= need_gbps, f"{coll} {fmt_bytes(nbytes)}: {_num(bus)} GB/s busbw",
                           f"{coll} {fmt_bytes(nbytes)}", {"busbw GB/s": bus}))
    return _judge(name, checks)


def _eager_target(rows, colls, bound: float, name: str) -> Target:
    checks = []
    for coll in colls:
        d = _default(rows, coll, KiB, "eager")
        if d is None:
            continue
        t = d["time_us"] if ok(d) else None
        checks.append((t is not None and t <= bound, f"{coll} 1 KiB eager: {_num(t)} us", f"{coll} 1 KiB", {"us": t}))
    return _judge(name, checks)


def measured_peak_gbps(meta: dict) -> tuple[float | None, str]:
    """The highest one-way peer bandwidth measured in the run, and how."""
    best, how = None, ""
    for method, m in (meta.get("peaks") or {}).items():
        if not isinstance(m, dict):
            continue
        for point in m.get("points", []):
            g = point.get("gbps")
            if g and (best is None or g > best):
                best, how = g, f"{method} at {fmt_bytes(point.get('bytes'))}"
    return best, how


def _default_vs_best(rows: list[dict], collectives: list[str]) -> Target:
    name = "default within 10% of the best explicit variant (every collective, size and mode)"
    misses, seen = [], 0
    for coll in collectives:
        for nbytes in sizes_of(rows, coll):
            for mode in MODES:
                d = _default(rows, coll, nbytes, mode)
                b = best_purlin(rows, coll, nbytes, mode)
                if d is None or b is None:
                    continue
                seen += 1
                if not ok(d) or d["time_us"] > 1.1 * b["time_us"]:
                    misses.append(f"{coll} {fmt_bytes(nbytes)} {mode}: default {_num(d.get('time_us'))} us vs "
                                  f"{b['variant']} {b['time_us']:.2f} us")
    lines = misses[:20] + ([f"... and {len(misses) - 20} more"] if len(misses) > 20 else [])
    if seen and not misses:
        lines = [f"all {seen} points within 10%"]
    return Target(name, "no data" if not seen else ("missed" if misses else "met"), lines)


def _footprint(rows: list[dict], meta: dict, collectives: list[str]) -> Target:
    """Report the SMs and memory the default call occupies (target: <= 32 SMs at >= 256 MiB)."""
    lines = []
    for coll in collectives:
        sms = sorted({r["sms"] for r in rows_for(rows, system="purlin", variant="default", collective=coll)
                      if r.get("sms") is not None and (r.get("bytes") or 0) >= 256 * MiB})
        lines.append(f"{coll}: Purlin default SMs at >= 256 MiB: {sms or 'unknown'}")
    fp = meta.get("purlin_footprint") or {}
    if fp:
        lines.append("Purlin device memory: " + ", ".join(f"{k} {fmt_bytes(v) if isinstance(v, int) else v}"
                                                           for k, v in fp.items()))
    return Target("footprint (SMs of the default call at >= 256 MiB; device memory)", "report", lines)


def targets(doc: dict) -> list[Target]:
    """Issue #11's targets, against the best NCCL row of each size (graph: the primary calls
    per graph)."""
    doc = prepared(doc)
    rows, meta = doc["rows"], doc["meta"]
    colls = collectives_of(rows)
    graph = select(rows, "graph")
    eager = select(rows, "eager")
    small = {"allreduce": 2.3, "allgather": 2.3, "reduce_scatter": 2.3, "*": 2.5}
    out = [
        _latency_target(graph, colls, KiB, 16 * KiB, small, 1.25,
                        "graph, 1 KiB and 16 KiB: every collective <= 2.5 us (all-reduce, all-gather, "
                        "reduce-scatter <= 2.3 us) and >= 1.25x the best NCCL"),
        _latency_target(graph, colls, 64 * KiB, 64 * KiB, {"*": 3.0}, None,
                        "graph, 64 KiB: every collective <= 3.0 us"),
        _speedup_target(graph, colls, MiB, MiB, 1.5, "graph, 1 MiB: >= 1.5x the best NCCL"),
        _wire_target(graph, colls, 16 * MiB, 0.15, "graph, 16 MiB: within 15% of the wire limit"),
        _busbw_target(graph, colls, 330.0,
                      "graph, 256 MiB and 1 GiB: all-gather, reduce-scatter, all-to-all >= 330 GB/s busbw"),
        _speedup_target(graph, colls, 256 * MiB, GiB, 1.05, "graph, 256 MiB and 1 GiB: all eight >= 1.05x the best NCCL"),
        _eager_target(eager, colls, 8.0, "eager, 1 KiB: <= 8 us per call"),
        _footprint(rows, meta, colls),
        _default_vs_best(graph + eager, colls),
    ]
    missing = [c for c in COLLECTIVES if c not in colls]
    if missing:
        for t in out:
            t.lines.append(f"(partial run: no rows for {', '.join(missing)})")
    return out


# --------------------------------------------------------------------------- markdown


def _cell_time(row: dict | None) -> str:
    if row is None:
        return "-"
    if row.get("error"):
        return "error"
    if row.get("time_us") is None:
        return "-"
    mark = "" if row.get("checked") is not False else " WRONG"
    return f"{_num(row['time_us'])}{mark}"


def _cell_bw(row: dict | None) -> str:
    if row is None or not ok(row):
        return "-"
    return f"{_num(row.get('algbw_gbps'))} / {_num(row.get('busbw_gbps'))}"


def _cell_sms(row: dict | None) -> str:
    if row is None or row.get("sms") is None:
        return "?"
    return str(row["sms"])


def _t(row: dict | None) -> float | None:
    return row["time_us"] if row is not None and ok(row) else None


def collective_table(rows: list[dict], coll: str, mode: str) -> list[str]:
    """One row per size: NCCL default and best (named), Purlin default, zero-copy and best
    explicit variant, speed-ups against the best NCCL row, the wire limit, symm_mem."""
    with_symm = any(r.get("system") == "symm_mem" and r.get("collective") == coll for r in rows)
    with_zc = any(r.get("variant") == "zerocopy" and r.get("collective") == coll for r in rows)
    head = ["size", "NCCL default us", "best NCCL", "best NCCL us", "Purlin default us", "default alg/bus GB/s",
            "default vs best NCCL"]
    if with_zc:
        head += ["zero-copy us", "zero-copy vs best NCCL"]
    head += ["best variant", "best us", "best vs best NCCL", "default/best", "limit us", "default % of limit",
             "SMs def/best"]
    if with_symm:
        head.append("symm_mem best us")
    head.append("checked")
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for nbytes in sizes_of(rows, coll):
        nd = one(rows, system="nccl", variant="default", collective=coll, bytes=nbytes, mode=mode)
        n = best_nccl(rows, coll, nbytes, mode)
        d = _default(rows, coll, nbytes, mode)
        z = one(rows, system="purlin", variant="zerocopy", collective=coll, bytes=nbytes, mode=mode)
        b = best_purlin(rows, coll, nbytes, mode)
        if nd is None and n is None and d is None and b is None and z is None:
            continue
        nt, dt, bt, zt = _t(n), _t(d), _t(b), _t(z)
        cells = [fmt_bytes(nbytes), _cell_time(nd), n["variant"] if n else "-", _cell_time(n), _cell_time(d),
                 _cell_bw(d), _fmt_ratio(ratio(nt, dt))]
        if with_zc:
            cells += [_cell_time(z), _fmt_ratio(ratio(nt, zt))]
        lim = limit_us(coll, int((d or n or nd or b or z).get("world_size") or 2), nbytes)
        cells += [b["variant"] if b else "-", _cell_time(b), _fmt_ratio(ratio(nt, bt)), _fmt_ratio(ratio(dt, bt)),
                  _num(lim), _num(None if dt is None else 100.0 * lim / dt, 1), f"{_cell_sms(d)}/{_cell_sms(b)}"]
        if with_symm:
            s = best_of(rows, "symm_mem", coll, nbytes, mode)
            cells.append(f"{_num(s['time_us'])} ({s['variant']})" if s else "-")
        checks = [r.get("checked") for r in rows_for(rows, collective=coll, bytes=nbytes, mode=mode)
                  if r.get("error") is None]
        cells.append("FAIL" if False in checks else ("yes" if checks and all(c is True for c in checks)
                                                      else "partial"))
        out.append("| " + " | ".join(cells) + " |")
    return out


def nccl_table(rows: list[dict], mode: str) -> list[str]:
    """Every NCCL variant side by side (time per call), so the best one's margin shows."""
    variants = [v for v in ("default", "nomix", "symm") if rows_for(rows, system="nccl", variant=v)]
    variants += sorted({r["variant"] for r in rows if r.get("system") == "nccl"} - set(variants))
    if len(variants) < 2:
        return []
    out = ["| collective | size | " + " | ".join(f"{v} us" for v in variants) + " | best |",
           "|" + "---|" * (len(variants) + 3)]
    for coll in collectives_of(rows):
        for nbytes in sizes_of(rows, coll):
            cells = [_cell_time(one(rows, system="nccl", variant=v, collective=coll, bytes=nbytes, mode=mode))
                     for v in variants]
            if all(c == "-" for c in cells):
                continue
            best = best_nccl(rows, coll, nbytes, mode)
            out.append(f"| {coll} | {fmt_bytes(nbytes)} | " + " | ".join(cells) + f" | {best['variant'] if best else '-'} |")
    return out


def _hier_order(variant: str) -> tuple:
    """g<G> variants by G, largest (fewest nodes) first; other names after, by name."""
    g = int(variant[1:]) if variant[:1] == "g" and variant[1:].isdigit() else 0
    return (-g, variant)


def hier_variants(rows: list[dict]) -> list[str]:
    """The purlin/hierarchical variants present, the largest G (fewest nodes) first."""
    return sorted({r["variant"] for r in rows if r.get("system") == HIER}, key=_hier_order)


def _hier_label(rows: list[dict], variant: str) -> str:
    opts = next((r.get("options") or {} for r in rows if r.get("system") == HIER and r.get("variant") == variant
                 and r.get("options")), {})
    if opts.get("nodes") and opts.get("gpus_per_node"):
        return f"{variant} ({opts['nodes']}x{opts['gpus_per_node']})"
    return variant


def hierarchical_table(rows: list[dict], mode: str, load_errors: dict | None = None) -> list[str]:
    """purlin/hierarchical beside NCCL, one line per collective and size: NCCL default and the
    best NCCL row (named), the flat Purlin default, each hierarchical variant (nodes x GPUs)
    and its ratio to the best NCCL row, the wire limit, and whether the hierarchical rows
    were checked.  ``load_errors``: {(collective, variant): error} of loads that failed (their
    variant shows 'no load' for that collective)."""
    load_errors = load_errors or {}
    variants = sorted(set(hier_variants(rows)) | {v for _, v in load_errors}, key=_hier_order)
    if not variants:
        return []
    colls = [c for c in collectives_of(rows) if rows_for(rows, system=HIER, collective=c)
             or any(c == lc for lc, _ in load_errors)]
    head = ["collective", "size", "NCCL default us", "best NCCL", "best NCCL us", "Purlin default us"]
    for v in variants:
        label = _hier_label(rows, v)
        head += [f"{label} us", f"{v} vs best NCCL"]
    head += ["limit us", "checked"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for coll in colls:
        for nbytes in sizes_of(rows, coll):
            hs = {v: one(rows, system=HIER, variant=v, collective=coll, bytes=nbytes, mode=mode) for v in variants}
            if all(h is None for h in hs.values()) and not any((coll, v) in load_errors for v in variants):
                continue
            nd = one(rows, system="nccl", variant="default", collective=coll, bytes=nbytes, mode=mode)
            n = best_nccl(rows, coll, nbytes, mode)
            d = _default(rows, coll, nbytes, mode)
            cells = [coll, fmt_bytes(nbytes), _cell_time(nd), n["variant"] if n else "-", _cell_time(n), _cell_time(d)]
            for v in variants:
                h = hs[v]
                if h is None and (coll, v) in load_errors:
                    cells += ["no load", "-"]
                else:
                    cells += [_cell_time(h), _fmt_ratio(ratio(_t(n), _t(h)))]
            world = next((r.get("world_size") for r in (*hs.values(), n, nd, d) if r and r.get("world_size")), 2)
            checks = [h.get("checked") for h in hs.values() if h is not None and h.get("error") is None]
            cells += [_num(limit_us(coll, int(world), nbytes)),
                      "FAIL" if False in checks else ("yes" if checks and all(c is True for c in checks) else
                                                      ("-" if not checks else "partial"))]
            out.append("| " + " | ".join(cells) + " |")
    return out


def hier_load_errors(rows: list[dict]) -> dict:
    """{(collective, variant): error} of the purlin/hierarchical loads that failed."""
    return {(r.get("collective"), r.get("variant")): r.get("error") for r in rows
            if r.get("system") == HIER and r.get("phase") == "load" and r.get("error")}


def _meta_lines(meta: dict) -> list[str]:
    keys = ("date", "machine", "world_size", "gpus", "nvidia_driver", "torch", "nccl", "cuda_bindings",
            "purlinc", "git_commit", "quick", "elapsed_s", "estimate_s", "status", "stopped_by_budget")
    out = []
    for k in keys:
        if k in meta and meta[k] is not None:
            v = meta[k]
            if isinstance(v, list):
                v = ", ".join(str(x) for x in v)
            out.append(f"- {k}: {v}")
    nccl = meta.get("nccl_variants")
    if isinstance(nccl, dict):
        for name, info in nccl.items():
            out.append(f"- NCCL {name}: {info}")
    return out


def _peak_lines(meta: dict) -> list[str]:
    peaks = meta.get("peaks") or {}
    if not peaks:
        return ["(no peak measurement in this run)"]
    out = ["| method | how | " + " | ".join(["bytes -> GB/s"]) + " |", "|---|---|---|"]
    for method, m in peaks.items():
        if not isinstance(m, dict):
            continue
        pts = ", ".join(f"{fmt_bytes(p.get('bytes'))}: {_num(p.get('gbps'))}" for p in m.get("points", []))
        out.append(f"| {method} | {m.get('how', '')} | {pts or m.get('error', '-')} |")
    return out


def _view_name(mode: str, calls: int | None) -> str:
    return f"graph, {calls} calls per graph" if mode == "graph" and calls else mode


def markdown(doc: dict) -> str:
    doc = prepared(doc)
    rows, meta = doc["rows"], doc["meta"]
    ws = world_size_of(doc)
    out = [f"# Collective benchmark: {meta.get('machine', '?')}, {meta.get('date', '?')}, R={ws}", ""]
    out += _meta_lines(meta) + [""]
    out += ["Times in microseconds: per call, the slowest rank's median. alg/bus: algorithm and bus",
            "bandwidth in GB/s (nccl-tests conventions; bytes = the larger of one rank's input and output).",
            "'vs best NCCL' > 1 means faster than the fastest NCCL row of that size (default, nomix =",
            "NCCL_GRAPH_MIXING_SUPPORT=0, symm = mixing off + NCCL symmetric buffers), which 'best NCCL' names.",
            "'best' is the fastest correct explicit Purlin variant; 'zero-copy' is the default call on",
            "buffers from comm.empty. Graph rows: the same calls per graph for every system; each timed",
            "repeat replays the graph several times back to back ('replays' in the JSON). 'limit' is",
            f"the wire model: {LAUNCH_US} us launch + {SIGNAL_US} us signal + bus bytes at {TWO_WAY_GBPS:.0f} GB/s",
            f"(both directions busy) or {ONE_WAY_GBPS:.0f} GB/s (one direction); '% of limit' = limit / time.",
            "Latency claims use graph mode (CUDA-graph replays); eager includes the Python launch.", ""]
    out += ["## One-way peer bandwidth (same run)", ""] + _peak_lines(meta) + [""]
    wrong = [r for r in rows if r.get("checked") is False]
    if wrong:
        out += ["## CORRECTNESS FAILURES", ""]
        out += [f"- {r['system']}/{r['variant']} {r['collective']} {fmt_bytes(r['bytes'])} "
                f"{_view_name(r['mode'], r.get('calls_per_graph'))}: {r.get('check_note', '')}" for r in wrong] + [""]
    for mode, calls in views(rows):
        table = nccl_table(select(rows, mode, calls), mode)
        if table:
            out += [f"## NCCL variants, {_view_name(mode, calls)}", ""] + table + [""]
    load_errors = hier_load_errors(rows)
    for mode, calls in views(rows):
        table = hierarchical_table(select(rows, mode, calls), mode, load_errors)
        if table:
            out += [f"## {HIER} beside NCCL, {_view_name(mode, calls)}", "",
                    "g<G>: the world as R/G nodes of G GPUs (nodes x GPUs in the header): Purlin kernels inside a",
                    "node, NCCL between nodes (docs/HIERARCHY.md). 'no load': no hierarchical plan or load failed",
                    "(see Errors).", ""] + table + [""]
    for coll in collectives_of(rows):
        for mode, calls in views(rows):
            sub = select(rows, mode, calls)
            if not rows_for(sub, collective=coll):
                continue
            out += [f"## {coll}, {_view_name(mode, calls)}", ""] + collective_table(sub, coll, mode) + [""]
    errors = [r for r in rows if r.get("error")]
    if errors:
        out += ["## Errors", ""]
        seen = set()
        for r in errors:
            msg = str(r["error"]).strip().splitlines()[-1][:160] if str(r["error"]).strip() else "?"
            key = (r.get("system"), r.get("variant"), r.get("collective"), msg)
            if key in seen:
                continue
            seen.add(key)
            n = sum(1 for e in errors if (e.get("system"), e.get("variant"), e.get("collective")) == key[:3])
            out.append(f"- {r.get('system')}/{r.get('variant')} {r.get('collective')} ({n} rows): {msg}")
        out.append("")
    out += ["## Targets (against the best NCCL row of each size)", ""]
    for t in targets(doc):
        out.append(f"- **{t.status.upper()}**: {t.name}")
        out += [f"    - {line}" for line in t.lines]
    out.append("")
    return "\n".join(out)


# --------------------------------------------------------------------------- plots


def plot(doc: dict, out_dir: Path, stem: str) -> list[Path]:
    """Three PNGs: graph latency, eager latency, graph busbw; one panel per collective."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    doc = prepared(doc)
    rows = doc["rows"]
    colls = collectives_of(rows)
    if not colls:
        return []
    files = []
    for mode, metric, label in (("graph", "time_us", "time per call (us)"),
                                ("eager", "time_us", "time per call (us)"),
                                ("graph", "busbw_gbps", "bus bandwidth (GB/s)")):
        sub = select(rows, mode)
        if not sub:
            continue
        ncols = min(4, len(colls))
        nrows = math.ceil(len(colls) / ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False)
        for ax, coll in zip(axes.flat, colls):
            for name, series in _series(sub, coll, mode, metric).items():
                if series:
                    xs, ys = zip(*series)
                    style = dict(linestyle="--", color="gray") if name == "wire limit" else {}
                    ax.plot(xs, ys, marker="o", markersize=3, label=name, **style)
            ax.set_xscale("log", base=2)
            ticks = sizes_of(rows, coll)
            if len(ticks) > 7:  # keep the labels readable: every other size
                ticks = ticks[::2]
            ax.set_xticks(ticks, [fmt_bytes(t).replace(" ", "") for t in ticks], rotation=45, fontsize=7)
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_title(coll)
            ax.set_xlabel("bytes")
            ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6)
        for ax in list(axes.flat)[len(colls):]:
            ax.axis("off")
        what = "latency" if metric == "time_us" else "busbw"
        calls = graph_counts(rows)[0] if mode == "graph" and graph_counts(rows) else None
        fig.suptitle(f"{doc.get('meta', {}).get('machine', '')} R={world_size_of(doc)}: {what}, "
                     f"{_view_name(mode, calls)}")
        fig.tight_layout()
        path = out_dir / f"{stem}-{what}-{mode}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


def _series(rows: list[dict], coll: str, mode: str, metric: str) -> dict[str, list[tuple[int, float]]]:
    names = ("nccl default", "nccl best", "purlin default", "purlin zero-copy", "purlin best", "symm_mem best",
             "wire limit")
    out: dict[str, list[tuple[int, float]]] = {k: [] for k in names}
    for nbytes in sizes_of(rows, coll):
        picks = {
            "nccl default": one(rows, system="nccl", variant="default", collective=coll, bytes=nbytes, mode=mode),
            "nccl best": best_nccl(rows, coll, nbytes, mode),
            "purlin default": _default(rows, coll, nbytes, mode),
            "purlin zero-copy": one(rows, system="purlin", variant="zerocopy", collective=coll, bytes=nbytes, mode=mode),
            "purlin best": best_purlin(rows, coll, nbytes, mode),
            "symm_mem best": best_of(rows, "symm_mem", coll, nbytes, mode),
        }
        for v in hier_variants(rows):
            picks[f"hierarchical {v}"] = one(rows, system=HIER, variant=v, collective=coll, bytes=nbytes, mode=mode)
        for name, row in picks.items():
            if row is not None and ok(row) and row.get(metric):
                out.setdefault(name, []).append((nbytes, row[metric]))
        world = next((r.get("world_size") for r in rows if r.get("world_size")), 2)
        lim = limit_us(coll, world, nbytes)
        out["wire limit"].append((nbytes, lim if metric == "time_us" else busbw_gbps(coll, world, nbytes, lim)))
    return {k: v for k, v in out.items() if v}


# --------------------------------------------------------------------------- writing


def write_all(doc: dict, results_dir: Path, stem: str, *, plots: bool = True) -> dict[str, Path]:
    """``<stem>.json``, ``<stem>.md``, ``<stem>-tuning.json`` and the PNGs."""
    results_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": results_dir / f"{stem}.json", "md": results_dir / f"{stem}.md",
             "tuning": results_dir / f"{stem}-tuning.json"}
    doc = prepared(doc)
    # Compact JSON: one row per line keeps the file small and diffable.
    rows = ",\n".join(json.dumps(r, separators=(",", ":"), default=str) for r in doc["rows"])
    meta = json.dumps(doc["meta"], separators=(",", ":"), default=str)
    _atomic_write(paths["json"], '{"meta":' + meta + ',\n"rows":[\n' + rows + "\n]}\n")
    _atomic_write(paths["md"], markdown(doc))
    _atomic_write(paths["tuning"], json.dumps(tuning_table(doc), indent=1))
    if plots:
        for i, p in enumerate(plot(doc, results_dir, stem)):
            paths[f"png{i}"] = p
    return paths


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def median(values: list[float]) -> float:
    return statistics.median(values)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Rebuild (and merge) benchmark reports from results JSON files.")
    ap.add_argument("json", nargs="+", type=Path, help="results JSON files; later ones win on equal keys")
    ap.add_argument("--out-dir", type=Path, default=None, help="default: the first file's directory")
    ap.add_argument("--stem", default=None, help="output name stem (default: the first file's)")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    doc = merge([json.loads(p.read_text()) for p in args.json])
    out_dir = args.out_dir or args.json[0].parent
    stem = args.stem or (args.json[0].stem if len(args.json) == 1 else args.json[0].stem + "-merged")
    paths = write_all(doc, out_dir, stem, plots=not args.no_plots)
    print(markdown(doc))
    print("wrote: " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
