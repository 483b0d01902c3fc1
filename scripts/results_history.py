"""The compact measurement history of benchmarks/bench.py's runs, merged from their JSON into
benchmarks/results/runs.csv (one row per run: date, commit, machine, versions) and
benchmarks/results/history.csv (one row per run, collective, size, mode, system and variant).

    python3 scripts/results_history.py benchmarks/results/<stem>.json [...]

The history keeps the rows a comparison needs: Purlin's default call and its zero-copy form,
every NCCL setting and torch symmetric memory (the explicit Purlin variants and the
hierarchical rows stay in each run's JSON), and of those only the rows that ran, have a real
time and were not found wrong (benchmarks/report.py's ``ok``).  Every file must be a bench.py
result (benchmarks/benchlib/files.py's ``load_results``).  A run already there is replaced whole
(its rows the new file lacks go too), so adding the newest run, or re-adding a run, is one command; older runs' full JSON and reports stay in
git's history.  Times are the slowest rank's median in us, bus bandwidth in GB/s.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:  # benchlib: the one reader of a bench.py result
    sys.path.insert(0, str(BENCHMARKS))

from benchlib.files import load_results, ResultsError  # noqa: E402
from benchlib.rows import normalize, ok  # noqa: E402

PROG = "results_history.py"
RESULTS = BENCHMARKS / "results"
HISTORY, RUNS = RESULTS / "history.csv", RESULTS / "runs.csv"
COLUMNS = ("run", "collective", "bytes", "mode", "calls_per_graph", "system", "variant", "time_us", "busbw_gbps")
RUN_COLUMNS = ("run", "date", "commit", "machine", "world_size", "torch", "nccl")
KEY = ("run", "collective", "bytes", "mode", "calls_per_graph", "system", "variant")


def kept(row: dict) -> bool:
    return row["system"] in ("nccl", "symm_mem") or (row["system"] == "purlin" and row["variant"] in ("default", "zerocopy"))


def _number(value) -> str:
    return "" if value is None else f"{value:.4g}"


def rows_of(path: Path) -> tuple[dict, list[dict]]:
    """One run's description and its kept, measured rows (``ok``: no error, a real time, not
    found wrong); ResultsError when ``path`` is no bench.py result."""
    doc = load_results(path)
    meta = doc.get("meta", {})
    run = {"run": path.stem, "date": meta.get("date", ""), "commit": meta.get("git_commit", ""),
           "machine": meta.get("machine", ""), "world_size": meta.get("world_size", ""),
           "torch": meta.get("torch", ""), "nccl": meta.get("nccl", "")}
    out = []
    for row in map(normalize, doc["rows"]):
        if not ok(row) or not kept(row):
            continue
        out.append({"run": path.stem, "collective": row["collective"], "bytes": row["bytes"], "mode": row["mode"],
                    "calls_per_graph": row.get("calls_per_graph") or "", "system": row["system"],
                    "variant": row["variant"], "time_us": _number(row["time_us"]),
                    "busbw_gbps": _number(row.get("busbw_gbps"))})
    return run, out


def merge(existing: list[dict], new: list[dict], key: tuple[str, ...]) -> list[dict]:
    merged = {tuple(str(r[k]) for k in key): r for r in existing}
    merged.update({tuple(str(r[k]) for k in key): r for r in new})
    return list(merged.values())


def _read(path: Path, columns: tuple[str, ...]) -> list[dict]:
    """The rows of one of the CSV files (none when it is not there); ResultsError when it
    cannot be read or lacks a column."""
    if not path.exists():
        return []
    try:
        with path.open(encoding="utf-8", newline="") as file:
            reader = csv.DictReader(file)
            rows = list(reader)
            missing = [c for c in columns if c not in (reader.fieldnames or [])]
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise ResultsError(f"{path}: cannot read it ({error})") from None
    if missing:
        raise ResultsError(f"{path}: no column {', '.join(missing)}; expected {','.join(columns)}")
    return rows


def _write(path: Path, columns, rows) -> None:
    with path.open("w", encoding="utf-8", newline="") as out:
        writer = csv.DictWriter(out, columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description="Merge benchmarks/bench.py results JSON files into "
                                 "benchmarks/results/runs.csv and history.csv.")
    ap.add_argument("json", nargs="+", type=Path, help="results JSON files of bench.py runs")
    args = ap.parse_args(argv)
    try:  # every file read and checked before either CSV is written
        loaded = [rows_of(path) for path in args.json]
        old_runs, old_rows = _read(RUNS, RUN_COLUMNS), _read(HISTORY, COLUMNS)
    except ResultsError as error:  # a user's file, not a bug: one line, no traceback
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    runs = merge(old_runs, [run for run, _ in loaded], ("run",))
    runs.sort(key=lambda r: (r["date"], [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", r["run"])]))
    order = {r["run"]: i for i, r in enumerate(runs)}
    added = {run["run"] for run, _ in loaded}  # a run given again replaces all of its rows
    rows = merge([r for r in old_rows if r["run"] not in added], [row for _, rows in loaded for row in rows], KEY)
    rows.sort(key=lambda r: (order[r["run"]], r["collective"], int(r["bytes"]), r["mode"], str(r["calls_per_graph"]),
                             r["system"], r["variant"]))
    _write(RUNS, RUN_COLUMNS, runs)
    _write(HISTORY, COLUMNS, rows)
    print(f"{HISTORY}: {len(rows)} rows; {RUNS}: {len(runs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
