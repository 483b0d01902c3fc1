"""The SNAC verifier: proves, for a schedule as written, that it is correct for every count.

``verify(schedule, spec)`` returns nothing or raises ``VerificationError`` naming the first
violation (in a fixed order: well-formedness, deadlock, signal monotonicity, races, result).

How the proof works
-------------------
0. *Channels*.  Programs are channel-relative (``purlinc.snac.ir``): one per rank, its
   slices in ``[0, S)`` and its signal indices in ``[0, W)``; channel ``c`` runs it shifted
   by ``c * S`` and ``c * W``.  Checking exactly that (every relative slice < S, every
   signal index < W, declarations included) proves that channels touch disjoint slices of
   every buffer (staging included) and disjoint signal words: they share no region and no
   signal, so each is a copy of channel 0 that cannot see the others.  The only thing they
   share is the call boundary (a rank's next call starts when all its channels finished),
   which orders call-0 steps before call-1 steps and adds no wait within a call: so a
   deadlock, a race or a wrong result in the C-channel schedule would be one in channel 0
   alone.  Steps 1-4 prove channel 0 (the schedule viewed with one channel); the simulator
   still runs every channel concretely.
1. *Well-formedness*, step by step: regions in bounds and in the channel's slices, remote
   ``IN``/``OUT`` only when registered, nothing writes an ``IN`` buffer, a step never moves
   one slice into another, waits only on the waiting rank's own signals, every signal
   declared and notified exactly ``per_call`` times per call with ``k`` = 1..per_call.
2. *Happens-before* over two back-to-back calls.  Nodes are the steps of call 0 and call 1
   of every program, plus one *caller* node per rank standing between its calls: the
   caller's next use of the buffers (it reads its output and may overwrite its input and
   output) and the next launch, which starts only after every channel of that rank finished
   the call.  Edges: program order; caller edges; and for ``Wait(s, k)`` in call ``e`` an
   edge from the notify that stores ``e * per_call + k`` (none when that is <= 0: the pad
   starts at zero).  The graph is built by running it (Kahn's algorithm, programs advanced in
   a fixed round-robin order), which yields a topological order and vector clocks (one entry
   per program and caller), so "a happens before b" is one array lookup.  A program left
   blocked means a cycle, reported with its ranks and steps.  Later calls repeat call 1's
   pattern (waits reach back at most one call, which step 1 enforces), so two calls cover
   every call.
   A notify *stores* its value, so a wait for value v is satisfied exactly by the notify of
   value v only if the signal's notifies are totally ordered by happens-before in increasing
   value (within a call and across the call boundary); otherwise the value could go
   backwards and a waiter miss it.  That is checked too.
   With two staging copies (``Schedule.stage_copies``; call ``e`` stages in copy ``e % 2``)
   a copy is reused two calls later and a producer's ACK wait reaches back two calls: the
   proof then runs on ``purlinc.snac.parity.unrolled``, whose call is two original calls
   (the odd one in the second copy), so its two calls cover four and every reuse.
3. *Races*: per region (one slice of one unit), accesses sorted in the topological order;
   each access must be ordered after the previous write, and each write after the reads
   since the previous write.  That makes every conflicting pair ordered (by transitivity),
   which covers "a staging slot overwritten before it is consumed", across calls and against
   the callers.
4. *Result*: symbolic execution of call 0 in the topological order.  Because every
   conflicting pair of accesses is ordered (3), every topological order gives every read
   the same write, so one order suffices.  A region holds a multiset of input slots (a copy
   is a multiset of one) or garbage; every output slice must hold exactly what the spec names.
   Steps 3 and 4 share one walk of the topological order (each region's accesses come up in
   that order, so no per-region sort is needed); a result error is reported only when no
   race was found, keeping the order of checks above.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from dataclasses import replace
from operator import attrgetter
from typing import NamedTuple

import numpy as np

from purlinc.errors import PurlinError
from purlinc.frontend.ast import Operation
from purlinc.frontend.spec import Slot, Spec
from purlinc.snac.gcpause import gc_paused
from purlinc.snac.epilogue import epilogue_problem
from purlinc.snac.ir import Consume, Epilogue, Notify, Region, Schedule, Space, Stage, Step, Wait
from purlinc.snac.packing import layout_problems, ll_groups, normalized, packed_stages
from purlinc.snac.parity import unrolled

CALLS = 2  # calls unrolled by the proof (see the module docstring for why two suffice)


class VerificationError(PurlinError):
    """A schedule that is not provably correct.  ``rank``/``channel``/``step``/``call`` locate
    the offending step (``None`` where the violation is not about one step)."""

    def __init__(
        self,
        message: str,
        span=None,
        notes=(),
        *,
        rank: int | None = None,
        channel: int | None = None,
        step: int | None = None,
        call: int | None = None,
    ):
        super().__init__(message, span, notes)
        self.rank = rank
        self.channel = channel
        self.step = step
        self.call = call

    def with_note(self, note: str) -> "VerificationError":
        return VerificationError(
            self.message, self.span, (*self.notes, note),
            rank=self.rank, channel=self.channel, step=self.step, call=self.call,
        )


def describe(step: Step) -> str:
    """One step as short text, e.g. ``consume r2.stage[1].s0 -> r2.out[1].s0``."""
    if isinstance(step, Stage):
        if step.packed:
            return f"stage+notify {step.src.format()} -> {step.dst.format()}, {step.signal.format()} k={step.k} (LL)"
        return f"stage {step.src.format()} -> {step.dst.format()}"
    if isinstance(step, Notify):
        return f"notify {step.signal.format()} k={step.k}"
    if isinstance(step, Wait):
        return f"wait {step.signal.format()} k={step.k}"
    if isinstance(step, Epilogue):
        return f"epilogue {step.region.format()}"
    if step.operation is Operation.REDUCE:
        return f"reduce {' + '.join(r.format() for r in step.srcs)} -> {step.dst.format()}"
    return f"consume {' + '.join(r.format() for r in step.srcs)} -> {step.dst.format()}"


def _kind(step: Step) -> str:
    return describe(step).split(" ", 1)[0]


def _reads(step: Step) -> tuple[Region, ...]:
    kind = type(step)
    if kind is Stage:
        return (step.src,)
    if kind is Consume:
        return step.srcs
    return ()


def _writes(step: Step) -> tuple[Region, ...]:
    kind = type(step)
    if kind is Stage or kind is Consume:
        return (step.dst,)
    return ()


class _Failure:
    """Builds located errors for one schedule.

    The proof runs on the normalized schedule (packed stages split into Stage + Notify, see
    ``purlinc.snac.packing``); ``origins`` maps its step indices back to the schedule as
    written, so errors name the steps the user sees."""

    def __init__(self, schedule: Schedule, origins: dict | None = None, unroll: int = 1):
        self.schedule = schedule  # as normalized, before any unrolling (purlinc.snac.parity)
        self.origins = origins
        self.unroll = unroll  # original calls per proof call: steps past n are the next call's

    def split(self, rank: int, channel: int, index: int, call: int) -> tuple[int, int]:
        """(normalized step index, original call) of step ``index`` of proof call ``call``."""
        if self.unroll == 1:
            return index, call
        n = len(self.schedule.programs[rank].steps)
        return index % n, call * self.unroll + index // n

    def index(self, rank: int, channel: int, index: int | None) -> int | None:
        """The step index as written, of normalized (proof) step ``index``."""
        if index is None:
            return index
        index = self.split(rank, channel, index, 0)[0]
        if self.origins is None:
            return index
        return self.origins[rank, channel][index]

    def at(self, rank: int, channel: int, index: int, message: str, call: int = 0) -> VerificationError:
        normal, call = self.split(rank, channel, index, call)
        step = self.schedule.program(rank, channel).steps[normal]
        when = f" in call {call}" if call else ""
        written = self.index(rank, channel, index)
        text = f"rank {rank}, channel {channel}, step {written}{when} ({describe(step)}): {message}"
        return VerificationError(text, rank=rank, channel=channel, step=written, call=call)

    def short(self, rank: int, channel: int, index: int, call: int = 0) -> str:
        call = self.split(rank, channel, index, call)[1]
        when = f" in call {call}" if call else ""
        return f"rank {rank} channel {channel} step {self.index(rank, channel, index)}{when}"


# --------------------------------------------------------------------------- 1. well-formed


def _check_shape(schedule: Schedule, spec: Spec) -> None:
    world = spec.world_size
    problems = []
    if schedule.world_size != world:
        problems.append(f"it is for R={schedule.world_size}, the spec for R={world}")
    if schedule.operation is not spec.operation:
        problems.append(f"its operation is {schedule.operation.value}, the spec's {spec.operation.value}")
    if tuple(schedule.in_units) != tuple(len(x) for x in spec.inputs):
        problems.append(f"in_units {list(schedule.in_units)} differ from the spec's input layouts")
    if tuple(schedule.out_units) != tuple(len(x) for x in spec.outputs):
        problems.append(f"out_units {list(schedule.out_units)} differ from the spec's output layouts")
    if schedule.channels < 1 or schedule.options.slices < 1:
        problems.append("it needs at least one channel and one slice per channel")
    elif schedule.slices != schedule.channels * schedule.options.slices:
        problems.append(
            f"slices = {schedule.slices}, but channels x slices per channel = "
            f"{schedule.channels} x {schedule.options.slices}"
        )
    found = [(p.rank, p.channel) for p in schedule.programs]
    if found != [(r, 0) for r in range(world)]:
        problems.append("its programs are not one per rank (channel-relative, channel 0), in rank order")
    if schedule.channel_signals < 0:
        problems.append(f"channel_signals = {schedule.channel_signals} (must be >= 0)")
    if problems:
        raise VerificationError(f"schedule {schedule.collective} does not fit its spec: " + "; ".join(problems))


def _check_signals_declared(schedule: Schedule) -> None:
    seen = set()
    for decl in schedule.signals:
        if decl.signal in seen:
            raise VerificationError(f"signal {decl.signal.format()} is declared twice")
        seen.add(decl.signal)
        if not 0 <= decl.signal.owner < schedule.world_size or decl.signal.index < 0:
            raise VerificationError(f"signal {decl.signal.format()} names no rank's pad")
        if decl.signal.index >= schedule.channel_signals:
            raise VerificationError(
                f"signal {decl.signal.format()} lies outside its channel's signals 0..{schedule.channel_signals - 1} "
                f"(channel_signals = {schedule.channel_signals}): channel 1 would share it"
            )
        if decl.per_call < 1:
            raise VerificationError(f"signal {decl.signal.format()} has per_call = {decl.per_call} (must be >= 1)")


def _region_problem(schedule: Schedule, region: Region, rank: int, channel: int, writes: bool) -> str | None:
    problem = _region_fault(schedule, region, rank, channel, writes)
    return None if problem is None else problem.replace("@", region.format())


def _region_fault(schedule: Schedule, region: Region, rank: int, channel: int, writes: bool) -> str | None:
    """What is wrong with ``region`` (``@`` stands for its name, formatted only on failure)."""
    if not 0 <= region.rank < schedule.world_size:
        return f"@ names no rank (R={schedule.world_size})"
    space = region.space
    units = schedule.stage_units
    if space is Space.IN:
        units = schedule.in_units[region.rank]
    elif space is Space.OUT:
        units = schedule.out_units[region.rank]
    if not 0 <= region.unit < units:
        return f"@ is out of bounds: rank {region.rank}'s {space.value} has {units} units"
    per_channel = schedule.options.slices
    if not 0 <= region.slice < per_channel:
        return (f"@ lies outside the channel's slices 0..{per_channel - 1} (programs are channel-relative: "
                "channel c adds c * slices, so another channel would own it)")
    if writes and space is Space.IN:
        return "writes @, the caller's input"
    if region.rank != rank and space is not Space.STAGE and space.value not in schedule.options.registered:
        return f"touches @, another rank's {space.value} buffer, which is not registered"
    return None


def _step_problem(schedule: Schedule, step: Step, rank: int, channel: int, per_call: dict) -> str | None:
    if isinstance(step, Stage) and step.packed:
        if step.signal not in per_call:
            return f"{step.signal.format()} is not declared"
        if not 1 <= step.k <= per_call[step.signal]:
            return f"k={step.k} is outside 1..{per_call[step.signal]} (per_call of {step.signal.format()})"
    if isinstance(step, (Notify, Wait)):
        if step.signal not in per_call:
            return f"{step.signal.format()} is not declared"
        total = per_call[step.signal]
        if isinstance(step, Notify):
            if not 1 <= step.k <= total:
                return f"k={step.k} is outside 1..{total} (per_call of {step.signal.format()})"
            return None
        if step.signal.owner != rank:
            return f"waits on {step.signal.format()}, which rank {step.signal.owner} owns (only the owner may wait)"
        if step.k > total:
            return f"k={step.k} exceeds per_call = {total} of {step.signal.format()}"
        copies = schedule.stage_copies  # a slot is reused that many calls later
        if step.k <= -total * copies:
            back = "one call" if copies == 1 else f"{copies} calls (its stage copies)"
            return f"k={step.k} reaches back more than {back} (per_call = {total})"
        return None
    if isinstance(step, Consume):
        if not step.srcs:
            return "consumes nothing"
        if step.operation is Operation.COPY and len(step.srcs) != 1:
            return f"a copy needs exactly one source, not {len(step.srcs)}"
        if step.operation is Operation.REDUCE and schedule.operation is Operation.COPY:
            return "reduces in a copy collective"
    for region in (*_reads(step), *_writes(step)):
        problem = _region_problem(schedule, region, rank, channel, writes=region in _writes(step))
        if problem is not None:
            return problem
    slices = {r.slice for r in (*_reads(step), *_writes(step))}
    if len(slices) > 1:
        return f"mixes slices {sorted(slices)} (data only moves within one slice)"
    return None


def _check_steps(schedule: Schedule, fail: _Failure) -> None:
    per_call = schedule.per_call()
    known: dict[int, int] = {}  # id(Signal) -> per_call, for declared signals (see _Order)
    for program in schedule.programs:
        rank, channel = program.rank, program.channel
        for index, step in enumerate(program.steps):
            kind = type(step)
            if kind is Notify or kind is Wait:  # as quickly: the checks of _step_problem
                signal = step.signal
                total = known.get(id(signal))
                if total is None and signal in per_call:
                    total = known[id(signal)] = per_call[signal]
                if total is not None:
                    k = step.k
                    if (1 <= k <= total) if kind is Notify else (signal.owner == rank and -total < k <= total):
                        continue
            if type(step) is Stage and step.signal is None:  # the common case, quickly
                src, dst = step.src, step.dst
                if (src.slice == dst.slice and _region_fault(schedule, src, rank, channel, False) is None
                        and _region_fault(schedule, dst, rank, channel, True) is None):
                    continue
            elif type(step) is Consume and _consume_ok(schedule, step, rank, channel):
                continue
            problem = _step_problem(schedule, step, rank, channel, per_call)
            if problem is not None:
                raise fail.at(rank, channel, index, problem)


def _consume_ok(schedule: Schedule, step: Consume, rank: int, channel: int) -> bool:
    """``_step_problem`` of a Consume finds nothing (True), or may find something (False:
    then ``_step_problem`` names it).  The same checks, without building messages: reduces
    have hundreds of sources at R=72."""
    srcs, dst = step.srcs, step.dst
    if not srcs:
        return False
    if step.operation is Operation.COPY:
        if len(srcs) != 1:
            return False
    elif step.operation is not Operation.REDUCE or schedule.operation is Operation.COPY:
        return False
    if _region_fault(schedule, dst, rank, channel, True) is not None:
        return False
    s = dst.slice
    for region in srcs:  # a source that is the destination passed as a write just above
        if region.slice != s or _region_fault(schedule, region, rank, channel, False) is not None:
            return False
    return True


def _notify_sites(schedule: Schedule) -> dict:
    """signal -> k -> [(program index, step index)] within one call."""
    sites: dict = defaultdict(lambda: defaultdict(list))
    by_object: dict = {}  # id(Signal) -> its entry of sites (a Signal's hash is Python code)
    for p, program in enumerate(schedule.programs):
        for index, step in enumerate(program.steps):
            if type(step) is Notify or isinstance(step, Notify):
                entry = by_object.get(id(step.signal))
                if entry is None:
                    entry = by_object[id(step.signal)] = sites[step.signal]
                entry[step.k].append((p, index))
    return sites


def _check_signal_counts(schedule: Schedule, fail: _Failure) -> None:
    sites = _notify_sites(schedule)
    channels = schedule.channels
    for decl in schedule.signals:
        by_k = sites.get(decl.signal, {})
        for k in sorted(by_k):
            if len(by_k[k]) > 1:
                p, index = sorted(by_k[k])[1]
                raise fail.at(
                    p // channels, p % channels, index,
                    f"{decl.signal.format()} is notified with k={k} more than once per call",
                )
        missing = [k for k in range(1, decl.per_call + 1) if k not in by_k]
        if missing:
            raise VerificationError(
                f"{decl.signal.format()} is notified {len(by_k)} times per call, but declared "
                f"per_call = {decl.per_call} (no notify with k={', '.join(map(str, missing))})",
                rank=decl.signal.owner,
            )


# --------------------------------------------------------------------------- 2. happens-before


class _Node(NamedTuple):
    """A step of the unrolled graph: chain ``p`` (a program, or ``programs + rank`` for a
    caller) at position ``pos`` (call * len(steps) + step; always 0 for a caller).

    A named tuple, not a frozen dataclass: the proof makes a few per step of every program
    and call, and tuples are built, hashed and compared in C (the proof of a schedule with
    half a million steps spent a third of its time on dataclass nodes)."""

    p: int
    pos: int


# Hot paths build nodes as plain (p, pos) tuples (equal to, and hashed like, _Node), and
# every reader indexes them: node[0] is p, node[1] is pos.


class _Order:
    """Happens-before over two calls, as vector clocks and a topological order."""

    def __init__(self, schedule: Schedule, fail: _Failure):
        self.schedule = schedule
        self.fail = fail
        self.programs = schedule.programs
        self.np = len(self.programs)
        self.channels = schedule.channels
        self.world = schedule.world_size
        self.n = [len(p.steps) for p in self.programs]
        self.per_call = schedule.per_call()
        width = self.np + self.world
        # snap[p][pos]: vector clock of that node, excluding its own chain's entry (its pos).
        self.snap: list[list] = [[None] * (CALLS * n) for n in self.n] + [[None] for _ in range(self.world)]
        self.sequence: list[_Node] = []  # the topological order itself
        self.notify_at: dict = {}  # (signal number, value) -> _Node; see notify_of
        # Per program and step: None, or (is a wait, signal number, per_call, k).  Signals are
        # numbered here so that the proof hashes int pairs, not Signal dataclasses (whose hash
        # is Python code): by object identity first (lowerings share one Signal object per
        # signal; the schedule keeps them alive), by value on a miss.
        self.events: list[list] = []
        self.numbers: dict = {}  # Signal -> its number
        by_object: dict = {}  # id(Signal) -> (number, per_call)
        for p, program in enumerate(self.programs):
            count = self.n[p]
            events = [None] * count
            for index, step in enumerate(program.steps):
                kind = type(step)
                if kind is Stage or kind is Consume:
                    continue
                wait = isinstance(step, Wait)
                if wait or isinstance(step, Notify):
                    signal = step.signal
                    known = by_object.get(id(signal))
                    if known is None:
                        known = (self.numbers.setdefault(signal, len(self.numbers)), self.per_call[signal])
                        by_object[id(signal)] = known
                    number, per_call = known
                    events[index] = (wait, number, per_call, step.k)
                    if not wait:
                        for call in range(CALLS):
                            self.notify_at[(number, call * per_call + step.k)] = (p, call * count + index)
            self.events.append(events)
        self._run(width)

    # ---- queries

    def notify_of(self, signal, value: int) -> _Node:
        """The notify that stores ``value`` into ``signal`` (KeyError: none does)."""
        return self.notify_at[(self.numbers[signal], value)]

    def is_caller(self, node: _Node) -> bool:
        return node[0] >= self.np

    def call_of(self, node: _Node) -> int:
        return 1 if self.is_caller(node) else node[1] // max(1, self.n[node[0]])

    def before(self, a: _Node, b: _Node) -> bool:
        """a happens before b (strictly)."""
        if a[0] == b[0]:
            return a[1] < b[1]
        return int(self.snap[b[0]][b[1]][a[0]]) >= a[1]

    def where(self, node: _Node) -> tuple[int, int, int, int]:
        """(rank, channel, step, call) of a program node."""
        n = self.n[node[0]]
        return (node[0] // self.channels, node[0] % self.channels, node[1] % n, node[1] // n)

    def step(self, node: _Node) -> Step:
        return self.programs[node[0]].steps[node[1] % self.n[node[0]]]

    def key(self, node: _Node) -> tuple:
        """Deterministic order of reported locations: call, rank, channel, step."""
        if self.is_caller(node):
            return (1, node[0] - self.np, -1, -1)
        rank, channel, index, call = self.where(node)
        return (call, rank, channel, index)

    def short(self, node: _Node) -> str:
        rank, channel, index, call = self.where(node)
        return self.fail.short(rank, channel, index, call)

    def error(self, node: _Node, message: str) -> VerificationError:
        rank, channel, index, call = self.where(node)
        return self.fail.at(rank, channel, index, message, call)

    # ---- construction

    def _run(self, width: int) -> None:
        np_, n, channels = self.np, self.n, self.channels
        clock = [np.full(width, -1, dtype=np.int64) for _ in range(np_)]
        pos = [0] * np_
        arrived = [False] * np_
        passed = [False] * np_
        arrivals = [0] * self.world
        caller_clock: list = [None] * self.world
        notified: dict = {}
        blocked: dict = defaultdict(list)  # (signal, value) -> programs waiting for it
        at_boundary: dict = defaultdict(list)  # rank -> programs waiting for its caller
        ready = deque(range(np_))
        append = self.sequence.append

        def record(node: _Node, vc) -> None:
            self.snap[node[0]][node[1]] = vc
            self.sequence.append(node)

        def arrive(p: int) -> None:
            arrived[p] = True
            rank = p // channels
            arrivals[rank] += 1
            if arrivals[rank] < channels:
                return
            vc = np.full(width, -1, dtype=np.int64)
            for q in range(rank * channels, (rank + 1) * channels):
                vc = np.maximum(vc, clock[q])
                vc[q] = max(int(vc[q]), n[q] - 1)
            record(_Node(np_ + rank, 0), vc)
            vc = vc.copy()
            vc[np_ + rank] = 0
            caller_clock[rank] = vc
            second_call.extend(at_boundary.pop(rank, []))

        # Call 0 first, entirely (it never waits on call 1), then call 1: reports then read
        # "x is not ordered before y" with x and y in the same call wherever possible.
        second_call: list[int] = []
        while ready or second_call:
            if not ready:
                ready.extend(sorted(second_call))
                second_call.clear()
            p = ready.popleft()
            rank = p // channels
            # Program p's position and clock live in locals while it runs (written back below).
            events, count, snap_p = self.events[p], n[p], self.snap[p]
            end = CALLS * count
            position, vc = pos[p], clock[p]
            while True:
                if position == count and not passed[p]:
                    clock[p] = vc  # arrive() reads it
                    if not arrived[p]:
                        arrive(p)
                        if caller_clock[rank] is not None:
                            second_call.append(p)
                            break
                    if caller_clock[rank] is None:
                        at_boundary[rank].append(p)
                        break
                    vc = np.maximum(vc, caller_clock[rank])
                    passed[p] = True
                if position == end:
                    break
                event = events[position - count if position >= count else position]
                if event is None:  # a stage or consume: ordered by program order alone
                    snap_p[position] = vc
                    append((p, position))
                    position += 1
                    continue
                wait, signal, per_call, k = event
                value = (position // count) * per_call + k
                if wait:
                    if value > 0:
                        source = notified.get((signal, value))
                        if source is None:
                            blocked[(signal, value)].append(p)
                            break
                        # A notify's clock is (its program's clock, its program, its position).
                        vc = np.maximum(vc, source[0])
                        if vc[source[1]] < source[2]:
                            vc[source[1]] = source[2]  # vc is fresh from np.maximum: no snap shares it
                    snap_p[position] = vc
                    append((p, position))
                else:
                    snap_p[position] = vc
                    append((p, position))
                    notified[(signal, value)] = (vc, p, position)  # no copy: vc is never changed in place
                    waiting = blocked.pop((signal, value), None)
                    if waiting:
                        ready.extend(waiting)
                position += 1
            pos[p], clock[p] = position, vc

        stuck = [p for p in range(np_) if pos[p] < CALLS * n[p] or not passed[p]]
        if stuck:
            raise self._deadlock(stuck, pos, arrived)

    def _deadlock(self, stuck: list[int], pos: list[int], arrived: list[bool]) -> VerificationError:
        """Follow 'waits for' from a stuck program until a program repeats: that is the cycle."""
        channels = self.channels

        def waits_for(p: int) -> tuple[int, str]:
            if pos[p] == self.n[p]:  # at the call boundary: waits for the rest of its rank
                rank = p // channels
                q = next(q for q in range(rank * channels, (rank + 1) * channels) if not arrived[q])
                return q, f"waits at the end of call 0 for rank {rank} channel {q % channels} to finish it"
            step = self.step(_Node(p, pos[p]))
            call = pos[p] // self.n[p]
            value = call * self.per_call[step.signal] + step.k
            source = self.notify_of(step.signal, value)
            return source[0], f"waits for {self.short(source)} ({describe(self.step(source))})"

        seen: dict[int, int] = {}
        path: list[int] = []
        p = min(stuck)
        while p not in seen:
            seen[p] = len(path)
            path.append(p)
            p = waits_for(p)[0]
        cycle = path[seen[p]:]

        def label(q: int) -> str:
            if pos[q] == self.n[q]:
                return f"rank {q // channels} channel {q % channels} (end of call 0)"
            node = _Node(q, pos[q])
            return f"{self.short(node)} ({describe(self.step(node))})"

        def sort_key(q: int) -> tuple:
            return (pos[q] // max(1, self.n[q]), q // channels, q % channels, pos[q] % max(1, self.n[q]))

        first = min(range(len(cycle)), key=lambda i: sort_key(cycle[i]))
        cycle = cycle[first:] + cycle[:first]
        links = [waits_for(cycle[0])[1]]
        links += [f"{label(q)} {waits_for(q)[1]}" for q in cycle[1:]]
        message = "deadlock: " + ", which is behind ".join(links) + " (a cycle of waits)"
        head = cycle[0]
        if pos[head] == self.n[head]:
            rank, channel = head // channels, head % channels
            return VerificationError(
                f"rank {rank}, channel {channel}, end of call 0: {message}", rank=rank, channel=channel, call=0
            )
        return self.error(_Node(head, pos[head]), message)


def _check_monotone(schedule: Schedule, order: _Order) -> None:
    """A notify stores its value: the signal's notifies must happen in increasing value."""
    for decl in schedule.signals:
        per_call = decl.per_call
        number = order.numbers[decl.signal]  # every declared signal is notified (checked before)
        for value in range(1, CALLS * per_call):
            earlier = order.notify_at[(number, value)]
            later = order.notify_at[(number, value + 1)]
            if not order.before(earlier, later):
                raise order.error(
                    later,
                    f"is not ordered after {order.short(earlier)} ({describe(order.step(earlier))}), "
                    f"which stores the value before it ({value}); {decl.signal.format()} could go "
                    "backwards and a waiter miss its value",
                )


