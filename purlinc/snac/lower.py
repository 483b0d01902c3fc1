"""Lowering: a resolved ``Spec`` plus ``LowerOptions`` -> a SNAC ``Schedule``.

Every algorithm is generic over the spec: it looks only at which input slots each output
chunk is made from, never at the collective's name.

How the pieces fit
------------------
A *message* is one chunk (all its slices) moved from one rank to another.  Messages are
grouped by *edge* ``(producer, consumer)``.  Each edge gets at most two signals per channel:

- ``DATA``: owned by the consumer, notified only by the producer ("staged, go ahead");
- ``ACK``:  owned by the producer, notified only by the consumer ("done with it": the
  staging unit may be rewritten; or "ready": my registered OUT may be written this call).

Each signal has exactly one notifier, and that notifier raises it in program order, so its
value only grows; ``per_call`` is the number of notifies the builder emitted for it.  A
notify's ``k`` is its 1-based position in that sequence.  A wait for something done in the
previous call uses ``k - per_call`` (<= 0).  Waits name the notify they need (by a key), and
are resolved once every program is built, so the two sides never have to agree on counts by
convention.

``options.packed`` (direct-push only): every staged message slice carries its data notify
in its packets (a packed ``Stage`` with its own ``k``), occupying two STAGE units; the
consumer's wait for a slice names the last k of that slice, and the consumes after it
read the packets (``purlinc.snac.packing``).

``options.slots`` shapes the ring only (the one algorithm that forwards through staging);
direct-push, direct-pull and two-shot give every message its own unit, reused across calls.
Ring reductions add in ring order and round at each hop: close to the spec's evaluator but
not bitwise equal to it (direct-push, direct-pull and two-shot are bitwise equal).

Channels: the lowering builds one *template* channel over local slices ``0..S-1`` and
symbolic signals, then instantiates it per channel by shifting slices by ``c * S`` and
signal indices by ``c * (signals per channel of that rank)``: channels are independent.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace

from purlinc.errors import PurlinError
from purlinc.frontend.ast import Operation
from purlinc.frontend.spec import Chunk, Slot, Spec
from purlinc.snac.ir import (
    Algorithm,
    Consume,
    LowerOptions,
    Notify,
    Program,
    Region,
    Role,
    Schedule,
    Signal,
    SignalDecl,
    Space,
    Stage,
    Wait,
)

IN, OUT, STAGE = Space.IN, Space.OUT, Space.STAGE


# --------------------------------------------------------------------------------------
# The spec, regrouped by chunk name


@dataclass(frozen=True, slots=True)
class _Need:
    """One output chunk name: where it must land and what it is made from."""

    chunk: Chunk
    positions: tuple[tuple[int, tuple[int, ...]], ...]  # (rank, its output positions), rank order
    sources: tuple[Slot, ...]  # copy: candidate producers; reduce: all, in spec order

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(rank for rank, _ in self.positions)

    def at(self, rank: int) -> tuple[int, ...]:
        return dict(self.positions).get(rank, ())


def _needs(spec: Spec) -> tuple[_Need, ...]:
    """Output chunk names in order of first appearance (rank, then position)."""
    order: list[Chunk] = []
    where: dict[Chunk, dict[int, list[int]]] = {}
    sources: dict[Chunk, tuple[Slot, ...]] = {}
    for rank in range(spec.world_size):
        for position, chunk in enumerate(spec.outputs[rank]):
            if chunk not in where:
                order.append(chunk)
                where[chunk] = {}
                sources[chunk] = spec.sources[rank][position]
            where[chunk].setdefault(rank, []).append(position)
    return tuple(
        _Need(chunk, tuple((rank, tuple(ps)) for rank, ps in sorted(where[chunk].items())), sources[chunk])
        for chunk in order
    )


def _copy_source(need: _Need, rank: int) -> Slot:
    """The producer a copy reads for ``rank``: a local one when the spec offers it."""
    for slot in need.sources:
        if slot.rank == rank:
            return slot
    return need.sources[0]


def _owners(needs: tuple[_Need, ...]) -> dict[Chunk, int]:
    """Round-robin over the ranks that need each chunk (chunk i -> i-th such rank, cyclically)."""
    return {need.chunk: need.ranks[i % len(need.ranks)] for i, need in enumerate(needs)}


# --------------------------------------------------------------------------------------
# The builder: template programs with symbolic signals and deferred ack counts


@dataclass(frozen=True, slots=True)
class _Sig:
    """A signal before numbering: DATA(owner=consumer, peer=producer) or ACK(owner=producer, peer=consumer)."""

    owner: int
    role: Role
    peer: int


@dataclass(frozen=True, slots=True)
class _Ref:
    """A wait's target, resolved at the end: the k recorded under ``key``, minus per_call if ``previous``."""

    key: object
    previous: bool


