"""Ring lowering: every chunk hops rank to rank through staging slots, pipelined by slice."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from operator import attrgetter

from purlinc.errors import PurlinError
from purlinc.frontend.ast import Operation
from purlinc.frontend.spec import Chunk, Spec
from purlinc.snac.ir import Consume, LowerOptions, Schedule, Stage
from purlinc.snac.kit import (
    IN, OUT, STAGE, ack_signal, Builder, chunk_names, chunk_text, consume_into, copy_source, data_signal, Need,
    needs_of, Ref, region, round_robin_owners, TNotify, TWait,
)


# --------------------------------------------------------------------------------------
# Ring


@dataclass(slots=True)  # slots: 10^5 hops at R=64, built and read in the lowering's inner loops
class _Hop:
    """One chunk (all slices) moved from ``sender`` to the next rank, at ring step ``step``."""

    id: int
    step: int
    sender: int
    receiver: int
    chunk: Chunk
    srcs: tuple  # on the sender: (space, unit) or ("hop", id) for the unit where that hop landed
    to_out: int | None  # receiver's OUT position when it lands there (registered OUT), else STAGE
    receipt: tuple = ()  # on the receiver after it lands: ((srcs, position), ...) consumes into OUT
    read_later: bool = False  # the unit it lands in is read again by the receiver's next hop
    unit: int = -1


@dataclass(frozen=True, slots=True)
class _Route:
    """How the ring carries one output chunk: a reduction's contributions are summed hop by hop
    from ``start`` to ``final`` (its owner); then the chunk travels on from ``final`` until every
    rank in ``consumers`` has it.  A copy starts at its producer: ``start == final``."""

    need: Need
    start: int
    final: int
    consumers: frozenset[int]

    def partial_hops(self, R: int) -> int:
        return (self.final - self.start) % R

    def travel_hops(self, R: int) -> int:
        """The travel's length: each consumer lies 1..length ranks on from ``final``."""
        return max(((c - self.final) % R for c in self.consumers), default=0)


def _routes(spec: Spec) -> list[_Route]:
    """Every output chunk's route, the one rule that both ``_ring_hops`` (which builds the
    hops) and ``_least_steps`` (which counts them before any is built) follow."""
    R = spec.world_size
    needs = needs_of(spec)
    routes = []
    if spec.is_reduce:
        owners = round_robin_owners(needs)
        for need in needs:
            final = owners[need.chunk]
            contributors = {slot.rank for slot in need.sources}
            start = next(q for q in ((final + 1 + i) % R for i in range(R)) if q in contributors)
            routes.append(_Route(need, start, final, frozenset(need.ranks) - {final}))
        return routes
    for need in needs:
        start = need.sources[0].rank
        remote = frozenset(rank for rank, _ in need.positions if copy_source(need, rank).rank != rank)
        routes.append(_Route(need, start, start, remote))
    return routes


def _ring_hops(spec: Spec, options: LowerOptions):
    """Every hop of every chunk, plus the purely local consumes (rank, srcs, position)."""
    R = spec.world_size
    registered_out = "out" in options.registered
    hops: list[_Hop] = []
    local: list[tuple[int, Need, tuple, tuple[int, ...]]] = []

    def travel(route: _Route, first_step: int, where) -> None:
        """Carry ``where`` (on ``route.final``) forward until every consumer has it."""
        need, start, consumers = route.need, route.final, route.consumers
        for t in range(route.travel_hops(R)):
            sender, receiver = (start + t) % R, (start + t + 1) % R
            positions = need.at(receiver) if receiver in consumers else ()
            hop = _Hop(len(hops), first_step + t, sender, receiver, need.chunk, (where,),
                       positions[0] if positions and registered_out else None)
            hops.append(hop)
            _mark_read(hops, where)
            if positions:
                landed = (OUT, positions[0]) if hop.to_out is not None else ("hop", hop.id)
                receipt = [] if hop.to_out is not None else [((landed,), positions[0])]
                receipt += [(((OUT, positions[0]),), p) for p in positions[1:]]
                hop.receipt = tuple(receipt)
                where = (OUT, positions[0])
            else:
                where = ("hop", hop.id)

    for route in _routes(spec):
        need = route.need
        if not spec.is_reduce:
            for rank, positions in need.positions:
                if rank not in route.consumers:
                    local.append((rank, need, ((IN, copy_source(need, rank).position),), positions))
            travel(route, 0, (IN, need.sources[0].position))
            continue
        final = route.final
        contrib: dict[int, list] = defaultdict(list)
        for slot in need.sources:
            contrib[slot.rank].append((IN, slot.position))
        first = need.at(final)[0]
        steps = route.partial_hops(R)
        if steps == 0:
            local.append((final, need, tuple(contrib[final]), need.at(final)))
        else:
            carried = None
            for t in range(steps):
                sender, receiver = (route.start + t) % R, (route.start + t + 1) % R
                srcs = ((carried,) if carried else ()) + tuple(contrib[sender])
                hop = _Hop(len(hops), t, sender, receiver, need.chunk, srcs, None)
                hops.append(hop)
                if carried:
                    _mark_read(hops, carried)
                carried = ("hop", hop.id)
            positions = need.at(final)
            receipt = [((carried, *contrib[final]), first)]
            receipt += [(((OUT, first),), p) for p in positions[1:]]
            hops[-1].receipt = tuple(receipt)
        travel(route, steps, (OUT, first))
    return hops, local


