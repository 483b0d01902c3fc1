"""2. Happens-before over two back-to-back calls (see the package docstring): the order is
built by running the programs, with vector clocks; a stuck program is a deadlock."""

from __future__ import annotations

from collections import defaultdict, deque
from typing import NamedTuple

import numpy as np

from purlinc.snac.ir import Consume, Notify, Schedule, Stage, Step, Wait
from purlinc.snac.verify.common import CALLS, Failure, VerificationError, describe


class Node(NamedTuple):
    """A step of the unrolled graph: chain ``p`` (a program, or ``programs + rank`` for a
    caller) at position ``pos`` (call * len(steps) + step; always 0 for a caller).

    A named tuple, not a frozen dataclass: the proof makes a few per step of every program
    and call, and tuples are built, hashed and compared in C (the proof of a schedule with
    half a million steps spent a third of its time on dataclass nodes)."""

    p: int
    pos: int


# Hot paths build nodes as plain (p, pos) tuples (equal to, and hashed like, Node), and
# every reader indexes them: node[0] is p, node[1] is pos.


class Order:
    """Happens-before over two calls, as vector clocks and a topological order."""

    def __init__(self, schedule: Schedule, fail: Failure):
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
        self.sequence: list[Node] = []  # the topological order itself
        self.notify_at: dict = {}  # (signal number, value) -> Node; see notify_of
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

    def notify_of(self, signal, value: int) -> Node:
        """The notify that stores ``value`` into ``signal`` (KeyError: none does)."""
        return self.notify_at[(self.numbers[signal], value)]

    def is_caller(self, node: Node) -> bool:
        return node[0] >= self.np

    def call_of(self, node: Node) -> int:
        return 1 if self.is_caller(node) else node[1] // max(1, self.n[node[0]])

    def before(self, a: Node, b: Node) -> bool:
        """a happens before b (strictly)."""
        if a[0] == b[0]:
            return a[1] < b[1]
        return int(self.snap[b[0]][b[1]][a[0]]) >= a[1]

    def where(self, node: Node) -> tuple[int, int, int, int]:
        """(rank, channel, step, call) of a program node."""
        n = self.n[node[0]]
        return (node[0] // self.channels, node[0] % self.channels, node[1] % n, node[1] // n)

    def step(self, node: Node) -> Step:
        return self.programs[node[0]].steps[node[1] % self.n[node[0]]]

    def key(self, node: Node) -> tuple:
        """Deterministic order of reported locations: call, rank, channel, step."""
        if self.is_caller(node):
            return (1, node[0] - self.np, -1, -1)
        rank, channel, index, call = self.where(node)
        return (call, rank, channel, index)

    def short(self, node: Node) -> str:
        rank, channel, index, call = self.where(node)
        return self.fail.short(rank, channel, index, call)

    def error(self, node: Node, message: str) -> VerificationError:
        rank, channel, index, call = self.where(node)
        return self.fail.at(rank, channel, index, message, call)

    # ---- construction

    def _run(self, width: int) -> None:
        kahn = _Kahn(self, width)
        kahn.run()
        stuck = [p for p in range(self.np) if kahn.pos[p] < CALLS * self.n[p] or not kahn.passed[p]]
        if stuck:
            raise self._deadlock(stuck, kahn.pos, kahn.arrived, kahn.passed)

    def _deadlock(self, stuck: list[int], pos: list[int], arrived: list[bool], passed: list[bool]) -> VerificationError:
        """Follow 'waits for' from a stuck program until a program repeats: that is the cycle."""
        channels = self.channels

        def at_boundary(p: int) -> bool:
            # Position n[p] is both "at the end of call 0" and, once its rank has passed the
            # boundary, "blocked on call 1's first step" (the boundary test alone raised
            # StopIteration there: every channel of the rank had arrived).
            return pos[p] == self.n[p] and not passed[p]

        def waits_for(p: int) -> tuple[int, str]:
            if at_boundary(p):  # waits for the rest of its rank
                rank = p // channels
                q = next(q for q in range(rank * channels, (rank + 1) * channels) if not arrived[q])
                return q, f"waits at the end of call 0 for rank {rank} channel {q % channels} to finish it"
            step = self.step(Node(p, pos[p]))
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
            if at_boundary(q):
                return f"rank {q // channels} channel {q % channels} (end of call 0)"
            node = Node(q, pos[q])
            return f"{self.short(node)} ({describe(self.step(node))})"

        def sort_key(q: int) -> tuple:
            return (pos[q] // max(1, self.n[q]), q // channels, q % channels, pos[q] % max(1, self.n[q]))

        first = min(range(len(cycle)), key=lambda i: sort_key(cycle[i]))
        cycle = cycle[first:] + cycle[:first]
        links = [waits_for(cycle[0])[1]]
        links += [f"{label(q)} {waits_for(q)[1]}" for q in cycle[1:]]
        message = "deadlock: " + ", which is behind ".join(links) + " (a cycle of waits)"
        head = cycle[0]
        if at_boundary(head):
            rank, channel = head // channels, head % channels
            return VerificationError(
                f"rank {rank}, channel {channel}, end of call 0: {message}", rank=rank, channel=channel, call=0
            )
        return self.error(Node(head, pos[head]), message)


def check_monotone(schedule: Schedule, order: Order) -> None:
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


class _Kahn:
    """Kahn's algorithm over the programs of an Order: each program runs until it waits for a
    notify not yet made (it resumes when that notify comes) or reaches the call boundary (it
    resumes once every channel of its rank has, through the caller node).  Fills the Order's
    ``snap`` (vector clocks) and ``sequence`` (the topological order)."""

    def __init__(self, order: Order, width: int):
        self.order, self.width = order, width
        np_, world = order.np, order.world
        self.clock = [np.full(width, -1, dtype=np.int64) for _ in range(np_)]
        self.pos = [0] * np_
        self.arrived = [False] * np_
        self.passed = [False] * np_
        self.arrivals = [0] * world
        self.caller_clock: list = [None] * world
        self.notified: dict = {}
        self.blocked: dict = defaultdict(list)  # (signal, value) -> programs waiting for it
        self.at_boundary: dict = defaultdict(list)  # rank -> programs waiting for its caller
        self.ready = deque(range(np_))
        self.second_call: list[int] = []

    def run(self) -> None:
        # Call 0 first, entirely (it never waits on call 1), then call 1: reports then read
        # "x is not ordered before y" with x and y in the same call wherever possible.
        ready, second_call = self.ready, self.second_call
        while ready or second_call:
            if not ready:
                ready.extend(sorted(second_call))
                second_call.clear()
            self.advance(ready.popleft())

    def arrive(self, p: int) -> None:
        """Program p finished call 0; the last channel of its rank to do so makes the caller node."""
        order, channels, width = self.order, self.order.channels, self.width
        self.arrived[p] = True
        rank = p // channels
        self.arrivals[rank] += 1
        if self.arrivals[rank] < channels:
            return
        vc = np.full(width, -1, dtype=np.int64)
        for q in range(rank * channels, (rank + 1) * channels):
            vc = np.maximum(vc, self.clock[q])
            vc[q] = max(int(vc[q]), order.n[q] - 1)
        order.snap[order.np + rank][0] = vc
        order.sequence.append(Node(order.np + rank, 0))
        vc = vc.copy()
        vc[order.np + rank] = 0
        self.caller_clock[rank] = vc
        self.second_call.extend(self.at_boundary.pop(rank, []))

    def advance(self, p: int) -> None:
        """Run program p as far as it can go now."""
        order = self.order
        rank = p // order.channels
        passed, caller_clock, notified, blocked = self.passed, self.caller_clock, self.notified, self.blocked
        append = order.sequence.append
        # Program p's position and clock live in locals while it runs (written back below).
        events, count, snap_p = order.events[p], order.n[p], order.snap[p]
        end = CALLS * count
        position, vc = self.pos[p], self.clock[p]
        while True:
            if position == count and not passed[p]:
                self.clock[p] = vc  # arrive() reads it
                if not self.arrived[p]:
                    self.arrive(p)
                    if caller_clock[rank] is not None:
                        self.second_call.append(p)
                        break
                if caller_clock[rank] is None:
                    self.at_boundary[rank].append(p)
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
                    self.ready.extend(waiting)
            position += 1
        self.pos[p], self.clock[p] = position, vc
