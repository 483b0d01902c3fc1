"""The README's results table from a benchmark JSON (benchmarks/bench.py's <stem>.json).

    python3 scripts/readme_table.py [benchmarks/results/<stem>.json]

Without an argument: the newest run in benchmarks/results/runs.csv whose JSON is there.  Only
rows that ran, have a real time and were not found wrong are quoted (benchmarks/report.py's
``ok``).

Per collective: Purlin's default call beside the fastest NCCL setting of each size (named),
graph mode with the largest calls per graph the run has for that size (the caption says which,
and the repeats, from the rows quoted), times in us up to 1 MiB and bus bandwidth above; every
cell is "Purlin / best NCCL setting (speed-up)".  Prints Markdown.
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
from benchlib.sizes import fmt_bytes  # noqa: E402

PROG = "readme_table.py"
RESULTS = BENCHMARKS / "results"

SIZES = (1024, 65536, 1 << 20, 16 << 20, 256 << 20)
HEADERS = ("1 KiB graph, us", "64 KiB graph, us", "1 MiB graph, us", "16 MiB busbw GB/s", "256 MiB busbw GB/s")
ORDER = ("allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast", "reduce", "gather", "scatter")


def _number(value: float) -> str:
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def quoted(rows: list[dict]) -> dict[tuple[str, int], tuple[dict, str, dict]]:
    """(collective, bytes) -> (Purlin's default row, the best NCCL variant's name, its row) for
    every cell the table fills: graph rows that are ``ok``, at the most calls per graph measured
    for that collective and size."""
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
    out = {}
    for key, mine in purlin.items():
        if key[0] in ORDER and key[1] in SIZES and nccl.get(key):
            name, best = min(nccl[key].items(), key=lambda kv: kv[1]["time_us"])
            out[key] = (mine, name, best)
    return out


def table(rows: list[dict]) -> str:
    cells_of = quoted(rows)
    lines = ["| collective | " + " | ".join(HEADERS) + " |", "|---" * (len(HEADERS) + 1) + "|"]
    for collective in ORDER:
        cells = []
        for size in SIZES:
            if (collective, size) not in cells_of:
                cells.append("-")
                continue
            mine, name, best = cells_of[collective, size]
            ratio = best["time_us"] / mine["time_us"]
            if size <= 1 << 20:
                cells.append(f"{_number(mine['time_us'])} / {_number(best['time_us'])} {name} ({ratio:.2f}x)")
            elif mine.get("busbw_gbps") is None or best.get("busbw_gbps") is None:
                cells.append("-")  # a timed row without its bandwidth: nothing to quote
            else:
                cells.append(f"{mine['busbw_gbps']:.0f} / {best['busbw_gbps']:.0f} {name} ({ratio:.2f}x)")
        lines.append(f"| {collective} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def calls_text(cells: dict) -> str:
    """The calls per graph the quoted cells were timed with, as the caption says it: "100 calls
    per graph up to 1 MiB, 20 above" where one count serves the small sizes and another the rest."""
    per_size: dict[int, set] = defaultdict(set)
    for (_, size), (mine, _, best) in cells.items():
        per_size[size] |= {mine.get("calls_per_graph"), best.get("calls_per_graph")}
    if not per_size:
        return "no graph rows quoted"
    sizes = sorted(per_size)
    if any(len(c) > 1 or None in c for c in per_size.values()):
        known = sorted(c for cs in per_size.values() for c in cs if c is not None)
        return (f"{'/'.join(map(str, sorted(set(known))))} calls per graph (the most each size has)" if known
                else "calls per graph not recorded")
    counts = [next(iter(per_size[s])) for s in sizes]
    if len(set(counts)) == 1:
        return f"{counts[0]} calls per graph"
    split = next(i for i in range(1, len(counts)) if counts[i] != counts[0])
    if len(set(counts[split:])) == 1:
        return f"{counts[0]} calls per graph up to {fmt_bytes(sizes[split - 1])}, {counts[split]} above"
    return "calls per graph: " + ", ".join(f"{c} at {fmt_bytes(s)}" for s, c in zip(sizes, counts))


def reps_text(cells: dict) -> str:
    """The repeats the quoted medians are of ("median of 3 repeats"), from the rows themselves."""
    reps = sorted({r.get("reps") for mine, _, best in cells.values() for r in (mine, best)} - {None})
    if not reps:
        return "median over repeats"
    return f"median of {reps[0] if len(reps) == 1 else f'{reps[0]}-{reps[-1]}'} repeats"


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


def caption(path: Path, meta: dict, rows: list[dict]) -> str:
    """Which run the table is, the baselines' settings, and how the quoted cells were timed
    (calls per graph and repeats, read from the rows the table quotes)."""
    cells = quoted(rows)
    return (f"From `benchmarks/results/{path.stem}.md` (commit {meta.get('git_commit', '?')}, "
            f"{meta.get('date', '?')}, {meta.get('machine', '?')}, {meta.get('world_size', '?')} ranks, "
            f"{meta.get('dtype', '?')}): Purlin's default call / the fastest NCCL {meta.get('nccl', '?')} setting "
            f"(torch {meta.get('torch', '?')}; `default`, `nomix` = NCCL_GRAPH_MIXING_SUPPORT=0, `symm` = "
            f"mixing off and NCCL symmetric buffers; NCCL_NVLS_ENABLE=0) and the speed-up. Graph replay, "
            f"{calls_text(cells)}; the slowest rank's {reps_text(cells)}; bus "
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
    print(caption(path, doc.get("meta", {}), doc["rows"]) + "\n")
    print(table(doc["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
