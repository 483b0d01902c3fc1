"""The run: every size of every collective, each case timed in every view, then checked."""

from __future__ import annotations

import statistics
import sys
import time

import torch

import purlin_api
import report
from benchlib.cases import Case, hier_case, hier_variant, nccl_case, nccl_symm_case, purlin_case, symm_cases
from benchlib.check import check_case, fresh_input
from benchlib.context import Ctx, PROBE_LIMIT_US, allreduce_max, barrier, guarded, sync
from benchlib.insitu import INSITU, insitu_row
from benchlib.meta import collect_meta
from benchlib.nccl_child import run_nccl_child
from benchlib.output import write_partial
from benchlib.peaks import measure_peaks
from benchlib.plan import HIER, NCCL_SYMM_COLLECTIVES, describe_plan, estimate_s, measured_sizes
from benchlib.setup import precompile, setup_hierarchical, setup_nccl_symm, setup_purlin, setup_symm
from benchlib.timing import calls_us, capture_graph, eager_iters, graph_replays, probe_us, time_eager, time_graph


def run_case(ctx: Ctx, lay: report.Layout, case: Case, x_time, salt: int) -> list[dict]:
    args = ctx.args
    base = {"system": case.system, "variant": case.variant, "collective": lay.collective, "dtype": "bfloat16",
            "bytes": lay.bytes, "count": lay.count, "world_size": ctx.world, "sms": case.sms,
            "sms_note": case.sms_note, "options": case.options or None, "repeat_safe": case.repeat_safe,
            "limit_us": round(report.limit_us(lay.collective, ctx.world, lay.bytes), 3)}
    every = ctx.plan.views(lay.bytes)
    views = [v for v in every if v[0] != INSITU]  # back to back; the in-situ views come last

    def view_base(mode, calls):
        return {**base, "mode": mode, "calls_per_graph": calls}

    def error_rows(msg):
        return [{**view_base(m, c), "time_us": None, "algbw_gbps": None, "busbw_gbps": None, "pct_of_limit": None,
                 "checked": None, "error": msg} for m, c in every]

    key = (case.system, case.variant, lay.collective)
    if key in ctx.hung:
        return error_rows(f"skipped: {ctx.hung[key]}")
    barrier(ctx)
    t_probe = time.time()
    ran, t1, err = guarded(ctx, lambda: (case.load(x_time), probe_us(case))[1])
    if not ran:
        if time.time() - t_probe > PROBE_LIMIT_US / 1e6 or "timeout" in err.lower() or "timed out" in err.lower():
            ctx.hung[key] = f"hung at {report.fmt_bytes(lay.bytes)}: {err[:300]}"
        return error_rows(f"probe: {err}")
    t1 = allreduce_max(ctx, [t1])[0]
    if t1 > PROBE_LIMIT_US:
        ctx.hung[key] = f"a call took {t1 / 1e3:.0f} ms at {report.fmt_bytes(lay.bytes)}"
        return error_rows(f"probe: one call took {t1 / 1e3:.0f} ms (a device-side wait timing out?)")
    iters = None  # eager calls per repeat (eager_iters), set when the eager view is timed
    replays: dict = {}
    measured, graph, errors = {}, None, {}
    for mode, calls in views:
        barrier(ctx)
        if mode == "eager":
            ran, value, err = guarded(ctx, lambda: calls_us(case.call, 20, warm=20))
            if ran:
                iters = eager_iters(allreduce_max(ctx, [value])[0], args.target_rep_us)
                barrier(ctx)
                ran, value, err = guarded(ctx, lambda: time_eager(case, iters, args.reps, lambda: barrier(ctx)))
        else:
            ran, value, err = guarded(ctx, lambda: capture_graph(case, calls))
            if ran:
                g, one_us = value
                # Every rank replays as often as the slowest rank's replay time says.
                replays[calls] = graph_replays(allreduce_max(ctx, [one_us])[0], args.target_rep_us)
                barrier(ctx)
                ran, value, err = guarded(ctx, lambda: time_graph(case, g, calls, args.reps, replays[calls]))
                if ran and graph is None:
                    graph = g  # the first (primary) graph that timed cleanly is checked
                del g
        if ran:
            measured[(mode, calls)] = value
        else:
            errors[(mode, calls)] = err
    # One collective for all numbers: per view, the max over ranks of each rank's median, of its
    # min and of its max over the repeats (three maxima taken separately: time_us_min and
    # time_us_max need not be the slowest-median rank's own).
    flat = []
    for view in views:
        v = measured.get(view)
        flat += [statistics.median(v), min(v), max(v)] if v else [-1.0, -1.0, -1.0]
    flat = allreduce_max(ctx, flat) if flat else []  # --modes insitu alone: no back-to-back view

    barrier(ctx)
    try:
        checks = check_case(ctx, lay, case, salt, graph)
    except Exception as e:  # noqa: BLE001
        checks = {m: (None, f"check failed to run: {type(e).__name__}: {e}") for m in ctx.plan.modes}
    del graph

    rows = []
    for i, (mode, calls) in enumerate(views):
        if (mode, calls) in errors:
            rows.append({**view_base(mode, calls), "time_us": None, "algbw_gbps": None, "busbw_gbps": None,
                         "pct_of_limit": None, "checked": None, "error": f"{mode}: {errors[(mode, calls)]}"})
            continue
        med, lo, hi = flat[3 * i: 3 * i + 3]
        checked, note = checks.get(mode, checks.get("eager", (None, "not checked")))
        if mode == "graph" and calls != views[[m for m, _ in views].index("graph")][1]:
            note = f"{note} (checked on the {ctx.plan.calls[0]}-call graph)"
        row = {**view_base(mode, calls), "time_us": med, "time_us_min": lo, "time_us_max": hi,
               "iters": iters if mode == "eager" else calls, "reps": args.reps,
               "replays": replays.get(calls) if mode == "graph" else None,
               "algbw_gbps": report.algbw_gbps(lay.bytes, med),
               "busbw_gbps": report.busbw_gbps(lay.collective, ctx.world, lay.bytes, med),
               "pct_of_limit": report.pct_of_limit(lay.collective, ctx.world, lay.bytes, med),
               "checked": checked, "check_note": note, "error": None}
        rows.append(row)
        if checked is False:
            _failed(ctx, case, lay, mode, calls, note)
    for k, (_, calls) in enumerate(v for v in every if v[0] == INSITU):
        barrier(ctx)
        row = insitu_row(ctx, lay, case, calls, salt * 10 + k + 7, base)
        rows.append(row)
        if row.get("checked") is False:
            _failed(ctx, case, lay, INSITU, calls, row.get("check_note"))
    return rows


