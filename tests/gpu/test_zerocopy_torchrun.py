"""Launch zerocopy_check.py with ``torchrun --nproc_per_node=<GPUs>`` under a timeout: the
zero-copy path through Communicator.from_torch (every example, eager and graph replay, heap
growth, exhaustion, a freed block)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from _launch import run_torchrun

pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
HERE = Path(__file__).resolve().parent


def test_zero_copy_under_torchrun():
    import torch

    run_torchrun(HERE / "zerocopy_check.py", nproc=torch.cuda.device_count(), port=29541,
                 timeout=int(os.environ.get("PURLIN_TORCHRUN_TIMEOUT", "300")),
                 env={"PURLIN_WAIT_TIMEOUT_S": os.environ.get("PURLIN_WAIT_TIMEOUT_S", "5")}, tail=6000)
