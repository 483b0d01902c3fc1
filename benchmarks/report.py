"""Benchmark bookkeeping that needs no GPU and no torch: sizes, buffer layouts, bandwidth
conventions, and turning a results JSON into Markdown, plots and a tuning table.

``bench.py`` measures and writes ``{"meta": {...}, "rows": [...]}``; everything here reads
that document, so a report can be rebuilt (or several split runs merged) on any machine:

    python benchmarks/report.py benchmarks/results/2026-11-30-h200x2.json [more.json ...]

Row fields (one row per system, variant, collective, size and mode):
    system, variant, collective, dtype, bytes, count, world_size, mode ("eager" | "graph"),
    time_us (max over ranks of each rank's median), time_us_min / time_us_max (spread of the
    repeats on the slowest rank), iters, reps, algbw_gbps, busbw_gbps, sms, sms_note,
    checked (True | False | None = not checkable), check_note, error (None or text),
    options (Purlin variant options), repeat_safe.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass
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
SYSTEMS = ("nccl", "symm_mem", "purlin")

# Alignment: every chunk a multiple of 16 bytes (the ldst atom moves 16-byte vectors).
ALIGN_BYTES = 16


# --------------------------------------------------------------------------- sizes


def quick_sizes() -> list[int]:
    return [1 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 256 * MiB]


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
    ``target_rep_us`` (2..100); fixed overheads (barriers, graph capture, the check's
    reference) about 40 ms per case.
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


# --------------------------------------------------------------------------- row access


def ok(row: dict) -> bool:
    """A row that ran and was not found wrong."""
    return row.get("error") is None and row.get("time_us") is not None and row.get("checked") is not False


def rows_for(rows: list[dict], **match) -> list[dict]:
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def one(rows: list[dict], **match) -> dict | None:
    found = [r for r in rows_for(rows, **match) if r.get("time_us") is not None or r.get("error")]
    return found[0] if found else None


def best_purlin(rows: list[dict], collective: str, nbytes: int, mode: str) -> dict | None:
    """The fastest correct explicit Purlin variant (``default`` excluded: it is a choice)."""
    cands = [r for r in rows_for(rows, system="purlin", collective=collective, bytes=nbytes, mode=mode)
             if r.get("variant") != "default" and ok(r) and r.get("checked") is True]
    return min(cands, key=lambda r: r["time_us"]) if cands else None


def best_of(rows: list[dict], system: str, collective: str, nbytes: int, mode: str) -> dict | None:
    cands = [r for r in rows_for(rows, system=system, collective=collective, bytes=nbytes, mode=mode) if ok(r)]
    return min(cands, key=lambda r: r["time_us"]) if cands else None


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


# --------------------------------------------------------------------------- merge


def merge(docs: list[dict]) -> dict:
    """Later documents win for the same (system, variant, collective, bytes, mode) key."""
    if not docs:
        return {"meta": {}, "rows": []}
    meta = dict(docs[0].get("meta", {}))
    keyed: dict[tuple, dict] = {}
    for doc in docs:
        for row in doc.get("rows", []):
            key = (row.get("system"), row.get("variant"), row.get("collective"), row.get("bytes"), row.get("mode"))
            keyed[key] = row
    if len(docs) > 1:
        meta["merged_from"] = [d.get("meta", {}).get("run_id") for d in docs]
        for d in docs[1:]:  # keep the best peak measurements any run made
            for k, v in (d.get("meta", {}).get("peaks") or {}).items():
                meta.setdefault("peaks", {}).setdefault(k, v)
    return {"meta": meta, "rows": list(keyed.values())}


# --------------------------------------------------------------------------- tuning table


def variant_options(row: dict) -> dict:
    opts = dict(row.get("options") or {})
    return {k: opts.get(k) for k in ("algorithm", "atom", "channels", "slices", "packed") if opts.get(k) is not None}


def tuning_table(doc: dict, *, prefer_mode: str = "graph") -> dict:
    """{collective: {world_size: [{max_bytes, variant, options...}, ...]}}.

    Per measured size the fastest correct explicit Purlin variant (``prefer_mode`` timings,
    eager where that mode has none); neighbouring sizes with the same winner are merged.
    An entry applies to calls of at most ``max_bytes``; the last has ``max_bytes: null``.
    """
    rows = doc.get("rows", [])
    ws = str(world_size_of(doc))
    table: dict[str, dict[str, list[dict]]] = {}
    for coll in collectives_of(rows):
        picks: list[tuple[int, dict]] = []
        for nbytes in sizes_of(rows, coll):
            best = best_purlin(rows, coll, nbytes, prefer_mode)
            if best is None:
                best = best_purlin(rows, coll, nbytes, "eager" if prefer_mode == "graph" else "graph")
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


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _pairs(rows: list[dict], collective: str, mode: str, lo: int, hi: int):
    """(bytes, nccl row, purlin default row) over the sizes in [lo, hi] with both present."""
    for nbytes in sizes_of(rows, collective):
        if not lo <= nbytes <= hi:
            continue
        n = one(rows, system="nccl", variant="nccl", collective=collective, bytes=nbytes, mode=mode)
        d = one(rows, system="purlin", variant="default", collective=collective, bytes=nbytes, mode=mode)
        if n is not None and d is not None:
            yield nbytes, n, d


def _speedup_target(name: str, rows: list[dict], mode: str, lo: int, hi: int, need: float,
                    metric: str, collectives: list[str]) -> Target:
    """Every collective: purlin default >= need x NCCL (time ratio, or busbw ratio)."""
    lines, missed, seen = [], False, 0
    for coll in collectives:
        worst = None
        for nbytes, n, d in _pairs(rows, coll, mode, lo, hi):
            if not ok(n):
                continue
            seen += 1
            r = ratio(n["time_us"], d["time_us"]) if ok(d) else 0.0  # same bytes: busbw ratio = time ratio
            if worst is None or r < worst[0]:
                worst = (r, nbytes, n, d)
        if worst is None:
            lines.append(f"{coll}: no data")
            continue
        r, nbytes, n, d = worst
        good = r >= need
        missed |= not good
        if metric == "time":
            detail = f"NCCL {_num(n['time_us'])} us, Purlin {_num(d.get('time_us'))} us"
        else:
            detail = f"NCCL {_num(n.get('busbw_gbps'))} GB/s, Purlin {_num(d.get('busbw_gbps'))} GB/s"
        why = "" if ok(d) else f" (Purlin row failed: {_why(d)})"
        lines.append(f"{coll}: {'met' if good else 'MISSED'}, worst {_fmt_ratio(r)} at {fmt_bytes(nbytes)} ({detail}){why}")
    status = "no data" if not seen else ("missed" if missed else "met")
    return Target(name, status, lines)


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


def _symm_target(rows: list[dict]) -> Target:
    name = "small (1-64 KiB), graph: Purlin all-reduce faster than the best torch symm_mem all-reduce"
    lines, missed, seen = [], False, 0
    for nbytes in sizes_of(rows, "allreduce"):
        if not KiB <= nbytes <= 64 * KiB:
            continue
        d = one(rows, system="purlin", variant="default", collective="allreduce", bytes=nbytes, mode="graph")
        s = best_of(rows, "symm_mem", "allreduce", nbytes, "graph")
        if d is None or s is None:
            continue
        seen += 1
        good = ok(d) and d["time_us"] < s["time_us"]
        missed |= not good
        lines.append(f"{fmt_bytes(nbytes)}: {'met' if good else 'MISSED'} (Purlin {_num(d.get('time_us'))} us, "
                     f"symm_mem {s['variant']} {s['time_us']:.2f} us)")
    return Target(name, "no data" if not seen else ("missed" if missed else "met"), lines)


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


def _large_target(rows: list[dict], meta: dict, collectives: list[str]) -> list[Target]:
    lo, hi = 256 * MiB, 1 * GiB
    base = _speedup_target("large (256 MiB, 1 GiB), graph: Purlin busbw >= NCCL busbw, every collective",
                           rows, "graph", lo, hi, 1.0, "busbw", collectives)
    peak, how = measured_peak_gbps(meta)
    name = "large (256 MiB, 1 GiB), graph: allgather / reduce_scatter / alltoall >= 1.1x NCCL and >= 90% of peak"
    lines, missed, seen = [], False, 0
    for coll in [c for c in BANDWIDTH_BOUND if c in collectives]:
        for nbytes, n, d in _pairs(rows, coll, "graph", lo, hi):
            if not ok(n):
                continue
            seen += 1
            bus = d.get("busbw_gbps") if ok(d) else None
            r = ratio(bus, n.get("busbw_gbps")) or 0.0
            frac = None if (peak is None or bus is None) else bus / peak
            good = r >= 1.1 and frac is not None and frac >= 0.9
            missed |= not good
            lines.append(f"{coll} {fmt_bytes(nbytes)}: {'met' if good else 'MISSED'} ({_fmt_ratio(r)} NCCL, "
                         f"{'-' if frac is None else f'{100 * frac:.0f}%'} of peak; Purlin {_num(bus)} GB/s, "
                         f"NCCL {_num(n.get('busbw_gbps'))} GB/s)")
    lines.append(f"peak: {_num(peak)} GB/s ({how or 'not measured'})")
    return [base, Target(name, "no data" if not seen else ("missed" if missed else "met"), lines)]


def _default_vs_best(rows: list[dict], collectives: list[str]) -> Target:
    name = "default within 10% of the best explicit variant (every collective, size and mode)"
    misses, seen = [], 0
    for coll in collectives:
        for nbytes in sizes_of(rows, coll):
            for mode in MODES:
                d = one(rows, system="purlin", variant="default", collective=coll, bytes=nbytes, mode=mode)
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
    """No threshold was given: report the SMs and memory the default call occupies."""
    lines = []
    for coll in collectives:
        sms = sorted({r["sms"] for r in rows_for(rows, system="purlin", variant="default", collective=coll)
                      if r.get("sms") is not None})
        nccl = sorted({r["sms"] for r in rows_for(rows, system="nccl", collective=coll) if r.get("sms") is not None})
        lines.append(f"{coll}: Purlin default SMs {sms or 'unknown'}; NCCL SMs {nccl or 'unknown (not exposed)'}")
    fp = meta.get("purlin_footprint") or {}
    if fp:
        lines.append("Purlin device memory: " + ", ".join(f"{k} {fmt_bytes(v) if isinstance(v, int) else v}"
                                                           for k, v in fp.items()))
    return Target("footprint (SMs and device memory of the default call)", "report", lines)


def targets(doc: dict) -> list[Target]:
    rows, meta = doc.get("rows", []), doc.get("meta", {})
    colls = collectives_of(rows)
    out = [
        _speedup_target("small (1-64 KiB), graph: Purlin >= 3x faster than NCCL, every collective",
                        rows, "graph", KiB, 64 * KiB, 3.0, "time", colls),
        _symm_target(rows),
        _speedup_target("small (1-64 KiB), eager: Purlin >= 2x faster than NCCL eager, every collective",
                        rows, "eager", KiB, 64 * KiB, 2.0, "time", colls),
        _speedup_target("medium (1-16 MiB), graph: Purlin busbw >= 2x NCCL busbw, every collective",
                        rows, "graph", MiB, 16 * MiB, 2.0, "busbw", colls),
        *_large_target(rows, meta, colls),
        _footprint(rows, meta, colls),
        _default_vs_best(rows, colls),
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


def collective_table(rows: list[dict], coll: str, mode: str) -> list[str]:
    with_symm = any(r.get("system") == "symm_mem" and r.get("collective") == coll for r in rows)
    head = ["size", "NCCL us", "NCCL alg/bus GB/s", "default us", "default alg/bus", "default vs NCCL",
            "best variant", "best us", "best alg/bus", "best vs NCCL", "default/best", "SMs NCCL/def/best"]
    if with_symm:
        head.append("symm_mem best us")
    head.append("checked")
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for nbytes in sizes_of(rows, coll):
        n = one(rows, system="nccl", variant="nccl", collective=coll, bytes=nbytes, mode=mode)
        d = one(rows, system="purlin", variant="default", collective=coll, bytes=nbytes, mode=mode)
        b = best_purlin(rows, coll, nbytes, mode)
        if n is None and d is None and b is None:
            continue
        nt = n["time_us"] if n is not None and ok(n) else None
        dt = d["time_us"] if d is not None and ok(d) else None
        bt = b["time_us"] if b is not None else None
        cells = [fmt_bytes(nbytes), _cell_time(n), _cell_bw(n), _cell_time(d), _cell_bw(d),
                 _fmt_ratio(ratio(nt, dt)), b["variant"] if b else "-", _cell_time(b), _cell_bw(b),
                 _fmt_ratio(ratio(nt, bt)), _fmt_ratio(ratio(dt, bt)),
                 f"{_cell_sms(n)}/{_cell_sms(d)}/{_cell_sms(b)}"]
        if with_symm:
            s = best_of(rows, "symm_mem", coll, nbytes, mode)
            cells.append(f"{_num(s['time_us'])} ({s['variant']})" if s else "-")
        checks = [r.get("checked") for r in rows_for(rows, collective=coll, bytes=nbytes, mode=mode)
                  if r.get("error") is None]
        cells.append("FAIL" if False in checks else ("yes" if checks and all(c is True for c in checks)
                                                      else "partial"))
        out.append("| " + " | ".join(cells) + " |")
    return out


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


def markdown(doc: dict) -> str:
    rows, meta = doc.get("rows", []), doc.get("meta", {})
    ws = world_size_of(doc)
    out = [f"# Collective benchmark: {meta.get('machine', '?')}, {meta.get('date', '?')}, R={ws}", ""]
    out += _meta_lines(meta) + [""]
    out += ["Times in microseconds: per call, the slowest rank's median. alg/bus: algorithm and bus",
            "bandwidth in GB/s (nccl-tests conventions; bytes = the larger of one rank's input and output).",
            "'vs NCCL' > 1 means faster than NCCL. 'best' is the fastest correct explicit Purlin variant.",
            "Latency claims use graph mode (CUDA-graph replays); eager includes the Python launch.", ""]
    out += ["## One-way peer bandwidth (same run)", ""] + _peak_lines(meta) + [""]
    wrong = [r for r in rows if r.get("checked") is False]
    if wrong:
        out += ["## CORRECTNESS FAILURES", ""]
        out += [f"- {r['system']}/{r['variant']} {r['collective']} {fmt_bytes(r['bytes'])} {r['mode']}: "
                f"{r.get('check_note', '')}" for r in wrong] + [""]
    for coll in collectives_of(rows):
        for mode in ("graph", "eager"):
            if not rows_for(rows, collective=coll, mode=mode):
                continue
            out += [f"## {coll}, {mode}", ""] + collective_table(rows, coll, mode) + [""]
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
    out += ["## Targets", ""]
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
    rows = doc.get("rows", [])
    colls = collectives_of(rows)
    if not colls:
        return []
    files = []
    for mode, metric, label in (("graph", "time_us", "time per call (us)"),
                                ("eager", "time_us", "time per call (us)"),
                                ("graph", "busbw_gbps", "bus bandwidth (GB/s)")):
        ncols = min(4, len(colls))
        nrows = math.ceil(len(colls) / ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False)
        for ax, coll in zip(axes.flat, colls):
            for name, series in _series(rows, coll, mode, metric).items():
                if series:
                    xs, ys = zip(*series)
                    ax.plot(xs, ys, marker="o", markersize=3, label=name)
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
            ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(colls):]:
            ax.axis("off")
        what = "latency" if metric == "time_us" else "busbw"
        fig.suptitle(f"{doc.get('meta', {}).get('machine', '')} R={world_size_of(doc)}: {what}, {mode}")
        fig.tight_layout()
        path = out_dir / f"{stem}-{what}-{mode}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


def _series(rows: list[dict], coll: str, mode: str, metric: str) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {"nccl": [], "purlin default": [], "purlin best": [], "symm_mem best": []}
    for nbytes in sizes_of(rows, coll):
        picks = {
            "nccl": one(rows, system="nccl", variant="nccl", collective=coll, bytes=nbytes, mode=mode),
            "purlin default": one(rows, system="purlin", variant="default", collective=coll, bytes=nbytes, mode=mode),
            "purlin best": best_purlin(rows, coll, nbytes, mode),
            "symm_mem best": best_of(rows, "symm_mem", coll, nbytes, mode),
        }
        for name, row in picks.items():
            if row is not None and ok(row) and row.get(metric):
                out[name].append((nbytes, row[metric]))
    return {k: v for k, v in out.items() if v}


# --------------------------------------------------------------------------- writing


def write_all(doc: dict, results_dir: Path, stem: str, *, plots: bool = True) -> dict[str, Path]:
    """``<stem>.json``, ``<stem>.md``, ``<stem>-tuning.json`` and the PNGs."""
    results_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": results_dir / f"{stem}.json", "md": results_dir / f"{stem}.md",
             "tuning": results_dir / f"{stem}-tuning.json"}
    _atomic_write(paths["json"], json.dumps(doc, indent=1, sort_keys=False, default=str))
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