def _failed(ctx: Ctx, case: Case, lay: report.Layout, mode: str, calls, note) -> None:
    msg = (f"CHECK FAILED: {case.system}/{case.variant} {lay.collective} "
           f"{report.fmt_bytes(lay.bytes)} {mode}{'' if calls is None else f' x{calls}'}: {note}")
    ctx.failures.append(msg)
    if ctx.rank == 0:
        print("!" * 8 + " " + msg, file=sys.stderr, flush=True)


def run(ctx: Ctx) -> None:
    plan, args = ctx.plan, ctx.args
    collect_meta(ctx)
    ctx.log(describe_plan(plan, args, ctx.world))
    ctx.meta["estimate_s"] = round(estimate_s(plan, args))
    if args.nccl_child:
        ctx.nccl_here = tuple(plan.nccl)
        if "symm" in plan.nccl:
            lays = [report.layout(c, ctx.world, s) for c in plan.collectives if c in NCCL_SYMM_COLLECTIVES
                    for s in plan.sizes]
            if lays:
                setup_nccl_symm(ctx, 2 * max(l.in_elems for l in lays), 2 * max(l.out_elems for l in lays))
    elif "nccl" in plan.systems:
        ctx.nccl_here = tuple(v for v in plan.nccl if v == "default")
        run_nccl_child(ctx)  # first, while nothing else of this run holds the GPUs or the CPUs

    need_symm = "symm_mem" in plan.systems or not args.no_peak
    if need_symm:
        ar_max = max((report.layout("allreduce", ctx.world, s).bytes for s in plan.sizes), default=0)
        symm_bytes = max(ar_max if "allreduce" in plan.collectives else 0, 0 if args.no_peak else args.peak_bytes)
        setup_symm(ctx, max(symm_bytes, report.MiB))
    if "purlin" in plan.systems or HIER in plan.systems:
        if not args.no_precompile:
            precompile(ctx)
    if "purlin" in plan.systems:
        setup_purlin(ctx)
    if HIER in plan.systems and plan.hier:
        setup_hierarchical(ctx)
    if not args.no_peak:
        ctx.meta["peaks"] = measure_peaks(ctx)
        best, how = report.measured_peak_gbps(ctx.meta)
        ctx.log(f"one-way peak: {report._num(best)} GB/s ({how})")
    write_partial(ctx)

    skipped = []
    own = {c: set(measured_sizes(plan.sizes, c, ctx.world)) for c in plan.collectives}  # one call, one row
    for si, nbytes in enumerate(plan.sizes):
        elapsed = allreduce_max(ctx, [time.time() - ctx.t0])[0]
        if args.budget_s and elapsed > args.budget_s:
            skipped = plan.sizes[si:]
            ctx.meta["stopped_by_budget"] = {"elapsed_s": round(elapsed, 1), "budget_s": args.budget_s,
                                             "skipped_bytes": skipped}
            ctx.log(f"budget {args.budget_s:.0f} s exceeded ({elapsed:.0f} s): skipping "
                    + ", ".join(report.fmt_bytes(s) for s in skipped))
            break
        for ci, coll in enumerate(plan.collectives):
            if nbytes in own[coll]:
                run_size(ctx, coll, nbytes, salt=1000 * si + 10 * ci)
        write_partial(ctx)


