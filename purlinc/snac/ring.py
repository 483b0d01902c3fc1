"""Ring lowering: every chunk hops rank to rank through staging slots, pipelined by slice."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from purlinc.errors import PurlinError
from purlinc.frontend.ast import Operation
from purlinc.frontend.spec import Chunk, Spec
from purlinc.snac.builder import IN, OUT, STAGE, _ack, _Builder, _consume_into, _data, _from, _names, _reg, _text
from purlinc.snac.ir import Consume, LowerOptions, Region, Schedule
from purlinc.snac.needs import _copy_source, _Need, _needs, _owners


# --------------------------------------------------------------------------------------
# Ring


@dataclass
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


def _ring_hops(spec: Spec, options: LowerOptions):
    """Every hop of every chunk, plus the purely local consumes (rank, srcs, position)."""
    R = spec.world_size
    registered_out = "out" in options.registered
    hops: list[_Hop] = []
    local: list[tuple[int, _Need, tuple, tuple[int, ...]]] = []
    needs = _needs(spec)
    owners = _owners(needs)

    def travel(need: _Need, start: int, first_step: int, where, consumers: set[int]) -> None:
        """Carry ``where`` (on ``start``) forward until every rank in ``consumers`` has it."""
        if not consumers:
            return
        length = max((c - start) % R for c in consumers)
        for t in range(length):
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

    for need in needs:
        if not spec.is_reduce:
            remote = set()
            for rank, positions in need.positions:
                slot = _copy_source(need, rank)
                if slot.rank == rank:
                    local.append((rank, need, ((IN, slot.position),), positions))
                else:
                    remote.add(rank)
            if remote:
                slot = need.sources[0]
                travel(need, slot.rank, 0, (IN, slot.position), remote)
            continue
        final = owners[need.chunk]
        contrib: dict[int, list] = defaultdict(list)
        for slot in need.sources:
            contrib[slot.rank].append((IN, slot.position))
        order = [(final + 1 + i) % R for i in range(R)]  # ends with final
        start = next(q for q in order if contrib[q])
        first = need.at(final)[0]
        if start == final:
            local.append((final, need, tuple(contrib[final]), need.at(final)))
            steps = 0
        else:
            steps = (final - start) % R
            carried = None
            for t in range(steps):
                sender, receiver = (start + t) % R, (start + t + 1) % R
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
        travel(need, final, steps, (OUT, first), set(need.ranks) - {final})
    return hops, local


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
    for hop in sorted(hops, key=lambda h: (h.step, h.id)):
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
            f"without waiting on the writer; use --slots {needed} or more (or leave slots unset)"
        )
    for msgs in edges.values():
        for j, hop in enumerate(msgs):
            hop.unit = j if options.slots is None else j % options.slots
    return edges


def _ring(spec: Spec, options: LowerOptions) -> Schedule:
    b = _Builder(spec, options)
    S, R = b.slices, b.world
    hops, local = _ring_hops(spec, options)
    edges = _assign_slots(spec, options, hops)
    for msgs in edges.values():
        receiver = msgs[0].receiver
        b.units[receiver] = max(b.units[receiver], max(h.unit for h in msgs) + 1)
    position_in_edge = {h.id: j for msgs in edges.values() for j, h in enumerate(msgs)}
    by_id = {h.id: h for h in hops}

    def region(rank: int, where, s: int) -> Region:
        if where[0] == "hop":
            return _reg(STAGE, rank, by_id[where[1]].unit, s)
        return _reg(where[0], rank, where[1], s)

    def dst_of(hop: _Hop, s: int) -> Region:
        if hop.to_out is not None:
            return _reg(OUT, hop.receiver, hop.to_out, s)
        return _reg(STAGE, hop.receiver, hop.unit, s)

    def ack(hop: _Hop) -> None:
        b.notify(hop.receiver, _ack(hop.sender, hop.receiver), f"done with {_text(hop.chunk)} (r{hop.receiver}.stage[{hop.unit}])",
                 keys=(("ack", hop.id),))

    def slot_wait(hop: _Hop) -> None:
        msgs = edges[hop.sender, hop.receiver]
        j, n = position_in_edge[hop.id], options.slots
        if n is not None and j >= n:
            b.wait(hop.sender, ("ack", msgs[j - n].id), f"r{hop.receiver}.stage[{hop.unit}] free again")
            return
        last = j if n is None else j + (len(msgs) - 1 - j) // n * n  # the last message on this unit
        b.wait(hop.sender, ("ack", msgs[last].id), f"r{hop.receiver}.stage[{hop.unit}] free (read last call)", previous=True)

    # A receiver whose OUT peers write into says so first.
    out_edges = sorted({(h.sender, h.receiver) for h in hops if h.to_out is not None})
    for sender, receiver in out_edges:
        b.notify(receiver, _ack(sender, receiver), f"r{receiver}.out ready for r{sender}", keys=(("ready", sender, receiver),))
    ready_waited: set[tuple[int, int]] = set()
    for rank, need, srcs, positions in local:
        for s in range(S):
            _consume_into(b, rank, need, positions, srcs, s)

    steps = max((h.step for h in hops), default=-1) + 1
    at_step: dict[int, list[_Hop]] = defaultdict(list)
    for hop in hops:
        at_step[hop.step].append(hop)
    for w in range(steps + S - 1):
        # The hops in flight at wavefront w (slice w - step of each), in hop order.
        batch = sorted(((h, w - t) for t in range(max(0, w - S + 1), w + 1) for h in at_step.get(t, ())),
                       key=lambda hs: hs[0].id)
        sending: dict[int, list] = defaultdict(list)
        receiving: dict[int, list] = defaultdict(list)
        for h, s in batch:
            sending[h.sender].append((h, s))
            receiving[h.receiver].append((h, s))
        for rank in sorted(sending):
            sent = sending[rank]
            for hop, s in sent:
                if s == 0 and hop.to_out is None:
                    slot_wait(hop)
                if hop.to_out is not None and (rank, hop.receiver) not in ready_waited:
                    ready_waited.add((rank, hop.receiver))
                    b.wait(rank, ("ready", rank, hop.receiver), f"r{hop.receiver}.out ready")
                srcs = tuple(region(rank, where, s) for where in hop.srcs)
                dst = dst_of(hop, s)
                if len(srcs) == 1:
                    b.stage(rank, srcs[0], dst, f"{_text(hop.chunk)} for r{hop.receiver}")
                else:
                    b.steps[rank].append(Consume(Operation.REDUCE, srcs, dst, f"partial {_text(hop.chunk)} for r{hop.receiver}"))
                if s == S - 1:
                    for where in hop.srcs:
                        if where[0] == "hop":
                            ack(by_id[where[1]])
            receiver = sent[0][0].receiver
            b.notify(rank, _data(rank, receiver), f"{_names(h.chunk for h, _ in sent)} for r{receiver}",
                     keys=tuple(("data", h.id, s) for h, s in sent))
        for rank in sorted(receiving):
            got = receiving[rank]
            b.wait_all(rank, [("data", h.id, s) for h, s in got], lambda sig: f"({_names(h.chunk for h, _ in got)} {_from(sig)})")
            for hop, s in got:
                for srcs, position in hop.receipt:
                    regions = tuple(region(rank, where, s) for where in srcs)
                    b.consume(rank, regions, _reg(OUT, rank, position, s), hop.chunk, position)
                if s == S - 1 and hop.to_out is None and not hop.read_later:
                    ack(hop)
    return b.build()
