"""Hierarchical collectives at run time: Purlin kernels inside each node, NCCL between nodes.

``purlinc.load(path, None, gpus_per_node=G)`` under torchrun (``torch.distributed`` initialised
with NCCL, ``torch.cuda.set_device`` done) derives the ``HierPlan`` of the spec for the
world's R ranks (``purlinc.snac.hierplan``), checks it (``verify_plan``), and builds:
(before any of it, one world-wide exchange of every rank's G, host and planning outcome, so
that a refusal at load -- nodes of unequal size, a rank that cannot plan -- is raised by every
rank alike instead of leaving the others waiting in a collective)

- one Purlin ``Communicator`` per node (the node's G ranks, bootstrapped through the torch
  store under a prefix of its own, so nodes never share a group name);
- one NCCL sub-group per local index (``torch.distributed.new_group``, every rank creating
  every group in the same order, as torch requires), warmed up at load so that the first
  point-to-point call needs no other rank;
- per intra phase, an ordinary Purlin collective loaded from the node's sub-spec as .pln text
  (``purlinc.snac.hiersource``): its own staging, signals and compiled kernels.

A call runs the phases in order on the caller's current torch stream: intra phases as Purlin
launches, inter phases as NCCL (``all_reduce`` where the moves are exactly an all-reduce with
aligned units, else ``batch_isend_irecv`` plus a local reduction in node order).  Scratch
buffers are allocated on the first call of a (dtype, count): warm up before capturing a CUDA
graph, as for flat collectives.  That first call also makes the ranks of the whole world agree on
(dtype, op, count) through the torch store (host only): the intra phases' own agreement covers
one node, and ranks of different nodes passing different counts would otherwise reach NCCL with
different sizes (a hang, or wrong data) instead of a ``MismatchError``.

On GPUs: tests/gpu/hier_check.py (every standard collective, 2 nodes x 1 GPU and 1 node x 2
GPUs, eager and CUDA graphs, against NCCL) passed on 2 x H200 (tests/gpu/results/).
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import numbers
import os
from dataclasses import dataclass, replace

from purlinc.dtypes import ReduceOp
from purlinc.errors import PurlinError
from purlinc.frontend.ast import Operation
from purlinc.runtime import bootstrap
from purlinc.runtime.collective import prepare_options
from purlinc.runtime.communicator import Communicator
from purlinc.runtime.options import LoadOptions
from purlinc.runtime.placement import load_compiled
from purlinc.runtime.rendezvous import small_digits
from purlinc.snac.algorithms import DEFAULT_ALGORITHM, get_algorithm
from purlinc.snac.hierarchy import IN, OUT, HierPlan, InterPhase, IntraPhase, TopologyError

_LOADS = itertools.count()  # every rank loads in the same order: the same serial everywhere
# (default group, world size, G) -> this rank's local-index NCCL group, shared by every load of
# that topology (every rank makes the same loads in the same order, so all create the groups
# together).  The default group is in the key (and kept alive by it): after
# destroy_process_group and a new init_process_group the old sub-groups are dead, and reusing
# them would fail or hang in the first NCCL call instead of creating new ones.
_GROUPS: dict = {}


class _TorchStore:
    """The store interface ``rendezvous.Exchange`` uses, over torch's c10d store."""

    def __init__(self, store, timeout: float):
        self.store, self.timeout = store, timeout

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        from purlinc.runtime.rendezvous import RendezvousTimeout

        try:
            self.store.wait([key], datetime.timedelta(seconds=timeout or self.timeout))
        except Exception as error:  # torch's DistStoreError: report as the exchange's timeout
            raise RendezvousTimeout(f"torch store: {key} did not arrive: {str(error).splitlines()[0]}") from error
        return bytes(self.store.get(key))

    def add(self, key: str, delta: int) -> int:
        return int(self.store.add(key, delta))

    def delete(self, keys) -> None:
        for key in keys:
            self.store.delete_key(key)


