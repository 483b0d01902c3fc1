"""Launch hier_check.py with ``torchrun --nproc_per_node=2``: hierarchical collectives as
2 nodes x 1 GPU and 1 node x 2 GPUs, under a timeout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
HERE = Path(__file__).resolve().parent


def test_hierarchical_two_processes():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    torchrun = shutil.which("torchrun")
    command = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    # Two processes whatever the machine: 2 "nodes" of 1 GPU, then 1 node of 2 GPUs.
    command += ["--nproc_per_node=2", "--master_port=29541", str(HERE / "hier_check.py")]
    env = dict(os.environ)
    env.setdefault("PURLIN_WAIT_TIMEOUT_S", "5")
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=int(os.environ.get("PURLIN_HIER_TIMEOUT", "380")))
    except subprocess.TimeoutExpired as error:  # show how far it got
        out = error.stdout.decode(errors="replace") if isinstance(error.stdout, bytes) else (error.stdout or "")
        err = error.stderr.decode(errors="replace") if isinstance(error.stderr, bytes) else (error.stderr or "")
        pytest.fail(f"timed out after {error.timeout} s\n{out[-4000:]}\n{err[-4000:]}")
    print(done.stdout[-8000:])
    print(done.stderr[-6000:], file=sys.stderr)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
