"""Purlin on any torch process group: four gloo processes (CPU) in a TP x DP layout.

Tensor-parallel groups [0, 1], [2, 3] and data-parallel groups [0, 2], [1, 3], made with
``new_group`` and as a ``DeviceMesh``'s dimensions; every purlinc.torch call takes the process
group itself as ``group=``.  Each group's communicator is made by its members alone, over the
group's own store (``Communicator.from_torch`` too).  The CPU stand-in (torch_standin.py) runs
every call through that exchange and fails if any exchange met a rank of another group; the
worker checks every result against values computed from the global ranks: all-reduce (SUM,
PRODUCT), reduce-scatter (MAX, lists), reduce to a global dst, all-gather (lists, int64, float64),
broadcast (bool, global src), gather (int16, group_dst), scatter (uint8), uneven all-to-all,
all-to-all of lists, barrier, Work.get_future.  ``PURLIN_TEST_GROUP_RUNS`` repeats the whole run
(CI runs it once).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "torch_groups_worker.py"


def run_world(tmp_path: Path, world: int = 4, timeout: float = 600) -> list[str]:
    init = tmp_path / "init"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), str(init)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outs = []
    deadline = time.monotonic() + timeout  # one bound for the whole world (a loaded machine is slow, not hung)
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    failed = [(r, p.returncode, out[-3000:]) for r, (p, out) in enumerate(zip(procs, outs)) if p.returncode]
    assert not failed, "\n".join(f"rank {r} exited {code}:\n{out}" for r, code, out in failed)
    return outs


@pytest.mark.parametrize("run", range(int(os.environ.get("PURLIN_TEST_GROUP_RUNS", "1"))))
def test_tp_dp_groups_never_exchange_with_each_other(tmp_path, run):
    outs = run_world(tmp_path)
    for rank, out in enumerate(outs):
        tp = (0, 1) if rank < 2 else (2, 3)
        dp = (0, 2) if rank % 2 == 0 else (1, 3)
        assert f"calls on groups {sorted([tp, dp, (0, 1, 2, 3)])}" in out, out
