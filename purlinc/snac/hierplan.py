"""Deriving a ``HierPlan`` from a resolved spec (any collective, never by its name).

Reductions (every output chunk is the reduction of every occurrence of its name):

1. intra-node reduce: on every node that holds a contribution to chunk ``c``, the node's
   contributions are reduced onto one *owner* local index ``o(c)`` (buffer ``partial``);
   owners spread over the local indices (or the consumers' local index when every consumer
   of ``c`` has the same one, so the last copy stays on the rank);
2. inter-node reduce among the ranks with local index ``o(c)``: the node partials, in node
   order, land on the owner of every node that needs ``c`` (buffer ``reduced``);
3. intra-node copy from the owner to every rank of the node that outputs ``c``.

For an all-reduce that is exactly intra reduce-scatter, inter all-reduce of the shards,
intra all-gather.

Copies: every node that needs chunk ``c`` takes it from a producer on the node if there is
one, else from the first producer ``p``, whose rank with the same local index on the
consumer node receives it (inter-node, one NCCL sub-group per local index; a node receives
each chunk once however many of its ranks need it).  Chunks served from the node itself are
copied locally into the same buffer (``mid``), and one intra-node copy delivers to the
consumers.  When no chunk crosses a node boundary the plan is one intra-node phase.

Every output chunk of the spec has this decomposition, so the plan always exists; what can
fail is the topology (``TopologyError``) or lowering a sub-spec under the options asked for
(``PurlinError``, naming the phase and node).
"""

from __future__ import annotations

from dataclasses import replace

from purlinc.errors import PurlinError
from purlinc.frontend.ast import Operation
from purlinc.frontend.spec import Chunk, Slot, Spec
from purlinc.snac.algorithms import DEFAULT_ALGORITHM
from purlinc.snac.hierarchy import IN, OUT, HierPlan, InterPhase, IntraPhase, Layout, Move, Topology, Unit
from purlinc.snac.ir import Algorithm, LowerOptions, Schedule
from purlinc.snac.lower import applicable_algorithms, check_packed, default_options, lower
from purlinc.snac.verify import verify


def canonical(spec: Spec, name: str) -> Spec:
    """``spec`` with its chunks renamed ``c[i]`` in order of appearance: nodes whose sub-specs
    differ only by names share one schedule (the lowering and the proof see only slots)."""
    if spec.operation is Operation.COPY:
        return _canonical_copy(spec, name)
    names: dict[Chunk, Chunk] = {}

    def rename(chunk: Chunk) -> Chunk:
        if chunk not in names:
            names[chunk] = Chunk("c", (len(names),))
        return names[chunk]

    inputs = tuple(tuple(rename(c) for c in layout) for layout in spec.inputs)
    outputs = tuple(tuple(rename(c) for c in layout) for layout in spec.outputs)
    return Spec(name, spec.world_size, (), spec.operation, spec.replicated, inputs, outputs, spec.sources)


def _canonical_copy(spec: Spec, name: str) -> Spec:
    """A copy phase's canonical spec names input *slots* ``c[i]`` in the order the outputs
    read them (then the unread ones), and every output after the one slot it is copied from.

    Slots, not chunk names: a phase of a ``copy replicated`` collective can hold one chunk on
    several ranks, and its .pln text (``hiersource``, a plain ``copy``) would then name two
    producers of ``c[0]``, which the checker refuses at load.  Reading order: every output
    layout is then a run ``c[a..b]`` (and the inputs strided runs), which keeps the text of a
    big phase short (hiersource writes runs as ranges)."""
    names: dict[Slot, Chunk] = {}
    read = [slots[0] for layout in spec.sources for slots in layout]
    unread = [Slot(rank, p) for rank, layout in enumerate(spec.inputs) for p in range(len(layout))]
    for slot in read + unread:
        names.setdefault(slot, Chunk("c", (len(names),)))
    inputs = tuple(tuple(names[Slot(rank, p)] for p in range(len(layout))) for rank, layout in enumerate(spec.inputs))
    outputs = tuple(tuple(names[slots[0]] for slots in layout) for layout in spec.sources)
    return Spec(name, spec.world_size, (), spec.operation, False, inputs, outputs, spec.sources)


def phase_algorithm(asked: Algorithm, shape: Spec) -> Algorithm:
    """The algorithm a node's phase runs: the one asked for where it applies to the phase's
    sub-spec, else direct-push (the planner lowers, and the runtime loads, by this one rule)."""
    return asked if asked in applicable_algorithms(shape) else DEFAULT_ALGORITHM


