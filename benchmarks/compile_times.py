"""Compile-side figures of issue #10, cold (an empty compile cache) and warm (the cache that
the cold run filled), each in fresh processes:

    python benchmarks/compile_times.py [--only NAME ...] [--limit-scale X] [--targets]

* ``compile``: ``purlinc compile examples/allreduce.pln --ranks 8 --channels 64 --arch sm_90``
  (a whole CLI process; target: cold <= 5 s);
* ``cu_size``: the generated ``.cu`` of allreduce at R=8 with 1 and with 128 channels
  (target: 128 channels <= 1.3x the size with 1);
* ``tuned``: what a plain ``load()`` at R=8 prepares before loading modules on a GPU, for
  every size bucket (``purlinc.runtime.tuned.prepare_tuned``: parse, check, lower and
  verify each bucket), and the same plus every bucket's kernel for (bfloat16, sum)
  (generate + NVRTC, the buckets concurrently as ``Tuned.warm`` does): everything up to,
  not including, ``cuModuleLoad``.  Measured in the child from before ``import purlinc`` (targets: cold <= 10 s, warm <= 0.5 s);
* ``check72``: ``purlinc check FILE --ranks 72`` for the 8 standard examples (target <= 10 s each);
* ``check_alltoall``: ``purlinc check examples/alltoall.pln --ranks 1..64`` (target <= 60 s);
* ``--targets``: also the per-target compile times of allgather and allreduce at R=8
  (every (arch, atom), cold and cached), as measured before.

Every measurement runs under a time limit (``--limit-scale`` multiplies them); one that runs
out is recorded as a timeout with its limit, and the run goes on.  The children run a
snapshot of purlinc, its grammar and templates (copied to a temporary folder first), so edits
to the working tree during the run cannot change the package under it.  Writes
``benchmarks/results/<date>-compile-times.json`` and ``.md`` with the date, machine and git
commit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))  # benchlib

from benchlib import argtypes  # noqa: E402

EXAMPLES = REPO / "examples"
STANDARD = ("allgather", "allreduce", "alltoall", "broadcast", "gather", "reduce", "reduce_scatter", "scatter")
TARGETS = (("sm_80", "ldst"), ("sm_90", "ldst"), ("sm_90", "tma"), ("sm_100", "ldst"), ("sm_100", "tma"))
GOALS = {"compile_cold_s": 5.0, "cu_ratio": 1.3, "tuned_cold_s": 10.0, "tuned_warm_s": 0.5, "check72_s": 10.0,
         "check_alltoall_s": 60.0}
SECTIONS = ("compile", "cu_size", "tuned", "check72", "check_alltoall")


# ---- children (run in fresh processes) ---------------------------------------------------

def _child_tuned(args) -> dict:
    """Prepare a plain load()'s buckets (and, with --kernels, their kernels) as a fresh process would."""
    start = time.perf_counter()
    from purlinc import pipeline
    from purlinc.dtypes import DType, ReduceOp
    from purlinc.runtime.tuned import prepare_tuned

    prepared, _ = prepare_tuned(EXAMPLES / f"{args.collective}.pln", args.ranks, arch=args.arch)
    schedules_s = time.perf_counter() - start
    kernels = 0
    if args.kernels:  # every distinct bucket's kernel (kernel atoms only), compiled concurrently
        from purlinc.runtime.tuned import compile_tuned_kernels

        kernels = compile_tuned_kernels(prepared, DType.BFLOAT16, ReduceOp.SUM)
    total_s = time.perf_counter() - start
    from purlinc.atom import nvrtc

    return {"seconds": total_s, "schedules_s": schedules_s, "buckets": [p.compiled.options.key() for p in prepared],
            "kernels": kernels, "stats": _stats(pipeline), "nvrtc_compiles": nvrtc.STATS.compiles}


def _child_cu(args) -> dict:
    start = time.perf_counter()
    from purlinc import pipeline

    artifact = pipeline.compile(EXAMPLES / f"{args.collective}.pln", world_size=args.ranks, arch=args.arch,
                                overrides={"channels": args.channels}, emit_cubin=False)
    source = artifact.cuda.source
    return {"seconds": time.perf_counter() - start, "bytes": len(source.encode()), "lines": source.count("\n")}


