"""Fold a benchmark's tuning table into the committed one, up to a size.

    python3 scripts/retune.py benchmarks/results/<run>-tuning.json --up-to 65536

``benchmarks/bench.py`` writes ``<stem>-tuning.json`` (per collective and world size, the
fastest correct variant of each measured size, adjacent equal choices merged).  A ``--quick``
run measures six sizes and a few variants; a full run (1 KiB..1 GiB, every variant) made the
committed ``purlinc/runtime/tuning.json``.  When only the small-message kernels changed, this
takes the new run's buckets up to ``--up-to`` bytes and keeps the committed buckets above it,
so the large sizes keep the full sweep's choices.  Records the sources in the file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "purlinc" / "runtime" / "tuning.json"
FIELDS = ("algorithm", "atom", "channels", "slices", "packed")


def bucket_of(measured: dict) -> dict:
    """A committed-table bucket from a bench tuning row."""
    out = {"max_bytes": measured["max_bytes"], "algorithm": measured["algorithm"], "atom": measured["atom"],
           "channels": measured.get("channels") or 1, "slices": measured.get("slices") or 1,
           "packed": bool(measured.get("packed", False))}
    out["measured_us"] = measured.get("time_us")
    out["variant"] = measured.get("variant")
    return out


def fold(committed: list[dict], measured: list[dict], up_to: int) -> list[dict]:
    """Measured buckets covering sizes <= up_to, then the committed buckets above up_to."""
    small = []
    for row in measured:
        bucket = bucket_of(row)
        last = row["max_bytes"] is None or row["max_bytes"] >= up_to
        if last:
            bucket["max_bytes"] = up_to  # the measured choice for the sizes up to up_to it covers
        small.append(bucket)
        if last:
            break
    large = [dict(b) for b in committed if b["max_bytes"] is None or b["max_bytes"] > up_to]
    merged = small + large
    # Adjacent buckets with the same schedule serve one range: keep the larger bound.
    out: list[dict] = []
    for bucket in merged:
        if out and all(out[-1][f] == bucket[f] for f in FIELDS):
            out[-1] = {**bucket, "measured_us": bucket.get("measured_us")}
            continue
        out.append(bucket)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("measured", type=Path, help="a bench <stem>-tuning.json")
    ap.add_argument("--up-to", type=int, required=True, help="largest call size (bytes) taken from the new run")
    ap.add_argument("--collectives", default=None, help="comma-separated: only these (default: every one measured)")
    ap.add_argument("--table", type=Path, default=TABLE)
    args = ap.parse_args()
    measured = json.loads(args.measured.read_text())
    table = json.loads(args.table.read_text())
    only = set(args.collectives.split(",")) if args.collectives else None
    for collective, worlds in measured.items():
        if only is not None and collective not in only:
            continue
        for world, rows in worlds.items():
            committed = table["tables"].get(collective, {}).get(world, [])
            table["tables"].setdefault(collective, {})[world] = fold(committed, rows, args.up_to)
    which = f" ({args.collectives})" if args.collectives else ""
    table["source"] = f"{args.measured.name}{which} up to {args.up_to} bytes; then: " + table["source"]
    args.table.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {args.table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
