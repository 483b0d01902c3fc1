"""Writing results: partial JSON as the run goes, the full report once, and the guards (a
global timeout, SIGTERM) that write what was measured before exiting."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
import traceback

import report
from benchlib.context import Ctx


def document(ctx: Ctx) -> dict:
    with ctx.lock:
        rows = list(ctx.rows)
    meta = {k: v for k, v in ctx.meta.items() if not k.startswith("_")}
    doc = {"meta": dict(meta, elapsed_s=round(time.time() - ctx.t0, 1)), "rows": rows}
    if ctx.args.merge:
        # rows: this run's win; meta: this run's, with the best peaks of all and what it lacks
        # (a split run measures the peaks and the footprint once) from the merged files
        others = _merged_files(ctx, doc)
        merged_meta = report.merge([doc, *others])["meta"]
        doc = {"meta": dict(merged_meta, merged_from=[str(p) for p in ctx.args.merge]),
               "rows": report.merge([*others, doc])["rows"]}
    return doc


def _merged_files(ctx: Ctx, this_run: dict) -> list[dict]:
    """The --merge documents (checked when the run started); one that has gone bad since, or
    that ran on other GPUs than this run (known only now), is left out with a line on stderr:
    the rows this run measured are written either way."""
    docs = []
    for path in ctx.args.merge:
        try:
            other = report.load_results(path)
            report.check_mergeable([this_run, other], ["this run", path])
            docs.append(other)
        except report.ResultsError as error:
            print(f"bench: not merged: {error}", file=sys.stderr)
    return docs


def write_partial(ctx: Ctx) -> None:
    if ctx.rank != 0:
        return
    if ctx.args.nccl_child:
        if ctx.args.child_out:
            report._atomic_write(ctx.args.child_out, report.results_json(document(ctx)))
        return
    try:
        ctx.args.results_dir.mkdir(parents=True, exist_ok=True)
        path = ctx.args.results_dir / f"{ctx.stem}.json"
        report._atomic_write(path, report.results_json(document(ctx), indent=1))
        if ctx.args.out:
            ctx.args.out.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, ctx.args.out / path.name)
    except Exception as e:  # noqa: BLE001
        print(f"bench: partial write failed: {e}", file=sys.stderr)


def finish(ctx: Ctx, status: str) -> None:
    """Rank 0 writes everything once; a second caller (main thread vs. the timeout guard) waits."""
    if ctx.rank != 0:
        return
    with ctx.finish_lock:
        if ctx.finished:
            return
        ctx.finished = True
        _finish(ctx, status)


def _finish(ctx: Ctx, status: str) -> None:
    ctx.meta["status"] = status
    ctx.meta.pop("_keep", None)
    doc = document(ctx)
    if ctx.args.nccl_child:  # the parent merges these rows and writes the reports
        if ctx.args.child_out:
            report._atomic_write(ctx.args.child_out, report.results_json(doc))
        return
    try:
        paths = report.write_all(doc, ctx.args.results_dir, ctx.stem, plots=not ctx.args.no_plots)
        if ctx.args.out:
            ctx.args.out.mkdir(parents=True, exist_ok=True)
            for p in paths.values():
                shutil.copy(p, ctx.args.out / p.name)
        print(report.markdown(doc), flush=True)
        print("wrote: " + ", ".join(str(p) for p in paths.values())
              + (f" (copied to {ctx.args.out})" if ctx.args.out else ""), flush=True)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        write_partial(ctx)
    if ctx.failures:
        print(f"{len(ctx.failures)} CORRECTNESS FAILURES:\n  " + "\n  ".join(ctx.failures[:30]),
              file=sys.stderr, flush=True)


def install_guards(ctx: Ctx) -> None:
    def on_timeout():
        ctx.log(f"global timeout {ctx.args.timeout_s:.0f} s reached: writing what was measured and exiting")
        finish(ctx, f"timeout after {ctx.args.timeout_s:.0f} s (global guard)")
        sys.stdout.flush()
        os._exit(124)

    # Rank 0 writes the results; the others wait a little longer, so that their exit (which makes
    # torchrun stop every worker) cannot cut rank 0's writing short.
    grace = 0.0 if ctx.rank == 0 else 60.0
    timer = threading.Timer(ctx.args.timeout_s + grace, on_timeout)
    timer.daemon = True
    timer.start()

    def on_term(signum, _frame):
        if ctx.finished:  # already writing the results: let that complete
            return
        finish(ctx, f"killed by signal {signum}")
        sys.stdout.flush()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
