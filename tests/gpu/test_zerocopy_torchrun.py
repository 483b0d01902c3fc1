"""Launch zerocopy_check.py with ``torchrun --nproc_per_node=<GPUs>`` under a timeout: the
zero-copy path through Communicator.from_torch (every example, eager and graph replay, heap
growth, exhaustion, a freed block)."""

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


def test_zero_copy_under_torchrun():
    torchrun = shutil.which("torchrun")
    command = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    import torch

    nproc = torch.cuda.device_count()
    command += [f"--nproc_per_node={nproc}", "--master_port=29541", str(HERE / "zerocopy_check.py")]
    env = dict(os.environ)
    env.setdefault("PURLIN_WAIT_TIMEOUT_S", "5")
    done = subprocess.run(command, env=env, capture_output=True, text=True,
                          timeout=int(os.environ.get("PURLIN_TORCHRUN_TIMEOUT", "300")))
    print(done.stdout[-6000:])
    print(done.stderr[-6000:], file=sys.stderr)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
