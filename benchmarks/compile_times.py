"""Compile times: cold (cache disabled, a fresh process) and cached, per target.

    python benchmarks/compile_times.py [--ranks 8] [--repeats 3] [--collectives allgather allreduce]

Each measurement runs in a new Python process:

* cold: PURLIN_NO_CACHE=1 (neither cache level), ``import purlinc.pipeline`` + one compile;
* cached first: the front cache holds the entry; ``import purlinc.pipeline`` + one compile
  (what a fresh ``purlin.load`` / ``purlinc compile`` pays beyond Python's own start-up);
* cached warm: a second compile in that process;
* CLI: the wall time of a whole ``python -m purlinc.cli compile`` process on a cache hit
  (Python start-up, argument parsing, artifacts written), for reference.

The children run a snapshot of purlinc, its grammar and templates (copied to a temporary
folder first), so edits made to the working tree while the benchmark runs cannot change
the package hash under it.  Writes benchmarks/results/<date>-compile-times.json and .md.
Targets: cold under 2 s, cached under 50 ms.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
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
    """Child process: import + compile once (and once more with --warm); print JSON."""
    start = time.perf_counter()
    from purlinc import pipeline

    path = REPO / "examples" / f"{args.collective}.pln"
    times = []
    for _ in range(2 if args.warm else 1):
        pipeline.compile(path, world_size=args.ranks, arch=args.arch, atom=args.atom)
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
    from purlinc.atom import nvrtc

    print(json.dumps({"seconds": times, "nvrtc_compiles": nvrtc.STATS.compiles, "cache_hits": nvrtc.STATS.cache_hits,
                      "front_hits": pipeline.STATS.front_hits, "lowerings": pipeline.STATS.lowerings}))


def _child(collective: str, ranks: int, arch: str, atom: str, env: dict, warm: bool = False) -> dict:
    command = [sys.executable, __file__, "--child", "--collective", collective, "--ranks", str(ranks),
               "--arch", arch, "--atom", atom] + (["--warm"] if warm else [])
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"measurement failed: {' '.join(command)}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cli_seconds(collective: str, ranks: int, arch: str, atom: str, env: dict, out: str) -> float:
    command = [sys.executable, "-m", "purlinc.cli", "compile", str(REPO / "examples" / f"{collective}.pln"),
               "--ranks", str(ranks), "--arch", arch, "--atom", atom, "-o", out]
    start = time.perf_counter()
    # cwd: not the repository, whose purlinc/ would shadow the snapshot for ``-m``
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=Path(out).parent, timeout=600)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"measurement failed: {' '.join(command)}\n{done.stderr}")
    return seconds


def _snapshot(into: Path) -> Path:
    """purlinc with its grammar and templates inside (the wheel's layout), found first on PYTHONPATH."""
    shutil.copytree(REPO / "purlinc", into / "purlinc", ignore=shutil.ignore_patterns("__pycache__"))
    for folder in ("grammar", "templates"):
        shutil.copytree(REPO / folder, into / "purlinc" / folder)
    return into


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
    with tempfile.TemporaryDirectory(prefix="purlin-bench-") as scratch:
        cache = str(Path(scratch) / "cache")
        code = _snapshot(Path(scratch) / "code")
        base_env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(code), os.environ.get("PYTHONPATH")))))
        cold_env = dict(base_env, PURLIN_NO_CACHE="1", PURLIN_CACHE_DIR=cache)
        warm_env = {k: v for k, v in base_env.items() if k != "PURLIN_NO_CACHE"} | {"PURLIN_CACHE_DIR": cache}
        for collective in args.collectives:
            for arch, atom in TARGETS:
                cold = [_child(collective, args.ranks, arch, atom, cold_env)["seconds"][0] for _ in range(args.repeats)]
                _child(collective, args.ranks, arch, atom, warm_env)  # fills the cache
                cached = []
                warm = []
                for _ in range(args.repeats):
                    result = _child(collective, args.ranks, arch, atom, warm_env, warm=True)
                    assert result["nvrtc_compiles"] == 0, "a cached compile ran NVRTC"
                    assert result["front_hits"] == 2 and result["lowerings"] == 0, "a cached compile missed"
                    cached.append(result["seconds"][0])
                    warm.append(result["seconds"][1])
                # The CLI passes explicit options (another front key): its first run fills the cache.
                cli = [_cli_seconds(collective, args.ranks, arch, atom, warm_env, str(Path(scratch) / "out"))
                       for _ in range(args.repeats + 1)][1:]
                row = {
                    "collective": collective, "ranks": args.ranks, "arch": arch, "atom": atom,
                    "cold_s": statistics.median(cold), "cached_first_s": statistics.median(cached),
                    "cached_warm_s": statistics.median(warm), "cli_cached_s": statistics.median(cli),
                    "cold_runs": cold, "cached_first_runs": cached, "cached_warm_runs": warm, "cli_cached_runs": cli,
                }
                rows.append(row)
                print(f"{collective:12s} R={args.ranks} {arch:7s} {atom:5s} cold {row['cold_s']:.2f} s  "
                      f"cached {row['cached_first_s'] * 1e3:.1f} ms (first in process), "
                      f"{row['cached_warm_s'] * 1e3:.1f} ms (warm); CLI process {row['cli_cached_s'] * 1e3:.0f} ms",
                      flush=True)

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
        f"Median of {args.repeats} fresh processes each. Cold: both cache levels disabled, import + compile "
        f"(target < {COLD_TARGET_S:g} s). Cached: a front-cache hit (no parse, lower, verify, codegen or NVRTC), "
        f"first call in a fresh process including `import purlinc.pipeline`, and a second call "
        f"(target < {CACHED_TARGET_S * 1e3:g} ms). CLI: wall time of a whole `python -m purlinc.cli compile` "
        f"process on a cache hit (interpreter start-up, the CLI's own parse/check, writing the artifacts), "
        f"for reference.",
        "",
        "| collective | R | arch | atom | cold | cached (first) | cached (warm) | CLI process, cached |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(f"| {row['collective']} | {row['ranks']} | {row['arch']} | {row['atom']} | {row['cold_s']:.2f} s "
                     f"| {row['cached_first_s'] * 1e3:.1f} ms | {row['cached_warm_s'] * 1e3:.1f} ms "
                     f"| {row['cli_cached_s'] * 1e3:.0f} ms |")
    def verdict(name: str, key: str, limit: float) -> str:
        missed = [" ".join((r["collective"], r["arch"], r["atom"])) for r in rows if r[key] >= limit]
        text = f"- {name}: met for {len(rows) - len(missed)} of {len(rows)}"
        return text + (f" (missed: {', '.join(missed)})" if missed and len(missed) < len(rows) else "")

    lines += ["", "Targets (medians):", verdict(f"cold < {COLD_TARGET_S:g} s", "cold_s", COLD_TARGET_S),
              verdict(f"cached first call < {CACHED_TARGET_S * 1e3:g} ms", "cached_first_s", CACHED_TARGET_S),
              verdict(f"cached warm < {CACHED_TARGET_S * 1e3:g} ms", "cached_warm_s", CACHED_TARGET_S)]
    (args.out / f"{today}-compile-times.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / f'{today}-compile-times.json'} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
