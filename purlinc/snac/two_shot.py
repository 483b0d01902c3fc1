"""Two-shot lowering for reductions: reduce-scatter to each chunk's owner, then all-gather from it."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from purlinc.errors import PurlinError
from purlinc.frontend.spec import Chunk, Spec
from purlinc.snac.ir import LowerOptions, Schedule
from purlinc.snac.kit import (
    IN, OUT, STAGE, ack_signal, Builder, chunk_names, chunk_text, consume_into, data_signal, from_peer, Msg,
    needs_of, region, round_robin_owners,
)


@dataclass
class _Phases:
    """The two phases' messages and what each rank does with them (``_two_shot_units``)."""

    owners: dict  # chunk -> the rank that reduces it
    phase1: list[Msg] = field(default_factory=list)  # contributions -> owner's STAGE
    phase2: list[Msg] = field(default_factory=list)  # owner's OUT -> other ranks
    reduce_at: dict[Chunk, tuple] = field(default_factory=dict)  # chunk -> srcs on the owner
    copies: list[list] = field(default_factory=list)  # per rank: (need, positions, unit or None)


@dataclass
class _PhaseEdges:
    """One phase's edges, indexed once so that every emitting loop is linear in what it writes."""

    edges: list  # (producer, consumer), by consumer then producer
    to: list[list[int]]  # producer -> consumers
    sources: list[list[int]]  # consumer -> producers
    chunks: dict  # edge -> chunks, in message order
    sent_by: list[list[Msg]]  # producer -> its messages


def two_shot(spec: Spec, options: LowerOptions) -> Schedule:
    """Reduce-scatter to each chunk's owner, then all-gather from it.  Steps: allocate the
    units both phases land in, derive each phase's edges, emit the ready/ACK waits, then
    phase 1 (contributions, reductions) and phase 2 (results, copies)."""
    needs = needs_of(spec)
    if not spec.is_reduce:
        raise PurlinError(f"two-shot applies to reductions only; {spec.name} is a copy collective (use direct-push, direct-pull or ring)")
    if not any(len(need.ranks) > 1 for need in needs):
        raise PurlinError(
            f"two-shot needs an output chunk that several ranks receive (as in allreduce); in {spec.name} "
            f"for R={spec.world_size} every chunk goes to one rank, so two-shot would be exactly direct-push: use that"
        )
    b = Builder(spec, options)
    registered_out = "out" in options.registered
    phases = _two_shot_units(b, needs, registered_out)
    first = _phase_edges(b.world, phases.phase1)
    second = _phase_edges(b.world, phases.phase2)
    _two_shot_prologue(b, first, second, registered_out)
    _two_shot_reduce(b, needs, phases, first)
    _two_shot_gather(b, phases, second, registered_out)
    return b.build()


def _two_shot_units(b: Builder, needs, registered_out: bool) -> _Phases:
    """Each chunk's owner (round robin), the STAGE units contributions land in on it, and the
    units (or registered OUT) its result lands in on every other rank that needs it."""
    phases = _Phases(round_robin_owners(needs), copies=[[] for _ in range(b.world)])
    for need in needs:
        owner = phases.owners[need.chunk]
        srcs = []
        for slot in need.sources:
            if slot.rank == owner:
                srcs.append((IN, slot.position))
            else:
                unit = b.unit(owner)
                phases.phase1.append(Msg(need.chunk, slot.rank, owner, (IN, slot.position), (STAGE, unit)))
                srcs.append((STAGE, unit))
        phases.reduce_at[need.chunk] = tuple(srcs)
        first = need.at(owner)[0]
        for consumer, positions in need.positions:
            if consumer == owner:
                continue
            if registered_out:
                phases.phase2.append(Msg(need.chunk, owner, consumer, (OUT, first), (OUT, positions[0])))
                phases.copies[consumer].append((need, positions, None))
            else:
                unit = b.unit(consumer)
                phases.phase2.append(Msg(need.chunk, owner, consumer, (OUT, first), (STAGE, unit)))
                phases.copies[consumer].append((need, positions, unit))
    return phases


