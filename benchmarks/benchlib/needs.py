"""What a measuring run needs (torch, CUDA GPUs, torchrun's environment), checked before the
first CUDA call, so a machine without them gets one line and exit status 2 instead of a
traceback from deep inside torch (``torch._C has no attribute '_cuda_setDevice'``).
Imports torch only to look; no GPU is touched beyond counting devices."""

from __future__ import annotations

import os
import sys

# What torch.distributed's env:// rendezvous reads (torchrun sets them, and the benchmarks'
# NCCL child processes are given them).
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _index(name: str, default: str) -> int | None:
    """An environment variable holding a rank index (None: not an integer >= 0)."""
    text = os.environ.get(name, default)
    return int(text) if text.isascii() and text.isdigit() else None


def missing(*, torchrun: bool, devices: int = 1) -> str | None:
    """What this process lacks for a GPU run (None: nothing).  ``torchrun``: started by
    torchrun, an NCCL-enabled torch, and a GPU for LOCAL_RANK; ``devices``: GPUs needed."""
    torch = _torch()
    if torch is None:
        return "torch is not installed in this Python"
    if torchrun:
        unset = [v for v in TORCHRUN_VARIABLES if v not in os.environ]
        if unset:
            return f"not started by torchrun ({', '.join(unset)} not set)"
        if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
            return f"torch {torch.__version__} has no NCCL (a CPU-only build?)"
        local = _index("LOCAL_RANK", "0")
        if local is None:
            return f"LOCAL_RANK {os.environ.get('LOCAL_RANK')!r} is not a rank index"
        devices = max(devices, local + 1)
    if not torch.cuda.is_available():
        build = "" if torch.version.cuda else f" (torch {torch.__version__} is built without CUDA)"
        return f"no CUDA GPU is visible{build}"
    count = torch.cuda.device_count()
    if count < devices:
        return f"{devices} CUDA GPUs needed, {count} visible"
    return None


def require(prog: str, how: str, *, torchrun: bool, devices: int = 1) -> None:
    """Exit with status 2 and one line on stderr when ``missing`` finds something; ``how``
    says how the script is meant to run (e.g. 'torchrun --nproc_per_node=2 benchmarks/bench.py')."""
    why = missing(torchrun=torchrun, devices=devices)
    if why is not None:
        print(f"{prog}: needs {'torchrun, ' if torchrun else ''}CUDA GPUs and torch ({how}): {why}",
              file=sys.stderr)
        raise SystemExit(2)
