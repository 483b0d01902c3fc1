"""Summarise a GPU suite run (scripts/gpu_suite.sh): $OUT/steps.tsv, the JUnit files of the
pytest steps and the JSON results the tests leave in $OUT -> summary.json and summary.md."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET


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


def junit(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    result = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "failed": []}
    for suite in suites:
        for key in ("tests", "failures", "errors", "skipped"):
            result[key] += int(suite.get(key, 0))
        for case in suite.iter("testcase"):
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                result["failed"].append(f"{case.get('name')}: {(bad.get('message') or '')[:300]}")
    result["passed"] = result["tests"] - result["failures"] - result["errors"] - result["skipped"]
    return result


def main(out: str) -> None:
    steps = []
    with open(os.path.join(out, "steps.tsv")) as file:
        for line in file:
            name, rc, seconds = line.rstrip("\n").split("\t")
            steps.append({"name": name, "rc": int(rc), "seconds": int(seconds),
                          "junit": junit(f"/tmp/purlin_{name}.xml")})
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
        "seconds": int(os.environ.get("SUITE_SECONDS", 0)),
        "steps": steps,
        "results": results,
    }
    with open(os.path.join(out, "summary.json"), "w") as file:
        json.dump(summary, file, indent=1)
    md = [f"# Purlin GPU suite, {summary['date']}", "", f"Machine: {summary['machine']}", "",
          f"Commit: {summary['git_commit'] or '(not given)'}", "", f"Versions: {json.dumps(summary['versions'])}", "",
          f"Total {summary['seconds']} s", "",
          "| step | rc | seconds | passed | failed | errors | skipped |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in steps:
        j = s["junit"] or {}
        md.append(f"| {s['name']} | {s['rc']} | {s['seconds']} | {j.get('passed', '')} | {j.get('failures', '')} "
                  f"| {j.get('errors', '')} | {j.get('skipped', '')} |")
    for name, data in results.items():
        if isinstance(data, dict) and "passed" in data and "total" in data:
            md.append(f"\n{name}: {data['passed']}/{data['total']} checks passed")
    for s in steps:
        if s["junit"] and s["junit"]["failed"]:
            md += ["", f"## {s['name']} failures"] + [f"- {f}" for f in s["junit"]["failed"][:60]]
    md += ["", "```", summary["topology"], "```"]
    with open(os.path.join(out, "summary.md"), "w") as file:
        file.write("\n".join(md) + "\n")
    print("\n".join(md[:60]))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ["OUT"])
