"""Launch graphbuffers_check.py with ``torchrun --nproc_per_node=<GPUs>`` under a timeout:
captured calls on ordinary tensors reach the peers' buffers through CUDA IPC exports made at
capture, with no staging copy (purlinc/runtime/graphbuffers.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from _launch import free_port, run_torchrun

pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
HERE = Path(__file__).resolve().parent


def test_graph_buffers_under_torchrun():
    import torch

    run_torchrun(HERE / "graphbuffers_check.py", nproc=torch.cuda.device_count(), port=free_port(),
                 timeout=int(os.environ.get("PURLIN_TORCHRUN_TIMEOUT", "300")),
                 env={"PURLIN_WAIT_TIMEOUT_S": os.environ.get("PURLIN_WAIT_TIMEOUT_S", "5")}, tail=6000)