# --------------------------------------------------------------------------- 3. races, 4. result


def _race_message(order: _Order, region: Region, later: _Node, earlier: _Node, later_writes: bool, earlier_writes: bool):
    """(key, error) for an unordered conflicting pair, located at a program step."""
    text = region.format()
    if order.is_caller(later) or order.is_caller(earlier):
        caller, other = (later, earlier) if order.is_caller(later) else (earlier, later)
        owner = caller[0] - order.np
        verb = "writes" if (later_writes if other == later else earlier_writes) else "reads"
        if order.call_of(other) == 0:  # may still run after the owner finished call 0
            message = (
                f"{verb} {text}, which rank {owner}'s caller owns again once rank {owner} finishes "
                "the call; it is not ordered before that by any notify/wait"
            )
        else:
            message = (
                f"{verb} {text} without being ordered after rank {owner} finishing the previous call "
                f"by any notify/wait (its caller may still be using its {region.space.value} buffer)"
            )
        return order.key(other), order.error(other, message)
    kind = _kind(order.step(earlier))
    where = f"{kind} at {order.short(earlier)}"
    if not later_writes:
        message = f"reads {text}, whose {where} is not ordered before it by any notify/wait"
    elif not earlier_writes:
        message = (
            f"overwrites {text}, which the {where} reads, without being ordered after that read "
            "by any notify/wait (the slot is reused too early)"
        )
    else:
        message = f"writes {text}, also written by the {where}, and no notify/wait orders the two"
    return order.key(later), order.error(later, message)


