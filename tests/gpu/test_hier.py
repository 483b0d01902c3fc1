"""Launch hier_check.py with ``torchrun --nproc_per_node=2``: hierarchical collectives as
2 nodes x 1 GPU and 1 node x 2 GPUs, under a timeout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from _launch import run_torchrun

pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
HERE = Path(__file__).resolve().parent


def test_hierarchical_two_processes():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    # Two processes whatever the machine: 2 "nodes" of 1 GPU, then 1 node of 2 GPUs.
    run_torchrun(HERE / "hier_check.py", nproc=2, port=29541,
                 timeout=int(os.environ.get("PURLIN_HIER_TIMEOUT", "380")),
                 env={"PURLIN_WAIT_TIMEOUT_S": os.environ.get("PURLIN_WAIT_TIMEOUT_S", "5")})