@dataclass
class _Inter:
    """One inter phase as this rank runs it (everything in the plan's global move order)."""

    index: int
    phase: InterPhase
    group: object
    copies: list  # (dst unit, src unit): local copies
    sends: list  # (src unit, peer rank)
    recvs: list  # (dst unit or ("tmp", k), peer rank)
    reductions: list  # (dst unit, [("src", unit) | ("tmp", k)]) in the move's source order
    temps: int
    all_reduce: bool  # the moves are one all_reduce of this rank's src buffer into its dst buffer


def _torch_op(dist, op: ReduceOp):
    return {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.PROD: dist.ReduceOp.PRODUCT,
            ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.MIN: dist.ReduceOp.MIN}[op]


def _inter_for(plan: HierPlan, index: int, phase: InterPhase, rank: int, group) -> _Inter:
    copies, sends, recvs, reductions = [], [], [], []
    temps = 0
    t = plan.topology
    # One NCCL all_reduce per sub-group when, on every rank (all must take the same path), the
    # moves reduce every unit of the src buffer over the whole group into the same unit of dst.
    src_units, dst_units = plan.layout(phase.src).units, plan.layout(phase.dst).units
    aligned = (
        phase.nccl == "all_reduce" and phase.operation is Operation.REDUCE
        and all(len(src_units[r]) == len(dst_units[r]) for r in range(t.world_size))
        and len(phase.moves) == sum(len(u) for u in dst_units)
        and all(s.unit == m.dst.unit for m in phase.moves for s in m.srcs)
        and all([s.rank for s in m.srcs] == list(t.group(t.local_of(m.dst.rank))) for m in phase.moves)
    )
    for move in phase.moves:
        if phase.operation is Operation.COPY:
            (src,) = move.srcs
            if src.rank == move.dst.rank == rank:
                copies.append((move.dst.unit, src.unit))
            elif src.rank == rank:
                sends.append((src.unit, move.dst.rank))
            elif move.dst.rank == rank:
                recvs.append((move.dst.unit, src.rank))
            continue
        parts = []
        for src in move.srcs:
            if move.dst.rank == rank:
                if src.rank == rank:
                    parts.append(("src", src.unit))
                else:
                    recvs.append((("tmp", temps), src.rank))
                    parts.append(("tmp", temps))
                    temps += 1
            elif src.rank == rank:
                sends.append((src.unit, move.dst.rank))
        if move.dst.rank == rank:
            reductions.append((move.dst.unit, parts))
    return _Inter(index, phase, group, copies, sends, recvs, reductions, temps, aligned)