def _least_steps(spec: Spec, options: LowerOptions) -> int:
    """The fewest steps the ring's programs can hold, from its routes (``_routes``, which
    ``_ring_hops`` follows), counted without building a hop: each hop writes a Stage (or
    partial reduce) per slice, and one landing in STAGE also waits for its unit and
    acknowledges it (every consumer's hop lands in its OUT where OUT is registered).  So a
    ring whose proof is bound to be too large is refused at once, not after its hops took the
    time and memory (alltoall at R=128: 1.04 million hops, 14 s and 1.4 GB before the partial
    budget check stopped the emission)."""
    R, S = spec.world_size, options.slices
    registered_out = "out" in options.registered
    hops = into_out = 0
    for route in _routes(spec):
        hops += route.partial_hops(R) + route.travel_hops(R)
        into_out += len(route.consumers) if registered_out else 0
    return hops * S + 2 * (hops - into_out)


def _mark_read(hops: list[_Hop], where) -> None:
    if where[0] == "hop":
        hops[where[1]].read_later = True


def _last_read(hop: _Hop, S: int) -> int:
    """The wavefront at which the receiver last reads the unit ``hop`` landed in."""
    return hop.step + S - 1 + (1 if hop.read_later else 0)


def _assign_slots(spec: Spec, options: LowerOptions, hops: list[_Hop]) -> dict[tuple[int, int], list[_Hop]]:
    """Staging units per edge: message j uses unit j (no slots) or j % slots; check that
    reusing a unit within a call can never deadlock (its last read is an earlier wavefront)."""
    S = options.slices
    edges: dict[tuple[int, int], list[_Hop]] = defaultdict(list)
    for hop in sorted(hops, key=attrgetter("step")):  # stable: by (step, id), hops being in id order
        if hop.to_out is None:
            edges[hop.sender, hop.receiver].append(hop)

    def safe(n: int) -> bool:
        return all(_last_read(msgs[j - n], S) < msgs[j].step for msgs in edges.values() for j in range(n, len(msgs)))

    if options.slots is not None and not safe(options.slots):
        most = max((len(m) for m in edges.values()), default=1)
        needed = next(n for n in range(1, most + 1) if safe(n))
        raise PurlinError(
            f"ring with {options.slots} staging slot(s) per edge could deadlock for {spec.name} at "
            f"R={spec.world_size} with {S} slice(s): a unit is reused before its reader can have freed it "
            f"without waiting on the writer; use {needed} slots or more (slots={needed}, or --slots {needed} on the "
            f"command line), or leave slots unset"
        )
    for msgs in edges.values():
        for j, hop in enumerate(msgs):
            hop.unit = j if options.slots is None else j % options.slots
    return edges