_slot_key = attrgetter("rank", "position")  # Slot's own order, compared in C


def _format_value(value: tuple[Slot, ...] | None) -> str:
    if value is None:
        return "garbage"
    return " + ".join(map(str, value))


def _access_table(programs) -> tuple[list, list, dict]:
    """Per program and step, its accesses over interned regions: (reads, write, sources),
    where ``reads`` are region ids read and not written by the step (each once), ``write``
    is the id of the region written (-1: none) and ``sources`` the ids of its sources in
    order (what the symbolic execution reads).  Regions are numbered once here, so the walk
    below indexes lists instead of hashing a Region per access and call."""
    ids: dict[Region, int] = {}
    regions: list[Region] = []
    # Lowerings share one Region object per place (``builder._reg``): look objects up by
    # identity first (an int hashed in C; a Region's hash is Python code), by value on a miss,
    # so equal regions that are distinct objects still get one number.  The schedule keeps
    # every object alive, so no id is reused while this table lives.
    by_object: dict[int, int] = {}
    table = []

    def number(region: Region) -> int:
        r = ids.get(region)
        if r is None:
            r = ids[region] = len(regions)
            regions.append(region)
        by_object[id(region)] = r
        return r

    none = ((), -1, None)
    known = by_object.get
    for program in programs:
        rows = []
        append = rows.append
        for step in program.steps:
            kind = type(step)
            if kind is Stage:  # the common step, quickly: one source, one destination
                w = known(id(step.dst))
                if w is None:
                    w = number(step.dst)
                r = known(id(step.src))
                if r is None:
                    r = number(step.src)
                append(((r,) if r != w else (), w, (r,)))
                continue
            if kind is not Consume:
                append(none)
                continue
            w = known(id(step.dst))
            if w is None:
                w = number(step.dst)
            order = []
            for region in step.srcs:
                r = known(id(region))
                if r is None:
                    r = number(region)
                order.append(r)
            if len(order) == 1:
                reads = () if order[0] == w else (order[0],)
            else:  # each region once; a read-modify-write counts as a write
                reads = tuple(r for r in dict.fromkeys(order) if r != w)
            append((reads, w, order))
        table.append(rows)
    return table, regions, ids