class HierarchicalCollective:
    """One rank's hierarchical collective: ``coll(x, out=None, op="sum", count=None)``."""

    def __init__(self, plan: HierPlan, rank: int, device: int | str, node_comm, intra: dict, inter: dict,
                 world_exchange=None):
        self.plan, self.rank, self.device = plan, rank, device
        self.node_comm = node_comm
        self._intra = intra  # phase index -> Purlin collective (absent: nothing to do on this node)
        self._inter = inter  # phase index -> _Inter
        self._scratch: dict = {}
        self._world = world_exchange  # Exchange over every rank of the world (host only), or None
        self._agreed: set = set()  # (dtype, op, count) every rank of the world agreed on

    @property
    def _where(self) -> str:
        """Where scratch and outputs go: the CUDA device (an index); a string device (``"cpu"``)
        only in CPU tests that stand in for the intra phases."""
        return self.device if isinstance(self.device, str) else f"cuda:{self.device}"

    def __repr__(self) -> str:
        t = self.plan.topology
        return f"HierarchicalCollective({self.plan.spec.name}, rank {self.rank}, {t.nodes} nodes x {t.gpus_per_node} GPUs)"

    def _buffers(self, dtype, count: int) -> dict:
        import torch

        key = (dtype, count)
        buffers = self._scratch.get(key)
        if buffers is None:
            buffers = {}
            for layout in self.plan.layouts:
                if layout.name not in (IN, OUT):
                    units = len(layout.units[self.rank])
                    buffers[layout.name] = torch.empty(units * count, dtype=dtype, device=self._where)
            for index, inter in self._inter.items():
                buffers[("tmp", index)] = torch.empty(inter.temps * count, dtype=dtype, device=self._where)
            self._scratch[key] = buffers
        return buffers

    def __call__(self, x=None, out=None, op="sum", *, count: int | None = None, dtype=None):
        """Run on this rank's buffers; returns ``out`` (allocated where not given).  The
        arguments are checked as a flat call's are (``validate.validate_call``).  A rank whose
        spec gives it no input and no output still takes part (it may hold scratch units): pass
        ``count`` and ``dtype``."""
        import torch

        spec, rank = self.plan.spec, self.rank
        n_out = len(spec.outputs[rank])
        try:
            shape = self._shape(x, out, op, count, dtype)
        except PurlinError as error:
            self._refuse(error)
            raise
        reduce_op, count = shape.op, shape.count
        dtype = getattr(torch, shape.dtype.info.torch_name)
        if out is None and n_out:
            out = torch.empty(n_out * count, dtype=dtype, device=self._where)
        # Scratch first, then the agreement: a rank that cannot allocate (out of memory) says
        # so in the exchange and every rank raises, instead of the others going on into the
        # phases and waiting for it there.
        try:
            buffers, problem = self._buffers(dtype, count), None
        except RuntimeError as error:  # torch.OutOfMemoryError and other allocation failures
            buffers, problem = None, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        self._agree(shape.dtype.value, reduce_op.value if reduce_op else None, count, problem)
        if problem is not None:  # no exchange to join (not under torch.distributed): raise here
            raise PurlinError(f"{spec.name}: rank {rank}: scratch buffers for {count} elements per chunk: {problem}")
        views = dict(buffers)
        views[IN] = x.reshape(-1) if x is not None else None
        views[OUT] = out.reshape(-1) if out is not None else None
        for index, phase in enumerate(self.plan.phases):
            if isinstance(phase, IntraPhase):
                coll = self._intra.get(index)
                if coll is not None:
                    src, dst = views[phase.src], views[phase.dst]
                    src = src if src is not None and src.numel() else None
                    dst = dst if dst is not None and dst.numel() else None
                    # A rank with nothing in this phase passes count and dtype instead of
                    # buffers: it must still join the ranks' agreement on each new count
                    # (without them its signature never changed, and the others waited for it).
                    coll(src, dst, op=op if reduce_op else "sum", count=count,
                         dtype=dtype if src is None and dst is None else None)
            else:
                self._run_inter(self._inter[index], views, buffers[("tmp", index)], count, reduce_op)
        return out

    def _shape(self, x, out, op, count, dtype):
        """The call's dtype, op and count, every argument checked as a flat call checks it
        (``validate_call``: ArgumentError naming the tensor or argument, the expected and the
        actual).  All of it is this rank's own business and comes before any exchange: a wrong
        call raises here at once.  Before any signature is agreed (the first call after the
        load or ``free_scratch``) the other ranks are all in the agreement, and ``_refuse``
        tells them; later they may not be, and wait for this rank in the agreement (a new
        signature: RendezvousTimeout after the exchange's timeout) or in the phases (a known
        one: NCCL's or the intra phase's timeout), as for flat collectives."""
        from purlinc.runtime import interop
        from purlinc.runtime.errors import ArgumentError
        from purlinc.runtime.validate import validate_call

        spec, rank = self.plan.spec, self.rank
        n_in, n_out = len(spec.inputs[rank]), len(spec.outputs[rank])
        where = f"{spec.name} (hierarchical) on rank {rank}"
        xi = interop.described(where, "x", x) if x is not None else None
        oi = interop.described(where, "out", out) if out is not None else None
        no_x = xi is None or (not n_in and not xi.numel)  # an empty x where the rank gives nothing: None
        if no_x and out is None and count is None and n_out and not n_in:
            # validate_call would take this for an empty call; here out is allocated, so the
            # count has to come from somewhere (x missing where n_in > 0: validate_call says so).
            raise ArgumentError(f"{where}: out or count= is required (this rank receives {n_out} chunk(s) and gives "
                                "none), got neither", notes=("pass out, or count= and dtype= (out is then allocated)",))
        if not (n_in or n_out) and count is None:
            # A flat call would be an empty one; here the rank may hold scratch units between
            # phases, sized by the count the others pass.
            raise ArgumentError(f"{where}: count= is required (this rank gives and receives no chunks), got None",
                                notes=("pass count= and dtype=, the same as the other ranks",))
        # out may be left out (it is allocated): checked as a rank without output would be.
        out_units = n_out if out is not None else 0
        if dtype is None:  # an empty x (or out) still says the dtype of a rank that passes no data
            dtype = next((i.dtype for i in (xi, oi) if i is not None and i.dtype is not None), None)
        device = -1 if isinstance(self.device, str) else self.device  # CPU stand-ins: tensors on the host
        return validate_call(xi, oi, name=f"{spec.name} (hierarchical)", rank=rank, device=device, in_units=n_in,
                             out_units=out_units, is_reduce=spec.is_reduce, op=op, count=count, dtype_hint=dtype)

    def _agree(self, dtype: str, op: str | None, count: int, problem: str | None = None) -> None:
        """The first call of each (dtype, op, count): every rank of the world exchanges it (one
        host round through the torch store; nothing on the device, so capture is unaffected once
        warm) and raises ``MismatchError`` before anything runs if any rank differs.  Known
        signatures cost a set lookup.  As for flat collectives, a rank repeating a known
        signature while another makes a new one is not caught here (the exchange's timeout and
        the device-side bound are).  ``problem``: why this rank cannot run the call (its scratch
        allocation failed); every rank then raises it.  A new (dtype, count) always comes here
        with a new key (scratch and agreement are dropped together), so a failed allocation is
        always exchanged."""
        from purlinc.runtime.validate import CallSignature, disagreement

        key = (dtype, op, count)
        if self._world is None or key in self._agreed:
            return
        name = self.plan.spec.name
        mine = CallSignature(name, dtype, op, count)
        everyone = self._world(("hier-call", mine.as_tuple(), problem))
        _raise_refusals(name, everyone)
        mismatch = disagreement(f"{name} (hierarchical)", [
            CallSignature.from_tuple(e[1]) if e[0] == "hier-call" else CallSignature(f"another exchange ({e[0]})", None, None, None)
            for e in everyone])
        if mismatch is not None:
            raise mismatch
        failed = [(r, e[2]) for r, e in enumerate(everyone) if e[2]]
        if failed:
            raise PurlinError(f"{name} (hierarchical): no call with {count} elements per chunk: "
                              + "; ".join(f"rank {r}: {why}" for r, why in failed),
                              notes=("every rank raised this; nothing was launched",))
        self._agreed.add(key)

    def _refuse(self, error: PurlinError) -> None:
        """Tell the other ranks that this rank's call was refused, where they are sure to be
        waiting for it: no signature is agreed yet, so (every agreement being world-wide, every
        rank's set is this one) each other rank's call is new to it and waits in the agreement's
        next round.  There they raise at once, naming this rank, instead of after the exchange's
        timeout.  Later calls cannot tell: a rank repeating a known signature joins no exchange,
        and a record left for it would answer another call."""
        if self._world is None or self._agreed:
            return
        message = getattr(error, "message", str(error)).splitlines()
        try:
            self._world(("hier-call-refused", type(error).__name__, message[0] if message else ""))
        except PurlinError:  # e.g. a rank that never calls: this rank's own refusal is the one to raise
            pass

    def warm(self, dtype, op="sum") -> None:
        """Compile and load every intra phase's kernel for (dtype, op) now (a collective: every
        rank calls it).  Scratch buffers still come with the first call of each count."""
        for coll in self._intra.values():
            coll.warm(dtype, op)  # a copy phase ignores op

    def check(self) -> None:
        """Raise the device-side error (a timed-out wait) an intra phase recorded, if any."""
        for coll in self._intra.values():
            coll.check()

    def free_scratch(self) -> None:
        """Drop the scratch buffers of every (dtype, count) seen so far (the next call of each
        allocates again, and agrees again).  No CUDA graph that captured a call may be replayed
        afterwards.  Call it on every rank alike."""
        self._scratch.clear()
        self._agreed.clear()

    def _run_inter(self, inter: _Inter, views: dict, tmp, count: int, reduce_op) -> None:
        import torch.distributed as dist

        src, dst = views[inter.phase.src], views[inter.phase.dst]

        def unit(buffer, u):
            return buffer[u * count:(u + 1) * count]

        try:
            if inter.all_reduce:
                dst.copy_(src)
                dist.all_reduce(dst, op=_torch_op(dist, reduce_op), group=inter.group)
                return
            for d, s in inter.copies:
                unit(dst, d).copy_(unit(src, s))
            ops = [dist.P2POp(dist.isend, unit(src, s), peer, inter.group) for s, peer in inter.sends]
            ops += [dist.P2POp(dist.irecv, unit(tmp, d[1]) if isinstance(d, tuple) else unit(dst, d), peer, inter.group)
                    for d, peer in inter.recvs]
            # NCCL matches a pair's point-to-point operations in order; both sides list them in
            # the plan's global move order, so sends and receives pair up.
            if ops:
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
        except RuntimeError as error:  # torch's DistBackendError and NCCL errors
            raise PurlinError(
                f"{self.plan.spec.name}: rank {self.rank}: NCCL failed in phase {inter.index} "
                f"({inter.phase.nccl}, {inter.phase.src} -> {inter.phase.dst}): {str(error).splitlines()[0]}"
            ) from error
        for d, parts in inter.reductions:
            tensors = [unit(src, u) if kind == "src" else unit(tmp, u) for kind, u in parts]
            unit(dst, d).copy_(_reduce(tensors, reduce_op))

    def close(self) -> None:
        for coll in self._intra.values():
            close = getattr(coll, "close", None)
            if close is not None:
                close()
        self._intra.clear()
        self._scratch.clear()
        if self.node_comm is not None:
            self.node_comm.close()
            self.node_comm = None


