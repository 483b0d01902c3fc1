"""Issue #11's targets over several benchmark runs: how often each was met, and the range of
every checked point's numbers (benchmarks/bench.py's <stem>.json files, one per run).

    python3 scripts/target_ranges.py benchmarks/results/2026-12-01-h200x2-run{19,20,21}.json

One section per target (``benchmarks/report.targets``, the same checks as each run's report):
in how many runs it held, then per point (collective and size) how many runs met it and each
measure as "min-max" over the runs.  Prints Markdown.  The runs must share a world size (the
targets are per world size), as for a merged report.  A run without a point leaves it out of
that point's count (the count says "of N").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import report  # noqa: E402

PROG = "target_ranges.py"


def _span(values: list[float]) -> str:
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return report._num(lo) if report._num(lo) == report._num(hi) else f"{report._num(lo)}-{report._num(hi)}"


def ranges(docs: list[dict]) -> str:
    """The Markdown summary of ``docs`` (bench JSON documents, one per run)."""
    per_run = [report.targets(doc) for doc in docs]
    names = [t.name for t in per_run[0]]
    out = []
    for i, name in enumerate(names):
        runs = [targets[i] for targets in per_run if i < len(targets) and targets[i].name == name]
        judged = [t for t in runs if t.status in ("met", "missed")]
        if not judged:
            continue  # reports, and targets no run has data for
        met = sum(t.status == "met" for t in judged)
        out += [f"## {name}", "", f"Met in {met} of {len(judged)} runs.", ""]
        points: dict[str, list[tuple[bool, dict]]] = {}
        for t in judged:
            for point, good, values in t.points:
                points.setdefault(point, []).append((good, values))
        if not points:
            continue  # a target judged without points (default against best): its runs' reports list it
        measures = list(dict.fromkeys(m for seen in points.values() for _, values in seen for m in values))
        out.append("| point | met | " + " | ".join(measures) + " |")
        out.append("|---" * (len(measures) + 2) + "|")
        for point, seen in points.items():
            cells = [_span([v[m] for _, v in seen if v.get(m) is not None]) for m in measures]
            out.append(f"| {point} | {sum(good for good, _ in seen)} of {len(seen)} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description="Issue #11's targets over several benchmarks/bench.py "
                                 "runs, as Markdown.")
    ap.add_argument("json", nargs="+", type=Path, help="results JSON files, one per run")
    args = ap.parse_args(argv)
    try:
        docs = [report.load_results(path) for path in args.json]
        report.check_mergeable(docs, args.json)  # the targets are per world size: never pool R=2 with R=4
    except report.ResultsError as error:  # a user's file, not a bug: one line, no traceback
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    print(ranges(docs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
