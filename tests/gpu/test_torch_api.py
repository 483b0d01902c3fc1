"""purlinc.torch on GPUs: torch_check.py under torchrun (eager, torch.compile, CUDA graphs,
bad input; every result against NCCL), and CuPy processes that never import torch forming a
communicator through Purlin's own rendezvous (cupy_allgather.py, one plain ``python`` per rank)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _launch import free_port, run_torchrun

pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
HERE = Path(__file__).resolve().parent


def test_torch_api_under_torchrun():
    import torch

    # Ranks compile their graphs (inductor) at slightly different times: a device-side wait
    # must outlast that skew, not just a missing peer.
    run_torchrun(HERE / "torch_check.py", nproc=torch.cuda.device_count(), port=free_port(),
                 timeout=int(os.environ.get("PURLIN_TORCH_TIMEOUT", "480")),
                 env={"PURLIN_WAIT_TIMEOUT_S": os.environ.get("PURLIN_TORCH_WAIT_TIMEOUT_S", "120")})


def test_cupy_processes_without_torch():
    pytest.importorskip("cupy")
    import torch

    world = torch.cuda.device_count()
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(HERE / "cupy_allgather.py")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    reports = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=int(os.environ.get("PURLIN_CUPY_TIMEOUT", "240")))
            print(out[-3000:])
            print(err[-3000:], file=sys.stderr)
            assert p.returncode == 0, out[-2000:] + err[-2000:]
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    summary = {"what": "CuPy ranks without torch: all-gather", "ranks": len(reports),
               "total": sum(r["checks"] for r in reports), "passed": sum(r["passed"] for r in reports),
               "torch_imported": any(r["torch_imported"] for r in reports)}
    results = os.environ.get("PURLIN_RESULTS")
    if results:
        Path(results, "cupy_results.json").write_text(json.dumps(summary, indent=1))
    assert summary["passed"] == summary["total"] and not summary["torch_imported"], summary
