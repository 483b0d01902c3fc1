"""The lowering kit: everything the lowerings (``direct``, ``two_shot``, ``ring``) share, public.

- The spec regrouped by chunk name (``Need``, ``needs_of``, ``copy_source``,
  ``round_robin_owners``): where each output chunk must land and what it is made from; like
  the lowerings, it looks only at slots, never at the collective's name.
- The ``Builder``: one channel-relative program per rank, written as its own template steps
  (symbolic signals ``data_signal`` / ``ack_signal``, waits naming the notify they need by a
  key), turned into IR steps only at the end by ``Builder.build``.
- Helpers for one-shot messages (``Msg``, ``consume_into``) and for notes and regions
  (``chunk_text``, ``chunk_names``, ``from_peer``, ``region``).

A lowering is a sequence of named steps over these: allocate the units messages land in,
derive the edges (DATA and ACK signals) between producers and consumers, emit each rank's
program.  How signals, keys and channels fit together is told in ``purlinc.snac.lower``'s
docstring.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

from purlinc.frontend.ast import Operation
from purlinc.frontend.spec import Chunk, Slot, Spec
from purlinc.snac.ir import Consume, LowerOptions, Notify, Program, Region, Role, Schedule, Signal, SignalDecl, Space
from purlinc.snac.ir import Stage, Wait


# --------------------------------------------------------------------------------------
# The spec, regrouped by chunk name


@dataclass(frozen=True, slots=True)
class Need:
    """One output chunk name: where it must land and what it is made from."""

    chunk: Chunk
    positions: tuple[tuple[int, tuple[int, ...]], ...]  # (rank, its output positions), rank order
    sources: tuple[Slot, ...]  # copy: candidate producers; reduce: all, in spec order

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(rank for rank, _ in self.positions)

    def at(self, rank: int) -> tuple[int, ...]:
        return dict(self.positions).get(rank, ())


def needs_of(spec: Spec) -> tuple[Need, ...]:
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
        Need(chunk, tuple((rank, tuple(ps)) for rank, ps in sorted(where[chunk].items())), sources[chunk])
        for chunk in order
    )


def copy_source(need: Need, rank: int) -> Slot:
    """The producer a copy reads for ``rank``: a local one when the spec offers it."""
    for slot in need.sources:
        if slot.rank == rank:
            return slot
    return need.sources[0]


def round_robin_owners(needs: tuple[Need, ...]) -> dict[Chunk, int]:
    """Round-robin over the ranks that need each chunk (chunk i -> i-th such rank, cyclically)."""
    return {need.chunk: need.ranks[i % len(need.ranks)] for i, need in enumerate(needs)}


IN, OUT, STAGE = Space.IN, Space.OUT, Space.STAGE


# --------------------------------------------------------------------------------------
# The builder: template programs with symbolic signals and deferred ack counts
#
# Its own records are named tuples, not frozen dataclasses: a schedule at R=72 makes
# hundreds of thousands of them, and tuples are built, hashed and compared in C.


class Sig(NamedTuple):
    """A signal before numbering: DATA(owner=consumer, peer=producer) or ACK(owner=producer, peer=consumer)."""

    owner: int
    role: Role
    peer: int


class Ref(NamedTuple):
    """A wait's target, resolved at the end: the k recorded under ``key``; with ``previous``,
    of the call the slot was last used in (``stage_copies`` calls back: minus that many per_call)."""

    key: object
    previous: bool


class TStage(NamedTuple):
    """A packed (LL) Stage before numbering: it notifies ``sig`` with ``k``."""

    src: Region
    dst: Region
    note: str
    sig: Sig
    k: int


class TNotify(NamedTuple):
    sig: Sig
    k: int
    note: str


class TWait(NamedTuple):
    ref: Ref
    note: str


def data_signal(producer: int, consumer: int) -> Sig:
    return Sig(consumer, Role.DATA, producer)


def ack_signal(producer: int, consumer: int) -> Sig:
    return Sig(producer, Role.ACK, consumer)


@dataclass
class Builder:
    spec: Spec
    options: LowerOptions
    steps: list[list] = field(default_factory=list)
    units: list[int] = field(default_factory=list)
    counts: dict[Sig, int] = field(default_factory=lambda: defaultdict(int))
    recorded: dict[object, tuple[Sig, int]] = field(default_factory=dict)
    stage_copies: int = 1  # STAGE copies by epoch parity (purlinc.snac.ir, "Staging copies")

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
        # A plain stage names no signal: it is IR already (so is a Consume).
        self.steps[rank].append(Stage(src, dst, note))

    def stage_packed(self, rank: int, src: Region, dst: Region, sig: Sig, note: str, keys: tuple = ()) -> int:
        """A packed stage: the stage and the next notify of ``sig`` in one step."""
        self.counts[sig] += 1
        k = self.counts[sig]
        self.steps[rank].append(TStage(src, dst, note, sig, k))
        for key in keys:
            self.recorded[key] = (sig, k)
        return k

    def notify(self, rank: int, sig: Sig, note: str, keys: tuple = ()) -> int:
        """Emit a notify on ``sig``; record its k under every key; return k."""
        self.counts[sig] += 1
        k = self.counts[sig]
        self.steps[rank].append(TNotify(sig, k, note))
        for key in keys:
            self.recorded[key] = (sig, k)
        return k

    def wait(self, rank: int, key: object, note: str, previous: bool = False) -> None:
        self.steps[rank].append(TWait(Ref(key, previous), note))

    def wait_all(self, rank: int, keys, note_of) -> None:
        """One wait per distinct (signal, k) among ``keys`` (the highest k per signal suffices)."""
        best: dict[Sig, tuple[int, object]] = {}
        for key in keys:
            sig, k = self.recorded[key]
            if sig not in best or k > best[sig][0]:
                best[sig] = (k, key)
        for sig, (_, key) in best.items():
            self.wait(rank, key, note_of(sig))

    def consume(self, rank: int, srcs: tuple[Region, ...], dst: Region, chunk: Chunk, position: int, note: str = "") -> None:
        operation = Operation.REDUCE if len(srcs) > 1 else Operation.COPY
        line = self.spec.output_line(dst.rank, position) if dst.space is OUT else None
        self.steps[rank].append(Consume(operation, srcs, dst, note or chunk_text(chunk), line))

    # ---- finishing

    def build(self) -> Schedule:
        """The schedule: one channel-relative program per rank (see ``purlinc.snac.ir``)."""
        spec, options = self.spec, self.options
        # Number signals per owner: DATA by producer rank, then ACK by consumer rank.  Every
        # rank's pad reserves W = the widest owner's count per channel, so channel c's signals
        # sit at c * W + index on every rank (a symmetric pad, one base per channel).
        per_owner: dict[int, list[Sig]] = defaultdict(list)
        for sig in sorted(self.counts, key=lambda s: (s.owner, s.role is Role.ACK, s.peer)):
            per_owner[sig.owner].append(sig)
        numbered = {sig: Signal(sig.owner, i) for sigs in per_owner.values() for i, sig in enumerate(sigs)}
        width = max((len(sigs) for sigs in per_owner.values()), default=0)

        def step_for(rank: int, step):
            kind = type(step)
            if kind is Stage or kind is Consume:  # no signal in it: IR already
                return step
            if kind is TStage:
                return Stage(step.src, step.dst, step.note, numbered[step.sig], step.k)
            if kind is TNotify:
                return Notify(numbered[step.sig], step.k, step.note)
            if isinstance(step, TWait):
                sig, k = self.recorded[step.ref.key]
                if sig.owner != rank:
                    raise AssertionError(f"r{rank} waits on {sig}, owned by r{sig.owner}")
                if step.ref.previous:
                    k -= self.counts[sig] * self.stage_copies
                return Wait(numbered[sig], k, step.note)
            raise AssertionError(f"not a builder step: {step!r}")

        programs = tuple(
            Program(rank, 0, tuple([step if type(step) in _IR else step_for(rank, step) for step in self.steps[rank]]))
            for rank in range(self.world)
        )
        decls = tuple(
            SignalDecl(numbered[sig], self.counts[sig], sig.role, signal_note(sig))
            for owner in sorted(per_owner)
            for sig in per_owner[owner]
        )
        return Schedule(
            collective=spec.name,
            world_size=self.world,
            operation=spec.operation,
            options=options,
            slices=options.channels * self.slices,
            in_units=tuple(len(layout) for layout in spec.inputs),
            out_units=tuple(len(layout) for layout in spec.outputs),
            stage_units=max(self.units, default=0),
            signals=decls,
            programs=programs,
            channel_signals=width,
            stage_copies=self.stage_copies,
        )


_IR = frozenset({Stage, Consume})  # builder steps that are IR already (they name no signal)


def signal_note(sig: Sig) -> str:
    if sig.role is Role.DATA:
        return f"data from r{sig.peer}"
    return f"ack from r{sig.peer}"


def from_peer(sig: Sig) -> str:
    return f"from r{sig.peer}"


_TEXTS: dict[int, tuple[Chunk, str]] = {}  # id(chunk) -> (chunk, its text)


def chunk_text(chunk: Chunk) -> str:
    """``str(chunk)``, once per chunk: notes name chunks on every step of big schedules.

    Cached by object identity (a Chunk's hash is Python code, and this runs per step); the
    entry holds the chunk itself, so its id cannot be reused by another object meanwhile."""
    entry = _TEXTS.get(id(chunk))
    if entry is not None and entry[0] is chunk:
        return entry[1]
    if len(_TEXTS) >= 1 << 16:
        _TEXTS.clear()
    text = str(chunk)
    _TEXTS[id(chunk)] = (chunk, text)
    return text


def chunk_names(chunks, texts: dict[int, str] | None = None) -> str:
    """The chunks' distinct names, in order (the first three and a count if many).
    ``texts``: id(chunk) -> its text, for every chunk here, if the caller has them."""
    chunks = chunks if isinstance(chunks, (list, tuple)) else list(chunks)
    # Distinct objects first (by id, all in C: a Chunk's hash is Python code), then distinct
    # texts in order of first appearance; edges of big schedules list the same chunk objects.
    unique = dict(zip(map(id, chunks), chunks))
    if texts is not None:
        chunks = list(dict.fromkeys(map(texts.__getitem__, unique)))
    else:
        chunks = list(dict.fromkeys(map(chunk_text, unique.values())))
    return ", ".join(chunks) if len(chunks) <= 4 else ", ".join(chunks[:3]) + f", ... ({len(chunks)} chunks)"


@lru_cache(maxsize=1 << 19)
def region(space: Space, rank: int, unit: int, s: int) -> Region:
    """One Region object per place (cached): big schedules name each region several times.
    Sized for R=72 (an all-reduce by direct-push names 380k places; the cache holds at most
    about 80 MB): the verifier numbers regions by object identity first, so sharing objects
    also speeds up the proof."""
    return Region(space, rank, unit, s)


# --------------------------------------------------------------------------------------
# Shared by the lowerings: one-shot messages, consumes into OUT


class Msg(NamedTuple):
    """A chunk moved from ``src`` (on its producer) to ``dst`` (unit on the consumer).

    A named tuple, not a frozen dataclass: direct-push makes one per (slot, consumer),
    R^2 (R-1) of them for an all-reduce, and tuples are built in C."""

    chunk: Chunk
    producer: int
    consumer: int
    src: tuple[Space, int]  # space, unit on the producer
    dst: tuple[Space, int]  # space, unit on the consumer (push) or where the consumer reads (pull)


def consume_into(b: Builder, rank: int, need: Need, positions, srcs, s: int, src_rank=None) -> None:
    """One Consume into the first position, then copies to the others (bitwise the same)."""
    if src_rank is None:
        regions = tuple([region(space, rank, unit, s) for space, unit in srcs])
    else:
        regions = tuple([region(space, src_rank[i], unit, s) for i, (space, unit) in enumerate(srcs)])
    first = region(OUT, rank, positions[0], s)
    b.consume(rank, regions, first, need.chunk, positions[0])
    for position in positions[1:]:
        b.consume(rank, (first,), region(OUT, rank, position, s), need.chunk, position)