def _raise_refusals(name: str, everyone: list) -> None:
    """On every rank that made a call the others could not check, the refusals other ranks made
    (``HierarchicalCollective._refuse``): one error naming each refused rank and why."""
    refused = [(rank, e[1], e[2]) for rank, e in enumerate(everyone) if e[0] == "hier-call-refused"]
    if refused:
        shown = "; ".join(f"rank {rank}: {kind}: {line}" for rank, kind, line in refused)
        raise PurlinError(f"{name} (hierarchical): no call: the call was refused on {shown}",
                          notes=("every rank raised; the ranks named raised their own error, nothing was launched",))


def _reduce(tensors, op: ReduceOp):
    """In order, float32 accumulation for floats (as the kernels), int32 wrapping for int32."""
    import torch

    fn = {ReduceOp.SUM: torch.add, ReduceOp.PROD: torch.mul, ReduceOp.MAX: torch.maximum, ReduceOp.MIN: torch.minimum}[op]
    wide = tensors[0].dtype.is_floating_point
    acc = tensors[0].float() if wide else tensors[0].clone()
    for t in tensors[1:]:
        acc = fn(acc, t.float() if wide else t)
    return acc


@dataclass(frozen=True)
class _RankView:
    """What one rank brings to the load's single world-wide exchange: its host, its G and where
    that came from, why that G is unusable (None: it is usable), and the outcome of planning
    with it (the collective's fingerprint, or the error's type and first line)."""

    host: str
    gpus_per_node: int | None  # given, or LOCAL_WORLD_SIZE's; None where unusable (see problem)
    source: str  # "gpus_per_node" (given) or "LOCAL_WORLD_SIZE"
    problem: str | None
    planned: tuple  # ("ok", name, fingerprint) or ("error", type name, first line)

    @property
    def shown(self) -> str:
        """This rank's G for a message: the value and its source, or why it has none."""
        if self.problem is not None:
            return self.problem
        if self.source == "LOCAL_WORLD_SIZE":
            return f"LOCAL_WORLD_SIZE={self.gpus_per_node}"
        return f"gpus_per_node={self.gpus_per_node} (given)"


