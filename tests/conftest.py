"""Fixtures shared by every test module: where things are, golden files, hypothesis profiles.

Golden files: ``golden(path, text)`` compares ``text`` with ``tests/golden/<path>``; any diff
fails.  ``pytest --update-golden`` or ``PURLIN_UPDATE_GOLDEN=1`` rewrites them instead (the
test then still passes, so review the diff with git before committing).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

REPO = Path(__file__).resolve().parent.parent
GOLDEN_DIR = Path(__file__).resolve().parent / "golden"

# Deterministic by default: the same examples on every run and every machine, no deadline
# (the 2-core CI box is slow to warm up).  HYPOTHESIS_PROFILE=explore searches further.
settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=25, print_blob=True,
    suppress_health_check=(HealthCheck.too_slow,),
)
settings.register_profile("explore", deadline=None, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_addoption(parser):
    parser.addoption(
        "--update-golden", action="store_true", default=False,
        help="rewrite golden files under tests/golden/ instead of comparing (same as PURLIN_UPDATE_GOLDEN=1)",
    )


@pytest.fixture(scope="session")
def repo_dir() -> Path:
    return REPO


@pytest.fixture(scope="session")
def examples_dir() -> Path:
    return REPO / "examples"


@pytest.fixture(scope="session")
def example_paths(examples_dir) -> dict[str, Path]:
    """Every example, by stem: {'allgather': .../examples/allgather.pln, ...}."""
    return {path.stem: path for path in sorted(examples_dir.glob("*.pln"))}


class Golden:
    """Compare text against a file under tests/golden/, or rewrite it when asked to."""

    def __init__(self, update: bool):
        self.update = update

    def __call__(self, relative: str, text: str) -> None:
        path = GOLDEN_DIR / relative
        if self.update:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            return
        if not path.exists():
            pytest.fail(f"missing golden file {path}; create it with PURLIN_UPDATE_GOLDEN=1 (or --update-golden)")
        expected = path.read_text(encoding="utf-8")
        if text != expected:
            diff = "".join(difflib.unified_diff(
                expected.splitlines(keepends=True), text.splitlines(keepends=True),
                fromfile=f"golden/{relative}", tofile="actual",
            ))
            pytest.fail(f"output differs from golden/{relative} (PURLIN_UPDATE_GOLDEN=1 rewrites it):\n{diff}")


@pytest.fixture
def golden(request) -> Golden:
    update = request.config.getoption("--update-golden") or os.environ.get("PURLIN_UPDATE_GOLDEN", "") not in ("", "0")
    return Golden(update)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty compile cache for one test, and no in-process memo either side of it
    (test modules with a session-wide cache define their own ``cache_dir``)."""
    from purlinc import pipeline

    path = tmp_path / "cache"
    monkeypatch.setenv("PURLIN_CACHE_DIR", str(path))
    monkeypatch.delenv("PURLIN_NO_CACHE", raising=False)
    pipeline.forget()
    yield path
    pipeline.forget()


@pytest.fixture(autouse=True)
def _precompile_off_on_the_cpu(request, monkeypatch):
    """A tuned load compiles its buckets' kernels for PURLIN_PRECOMPILE's dtypes before it
    returns.  CPU tests load on fake drivers many times, each with a fresh compile cache, and
    mostly call one dtype: they keep the compile-at-first-call behaviour unless they set the
    variable themselves (tests/test_precompile.py).  GPU tests keep the default."""
    if "PURLIN_PRECOMPILE" in os.environ:
        return
    if not any(request.node.get_closest_marker(mark) for mark in ("gpu", "multigpu")):
        monkeypatch.setenv("PURLIN_PRECOMPILE", "0")
