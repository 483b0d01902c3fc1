"""The ``purlin`` torch.distributed backend on GPUs: torch_backend_check.py under torchrun, one
process per GPU (a world of one on a one-GPU machine), and two processes sharing cuda:0."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from _launch import free_port, run_torchrun

pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu]
HERE = Path(__file__).resolve().parent


def test_backend_under_torchrun():
    import torch

    done = run_torchrun(HERE / "torch_backend_check.py", nproc=torch.cuda.device_count(), port=free_port(),
                        timeout=int(os.environ.get("PURLIN_TORCH_TIMEOUT", "540")))
    assert done.stdout.count("torch backend check: passed") == torch.cuda.device_count(), done.stdout[-3000:]


def test_backend_two_ranks_sharing_one_gpu():
    # both processes on cuda:0: real two-rank Purlin collectives through the backend on one GPU
    done = run_torchrun(HERE / "torch_backend_check.py", nproc=2, port=free_port(),
                        timeout=int(os.environ.get("PURLIN_TORCH_TIMEOUT", "540")),
                        env={"PURLIN_TORCH_SHARE_GPU": "1"})
    assert done.stdout.count("torch backend check: passed") == 2, done.stdout[-3000:]
