"""Launching a check script under torchrun from a pytest test: one command line, one way of
showing what the ranks printed, one assertion.  (torchrun_check, zerocopy_check, torch_check,
hier_check and fault_check are each launched this way.)"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(script, nproc: int, port: int) -> list[str]:
    """torchrun (or ``python -m torch.distributed.run`` where the script is not on PATH)."""
    torchrun = shutil.which("torchrun")
    command = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    return [*command, f"--nproc_per_node={nproc}", f"--master_port={port}", str(script)]


def run_torchrun(script, *, nproc: int, port: int, timeout: int, env: dict | None = None,
                 tail: int = 8000) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nproc`` ranks; print the ends of its output; a run past ``timeout``
    fails the test showing how far it got; a non-zero exit fails it with the output's end."""
    try:
        done = subprocess.run(torchrun_command(script, nproc, port), env={**os.environ, **(env or {})},
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as error:
        out = error.stdout.decode(errors="replace") if isinstance(error.stdout, bytes) else (error.stdout or "")
        err = error.stderr.decode(errors="replace") if isinstance(error.stderr, bytes) else (error.stderr or "")
        pytest.fail(f"timed out after {error.timeout} s\n{out[-4000:]}\n{err[-4000:]}")
    print(done.stdout[-tail:])
    print(done.stderr[-6000:], file=sys.stderr)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done