class _Builder:
    def __init__(self, spec: Spec, topology: Topology, options: LowerOptions | None, verify_schedules: bool):
        self.spec, self.t = spec, topology
        self.options = options
        self.verify = verify_schedules
        self.layouts: list[Layout] = [Layout(IN, spec.inputs), Layout(OUT, spec.outputs)]
        self.phases: list = []
        self.schedules: list[Schedule] = []
        self.canonical: list[Spec] = []
        self._by_shape: dict[Spec, int] = {}

    def layout(self, name: str, units: list[list[Chunk]]) -> str:
        self.layouts.append(Layout(name, tuple(tuple(u) for u in units)))
        return name

    def _options_for(self, spec: Spec) -> LowerOptions:
        if self.options is None:
            return default_options(spec)
        algorithm = phase_algorithm(self.options.algorithm, spec)
        if algorithm is self.options.algorithm:
            return self.options
        # e.g. two-shot asked for, but this phase is a copy: the node's phase runs direct-push
        # with every other option as asked (channels, slices, slots, registered buffers,
        # staging copies; documented in docs/HIERARCHY.md).  Packed stages are refused with the
        # algorithms that have none, as a flat lowering refuses them (they were dropped here).
        check_packed(self.options)
        return replace(self.options, algorithm=algorithm)

    def intra(self, src: str, dst: str, operation: Operation, node_specs: list[Spec], what: str) -> None:
        indices = []
        for node, spec in enumerate(node_specs):
            shape = canonical(spec, f"{self.spec.name}.{what}")
            index = self._by_shape.get(shape)
            if index is None:
                try:
                    schedule = lower(shape, self._options_for(shape))
                    if self.verify:
                        verify(schedule, shape)
                except PurlinError as error:
                    raise error.with_note(
                        f"while building the intra-node {what} phase of node {node} "
                        f"({self.t.format()})"
                    ) from None
                index = self._by_shape[shape] = len(self.schedules)
                self.schedules.append(schedule)
                self.canonical.append(shape)
            indices.append(index)
        self.phases.append(IntraPhase(src, dst, operation, tuple(node_specs), tuple(indices)))

    def inter(self, src: str, dst: str, operation: Operation, moves: list[Move]) -> None:
        self.phases.append(InterPhase(src, dst, operation, tuple(moves), _nccl_kind(self.t, operation, moves)))

    def node_spec(self, node: int, what: str, operation: Operation, src: Layout, dst: Layout,
                  sources: list[list[tuple[Slot, ...]]]) -> Spec:
        ranks = self.t.node_ranks(node)
        return Spec(
            f"{self.spec.name}.{what}.n{node}", self.t.gpus_per_node, (), operation, False,
            tuple(src.units[r] for r in ranks), tuple(dst.units[r] for r in ranks),
            tuple(tuple(s) for s in sources),
        )

    def plan(self) -> HierPlan:
        return HierPlan(self.spec, self.t, tuple(self.layouts), tuple(self.phases),
                        tuple(self.schedules), tuple(self.canonical))


def _nccl_kind(t: Topology, operation: Operation, moves: list[Move]) -> str:
    """Which NCCL collective the moves are, on every sub-group (descriptive)."""
    remote = [m for m in moves if any(s.rank != m.dst.rank for s in m.srcs)]
    if not remote:
        return "local"
    everyone = t.nodes
    if operation is Operation.REDUCE:
        dsts: dict[tuple[Unit, ...], set[int]] = {}
        for m in moves:
            dsts.setdefault(m.srcs, set()).add(m.dst.rank)
        if all(len(srcs) == everyone and len(d) == everyone for srcs, d in dsts.items()):
            return "all_reduce"
        if all(len(srcs) == everyone and len(d) == 1 for srcs, d in dsts.items()):
            per_rank: dict[int, int] = {}
            for m in moves:
                per_rank[m.dst.rank] = per_rank.get(m.dst.rank, 0) + 1
            if len(per_rank) == t.world_size and len(set(per_rank.values())) == 1:
                return "reduce_scatter"
        return "reduce"
    # Copies, per sub-group: which units are sent, how far each fans out, who sends and who
    # receives; and what stays on its rank (a collective's own part: the root keeps what it
    # broadcasts or scatters, a gatherer what it gathers, every rank what it all-gathers).
    # With two nodes a single transfer fits several names, which the local part tells apart.
    fan: dict[Unit, set[int]] = {}
    units: dict[int, set[Unit]] = {}
    senders: dict[int, set[int]] = {}
    receivers: dict[int, set[int]] = {}
    for m in remote:
        group = t.local_of(m.dst.rank)
        fan.setdefault(m.srcs[0], set()).add(m.dst.rank)
        units.setdefault(group, set()).add(m.srcs[0])
        senders.setdefault(group, set()).add(m.srcs[0].rank)
        receivers.setdefault(group, set()).add(m.dst.rank)
    local = [m for m in moves if all(s.rank == m.dst.rank for s in m.srcs)]
    kept, keeping = {m.srcs[0] for m in local}, {m.dst.rank for m in local}
    groups = list(units)  # the sub-groups that move anything (a rooted phase: the root's only)
    if all(len(units[g]) == 1 and all(len(fan[u]) == everyone - 1 and u in kept for u in units[g]) for g in groups):
        return "broadcast"
    if all(len(senders[g]) == everyone == len(units[g])
           and all(len(fan[u]) == everyone - 1 and u in kept for u in units[g]) for g in groups):
        return "all_gather"
    if all(len(receivers[g]) == 1 and receivers[g] <= keeping for g in groups):
        return "gather"
    if all(len(senders[g]) == 1 and senders[g] <= keeping for g in groups):
        return "scatter"
    return "send_recv"


