"""The e2e benchmark with one process per GPU (torchrun): every system, every batch."""

from __future__ import annotations

import datetime
import os
import statistics
import traceback

import torch
import torch.distributed as dist

from e2e import model, results, systems
from e2e.timing import capture, replay_us


class Rank:
    """This process's part: its GPU, shard, weights, and the systems made so far."""

    def __init__(self, args, config: model.Config):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        self.device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=self.device, timeout=datetime.timedelta(seconds=600))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.args, self.shard = args, config.shard(self.world)
        self.weights = model.make_weights(self.shard, self.rank, seed=args.seed, device=self.device)
        self.made: dict = {}
        self.purlin_comm = None

    def guarded(self, fn):
        """(value, None) on every rank, or (None, every failing rank's error) on every rank."""
        value, error = None, None
        try:
            value = fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - any failure becomes the system's error row
            error = f"{type(e).__name__}: {e}"
            if os.environ.get("BENCH_TRACEBACK"):
                traceback.print_exc()
        errors = [None] * self.world
        dist.all_gather_object(errors, error)
        failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
        return (None, "; ".join(failed)[:1000]) if failed else (value, None)

    def slowest(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def comm(self, system: str) -> model.Comm:
        if system not in self.made:
            self.made[system] = self._make(system)
        return self.made[system]

    def _make(self, system: str) -> model.Comm:
        if system == "none":
            return model.NoComm()
        if system == "reference":
            return systems.Reference()
        if system in ("nccl", "nccl-nomix"):
            return systems.Nccl()
        if system == "nccl-symm":
            return systems.NcclSymm(self.device, max(self.args.batch_list) * self.shard.config.hidden)
        if system.startswith("symm-"):
            return systems.SymmMem(system[len("symm-"):].replace("-", "_"), dist.group.WORLD.group_name)
        if self.purlin_comm is None:
            import purlinc

            self.purlin_comm = purlinc.Communicator.from_torch()
        if system == "purlin-fused":
            return systems.PurlinFused(self.purlin_comm, self.shard.config.hidden)
        return systems.Purlin(self.purlin_comm, heap=system == "purlin-heap")


def run_system(me: Rank, system: str, batch: int, state: model.State, h0, reference) -> tuple[dict, object]:
    """One system at one batch: its row, and its final hidden states (for the reference)."""
    args = me.args

    def prepare():
        comm = me.comm(system)
        buffers = model.Buffers.make(me.shard, batch, comm, torch.bfloat16, me.device)
        state.h.copy_(h0)
        return capture(lambda: model.decode_step(me.shard, me.weights, state, comm, buffers))

    made, error = me.guarded(prepare)
    if error:
        return results.row(system, batch, me.world, None, None, error=error), None
    graph, y = made
    times, error = me.guarded(lambda: replay_us(graph, args.replays, args.reps, f"{system} batch {batch}"))
    if error:
        return results.row(system, batch, me.world, None, None, error=error), None
    times = me.slowest(times)

    def check():
        state.h.copy_(h0)
        graph.replay()
        torch.cuda.synchronize()
        return y.clone()

    final, error = me.guarded(check)
    mine = None  # this rank's (agrees, note), where the system has a check
    if error is None and system not in ("none", "reference") and reference is not None:
        mine = results.agree(final, reference, results.TOLERANCE)
    elif error is None and system == "reference":
        mine = results.reference_agrees([final], "the reference (partial sums gathered, added in float32)")
    agree = None if mine is None else _on_every_rank(me, mine)
    return results.row(system, batch, me.world, statistics.median(times), times, agree=agree, error=error), final


def _on_every_rank(me: Rank, mine: tuple[bool, str]) -> tuple[bool, str]:
    """Every rank's check as one: agreeing where all agree, else naming each rank that does not."""
    flags = [None] * me.world
    dist.all_gather_object(flags, mine)
    bad = [f"rank {r}: {n}" for r, (g, n) in enumerate(flags) if not g]
    return (not bad, "; ".join(bad) if bad else mine[1])


def run(args, config: model.Config) -> tuple[list[dict], int, int]:
    from e2e.run import CHILD_SYSTEMS, run_child

    me = Rank(args, config)
    child = args.child_out is not None
    here = [s for s in args.system_list if child or s not in CHILD_SYSTEMS]
    rows = []
    wanted_child = [s for s in args.system_list if s in CHILD_SYSTEMS and not child]
    if wanted_child:  # first, while nothing else of this run holds the GPU
        def exchange(obj):
            out = [obj]
            dist.broadcast_object_list(out, src=0)
            return out[0]

        rows += run_child(args, me.rank, me.world, wanted_child, exchange)
    for batch in args.batch_list:
        state = model.make_state(me.shard, me.rank, batch, seed=args.seed, device=me.device)
        h0 = state.h.clone()
        reference = None
        for system in here:
            row, final = run_system(me, system, batch, state, h0, reference)
            if system == "reference":
                reference = final
            rows.append(row)
            if me.rank == 0:
                print(f"batch {batch:>4} {system:>14}: {row.get('step_us') or row.get('error')}", flush=True)
        del state
        torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()
    return rows, me.world, me.rank
