"""The ``ce`` Atom: a copy schedule run by the copy engines, driven from the host.  No SMs.

Stage and Consume-copy become ``cuMemcpyAsync`` (peer pointers go over NVLink), Notify a
``cuStreamWriteValue64`` into the owner's signal pad, Wait a ``cuStreamWaitValue64``.
Each channel runs on a stream of its own (never the legacy default stream), forked from and
joined back into the caller's stream with events, so a call is still one stream-ordered
operation on the caller's stream (and capturable in a graph).

Why not the kernels' epochs
---------------------------
The kernels compute every signal value from a call counter kept on the device.  Stream
memory operations take *immediate* values, fixed when the call is enqueued, and a CUDA
graph bakes them in: every replay would write and wait for the same numbers.  So values
here never change between calls; instead every signal is a one-word mailbox that is
emptied by its reader, and a writer may only fill it once it knows it is empty again.

The handshake (per IR signal ``s``, owned by rank O, notified by rank P)
-----------------------------------------------------------------------
- the *flag* ``s`` lives in O's pad: 1 = full (notified), 0 = empty;
- a *gate* ``g(s)`` lives in P's pad (after the IR's signals): 1 = free (O emptied the
  flag, P may notify again), 0 = in use.

    Notify(s):  P: wait g(s) >= 1;  g(s) := 0;  s := 1 (remote write, after a fence)
    Wait(s):    O: wait s >= 1;     s := 0;     g(s) := 1 (remote write, after a fence)

Each pair is a token passed back and forth, so no notify can land before the previous one
was consumed and then be wiped by its reset (the lost-update that constant values would
otherwise allow), whatever the interleaving of calls, rounds and graph replays.  The gate
only delays a notify until the reader has *seen* the previous one; data safety (a staging
slot rewritten only after it was read) stays the schedule's job, through its own ACK
signals, which go through the same handshake.

A wait with ``k <= 0`` waits for the notify of the previous call (flow control: "the slot
you wrote last call is free").  For the very first call there is none, so such signals
start *full* (flag 1, gate 0): exactly the state a previous notify would have left.  All
others start empty (flag 0, gate 1).  Every rank writes the initial values of its own pad
at load, before the load's closing exchange, so no peer's first notify can precede them.

What the handshake cannot run, rejected at load with a clear message: reductions (the
copy engines only move bytes), signals notified more than once per call (``per_call > 1``,
e.g. several slices per channel), a signal waited more than once per call or by more than
one program, and schedules that touch another rank's IN or OUT (registered buffers).

There is no timeout on a stream wait itself: the runtime's host-side watchdog
(``purlinc/runtime/watchdog.py``) bounds each call instead, releasing a stuck wait and
recording a timeout that the next call raises.

Layers: this module is the Atom layer, below the runtime, so it never imports
``purlinc.runtime``.  ``plan``/``expand`` are pure; ``CeRunner`` issues the driver calls
through the driver module the runtime hands it (``purlinc.runtime.driver``, or any object
with the same functions: a recorder in the CPU tests), and reports each call to the
watchdog the runtime hands it (``watchdog``: anything with ``track`` and ``unregister``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from purlinc.errors import PurlinError
from purlinc.frontend.ast import Operation
from purlinc.snac.ir import Consume, Notify, Region, Schedule, Signal, Space, Stage, Wait
from purlinc.snac.simulate import slice_bounds

# One primitive operation, resolved at plan time except for the buffer addresses.
#   ("copy", dst: Region, src: Region)
#   ("wait", rank, word, value)    wait until pad[rank][word] >= value
#   ("write", rank, word, value)   pad[rank][word] := value
Op = tuple


class CeError(PurlinError):
    """The schedule cannot run on the copy engines."""


@dataclass(frozen=True, slots=True)
class CePlan:
    world_size: int
    channels: int
    slices: int
    signals: int  # IR signal words per pad
    pad_words: int  # signals + gates
    programs: tuple[tuple[tuple[Op, ...], ...], ...]  # [rank][channel] -> ops of one round
    init: tuple[tuple[tuple[int, int], ...], ...]  # [rank] -> (word, value) for its own pad


def _atoms_that(capability: str) -> str:
    from purlinc.atom.atoms import ATOMS

    return ", ".join(repr(a.name) for a in ATOMS.records() if getattr(a, capability))


def gate_word(signals: int, signal: Signal) -> int:
    """Where the gate of ``signal`` sits in its notifier's pad."""
    return signals + signal.owner * signals + signal.index