def _data(producer: int, consumer: int) -> _Sig:
    return _Sig(consumer, Role.DATA, producer)


def _ack(producer: int, consumer: int) -> _Sig:
    return _Sig(producer, Role.ACK, consumer)


@dataclass
class _Builder:
    spec: Spec
    options: LowerOptions
    steps: list[list] = field(default_factory=list)
    units: list[int] = field(default_factory=list)
    counts: dict[_Sig, int] = field(default_factory=lambda: defaultdict(int))
    recorded: dict[object, tuple[_Sig, int]] = field(default_factory=dict)

    def __post_init__(self):
        self.steps = [[] for _ in range(self.world)]
        self.units = [0] * self.world

    @property
    def world(self) -> int:
        return self.spec.world_size

    @property
    def slices(self) -> int:
        return self.options.slices

    def unit(self, rank: int) -> int:
        self.units[rank] += 1
        return self.units[rank] - 1

    def stage(self, rank: int, src: Region, dst: Region, note: str) -> None:
        self.steps[rank].append(Stage(src, dst, note))

    def stage_packed(self, rank: int, src: Region, dst: Region, sig: _Sig, note: str, keys: tuple = ()) -> int:
        """A packed stage: the stage and the next notify of ``sig`` in one step."""
        self.counts[sig] += 1
        k = self.counts[sig]
        self.steps[rank].append(Stage(src, dst, note, sig, k))
        for key in keys:
            self.recorded[key] = (sig, k)
        return k

    def notify(self, rank: int, sig: _Sig, note: str, keys: tuple = ()) -> int:
        """Emit a notify on ``sig``; record its k under every key; return k."""
        self.counts[sig] += 1
        k = self.counts[sig]
        self.steps[rank].append(Notify(sig, k, note))
        for key in keys:
            self.recorded[key] = (sig, k)
        return k

    def wait(self, rank: int, key: object, note: str, previous: bool = False) -> None:
        self.steps[rank].append(Wait(None, _Ref(key, previous), note))

    def wait_all(self, rank: int, keys, note_of) -> None:
        """One wait per distinct (signal, k) among ``keys`` (the highest k per signal suffices)."""
        best: dict[_Sig, tuple[int, object]] = {}
        for key in keys:
            sig, k = self.recorded[key]
            if sig not in best or k > best[sig][0]:
                best[sig] = (k, key)
        for sig, (_, key) in best.items():
            self.wait(rank, key, note_of(sig))

    def consume(self, rank: int, srcs: tuple[Region, ...], dst: Region, chunk: Chunk, position: int, note: str = "") -> None:
        operation = Operation.REDUCE if len(srcs) > 1 else Operation.COPY
        line = self.spec.output_line(dst.rank, position) if dst.space is OUT else None
        self.steps[rank].append(Consume(operation, srcs, dst, note or str(chunk), line))

    # ---- finishing

    def build(self, algorithm_note: str = "") -> Schedule:
        spec, options = self.spec, self.options
        for rank in range(self.world):
            for step in self.steps[rank]:
                if isinstance(step, Wait):
                    sig, _ = self.recorded[step.k.key]
                    if sig.owner != rank:
                        raise AssertionError(f"r{rank} waits on {sig}, owned by r{sig.owner}")
        # Number signals per owner: DATA by producer rank, then ACK by consumer rank.
        per_owner: dict[int, list[_Sig]] = defaultdict(list)
        for sig in sorted(self.counts, key=lambda s: (s.owner, s.role is Role.ACK, s.peer)):
            per_owner[sig.owner].append(sig)
        local = {sig: i for sigs in per_owner.values() for i, sig in enumerate(sigs)}
        width = {owner: len(sigs) for owner, sigs in per_owner.items()}
        S = self.slices

        def signal(sig: _Sig, channel: int) -> Signal:
            return Signal(sig.owner, channel * width[sig.owner] + local[sig])

        def region(r: Region, channel: int) -> Region:
            return replace(r, slice=channel * S + r.slice)

        def step_for(step, channel: int):
            if isinstance(step, Stage):
                packed = {} if step.signal is None else {"signal": signal(step.signal, channel)}
                return replace(step, src=region(step.src, channel), dst=region(step.dst, channel), **packed)
            if isinstance(step, Consume):
                return replace(step, srcs=tuple(region(s, channel) for s in step.srcs), dst=region(step.dst, channel))
            if isinstance(step, Notify):
                return replace(step, signal=signal(step.signal, channel))
            sig, k = self.recorded[step.k.key]
            if step.k.previous:
                k -= self.counts[sig]
            return replace(step, signal=signal(sig, channel), k=k)

        programs = tuple(
            Program(rank, channel, tuple(step_for(step, channel) for step in self.steps[rank]))
            for rank in range(self.world)
            for channel in range(options.channels)
        )
        decls = tuple(
            SignalDecl(signal(sig, channel), self.counts[sig], sig.role, _signal_note(sig, channel))
            for owner in sorted(per_owner)
            for channel in range(options.channels)
            for sig in per_owner[owner]
        )
        return Schedule(
            collective=spec.name,
            world_size=self.world,
            operation=spec.operation,
            options=options,
            slices=options.channels * S,
            in_units=tuple(len(layout) for layout in spec.inputs),
            out_units=tuple(len(layout) for layout in spec.outputs),
            stage_units=max(self.units, default=0),
            signals=decls,
            programs=programs,
        )


