"""One rank of tests/test_torch_backend.py: ``python torch_backend_worker.py RANK WORLD INIT_FILE``.

Unmodified torch.distributed calls on a process group of the Purlin backend, registered for CPU
tensors with the stand-in of torch_standin.py in place of the GPU: every call Purlin takes goes
through the stand-in (counted), everything else to gloo underneath, each result checked here.
Exits 0 when all held.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_standin  # noqa: E402

import purlinc.torch as pt  # noqa: E402
from purlinc.torch import backend, groups  # noqa: E402
from purlinc.torch.distributed import Work  # noqa: E402


def expect(got, want, what):
    if not torch.equal(got, want):
        raise AssertionError(f"rank {dist.get_rank()}: {what}: got {got.tolist()}, expected {want.tolist()}")


DEVICE = "cpu"  # tests/gpu/torch_backend_check.py runs purlin_calls on cuda


def value(rank, n=6, dtype=torch.float32):
    return (torch.arange(n) + 10 * rank + 1).to(dtype).to(DEVICE)


def purlin_calls(rank, R):
    """Every call Purlin takes, against values from the ranks (any world size: roots are the last rank)."""
    before = len(torch_standin.CALLS)
    n, last = 2 * R, R - 1

    def val(r, dtype=torch.float32):
        return value(r, n, dtype)
    total = sum(val(r) for r in range(R))
    t = val(rank)
    dist.all_reduce(t)
    expect(t, total, "all_reduce")
    t = val(rank)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    torch.testing.assert_close(t, total / R)
    t = val(rank, torch.int64) + 2**40  # beyond 32 bits
    dist.all_reduce(t)
    expect(t, sum(val(r, torch.int64) + 2**40 for r in range(R)), "all_reduce int64")
    t = val(rank)
    dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
    expect(t, torch.prod(torch.stack([val(r) for r in range(R)]), 0), "all_reduce PRODUCT")
    out = torch.empty(R * n, device=DEVICE)
    dist.all_gather_into_tensor(out, val(rank))
    expect(out, torch.cat([val(r) for r in range(R)]), "all_gather_into_tensor")
    out = torch.empty(2, device=DEVICE)
    dist.reduce_scatter_tensor(out, val(rank), op=dist.ReduceOp.MAX)
    expect(out, val(last)[2 * rank:2 * rank + 2], "reduce_scatter_tensor MAX")
    out = torch.cat([val(r) if r == rank else torch.zeros(n, device=DEVICE) for r in range(R)])
    dist.all_gather_into_tensor(out, out[rank * n:(rank + 1) * n])  # in place, as NCCL takes it
    expect(out, torch.cat([val(r) for r in range(R)]), "all_gather_into_tensor in place")
    t = torch.cat([val(rank) * (j + 1) for j in range(R)])
    dist.reduce_scatter_tensor(t[rank * n:(rank + 1) * n], t)  # in place: the output is the input's own slot
    expect(t[rank * n:(rank + 1) * n], total * (rank + 1), "reduce_scatter_tensor in place")
    out = torch.empty(n, device=DEVICE)
    dist.all_to_all_single(out, val(rank))
    expect(out, torch.cat([val(r)[2 * rank:2 * rank + 2] for r in range(R)]), "all_to_all_single")
    t = val(rank, torch.int64)
    dist.broadcast(t, src=last)
    expect(t, val(last, torch.int64), "broadcast int64")
    t = val(rank)
    dist.reduce(t, dst=last)
    expect(t, total if rank == last else val(rank), "reduce")
    lst = [torch.empty(n, device=DEVICE) for _ in range(R)] if rank == 0 else None
    dist.gather(val(rank), lst, dst=0)
    if rank == 0:
        for r in range(R):
            expect(lst[r], val(r), "gather")
    t = torch.empty(2, dtype=torch.bool, device=DEVICE)
    dist.scatter(t, [torch.tensor([r % 2 == 0, True], device=DEVICE) for r in range(R)] if rank == last else None,
                 src=last)
    expect(t, torch.tensor([rank % 2 == 0, True], device=DEVICE), "scatter bool")
    lst = [torch.empty(n, device=DEVICE) for _ in range(R)]
    dist.all_gather(lst, val(rank))
    for r in range(R):
        expect(lst[r], val(r), "all_gather (list)")
    out = torch.empty(n, device=DEVICE)
    dist.reduce_scatter(out, [val(rank) * (j + 1) for j in range(R)])
    expect(out, total * (rank + 1), "reduce_scatter (list)")
    outs = [torch.empty(r + 1, device=DEVICE) for r in range(R)]
    dist.all_to_all(outs, [torch.full((rank + 1,), float(10 * rank + j), device=DEVICE) for j in range(R)])
    for r in range(R):
        expect(outs[r], torch.full((r + 1,), float(10 * r + rank), device=DEVICE), "all_to_all (lists, uneven)")
    work = dist.all_reduce(val(rank), async_op=True)
    assert isinstance(work, Work), type(work)
    work.wait()
    expect(work.get_future().wait()[0], total, "Work.get_future")
    dist.barrier()
    return len(torch_standin.CALLS) - before


def fallback_calls(rank, R, records):
    """What Purlin does not take goes to gloo, said once per kind in the log."""
    before = len(torch_standin.CALLS)
    if rank == 0:
        for _ in range(2):
            dist.send(torch.arange(3.0), dst=1)
    elif rank == 1:
        for _ in range(2):
            t = torch.empty(3)
            dist.recv(t, src=0)
            expect(t, torch.arange(3.0), "recv (gloo)")
    t = torch.tensor([rank + 1], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.BXOR)
    want = 0
    for r in range(R):
        want ^= r + 1
    expect(t, torch.tensor([want], dtype=torch.int32), "all_reduce BXOR (gloo)")
    t = torch.tensor([0.5 + rank], dtype=torch.float64)
    dist.all_reduce(t)
    expect(t, torch.tensor([sum(0.5 + r for r in range(R))], dtype=torch.float64), "all_reduce float64 (gloo)")
    m = value(rank, 12).view(3, 4).t()  # not contiguous
    dist.all_reduce(m)
    expect(m, sum(value(r, 12) for r in range(R)).view(3, 4).t(), "all_reduce non-contiguous (gloo)")
    # lists of unequal sizes: NCCL runs them (as broadcasts, reduces), so they go to the fallback,
    # not to Purlin's list forms (one equal chunk per rank), which refused them
    out = torch.empty(rank + 1)
    dist.reduce_scatter(out, [torch.full((r + 1,), float(r + 1)) for r in range(R)])
    expect(out, torch.full((rank + 1,), float(R * (rank + 1))), "reduce_scatter of unequal sizes (gloo)")
    try:  # gloo itself refuses an uneven all_gather, with its own message: the call reached it
        dist.all_gather([torch.empty(r + 1) for r in range(R)], torch.zeros(rank + 1))
    except RuntimeError as error:
        assert "ProcessGroupGloo::allgather" in str(error), error
    else:
        raise AssertionError("an all_gather of unequal sizes did not reach gloo")
    assert len(torch_standin.CALLS) == before, "a fallback call reached Purlin"
    said = [r.getMessage() for r in records if "goes to gloo" in r.getMessage()]
    sends = [m for m in said if ": send with" in m or ": recv with" in m]
    assert len(sends) == (1 if rank in (0, 1) else 0), said
    assert any("all_reduce" in m or "allreduce with op" in m for m in said), said


def torch_layers(rank, R):
    """What torch builds on process groups, on this one: functional collectives (eager and
    compiled: traced ones reach the group's backends through torch's dispatcher, here gloo), a
    DTensor on a DeviceMesh of the world; and purlinc.torch's differentiable functional forms
    with no group= (the backend's world), eager and compiled."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    total = sum(value(r) for r in range(R))
    expect(funcol.all_reduce(value(rank), "sum", dist.group.WORLD).wait(), total, "funcol.all_reduce")
    compiled = torch.compile(lambda t: funcol.all_gather_tensor(t * 2, 0, dist.group.WORLD) + 1, fullgraph=True,
                             backend="aot_eager")
    expect(compiled(value(rank)), torch.cat([value(r) * 2 + 1 for r in range(R)]), "compiled funcol.all_gather")
    # purlinc.torch with no group= on this backend, eager then compiled (the trace finds the group by name)
    w = torch.arange(4.0 * R).view(2 * R, 2)

    def f(x):
        y = pt.functional.all_reduce(x * 2)  # dx = 2 * R * w
        z = pt.functional.reduce_scatter_tensor(pt.functional.all_gather_tensor(x))  # dx = R
        return (y * w).sum() + z.sum()
    for compiled in (False, True):
        x = torch.ones(2 * R, 2, requires_grad=True)
        (torch.compile(f, fullgraph=True, backend="aot_eager") if compiled else f)(x).backward()
        expect(x.grad, 2 * R * w + R, f"gradients on the backend's group (compiled={compiled})")
    mesh = init_device_mesh("cpu", (R,))
    full = torch.arange(4.0 * R).view(2 * R, 2)
    shard = distribute_tensor(full, mesh, [Shard(0)])
    expect(shard.to_local(), full[2 * rank:2 * rank + 2], "DTensor shard")
    expect(shard.full_tensor(), full, "DTensor full_tensor")


def main(rank: int, world: int, init_file: str) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("purlin").addHandler(handler)
    logging.getLogger("purlin").setLevel(logging.INFO)
    backend.register("purlincpu", device_type="cpu", fallbacks={"cpu": "gloo"})
    groups.factory = torch_standin.factory
    dist.init_process_group("purlincpu", init_method=f"file://{init_file}", rank=rank, world_size=world)
    assert isinstance(dist.group.WORLD, backend.PurlinProcessGroup), type(dist.group.WORLD)
    assert dist.get_backend() == "purlincpu", dist.get_backend()
    taken = purlin_calls(rank, world)
    assert taken >= 18, taken  # the uneven all-to-all is one call (run-time sizes)
    fallback_calls(rank, world, records)
    torch_layers(rank, world)
    sub = dist.new_group([0, 1], backend="purlincpu")
    if rank in (0, 1):
        assert isinstance(sub, backend.PurlinProcessGroup), type(sub)
        t = value(rank)
        dist.all_reduce(t, group=sub)
        expect(t, value(0) + value(1), "all_reduce on new_group([0, 1])")
        assert torch_standin.CALLS[-1] == ("allreduce", (0, 1)), torch_standin.CALLS[-1]
        made = groups._GROUPS[id(sub)][1]
        dist.destroy_process_group(sub)  # its shutdown releases what Purlin made for it
        assert id(sub) not in groups._GROUPS and all(g is not made for _, g in groups._BY_NAME.values()), "sub-group kept"
        assert not made._entries, "the sub-group's collectives were not closed"
    gloo = dist.new_group(list(range(world)), backend="gloo")  # a foreign group, used through group=
    t = value(rank)
    pt.all_reduce(t, group=gloo)
    expect(t, sum(value(r) for r in range(world)), "purlinc.torch.all_reduce on a gloo group")
    dist.destroy_process_group(gloo)
    groups.release_destroyed()  # torch cannot tell Purlin: the cache drops it when it looks next
    assert all(pg is not gloo for pg, _ in groups._GROUPS.values()), "destroyed gloo group kept"
    dist.barrier()
    print(f"rank {rank}: {taken} calls on Purlin, then the fallbacks", flush=True)
    dist.destroy_process_group()
    assert not groups._GROUPS and not groups._BY_NAME, (groups._GROUPS, groups._BY_NAME)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
