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
from pathlib import Path

import pytest

pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)

from worker_world import run_world  # noqa: E402

WORKER = Path(__file__).resolve().parent / "torch_groups_worker.py"


@pytest.mark.parametrize("run", range(int(os.environ.get("PURLIN_TEST_GROUP_RUNS", "1"))))
def test_tp_dp_groups_never_exchange_with_each_other(tmp_path, run):
    outs = run_world(WORKER, 4, tmp_path)
    for rank, out in enumerate(outs):
        tp = (0, 1) if rank < 2 else (2, 3)
        dp = (0, 2) if rank % 2 == 0 else (1, 3)
        assert f"calls on groups {sorted([tp, dp, (0, 1, 2, 3)])}" in out, out
