"""The ``purlin`` torch.distributed backend on the CPU: registration and dispatch.

``import purlinc.torch`` registers ``purlin``; a world made with it runs unmodified
``torch.distributed`` calls.  Here three gloo-connected processes register the same backend for
CPU tensors (``backend.register("purlincpu", device_type="cpu")``) with the stand-in of
torch_standin.py in place of the GPU, and check (tests/torch_backend_worker.py): the world and a
``new_group(backend=...)`` are PurlinProcessGroups; all_reduce (SUM, AVG, PRODUCT, int64 SUM),
all_gather_into_tensor, reduce_scatter_tensor (MAX), all_to_all_single, broadcast (int64),
reduce, gather, scatter (bool), the list forms (uneven all_to_all), async Work with get_future,
and barrier all reach Purlin (the stand-in counts them) with correct results; send/recv, BXOR,
float64 sums and non-contiguous tensors go to gloo with correct results, none reaching Purlin, and
each kind of hand-over is logged once; torch's functional collectives (eager, compiled) and a
DTensor on a DeviceMesh work on such a group.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)

from worker_world import run_world  # noqa: E402

WORKER = Path(__file__).resolve().parent / "torch_backend_worker.py"


def test_import_registers_purlin():
    import purlinc.torch  # noqa: F401
    from purlinc.torch import backend

    assert dist.Backend.PURLIN == "purlin"
    assert backend.register() == "purlin"  # twice: kept, not an error


def test_backend_world_of_three_processes(tmp_path):
    outs = run_world(WORKER, 3, tmp_path)
    for rank, out in enumerate(outs):
        assert f"rank {rank}: 18 calls on Purlin, then the fallbacks" in out, out  # the uneven all-to-all is one
