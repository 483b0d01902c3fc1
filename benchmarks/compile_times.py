"""Compile times: cold (cache disabled, a fresh process) and cached, per target.

    python benchmarks/compile_times.py [--ranks 8] [--repeats 3] [--collectives allgather allreduce]

Each measurement runs in a new Python process, so "cold" includes loading NVRTC and the
templates, as a first ``purlin.load`` would.  Times are of ``purlinc.pipeline.compile``
only (parse -> check -> lower -> verify -> generate -> NVRTC or cache), not of Python's
own start-up.  Writes benchmarks/results/<date>-compile-times.json and .md.
Targets: cold under 2 s, cached under 50 ms.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGETS = (("sm_80", "ldst"), ("sm_90", "ldst"), ("sm_90", "tma"), ("sm_100", "ldst"), ("sm_100", "tma"))
COLD_TARGET_S = 2.0
CACHED_TARGET_S = 0.050


def _measure_once(args) -> None:
    """Child process: compile once (twice with --warm) and print the times as JSON."""
    from purlinc import pipeline
    from purlinc.atom import nvrtc

    path = REPO / "examples" / f"{args.collective}.pln"
    times = []
    for _ in range(2 if args.warm else 1):
        start = time.perf_counter()
        pipeline.compile(path, world_size=args.ranks, arch=args.arch, atom=args.atom)
        times.append(time.perf_counter() - start)
    print(json.dumps({"seconds": times, "nvrtc_compiles": nvrtc.STATS.compiles, "cache_hits": nvrtc.STATS.cache_hits}))


def _child(collective: str, ranks: int, arch: str, atom: str, env: dict, warm: bool = False) -> dict:
    command = [sys.executable, __file__, "--child", "--collective", collective, "--ranks", str(ranks),
               "--arch", arch, "--atom", atom] + (["--warm"] if warm else [])
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"measurement failed: {' '.join(command)}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _versions() -> dict:
    from importlib import metadata

    import purlinc
    from purlinc.atom.nvrtc import nvrtc_version

    return {"purlinc": purlinc.__version__, "nvrtc": nvrtc_version(), "cuda-bindings": metadata.version("cuda-bindings"),
            "python": platform.python_version()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--collective", default="allgather", help=argparse.SUPPRESS)
    parser.add_argument("--arch", default="sm_90", help=argparse.SUPPRESS)
    parser.add_argument("--atom", default="ldst", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--collectives", nargs="+", default=["allgather", "allreduce"])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    if args.child:
        _measure_once(args)
        return 0

    rows = []
    with tempfile.TemporaryDirectory(prefix="purlin-bench-cache-") as cache:
        cold_env = dict(os.environ, PURLIN_NO_CACHE="1", PURLIN_CACHE_DIR=cache)
        warm_env = {k: v for k, v in os.environ.items() if k != "PURLIN_NO_CACHE"} | {"PURLIN_CACHE_DIR": cache}
        for collective in args.collectives:
            for arch, atom in TARGETS:
                cold = [_child(collective, args.ranks, arch, atom, cold_env)["seconds"][0] for _ in range(args.repeats)]
                _child(collective, args.ranks, arch, atom, warm_env)  # fills the cache
                cached = []
                warm = []
                for _ in range(args.repeats):
                    result = _child(collective, args.ranks, arch, atom, warm_env, warm=True)
                    assert result["nvrtc_compiles"] == 0, "a cached compile ran NVRTC"
                    cached.append(result["seconds"][0])
                    warm.append(result["seconds"][1])
                row = {
                    "collective": collective, "ranks": args.ranks, "arch": arch, "atom": atom,
                    "cold_s": statistics.median(cold), "cached_first_s": statistics.median(cached),
                    "cached_warm_s": statistics.median(warm),
                    "cold_runs": cold, "cached_first_runs": cached, "cached_warm_runs": warm,
                }
                rows.append(row)
                print(f"{collective:12s} R={args.ranks} {arch:7s} {atom:5s} cold {row['cold_s']:.2f} s  "
                      f"cached {row['cached_first_s'] * 1e3:.1f} ms (first in process), "
                      f"{row['cached_warm_s'] * 1e3:.1f} ms (warm)", flush=True)

    today = datetime.date.today().isoformat()
    record = {
        "date": today, "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()})",
        "versions": _versions(), "repeats": args.repeats, "statistic": "median",
        "targets": {"cold_s": COLD_TARGET_S, "cached_s": CACHED_TARGET_S}, "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{today}-compile-times.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        f"# Compile times, {today}",
        "",
        f"Machine: {record['machine']}; versions: "
        + ", ".join(f"{k} {v}" for k, v in record["versions"].items()) + ".",
        f"Median of {args.repeats} fresh processes each. Cold: cache disabled (target < {COLD_TARGET_S:g} s). "
        f"Cached: the CUBIN comes from the disk cache, first call in a process and a second call "
        f"(target < {CACHED_TARGET_S * 1e3:g} ms). Times cover parse, check, lower, verify, generate and NVRTC/cache.",
        "",
        "| collective | R | arch | atom | cold | cached (first) | cached (warm) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(f"| {row['collective']} | {row['ranks']} | {row['arch']} | {row['atom']} | {row['cold_s']:.2f} s "
                     f"| {row['cached_first_s'] * 1e3:.1f} ms | {row['cached_warm_s'] * 1e3:.1f} ms |")
    (args.out / f"{today}-compile-times.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / f'{today}-compile-times.json'} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
