"""The README is a user's guide: short, its two set-up commands as written, and its results
table exactly what scripts/readme_table.py makes from the newest committed run."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
BEGIN = "<!-- results table: made by scripts/readme_table.py from the newest run; tests/test_readme.py checks it -->"
END = "<!-- end of results table -->"


def test_readme_is_a_short_guide():
    assert len(README.splitlines()) <= 150


def test_readme_keeps_the_two_setup_commands():
    assert ("python3 -m venv .venv && . .venv/bin/activate && pip install . && "
            "purlinc compile examples/allgather.pln --arch sm_90") in README
    assert "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' && python -m pytest -q" in README


def test_results_table_is_the_scripts_output_for_the_newest_run():
    made = subprocess.run([sys.executable, str(ROOT / "scripts" / "readme_table.py")], capture_output=True,
                          text=True, check=True).stdout.strip()
    shown = README.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert shown == made
    spec = importlib.util.spec_from_file_location("readme_table", ROOT / "scripts" / "readme_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.newest().stem in shown  # the caption names the run it was made from


def test_linked_documents_exist():
    for line in README.splitlines():
        for part in line.split("](")[1:]:
            target = part.split(")", 1)[0]
            if not target.startswith("http"):
                assert (ROOT / target).exists(), target


def test_ci_runs_every_test_file_that_needs_torch():
    """The default install has no torch, so a test file that skips without it runs only where
    .ci/run names it on its torch line: a new one left off would be skipped in CI for good."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    skips = re.compile(r'^(\w+ = )?pytest\.importorskip\("torch"\)', re.M)  # at module level
    needing = sorted(p.name for p in (ROOT / "tests").glob("test_*.py") if skips.search(p.read_text(encoding="utf-8")))
    assert needing and [name for name in needing if f"tests/{name}" not in ci] == []


def _readme_table():
    spec = importlib.util.spec_from_file_location("readme_table", ROOT / "scripts" / "readme_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_table_skips_rows_found_wrong():
    """A Purlin row whose check failed is never quoted (report.py's ``ok``), however fast."""
    def timed(system, variant, time_us, checked=True):
        return {"system": system, "variant": variant, "collective": "allreduce", "bytes": 1024, "mode": "graph",
                "calls_per_graph": 100, "time_us": time_us, "busbw_gbps": 1.0, "checked": checked, "error": None}
    module = _readme_table()
    good = module.table([timed("nccl", "default", 6.0), timed("purlin", "default", 3.0)])
    assert "| allreduce | 3 / 6 default (2.00x) |" in good
    wrong = module.table([timed("nccl", "default", 6.0), timed("purlin", "default", 0.5, checked=False)])
    assert "| allreduce | - |" in wrong


def test_results_table_refuses_another_tools_result():
    made = subprocess.run([sys.executable, str(ROOT / "scripts" / "readme_table.py"),
                           str(ROOT / "benchmarks" / "results" / "2026-12-02-h200x1-loopback-moe.json")],
                          capture_output=True, text=True)
    assert made.returncode == 2 and made.stdout == ""
    assert made.stderr.startswith("readme_table.py: error: ") and "not a benchmarks/bench.py result" in made.stderr
    assert made.stderr.count("\n") == 1
