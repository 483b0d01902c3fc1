"""The run-time log: PURLIN_DEBUG levels, the 'purlin' logger, and what it says (no GPU, no torch)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from purlinc import settings
from purlinc.log import TRACE, log
from purlinc.runtime.heap import SymmetricHeap

REPO = Path(__file__).resolve().parent.parent


def _run(code: str, debug: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PURLIN_DEBUG"}
    if debug is not None:
        env["PURLIN_DEBUG"] = debug
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)


SAY = ("import logging; from purlinc.log import log; "
       "print(log.level, len(log.handlers), log.isEnabledFor(logging.INFO), log.isEnabledFor(5)); "
       "log.info('hello %d', 7); log.debug('fine'); log.log(5, 'finest')")


def test_off_by_default_configures_nothing():
    done = _run(SAY, None)
    assert done.stdout.split() == ["0", "0", "False", "False"], done
    assert "hello" not in done.stderr
    done = _run("import logging, purlinc.log; print(len(logging.getLogger().handlers))", "INFO")
    assert done.stdout.strip() == "0", done  # never basicConfig: the root logger keeps no handler


@pytest.mark.parametrize("value,level,shown", [
    ("INFO", logging.INFO, ["hello 7"]), ("info", logging.INFO, ["hello 7"]),
    ("DEBUG", logging.DEBUG, ["hello 7", "fine"]), ("1", logging.DEBUG, ["hello 7", "fine"]),
    ("TRACE", TRACE, ["hello 7", "fine", "finest"]),
])
def test_levels_log_to_stderr(value, level, shown):
    done = _run(SAY, value)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:2] == [str(level), "1"]
    lines = [line for line in done.stderr.splitlines() if line.startswith("purlin ")]
    assert [line.split(": ", 1)[1] for line in lines] == shown, done.stderr
    assert "purlin INFO [pid " in lines[0]


def test_debug_setting_keeps_the_cli_meaning(monkeypatch):
    for value, reraise, level in (("1", True, "DEBUG"), ("DEBUG", True, "DEBUG"), ("TRACE", True, "TRACE"),
                                  ("INFO", False, "INFO"), ("0", False, None), ("", False, None)):
        monkeypatch.setenv("PURLIN_DEBUG", value)
        assert (settings.debug(), settings.log_level()) == (reraise, level), value
    monkeypatch.setenv("PURLIN_DEBUG", "loud")
    from purlinc.errors import PurlinError

    with pytest.raises(PurlinError, match="PURLIN_DEBUG='loud': expected 0, 1, INFO, DEBUG, TRACE, WARN or WARNING"):
        settings.log_level()


def test_heap_growth_is_logged(caplog):
    grown = []

    def grow(index, size):
        grown.append((index, size))
        return [0x100000 * (index + 1)]
    heap = SymmetricHeap(0, 1 << 16, [0x10000], grow=grow, segment_bytes=1 << 16)
    with caplog.at_level(logging.INFO, logger="purlin"):
        heap.alloc(1 << 17, "a test block")
    assert grown and any("heap of rank 0 grew by segment 1" in r.getMessage() and "a test block" in r.getMessage()
                         for r in caplog.records), caplog.records
    assert log.name == "purlin"
