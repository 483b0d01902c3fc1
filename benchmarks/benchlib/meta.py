"""What a result records about the machine and the software (versions, commit, environment)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch
import torch.distributed as dist

import purlin_api
from benchlib.context import Ctx


ROOT = Path(__file__).resolve().parents[2]  # the repository

def collect_meta(ctx: Ctx) -> None:
    m = ctx.meta
    props = torch.cuda.get_device_properties(ctx.device)
    names = [None] * ctx.world
    dist.all_gather_object(names, props.name)
    m.update(gpus=names, sm_count=props.multi_processor_count,
             capability=f"{props.major}.{props.minor}", torch=torch.__version__)
    try:
        m["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
    except Exception as e:  # noqa: BLE001
        m["nccl"] = f"unknown ({e})"
    m["nvidia_driver"] = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i",
                               str(ctx.local_rank)])
    try:
        from importlib.metadata import version

        m["cuda_bindings"] = version("cuda-bindings")
    except Exception:  # noqa: BLE001
        try:
            import cuda.bindings

            m["cuda_bindings"] = getattr(cuda.bindings, "__version__", "unknown")
        except Exception as e:  # noqa: BLE001
            m["cuda_bindings"] = f"not importable ({e})"
    try:
        m["purlinc"] = purlin_api.version()
    except Exception as e:  # noqa: BLE001
        m["purlinc"] = f"not importable ({e})"
    # An explicit --git-commit wins: the device machine's copy of the tree can carry a stale .git.
    commit = ctx.args.git_commit or _run(["git", "-C", str(ROOT), "rev-parse", "HEAD"])
    if commit and not ctx.args.git_commit:
        dirty = _run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])
        commit += "-dirty" if dirty else ""
    m["git_commit"] = commit
    m["env"] = {k: v for k, v in sorted(os.environ.items())
                if k.startswith(("NCCL_", "TORCH_SYMM_MEM", "PURLIN_", "CUDA_VISIBLE", "TORCH_NCCL"))}


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except Exception:  # noqa: BLE001
        return None


def machine_tag(ctx: Ctx) -> str:
    if ctx.args.machine:
        return ctx.args.machine
    name = torch.cuda.get_device_name(ctx.device).lower()
    short = next((t for t in reversed(name.replace("-", " ").split()) if any(ch.isdigit() for ch in t)), "gpu")
    return f"{''.join(ch for ch in short if ch.isalnum())}x{ctx.world}"
