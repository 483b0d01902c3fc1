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


_NO_GPU = r'''
import sys, torch, torch.distributed as dist
import purlinc.torch as pt
from purlinc.runtime.communicator import Communicator
from purlinc.runtime.errors import ArgumentError
dist.init_process_group("purlin", init_method="file://" + sys.argv[1], rank=0, world_size=1)
t = torch.ones(3)
dist.all_reduce(t)  # a CPU tensor: the gloo fallback
dist.barrier()
print("barrier held")
for call in (lambda: pt.all_reduce(torch.ones(2)), lambda: pt.functional.all_reduce(torch.ones(2)),
             Communicator.from_torch):
    try:
        call()
    except ArgumentError as error:
        print("refused:", error.message)
dist.destroy_process_group()
'''


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without a CUDA device gets")
def test_a_purlin_world_without_a_gpu_holds_barriers_and_refuses_clearly(tmp_path):
    """init_process_group("purlin") without CUDA: dist.barrier() handed itself to NCCL, which a CPU
    build of torch lacks (AttributeError: module 'torch.distributed' has no attribute
    'ProcessGroupNCCL'); purlinc.torch's own calls reached torch.cuda.init() deep in the
    communicator (AssertionError: Torch not compiled with CUDA enabled), as did
    Communicator.from_torch itself.  Now the barrier is gloo's and the calls are refused, before
    any exchange, saying what is missing."""
    import subprocess
    import sys

    from worker_world import REPO

    done = subprocess.run([sys.executable, "-c", _NO_GPU, str(tmp_path / "init")], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "barrier held" in done.stdout
    refused = [line for line in done.stdout.splitlines() if line.startswith("refused:")]
    assert len(refused) == 3 and all("a Purlin communicator needs a CUDA device" in line for line in refused), done.stdout
    # Communicator.from_torch itself (what the docs' first example calls) raised torch's AssertionError
    assert refused[2].startswith("refused: Communicator.from_torch: a Purlin communicator needs a CUDA device, and "
                                 "torch has none: "), refused[2]


@pytest.mark.skipif(hasattr(dist, "ProcessGroupNCCL"), reason="a torch built without NCCL")
def test_an_nccl_fallback_on_a_torch_without_nccl_is_refused_by_name():
    from types import SimpleNamespace

    from purlinc.runtime.errors import ArgumentError
    from purlinc.torch.backend import PurlinProcessGroup

    # what _make_fallback reads of its group (a ProcessGroup made without its __init__ crashes torch)
    group = SimpleNamespace(_fallback_names={"cuda": "nccl"}, _store=dist.HashStore(), _timeout=None,
                            rank=lambda: 0, size=lambda: 1)
    with pytest.raises(ArgumentError, match=r"purlin backend: the fallback for tensors on cuda is nccl, which this "
                                            r"torch lacks \(built without NCCL\)"):
        PurlinProcessGroup._make_fallback(group, "cuda")
