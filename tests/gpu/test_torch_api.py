"""purlinc.torch on GPUs: torch_check.py under torchrun (eager, torch.compile, CUDA graphs,
bad input; every result against NCCL), and CuPy processes that never import torch forming a
communicator through Purlin's own rendezvous (cupy_allgather.py, one plain ``python`` per rank)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torch_api_under_torchrun():
    import torch

    torchrun = shutil.which("torchrun")
    command = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    command += [f"--nproc_per_node={torch.cuda.device_count()}", f"--master_port={_free_port()}",
                str(HERE / "torch_check.py")]
    env = dict(os.environ)
    # Ranks compile their graphs (inductor) at slightly different times: a device-side wait
    # must outlast that skew, not just a missing peer.
    env["PURLIN_WAIT_TIMEOUT_S"] = os.environ.get("PURLIN_TORCH_WAIT_TIMEOUT_S", "120")
    done = subprocess.run(command, env=env, capture_output=True, text=True,
                          timeout=int(os.environ.get("PURLIN_TORCH_TIMEOUT", "480")))
    print(done.stdout[-8000:])
    print(done.stderr[-6000:], file=sys.stderr)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_cupy_processes_without_torch():
    pytest.importorskip("cupy")
    import torch

    world = torch.cuda.device_count()
    port = _free_port()
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
