"""Benchmark bookkeeping that needs no GPU and no torch: sizes, buffer layouts, bandwidth
conventions, and turning a results JSON into Markdown, plots and a tuning table.

``bench.py`` measures and writes ``{"meta": {...}, "rows": [...]}``; everything here reads
that document, so a report can be rebuilt (or several split runs merged) on any machine:

    python benchmarks/report.py benchmarks/results/2026-11-30-h200x2.json [more.json ...]

Row fields (one row per system, variant, collective, size, mode and calls per graph):
    system, variant, collective, dtype, bytes, count, world_size, mode ("eager" | "graph"),
    calls_per_graph (graph rows: calls captured in one graph, the same for every system;
    eager rows: None), time_us (max over ranks of each rank's median over its repeats),
    time_us_min / time_us_max (max over ranks of each rank's fastest / slowest repeat: each
    taken separately, so the three may come from different ranks), iters, reps, replays (graph rows:
    back-to-back replays of the graph per timed repeat, benchlib.timing.graph_replays), algbw_gbps,
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
(broadcast, reduce, gather, scatter); all measured on 2 x H200 (NV18) by bandwidth probes.  It is
a floor for graph replays; eager rows carry the same figure (their launch costs more).

The code lives in ``benchlib``: ``sizes`` (sizes, layouts, bandwidth, the wire model), ``rows``
(selecting, merging, the tuning table), ``targets``, ``tables`` (the Markdown), ``plots`` and
``files``.  This module is their front door and command line; every name it ever had is here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # benchlib sits beside this file (run as a script or loaded by path)
    sys.path.insert(0, _HERE)

from benchlib.sizes import (  # noqa: F401  (re-exported)
    algbw_gbps, ALIGN_BYTES, BANDWIDTH_BOUND, busbw_factor, busbw_gbps, COLLECTIVES, estimate_case_s,
    estimate_run_s, fmt_bytes, full_sizes, GiB, HIER, INSITU, KiB, LAUNCH_US, Layout, layout, limit_us, MiB, MODES,
    ONE_WAY_GBPS, parse_bytes, parse_cpu_list, pct_of_limit, quick_sizes, REDUCE_COLLECTIVES, ROOTED,
    select_sizes, SIGNAL_US, SYSTEMS, TWO_WAY, TWO_WAY_GBPS, wire_bytes, finite_positive, valid_time,
)
from benchlib.rows import (  # noqa: F401  (re-exported)
    best_nccl, best_of, best_purlin, collectives_of, finite_only, graph_counts, merge, normalize, NOT_SCHEDULES, ok, one,
    prepared, PRIMARY_CALLS_PER_GRAPH, ratio, rows_for, select, sizes_of, timing_checked, tuning_table,
    variant_options, views, with_limits, world_size_of,
)
from benchlib.targets import (  # noqa: F401  (re-exported)
    measured_peak_gbps, Target, targets, _fmt_ratio, _num,
)
from benchlib.tables import (  # noqa: F401  (re-exported)
    collective_table, hier_load_errors, hier_variants, hierarchical_table, insitu_counts, insitu_table, markdown, nccl_table,
    _cell_time,
)
from benchlib.plots import (  # noqa: F401  (re-exported)
    plot, _series,
)
from benchlib.files import (  # noqa: F401  (re-exported)
    check_mergeable, check_shape, load_results, median, ResultsError, results_json, write_all, _atomic_write,
)
from benchlib.rows import bad_timings  # noqa: F401  (re-exported)
from benchlib.tables import bad_timing_line  # noqa: F401  (re-exported)

PROG = "report.py"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description="Rebuild (and merge) benchmark reports from results JSON files.")
    ap.add_argument("json", nargs="+", type=Path, help="results JSON files; later ones win on equal keys")
    ap.add_argument("--out-dir", type=Path, default=None, help="default: the first file's directory")
    ap.add_argument("--stem", default=None, help="output name stem (default: the first file's)")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    out_dir = args.out_dir or args.json[0].parent
    stem = args.stem or (args.json[0].stem if len(args.json) == 1 else args.json[0].stem + "-merged")
    try:
        docs = [load_results(p) for p in args.json]
        check_mergeable(docs, args.json)
        _check_output(out_dir, stem)
    except ResultsError as error:  # a user's file, not a bug: one line, no traceback
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    doc = merge(docs)
    try:
        paths = write_all(doc, out_dir, stem, plots=not args.no_plots)
    except OSError as error:
        print(f"{PROG}: error: {error.filename or out_dir}: cannot write the report ({error.strerror or error})",
              file=sys.stderr)
        return 2
    print(markdown(doc))
    print("wrote: " + ", ".join(str(p) for p in paths.values()))
    bad = bad_timings(prepared(doc)["rows"])
    if bad:
        print(f"{PROG}: {bad_timing_line(bad)}", file=sys.stderr)
    return 0


def _check_output(out_dir: Path, stem: str) -> None:
    """Where the report goes: a folder (made if missing) and a plain file name stem."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ResultsError(f"{out_dir}: --out-dir is a file, not a folder")
    if not stem or stem in (".", "..") or "/" in stem or "\\" in stem or "\0" in stem:
        raise ResultsError(f"--stem {stem!r}: should be a file name stem, without a folder")


if __name__ == "__main__":
    raise SystemExit(main())