def _phase_edges(R: int, msgs: list[Msg]) -> _PhaseEdges:
    edges = sorted({(m.producer, m.consumer) for m in msgs}, key=lambda e: (e[1], e[0]))
    phase = _PhaseEdges(edges, [[] for _ in range(R)], [[] for _ in range(R)], defaultdict(list),
                        [[] for _ in range(R)])
    for producer, consumer in edges:
        phase.to[producer].append(consumer)
    for producer, consumer in sorted(edges):
        phase.sources[consumer].append(producer)
    for m in msgs:
        phase.chunks[m.producer, m.consumer].append(m.chunk)
        phase.sent_by[m.producer].append(m)
    return phase


def _two_shot_prologue(b: Builder, first: _PhaseEdges, second: _PhaseEdges, registered_out: bool) -> None:
    """Registered OUT: each consumer says "ready" first thing.  Producers wait until last call's
    contributions and results were taken (or this call's OUT is ready)."""
    if registered_out:
        for producer, consumer in second.edges:
            b.notify(consumer, ack_signal(producer, consumer), f"r{consumer}.out ready for r{producer}",
                     keys=(("ready", producer, consumer),))
    for rank in range(b.world):
        for consumer in first.to[rank]:
            b.wait(rank, ("ack1", rank, consumer), f"r{consumer} done with last call's contributions", previous=True)
        for consumer in second.to[rank]:
            if registered_out:
                b.wait(rank, ("ready", rank, consumer), f"r{consumer}.out ready")
            else:
                b.wait(rank, ("ack2", rank, consumer), f"r{consumer} done with last call's results", previous=True)


def _two_shot_push(b: Builder, edges: _PhaseEdges, phase: int) -> None:
    """Every producer stages its messages of one phase, slice by slice, with a notify per edge."""
    what = "contribution to" if phase == 1 else "result for"
    for producer, mine in enumerate(edges.sent_by):
        notes = {c: f"{chunk_names(edges.chunks[producer, c])} for r{c}" for c in edges.to[producer]}
        for s in range(b.slices):
            for m in mine:
                b.stage(producer, region(m.src[0], producer, m.src[1], s), region(m.dst[0], m.consumer, m.dst[1], s),
                        f"{chunk_text(m.chunk)} {what} r{m.consumer}")
            for consumer in edges.to[producer]:
                b.notify(producer, data_signal(producer, consumer), notes[consumer],
                         keys=((f"data{phase}", producer, consumer, s),))


def _two_shot_waits(b: Builder, rank: int, edges: _PhaseEdges, phase: int, s: int) -> None:
    b.wait_all(rank, [(f"data{phase}", p, rank, s) for p in edges.sources[rank]],
               lambda sig: f"({chunk_names(edges.chunks[sig.peer, rank])} {from_peer(sig)})")


def _two_shot_reduce(b: Builder, needs, phases: _Phases, first: _PhaseEdges) -> None:
    """Phase 1: reduce-scatter to the owners."""
    _two_shot_push(b, first, 1)
    owned: list[list] = [[] for _ in range(b.world)]
    for need in needs:
        owned[phases.owners[need.chunk]].append(need)
    for rank in range(b.world):
        for s in range(b.slices):
            _two_shot_waits(b, rank, first, 1, s)
            for need in owned[rank]:
                consume_into(b, rank, need, need.at(rank), phases.reduce_at[need.chunk], s)
        for producer in first.sources[rank]:
            b.notify(rank, ack_signal(producer, rank), f"reduced r{producer}'s contributions",
                     keys=(("ack1", producer, rank),))


def _two_shot_gather(b: Builder, phases: _Phases, second: _PhaseEdges, registered_out: bool) -> None:
    """Phase 2: all-gather from the owners (staged results acknowledged once copied)."""
    _two_shot_push(b, second, 2)
    for rank in range(b.world):
        for s in range(b.slices):
            _two_shot_waits(b, rank, second, 2, s)
            for need, positions, unit in phases.copies[rank]:
                if unit is None:
                    for position in positions[1:]:
                        b.consume(rank, (region(OUT, rank, positions[0], s),), region(OUT, rank, position, s),
                                  need.chunk, position)
                else:
                    consume_into(b, rank, need, positions, ((STAGE, unit),), s)
        for producer in (second.sources[rank] if not registered_out else ()):
            b.notify(rank, ack_signal(producer, rank), f"copied r{producer}'s results", keys=(("ack2", producer, rank),))
