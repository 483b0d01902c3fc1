"""Two-shot lowering for reductions: reduce-scatter to each chunk's owner, then all-gather from it."""

from __future__ import annotations

from collections import defaultdict

from purlinc.errors import PurlinError
from purlinc.frontend.spec import Chunk, Spec
from purlinc.snac.ir import LowerOptions, Schedule
from purlinc.snac.kit import (
    IN, OUT, STAGE, ack_signal, Builder, chunk_names, chunk_text, consume_into, data_signal, from_peer, Msg,
    needs_of, region, round_robin_owners,
)


def _two_shot(spec: Spec, options: LowerOptions) -> Schedule:
    needs = needs_of(spec)
    if not spec.is_reduce:
        raise PurlinError(f"two-shot applies to reductions only; {spec.name} is a copy collective (use direct-push, direct-pull or ring)")
    if not any(len(need.ranks) > 1 for need in needs):
        raise PurlinError(
            f"two-shot needs an output chunk that several ranks receive (as in allreduce); in {spec.name} "
            f"for R={spec.world_size} every chunk goes to one rank, so two-shot would be exactly direct-push: use that"
        )
    b = Builder(spec, options)
    S, R = b.slices, b.world
    registered_out = "out" in options.registered
    owners = round_robin_owners(needs)
    phase1: list[Msg] = []  # contributions -> owner's STAGE
    phase2: list[Msg] = []  # owner's OUT -> other ranks
    reduce_at: dict[Chunk, tuple] = {}  # chunk -> srcs on the owner
    copies: list[list] = [[] for _ in range(R)]  # (need, positions, unit or None)
    for need in needs:
        owner = owners[need.chunk]
        srcs = []
        for slot in need.sources:
            if slot.rank == owner:
                srcs.append((IN, slot.position))
            else:
                unit = b.unit(owner)
                phase1.append(Msg(need.chunk, slot.rank, owner, (IN, slot.position), (STAGE, unit)))
                srcs.append((STAGE, unit))
        reduce_at[need.chunk] = tuple(srcs)
        first = need.at(owner)[0]
        for consumer, positions in need.positions:
            if consumer == owner:
                continue
            if registered_out:
                phase2.append(Msg(need.chunk, owner, consumer, (OUT, first), (OUT, positions[0])))
                copies[consumer].append((need, positions, None))
            else:
                unit = b.unit(consumer)
                phase2.append(Msg(need.chunk, owner, consumer, (OUT, first), (STAGE, unit)))
                copies[consumer].append((need, positions, unit))

    def edges_of(msgs):
        return sorted({(m.producer, m.consumer) for m in msgs}, key=lambda e: (e[1], e[0]))

    e1, e2 = edges_of(phase1), edges_of(phase2)
    # Indexed once, so that every loop below is linear in the schedule it writes.
    def by_producer(edges):
        out = [[] for _ in range(R)]
        for producer, consumer in edges:
            out[producer].append(consumer)
        return out

    def by_consumer(edges):
        out = [[] for _ in range(R)]
        for producer, consumer in sorted(edges):
            out[consumer].append(producer)
        return out

    def chunks_by_edge(msgs):
        out = defaultdict(list)
        for m in msgs:
            out[m.producer, m.consumer].append(m.chunk)
        return out

    def sent_by(msgs):
        out = [[] for _ in range(R)]
        for m in msgs:
            out[m.producer].append(m)
        return out

    to1, to2 = by_producer(e1), by_producer(e2)
    from1, from2, from_stage2 = by_consumer(e1), by_consumer(e2), by_consumer(e2 if not registered_out else [])
    chunks1, chunks2 = chunks_by_edge(phase1), chunks_by_edge(phase2)
    if registered_out:
        for producer, consumer in e2:
            b.notify(consumer, ack_signal(producer, consumer), f"r{consumer}.out ready for r{producer}", keys=(("ready", producer, consumer),))
    for rank in range(R):
        for consumer in to1[rank]:
            b.wait(rank, ("ack1", rank, consumer), f"r{consumer} done with last call's contributions", previous=True)
        for consumer in to2[rank]:
            if registered_out:
                b.wait(rank, ("ready", rank, consumer), f"r{consumer}.out ready")
            else:
                b.wait(rank, ("ack2", rank, consumer), f"r{consumer} done with last call's results", previous=True)

    def push(msgs, targets, chunks, phase):
        what = "contribution to" if phase == 1 else "result for"
        for producer, mine in enumerate(sent_by(msgs)):
            notes = {c: f"{chunk_names(chunks[producer, c])} for r{c}" for c in targets[producer]}
            for s in range(S):
                for m in mine:
                    b.stage(producer, region(m.src[0], producer, m.src[1], s), region(m.dst[0], m.consumer, m.dst[1], s),
                            f"{chunk_text(m.chunk)} {what} r{m.consumer}")
                for consumer in targets[producer]:
                    b.notify(producer, data_signal(producer, consumer), notes[consumer], keys=((f"data{phase}", producer, consumer, s),))

    def waits(rank, sources, chunks, phase, s):
        b.wait_all(rank, [(f"data{phase}", p, rank, s) for p in sources[rank]],
                   lambda sig: f"({chunk_names(chunks[sig.peer, rank])} {from_peer(sig)})")

    # Phase 1: reduce-scatter to the owners.
    push(phase1, to1, chunks1, 1)
    owned: list[list] = [[] for _ in range(R)]
    for need in needs:
        owned[owners[need.chunk]].append(need)
    for rank in range(R):
        mine = owned[rank]
        for s in range(S):
            waits(rank, from1, chunks1, 1, s)
            for need in mine:
                consume_into(b, rank, need, need.at(rank), reduce_at[need.chunk], s)
        for producer in from1[rank]:
            b.notify(rank, ack_signal(producer, rank), f"reduced r{producer}'s contributions", keys=(("ack1", producer, rank),))
    # Phase 2: all-gather from the owners.
    push(phase2, to2, chunks2, 2)
    for rank in range(R):
        for s in range(S):
            waits(rank, from2, chunks2, 2, s)
            for need, positions, unit in copies[rank]:
                if unit is None:
                    for position in positions[1:]:
                        b.consume(rank, (region(OUT, rank, positions[0], s),), region(OUT, rank, position, s), need.chunk, position)
                else:
                    consume_into(b, rank, need, positions, ((STAGE, unit),), s)
        for producer in from_stage2[rank]:
            b.notify(rank, ack_signal(producer, rank), f"copied r{producer}'s results", keys=(("ack2", producer, rank),))
    return b.build()
