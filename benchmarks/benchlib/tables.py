"""The Markdown report: per-collective tables, NCCL and hierarchical tables, ``markdown(doc)``."""

from __future__ import annotations

from benchlib.rows import (
    bad_timings, best_nccl, best_of, best_purlin, collectives_of, ok, one, prepared, ratio, rows_for, select, sizes_of,
    views, world_size_of,
)
from benchlib.sizes import fmt_bytes, HIER, INSITU, LAUNCH_US, limit_us, ONE_WAY_GBPS, SIGNAL_US, TWO_WAY_GBPS
from benchlib.targets import _default, _fmt_ratio, _num, targets


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


def insitu_counts(rows: list[dict]) -> list[int]:
    return sorted({r["calls_per_graph"] for r in rows if r.get("mode") == INSITU and r.get("calls_per_graph")})


def insitu_table(rows: list[dict], calls: int) -> list[str]:
    """What each system adds per call between a producer and a consumer kernel (benchlib/insitu.py),
    every system and variant side by side, with the step's time without the collective."""
    sub = [r for r in rows if r.get("mode") == INSITU and r.get("calls_per_graph") == calls]
    names = []
    for r in sub:
        name = f"{r['system']}/{r['variant']}"
        if name not in names:
            names.append(name)
    if not names:
        return []
    out = ["| collective | size | without us | " + " | ".join(f"{n} adds us" for n in names) + " | checked |",
           "|" + "---|" * (len(names) + 4)]
    for coll in collectives_of(sub):
        for nbytes in sizes_of(sub, coll):
            here = [r for r in sub if r["collective"] == coll and r["bytes"] == nbytes]
            cells = [_cell_time(next((r for r in here if f"{r['system']}/{r['variant']}" == n), None)) for n in names]
            bare = [r["base_us"] for r in here if r.get("base_us") is not None]
            checked = "FAIL" if any(r.get("checked") is False for r in here) else (
                "yes" if here and all(r.get("checked") for r in here if not r.get("error")) else "-")
            out.append(f"| {coll} | {fmt_bytes(nbytes)} | {_num(min(bare)) if bare else '-'} | "
                       + " | ".join(cells) + f" | {checked} |")
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


def bad_timing_line(n: int) -> str:
    """The report's count of rows whose time was no timing (benchlib.rows.timing_checked)."""
    return (f"{n} row{'' if n == 1 else 's'} with a time that is not a finite positive number (NaN, "
            "infinite, zero, negative or not a number): error rows, never a best, a target or a tuning entry")


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
    for calls in insitu_counts(rows):
        out += [f"## In situ: what a call adds between a producer and a consumer kernel ({calls} steps per graph)",
                "", "Each step: an elementwise kernel writes the input, the collective, an elementwise kernel reads",
                "the output, all plain launches in one CUDA graph; 'adds' = step with minus step without the",
                "collective ('without': the latter). Loopback rows (one GPU) say nothing about link speed.", ""]
        out += insitu_table(rows, calls) + [""]
    errors = [r for r in rows if r.get("error")]
    if errors:
        out += ["## Errors", ""]
        bad = bad_timings(rows)
        if bad:
            out += [f"- {bad_timing_line(bad)}"]
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