def _child_target(args) -> dict:
    start = time.perf_counter()
    from purlinc import pipeline

    times = []
    for _ in range(2):
        pipeline.compile(EXAMPLES / f"{args.collective}.pln", world_size=args.ranks, arch=args.arch, atom=args.atom)
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
    return {"seconds": times[0], "second_s": times[1], "stats": _stats(pipeline)}


def _stats(pipeline) -> dict:
    from dataclasses import asdict

    return asdict(pipeline.STATS)


CHILDREN = {"tuned": _child_tuned, "cu": _child_cu, "target": _child_target}


# ---- the parent ------------------------------------------------------------------------

class Runner:
    def __init__(self, scratch: Path, scale: float):
        self.scratch = scratch
        self.scale = scale
        code = self._snapshot(scratch / "code")
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(code), os.environ.get("PYTHONPATH")))))
        self.env.pop("PURLIN_NO_CACHE", None)
        self.caches = 0

    @staticmethod
    def _snapshot(into: Path) -> Path:
        """purlinc with its grammar and templates inside (the wheel's layout), found first on PYTHONPATH."""
        shutil.copytree(REPO / "purlinc", into / "purlinc", ignore=shutil.ignore_patterns("__pycache__"))
        for folder in ("grammar", "templates"):
            shutil.copytree(REPO / folder, into / "purlinc" / folder)
        return into

    def new_cache(self) -> str:
        self.caches += 1
        return str(self.scratch / f"cache{self.caches}")

    def run(self, command: list[str], cache: str, limit: float) -> dict:
        """Run ``command`` in a fresh process with ``cache`` as its compile cache; wall time,
        or a timeout record.  The cwd is outside the repository (its purlinc/ would shadow
        the snapshot)."""
        limit = limit * self.scale
        env = dict(self.env, PURLIN_CACHE_DIR=cache)
        start = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=self.scratch, timeout=limit)
        except subprocess.TimeoutExpired:
            return {"timeout": True, "limit_s": limit}
        wall = time.perf_counter() - start
        if done.returncode != 0:
            return {"error": (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"], "wall_s": wall}
        result = {"wall_s": wall}
        if command[1:3] == [__file__, "--child"]:
            result.update(json.loads(done.stdout.strip().splitlines()[-1]))
        else:
            result["stdout_tail"] = done.stdout.strip().splitlines()[-1:]
        return result

    def cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "purlinc.cli", *args]

    def child(self, kind: str, **options) -> list[str]:
        command = [sys.executable, __file__, "--child", kind]
        for key, value in options.items():
            if value is True:
                command.append(f"--{key}")
            elif value is not None:
                command += [f"--{key}", str(value)]
        return command


def _cold_warm(runner: Runner, command: list[str], limit: float) -> dict:
    """Cold, then warm with the cache the cold run filled; a cold run that timed out or
    failed stored nothing, so its warm run is not attempted."""
    cache = runner.new_cache()
    cold = runner.run(command, cache, limit)
    if cold.get("timeout") or cold.get("error"):
        return {"cold": cold, "warm": {"skipped": "the cold run did not finish"}}
    return {"cold": cold, "warm": runner.run(command, cache, limit)}


def _seconds(result: dict, key: str = "seconds") -> float | None:
    if not result or result.get("timeout") or result.get("error"):
        return None
    return result.get(key, result.get("wall_s"))


def measure(runner: Runner, sections, out_dir: Path) -> dict:
    rows: dict[str, object] = {}
    say = lambda text: print(text, flush=True)  # noqa: E731
    if "compile" in sections:
        out = str(runner.scratch / "out")
        command = runner.cli("compile", str(EXAMPLES / "allreduce.pln"), "--ranks", "8", "--channels", "64",
                             "--arch", "sm_90", "-o", out)
        rows["compile"] = _cold_warm(runner, command, 120)
        say(f"compile allreduce R=8 c64: {_fmt(rows['compile'])}")
    if "cu_size" in sections:
        rows["cu_size"] = {}
        for channels in (1, 128):
            command = runner.child("cu", collective="allreduce", ranks=8, channels=channels, arch="sm_90")
            rows["cu_size"][str(channels)] = runner.run(command, runner.new_cache(), 180)
            say(f".cu allreduce R=8 c{channels}: {rows['cu_size'][str(channels)]}")
    if "tuned" in sections:
        rows["tuned"] = {}
        for collective in ("allreduce", "allgather"):
            for kernels in (False, True):
                name = f"{collective}{' + kernels' if kernels else ''}"
                command = runner.child("tuned", collective=collective, ranks=8, arch="sm_90", kernels=kernels or None)
                rows["tuned"][name] = _cold_warm(runner, command, 300 if kernels else 120)
                say(f"tuned load R=8 {name}: {_fmt(rows['tuned'][name])}")
    if "check72" in sections:
        rows["check72"] = {}
        for collective in STANDARD:
            command = runner.cli("check", str(EXAMPLES / f"{collective}.pln"), "--ranks", "72")
            rows["check72"][collective] = _cold_warm(runner, command, 30)
            say(f"check {collective} --ranks 72: {_fmt(rows['check72'][collective])}")
    if "check_alltoall" in sections:
        command = runner.cli("check", str(EXAMPLES / "alltoall.pln"), "--ranks", "1..64")
        cache = runner.new_cache()
        rows["check_alltoall"] = {"cold": runner.run(command, cache, 120)}
        say(f"check alltoall --ranks 1..64: {_fmt(rows['check_alltoall'])}")
    return rows


def measure_targets(runner: Runner, ranks: int = 8) -> list[dict]:
    rows = []
    for collective in ("allgather", "allreduce"):
        for arch, atom in TARGETS:
            command = runner.child("target", collective=collective, ranks=ranks, arch=arch, atom=atom)
            row = {"collective": collective, "ranks": ranks, "arch": arch, "atom": atom,
                   **_cold_warm(runner, command, 600)}
            rows.append(row)
            print(f"target {collective} R={ranks} {arch} {atom}: {_fmt(row)}", flush=True)
    return rows


def _fmt(pair: dict) -> str:
    parts = []
    for label in ("cold", "warm"):
        if label in pair:
            parts.append(f"{label} {_show(pair[label])}")
    return ", ".join(parts)


def _show(result: dict, key: str = "seconds") -> str:
    if result.get("skipped"):
        return "-"
    if result.get("timeout"):
        return f"> {result['limit_s']:g} s (timeout)"
    if result.get("error"):
        return f"error: {result['error'][0][:120]}"
    value = result.get(key, result.get("wall_s"))
    return f"{value:.2f} s" if value >= 0.1 else f"{value * 1e3:.0f} ms"


# ---- the record --------------------------------------------------------------------------

def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def _versions() -> dict:
    from importlib import metadata

    versions = {"python": platform.python_version()}
    for name in ("cuda-bindings", "nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12", "lark", "jinja2", "numpy"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return f"{platform.node()}: {cpu}, {os.cpu_count()} cores; load average {load:.1f} at the start" if load is not None \
        else f"{platform.node()}: {cpu}, {os.cpu_count()} cores"


def markdown(record: dict) -> str:
    rows = record["rows"]
    lines = [
        f"# Compile times, {record['date']}",
        "",
        f"Commit `{record['commit']}`{' (with uncommitted changes)' if record['dirty'] else ''}; "
        f"machine: {record['machine']}; " + ", ".join(f"{k} {v}" for k, v in record["versions"].items()) + ".",
        "",
        "Every figure is one fresh process. Cold: an empty compile cache (`PURLIN_CACHE_DIR` a new folder); "
        "warm: the same command again, with the cache the cold run filled. A timeout is shown as `> limit`.",
        "",
        "| figure | goal | cold | warm |",
        "| --- | --- | --- | --- |",
    ]
    if "compile" in rows:
        r = rows["compile"]
        lines.append(f"| `purlinc compile examples/allreduce.pln --ranks 8 --channels 64 --arch sm_90` (process) "
                     f"| cold <= {GOALS['compile_cold_s']:g} s | {_show(r['cold'])} | {_show(r['warm'])} |")
    if "tuned" in rows:
        for name, r in rows["tuned"].items():
            what = "buckets lowered + verified" if "kernels" not in name else "buckets + their kernels (bf16, sum), NVRTC"
            lines.append(f"| tuned `load()` preparation, {name.split()[0]} R=8, {what} "
                         f"| cold <= {GOALS['tuned_cold_s']:g} s, warm <= {GOALS['tuned_warm_s']:g} s "
                         f"| {_show(r['cold'])} | {_show(r['warm'])} |")
    if "check72" in rows:
        for name, r in rows["check72"].items():
            lines.append(f"| `purlinc check examples/{name}.pln --ranks 72` | <= {GOALS['check72_s']:g} s "
                         f"| {_show(r['cold'])} | {_show(r['warm'])} |")
    if "check_alltoall" in rows:
        r = rows["check_alltoall"]
        lines.append(f"| `purlinc check examples/alltoall.pln --ranks 1..64` | <= {GOALS['check_alltoall_s']:g} s "
                     f"| {_show(r['cold'])} | |")
    if "cu_size" in rows:
        sizes = rows["cu_size"]
        one, many = sizes.get("1", {}), sizes.get("128", {})
        lines += ["", "Generated `.cu` of allreduce, R=8, sm_90 (generation only, no NVRTC):", "",
                  "| channels | bytes | lines | time |", "| --- | --- | --- | --- |"]
        for channels, r in sizes.items():
            lines.append(f"| {channels} | {r.get('bytes', '-')} | {r.get('lines', '-')} | {_show(r)} |")
        if one.get("bytes") and many.get("bytes"):
            lines.append("")
            lines.append(f"Ratio 128 / 1 channels: {many['bytes'] / one['bytes']:.2f} (goal <= {GOALS['cu_ratio']:g}).")
    if "tuned" in rows:
        lines += ["", "Tuned buckets (R=8): " + "; ".join(
            f"{name.split()[0]}: {', '.join(r['cold'].get('buckets', []))}" for name, r in rows["tuned"].items()
            if "kernels" not in name and r["cold"].get("buckets"))]
    if record.get("targets"):
        lines += ["", "Per target (R=8, default options, `pipeline.compile` in a fresh process; cold = empty cache):", "",
                  "| collective | arch | atom | cold | warm (first in process) |", "| --- | --- | --- | --- | --- |"]
        for row in record["targets"]:
            lines.append(f"| {row['collective']} | {row['arch']} | {row['atom']} | {_show(row['cold'])} "
                         f"| {_show(row['warm'])} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--collective", default="allreduce", help=argparse.SUPPRESS)
    parser.add_argument("--arch", default="sm_90", help=argparse.SUPPRESS)
    parser.add_argument("--atom", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--channels", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--kernels", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="which figures to measure")
    parser.add_argument("--targets", action="store_true", help="also per-target compile times (allgather, allreduce)")
    parser.add_argument("--limit-scale", type=argtypes.positive_float, default=1.0,
                        help="multiply every time limit (a finite number above 0)")
    parser.add_argument("--out", type=argtypes.output_dir, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    if args.child:
        if args.atom is None:
            from purlinc.atom.atoms import DEFAULT_ATOM

            args.atom = DEFAULT_ATOM
        print(json.dumps(CHILDREN[args.child](args)))
        return 0

    started = datetime.datetime.now(datetime.timezone.utc)
    record = {
        "date": started.date().isoformat(), "started": started.isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "HEAD"), "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "machine": _machine(), "versions": _versions(), "goals": GOALS,
    }
    with tempfile.TemporaryDirectory(prefix="purlin-bench-") as scratch:
        runner = Runner(Path(scratch), args.limit_scale)
        record["rows"] = measure(runner, args.only, args.out)
        if args.targets:
            record["targets"] = measure_targets(runner)
    record["seconds"] = round((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(), 1)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{record['date']}-compile-times"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(record))
    print(f"wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