def _signal_note(sig: _Sig, channel: int) -> str:
    if sig.role is Role.DATA:
        return f"data from r{sig.peer}, channel {channel}"
    return f"ack from r{sig.peer}, channel {channel}"


def _from(sig: _Sig) -> str:
    return f"from r{sig.peer}"


def _names(chunks) -> str:
    chunks = list(dict.fromkeys(str(c) for c in chunks))
    return ", ".join(chunks) if len(chunks) <= 4 else ", ".join(chunks[:3]) + f", ... ({len(chunks)} chunks)"


def _reg(space: Space, rank: int, unit: int, s: int) -> Region:
    return Region(space, rank, unit, s)


# --------------------------------------------------------------------------------------
# One-shot algorithms


@dataclass(frozen=True, slots=True)
class _Msg:
    """A chunk moved from ``src`` (on its producer) to ``dst`` (unit on the consumer)."""

    chunk: Chunk
    producer: int
    consumer: int
    src: tuple[Space, int]  # space, unit on the producer
    dst: tuple[Space, int]  # space, unit on the consumer (push) or where the consumer reads (pull)


def _direct_push(spec: Spec, options: LowerOptions) -> Schedule:
    b = _Builder(spec, options)
    S, R = b.slices, b.world
    registered_out = "out" in options.registered and not spec.is_reduce
    msgs: list[_Msg] = []
    landed: dict[tuple[Slot, int], int] = {}  # (slot, consumer) -> STAGE unit on consumer
    local_work: list[list] = [[] for _ in range(R)]  # per rank: (srcs-fn, dst-fn)
    remote_work: list[list] = [[] for _ in range(R)]

    needs = _needs(spec)
    # Units on each consumer in (producer, input position) order: what one producer sends
    # one consumer is contiguous there, so the datapath may move it as one block.
    wanted = set()
    for need in needs:
        for consumer, _ in need.positions:
            slots = need.sources if spec.is_reduce else (_copy_source(need, consumer),)
            wanted.update((slot, consumer) for slot in slots if slot.rank != consumer)
    packed = options.packed
    if packed and registered_out:
        raise PurlinError(
            f"packed (LL) stages write the consumer's staging buffer, but {spec.name} with a registered "
            "output pushes straight into it: drop --registered out or --packed"
        )
    if not registered_out:
        for slot, consumer in sorted(wanted, key=lambda sc: (sc[1], sc[0])):
            landed[slot, consumer] = b.unit(consumer)
            if packed:  # packets are twice the data: the next unit holds their second half
                b.unit(consumer)
    for need in needs:
        for consumer, positions in need.positions:
            if spec.is_reduce:
                slots = need.sources
            else:
                slots = (_copy_source(need, consumer),)
            srcs = []
            for slot in slots:
                if slot.rank == consumer:
                    srcs.append((IN, slot.position))
                    continue
                if registered_out:
                    for position in positions:
                        msgs.append(_Msg(need.chunk, slot.rank, consumer, (IN, slot.position), (OUT, position)))
                    srcs = None
                    continue
                if not any(m.producer == slot.rank and m.consumer == consumer and m.src == (IN, slot.position) for m in msgs):
                    msgs.append(_Msg(need.chunk, slot.rank, consumer, (IN, slot.position), (STAGE, landed[slot, consumer])))
                srcs.append((STAGE, landed[slot, consumer]))
            if srcs is None:  # landed straight in OUT
                remote_work[consumer].append((need, positions, None))
                continue
            local = all(space is IN for space, _ in srcs)
            (local_work if local else remote_work)[consumer].append((need, positions, tuple(srcs)))

    out_edges = {(m.producer, m.consumer) for m in msgs if m.dst[0] is OUT}
    stage_edges = {(m.producer, m.consumer) for m in msgs if m.dst[0] is STAGE}
    edges = sorted(out_edges | stage_edges, key=lambda e: (e[1], e[0]))

    # 1. "ready": a consumer whose OUT is written by peers says so first thing.
    for producer, consumer in sorted(out_edges, key=lambda e: (e[1], e[0])):
        b.notify(consumer, _ack(producer, consumer), f"r{consumer}.out ready for r{producer}", keys=(("ready", producer, consumer),))
    # 2. Producers make sure their targets are free: previous call consumed / this call started.
    for producer in range(R):
        for p, consumer in edges:
            if p != producer:
                continue
            if (p, consumer) in stage_edges:
                b.wait(producer, ("ack", p, consumer), f"r{consumer} done with last call's data", previous=True)
            if (p, consumer) in out_edges:
                b.wait(producer, ("ready", p, consumer), f"r{consumer}.out ready")
    # 3. Stage everything, then one notify per edge and slice.
    for producer in range(R):
        # Start with the next rank, so that not every producer hits rank 0 first.
        mine = sorted((m for m in msgs if m.producer == producer), key=lambda m: ((m.consumer - producer) % R, m.dst))
        for s in range(S):
            for m in mine:
                src, dst = _reg(m.src[0], producer, m.src[1], s), _reg(m.dst[0], m.consumer, m.dst[1], s)
                if packed:  # the notify rides in the packets: one k per message slice
                    b.stage_packed(producer, src, dst, _data(producer, m.consumer), f"{m.chunk} for r{m.consumer}",
                                   keys=(("data", producer, m.consumer, s),))
                    continue
                b.stage(producer, src, dst, f"{m.chunk} for r{m.consumer}")
            if packed:
                continue
            for p, consumer in sorted(edges, key=lambda e: (e[1] - producer) % R):
                if p != producer:
                    continue
                chunks = [m.chunk for m in mine if m.consumer == consumer]
                b.notify(producer, _data(producer, consumer), f"{_names(chunks)} for r{consumer}", keys=(("data", producer, consumer, s),))
    # 4. Outputs made only of local inputs: no need to wait for anyone.
    for rank in range(R):
        for s in range(S):
            for need, positions, srcs in local_work[rank]:
                _consume_into(b, rank, need, positions, srcs, s)
    # 5. Wait for each slice from every peer, then consume it.
    for consumer in range(R):
        producers = sorted({p for p, c in edges if c == consumer})
        for s in range(S):
            b.wait_all(consumer, [("data", p, consumer, s) for p in producers],
                       lambda sig: f"({_names(m.chunk for m in msgs if (m.producer, m.consumer) == (sig.peer, consumer))} {_from(sig)})")
            for need, positions, srcs in remote_work[consumer]:
                if srcs is not None:
                    _consume_into(b, consumer, need, positions, srcs, s)
    # 6. Tell producers their staging units are free again.
    for consumer in range(R):
        for producer in sorted({p for p, c in stage_edges if c == consumer}):
            b.notify(consumer, _ack(producer, consumer), f"consumed r{producer}'s data", keys=(("ack", producer, consumer),))
    return b.build()


