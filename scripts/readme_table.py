"""The README's results table from a benchmark JSON (benchmarks/bench.py's <stem>.json).

    python3 scripts/readme_table.py [benchmarks/results/<stem>.json]

Without an argument: the newest run in benchmarks/results/runs.csv whose JSON is there.  Only
rows that ran, have a real time and were not found wrong are quoted (benchmarks/report.py's
``ok``).

Per collective: Purlin's default call beside the fastest NCCL setting of each size (named),
graph mode with 100 calls per graph up to 1 MiB and 20 above (the largest count the run has
for that size), times in us up to 1 MiB and bus bandwidth above; every cell is
"Purlin / best NCCL setting (speed-up)".  Prints Markdown.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:  # benchlib: the one reader of a bench.py result
    sys.path.insert(0, str(BENCHMARKS))

from benchlib.files import load_results, ResultsError  # noqa: E402
from benchlib.rows import normalize, ok  # noqa: E402

PROG = "readme_table.py"
RESULTS = BENCHMARKS / "results"

SIZES = (1024, 65536, 1 << 20, 16 << 20, 256 << 20)
HEADERS = ("1 KiB graph, us", "64 KiB graph, us", "1 MiB graph, us", "16 MiB busbw GB/s", "256 MiB busbw GB/s")
ORDER = ("allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast", "reduce", "gather", "scatter")


def _number(value: float) -> str:
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def table(rows: list[dict]) -> str:
    graph = [r for r in map(normalize, rows) if r.get("mode") == "graph" and ok(r)]
    calls = defaultdict(int)  # (collective, bytes) -> most calls per graph measured
    for r in graph:
        calls[r["collective"], r["bytes"]] = max(calls[r["collective"], r["bytes"]], r.get("calls_per_graph") or 0)
    purlin, nccl = {}, defaultdict(dict)
    for r in graph:
        key = (r["collective"], r["bytes"])
        if (r.get("calls_per_graph") or 0) != calls[key]:
            continue
        if r["system"] == "purlin" and r["variant"] == "default":
            purlin[key] = r
        elif r["system"] == "nccl":
            nccl[key][r["variant"]] = r
    lines = ["| collective | " + " | ".join(HEADERS) + " |", "|---" * (len(HEADERS) + 1) + "|"]
    for collective in ORDER:
        cells = []
        for size in SIZES:
            key = (collective, size)
            mine, theirs = purlin.get(key), nccl.get(key)
            if mine is None or not theirs:
                cells.append("-")
                continue
            name, best = min(theirs.items(), key=lambda kv: kv[1]["time_us"])
            ratio = best["time_us"] / mine["time_us"]
            if size <= 1 << 20:
                cells.append(f"{_number(mine['time_us'])} / {_number(best['time_us'])} {name} ({ratio:.2f}x)")
            elif mine.get("busbw_gbps") is None or best.get("busbw_gbps") is None:
                cells.append("-")  # a timed row without its bandwidth: nothing to quote
            else:
                cells.append(f"{mine['busbw_gbps']:.0f} / {best['busbw_gbps']:.0f} {name} ({ratio:.2f}x)")
        lines.append(f"| {collective} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def newest() -> Path:
    """The newest run (runs.csv is in date and run order) whose JSON is committed."""
    try:
        runs = list(csv.DictReader((RESULTS / "runs.csv").open(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise ResultsError(f"{RESULTS / 'runs.csv'}: cannot read the list of runs ({error})") from None
    for run in reversed(runs):
        path = RESULTS / f"{run.get('run')}.json"
        if run.get("run") and path.exists():
            return path
    raise ResultsError(f"{RESULTS / 'runs.csv'}: no run has its JSON in {RESULTS}")


def caption(path: Path, meta: dict) -> str:
    """Which run the table is, and the baselines' settings."""
    return (f"From `benchmarks/results/{path.stem}.md` (commit {meta.get('git_commit', '?')}, "
            f"{meta.get('date', '?')}, {meta.get('machine', '?')}, {meta.get('world_size', '?')} ranks, "
            f"{meta.get('dtype', '?')}): Purlin's default call / the fastest NCCL {meta.get('nccl', '?')} setting "
            f"(torch {meta.get('torch', '?')}; `default`, `nomix` = NCCL_GRAPH_MIXING_SUPPORT=0, `symm` = "
            "mixing off and NCCL symmetric buffers; NCCL_NVLS_ENABLE=0) and the speed-up. Graph replay, "
            "100 calls per graph up to 1 MiB, 20 above; the slowest rank's median of 3 repeats; bus "
            "bandwidth by nccl-tests' conventions.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description="The README's results table from a benchmarks/bench.py "
                                 "results JSON, as Markdown.")
    ap.add_argument("json", nargs="?", type=Path, default=None,
                    help="a results JSON (default: the newest run of benchmarks/results/runs.csv whose JSON is there)")
    args = ap.parse_args(argv)
    try:
        path = args.json or newest()
        doc = load_results(path)
    except ResultsError as error:  # a user's file, not a bug: one line, no traceback
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    print(caption(path, doc.get("meta", {})) + "\n")
    print(table(doc["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
