"""A CPU stand-in for a Purlin communicator and its kernels, across real processes.

The stand-in keeps every part of the torch integration real except the GPU: the process group's
store, the key space ``purlinc.runtime.torchstore`` picks for the group, and the host exchange
(``rendezvous.Exchange``) a communicator would use.  A collective call sends this rank's input
bytes through that exchange and computes its output with the spec's NumPy evaluator.  Every
payload also carries the sender's global rank and the group it believes it is in, and every
receiver checks that exactly its own group's members answered, in group-rank order: a call that
ever met a rank of another group fails at once, naming both.

Used by tests/test_torch_groups.py and tests/test_torch_backend.py (their worker processes import it).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from purlinc.frontend.check import check
from purlinc.frontend.evaluate import evaluate, evaluate_sized
from purlinc.frontend.parse import parse
from purlinc.runtime.errors import ArgumentError
from purlinc.runtime.interop import _torch_dtype_map
from purlinc.runtime.rendezvous import Exchange
from purlinc.runtime.torchstore import store_for

CALLS: list[tuple] = []  # (collective name, global ranks) of every stand-in call this process made


class FakeComm:
    def __init__(self, rank, world_size, exchange, ranks, device="cpu"):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.exchange, self.ranks = exchange, list(ranks)

    def allgather(self, obj):
        return self.exchange(obj)


class ExchangeStandIn:
    """One rank's collective: its bytes through the group's exchange, its output from the evaluator."""

    def __init__(self, source, params, comm: FakeComm):
        self.spec = check(parse(source), comm.world_size, params)
        self.comm = comm
        self.warmed = set()

    def is_warm(self, dtype, op, count):
        return True

    def close(self):
        pass

    def __call__(self, x=None, out=None, op="sum", *rest, row=1, expected_sizes=None):
        if x is not None and out is not None and x.numel() and out.numel():  # as the runtime's validate_call
            a0, b0 = x.data_ptr(), out.data_ptr()
            if a0 < b0 + out.numel() * out.element_size() and b0 < a0 + x.numel() * x.element_size():
                raise ArgumentError(f"{self.spec.name} on rank {self.comm.rank}: x and out overlap")
        if self.spec.sizes is not None:  # the all-to-all with run-time sizes: (x, sizes, out, out_sizes)
            return self._sized(x, out, op, *rest, row=row, expected_sizes=expected_sizes)  # x, sizes, out, out_sizes
        spec, comm, r = self.spec, self.comm, self.comm.rank
        ins, outs = len(spec.inputs[r]), len(spec.outputs[r])
        probe = x if x is not None else out
        dtype = _torch_dtype_map()[probe.dtype]
        count = x.numel() // ins if ins else out.numel() // outs
        me = comm.ranks[r]
        data = x.reshape(-1).view(torch.uint8).numpy().tobytes() if x is not None else b""
        got = comm.exchange((me, tuple(comm.ranks), spec.name, count, data))
        senders = [g[0] for g in got]
        if senders != comm.ranks or any(g[1] != tuple(comm.ranks) for g in got):
            raise AssertionError(f"rank {me} in group {comm.ranks} exchanged with {[(g[0], g[1]) for g in got]}")
        if {(g[2], g[3]) for g in got} != {(spec.name, count)}:
            raise AssertionError(f"rank {me}: the group's ranks call different collectives: {[g[2:4] for g in got]}")
        CALLS.append((spec.name, tuple(comm.ranks)))
        slots = [np.frombuffer(g[4], dtype.storage) for g in got]
        result = evaluate(spec, slots, count, dtype, op if spec.is_reduce else None)[r]
        if out is not None:
            bits = torch.from_numpy(np.ascontiguousarray(result).view(np.uint8).copy())
            out.copy_(bits.view(out.dtype).view(out.shape))
        return out


    def _sized(self, x, sizes, out, out_sizes, row=1, expected_sizes=None):
        """Sizes count rows of ``row`` elements; the host checked them against the capacity.
        ``expected_sizes``: the rows this rank expects from each rank (its output's layout)."""
        spec, comm, r = self.spec, self.comm, self.comm.rank
        dtype = _torch_dtype_map()[x.dtype]
        data = x.reshape(-1).view(torch.uint8).numpy().tobytes()
        got = comm.exchange((comm.ranks[r], tuple(comm.ranks), spec.name, [int(v) * row for v in sizes.tolist()], data))
        if [g[0] for g in got] != comm.ranks:
            raise AssertionError(f"rank {comm.ranks[r]} in group {comm.ranks} exchanged with {[g[0] for g in got]}")
        CALLS.append((spec.name, tuple(comm.ranks)))
        slots = [np.frombuffer(g[4], dtype.storage) for g in got]
        current = out.reshape(-1).view(torch.uint8).numpy().view(dtype.storage)
        expected = [None] * len(got)
        if expected_sizes is not None:
            expected[r] = [int(v) * row for v in expected_sizes.tolist()]
        outs, written, _ = evaluate_sized(spec, slots, [g[3] for g in got], 1 << 62,
                                          [current if i == r else np.empty(0, dtype.storage) for i in range(len(got))],
                                          expected)
        out.reshape(-1).view(torch.uint8).copy_(torch.from_numpy(np.ascontiguousarray(outs[r]).view(np.uint8).copy()))
        out_sizes.copy_(torch.tensor([v // row for v in written[r]], dtype=torch.int64))
        return out, out_sizes


def factory(pg, ranks):
    """``purlinc.torch.groups.factory``'s stand-in: a fake communicator over the group's own key space."""
    rank = dist.get_rank(pg)
    comm = FakeComm(rank, len(ranks), Exchange(store_for(pg, timeout=60), rank, len(ranks)), ranks)
    return comm, lambda source, params: ExchangeStandIn(source, params, comm)
