"""Launch torchrun_check.py with ``torchrun --nproc_per_node=2`` (the bootstrap through
torch.distributed), under a timeout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from _launch import run_torchrun

pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
HERE = Path(__file__).resolve().parent


def test_torchrun_two_processes():
    import torch

    # One process per visible GPU: the same test runs on 2-, 4- and 8-GPU machines.
    run_torchrun(HERE / "torchrun_check.py", nproc=torch.cuda.device_count(), port=29533,
                 timeout=int(os.environ.get("PURLIN_TORCHRUN_TIMEOUT", "240")),
                 env={"PURLIN_WAIT_TIMEOUT_S": os.environ.get("PURLIN_WAIT_TIMEOUT_S", "5")}, tail=6000)
