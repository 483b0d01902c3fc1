"""The README's results table from a benchmark JSON (benchmarks/bench.py's <stem>.json).

    python3 scripts/readme_table.py benchmarks/results/<stem>.json

Per collective: Purlin's default call beside the fastest NCCL setting of each size (named),
graph mode with 100 calls per graph up to 1 MiB and 20 above (the largest count the run has
for that size), times in us up to 1 MiB and bus bandwidth above; every cell is
"Purlin / best NCCL setting (speed-up)".  Prints Markdown.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

SIZES = (1024, 65536, 1 << 20, 16 << 20, 256 << 20)
HEADERS = ("1 KiB graph, us", "64 KiB graph, us", "1 MiB graph, us", "16 MiB busbw GB/s", "256 MiB busbw GB/s")
ORDER = ("allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast", "reduce", "gather", "scatter")


def _number(value: float) -> str:
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def table(rows: list[dict]) -> str:
    graph = [r for r in rows if r.get("mode") == "graph" and r.get("time_us") and not r.get("error")]
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
            else:
                cells.append(f"{mine['busbw_gbps']:.0f} / {best['busbw_gbps']:.0f} {name} ({ratio:.2f}x)")
        lines.append(f"| {collective} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    doc = json.loads(open(sys.argv[1]).read())
    print(table(doc["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
