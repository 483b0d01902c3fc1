"""Summarise a GPU suite run (scripts/gpu_suite.sh): $OUT/steps.tsv, the JUnit files of the
pytest steps and the JSON results the tests leave in $OUT -> summary.json and summary.md.

    python3 scripts/gpu_summary.py [OUT]     (default: $OUT)

A summary is written whatever the suite left: a bad line of steps.tsv is listed (and skipped),
a JUnit file that cannot be parsed is reported as unreadable."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:  # benchlib: finite_only, as the results files use it
    sys.path.insert(0, str(BENCHMARKS))

from benchlib.rows import finite_only  # noqa: E402


def sh(cmd: str) -> str:
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception as error:  # a summary must not fail for a missing tool
        return f"({error})"


def versions() -> dict:
    found = {"python": platform.python_version()}
    for module in ("torch", "cupy", "numpy", "cuda.bindings"):
        try:
            found[module] = getattr(__import__(module, fromlist=["x"]), "__version__", "?")
        except Exception as error:
            found[module] = f"missing ({type(error).__name__})"
    try:
        import torch

        found["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:
        pass
    try:
        from purlinc.atom.nvrtc import nvrtc_version

        found["nvrtc"] = nvrtc_version()
    except Exception as error:
        found["nvrtc"] = str(error)
    return found


PROG = "gpu_summary.py"


def junit(path: str) -> dict | None:
    """The counts and failures of one JUnit file; None when there is none; ``{"unreadable":
    why}`` when it cannot be read or parsed (a step cut short leaves a truncated file)."""
    if not os.path.exists(path):
        return None
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as error:
        return {"unreadable": f"{type(error).__name__}: {error}"}
    suites = [root] if root.tag == "testsuite" else list(root)
    result = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "failed": []}
    for suite in suites:
        for key in ("tests", "failures", "errors", "skipped"):
            try:
                result[key] += int(float(suite.get(key, 0)))
            except ValueError:
                return {"unreadable": f"{key}={suite.get(key)!r} is not a number"}
        for case in suite.iter("testcase"):
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                result["failed"].append(f"{case.get('name')}: {(bad.get('message') or '')[:300]}")
    result["passed"] = result["tests"] - result["failures"] - result["errors"] - result["skipped"]
    return result


def _seconds(text: str) -> int | float:
    """'12' -> 12, '2.54' -> 2.5; ValueError for what is no finite number of seconds >= 0."""
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{text.strip()!r} is not a finite number of seconds >= 0")
    return int(value) if value.is_integer() else round(value, 1)


def suite_seconds(text: str | None) -> tuple[int | float | None, list[str]]:
    """$SUITE_SECONDS (the suite's wall time) and a note when it is there but no number."""
    if text is None or not text.strip():
        return None, []
    try:
        return _seconds(text), []
    except ValueError:
        return None, [f"SUITE_SECONDS={text!r} is not a finite number of seconds >= 0"]


def read_steps(path: str) -> tuple[list[dict], list[str]]:
    """The steps of steps.tsv (name, rc, seconds; tab-separated) and a note per line that is
    not one (blank lines are skipped silently); a missing or unreadable file is one note."""
    steps, bad = [], []
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            lines = file.read().splitlines()
    except OSError as error:
        return [], [f"{path}: cannot read it ({error.strerror or error})"]
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        try:
            if len(fields) != 3:
                raise ValueError(f"{len(fields)} columns, expected 3 (name, rc, seconds)")
            name, rc, seconds = fields
            step = {"name": name, "rc": int(rc), "seconds": _seconds(seconds)}
        except ValueError as error:
            bad.append(f"{path} line {number}: {line[:200]!r}: {error}")
            continue
        steps.append({**step, "junit": junit(f"/tmp/purlin_{step['name']}.xml")})
    return steps, bad


def main(out: str) -> None:
    steps, bad_lines = read_steps(os.path.join(out, "steps.tsv"))
    seconds, notes = suite_seconds(os.environ.get("SUITE_SECONDS"))
    results = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".json") and name != "summary.json":
            try:
                with open(os.path.join(out, name)) as file:
                    data = json.load(file)
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and "checks" in data:  # keep the summary small
                data = {k: v for k, v in data.items() if k != "checks"}
            results[name] = data
    summary = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": sh("hostname") + " / " + sh(
            "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tr '\\n' ';'"),
        "topology": sh("nvidia-smi topo -m"),
        "git_commit": os.environ.get("PURLIN_GIT_COMMIT", ""),
        "versions": versions(),
        "seconds": seconds,
        "steps": steps,
        "bad_steps_lines": bad_lines,
        "notes": notes,
        "results": results,
    }
    with open(os.path.join(out, "summary.json"), "w") as file:
        json.dump(finite_only(summary), file, indent=1, allow_nan=False)
    md = [f"# Purlin GPU suite, {summary['date']}", "", f"Machine: {summary['machine']}", "",
          f"Commit: {summary['git_commit'] or '(not given)'}", "", f"Versions: {json.dumps(summary['versions'])}", "",
          f"Total {'?' if summary['seconds'] is None else summary['seconds']} s", "",
          "| step | rc | seconds | passed | failed | errors | skipped |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in steps:
        j = s["junit"] or {}
        if "unreadable" in j:
            md.append(f"| {s['name']} | {s['rc']} | {s['seconds']} | JUnit XML unreadable ({j['unreadable'][:200]}) "
                      "| | | |")
            continue
        md.append(f"| {s['name']} | {s['rc']} | {s['seconds']} | {j.get('passed', '')} | {j.get('failures', '')} "
                  f"| {j.get('errors', '')} | {j.get('skipped', '')} |")
    if bad_lines:
        md += ["", "Lines of steps.tsv skipped:"] + [f"- {line}" for line in bad_lines]
    if notes:
        md += [""] + [f"Note: {note}" for note in notes]
    for name, data in results.items():
        if isinstance(data, dict) and "passed" in data and "total" in data:
            md.append(f"\n{name}: {data['passed']}/{data['total']} checks passed")
    for s in steps:
        if s["junit"] and s["junit"].get("failed"):
            md += ["", f"## {s['name']} failures"] + [f"- {f}" for f in s["junit"]["failed"][:60]]
    md += ["", "```", summary["topology"], "```"]
    with open(os.path.join(out, "summary.md"), "w") as file:
        file.write("\n".join(md) + "\n")
    print("\n".join(md[:60]))


def cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description="Summarise a GPU suite run (scripts/gpu_suite.sh) into "
                                 "OUT/summary.json and OUT/summary.md.")
    ap.add_argument("out", nargs="?", default=None, help="the suite's output folder (default: $OUT)")
    args = ap.parse_args(argv)
    out = args.out or os.environ.get("OUT")
    if not out:
        print(f"{PROG}: error: no output folder: give it as the argument or set $OUT", file=sys.stderr)
        return 2
    if not os.path.isdir(out):
        print(f"{PROG}: error: {out}: not a folder", file=sys.stderr)
        return 2
    main(out)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
