"""``purlinc check`` on several processes (purlinc/checkjobs.py): the same verdicts, counts and
first error as the one-process loop, every (world size, algorithm) verified once."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from purlinc import checkjobs, pipeline
from purlinc.cli import main
from purlinc.errors import PurlinError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
needs_fork = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork here")


def _run(capsys, *argv):
    code = main(["check", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_worth_it():
    big = [(48, "ring"), (49, "ring")]
    assert checkjobs.worth_it(2, big) == ("fork" in multiprocessing.get_all_start_methods())
    assert not checkjobs.worth_it(1, big)  # one worker
    assert not checkjobs.worth_it(2, big[:1])  # one job
    assert not checkjobs.worth_it(2, [(r, "ring") for r in range(1, 17)])  # too little work to fork for


@needs_fork
def test_same_result_as_one_process(capsys, monkeypatch):
    calls = []
    parallel = checkjobs.verify_parallel

    def recording(definition, params, units, options, jobs, progress):
        calls.append((list(units), jobs))
        return parallel(definition, params, units, options, jobs, progress)

    monkeypatch.setattr(checkjobs, "verify_parallel", recording)
    args = (EXAMPLES / "alltoall.pln", "-R", "30..33")
    one = _run(capsys, *args, "-j", "1")
    assert not calls
    two = _run(capsys, *args, "-j", "2")
    assert one == two == (0, "alltoall: ok for R=30..33 (4 sizes): spec and 12 schedules verified\n", "")
    assert calls == [([(r, a) for r in range(30, 34) for a in ("direct-push", "direct-pull", "ring")], 2)]


@needs_fork
def test_first_error_in_order(capsys, monkeypatch):
    """Two schedules fail: both runs report the one the loop meets first (R=31, direct-pull),
    even though a worker may finish R=33 first; workers inherit the patched stage (fork)."""
    stage = pipeline.snac_stage
    failing = {(31, "direct-pull"): "first", (33, "direct-push"): "second"}

    def snac_stage(spec, options, **kwargs):
        why = failing.get((spec.world_size, options.algorithm.value))
        if why is not None:
            raise PurlinError(f"the {why} failure", notes=("a note",))
        return stage(spec, options, **kwargs)

    monkeypatch.setattr(pipeline, "snac_stage", snac_stage)
    args = (EXAMPLES / "alltoall.pln", "-R", "30..33")
    one = _run(capsys, *args, "-j", "1")
    two = _run(capsys, *args, "-j", "2")
    assert one == two
    code, out, err = two
    assert code == 2 and out == ""
    assert err == "error: the first failure\nnote: a note\nnote: while verifying direct-pull for R=31\n"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc for the workers")
@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGKILL"])
def test_the_workers_end_with_a_killed_parent(tmp_path, signal_name):
    """SIGTERM (timeout, a CI runner, kill) or SIGKILL left the workers computing, orphaned, then
    printing broken-pipe tracebacks: they now die with the parent."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "PYTHONPATH": str(EXAMPLES.parent), "PURLIN_CACHE_DIR": str(tmp_path / "cache")}
    parent = subprocess.Popen([sys.executable, "-m", "purlinc", "check", str(EXAMPLES / "alltoall.pln"), "--ranks",
                               "100..128", "-j", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                              start_new_session=True)
    workers: list[str] = []
    try:
        deadline = time.time() + 60
        while len(workers) < 2 and time.time() < deadline and parent.poll() is None:
            time.sleep(0.2)
            workers = [p for p in os.listdir("/proc") if p.isdigit() and _parent_of(p) == parent.pid]
        assert len(workers) == 2, "the check never started its workers"
        parent.send_signal(getattr(signal, signal_name))
        _, err = parent.communicate(timeout=30)
        deadline = time.time() + 10
        while any(_running(p) for p in workers) and time.time() < deadline:
            time.sleep(0.1)
        assert not [p for p in workers if _running(p)], "workers outlived their parent"
        assert b"Traceback" not in err
        if signal_name == "SIGTERM":
            assert parent.returncode == 128 + signal.SIGTERM
    finally:
        for p in workers:
            if _running(p):
                os.kill(int(p), signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()


def _stat(pid: str) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _parent_of(pid: str) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def _running(pid: str) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def test_a_programs_own_sigterm_handler_is_left_alone(monkeypatch):
    """A library user's handler ran no more while a check verified (SystemExit instead), and a
    handler installed outside Python could not be restored (signal.signal refused None)."""
    import signal

    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with checkjobs._terminated_as_interrupted():
            assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGTERM) is mine
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with checkjobs._terminated_as_interrupted():
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, mine)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)
