"""Run one worker script as a world of processes (rank, world size, a file:// init path as its
arguments) and collect each rank's output; any rank's non-zero exit fails with its output's tail.
Used by the multi-process torch CPU tests (test_torch_groups.py, test_torch_backend.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_world(worker: Path, world: int, tmp_path: Path, timeout: float = 600) -> list[str]:
    init = tmp_path / "init"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), str(world), str(init)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outs = []
    deadline = time.monotonic() + timeout  # one bound for the whole world (a loaded machine is slow, not hung)
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    failed = [(r, p.returncode, out[-3000:]) for r, (p, out) in enumerate(zip(procs, outs)) if p.returncode]
    assert not failed, "\n".join(f"rank {r} exited {code}:\n{out}" for r, code, out in failed)
    return outs