def _own_gpus_per_node(gpus_per_node) -> tuple[int | None, str, str | None]:
    """(G, where it came from, why it is unusable or None) on this rank, without raising: a
    rank must not refuse alone before the exchange, or the others wait for it there."""
    if gpus_per_node is not None:
        if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, numbers.Integral) or gpus_per_node < 1:
            return None, "gpus_per_node", f"gpus_per_node must be an integer >= 1, got {gpus_per_node!r}"
        return int(gpus_per_node), "gpus_per_node", None
    text = os.environ.get("LOCAL_WORLD_SIZE")
    if text is None:
        return None, "LOCAL_WORLD_SIZE", "gpus_per_node: not given and LOCAL_WORLD_SIZE (torchrun) is not set"
    digits = text.strip()
    # Read as the launcher's other variables are (rendezvous): ASCII digits of a bounded number
    # ("²" passed str.isdigit(), then int() refused it; 5,000 digits, the same)
    if not small_digits(digits) or int(digits) < 1:
        return None, "LOCAL_WORLD_SIZE", (f"gpus_per_node: not given, and LOCAL_WORLD_SIZE={text!r} is not a "
                                          "whole number >= 1")
    return int(digits), "LOCAL_WORLD_SIZE", None


def _fingerprint(plan: HierPlan) -> str:
    """The collective a rank planned, in a few bytes: ranks loading different specs (or params)
    would otherwise meet in the node bootstrap and the phases with different shapes."""
    spec = plan.spec
    text = repr((spec.name, spec.operation, spec.inputs, spec.outputs, plan.topology))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _plan_here(path_or_source, R: int, G, problem: str | None, params, algorithm):
    """This rank's plan with its own G (None where that G is unusable) and the outcome to
    exchange; a planning error is kept, to be raised after the exchange with every rank's."""
    if problem is not None:
        return None, ("skipped",), None
    try:
        get_algorithm(algorithm)  # an unknown name: refused on every rank alike, below
        plan = plan_for(path_or_source, R, G, params)
    except Exception as error:  # noqa: BLE001 - exchanged, then raised (see _settle)
        message = getattr(error, "message", str(error)).splitlines()
        return None, ("error", type(error).__name__, message[0] if message else ""), error
    return plan, ("ok", plan.spec.name, _fingerprint(plan)), None


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _by_value(values) -> list[tuple[object, list[int]]]:
    """(value, the ranks that have it), in the order of each value's lowest rank."""
    groups: dict = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return list(groups.items())