def run_size(ctx: Ctx, coll: str, nbytes: int, salt: int) -> None:
    lay = report.layout(coll, ctx.world, nbytes)
    plan = ctx.plan
    ran, bufs, err = guarded(ctx, lambda: (torch.empty(lay.in_elems, dtype=torch.bfloat16, device=ctx.device),
                                           torch.empty(lay.out_elems, dtype=torch.bfloat16, device=ctx.device),
                                           fresh_input(ctx, lay.in_elems, salt)))
    if not ran:
        ctx.log(f"{coll} {report.fmt_bytes(lay.bytes)}: buffers failed: {err}")
        return
    X, Y, x_time = bufs
    cases: list[Case] = []
    build_errors = []
    if "nccl" in plan.systems:
        for variant in ctx.nccl_here:
            if variant != "symm":
                cases.append(nccl_case(ctx, coll, lay, X, Y, variant))
            elif coll in NCCL_SYMM_COLLECTIVES:
                if ctx.nsymm is None:
                    why = (ctx.meta.get("nccl_symm") or {}).get("error", "unavailable")
                    build_errors.append(("nccl", "symm", f"NCCL symmetric buffers: {why}"))
                else:
                    try:
                        cases.append(nccl_symm_case(ctx, coll, lay))
                    except Exception as e:  # noqa: BLE001
                        build_errors.append(("nccl", "symm", f"{type(e).__name__}: {e}"))
    if "symm_mem" in plan.systems and coll == "allreduce":
        if ctx.symm is None:
            why = (ctx.meta.get("symm_mem") or {}).get("error", "unavailable")
            build_errors += [("symm_mem", v, f"symmetric memory: {why}") for v in ("one-shot", "two-shot")]
        else:
            try:
                cases += symm_cases(ctx, lay, Y)
            except Exception as e:  # noqa: BLE001
                build_errors.append(("symm_mem", "one-shot", f"{type(e).__name__}: {e}"))
    heap_bufs = None
    if "purlin" in plan.systems and any(v.heap and v.applies(coll) and (coll, v.name) in ctx.colls
                                        for v in plan.variants):
        # Zero-copy buffers: a collective allocation in Purlin's symmetric heap (every rank is here).
        ran, heap_bufs, err = guarded(ctx, lambda: (purlin_api.empty(ctx.comm, lay.in_elems, torch.bfloat16),
                                                    purlin_api.empty(ctx.comm, lay.out_elems, torch.bfloat16)))
        if not ran:
            heap_bufs = None
            build_errors += [("purlin", v.name, f"comm.empty: {err}") for v in plan.variants
                             if v.heap and v.applies(coll)]
    if "purlin" in plan.systems:
        for v in plan.variants:
            if v.applies(coll) and (coll, v.name) in ctx.colls:
                if v.heap and heap_bufs is None:
                    continue
                try:
                    cases.append(purlin_case(ctx, coll, v, *(heap_bufs if v.heap else (X, Y))))
                except Exception as e:  # noqa: BLE001
                    build_errors.append(("purlin", v.name, f"{type(e).__name__}: {e}"))
    if HIER in plan.systems:
        for g in plan.hier:
            if (coll, g) in ctx.hcolls:  # a failed load has its error row already: no row per size
                try:
                    cases.append(hier_case(ctx, coll, g, lay, X, Y))
                except Exception as e:  # noqa: BLE001
                    build_errors.append((HIER, hier_variant(g), f"{type(e).__name__}: {e}"))
    for system, variant, err in build_errors:
        for mode, calls in plan.views(lay.bytes):
            ctx.add({"system": system, "variant": variant, "collective": coll, "dtype": "bfloat16",
                     "bytes": lay.bytes, "count": lay.count, "world_size": ctx.world, "mode": mode,
                     "calls_per_graph": calls, "time_us": None, "checked": None, "error": err})
    for k, case in enumerate(cases):
        for row in run_case(ctx, lay, case, x_time, salt * 100 + k + 1):
            ctx.add(row)
    progress(ctx, coll, lay.bytes)
    del X, Y, x_time, cases, heap_bufs  # the heap blocks are freed alike on every rank
    sync()
    for g in plan.hier:  # this size's scratch (its graphs are gone): memory stays flat over the sizes
        if (coll, g) in ctx.hcolls:
            purlin_api.free_scratch(ctx.hcolls[(coll, g)])
    torch.cuda.empty_cache()