def _reduce_plan(b: _Builder) -> None:
    spec, t = b.spec, b.t
    G = t.gpus_per_node
    # Distinct output chunks (first appearance), their contributions and consumers.
    slots: dict[Chunk, tuple[Slot, ...]] = {}
    consumers: dict[Chunk, list[int]] = {}
    for rank in range(t.world_size):
        for position, chunk in enumerate(spec.outputs[rank]):
            slots.setdefault(chunk, spec.sources[rank][position])
            consumers.setdefault(chunk, []).append(rank)
    owner: dict[Chunk, int] = {}
    spread = 0
    for chunk in slots:
        locals_ = {t.local_of(r) for r in consumers[chunk]}
        if len(locals_) == 1:
            owner[chunk] = locals_.pop()
        else:
            owner[chunk] = spread % G
            spread += 1
    contributors = {c: sorted({t.node_of(s.rank) for s in slots[c]}) for c in slots}
    needers = {c: sorted({t.node_of(r) for r in consumers[c]}) for c in slots}

    # 1. intra-node reduce onto the owners: buffer ``partial``.
    partial: list[list[Chunk]] = [[] for _ in range(t.world_size)]
    for chunk in slots:
        for node in contributors[chunk]:
            partial[t.rank(node, owner[chunk])].append(chunk)
    b.layout("partial", partial)
    specs = []
    for node in range(t.nodes):
        sources = []
        for rank in t.node_ranks(node):
            sources.append([
                tuple(Slot(t.local_of(s.rank), s.position) for s in slots[c] if t.node_of(s.rank) == node)
                for c in partial[rank]
            ])
        specs.append(b.node_spec(node, "reduce", Operation.REDUCE, b.layouts[0], b.layouts[-1], sources))
    b.intra(IN, "partial", Operation.REDUCE, specs, "reduce")

    # 2. inter-node reduce among the owners, delivered to the nodes that need the chunk.
    where = {(rank, c): u for rank in range(t.world_size) for u, c in enumerate(partial[rank])}
    reduced: list[list[Chunk]] = [[] for _ in range(t.world_size)]
    moves = []
    for chunk in slots:
        srcs = tuple(Unit(t.rank(n, owner[chunk]), where[(t.rank(n, owner[chunk]), chunk)]) for n in contributors[chunk])
        for node in needers[chunk]:
            rank = t.rank(node, owner[chunk])
            moves.append(Move(Unit(rank, len(reduced[rank])), srcs, chunk))
            reduced[rank].append(chunk)
    b.layout("reduced", reduced)
    b.inter("partial", "reduced", Operation.REDUCE, moves)

    # 3. intra-node copy from the owner to every consumer on the node.
    held = {(rank, c): u for rank in range(t.world_size) for u, c in enumerate(reduced[rank])}
    specs = []
    for node in range(t.nodes):
        sources = []
        for rank in t.node_ranks(node):
            sources.append([
                (Slot(owner[c], held[(t.rank(node, owner[c]), c)]),) for c in spec.outputs[rank]
            ])
        specs.append(b.node_spec(node, "gather", Operation.COPY, b.layouts[-1], b.layouts[1], sources))
    b.intra("reduced", OUT, Operation.COPY, specs, "gather")


