"""One-shot direct lowerings: direct-push (with packed/LL stages) and direct-pull."""

from __future__ import annotations

from collections import defaultdict

from purlinc.errors import PurlinError
from purlinc.frontend.spec import Slot, Spec
from purlinc.snac.ir import LowerOptions, Schedule, Space, Stage
from purlinc.snac.kit import (
    IN, OUT, STAGE, ack_signal, Builder, chunk_names, chunk_text, consume_into, copy_source, data_signal,
    from_peer, Msg, needs_of, region,
)


# --------------------------------------------------------------------------------------
# One-shot algorithms


def _direct_push(spec: Spec, options: LowerOptions) -> Schedule:
    b = Builder(spec, options)
    S, R = b.slices, b.world
    registered_out = "out" in options.registered and not spec.is_reduce
    msgs: list[Msg] = []
    # (consumer, slot rank, slot position) as one int, (consumer * R + rank) * P + position:
    # ints sort and hash much faster than tuples, and R^2 of them at R=72 for an
    # all-reduce; their order is the tuples' order.
    P = max((len(layout) for layout in spec.inputs), default=0) + 1
    landed: dict[int, int] = {}  # slot + consumer key -> STAGE unit on the consumer
    local_work: list[list] = [[] for _ in range(R)]  # per rank: (srcs-fn, dst-fn)
    remote_work: list[list] = [[] for _ in range(R)]

    needs = needs_of(spec)
    # Units on each consumer in (producer, input position) order: what one producer sends
    # one consumer is contiguous there, so the datapath may move it as one block.
    wanted: set[int] = set()  # slot + consumer keys (above)
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
    packed = options.packed
    if packed and registered_out:
        raise PurlinError(
            f"packed (LL) stages write the consumer's staging buffer, but {spec.name} with a registered "
            "output pushes straight into it: drop --registered out or --packed"
        )
    if packed or options.stage_copies == 2:
        # Two staging copies by epoch parity: call e+1 lands beside call e, so a producer waits
        # for its consumer's ACK two calls late (or not at all, below): see ir.py.  LL always
        # does: its point is the shortest critical path.
        b.stage_copies = 2
    if not registered_out:
        # By consumer, then slot (rank, position): the keys' own order.
        for key in sorted(wanted):
            landed[key] = b.unit(key // (R * P))
            if packed:  # packets are twice the data: the next unit holds their second half
                b.unit(key // (R * P))
    staged: set[int] = set()  # slot + consumer keys already sent to STAGE
    texts: dict[int, str] = {}  # id(chunk) -> its text (a Chunk's hash is Python code)
    for need in needs:
        chunk = need.chunk
        texts[id(chunk)] = chunk_text(chunk)
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
                if registered_out:
                    for out in positions:
                        msgs.append(Msg(chunk, rank, consumer, own, (OUT, out)))
                    srcs = None
                    continue
                key = (consumer * R + rank) * P + position
                landing = (STAGE, landed[key])
                if key not in staged:
                    staged.add(key)
                    msgs.append(Msg(chunk, rank, consumer, own, landing))
                srcs.append(landing)
            if srcs is None:  # landed straight in OUT
                remote_work[consumer].append((need, positions, None))
                continue
            local = all(space is IN for space, _ in srcs)
            (local_work if local else remote_work)[consumer].append((need, positions, tuple(srcs)))

    out_edges = {(m.producer, m.consumer) for m in msgs if m.dst[0] is OUT}
    stage_edges = {(m.producer, m.consumer) for m in msgs if m.dst[0] is STAGE}
    # Edges whose staging needs an ACK.  With two copies, the producer rewrites a copy two
    # calls later; if the consumer also stages data for the producer every call, the
    # producer's next call waits for that data, which the consumer sends only once its
    # previous call (the reads of this copy included) has finished: the ACK is implied.
    acked = stage_edges if b.stage_copies == 1 else {e for e in stage_edges if (e[1], e[0]) not in stage_edges}
    # Indexed once, so that every loop below is linear in the schedule it writes.
    sent_by: list[list[Msg]] = [[] for _ in range(R)]  # producer -> its messages
    chunks_on: dict[tuple[int, int], list] = defaultdict(list)  # edge -> chunks, in message order
    for m in msgs:
        sent_by[m.producer].append(m)
        chunks_on[m.producer, m.consumer].append(m.chunk)
    consumers_of: list[list[int]] = [[] for _ in range(R)]  # producer -> consumers, by consumer
    producers_of: list[list[int]] = [[] for _ in range(R)]  # consumer -> producers, by producer
    for producer, consumer in sorted(out_edges | stage_edges, key=lambda e: (e[1], e[0])):
        consumers_of[producer].append(consumer)
        producers_of[consumer].append(producer)

    # 1. "ready": a consumer whose OUT is written by peers says so first thing.
    for producer, consumer in sorted(out_edges, key=lambda e: (e[1], e[0])):
        b.notify(consumer, ack_signal(producer, consumer), f"r{consumer}.out ready for r{producer}", keys=(("ready", producer, consumer),))
    # 2. Producers make sure their targets are free: previous call consumed / this call started.
    for producer in range(R):
        for consumer in consumers_of[producer]:
            if (producer, consumer) in acked:
                last = "last call's" if b.stage_copies == 1 else "this copy's last"
                b.wait(producer, ("ack", producer, consumer), f"r{consumer} done with {last} data", previous=True)
            if (producer, consumer) in out_edges:
                b.wait(producer, ("ready", producer, consumer), f"r{consumer}.out ready")

    def local(rank: int, s: int) -> None:
        """Slice s of the outputs made only of local inputs: no need to wait for anyone."""
        for need, positions, srcs in local_work[rank]:
            consume_into(b, rank, need, positions, srcs, s)

    def receive(consumer: int, s: int) -> None:
        """Wait for slice s from every peer, then consume it."""
        for producer in producers_of[consumer]:  # one signal per producer: one wait each
            sig = data_signal(producer, consumer)
            note = f"({chunk_names(chunks_on[producer, consumer], texts)} {from_peer(sig)})"
            b.wait(consumer, ("data", producer, consumer, s), note)
        for need, positions, srcs in remote_work[consumer]:
            if srcs is not None:
                consume_into(b, consumer, need, positions, srcs, s)

    # With several slices (and plain stages), each rank's program pipelines them: see 3.
    interleave = S > 1 and not packed

    # 3. Stage everything, then one notify per edge and slice (interleaved: per slice, with
    #    this slice's local copies and the previous slice's consumes before the notify).
    note_of: dict[int, str] = {}  # id(chunk) * R + consumer -> the stage's note
    for producer in range(R):
        # Start with the next rank, so that not every producer hits rank 0 first.
        # By (consumer offset, unit), stably (the messages to one consumer all land in one
        # space, so the unit orders them as m.dst does): sorted as single ints, which compare
        # in C far faster than tuples.
        sent = sent_by[producer]
        count = len(sent)
        units = max((m.dst[1] for m in sent), default=0) + 1
        order = sorted([(((m.consumer - producer) % R) * units + m.dst[1]) * count + i for i, m in enumerate(sent)])
        mine = [sent[key % count] for key in order]
        # sorted() is stable: consumers in edge order, rotated to start after the producer.
        rotated = sorted(consumers_of[producer], key=lambda c: (c - producer) % R)
        sent_to: dict[int, list] = defaultdict(list)
        for m in mine:
            sent_to[m.consumer].append(m.chunk)
        notes = {c: f"{chunk_names(sent_to[c], texts)} for r{c}" for c in rotated}
        # Per message, what every slice's stage needs (hoisted: hundreds of thousands of stages).
        rows = []
        for m in mine:
            consumer = m.consumer
            key = id(m.chunk) * R + consumer
            note = note_of.get(key)
            if note is None:  # one string per (chunk, consumer), shared by every producer
                note = note_of[key] = f"{texts[id(m.chunk)]} for r{consumer}"
            rows.append((m.src[0], m.src[1], m.dst[0], consumer, m.dst[1], note))
        append = b.steps[producer].append
        if interleave:
            # Slice s's stores are under way while the rank copies its own inputs of slice s
            # (right after the stages, so the datapath reads each input once for both) and
            # consumes slice s-1; the notify's release, which waits for the stores to land,
            # comes last.  The last slice's local copies follow its notify instead, so that
            # they cover the signal's flight to the consumer.
            for s in range(S):
                for src_space, src_unit, dst_space, consumer, dst_unit, note in rows:
                    append(Stage(region(src_space, producer, src_unit, s), region(dst_space, consumer, dst_unit, s),
                                 note))
                if s < S - 1:
                    local(producer, s)
                if s:
                    receive(producer, s - 1)
                for consumer in rotated:
                    b.notify(producer, data_signal(producer, consumer), notes[consumer], keys=(("data", producer, consumer, s),))
            local(producer, S - 1)
            receive(producer, S - 1)
            continue
        for s in range(S):
            if packed:  # the notify rides in the packets: one k per message slice
                for src_space, src_unit, dst_space, consumer, dst_unit, note in rows:
                    b.stage_packed(producer, region(src_space, producer, src_unit, s), region(dst_space, consumer, dst_unit, s),
                                   data_signal(producer, consumer), note, keys=(("data", producer, consumer, s),))
                continue
            for src_space, src_unit, dst_space, consumer, dst_unit, note in rows:  # b.stage, inlined
                append(Stage(region(src_space, producer, src_unit, s), region(dst_space, consumer, dst_unit, s), note))
            for consumer in rotated:
                b.notify(producer, data_signal(producer, consumer), notes[consumer], keys=(("data", producer, consumer, s),))
    if not interleave:
        # 4. Outputs made only of local inputs: no need to wait for anyone.
        for rank in range(R):
            for s in range(S):
                local(rank, s)
        # 5. Wait for each slice from every peer, then consume it.
        for consumer in range(R):
            for s in range(S):
                receive(consumer, s)
    # 6. Tell producers their staging units are free again.
    for consumer in range(R):
        for producer in producers_of[consumer]:
            if (producer, consumer) in acked:
                b.notify(consumer, ack_signal(producer, consumer), f"consumed r{producer}'s data", keys=(("ack", producer, consumer),))
    return b.build()


def _direct_pull(spec: Spec, options: LowerOptions) -> Schedule:
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
