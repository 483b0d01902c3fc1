"""One-way peer bandwidth peaks (copy engine, SM stores, NCCL send/recv): the reference the
bandwidth targets read."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

import purlin_api
import report
from benchlib.context import Ctx, allreduce_max, barrier, guarded, sync
from benchlib.timing import _events, calls_us


def measure_peaks(ctx: Ctx) -> dict:
    """One-way peer bandwidth from rank 0 into rank 1: copy engine, SM stores, NCCL send/recv."""
    sizes = [s for s in (1 * report.MiB, 16 * report.MiB, 256 * report.MiB, 1 * report.GiB)
             if s <= ctx.args.peak_bytes] or [ctx.args.peak_bytes]
    peaks = {}
    if ctx.world < 2:
        return {"error": "one rank: no peer"}
    remote = None
    if ctx.symm is not None:
        S, handle = ctx.symm

        def get_remote(n):
            return handle.get_buffer(1, (n,), torch.uint8, 0)

        remote = get_remote
    ce_how = ("torch copy_ into rank 1's symmetric buffer (torch symm_mem get_buffer): "
              "cudaMemcpyAsync over a peer mapping = copy engine")
    sm_how = "torch elementwise kernel (mul by 1) writing rank 1's symmetric buffer: SM stores"
    raw = purlin_api.raw_peer_copy(ctx.comm) if ctx.comm is not None else None
    if remote is not None:
        peaks["ce_one_way"] = _peak(ctx, sizes, remote, "ce", ce_how)
        peaks["sm_store_one_way"] = _peak(ctx, sizes, remote, "sm", sm_how)
    else:
        peaks["ce_one_way"] = {"how": ce_how, "error": "no symmetric buffer (symm_mem unavailable)"}
    if raw is not None:
        peaks["purlin_raw_copy"] = {"how": f"comm.{raw[0]} exists; not measured (its signature is not fixed yet)"}
    peaks["nccl_sendrecv_one_way"] = _peak_sendrecv(ctx, sizes[-1])
    return peaks


def _peak(ctx: Ctx, sizes, remote, kind: str, how: str) -> dict:
    points = []
    for n in sizes:
        def body():
            if ctx.rank != 0:
                return None
            dst = remote(n)
            src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=ctx.device)
            if kind == "ce":
                op = lambda: dst.copy_(src)  # noqa: E731
            else:
                d16, s16 = dst.view(torch.bfloat16), src.view(torch.bfloat16)
                op = lambda: torch.mul(s16, 1, out=d16)  # noqa: E731
            iters = max(3, min(50, int(20 * report.MiB * 50 / n) or 3))
            times = [calls_us(op, iters, warm=3 if i == 0 else 0) for i in range(5)]
            return statistics.median(times)

        barrier(ctx)
        ran, t, err = guarded(ctx, body)
        if not ran:
            return {"how": how, "error": err, "points": points}
        t = allreduce_max(ctx, [t or 0.0])[0]
        points.append({"bytes": n, "time_us": t, "gbps": report.algbw_gbps(n, t)})
    barrier(ctx)
    return {"how": how, "points": points}


def _peak_sendrecv(ctx: Ctx, n: int) -> dict:
    how = "dist.send rank 0 -> dist.recv rank 1 (NCCL), timed on both, slowest kept: the documented fallback"

    def body():
        buf = torch.empty(n, dtype=torch.uint8, device=ctx.device)
        if ctx.rank == 0:
            buf.random_(0, 255)
        op = None
        if ctx.rank == 0:
            op = lambda: dist.send(buf, dst=1)  # noqa: E731
        elif ctx.rank == 1:
            op = lambda: dist.recv(buf, src=0)  # noqa: E731
        if op is None:
            return 0.0
        for _ in range(2):
            op()
        sync()
        times = []
        for _ in range(3):
            start, end = _events()
            start.record()
            for _ in range(3):
                op()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / 3)
        return statistics.median(times)

    barrier(ctx)
    ran, t, err = guarded(ctx, body)
    if not ran:
        return {"how": how, "error": err}
    t = allreduce_max(ctx, [t or 0.0])[0]
    return {"how": how, "points": [{"bytes": n, "time_us": t, "gbps": report.algbw_gbps(n, t)}]}