def ring(spec: Spec, options: LowerOptions) -> Schedule:
    """Every chunk hops rank to rank through staging, pipelined by slice.  Steps: list the
    hops, allocate the staging units per edge (slots), derive each hop's slot wait, then emit
    the programs wavefront by wavefront."""
    from purlinc.snac.verify import check_proof_steps

    check_proof_steps(spec.name, spec.world_size, _least_steps(spec, options), spec.world_size, partial=True)
    b = Builder(spec, options)
    hops, local = _ring_hops(spec, options)
    edges = _assign_slots(spec, options, hops)
    for msgs in edges.values():
        receiver = msgs[0].receiver
        b.units[receiver] = max(b.units[receiver], max(h.unit for h in msgs) + 1)
    emit = _RingEmit(b, hops, _slot_waits(edges, options.slots, len(hops)))
    emit.prologue(local)
    steps = max((h.step for h in hops), default=-1) + 1
    at_step: dict[int, list[_Hop]] = defaultdict(list)
    for hop in hops:
        at_step[hop.step].append(hop)
    for w in range(steps + b.slices - 1):
        emit.wavefront(w, at_step)
        if w % _BUDGET_EVERY == _BUDGET_EVERY - 1:
            _check_budget(spec, b)
    return b.build()


# Wavefronts between two counts of the steps emitted so far (a count walks the ranks' lists)
_BUDGET_EVERY = 64


def _check_budget(spec: Spec, b: Builder) -> None:
    """Stop a ring whose proof is already too large (the verifier would refuse it, after its
    millions of steps took gigabytes: alltoall_blocks at R=128 built 6.3 million, 3.4 GB)."""
    from purlinc.snac.verify import check_proof_steps

    check_proof_steps(spec.name, spec.world_size, sum(len(steps) for steps in b.steps), spec.world_size,
                      partial=True)


def _slot_waits(edges: dict, slots: int | None, count: int) -> list:
    """Hop id -> (wait ref, note) of its slot wait: the unit freed by the message that used it
    before (this call), or by its last user of the previous call."""
    slot_ref: list = [None] * count
    for msgs in edges.values():
        n = len(msgs)
        for j, hop in enumerate(msgs):
            if slots is not None and j >= slots:
                slot_ref[hop.id] = (Ref(msgs[j - slots].id, False), f"r{hop.receiver}.stage[{hop.unit}] free again")
                continue
            last = j if slots is None else j + (n - 1 - j) // slots * slots  # the last message on this unit
            slot_ref[hop.id] = (Ref(msgs[last].id, True), f"r{hop.receiver}.stage[{hop.unit}] free (read last call)")
    return slot_ref