def _check_races_and_result(schedule: Schedule, spec: Spec, order: _Order) -> None:
    """Steps 3 and 4 in one walk of the topological order.

    Races: per region, accesses in the topological order; each access must be ordered after
    the previous write, and each write after the reads since the previous write.  The
    caller of each rank, between its calls, writes every IN and OUT region of its rank that
    some program touches.  Result: the same walk, over call 0's program steps, runs the
    symbolic execution; its errors are raised only if there is no race (races first)."""
    programs = order.programs
    table, regions, ids = _access_table(programs)
    nreg = len(regions)
    np_, n, snap = order.np, order.n, order.snap
    world = order.world
    last_write: list = [None] * nreg
    reads_since: list = [None] * nreg  # None: no read since the last write
    # Regions in a caller's care, per rank: its IN and OUT regions that some program touches
    # (the table numbers every region any step touches, in either call).
    mine = [[] for _ in range(world)]
    for i, region in enumerate(regions):
        if region.space is not Space.STAGE:
            mine[region.rank].append(i)
    found = []

    # Result state (call 0): region id -> multiset of slots (a sorted tuple) or None (garbage).
    values: list = [None] * nreg
    writer: list = [None] * nreg  # last call-0 writer
    for i, region in enumerate(regions):
        if region.space is Space.IN:
            values[i] = (Slot(region.rank, region.unit),)
    failure = None

    def race(i, later, earlier, later_writes, earlier_writes):
        found.append(_race_message(order, regions[i], later, earlier, later_writes, earlier_writes))

    def written(i, node):
        """Region ``i`` written by ``node``: ordered after the last write and the reads since."""
        p, pos = node
        vc = snap[p][pos]
        lw = last_write[i]
        if lw is not None and not (lw[1] < pos if lw[0] == p else vc[lw[0]] >= lw[1]):
            race(i, node, lw, True, True)
        rs = reads_since[i]
        if rs is not None:
            for read in rs:
                if not (read[1] < pos if read[0] == p else vc[read[0]] >= read[1]):
                    race(i, node, read, True, False)
            reads_since[i] = None
        last_write[i] = node

    for node in order.sequence:
        p, pos = node
        if p >= np_:  # a caller: rewrites its rank's IN and OUT
            for i in mine[p - np_]:
                written(i, node)
            continue
        count = n[p]
        index = pos - count if pos >= count else pos
        reads, w, sources = table[p][index]
        if w < 0:
            continue
        # Races, inlined: this runs for every access of every step in both calls.
        vc = snap[p][pos]
        for i in reads:
            lw = last_write[i]
            if lw is not None and not (lw[1] < pos if lw[0] == p else vc[lw[0]] >= lw[1]):
                race(i, node, lw, False, True)
            rs = reads_since[i]
            if rs is None:
                reads_since[i] = [node]
            else:
                rs.append(node)
        lw = last_write[w]  # written(w, node), inlined
        if lw is not None and not (lw[1] < pos if lw[0] == p else vc[lw[0]] >= lw[1]):
            race(w, node, lw, True, True)
        rs = reads_since[w]
        if rs is not None:
            for read in rs:
                if not (read[1] < pos if read[0] == p else vc[read[0]] >= read[1]):
                    race(w, node, read, True, False)
            reads_since[w] = None
        last_write[w] = node
        if pos >= count or failure is not None:
            continue
        # Result: call 0, symbolically.
        if len(sources) == 1:
            src = sources[0]
            result = values[src]
            if result is None:
                failure = _garbage_read(order, node, regions[src], writer[src])
                continue
        else:
            got = [values[i] for i in sources]
            bad = next((k for k, value in enumerate(got) if value is None), None)
            if bad is not None:
                failure = _garbage_read(order, node, regions[sources[bad]], writer[sources[bad]])
                continue
            # Several sources: a reduce (step 1 rejects a copy of more than one).  A single
            # source is a copy, or a reduce of one value, which is already sorted.
            result = tuple(sorted((slot for value in got for slot in value), key=_slot_key))
        values[w] = result
        writer[w] = node
    if found:
        raise min(found, key=lambda item: (item[0], item[1].message))[1]
    if failure is not None:
        raise failure

    per_channel = schedule.options.slices
    for rank in range(spec.world_size):
        for unit, sources in enumerate(spec.sources[rank]):
            for s in range(schedule.slices):
                region = Region(Space.OUT, rank, unit, s)
                i = ids.get(region)
                problem = _output_problem(spec, None if i is None else values[i], sources)
                if problem is None:
                    continue
                chunk = spec.outputs[rank][unit]
                line = spec.output_line(rank, unit)
                named = f"{chunk}" + (f", line {line}" if line is not None else "")
                last = None if i is None else writer[i]
                text = f"rank {rank} out[{unit}] ({named}) slice {s} {problem}"
                if last is not None:
                    text += f" (last written by {order.short(last)}: {describe(order.step(last))})"
                _, channel, index, _ = order.where(last) if last is not None else (rank, s // per_channel, None, 0)
                call = 0 if index is None else order.fail.split(rank, channel, index, 0)[1]
                raise VerificationError(text, rank=rank, channel=channel, step=order.fail.index(rank, channel, index), call=call)


def _garbage_read(order: _Order, node, region: Region, writer) -> VerificationError:
    why = "nothing writes it before" if writer is None else "it holds garbage"
    return order.error(node, f"reads {region.format()}, which holds no data in call 0 ({why})")


def _output_problem(spec: Spec, value, sources: tuple[Slot, ...]) -> str | None:
    if value is None:
        return "is never written (holds garbage)"
    if not spec.is_reduce:
        if len(value) == 1 and value[0] in sources:
            return None
        want = " or ".join(map(str, sources))
        return f"holds {_format_value(value)}, expected a copy of {want}"
    if value == tuple(sorted(sources, key=_slot_key)):  # values of reductions are kept sorted
        return None
    got, want = Counter(value), Counter(sources)
    if got == want:
        return None
    details = []
    for slot in sorted(got):
        if slot not in want:
            details.append(f"{slot} is not part of it")
        elif got[slot] > want[slot]:
            details.append(f"{slot} is counted {got[slot]} times")
    missing = sorted(slot for slot in want if got[slot] < want[slot])
    if missing:
        details.append("missing " + ", ".join(map(str, missing)))
    return f"holds {_format_value(value)}: " + "; ".join(details)


# --------------------------------------------------------------------------- entry point


def _check_packing(schedule: Schedule) -> None:
    """Packed stages fit the staging layout, and their packets are read as the datapath
    reads them: by the consumes right after the waits that guard exactly them."""
    fail = _Failure(schedule)
    problems = layout_problems(schedule)
    if problems:
        rank, channel, index, message = problems[0]
        raise fail.at(rank, channel, index, message)
    packed = packed_stages(schedule)
    if not packed:
        return
    for program in schedule.programs:
        _, found = ll_groups(program, packed)
        if found:
            index, message = min(found)
            raise fail.at(program.rank, program.channel, index, message)


def _one_channel(schedule: Schedule) -> Schedule:
    """The schedule as if it had one channel: what steps 1-4 prove (see the docstring)."""
    if schedule.channels == 1:
        return schedule
    options = replace(schedule.options, channels=1)
    return replace(schedule, options=options, slices=options.slices)


def verify(schedule: Schedule, spec: Spec) -> None:
    """Prove ``schedule`` computes ``spec`` for every count and interleaving, or raise
    ``VerificationError`` naming the first violation."""
    with gc_paused():  # millions of acyclic nodes: see purlinc.snac.gcpause
        _verify(schedule, spec)
    if spec.sizes is not None or schedule.sizes is not None:
        from purlinc.snac.sized import verify_sized  # the interval obligations (docs/SNAC.md)

        verify_sized(schedule, spec)


def _verify(schedule: Schedule, spec: Spec) -> None:
    _check_shape(schedule, spec)
    problem = epilogue_problem(schedule, spec)
    if problem is not None:
        rank, index, message = problem
        if index is None:
            raise VerificationError(f"rank {rank}: {message}", rank=rank)
        raise _Failure(schedule).at(rank, 0, index, message)
    _check_signals_declared(schedule)
    schedule = _one_channel(schedule)
    _check_steps(schedule, _Failure(schedule))
    _check_packing(schedule)
    # A packed stage means its Stage followed by its Notify: the proof runs on that schedule.
    schedule, origins = normalized(schedule)
    # Two staging copies: the proof runs on two calls per call, so that each copy's reuse is
    # inside the unrolled calls (purlinc.snac.parity); errors still name the steps as written.
    fail = _Failure(schedule, origins, schedule.stage_copies)
    schedule = unrolled(schedule)
    _check_signal_counts(schedule, fail)
    order = _Order(schedule, fail)
    _check_monotone(schedule, order)
    _check_races_and_result(schedule, spec, order)
