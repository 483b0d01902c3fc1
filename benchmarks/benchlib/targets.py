"""Issue targets judged from results rows (``targets(doc)``): each a status, its lines and
its checked points."""

from __future__ import annotations

from dataclasses import dataclass, field

from benchlib.rows import best_nccl, best_purlin, collectives_of, ok, one, prepared, ratio, rows_for, select, sizes_of
from benchlib.sizes import BANDWIDTH_BOUND, COLLECTIVES, GiB, KiB, MODES, MiB, finite_positive, fmt_bytes


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
            if finite_positive(g) and (best is None or g > best):
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