def plan(schedule: Schedule) -> CePlan:
    """Translate a copy schedule into copy-engine operations, or raise CeError saying why not."""
    _check_options(schedule)
    n = schedule.signal_pad_size()
    R = schedule.world_size
    concrete = schedule.concrete_programs()  # channel-relative programs, shifted per channel
    notifier, waiter = _signal_sites(schedule.collective, concrete)
    programs: list[list[tuple[Op, ...]]] = [[() for _ in range(schedule.channels)] for _ in range(R)]
    for program in concrete:
        programs[program.rank][program.channel] = _ops(program, n, notifier)
    init: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for signal, (p_rank, _) in notifier.items():
        previous_call = waiter.get(signal, (0, 0, 1))[2] == 0
        init[signal.owner].append((signal.index, 1 if previous_call else 0))
        init[p_rank].append((gate_word(n, signal), 0 if previous_call else 1))
    return CePlan(
        R, schedule.channels, schedule.slices, n, n * (1 + R),
        tuple(tuple(p) for p in programs),
        tuple(tuple(sorted(init[r])) for r in range(R)),
    )


def _check_options(schedule: Schedule) -> None:
    """What the copy engines cannot do whatever the steps: packets, epoch-dependent addresses,
    reductions, signals counted above one per call."""
    name = schedule.collective
    if schedule.options.packed:
        raise CeError(
            f"the ce atom cannot run packed (LL) schedules of {name}: stream memory operations signal "
            "separately from the copies",
            notes=(f"drop packed=True, or use one of the atoms {_atoms_that('packed')}",),
        )
    if schedule.stage_copies != 1:
        raise CeError(
            f"the ce atom cannot run {name} with {schedule.stage_copies} staging copies: the copy engines' "
            "addresses are fixed when a call is issued (a graph replays them), so they cannot follow the epoch",
            notes=("use stage_copies=1 (the default for the ce atom)",),
        )
    if schedule.operation is Operation.REDUCE:
        raise CeError(
            f"the ce atom cannot run {name}: it is a reduction, and the copy engines only move bytes",
            notes=(f"use one of the atoms {_atoms_that('reduces')} for reductions",),
        )
    many = sorted(d.signal.format() for d in schedule.signals if d.per_call != 1)
    if many:
        raise CeError(
            f"the ce atom cannot run this schedule of {name}: signal(s) {', '.join(many[:4])} are notified "
            f"more than once per call (per_call > 1), which constant-valued stream writes cannot count",
            notes=("use slices=1 per channel with this atom (more channels are fine)",),
        )


def _signal_sites(name: str, concrete) -> tuple[dict, dict]:
    """Each signal's one notifier (rank, channel) and one waiter (rank, channel, k); a CeError
    for a step the copy engines cannot run."""
    notifier: dict[Signal, tuple[int, int]] = {}
    waiter: dict[Signal, tuple[int, int, int]] = {}
    for program in concrete:
        where = (program.rank, program.channel)
        for step in program.steps:
            if isinstance(step, Notify):
                if step.signal in notifier:
                    raise CeError(f"the ce atom cannot run {name}: {step.signal.format()} has several notifiers")
                notifier[step.signal] = where
            elif isinstance(step, Wait):
                if step.signal in waiter:
                    raise CeError(
                        f"the ce atom cannot run {name}: {step.signal.format()} is waited on more than once per call"
                    )
                if step.k not in (0, 1):
                    raise CeError(f"the ce atom cannot run {name}: a wait on {step.signal.format()} with k={step.k}"
                                  " reaches back more than one call")
                waiter[step.signal] = (*where, step.k)
            elif isinstance(step, (Stage, Consume)):
                regions = (step.src, step.dst) if isinstance(step, Stage) else (*step.srcs, step.dst)
                for region in regions:
                    if region.space is not Space.STAGE and region.rank != program.rank:
                        raise CeError(
                            f"the ce atom cannot run {name}: rank {program.rank} touches {region.format()} "
                            "(another rank's registered buffer)"
                        )
                if isinstance(step, Consume) and step.operation is Operation.REDUCE:
                    raise CeError(f"the ce atom cannot run {name}: it has a reduce step")
    for signal in waiter:
        if signal not in notifier:
            raise CeError(f"the ce atom cannot run {name}: {signal.format()} is waited on but never notified")
    return notifier, waiter


def _ops(program, n: int, notifier: dict) -> tuple[Op, ...]:
    """One program's round as copy-engine operations: copies, and each signal as a gate
    (the notifier waits for its gate, clears it, sets the signal; the waiter waits for the
    signal, clears it, sets the gate)."""
    ops: list[Op] = []
    for step in program.steps:
        if isinstance(step, Stage):
            ops.append(("copy", step.dst, step.src))
        elif isinstance(step, Consume):
            if step.srcs[0] != step.dst:
                ops.append(("copy", step.dst, step.srcs[0]))
        elif isinstance(step, Notify):
            s, gate = step.signal, gate_word(n, step.signal)
            ops += [("wait", program.rank, gate, 1), ("write", program.rank, gate, 0), ("write", s.owner, s.index, 1)]
        elif isinstance(step, Wait):
            s = step.signal
            p_rank, _ = notifier[s]
            ops += [("wait", s.owner, s.index, 1), ("write", s.owner, s.index, 0),
                    ("write", p_rank, gate_word(n, s), 1)]
    return tuple(ops)


