"""Proving and running a ``HierPlan``: the SNAC verifier per intra-node schedule, the NCCL
phases by their semantics, and the composition symbolically.

``verify_plan`` proves, for every count:

1. *Shapes*: every phase reads and writes declared buffers, nothing writes ``in``, every
   node's sub-spec has the layouts of the buffers it runs on (so its local unit ``u`` of
   rank ``l`` is unit ``u`` of global rank ``node * G + l``), its shape is the canonical
   spec its schedule was made for, and every move stays in bounds, within one sub-group
   (one local index) and writes a unit at most once per phase.
2. *Intra-node schedules*: each distinct schedule by ``snac.verify`` against its canonical
   spec (deadlock, races, cross-call reuse, result), so a node phase computes exactly its
   sub-spec.  Each schedule has its own staging and signals and phases are ordered on the
   caller's stream, so a phase cannot race with another.
3. *Result*: symbolic execution of the phases in order.  A unit holds a multiset of input
   slots of the whole collective (a copy: one slot); an intra phase's output is its
   sub-spec's sources mapped to global units, an NCCL move is its sources; every unit read
   must have been written, and every ``out`` unit must hold what the spec names
   (a reduction: every occurrence exactly once; a copy: one of its producers).
4. *Agreement* (reductions): beside its multiset, each unit carries the order it was formed
   in (a move reduces its sources in their order; an intra phase as its proved schedule
   forms that chunk), and every holder of a reduced chunk must have formed it alike, so
   replicated outputs agree bit for bit, as ``snac.verify``'s step 5 proves per schedule.

``simulate_plan`` runs the plan on NumPy buffers: intra phases with ``snac.simulate`` (the
schedules' own random interleavings), NCCL moves with ``evaluate.reduce_chunks``.  Scratch
buffers start poisoned.  Reductions add node partials, not all inputs at once, so floats
differ from the evaluator by rounding (compare with a tolerance); int32 sum wraps and is
associative, max and min too, so those are bitwise equal to the evaluator.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from purlinc.dtypes import DType, ReduceOp
from purlinc.frontend.ast import Operation
from purlinc.frontend.evaluate import reduce_chunks
from purlinc.frontend.spec import Slot
from purlinc.snac.hierarchy import IN, OUT, HierPlan, IntraPhase
from purlinc.snac.hierplan import canonical
from purlinc.snac.simulate import POISON_OUT, simulate
from purlinc.snac.verify import VerificationError, verify


def _fail(message: str, phase: int | None = None) -> VerificationError:
    where = f"phase {phase}: " if phase is not None else ""
    return VerificationError(f"hierarchical plan: {where}{message}")


def _check_shapes(plan: HierPlan) -> None:
    t, spec = plan.topology, plan.spec
    if t.world_size != spec.world_size:
        raise _fail(f"topology has {t.world_size} ranks, the spec {spec.world_size}")
    names = [layout.name for layout in plan.layouts]
    if len(set(names)) != len(names) or IN not in names or OUT not in names:
        raise _fail(f"buffers must be unique and include in and out, got {names}")
    for layout in plan.layouts:
        if len(layout.units) != t.world_size:
            raise _fail(f"buffer {layout.name} has {len(layout.units)} rank layouts, expected {t.world_size}")
    if plan.layout(IN).units != spec.inputs or plan.layout(OUT).units != spec.outputs:
        raise _fail("buffers in/out do not have the spec's layouts")
    for index, phase in enumerate(plan.phases):
        if phase.src not in names or phase.dst not in names:
            raise _fail(f"unknown buffer in {phase.src} -> {phase.dst}", index)
        if phase.dst == IN or phase.src == phase.dst:
            raise _fail(f"writes {phase.dst} (from {phase.src})", index)
        src, dst = plan.layout(phase.src), plan.layout(phase.dst)
        if isinstance(phase, IntraPhase):
            if len(phase.specs) != t.nodes or len(phase.schedules) != t.nodes:
                raise _fail(f"{len(phase.specs)} node specs for {t.nodes} nodes", index)
            for node, (sub, which) in enumerate(zip(phase.specs, phase.schedules)):
                ranks = t.node_ranks(node)
                if sub.world_size != t.gpus_per_node or sub.operation is not phase.operation:
                    raise _fail(f"node {node}'s sub-spec is not a {phase.operation.value} over {t.gpus_per_node} ranks", index)
                if sub.inputs != tuple(src.units[r] for r in ranks) or sub.outputs != tuple(dst.units[r] for r in ranks):
                    raise _fail(f"node {node}'s sub-spec layouts differ from buffers {phase.src}/{phase.dst}", index)
                if not 0 <= which < len(plan.schedules) or canonical(sub, plan.canonical[which].name) != plan.canonical[which]:
                    raise _fail(f"node {node}'s sub-spec is not the shape schedule #{which} was proved for", index)
        else:
            written = set()
            for move in phase.moves:
                if not move.srcs or (phase.operation is Operation.COPY and len(move.srcs) != 1):
                    raise _fail(f"move to {move.dst.format(phase.dst)} has {len(move.srcs)} sources", index)
                group = t.local_of(move.dst.rank)
                for unit, layout in [(move.dst, dst)] + [(s, src) for s in move.srcs]:
                    if not (0 <= unit.rank < t.world_size and 0 <= unit.unit < len(layout.units[unit.rank])):
                        raise _fail(f"{unit.format(layout.name)} is out of bounds", index)
                    if t.local_of(unit.rank) != group:
                        raise _fail(f"move {move.dst.format(phase.dst)} mixes local indices (NCCL sub-groups)", index)
                if move.dst in written:
                    raise _fail(f"{move.dst.format(phase.dst)} is written twice", index)
                written.add(move.dst)


def _check_result(plan: HierPlan) -> None:
    t, spec = plan.topology, plan.spec
    # Input slots as integers (C-speed sorting and comparison at R=256: an all-reduce output
    # is a multiset of R*R... slots).  (buffer, rank, unit) -> tuple of slot ids, or absent
    # (garbage).  A copy passes the same tuple object on, so equal values are often identical.
    base = [0]
    for layout in spec.inputs:
        base.append(base[-1] + len(layout))
    values: dict[tuple[str, int, int], tuple[int, ...]] = {
        (IN, r, p): (base[r] + p,) for r in range(t.world_size) for p in range(len(spec.inputs[r]))
    }

    def read(buffer: str, rank: int, unit: int, index: int) -> tuple[int, ...]:
        value = values.get((buffer, rank, unit))
        if value is None:
            raise _fail(f"reads r{rank}.{buffer}[{unit}] before anything wrote it", index)
        return value

    def combine(parts: list[tuple[int, ...]], operation: Operation) -> tuple[int, ...]:
        return parts[0] if operation is Operation.COPY else tuple(chain.from_iterable(parts))

    # How each value was formed, as far as its bits depend on it (snac.verify's step 5 for the
    # plan): an input slot, or a reduction of other values in its order; numbered once each.
    numbers: dict = {}  # form -> its number (hash-consed: equal forms, equal numbers)
    orders: dict[tuple[str, int, int], int] = {
        key: numbers.setdefault(("in", value[0]), len(numbers)) for key, value in values.items()}

    def formed(how, keys: list, operation: Operation) -> int:
        if operation is Operation.COPY or len(keys) == 1:
            return orders[keys[0]]  # a copy keeps its source's order
        return numbers.setdefault((how, tuple(orders[k] for k in keys)), len(numbers))  # in order: see races.Orders

    for index, phase in enumerate(plan.phases):
        new, new_orders = {}, {}
        if isinstance(phase, IntraPhase):
            for node, sub in enumerate(phase.specs):
                schedule = phase.schedules[node]
                canonical_outputs = plan.canonical[schedule].outputs
                for local, sources in enumerate(sub.sources):
                    rank = t.rank(node, local)
                    for position, slots in enumerate(sources):
                        keys = [(phase.src, t.rank(node, s.rank), s.position) for s in slots]
                        parts = [read(*key, index) for key in keys]
                        new[(phase.dst, rank, position)] = combine(parts, sub.operation)
                        # One schedule forms one chunk alike on every holder (its own step 5),
                        # from its sources in the sub-spec's order.
                        how = ("intra", schedule, canonical_outputs[local][position])
                        new_orders[(phase.dst, rank, position)] = formed(how, keys, sub.operation)
        else:
            for move in phase.moves:
                keys = [(phase.src, s.rank, s.unit) for s in move.srcs]
                parts = [read(*key, index) for key in keys]
                new[(phase.dst, move.dst.rank, move.dst.unit)] = combine(parts, phase.operation)
                new_orders[(phase.dst, move.dst.rank, move.dst.unit)] = formed("move", keys, phase.operation)
        values.update(new)
        orders.update(new_orders)

    canonical_values: dict[int, tuple[int, ...]] = {}  # id(value) -> sorted (the multiset)
    expected: dict[int, tuple[tuple[int, ...], tuple]] = {}  # id(sources) -> (sorted ids, sources)
    for rank in range(t.world_size):
        for position, chunk in enumerate(spec.outputs[rank]):
            value = values.get((OUT, rank, position))
            sources = spec.sources[rank][position]
            if value is None:
                raise _fail(f"r{rank}.out[{position}] ({chunk}) is never written")
            held = canonical_values.get(id(value))
            if held is None:
                held = canonical_values[id(value)] = tuple(sorted(value))
            want = expected.get(id(sources))
            if want is None or want[1] is not sources:
                want = expected[id(sources)] = (tuple(sorted(base[s.rank] + s.position for s in sources)), sources)
            ok = held == want[0] if spec.is_reduce else (len(held) == 1 and held[0] in want[0])
            if not ok:
                slot_of = {base[r] + p: Slot(r, p) for r in range(t.world_size) for p in range(len(spec.inputs[r]))}
                got = " ".join(str(slot_of[i]) for i in held)
                raise _fail(f"r{rank}.out[{position}] should be {chunk} from {' '.join(map(str, sources))}, holds {got}")
    if spec.is_reduce:
        _check_agreement(plan, orders)


def _check_agreement(plan: HierPlan, orders: dict) -> None:
    """Every holder of a reduced chunk formed it in the same order, so replicated outputs agree
    bit for bit (the multisets above cannot tell (a + b) + c from a + (b + c))."""
    first: dict = {}
    for rank in range(plan.topology.world_size):
        for position, chunk in enumerate(plan.spec.outputs[rank]):
            number = orders[(OUT, rank, position)]
            seen = first.setdefault(chunk, (rank, position, number))
            if seen[2] != number:
                raise _fail(f"r{rank}.out[{position}] ({chunk}) is reduced in another order than r{seen[0]}.out[{seen[1]}]: "
                            "the same sources combined in another order, so the two may differ in their last bits")


def verify_plan(plan: HierPlan, *, schedules: bool = True) -> None:
    """Raise ``VerificationError`` unless ``plan`` computes ``plan.spec`` (see the module doc).
    ``schedules=False`` skips re-proving the intra-node schedules (``plan_hierarchical``
    proves each as it is made)."""
    _check_shapes(plan)
    if schedules:
        for schedule, shape in zip(plan.schedules, plan.canonical):
            verify(schedule, shape)
    _check_result(plan)
    _check_phase_texts(plan)


def _check_phase_texts(plan: HierPlan) -> None:
    """Every intra phase's .pln text, as the runtime loads it, within a collective's size (the
    text is refused there otherwise: a plan check passed while every load of it failed)."""
    from purlinc.snac.hiersource import has_work, phase_name, phase_source

    for index, phase in enumerate(plan.phases):
        if isinstance(phase, IntraPhase):
            for which in sorted(set(phase.schedules)):
                if has_work(plan.canonical[which]):
                    phase_source(plan.canonical[which], phase_name(plan.spec.name, index))


def simulate_plan(plan: HierPlan, inputs, count: int, dtype: DType | str, op: ReduceOp | str | None = None,
                  *, seed: int = 0, calls: int = 1) -> list[np.ndarray]:
    """Each rank's output of one call of ``plan`` on ``inputs`` (one storage array per rank)."""
    dtype = DType.parse(dtype.value if isinstance(dtype, DType) else dtype)
    reduce_op = ReduceOp.parse(op) if op is not None else None
    t = plan.topology
    if len(inputs) != t.world_size:
        raise ValueError(f"expected {t.world_size} input arrays (one per rank), got {len(inputs)}")
    buffers: dict[str, list[np.ndarray]] = {}
    for layout in plan.layouts:
        arrays = []
        for rank in range(t.world_size):
            array = np.empty(len(layout.units[rank]) * count, dtype=dtype.storage)
            array.view(np.uint8)[:] = POISON_OUT
            arrays.append(array)
        buffers[layout.name] = arrays
    for rank, array in enumerate(inputs):
        if array.shape != buffers[IN][rank].shape or array.dtype != dtype.storage:
            raise ValueError(f"input of rank {rank}: expected {buffers[IN][rank].shape} {dtype.storage}, got {array.shape} {array.dtype}")
        buffers[IN][rank] = array.copy()

    def unit(buffer: str, rank: int, u: int) -> np.ndarray:
        return buffers[buffer][rank][u * count:(u + 1) * count]

    for index, phase in enumerate(plan.phases):
        if isinstance(phase, IntraPhase):
            for node, which in enumerate(phase.schedules):
                ranks = t.node_ranks(node)
                if not any(len(buffers[phase.dst][r]) for r in ranks):
                    continue
                outputs = simulate(
                    plan.schedules[which], plan.canonical[which], [buffers[phase.src][r] for r in ranks],
                    count, dtype, reduce_op if phase.operation is Operation.REDUCE else None,
                    calls=calls, seed=seed + 7919 * index + node,
                )
                for rank, out in zip(ranks, outputs):
                    buffers[phase.dst][rank][:] = out
        else:
            results = []
            for move in phase.moves:
                parts = [unit(phase.src, s.rank, s.unit) for s in move.srcs]
                value = parts[0].copy() if phase.operation is Operation.COPY else reduce_chunks(parts, dtype, reduce_op)
                results.append((move.dst, value))
            for dst, value in results:  # NCCL ops are out of place: read everything, then write
                unit(phase.dst, dst.rank, dst.unit)[:] = value
    return [array.copy() for array in buffers[OUT]]