class _RingEmit:
    """Writes the ring's programs into the builder.  Keys of its notifies: a hop's ack under
    its id (an int: hashed in C), the data notify of a sender at wavefront w under
    -1 - (w * R + sender); "ready" as tuples."""

    def __init__(self, b: Builder, hops: list[_Hop], slot_ref: list):
        self.b, self.hops, self.slot_ref = b, hops, slot_ref  # hop ids are their positions in ``hops``
        self.ack_sig: dict = {}  # (sender, receiver) -> its ACK signal (one tuple per edge, not per hop)
        self.ready_waited: set[tuple[int, int]] = set()
        self.lines: dict = {}  # (rank, OUT position) -> its .pln line
        # Per hop, once: its sources and destination as (space, rank, unit).
        self.where_of = [tuple((STAGE, h.sender, hops[w[1]].unit) if w[0] == "hop" else (w[0], h.sender, w[1])
                               for w in h.srcs) for h in hops]
        self.dst_of = [(OUT, h.receiver, h.to_out) if h.to_out is not None else (STAGE, h.receiver, h.unit)
                       for h in hops]

    def prologue(self, local) -> None:
        """A receiver whose OUT peers write into says so first; then the purely local consumes."""
        b = self.b
        for sender, receiver in sorted({(h.sender, h.receiver) for h in self.hops if h.to_out is not None}):
            b.notify(receiver, ack_signal(sender, receiver), f"r{receiver}.out ready for r{sender}",
                     keys=(("ready", sender, receiver),))
        for rank, need, srcs, positions in local:
            for s in range(b.slices):
                consume_into(b, rank, need, positions, srcs, s)

    def ack(self, hop: _Hop) -> None:
        """b.notify, inlined: one per hop landing in STAGE."""
        b = self.b
        sig = self.ack_sig.get((hop.sender, hop.receiver))
        if sig is None:
            sig = self.ack_sig[hop.sender, hop.receiver] = ack_signal(hop.sender, hop.receiver)
        k = b.counts[sig] = b.counts[sig] + 1
        b.steps[hop.receiver].append(
            TNotify(sig, k, f"done with {chunk_text(hop.chunk)} (r{hop.receiver}.stage[{hop.unit}])"))
        b.recorded[hop.id] = (sig, k)

    def wavefront(self, w: int, at_step: dict) -> None:
        """The hops in flight at wavefront w (slice w - step of each), in hop order: each sender
        sends and notifies, then each receiver waits and consumes."""
        S = self.b.slices
        if S == 1:
            batch = [(h, 0) for h in at_step.get(w, ())]  # at_step lists are in hop order already
        else:
            batch = sorted(((h, w - t) for t in range(max(0, w - S + 1), w + 1) for h in at_step.get(t, ())),
                           key=lambda hs: hs[0].id)
        sending: dict[int, list] = defaultdict(list)
        for hs in batch:
            sending[hs[0].sender].append(hs)
        # Every hop goes to the sender's next rank: what rank q receives at w is exactly what
        # rank q - 1 sends, in the same order, so one note serves the notify and the wait.
        names: dict[int, tuple] = {}  # receiver -> (sender, chunk names, what it got)
        for rank in sorted(sending):
            sent = sending[rank]
            receiver = sent[0][0].receiver
            text = self.send(rank, sent, w)
            names[receiver] = (rank, text, sent)
        for rank in sorted(names):
            self.receive(rank, *names[rank], w)

    def send(self, rank: int, sent: list, w: int) -> str:
        """Rank's stages (or partial reductions) of wavefront w, then its data notify."""
        b, S = self.b, self.b.slices
        append = b.steps[rank].append
        for hop, s in sent:
            if hop.to_out is None:
                if s == 0:
                    ref, note = self.slot_ref[hop.id]
                    append(TWait(ref, note))
            elif (rank, hop.receiver) not in self.ready_waited:
                self.ready_waited.add((rank, hop.receiver))
                b.wait(rank, ("ready", rank, hop.receiver), f"r{hop.receiver}.out ready")
            dst = self.dst_of[hop.id]
            dst = region(dst[0], dst[1], dst[2], s)
            wheres = self.where_of[hop.id]
            if len(wheres) == 1:
                src = wheres[0]
                append(Stage(region(src[0], src[1], src[2], s), dst, f"{chunk_text(hop.chunk)} for r{hop.receiver}"))
            else:
                srcs = tuple([region(space, r, unit, s) for space, r, unit in wheres])
                append(Consume(Operation.REDUCE, srcs, dst, f"partial {chunk_text(hop.chunk)} for r{hop.receiver}"))
            if s == S - 1:
                for where in hop.srcs:
                    if where[0] == "hop":
                        self.ack(self.hops[where[1]])
        receiver = sent[0][0].receiver
        text = chunk_names([h.chunk for h, _ in sent])
        b.notify(rank, data_signal(rank, receiver), f"{text} for r{receiver}", keys=(-1 - (w * b.world + rank),))
        return text

    def receive(self, rank: int, sender: int, text: str, got: list, w: int) -> None:
        """b.wait_all of the data keys of every hop received (they all name one notify), then
        the consumes into OUT, and the ACK of each unit no later hop reads."""
        b, S, hops, lines = self.b, self.b.slices, self.hops, self.lines
        steps = b.steps[rank]
        steps.append(TWait(Ref(-1 - (w * b.world + sender), False), f"({text} from r{sender})"))
        for hop, s in got:
            for srcs, position in hop.receipt:
                regions = tuple([region(STAGE, rank, hops[where[1]].unit, s) if where[0] == "hop"
                                 else region(where[0], rank, where[1], s) for where in srcs])
                line = lines.get((rank, position), lines)
                if line is lines:
                    line = lines[rank, position] = b.spec.output_line(rank, position)
                operation = Operation.REDUCE if len(regions) > 1 else Operation.COPY
                steps.append(Consume(operation, regions, region(OUT, rank, position, s), chunk_text(hop.chunk), line))
            if s == S - 1 and hop.to_out is None and not hop.read_later:
                self.ack(hop)
