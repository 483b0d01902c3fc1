"""Run under ``torchrun --nproc_per_node=N`` (N = 1 on a one-GPU machine): the ``purlin``
torch.distributed backend on real GPUs, and purlinc.torch on a process group of another backend.

1. ``dist.init_process_group("cuda:purlin,cpu:gloo")``: the unmodified torch.distributed calls of
   tests/torch_backend_worker.py (every collective, the list forms, async Work, get_future,
   barrier) on CUDA tensors through Purlin's real communicator and kernels, each result checked
   against values computed from the ranks (an int64 sum beyond 32 bits among them); then what goes
   underneath: a float64 sum and a BXOR to NCCL, a CPU tensor to gloo, each checked, each hand-over logged once.
2. The functional collectives' gradients, eager and under torch.compile (inductor); the serving
   adapter (PurlinAllReduce) in a hand-captured CUDA graph, replayed on new data.
3. A ``cuda:nccl,cpu:gloo`` group made with ``new_group`` (every rank): ``pt.all_reduce``,
   ``pt.all_gather_into_tensor`` and the functional all-reduce with ``group=`` that process group
   (its Purlin communicator made over the group's own store), against NCCL's answer on the same data.
With ``PURLIN_TORCH_SHARE_GPU=1`` every rank runs on cuda:0 (two ranks on a one-GPU machine:
Purlin's kernels of both ranks share the GPU, as in a loopback group); NCCL cannot put two ranks
on one GPU, so the parts that reach NCCL (the NCCL fallbacks, the NCCL group) are left out.
Prints "torch backend check: passed" on every rank; exits non-zero otherwise.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the CPU test's calls
import torch_backend_worker as calls  # noqa: E402

import purlinc.torch as pt  # noqa: E402
from purlinc.torch import backend  # noqa: E402


def fallbacks(rank, R, device, said, share):
    c = torch.full((4,), float(rank + 1))
    dist.all_reduce(c)
    calls.expect(c, torch.full((4,), float(R * (R + 1) // 2)), "CPU tensor (gloo)")
    assert any("goes to gloo" in m for m in said), said
    if share:
        return
    t = torch.tensor([0.5 + rank], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    calls.expect(t, torch.tensor([sum(0.5 + r for r in range(R))], dtype=torch.float64, device=device),
                 "float64 sum (NCCL)")
    t = torch.tensor([rank + 1.0], dtype=torch.float32, device=device)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))  # not Purlin's: NCCL runs it
    calls.expect(t, torch.tensor([2.0 * R * (R + 1) / 2], device=device), "PREMUL_SUM (NCCL)")
    assert any("goes to nccl" in m for m in said), said
    t = torch.tensor([rank + 1], dtype=torch.int32, device=device)
    try:  # neither Purlin nor NCCL has it: NCCL's own error, as on an NCCL group
        dist.all_reduce(t, op=dist.ReduceOp.BXOR)
    except ValueError as error:
        assert "BXOR" in str(error), error
    else:
        raise AssertionError("BXOR on CUDA tensors ran; NCCL has no BXOR")


def other_backend(rank, R, device):
    nccl = dist.new_group(list(range(R)), backend="cuda:nccl,cpu:gloo")
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    x = torch.randn(4096, device=device, generator=g).to(torch.bfloat16)
    mine, theirs = x.clone(), x.clone()
    pt.all_reduce(mine, group=nccl)
    dist.all_reduce(theirs, group=nccl)
    torch.testing.assert_close(mine.float(), theirs.float(), rtol=1e-2, atol=1e-2)
    out, ref = torch.empty(R * 4096, device=device, dtype=x.dtype), torch.empty(R * 4096, device=device, dtype=x.dtype)
    pt.all_gather_into_tensor(out, x, group=nccl)
    dist.all_gather_into_tensor(ref, x, group=nccl)
    assert torch.equal(out, ref), "all_gather_into_tensor on an NCCL group"
    y = pt.functional.all_reduce(x.float(), group=nccl)
    ref = x.float().clone()
    dist.all_reduce(ref, group=nccl)
    torch.testing.assert_close(y, ref)
    assert pt.group_of(nccl) is pt.group_of(nccl)


def autograd(rank, R, device):
    """The functional collectives' gradients, eager and compiled (inductor), against their closed form."""
    w = torch.randn(64, 32, device=device, generator=torch.Generator(device=device).manual_seed(7))

    def f(x):
        y = pt.functional.all_reduce(x * 2)  # dx = 2 * all_reduce(w) = 2 * R * w
        z = pt.functional.reduce_scatter_tensor(pt.functional.all_gather_tensor(x))  # dx = R * w2 (w2 = 1)
        return (y * w).sum() + z.sum()
    for compiled in (False, True):
        x = torch.randn(64, 32, device=device, requires_grad=True)
        (torch.compile(f, fullgraph=True) if compiled else f)(x).backward()
        torch.testing.assert_close(x.grad, 2 * R * w + R, rtol=1e-5, atol=1e-4)


def serving(rank, R, device):
    """The serving adapter in a hand-captured CUDA graph: warm-up inside capture(), then replays on new data."""
    from purlinc.torch.serving import PurlinAllReduce

    ar = PurlinAllReduce(dist.group.WORLD)
    static = torch.empty(8, 1024, device=device)
    base = torch.Generator(device=device).manual_seed(5)
    with ar.capture():
        static.normal_(generator=base)
        assert ar.should_custom_ar(static)
        ar.custom_all_reduce(static)  # the warm-up run: compiles and loads outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ar.custom_all_reduce(static)
    for step in range(3):
        values = torch.randn(8, 1024, device=device, generator=base)  # the same on every rank
        static.copy_(values * (rank + 1))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, values * (R * (R + 1) // 2), rtol=1e-5, atol=1e-5)


def main() -> None:
    share = os.environ.get("PURLIN_TORCH_SHARE_GPU") == "1"
    local = 0 if share else int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("purlin").addHandler(handler)
    logging.getLogger("purlin").setLevel(logging.INFO)
    dist.init_process_group("cuda:purlin,cpu:gloo")
    assert isinstance(dist.group.WORLD, backend.PurlinProcessGroup), type(dist.group.WORLD)
    rank, R = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local)
    calls.DEVICE = device
    calls.purlin_calls(rank, R)
    torch.cuda.synchronize()
    for what in ("communicator: rank", "load allreduce", "kernel for float32 sum loaded"):  # the INFO log
        assert any(what in m for m in said), (what, said[:20])
    fallbacks(rank, R, device, said, share)
    if not share:
        other_backend(rank, R, device)
    autograd(rank, R, device)
    serving(rank, R, device)
    torch.cuda.synchronize()
    dist.barrier()
    print(f"rank {rank}: torch backend check: passed", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