def _consume_into(b: _Builder, rank: int, need: _Need, positions, srcs, s: int, src_rank=None) -> None:
    """One Consume into the first position, then copies to the others (bitwise the same)."""
    regions = tuple(_reg(space, rank if src_rank is None else src_rank[i], unit, s) for i, (space, unit) in enumerate(srcs))
    first = _reg(OUT, rank, positions[0], s)
    b.consume(rank, regions, first, need.chunk, positions[0])
    for position in positions[1:]:
        b.consume(rank, (first,), _reg(OUT, rank, position, s), need.chunk, position)


def _direct_pull(spec: Spec, options: LowerOptions) -> Schedule:
    b = _Builder(spec, options)
    S, R = b.slices, b.world
    registered_in = "in" in options.registered
    exposed: dict[Slot, tuple[Space, int]] = {}  # slot -> where its producer exposes it
    readers: dict[Slot, list[int]] = defaultdict(list)
    work: list[list] = [[] for _ in range(R)]  # (need, positions, srcs: ((space, rank, unit), ...))

    for need in _needs(spec):
        for consumer, positions in need.positions:
            slots = need.sources if spec.is_reduce else (_copy_source(need, consumer),)
            srcs = []
            for slot in slots:
                if slot.rank == consumer:
                    srcs.append((IN, consumer, slot.position))
                    continue
                if slot not in exposed:
                    exposed[slot] = (IN, slot.position) if registered_in else (STAGE, b.unit(slot.rank))
                if consumer not in readers[slot]:
                    readers[slot].append(consumer)
                srcs.append((exposed[slot][0], slot.rank, exposed[slot][1]))
            work[consumer].append((need, positions, tuple(srcs)))

    edges = sorted({(slot.rank, c) for slot, cs in readers.items() for c in cs}, key=lambda e: (e[0], e[1]))
    exposed_by = {p: sorted(slot for slot in exposed if slot.rank == p) for p in range(R)}
    chunk_of = {slot: spec.inputs[slot.rank][slot.position] for slot in exposed}

    # 1. A producer rewrites its staging units only once last call's readers are done.
    if not registered_in:
        for producer, consumer in edges:
            b.wait(producer, ("ack", producer, consumer), f"r{consumer} done reading last call's data", previous=True)
    # 2. Expose (local copy into STAGE unless IN is registered), then tell every reader.
    for producer in range(R):
        consumers = [c for p, c in edges if p == producer]
        for s in range(S if not registered_in else 1):
            if not registered_in:
                for slot in exposed_by[producer]:
                    unit = exposed[slot][1]
                    b.stage(producer, _reg(IN, producer, slot.position, s), _reg(STAGE, producer, unit, s), f"{chunk_of[slot]} for readers")
            for consumer in consumers:
                chunks = [chunk_of[slot] for slot in exposed_by[producer] if consumer in readers[slot]]
                slices = range(S) if registered_in else (s,)
                b.notify(producer, _data(producer, consumer), f"{_names(chunks)} readable by r{consumer}",
                         keys=tuple(("data", producer, consumer, t) for t in slices))
    # 3. Outputs made only of local inputs.
    for rank in range(R):
        for s in range(S):
            for need, positions, srcs in work[rank]:
                if all(r == rank for _, r, _ in srcs):
                    _consume_into(b, rank, need, positions, [(sp, u) for sp, _, u in srcs], s)
    # 4. Wait for each producer, read its slice remotely.
    for consumer in range(R):
        producers = sorted({p for p, c in edges if c == consumer})
        for s in range(S):
            b.wait_all(consumer, [("data", p, consumer, s) for p in producers], lambda sig: f"({_from(sig)})")
            for need, positions, srcs in work[consumer]:
                if any(r != consumer for _, r, _ in srcs):
                    _consume_into(b, consumer, need, positions, [(sp, u) for sp, _, u in srcs], s,
                                  src_rank=[r for _, r, _ in srcs])
        for producer in producers:
            b.notify(consumer, _ack(producer, consumer), f"done reading r{producer}", keys=(("ack", producer, consumer),))
    # 5. With registered inputs the caller may rewrite IN once we return: wait for every reader.
    if registered_in:
        for producer, consumer in edges:
            b.wait(producer, ("ack", producer, consumer), f"r{consumer} done reading r{producer}.in")
    return b.build()


