"""GPU tests: skipped (with a reason) without torch, without a GPU, or with fewer than two."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs at least one CUDA GPU (skipped otherwise)")
    config.addinivalue_line("markers", "multigpu: needs at least two peer-connected CUDA GPUs (skipped otherwise)")


def _gpus() -> tuple[int, str]:
    try:
        import torch
    except ImportError:
        return 0, "torch is not installed"
    if not torch.cuda.is_available():
        return 0, "no CUDA GPU"
    return torch.cuda.device_count(), ""


def pytest_collection_modifyitems(config, items):
    count, why = _gpus()
    for item in items:
        if "multigpu" in item.keywords and count < 2:
            item.add_marker(pytest.mark.skip(reason=why or f"needs 2 GPUs, found {count}"))
        elif "gpu" in item.keywords and count < 1:
            item.add_marker(pytest.mark.skip(reason=why or "no CUDA GPU"))