def _agreed_gpus_per_node(everyone: list[_RankView], R: int) -> int:
    """The one G every rank has, or the same TopologyError on every rank: naming each rank's G
    and where it came from where they differ (or some have none), why it is unusable where no
    rank has a usable one, R not a multiple of G saying where G came from."""
    usable = {v.gpus_per_node for v in everyone if v.problem is None}
    if len(usable) != 1 or any(v.problem is not None for v in everyone):
        groups = _by_value([v.shown for v in everyone])
        if len(groups) == 1:  # one unusable value everywhere (a TopologyError, as Topology.of's)
            raise TopologyError(groups[0][0], notes=("every rank raised this; nothing was loaded",))
        shown = "; ".join(f"{_ranks_text(ranks)}: {text}" for text, ranks in groups)
        if not usable:
            raise TopologyError(shown, notes=("every rank raised this; nothing was loaded",))
        raise TopologyError(f"nodes of unequal size: the ranks disagree on gpus_per_node: {shown}",
                            notes=("a hierarchical plan needs R = nodes x gpus_per_node, the same on every node; "
                                   "gpus_per_node= (the same on every rank) overrides LOCAL_WORLD_SIZE",
                                   "every rank raised this; nothing was loaded"))
    (G,) = usable
    if R % G:
        # Planning would say so too, but not that G is torchrun's rather than the caller's.
        origin = " (torchrun's LOCAL_WORLD_SIZE)" if all(v.source == "LOCAL_WORLD_SIZE" for v in everyone) else ""
        raise TopologyError(f"world size R={R} is not a multiple of gpus_per_node={G}{origin}",
                            notes=("ranks are grouped into nodes of gpus_per_node ranks each: "
                                   "R = nodes x gpus_per_node",
                                   *(("pass gpus_per_node= to group the ranks otherwise",) if origin else ())))
    return G