def _copy_plan(b: _Builder) -> None:
    spec, t = b.spec, b.t
    # Per (chunk, consumer node): the producer slot it is served from, and the rank of that
    # node that holds it for the final intra copy (the producer, or its peer by local index).
    mid: list[list[Chunk]] = [[] for _ in range(t.world_size)]
    moves: list[Move] = []
    held: dict[tuple[Chunk, int], Slot] = {}  # (chunk, node) -> local slot in ``mid``
    for rank in range(t.world_size):
        node = t.node_of(rank)
        for position, chunk in enumerate(spec.outputs[rank]):
            if (chunk, node) in held:
                continue
            producers = spec.sources[rank][position]
            local = [s for s in producers if t.node_of(s.rank) == node]
            source = local[0] if local else producers[0]
            holder = t.rank(node, t.local_of(source.rank))
            held[(chunk, node)] = Slot(t.local_of(holder), len(mid[holder]))
            moves.append(Move(Unit(holder, len(mid[holder])), (Unit(source.rank, source.position),), chunk))
            mid[holder].append(chunk)

    if all(m.srcs[0].rank == m.dst.rank for m in moves):
        # Nothing crosses a node boundary: one intra-node phase per node, IN -> OUT.
        specs = []
        for node in range(t.nodes):
            sources = [
                [(Slot(t.local_of(p[0].rank), p[0].position),) for p in
                 ([s for s in slots if t.node_of(s.rank) == node] for slots in spec.sources[rank])]
                for rank in t.node_ranks(node)
            ]
            specs.append(b.node_spec(node, "copy", Operation.COPY, b.layouts[0], b.layouts[1], sources))
        b.intra(IN, OUT, Operation.COPY, specs, "copy")
        return

    b.layout("mid", mid)
    b.inter(IN, "mid", Operation.COPY, moves)
    specs = []
    for node in range(t.nodes):
        sources = [[(held[(c, node)],) for c in spec.outputs[rank]] for rank in t.node_ranks(node)]
        specs.append(b.node_spec(node, "scatter", Operation.COPY, b.layouts[-1], b.layouts[1], sources))
    b.intra("mid", OUT, Operation.COPY, specs, "scatter")


# Chunk reads (every output chunk's sources over every rank) a plan may cover: planning and its
# check walk them per node, so their cost grows faster than the reads (all-reduce, R^3 reads:
# R=128 3 s, R=256 8 s, R=512 150 s and 7.7 GB).  2^24 admits all-reduce to R=256.
MAX_PLAN_READS = 1 << 24


def _check_plannable(spec: Spec) -> None:
    """What the phases cannot express yet: an epilogue (no phase applies it, so the plan would
    drop it) and run-time sizes (the NCCL phases move fixed-size chunks); and a plan too large
    to make in reasonable time."""
    if spec.reads > MAX_PLAN_READS:
        raise PurlinError(f"{spec.name} for R={spec.world_size} reads {spec.reads:,} chunks across its ranks' outputs, "
                          f"more than a hierarchical plan covers ({MAX_PLAN_READS:,})",
                          notes=("plan it for fewer ranks",))
    if spec.epilogue is not None:
        raise PurlinError(f"{spec.name}: a hierarchical plan (gpus_per_node) cannot apply an epilogue yet",
                          spec.epilogue.span, ("run it on one node's communicator (a flat collective) instead",))
    if spec.sizes is not None:
        raise PurlinError(f"{spec.name}: a hierarchical plan (gpus_per_node) cannot move chunks of run-time "
                          f"sizes ({spec.sizes.format()}) yet", spec.sizes.span,
                          notes=("run it on one node's communicator (a flat collective) instead",))


def plan_hierarchical(spec: Spec, gpus_per_node: int, options: LowerOptions | None = None,
                      *, verify_schedules: bool = True) -> HierPlan:
    """The hierarchical plan of ``spec`` over nodes of ``gpus_per_node`` ranks.

    ``options`` shape the intra-node schedules (default: ``lower.default_options``); an
    algorithm that does not apply to a phase (two-shot for a copy phase) falls back to
    direct-push for that phase.  With ``verify_schedules`` every distinct intra-node schedule
    is proved by the SNAC verifier as it is made (``verify_plan`` checks the composition)."""
    _check_plannable(spec)
    topology = Topology.of(spec.world_size, gpus_per_node)
    builder = _Builder(spec, topology, options, verify_schedules)
    (_reduce_plan if spec.is_reduce else _copy_plan)(builder)
    return builder.plan()