def progress(ctx: Ctx, coll: str, nbytes: int) -> None:
    if ctx.rank != 0:
        return
    rows = [r for r in ctx.rows if r.get("collective") == coll and r.get("bytes") == nbytes]
    parts = []
    for mode in ("graph", "eager"):
        sub = report.select(rows, mode)
        n = report.best_nccl(sub, coll, nbytes, mode)
        d = report.one(sub, system="purlin", variant="default", mode=mode)
        z = report.one(sub, system="purlin", variant="zerocopy", mode=mode)
        b = report.best_purlin(sub, coll, nbytes, mode)
        s = report.best_of(sub, "symm_mem", coll, nbytes, mode)
        bit = (f"{mode[0]}: nccl {n['variant'] + ' ' + report._cell_time(n) if n else '-'} "
               f"default {report._cell_time(d)}" + (f" zc {report._cell_time(z)}" if z else ""))
        if b:
            bit += f" best {b['variant']} {report._num(b['time_us'])}"
        if s:
            bit += f" symm {report._num(s['time_us'])}"
        for h in sorted(report.rows_for(sub, system=HIER), key=lambda r: r["variant"]):
            bit += f" hier/{h['variant']} {report._cell_time(h)}"
        parts.append(bit)
    errs = sum(1 for r in rows if r.get("error"))
    wrong = sum(1 for r in rows if r.get("checked") is False)
    tail = (f" [{errs} error rows]" if errs else "") + (f" [{wrong} WRONG]" if wrong else "")
    ctx.log(f"{coll:>14} {report.fmt_bytes(nbytes):>8} us | " + " | ".join(parts) + tail)