def _two_shot(spec: Spec, options: LowerOptions) -> Schedule:
    needs = _needs(spec)
    if not spec.is_reduce:
        raise PurlinError(f"two-shot applies to reductions only; {spec.name} is a copy collective (use direct-push, direct-pull or ring)")
    if not any(len(need.ranks) > 1 for need in needs):
        raise PurlinError(
            f"two-shot needs an output chunk that several ranks receive (as in allreduce); in {spec.name} "
            f"for R={spec.world_size} every chunk goes to one rank, so two-shot would be exactly direct-push: use that"
        )
    b = _Builder(spec, options)
    S, R = b.slices, b.world
    registered_out = "out" in options.registered
    owners = _owners(needs)
    phase1: list[_Msg] = []  # contributions -> owner's STAGE
    phase2: list[_Msg] = []  # owner's OUT -> other ranks
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
                phase1.append(_Msg(need.chunk, slot.rank, owner, (IN, slot.position), (STAGE, unit)))
                srcs.append((STAGE, unit))
        reduce_at[need.chunk] = tuple(srcs)
        first = need.at(owner)[0]
        for consumer, positions in need.positions:
            if consumer == owner:
                continue
            if registered_out:
                phase2.append(_Msg(need.chunk, owner, consumer, (OUT, first), (OUT, positions[0])))
                copies[consumer].append((need, positions, None))
            else:
                unit = b.unit(consumer)
                phase2.append(_Msg(need.chunk, owner, consumer, (OUT, first), (STAGE, unit)))
                copies[consumer].append((need, positions, unit))

    def edges_of(msgs):
        return sorted({(m.producer, m.consumer) for m in msgs}, key=lambda e: (e[1], e[0]))

    e1, e2 = edges_of(phase1), edges_of(phase2)
    stage2 = [] if registered_out else e2
    if registered_out:
        for producer, consumer in e2:
            b.notify(consumer, _ack(producer, consumer), f"r{consumer}.out ready for r{producer}", keys=(("ready", producer, consumer),))
    for rank in range(R):
        for producer, consumer in e1:
            if producer == rank:
                b.wait(rank, ("ack1", producer, consumer), f"r{consumer} done with last call's contributions", previous=True)
        for producer, consumer in e2:
            if producer == rank:
                if registered_out:
                    b.wait(rank, ("ready", producer, consumer), f"r{consumer}.out ready")
                else:
                    b.wait(rank, ("ack2", producer, consumer), f"r{consumer} done with last call's results", previous=True)

    def push(msgs, edges, phase):
        for producer in range(R):
            mine = [m for m in msgs if m.producer == producer]
            for s in range(S):
                for m in mine:
                    what = "contribution to" if phase == 1 else "result for"
                    b.stage(producer, _reg(m.src[0], producer, m.src[1], s), _reg(m.dst[0], m.consumer, m.dst[1], s),
                            f"{m.chunk} {what} r{m.consumer}")
                for p, consumer in edges:
                    if p == producer:
                        chunks = [m.chunk for m in mine if m.consumer == consumer]
                        b.notify(producer, _data(producer, consumer), f"{_names(chunks)} for r{consumer}",
                                 keys=((f"data{phase}", producer, consumer, s),))

    def waits(rank, msgs, edges, phase, s):
        producers = sorted({p for p, c in edges if c == rank})
        b.wait_all(rank, [(f"data{phase}", p, rank, s) for p in producers],
                   lambda sig: f"({_names(m.chunk for m in msgs if (m.producer, m.consumer) == (sig.peer, rank))} {_from(sig)})")

    # Phase 1: reduce-scatter to the owners.
    push(phase1, e1, 1)
    for rank in range(R):
        mine = [need for need in needs if owners[need.chunk] == rank]
        for s in range(S):
            waits(rank, phase1, e1, 1, s)
            for need in mine:
                _consume_into(b, rank, need, need.at(rank), reduce_at[need.chunk], s)
        for producer in sorted({p for p, c in e1 if c == rank}):
            b.notify(rank, _ack(producer, rank), f"reduced r{producer}'s contributions", keys=(("ack1", producer, rank),))
    # Phase 2: all-gather from the owners.
    push(phase2, e2, 2)
    for rank in range(R):
        for s in range(S):
            waits(rank, phase2, e2, 2, s)
            for need, positions, unit in copies[rank]:
                if unit is None:
                    for position in positions[1:]:
                        b.consume(rank, (_reg(OUT, rank, positions[0], s),), _reg(OUT, rank, position, s), need.chunk, position)
                else:
                    _consume_into(b, rank, need, positions, ((STAGE, unit),), s)
        for producer in sorted({p for p, c in stage2 if c == rank}):
            b.notify(rank, _ack(producer, rank), f"copied r{producer}'s results", keys=(("ack2", producer, rank),))
    return b.build()


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
        b.notify(hop.receiver, _ack(hop.sender, hop.receiver), f"done with {hop.chunk} (r{hop.receiver}.stage[{hop.unit}])",
                 keys=(("ack", hop.id),))

    def slot_wait(hop: _Hop) -> None:
        msgs = edges[hop.sender, hop.receiver]
        j, n = position_in_edge[hop.id], options.slots
        if n is not None and j >= n:
            b.wait(hop.sender, ("ack", msgs[j - n].id), f"r{hop.receiver}.stage[{hop.unit}] free again")
            return
        last = j if n is None else max(i for i in range(len(msgs)) if i % n == j % n)
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
    for w in range(steps + S - 1):
        batch = [(h, w - h.step) for h in hops if 0 <= w - h.step < S]
        for rank in range(R):
            sent = [(h, s) for h, s in batch if h.sender == rank]
            for hop, s in sent:
                if s == 0 and hop.to_out is None:
                    slot_wait(hop)
                if hop.to_out is not None and (rank, hop.receiver) not in ready_waited:
                    ready_waited.add((rank, hop.receiver))
                    b.wait(rank, ("ready", rank, hop.receiver), f"r{hop.receiver}.out ready")
                srcs = tuple(region(rank, where, s) for where in hop.srcs)
                dst = dst_of(hop, s)
                if len(srcs) == 1:
                    b.stage(rank, srcs[0], dst, f"{hop.chunk} for r{hop.receiver}")
                else:
                    b.steps[rank].append(Consume(Operation.REDUCE, srcs, dst, f"partial {hop.chunk} for r{hop.receiver}"))
                if s == S - 1:
                    for where in hop.srcs:
                        if where[0] == "hop":
                            ack(by_id[where[1]])
            if sent:
                receiver = sent[0][0].receiver
                b.notify(rank, _data(rank, receiver), f"{_names(h.chunk for h, _ in sent)} for r{receiver}",
                         keys=tuple(("data", h.id, s) for h, s in sent))
        for rank in range(R):
            got = [(h, s) for h, s in batch if h.receiver == rank]
            if not got:
                continue
            b.wait_all(rank, [("data", h.id, s) for h, s in got], lambda sig: f"({_names(h.chunk for h, _ in got)} {_from(sig)})")
            for hop, s in got:
                for srcs, position in hop.receipt:
                    regions = tuple(region(rank, where, s) for where in srcs)
                    b.consume(rank, regions, _reg(OUT, rank, position, s), hop.chunk, position)
                if s == S - 1 and hop.to_out is None and not hop.read_later:
                    ack(hop)
    return b.build()


