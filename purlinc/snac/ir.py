"""The SNAC schedule IR: per rank and channel, an ordered list of Stage / Notify / Wait / Consume.

Plain frozen data, independent of any GPU mechanism: the Atom layer turns it into code,
the verifier proves it correct, the simulator runs it on NumPy buffers.

Memory model of the IR
----------------------
Every rank owns three buffers, all measured in *units* of one chunk (``count`` elements
of the call's dtype, ``count`` known only at call time):

- ``IN``    the caller's input  (``Schedule.in_units[rank]`` units)
- ``OUT``   the caller's output (``Schedule.out_units[rank]`` units)
- ``STAGE`` a symmetric staging buffer, reachable by every peer (``stage_units`` units, or
            two copies of them: see "Staging copies" below)

A unit is cut into ``Schedule.slices`` equal slices (the last may be shorter, some may be
empty for tiny counts).  ``Region(space, rank, unit, slice)`` names one slice of one unit of
one rank's buffer: the smallest piece of memory the IR talks about.  Slices
``[c * S, (c + 1) * S)`` belong to channel ``c`` (``S = options.slices``).

Channels are symbolic
---------------------
Channels are independent copies of one another: channel ``c`` runs the same steps as
channel 0 on its own slices and its own signals.  So ``Schedule.programs`` holds one
``Program`` per rank, written for channel 0: its regions are *channel-relative* (slice in
``[0, S)``) and so are its signals (index in ``[0, W)``, ``W = Schedule.channel_signals``,
the same for every rank).  Channel ``c`` adds ``c * S`` to every slice and ``c * W`` to every
signal index: the signal pad of a rank holds ``channels * W`` signals, channel ``c``'s at
``[c * W, (c + 1) * W)``.  ``Schedule.program(rank, c)`` and ``Schedule.signal_decls()``
give that concrete picture; the kernels compute it from ``blockIdx.x``.

Reading or writing another rank's ``IN`` or ``OUT`` is allowed only when the schedule was
lowered for registered buffers (``LowerOptions.registered``); ``STAGE`` is always reachable.

Signals and epochs
------------------
A signal is a 64-bit counter in its owner's signal pad; only its owner waits on it, any
rank may notify it.  Within one call each signal is notified exactly ``per_call`` times.
``Notify(signal, k)`` stores ``epoch * per_call + k`` (release, system scope);
``Wait(signal, k)`` blocks until the value is ``>= epoch * per_call + k`` (acquire).
``epoch`` is the call number (0, 1, 2, ...), kept on the device, so repeated calls and
CUDA-graph replays need no reset.  ``k`` may be <= 0 in a Wait: it then waits for a notify
of an *earlier* call (flow control across calls: "the consumer finished with this slot").

Packed stages (LL)
------------------
A ``Stage`` with a ``signal`` is a Stage and a ``Notify(signal, k)`` in one: the datapath
writes a flag word into every 16-byte packet it stages (NCCL's LL protocol), so the
consumer sees "data there" per packet and no fence or separate flag store is needed.
Its semantics are exactly those of the Stage followed by the Notify
(``purlinc.snac.packing.normalized`` rewrites it so; the verifier and the simulator run
on that).  A packed message occupies two consecutive STAGE units (packets carry 8 data
bytes each, so they are twice the data): ``Region(STAGE, r, u, s)`` of a packed stage
addresses unit ``u``, and unit ``u + 1`` is reserved for the second half of its packets.
The consumer's ``Wait`` on the signal stays a Wait, and the ``Consume`` steps right after
it that read the packed regions unpack them (see ``purlinc.snac.packing``).

Staging copies (epoch parity)
-----------------------------
With ``Schedule.stage_copies = 2`` every rank's STAGE holds two copies of the
``stage_units`` units the programs address, and call (round) ``e`` uses copy ``e % 2``:
``Region(STAGE, r, u, s)`` in call ``e`` is unit ``u + (e % 2) * stage_units``.  A producer
then writes call ``e + 1`` into the other copy while its consumer may still read call ``e``,
so "the consumer is done with my last call's data" (an ACK) is needed only two calls later:
its Wait reaches back two calls (``k > -2 * per_call``), and it is normally satisfied long
before the producer gets there -- no round trip on the critical path.  Where the consumer
sends the producer data of its own every call, even that ACK is implied (the consumer's
next call starts after it finished reading) and the lowering leaves it out; the verifier
proves either case (``purlinc.snac.parity``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum

from purlinc.frontend.ast import Operation
from purlinc.frontend.spec import Sizes
from purlinc.frontend.epilogue import Epilogue as SpecEpilogue


class Space(Enum):
    IN = "in"
    OUT = "out"
    STAGE = "stage"

    # Members are singletons: identity hashing is correct, and C-level (Enum's own __hash__ is
    # Python code, run for every Region hashed; verifying a big schedule hashes millions).
    __hash__ = object.__hash__


@dataclass(frozen=True, slots=True)
class Region:
    space: Space
    rank: int
    unit: int
    slice: int

    def format(self) -> str:
        return f"r{self.rank}.{self.space.value}[{self.unit}].s{self.slice}"

    def sort_key(self) -> tuple:
        return (self.space.value, self.rank, self.unit, self.slice)


@dataclass(frozen=True, slots=True, order=True)
class Signal:
    owner: int  # the rank whose pad holds it, and the only rank that waits on it
    index: int  # position in the owner's pad

    def format(self) -> str:
        return f"r{self.owner}.sig[{self.index}]"


class Role(Enum):
    """Why a signal exists (documentation in dumps; the semantics are all the same)."""

    DATA = "data"  # producer -> consumer: "the staged data is there"
    ACK = "ack"  # consumer -> producer: "I have consumed it; the slot is free again"

    __hash__ = object.__hash__  # as Space: C-level, for the builder's signal keys


@dataclass(frozen=True, slots=True)
class SignalDecl:
    signal: Signal
    per_call: int  # notifies of this signal in one call; epochs advance by this much
    role: Role
    note: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class Stage:
    """Move one slice to where its consumer can reach it (often a remote write)."""

    src: Region
    dst: Region
    note: str = field(default="", compare=False)  # e.g. "x[3] for r1"
    # Packed (LL): the stage also notifies ``signal`` with ``k``, through a flag in every
    # 16-byte packet it writes.  None: a plain stage (its notify, if any, is a separate step).
    signal: Signal | None = None
    k: int = 0

    @property
    def packed(self) -> bool:
        return self.signal is not None


@dataclass(frozen=True, slots=True)
class Notify:
    signal: Signal
    k: int
    note: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class Wait:
    signal: Signal
    k: int
    note: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class Consume:
    """``dst = srcs[0]`` (copy) or ``dst = srcs[0] (+) srcs[1] (+) ...`` in that order (reduce).

    ``dst`` may also appear among ``srcs`` (accumulate in place).  Reductions accumulate in
    float32 and round once per Consume.
    """

    operation: Operation
    srcs: tuple[Region, ...]
    dst: Region
    note: str = field(default="", compare=False)
    line: int | None = field(default=None, compare=False)  # .pln line of the output chunk


@dataclass(frozen=True, slots=True)
class Epilogue:
    """Apply the schedule's epilogue (``Schedule.epilogue``) to the whole rows of ``region``,
    an OUT slice of this rank, in place: placed after the last step of the program that
    touches the region, so it sees the final reduced data (``purlinc.snac.epilogue``)."""

    region: Region
    note: str = field(default="", compare=False)
    line: int | None = field(default=None, compare=False)  # .pln line of the epilogue


Step = Stage | Notify | Wait | Consume | Epilogue


@dataclass(frozen=True, slots=True)
class Program:
    """What one channel (one thread block, or one copy-engine stream) of one rank runs, in order.

    In ``Schedule.programs``: channel 0, channel-relative; ``Schedule.program(rank, c)`` shifts
    it to channel ``c``."""

    rank: int
    channel: int
    steps: tuple[Step, ...]


PACKET_FLAG_PERIOD = 2**32 - 1  # 32-bit flags with 0 left out


def packet_flag(value: int) -> int:
    """The 32-bit flag an LL packet carries for ``value`` = e * stride + base + k
    (``purlin_ll_flag``, ``ll.cuh.j2``): never 0, because staging starts zeroed and a slot no
    call has written must never pass for a packet, however many calls a process makes (a plain
    32-bit cast gives 0 once every 2^32 values)."""
    return value % PACKET_FLAG_PERIOD + 1


def shift_region(region: Region, base: int) -> Region:
    """``region`` of channel 0 moved to the channel whose slices start at ``base``."""
    return Region(region.space, region.rank, region.unit, base + region.slice) if base else region


def shift_signal(signal: Signal, base: int) -> Signal:
    return Signal(signal.owner, base + signal.index) if base else signal


def shift_step(step: Step, slice_base: int, signal_base: int) -> Step:
    """A channel-relative step as channel ``c`` runs it (bases ``c * S`` and ``c * W``)."""
    if isinstance(step, Stage):
        signal = None if step.signal is None else shift_signal(step.signal, signal_base)
        return Stage(shift_region(step.src, slice_base), shift_region(step.dst, slice_base), step.note, signal, step.k)
    if isinstance(step, Consume):
        srcs = tuple(shift_region(r, slice_base) for r in step.srcs)
        return Consume(step.operation, srcs, shift_region(step.dst, slice_base), step.note, step.line)
    if isinstance(step, Epilogue):
        return Epilogue(shift_region(step.region, slice_base), step.note, step.line)
    return type(step)(shift_signal(step.signal, signal_base), step.k, step.note)


class Algorithm(Enum):
    DIRECT_PUSH = "direct-push"  # one-shot: producers write into consumers' memory
    DIRECT_PULL = "direct-pull"  # one-shot: consumers read producers' memory
    TWO_SHOT = "two-shot"  # reduce-scatter to an owner, then all-gather from it
    RING = "ring"  # neighbour to neighbour, around the ranks


@dataclass(frozen=True, slots=True)
class LowerOptions:
    """Every orchestration choice, named.  ``key()`` is stable and feeds the compile cache."""

    algorithm: Algorithm = Algorithm.DIRECT_PUSH
    channels: int = 1
    slices: int = 1  # slices per chunk *per channel* (pipelining depth)
    # Staging slots per (producer, consumer, channel) edge; None = one slot per message, so
    # slots are only reused across calls.  With a number, a slot is reused within a call
    # after its consumer acknowledged it.
    slots: int | None = None
    # Which of the caller's buffers are registered (peer-reachable): frozenset of "in"/"out".
    registered: frozenset[str] = frozenset()
    # LL packing: data notifies ride inside the staged data (a flag in every 16-byte packet),
    # saving a system fence and a flag hop per call; for small messages (direct-push only).
    packed: bool = False
    # STAGE copies by epoch parity (see "Staging copies" above), direct-push only: 2 takes the
    # consumer's ACK off the producer's critical path.  Packed schedules always use 2.  The
    # pipeline picks 2 for atoms that can (kernels compute the copy from the epoch) and 1 for
    # host-driven ones (the copy engines' addresses are fixed when a call is issued).
    stage_copies: int = 1

    def __post_init__(self):
        for name in ("channels", "slices", "slots"):  # a NumPy integer held as an int: JSON and keys take ints
            value = getattr(self, name)
            if hasattr(value, "__index__") and not isinstance(value, (int, bool)):
                object.__setattr__(self, name, int(value.__index__()))
        if isinstance(self.stage_copies, bool) or self.stage_copies not in (1, 2) \
                or not isinstance(self.stage_copies, int):  # True and 2.0 compared equal to 1 and 2
            from purlinc.errors import PurlinError

            raise PurlinError(f"stage_copies={self.stage_copies!r}: staging has 1 or 2 copies")

    def key(self) -> str:
        reg = ",".join(sorted(self.registered)) or "-"
        slots = "all" if self.slots is None else str(self.slots)
        ll = "/ll" if self.packed else ""  # absent when off: keys (and caches) of plain schedules unchanged
        x2 = "/x2" if self.stage_copies == 2 and not self.packed else ""  # packed: always two
        return f"{self.algorithm.value}/c{self.channels}/s{self.slices}/slots{slots}/reg{reg}{ll}{x2}"


# The way out of a schedule too large for one lowering or one proof, as the errors say it: the
# Python API's and the command line's spellings (compile makes flat collectives only).
HIERARCHICAL_NOTE = ("lower it over nodes, a hierarchical plan of smaller phases: purlinc.load(path, None, "
                     "gpus_per_node=G) under torchrun; purlinc dump, check and draw take --gpus-per-node G")


# What ``LowerOptions.key()`` writes, read back (a trace carries slots and registered buffers in
# its key alone): kept beside the writer, so that one cannot change without the other.
KEY_PATTERN = re.compile(r"[a-z-]+/c\d+/s\d+/slots(?P<slots>all|\d+)/reg(?P<registered>-|[a-z,]+)(?:/ll)?(?:/x2)?")


@dataclass(frozen=True, slots=True)
class Schedule:
    collective: str
    world_size: int
    operation: Operation
    options: LowerOptions
    slices: int  # total slices per unit = channels * options.slices
    in_units: tuple[int, ...]  # per rank
    out_units: tuple[int, ...]  # per rank
    stage_units: int  # the same on every rank (symmetric)
    signals: tuple[SignalDecl, ...]  # one channel's signals, channel-relative (index < channel_signals)
    programs: tuple[Program, ...]  # one per rank, in rank order: channel 0, channel-relative
    channel_signals: int  # W: signals per channel in every rank's pad (channel c's start at c * W)
    # STAGE copies chosen by the call's epoch parity (see "Staging copies" above): 1 or 2.
    stage_copies: int = 1
    # Run-time sizes (docs/SNAC.md, "Run-time sizes"): IN/OUT units are packed by per-call
    # sizes and a STAGE unit is a slot of a size header plus ``capacity`` elements.  None: every
    # unit is the call's count.
    sizes: Sizes | None = None
    # The spec's epilogue, applied by the programs' Epilogue steps; None: the schedule has none.
    epilogue: SpecEpilogue | None = None

    @property
    def channels(self) -> int:
        return self.options.channels

    @property
    def staging_units(self) -> int:
        """STAGE units every rank allocates: ``stage_units`` per copy, times the copies."""
        return self.stage_units * self.stage_copies

    def program(self, rank: int, channel: int) -> Program:
        """The concrete program of ``channel`` of ``rank``: slices + channel * S, signals + channel * W."""
        program = self.programs[rank]
        if channel == 0:
            return program
        slice_base, signal_base = channel * self.options.slices, channel * self.channel_signals
        return Program(program.rank, channel, tuple(shift_step(s, slice_base, signal_base) for s in program.steps))

    def concrete_programs(self) -> tuple[Program, ...]:
        """Every (rank, channel) program, concrete, ordered by (rank, channel)."""
        return tuple(self.program(rank, channel) for rank in range(self.world_size) for channel in range(self.channels))

    def signal_decls(self) -> tuple[SignalDecl, ...]:
        """Every concrete signal of every channel, ordered by (owner, channel, index)."""
        W = self.channel_signals
        decls = []
        for owner in sorted({d.signal.owner for d in self.signals}):
            mine = sorted((d for d in self.signals if d.signal.owner == owner), key=lambda d: d.signal.index)
            for channel in range(self.channels):
                suffix = f", channel {channel}" if self.channels > 1 else ""
                decls += [
                    SignalDecl(shift_signal(d.signal, channel * W), d.per_call, d.role, d.note + suffix)
                    for d in mine
                ]
        return tuple(decls)

    def signal_pad_size(self) -> int:
        """Signals per rank (the pad is symmetric: every rank allocates channels * W)."""
        return self.channels * self.channel_signals

    def per_call(self) -> dict[Signal, int]:
        """Channel-relative signal -> notifies per call (the same for every channel)."""
        return {d.signal: d.per_call for d in self.signals}

    def packet_flags(self) -> dict[Signal, tuple[int, int]]:
        """Channel-relative signal -> (stride, base): notify k of a round with epoch e carries the
        packet flag ``packet_flag(e * stride + base + k)`` (LL, ``ll.cuh.j2``).  stride counts
        every signal's notifies per round and base those of the signals before it, so each
        round's values lie above every earlier round's, whichever signal wrote them.  A slot's
        place in staging depends on the call's count, so a packet an earlier call left where
        this call expects another signal's packet must never carry the flag this call expects
        there (with e * per_call + k it could: e=0, k=3 of a signal notified 4 times a round
        equals e=1, k=1 of one notified twice)."""
        stride = sum(d.per_call for d in self.signals)
        flags, base = {}, 0
        for d in self.signals:
            flags[d.signal] = (stride, base)
            base += d.per_call
        return flags
