"""Reading results rows: selecting views, the best row of a system, merging runs, the tuning
table.  No GPU, no torch."""

from __future__ import annotations

import math

from benchlib.sizes import COLLECTIVES, INSITU, limit_us, valid_time


# --------------------------------------------------------------------------- row access

PRIMARY_CALLS_PER_GRAPH = 20  # graph rows the tables and targets quote first


# What a row's time implies: cleared with it when the time is no timing.
DERIVED_FROM_TIME = ("time_us_min", "time_us_max", "algbw_gbps", "busbw_gbps", "pct_of_limit")
BAD_TIME = "bad timing"  # how an error row made from a bad time_us starts


def finite_only(value):
    """``value`` with every NaN or infinite float (at any depth) replaced by None: results
    files are strict JSON, and a number that is not finite says nothing."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_only(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_only(v) for v in value]
    return value


def row_time_valid(row: dict) -> bool:
    """A measured time: finite and above zero; an in-situ row's is a difference (the step with
    the call minus the step without), which noise may put at or below zero: finite is enough."""
    t = row.get("time_us")
    if row.get("mode") == INSITU:
        return isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
    return valid_time(t)


def timing_checked(row: dict) -> dict:
    """A row whose ``time_us`` is there but is no timing (``row_time_valid``) becomes an error
    row (the time and what was derived from it cleared; ``bad_time`` keeps what was given), so
    it is never a best row, never meets a target and never reaches the tuning table."""
    t = row.get("time_us")
    if t is None or row_time_valid(row):
        return row
    given = repr(t)
    kind = "a finite number" if row.get("mode") == INSITU else "a finite positive number"
    why = f"{BAD_TIME}: time_us {given} is not {kind}"
    return {**row, **{k: None for k in DERIVED_FROM_TIME if k in row}, "time_us": None, "bad_time": given,
            "error": row.get("error") or why}


def normalize(row: dict) -> dict:
    """Rows of older runs: NCCL's plain row was variant ``nccl``; no calls_per_graph.  Every
    row: a bad time made an error row (``timing_checked``), other non-finite numbers None."""
    if row.get("system") == "nccl" and row.get("variant") == "nccl":
        row = {**row, "variant": "default"}
    if "calls_per_graph" not in row:
        row = {**row, "calls_per_graph": None}
    return finite_only(timing_checked(row))


def bad_timings(rows: list[dict]) -> int:
    """How many rows had a time that is not a finite positive number (now error rows)."""
    return sum(1 for r in rows if r.get("bad_time") is not None)


def ok(row: dict) -> bool:
    """A row that ran, has a real time (``row_time_valid``) and was not found wrong."""
    return row.get("error") is None and row_time_valid(row) and row.get("checked") is not False


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


# Purlin rows that are a choice, not one pinned schedule: the default load (called on ordinary
# tensors, on heap buffers, or captured with PURLIN_GRAPH_BUFFERS=stage|register).
NOT_SCHEDULES = ("default", "zerocopy", "graph-staged", "graph-registered")


def best_purlin(rows: list[dict], collective: str, nbytes: int, mode: str) -> dict | None:
    """The fastest correct explicit Purlin variant (``NOT_SCHEDULES`` excluded: choices;
    loopback rows too: one GPU says nothing about the link a schedule is tuned for)."""
    cands = [r for r in rows_for(rows, system="purlin", collective=collective, bytes=nbytes, mode=mode)
             if r.get("variant") not in NOT_SCHEDULES and not r.get("loopback") and ok(r) and r.get("checked") is True]
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
    """a / b of two times; None unless both are real times (a ratio of NaN, inf or 0 means nothing)."""
    return a / b if valid_time(a) and valid_time(b) else None


def with_limits(row: dict) -> dict:
    """``limit_us`` and ``pct_of_limit`` filled in (rows of older runs lack them)."""
    if row.get("bytes") and row.get("collective") in COLLECTIVES and row.get("world_size"):
        lim = limit_us(row["collective"], row["world_size"], row["bytes"])
        row = {**row, "limit_us": round(lim, 3),
               "pct_of_limit": None if not ok(row) else round(100.0 * lim / row["time_us"], 1)}
    return row


KEY_FIELDS = ("system", "variant", "collective", "bytes", "mode", "calls_per_graph")


def row_key(row: dict) -> tuple:
    """What names a measurement: a run has one row per key, and a merge keeps the later one."""
    return tuple(row.get(k) for k in KEY_FIELDS)


def peak_gbps(measurement) -> float | None:
    """The highest finite GB/s of one peak measurement (``meta.peaks[method]``); None for an
    error or no points."""
    points = measurement.get("points") if isinstance(measurement, dict) else None
    speeds = [p.get("gbps") for p in points or [] if isinstance(p, dict)]
    speeds = [g for g in speeds if isinstance(g, (int, float)) and not isinstance(g, bool) and math.isfinite(g) and g > 0]
    return max(speeds) if speeds else None


def best_peaks(metas: list[dict]) -> dict:
    """Per peak method, the best measurement any run made: one with points over an error, the
    higher GB/s between two (the first on a tie)."""
    best: dict = {}
    for meta in metas:
        for method, m in (meta.get("peaks") or {}).items():
            if method not in best or (peak_gbps(m) or -1.0) > (peak_gbps(best[method]) or -1.0):
                best[method] = m
    return best


def merge(docs: list[dict]) -> dict:
    """Later documents win for the same (system, variant, collective, bytes, mode, calls) key
    (``row_key``; one document has one row per key: benchlib.files.check_shape).  The meta is
    the first document's, with each peak the best any run measured (``best_peaks``) and what
    the first lacks (the footprint, say) taken from the others."""
    if not docs:
        return {"meta": {}, "rows": []}
    metas = [d.get("meta", {}) for d in docs]
    meta = dict(metas[0])
    keyed: dict[tuple, dict] = {}
    for doc in docs:
        for row in doc.get("rows", []):
            row = normalize(row)
            keyed[row_key(row)] = row
    if len(docs) > 1:
        meta["merged_from"] = [m.get("run_id") for m in metas]
        for m in metas[1:]:
            for k, v in m.items():
                if meta.get(k) is None and v is not None:
                    meta[k] = v
        peaks = best_peaks(metas)
        if peaks:
            meta["peaks"] = peaks
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


