"""One rank of tests/test_torch_groups.py: ``python torch_groups_worker.py RANK WORLD INIT_FILE``.

Four gloo processes, tensor-parallel groups [0, 1], [2, 3] and data-parallel groups [0, 2],
[1, 3] (by new_group and as a DeviceMesh's dimensions), Purlin calls on all of them interleaved
(the stand-in of torch_standin.py checks every exchange's members), every result checked here
against values computed from the global ranks.  Exits 0 when all held; prints what failed otherwise.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_standin  # noqa: E402

import purlinc.torch as pt  # noqa: E402
from purlinc.torch import groups  # noqa: E402


def value(rank, n=6, dtype=torch.float32):
    return (torch.arange(n) + 100 * rank + 1).to(dtype)


def expect(got, want, what):
    if not torch.equal(got, want):
        raise AssertionError(f"rank {dist.get_rank()}: {what}: got {got.tolist()}, expected {want.tolist()}")


def reductions(rank, tp, dp, tp_ranks, dp_ranks):
    t = value(rank)
    pt.all_reduce(t, group=tp)
    expect(t, sum(value(r) for r in tp_ranks), "all_reduce on TP")
    t = value(rank)
    pt.all_reduce(t, op=dist.ReduceOp.PRODUCT, group=dp)
    expect(t, value(dp_ranks[0]) * value(dp_ranks[1]), "all_reduce PRODUCT on DP")
    out = torch.empty(3)
    pt.reduce_scatter_tensor(out, value(rank), op=dist.ReduceOp.MAX, group=dp)
    me = dp_ranks.index(rank)
    expect(out, value(max(dp_ranks))[3 * me:3 * me + 3], "reduce_scatter MAX on DP")
    t = value(rank)
    pt.reduce(t, dst=tp_ranks[1], group=tp)  # a global rank
    expect(t, sum(value(r) for r in tp_ranks) if rank == tp_ranks[1] else value(rank), "reduce to a global dst")
    out = torch.empty(6)
    pt.reduce_scatter(out, [value(rank), value(rank) * 2], group=tp)
    expect(out, sum(value(r) for r in tp_ranks) * (1 + tp_ranks.index(rank)), "reduce_scatter (list) on TP")


def copies(rank, tp, dp, tp_ranks, dp_ranks):
    big = torch.tensor([2**40 + rank, -(2**35) - rank], dtype=torch.int64)
    lst = [torch.empty(2, dtype=torch.int64) for _ in tp_ranks]
    pt.all_gather(lst, big, group=tp)
    for r, got in zip(tp_ranks, lst):
        expect(got, torch.tensor([2**40 + r, -(2**35) - r]), "all_gather int64 on TP")
    flags = torch.tensor([rank % 2 == 0, True, rank == 3])
    pt.broadcast(flags, src=dp_ranks[1], group=dp)
    expect(flags, torch.tensor([dp_ranks[1] % 2 == 0, True, dp_ranks[1] == 3]), "broadcast bool from a global src")
    x = value(rank, dtype=torch.float64)
    out = torch.empty(12, dtype=torch.float64)
    pt.all_gather_into_tensor(out, x, group=dp)
    expect(out, torch.cat([value(r, dtype=torch.float64) for r in dp_ranks]), "all_gather float64 on DP")
    got = [torch.empty(6, dtype=torch.int16) for _ in tp_ranks] if tp_ranks.index(rank) == 1 else None
    pt.gather(value(rank, dtype=torch.int16), got, group_dst=1, group=tp)
    if got is not None:
        for r, g in zip(tp_ranks, got):
            expect(g, value(r, dtype=torch.int16), "gather int16 to group_dst=1")
    t = torch.empty(2, dtype=torch.uint8)
    parts = [torch.tensor([7 * r, 200], dtype=torch.uint8) for r in dp_ranks] if rank == dp_ranks[0] else None
    pt.scatter(t, parts, src=dp_ranks[0], group=dp)
    expect(t, torch.tensor([7 * rank, 200], dtype=torch.uint8), "scatter uint8 from a global src")


def all_to_alls(rank, world):
    # uneven: rank i sends j + i rows to rank j (a row is 2 elements)
    sends = [j + rank for j in range(world)]
    x = torch.cat([torch.full((n, 2), float(100 * rank + j)) for j, n in enumerate(sends)])
    recv = [rank + i for i in range(world)]
    out = torch.empty(sum(recv), 2)
    pt.all_to_all_single(out, x, recv, sends)  # group=None: the world
    want = torch.cat([torch.full((n, 2), float(100 * i + rank)) for i, n in enumerate(recv)])
    expect(out, want, "all_to_all_single uneven on WORLD")
    outs = [torch.empty(i + 1, dtype=torch.int64) for i in range(world)]
    ins = [torch.full((rank + 1,), 10 * rank + j, dtype=torch.int64) for j in range(world)]
    pt.all_to_all(outs, ins)
    for i, o in enumerate(outs):
        expect(o, torch.full((i + 1,), 10 * i + rank, dtype=torch.int64), "all_to_all (lists, int64)")


def from_torch_on_subgroups(rank, groups_by_name, layouts):
    """Communicator.from_torch on each of this rank's groups (only their members call it): every
    exchange it makes (heap set-up, later ones, zero-copy checks) meets exactly that group.  The
    heap itself (CUDA IPC) is left out: open_heap records its exchange instead."""
    from purlinc.runtime import bootstrap
    from purlinc.runtime.communicator import Communicator

    saved = bootstrap.open_heap, torch.cuda.init, torch.cuda.current_device
    seen = []

    def open_heap(cls, group_rank, world, device, exchange, heap_bytes=None):
        seen.append(exchange(dist.get_rank()))
        return cls(group_rank, world, device, None, exchange)
    bootstrap.open_heap, torch.cuda.init, torch.cuda.current_device = open_heap, (lambda: None), (lambda: 0)
    try:
        for name, layout in layouts.items():
            members = layout[0] if rank in layout[0] else layout[1]
            pg = groups_by_name[name][layout.index(members)]
            comm = Communicator.from_torch(pg)
            assert seen[-1] == members, f"rank {rank}: from_torch({members}) set-up met {seen[-1]}"
            for _ in range(3):
                assert comm.allgather(rank) == members, f"rank {rank}: from_torch({members}) exchange"
                assert comm._check_exchange(rank) == members, f"rank {rank}: from_torch({members}) check exchange"
    finally:
        bootstrap.open_heap, torch.cuda.init, torch.cuda.current_device = saved


def main(rank: int, world: int, init_file: str) -> None:
    start = time.monotonic()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    groups.factory = torch_standin.factory
    layouts = {"tp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]]}
    made = {name: [dist.new_group(ranks) for ranks in layout] for name, layout in layouts.items()}
    tp_ranks, dp_ranks = layouts["tp"][rank // 2], layouts["dp"][rank % 2]
    tp, dp = made["tp"][rank // 2], made["dp"][rank % 2]
    from_torch_on_subgroups(rank, made, layouts)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for _ in range(2):  # the groups' calls interleaved, twice (a second round reuses cached communicators)
        reductions(rank, tp, dp, tp_ranks, dp_ranks)
        copies(rank, tp, dp, tp_ranks, dp_ranks)
        all_to_alls(rank, world)
        pt.barrier(group=tp)
        reductions(rank, mesh.get_group("tp"), mesh.get_group("dp"), tp_ranks, dp_ranks)
        work = pt.all_reduce(value(rank), group=dp, async_op=True)
        (done,) = work.get_future().wait()
        expect(done, sum(value(r) for r in dp_ranks), "get_future's value")
    assert pt.group_of(tp) is pt.group_of(tp), "one Purlin group per process group"
    allowed = {tuple(r) for layout in layouts.values() for r in layout} | {tuple(range(world))}
    stray = {ranks for _, ranks in torch_standin.CALLS} - allowed
    assert not stray, f"calls on groups {stray}"
    print(f"rank {rank}: {len(torch_standin.CALLS)} calls on groups "
          f"{sorted({ranks for _, ranks in torch_standin.CALLS})} in {time.monotonic() - start:.1f} s", flush=True)
    dist.destroy_process_group()
    print(f"rank {rank}: destroyed at {time.monotonic() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