_LOWERINGS = {
    Algorithm.DIRECT_PUSH: _direct_push,
    Algorithm.DIRECT_PULL: _direct_pull,
    Algorithm.TWO_SHOT: _two_shot,
    Algorithm.RING: _ring,
}


def _check_options(spec: Spec, options: LowerOptions) -> None:
    if options.channels < 1 or options.slices < 1:
        raise PurlinError(f"channels and slices must be >= 1 (got channels={options.channels}, slices={options.slices})")
    if options.slots is not None and options.slots < 1:
        raise PurlinError(f"slots must be >= 1 (got {options.slots})")
    if options.packed and options.algorithm is not Algorithm.DIRECT_PUSH:
        raise PurlinError(
            f"packed (LL) stages are supported for direct-push only, not {options.algorithm.value}",
            notes=("LL packing is for small messages, where one-shot direct-push is the algorithm to use",),
        )
    unknown = set(options.registered) - {"in", "out"}
    if unknown:
        raise PurlinError(f"registered buffers must be 'in' and/or 'out', got {sorted(unknown)}")


def lower(spec: Spec, options: LowerOptions) -> Schedule:
    """The SNAC schedule of ``spec`` under ``options``; PurlinError when the algorithm does not apply."""
    _check_options(spec, options)
    try:
        return _LOWERINGS[options.algorithm](spec, options)
    except PurlinError as error:
        raise error.with_note(f"while lowering {spec.name} for R={spec.world_size} with {options.key()}") from None


def applicable_algorithms(spec: Spec) -> tuple[Algorithm, ...]:
    algorithms = [Algorithm.DIRECT_PUSH, Algorithm.DIRECT_PULL]
    if spec.is_reduce and any(len(need.ranks) > 1 for need in _needs(spec)):
        algorithms.append(Algorithm.TWO_SHOT)
    algorithms.append(Algorithm.RING)
    return tuple(algorithms)


def default_options(spec: Spec) -> LowerOptions:
    """Small and medium messages: one-shot push, one channel, one slice (the runtime tunes later)."""
    return LowerOptions(algorithm=Algorithm.DIRECT_PUSH, channels=1, slices=1)
