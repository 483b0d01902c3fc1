"""A run's shared state (``Ctx``) and the steps every rank takes together: barriers, the
slowest rank's value, and ``guarded`` (a failure on any rank becomes an error on all)."""

from __future__ import annotations

import argparse
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from benchlib.plan import Plan


PROBE_LIMIT_US = 1e6  # a single call slower than 1 s is a hang (a device wait timing out)


@dataclass
class Ctx:
    args: argparse.Namespace
    plan: Plan
    rank: int
    world: int
    local_rank: int
    device: object
    group_name: str
    t0: float
    meta: dict
    rows: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stem: str = ""
    symm: object = None  # (tensor, handle) of the symmetric buffer, or None
    nccl_here: tuple = ("default",)  # the NCCL variants this process measures (the child: nomix, symm)
    nsymm: object = None  # (input, output) flat buffers registered as NCCL symmetric windows, or None
    comm: object = None  # Purlin communicator
    colls: dict = field(default_factory=dict)  # (collective, variant name) -> loaded Purlin collective
    hcolls: dict = field(default_factory=dict)  # (collective, gpus_per_node) -> loaded hierarchical collective
    failures: list = field(default_factory=list)  # correctness failures, for the exit status
    hung: dict = field(default_factory=dict)  # (system, variant, collective) -> why it is skipped from now on
    finished: bool = False
    finish_lock: threading.Lock = field(default_factory=threading.Lock)

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[{time.time() - self.t0:6.1f}s] {msg}", flush=True)

    def add(self, row: dict) -> None:
        with self.lock:
            self.rows.append(row)


def sync() -> None:
    torch.cuda.synchronize()


def barrier(ctx: Ctx) -> None:
    dist.barrier(device_ids=[ctx.local_rank])
    sync()


def allreduce_max(ctx: Ctx, values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def guarded(ctx: Ctx, fn: Callable):
    """Run ``fn`` on every rank; all ranks learn whether any failed, so they stay in step.

    Returns (ok, value, error text naming the failing ranks)."""
    err, value = None, None
    try:
        value = fn()
        sync()
    except Exception as e:  # noqa: BLE001 - any failure becomes an error row
        err = f"{type(e).__name__}: {e}".strip()
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()
    flag = allreduce_max(ctx, [1.0 if err else 0.0])[0]
    if not flag:
        return True, value, None
    msgs = [None] * ctx.world
    dist.all_gather_object(msgs, err)
    text = "; ".join(f"rank {r}: {m}" for r, m in enumerate(msgs) if m) or "failed on another rank"
    return False, value, text[:2000]