def init_image(plan_: CePlan, rank: int) -> bytes:
    """The initial contents of ``rank``'s pad (u64 words, little-endian)."""
    words = [0] * plan_.pad_words
    for word, value in plan_.init[rank]:
        words[word] = value
    return b"".join(w.to_bytes(8, "little") for w in words)


@dataclass(frozen=True, slots=True)
class Buffers:
    """Addresses a call resolves regions against (all as mapped on the running rank)."""

    in_ptr: int
    out_ptr: int
    stage: tuple[int, ...]  # per rank
    pads: tuple[int, ...]  # per rank
    count: int
    piece: int
    itemsize: int
    stage_unit: int  # bytes between staging units: the same for every call (abi.StagingPlacement)
    stage_step: int  # bytes between a staging unit's slices: the same for every call


def resolve(region: Region, buffers: Buffers, round_: int, lo: int) -> int:
    """The address of ``region`` at its slice's start, ``lo`` elements into the round's unit:
    a staging slice sits at its fixed step, an IN/OUT slice where its elements are."""
    b = buffers
    if region.space is Space.STAGE:
        return b.stage[region.rank] + region.unit * b.stage_unit + region.slice * b.stage_step
    base = b.in_ptr if region.space is Space.IN else b.out_ptr
    return base + (region.unit * b.count + round_ * b.piece + lo) * b.itemsize


def expand(plan_: CePlan, rank: int, channel: int, buffers: Buffers):
    """Every primitive of one channel of one call, in order, with concrete addresses:
    ("copy", dst, src, nbytes) | ("wait", addr, value) | ("write", addr, value)."""
    b = buffers
    n_rounds = 0 if b.count == 0 else -(-b.count // b.piece)
    for round_ in range(n_rounds):
        n = min(b.piece, b.count - round_ * b.piece)
        bounds = [slice_bounds(n, b.itemsize, plan_.slices, s) for s in range(plan_.slices)]
        for op in plan_.programs[rank][channel]:
            if op[0] == "copy":
                _, dst, src = op
                lo, hi = bounds[dst.slice]
                if hi > lo:
                    yield ("copy", resolve(dst, b, round_, lo), resolve(src, b, round_, lo), (hi - lo) * b.itemsize)
            else:
                kind, owner, word, value = op
                yield (kind, b.pads[owner] + 8 * word, value)


class CeRunner:
    """Issues one rank's plan on the caller's stream (and one forked stream per extra channel).

    ``driver``: the runtime's driver module (``purlinc.runtime.driver``), passed in so this
    layer does not import the one above it."""

    def __init__(self, plan_: CePlan, rank: int, device: int, driver):
        self.plan = plan_
        self.rank = rank
        self.device = device
        self._driver = driver
        driver.set_current(device)
        # Every channel gets its own non-blocking stream, forked from the caller's stream:
        # never the legacy default stream, whose implicit synchronisation with peer copies
        # (and with other devices' legacy streams in one process) deadlocks a stream wait.
        self.streams = [driver.stream_create() for _ in range(plan_.channels)]
        self.fork = driver.event_create()
        self.joins = [driver.event_create() for _ in range(plan_.channels)]
        # Set by the runtime (which registers id(self) with it): bounds every call's waits.
        self.watchdog = None

    def run(self, buffers: Buffers, stream: int) -> None:
        d = self._driver
        waits = []
        d.event_record(self.fork, stream)
        for channel, s in enumerate(self.streams):
            d.stream_wait_event(s, self.fork)
            for index, op in enumerate(expand(self.plan, self.rank, channel, buffers)):
                if op[0] == "copy":
                    d.memcpy_async(op[1], op[2], op[3], s)
                elif op[0] == "wait":
                    d.wait_value64(s, op[1], op[2])
                    waits.append((channel, index, op[1], op[2]))
                else:
                    d.write_value64(s, op[1], op[2])
        for s, join in zip(self.streams, self.joins):
            d.event_record(join, s)
            d.stream_wait_event(stream, join)
        if self.watchdog is not None:
            self.watchdog.track(id(self), stream, waits)

    def close(self) -> None:
        d = self._driver
        if self.watchdog is not None:
            self.watchdog.unregister(id(self))
            self.watchdog = None
        for s in self.streams:
            d.stream_destroy(s)
        for e in (self.fork, *self.joins):
            if e is not None:
                d.event_destroy(e)
        self.streams, self.joins, self.fork = [], [], None


Runner = CeRunner  # the name the runtime asks a host-driven atom's module for (atoms.Atom.host)