def _check_nodes(everyone: list[_RankView], G: int) -> None:
    """Every node (G consecutive ranks) on one host.  Only this decides once G is agreed: with
    G given, LOCAL_WORLD_SIZE may differ (ranks of several torchrun nodes grouped otherwise)."""
    for node in range(len(everyone) // G):
        hosts = sorted({everyone[r].host for r in range(node * G, (node + 1) * G)})
        if len(hosts) > 1:
            raise TopologyError(f"node {node} (ranks {node * G}..{node * G + G - 1}) spans hosts {hosts}: "
                                f"gpus_per_node={G} does not match how the ranks are placed")


def _check_plans(everyone: list[_RankView], own_error: BaseException | None) -> None:
    """Raise, on every rank, what planning raised on any (this rank's own error where it has
    one), or a MismatchError where the ranks planned different collectives."""
    from purlinc.runtime.errors import MismatchError

    failed = [(r, v.planned) for r, v in enumerate(everyone) if v.planned[0] == "error"]
    if own_error is not None:
        raise own_error
    if failed:
        shown = "; ".join(f"rank {r}: {kind}: {line}" for r, (_, kind, line) in failed)
        raise PurlinError(f"no hierarchical load: {shown}",
                          notes=("every rank raised; the ranks named raised their own error",))
    collectives = _by_value([v.planned for v in everyone])
    if len(collectives) > 1:
        shown = "; ".join(f"{_ranks_text(ranks)}: {planned[1]} ({planned[2]})" for planned, ranks in collectives)
        raise MismatchError(f"the ranks load different collectives (spec, params or world): {shown}",
                            notes=("every rank must load the same collective, in the same order",))


def _settle(dist, path_or_source, gpus_per_node, params, algorithm) -> HierPlan:
    """The checked plan, the same on every rank, from ONE world-wide exchange made before any
    rank can refuse: each rank's G and its source, host and planning outcome.  Every refusal
    after it is computed from what every rank sees, so all ranks raise the same error (a rank
    refusing alone before an exchange would leave the others waiting in it until the process
    group's timeout)."""
    import socket

    R = dist.get_world_size()
    G, source, problem = _own_gpus_per_node(gpus_per_node)
    plan, planned, error = _plan_here(path_or_source, R, G, problem, params, algorithm)
    mine = _RankView(socket.gethostname(), G, source, problem, planned)
    everyone = [None] * R
    dist.all_gather_object(everyone, mine)
    G = _agreed_gpus_per_node(everyone, R)
    _check_nodes(everyone, G)
    _check_plans(everyone, error)
    return plan


def _phase_algorithm(algorithm, shape) -> str:
    """The planner's rule (``hierplan.phase_algorithm``), so the runtime loads the phases that
    ``purlinc check --gpus-per-node`` checked (two-shot has nothing to do in a copy phase)."""
    from purlinc.snac.hierplan import phase_algorithm

    return phase_algorithm(get_algorithm(algorithm).algorithm, shape).value


def plan_for(path_or_source, world_size: int, gpus_per_node: int, params=None) -> HierPlan:
    """The checked hierarchical plan of a .pln path or source for ``world_size`` ranks in nodes
    of ``gpus_per_node`` (no GPU, no torch): what a load derives, and what a precompile needs."""
    from purlinc import pipeline
    from purlinc.snac.hiercheck import verify_plan
    from purlinc.snac.hierplan import plan_hierarchical

    spec = pipeline.spec_of(pipeline.load_source(path_or_source), world_size, params)
    plan = plan_hierarchical(spec, gpus_per_node)  # TopologyError for R not a multiple of G
    verify_plan(plan, schedules=False)
    return plan


def intra_sources(plan: HierPlan, node: int) -> dict[int, str]:
    """Phase index -> the .pln text a node loads for each intra phase with work on it (the
    same on every rank of the node: it depends on the node's sub-spec only)."""
    from purlinc.snac.hiersource import has_work, phase_name, phase_source

    out = {}
    for index, phase in enumerate(plan.phases):
        if isinstance(phase, IntraPhase):
            shape = plan.canonical[phase.schedules[node]]
            if has_work(shape):
                out[index] = phase_source(shape, phase_name(plan.spec.name, index))
    return out


def load_hierarchical(path_or_source, gpus_per_node: int | None = None, options: LoadOptions = LoadOptions(), *,
                      heap_bytes: int | None = None, algorithm: str = DEFAULT_ALGORITHM.value) -> HierarchicalCollective:
    """This rank's hierarchical collective over the torch.distributed world (a collective call).
    ``options`` gives the params and target; each intra-node phase runs ``algorithm``."""
    import torch
    import torch.distributed as dist

    from purlinc.runtime import driver
    from purlinc.runtime.rendezvous import DEFAULT_TIMEOUT_S, Exchange

    if not dist.is_initialized():
        raise PurlinError("a hierarchical load runs under torch.distributed: call init_process_group first")
    R, rank = dist.get_world_size(), dist.get_rank()
    plan = _settle(dist, path_or_source, gpus_per_node, options.param_map, algorithm)
    t = plan.topology
    spec = plan.spec
    node, local = t.node_of(rank), t.local_of(rank)
    device = torch.cuda.current_device()
    serial = next(_LOADS)

    world_group = dist.distributed_c10d._get_default_group()
    group = _GROUPS.get((world_group, R, t.gpus_per_node))
    if group is None:
        groups = [dist.new_group(ranks=list(t.group(l))) for l in range(t.gpus_per_node)]
        group = _GROUPS[(world_group, R, t.gpus_per_node)] = groups[local]
        warm = torch.zeros(1, device=f"cuda:{device}")
        dist.all_reduce(warm, group=group)  # creates the NCCL communicator now, with every member
        torch.cuda.synchronize(device)

    store = _TorchStore(dist.distributed_c10d._get_default_store(), DEFAULT_TIMEOUT_S)
    exchange = Exchange(store, local, t.gpus_per_node, prefix=f"purlin-hier/{serial}/node{node}")
    world_exchange = Exchange(store, rank, R, prefix=f"purlin-hier/{serial}/world")
    driver.set_current(device)
    node_comm = bootstrap.open_heap(Communicator, local, t.gpus_per_node, device, exchange, heap_bytes)
    # One pinned schedule per phase (not the per-size tuned set): each phase then compiles one
    # kernel per (dtype, op), and the plan's phases stay the proved ones.
    phase_options = LoadOptions(arch=options.arch).on_device(device)

    intra, inter = {}, {}
    sources = intra_sources(plan, node)
    try:
        for index, phase in enumerate(plan.phases):
            if isinstance(phase, IntraPhase):
                if index in sources:
                    shape = plan.canonical[phase.schedules[node]]
                    pinned = replace(phase_options, algorithm=_phase_algorithm(algorithm, shape))
                    coll = load_compiled(prepare_options(sources[index], t.gpus_per_node, pinned),
                                         node_comm, [node_comm])
                    intra[index] = coll
                    loaded = coll.compiled.spec if hasattr(coll, "compiled") else None
                    if loaded is not None and (loaded.inputs, loaded.outputs, loaded.sources) != (shape.inputs, shape.outputs, shape.sources):
                        raise PurlinError(f"{spec.name}: phase {index}'s generated source does not give back its sub-spec")
            else:
                inter[index] = _inter_for(plan, index, phase, rank, group)
    except BaseException:
        # Give the node's heap back: every rank of the node fails alike (the same sources, the
        # same exchanges), so each closes what it opened, in the same order (closing is local).
        try:
            HierarchicalCollective(plan, rank, device, node_comm, intra, inter).close()
        except Exception:  # noqa: BLE001 - the load's own error is the one to report
            pass
        raise
    return HierarchicalCollective(plan, rank, device, node_comm, intra, inter, world_exchange)
