"""One-shot direct lowerings: direct-push (with packed/LL stages) and direct-pull."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from purlinc.errors import PurlinError
from purlinc.frontend.spec import Slot, Spec
from purlinc.snac.ir import LowerOptions, Schedule, Space, Stage
from purlinc.snac.kit import (
    IN, OUT, STAGE, ack_signal, Builder, chunk_names, chunk_text, consume_into, copy_source, data_signal,
    from_peer, Msg, needs_of, region,
)


# --------------------------------------------------------------------------------------
# One-shot algorithms


@dataclass
class _Push:
    """What direct-push derives before it emits: the messages, where they land, and the
    consumes each rank makes (filled by ``_push_units`` and ``_push_messages``)."""

    R: int
    P: int  # input positions + 1: a (consumer, slot rank, slot position) key is (consumer * R + rank) * P + position
    registered_out: bool
    packed: bool
    landed: dict[int, int] = field(default_factory=dict)  # slot + consumer key -> STAGE unit on the consumer
    msgs: list[Msg] = field(default_factory=list)
    local_work: list[list] = field(default_factory=list)  # per rank: (need, positions, srcs)
    remote_work: list[list] = field(default_factory=list)
    texts: dict[int, str] = field(default_factory=dict)  # id(chunk) -> its text (a Chunk's hash is Python code)


@dataclass
class _Edges:
    """The edges of a direct-push schedule and the indices every emitting loop reads."""

    out_edges: set
    acked: set  # staging edges whose producer waits for an ACK
    sent_by: list[list[Msg]]  # producer -> its messages
    chunks_on: dict  # edge -> chunks, in message order
    consumers_of: list[list[int]]  # producer -> consumers, by consumer
    producers_of: list[list[int]]  # consumer -> producers, by producer


def direct_push(spec: Spec, options: LowerOptions) -> Schedule:
    """Producers write into consumers' staging (or registered OUT), one notify per edge and
    slice; consumers wait, consume, and acknowledge.  Steps: allocate the landing units,
    list the messages, derive the edges, then emit (ready/ack waits, stages, consumes, ACKs)."""
    b = Builder(spec, options)
    registered_out = "out" in options.registered and not spec.is_reduce
    push = _Push(b.world, max((len(layout) for layout in spec.inputs), default=0) + 1, registered_out,
                 options.packed, local_work=[[] for _ in range(b.world)], remote_work=[[] for _ in range(b.world)])
    needs = needs_of(spec)
    _push_units(spec, options, b, push, needs)
    _push_messages(spec, push, needs)
    edges = _push_edges(b, push)
    _push_prologue(b, edges)
    _push_emit(b, push, edges)
    _push_acks(b, edges)
    return b.build()


def _push_units(spec: Spec, options: LowerOptions, b: Builder, push: _Push, needs) -> None:
    """Allocate the STAGE units messages land in, on each consumer in (producer, input
    position) order: what one producer sends one consumer is contiguous there, so the datapath
    may move it as one block.  Keys are ints, (consumer * R + rank) * P + position: ints sort
    and hash much faster than tuples, and R^2 (R-1) of them at R=72 for an all-reduce; their
    order is the tuples' order."""
    R, P = push.R, push.P
    wanted: set[int] = set()
    for need in needs:
        if spec.is_reduce:
            sources = [(slot.rank, slot.position) for slot in need.sources]
            for consumer, _ in need.positions:
                wanted.update([(consumer * R + rank) * P + position for rank, position in sources if rank != consumer])
            continue
        for consumer, _ in need.positions:
            slot = copy_source(need, consumer)
            if slot.rank != consumer:
                wanted.add((consumer * R + slot.rank) * P + slot.position)
    if push.packed and push.registered_out:
        raise PurlinError(
            f"packed (LL) stages write the consumer's staging buffer, but {spec.name} with a registered "
            "output pushes straight into it: drop --registered out or --packed"
        )
    if push.packed or options.stage_copies == 2:
        # Two staging copies by epoch parity: call e+1 lands beside call e, so a producer waits
        # for its consumer's ACK two calls late (or not at all, below): see ir.py.  LL always
        # does: its point is the shortest critical path.
        b.stage_copies = 2
    if not push.registered_out:
        # By consumer, then slot (rank, position): the keys' own order.
        for key in sorted(wanted):
            push.landed[key] = b.unit(key // (R * P))
            if push.packed:  # packets are twice the data: the next unit holds their second half
                b.unit(key // (R * P))


def _push_messages(spec: Spec, push: _Push, needs) -> None:
    """Every message (once per slot and consumer) and each consumer's consumes: local ones
    (made of its own inputs only) and remote ones (reading what landed)."""
    R, P = push.R, push.P
    staged: set[int] = set()  # slot + consumer keys already sent to STAGE
    for need in needs:
        chunk = need.chunk
        push.texts[id(chunk)] = chunk_text(chunk)
        # (rank, position, where it is read on its own rank) of each source slot: plain
        # tuples, made once per need rather than once per consumer (R^3 of them at R=72).
        if spec.is_reduce:
            sources = [(slot.rank, slot.position, (IN, slot.position)) for slot in need.sources]
        for consumer, positions in need.positions:
            if not spec.is_reduce:
                slot = copy_source(need, consumer)
                sources = [(slot.rank, slot.position, (IN, slot.position))]
            srcs = []
            for rank, position, own in sources:
                if rank == consumer:
                    srcs.append(own)
                    continue
                if push.registered_out:
                    for out in positions:
                        push.msgs.append(Msg(chunk, rank, consumer, own, (OUT, out)))
                    srcs = None
                    continue
                key = (consumer * R + rank) * P + position
                landing = (STAGE, push.landed[key])
                if key not in staged:
                    staged.add(key)
                    push.msgs.append(Msg(chunk, rank, consumer, own, landing))
                srcs.append(landing)
            if srcs is None:  # landed straight in OUT
                push.remote_work[consumer].append((need, positions, None))
                continue
            local = all(space is IN for space, _ in srcs)
            (push.local_work if local else push.remote_work)[consumer].append((need, positions, tuple(srcs)))


def _push_edges(b: Builder, push: _Push) -> _Edges:
    """The (producer, consumer) edges, which of them need an ACK, and the indices (made once,
    so that every emitting loop is linear in the schedule it writes)."""
    R, msgs = push.R, push.msgs
    out_edges = {(m.producer, m.consumer) for m in msgs if m.dst[0] is OUT}
    stage_edges = {(m.producer, m.consumer) for m in msgs if m.dst[0] is STAGE}
    # Edges whose staging needs an ACK.  With two copies, the producer rewrites a copy two
    # calls later; if the consumer also stages data for the producer every call, the
    # producer's next call waits for that data, which the consumer sends only once its
    # previous call (the reads of this copy included) has finished: the ACK is implied.
    acked = stage_edges if b.stage_copies == 1 else {e for e in stage_edges if (e[1], e[0]) not in stage_edges}
    edges = _Edges(out_edges, acked, [[] for _ in range(R)], defaultdict(list),
                   [[] for _ in range(R)], [[] for _ in range(R)])
    for m in msgs:
        edges.sent_by[m.producer].append(m)
        edges.chunks_on[m.producer, m.consumer].append(m.chunk)
    for producer, consumer in sorted(out_edges | stage_edges, key=lambda e: (e[1], e[0])):
        edges.consumers_of[producer].append(consumer)
        edges.producers_of[consumer].append(producer)
    return edges


def _push_prologue(b: Builder, edges: _Edges) -> None:
    """1. A consumer whose OUT is written by peers says "ready" first thing.  2. Producers make
    sure their targets are free: previous call consumed / this call started."""
    for producer, consumer in sorted(edges.out_edges, key=lambda e: (e[1], e[0])):
        b.notify(consumer, ack_signal(producer, consumer), f"r{consumer}.out ready for r{producer}",
                 keys=(("ready", producer, consumer),))
    for producer in range(b.world):
        for consumer in edges.consumers_of[producer]:
            if (producer, consumer) in edges.acked:
                last = "last call's" if b.stage_copies == 1 else "this copy's last"
                b.wait(producer, ("ack", producer, consumer), f"r{consumer} done with {last} data", previous=True)
            if (producer, consumer) in edges.out_edges:
                b.wait(producer, ("ready", producer, consumer), f"r{consumer}.out ready")


def _push_local(b: Builder, push: _Push, rank: int, s: int) -> None:
    """Slice s of the outputs made only of local inputs: no need to wait for anyone."""
    for need, positions, srcs in push.local_work[rank]:
        consume_into(b, rank, need, positions, srcs, s)


def _push_receive(b: Builder, push: _Push, edges: _Edges, consumer: int, s: int) -> None:
    """Wait for slice s from every peer, then consume it."""
    for producer in edges.producers_of[consumer]:  # one signal per producer: one wait each
        sig = data_signal(producer, consumer)
        note = f"({chunk_names(edges.chunks_on[producer, consumer], push.texts)} {from_peer(sig)})"
        b.wait(consumer, ("data", producer, consumer, s), note)
    for need, positions, srcs in push.remote_work[consumer]:
        if srcs is not None:
            consume_into(b, consumer, need, positions, srcs, s)


def _push_emit(b: Builder, push: _Push, edges: _Edges) -> None:
    """3. Stage everything, then one notify per edge and slice (interleaved with several plain
    slices: per slice, with this slice's local copies and the previous slice's consumes
    before the notify).  Without interleaving, 4. local consumes and 5. waits and consumes
    follow, rank by rank."""
    S, R = b.slices, b.world
    interleave = S > 1 and not push.packed
    note_of: dict[int, str] = {}  # id(chunk) * R + consumer -> the stage's note
    for producer in range(R):
        rows, rotated, notes = _push_rows(push, edges, producer, note_of)
        if interleave:
            _push_interleaved(b, push, edges, producer, rows, rotated, notes)
        else:
            _push_slices(b, push, producer, rows, rotated, notes)
    if not interleave:
        for rank in range(R):
            for s in range(S):
                _push_local(b, push, rank, s)
        for consumer in range(R):
            for s in range(S):
                _push_receive(b, push, edges, consumer, s)


def _push_rows(push: _Push, edges: _Edges, producer: int, note_of: dict) -> tuple[list, list, dict]:
    """A producer's messages as rows of what every slice's stage needs (hoisted: hundreds of
    thousands of stages), its consumers starting after itself, and each edge's notify note."""
    R, texts = push.R, push.texts
    # Start with the next rank, so that not every producer hits rank 0 first.  By (consumer
    # offset, unit), stably (the messages to one consumer all land in one space, so the unit
    # orders them as m.dst does): sorted as single ints, which compare in C far faster than tuples.
    sent = edges.sent_by[producer]
    count = len(sent)
    units = max((m.dst[1] for m in sent), default=0) + 1
    order = sorted([(((m.consumer - producer) % R) * units + m.dst[1]) * count + i for i, m in enumerate(sent)])
    mine = [sent[key % count] for key in order]
    # sorted() is stable: consumers in edge order, rotated to start after the producer.
    rotated = sorted(edges.consumers_of[producer], key=lambda c: (c - producer) % R)
    sent_to: dict[int, list] = defaultdict(list)
    for m in mine:
        sent_to[m.consumer].append(m.chunk)
    notes = {c: f"{chunk_names(sent_to[c], texts)} for r{c}" for c in rotated}
    rows = []
    for m in mine:
        consumer = m.consumer
        key = id(m.chunk) * R + consumer
        note = note_of.get(key)
        if note is None:  # one string per (chunk, consumer), shared by every producer
            note = note_of[key] = f"{texts[id(m.chunk)]} for r{consumer}"
        rows.append((m.src[0], m.src[1], m.dst[0], consumer, m.dst[1], note))
    return rows, rotated, notes


def _push_interleaved(b: Builder, push: _Push, edges: _Edges, producer: int, rows, rotated, notes) -> None:
    """Slice s's stores are under way while the rank copies its own inputs of slice s (right
    after the stages, so the datapath reads each input once for both) and consumes slice s-1;
    the notify's release, which waits for the stores to land, comes last.  The last slice's
    local copies follow its notify instead, so that they cover the signal's flight."""
    S = b.slices
    append = b.steps[producer].append
    for s in range(S):
        for src_space, src_unit, dst_space, consumer, dst_unit, note in rows:
            append(Stage(region(src_space, producer, src_unit, s), region(dst_space, consumer, dst_unit, s), note))
        if s < S - 1:
            _push_local(b, push, producer, s)
        if s:
            _push_receive(b, push, edges, producer, s - 1)
        for consumer in rotated:
            b.notify(producer, data_signal(producer, consumer), notes[consumer], keys=(("data", producer, consumer, s),))
    _push_local(b, push, producer, S - 1)
    _push_receive(b, push, edges, producer, S - 1)


def _push_slices(b: Builder, push: _Push, producer: int, rows, rotated, notes) -> None:
    """Every slice's stages, then its notifies (packed: the notify rides in the packets, one k
    per message slice)."""
    append = b.steps[producer].append
    for s in range(b.slices):
        if push.packed:
            for src_space, src_unit, dst_space, consumer, dst_unit, note in rows:
                b.stage_packed(producer, region(src_space, producer, src_unit, s),
                               region(dst_space, consumer, dst_unit, s),
                               data_signal(producer, consumer), note, keys=(("data", producer, consumer, s),))
            continue
        for src_space, src_unit, dst_space, consumer, dst_unit, note in rows:  # b.stage, inlined
            append(Stage(region(src_space, producer, src_unit, s), region(dst_space, consumer, dst_unit, s), note))
        for consumer in rotated:
            b.notify(producer, data_signal(producer, consumer), notes[consumer], keys=(("data", producer, consumer, s),))


def _push_acks(b: Builder, edges: _Edges) -> None:
    """6. Tell producers their staging units are free again."""
    for consumer in range(b.world):
        for producer in edges.producers_of[consumer]:
            if (producer, consumer) in edges.acked:
                b.notify(consumer, ack_signal(producer, consumer), f"consumed r{producer}'s data",
                         keys=(("ack", producer, consumer),))


def direct_pull(spec: Spec, options: LowerOptions) -> Schedule:
    b = Builder(spec, options)
    S, R = b.slices, b.world
    registered_in = "in" in options.registered
    exposed: dict[Slot, tuple[Space, int]] = {}  # slot -> where its producer exposes it
    readers: dict[Slot, dict[int, None]] = defaultdict(dict)  # slot -> its reading consumers (ordered set)
    work: list[list] = [[] for _ in range(R)]  # (need, positions, srcs: ((space, rank, unit), ...))

    for need in needs_of(spec):
        for consumer, positions in need.positions:
            slots = need.sources if spec.is_reduce else (copy_source(need, consumer),)
            srcs = []
            for slot in slots:
                if slot.rank == consumer:
                    srcs.append((IN, consumer, slot.position))
                    continue
                if slot not in exposed:
                    exposed[slot] = (IN, slot.position) if registered_in else (STAGE, b.unit(slot.rank))
                readers[slot][consumer] = None
                srcs.append((exposed[slot][0], slot.rank, exposed[slot][1]))
            work[consumer].append((need, positions, tuple(srcs)))

    edges = sorted({(slot.rank, c) for slot, cs in readers.items() for c in cs}, key=lambda e: (e[0], e[1]))
    exposed_by: dict[int, list[Slot]] = {p: [] for p in range(R)}
    for slot in sorted(exposed):
        exposed_by[slot.rank].append(slot)
    chunk_of = {slot: spec.inputs[slot.rank][slot.position] for slot in exposed}
    consumers_of: list[list[int]] = [[] for _ in range(R)]  # producer -> consumers, by consumer
    producers_of: list[list[int]] = [[] for _ in range(R)]  # consumer -> producers, by producer
    for producer, consumer in edges:
        consumers_of[producer].append(consumer)
        producers_of[consumer].append(producer)
    readable: dict[tuple[int, int], list] = defaultdict(list)  # edge -> chunks the consumer reads
    for producer in range(R):
        for slot in exposed_by[producer]:
            for consumer in readers[slot]:
                readable[producer, consumer].append(chunk_of[slot])

    # 1. A producer rewrites its staging units only once last call's readers are done.
    if not registered_in:
        for producer, consumer in edges:
            b.wait(producer, ("ack", producer, consumer), f"r{consumer} done reading last call's data", previous=True)
    # 2. Expose (local copy into STAGE unless IN is registered), then tell every reader.
    for producer in range(R):
        consumers = consumers_of[producer]
        notes = {c: f"{chunk_names(readable[producer, c])} readable by r{c}" for c in consumers}
        for s in range(S if not registered_in else 1):
            if not registered_in:
                for slot in exposed_by[producer]:
                    unit = exposed[slot][1]
                    b.stage(producer, region(IN, producer, slot.position, s), region(STAGE, producer, unit, s), f"{chunk_text(chunk_of[slot])} for readers")
            for consumer in consumers:
                slices = range(S) if registered_in else (s,)
                b.notify(producer, data_signal(producer, consumer), notes[consumer],
                         keys=tuple(("data", producer, consumer, t) for t in slices))
    # 3. Outputs made only of local inputs.
    for rank in range(R):
        for s in range(S):
            for need, positions, srcs in work[rank]:
                if all(r == rank for _, r, _ in srcs):
                    consume_into(b, rank, need, positions, [(sp, u) for sp, _, u in srcs], s)
    # 4. Wait for each producer, read its slice remotely.
    for consumer in range(R):
        producers = producers_of[consumer]
        for s in range(S):
            b.wait_all(consumer, [("data", p, consumer, s) for p in producers], lambda sig: f"({from_peer(sig)})")
            for need, positions, srcs in work[consumer]:
                if any(r != consumer for _, r, _ in srcs):
                    consume_into(b, consumer, need, positions, [(sp, u) for sp, _, u in srcs], s,
                                  src_rank=[r for _, r, _ in srcs])
        for producer in producers:
            b.notify(consumer, ack_signal(producer, consumer), f"done reading r{producer}", keys=(("ack", producer, consumer),))
    # 5. With registered inputs the caller may rewrite IN once we return: wait for every reader.
    if registered_in:
        for producer, consumer in edges:
            b.wait(producer, ("ack", producer, consumer), f"r{consumer} done reading r{producer}.in")
    return b.build()
