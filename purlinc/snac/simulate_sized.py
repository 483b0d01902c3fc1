"""The simulator for schedules with run-time sizes: the programs run on byte buffers, one
(rank, channel) at a time in a random interleaving, over several calls with different size
vectors, exactly as the kernels address memory (docs/SNAC.md, "Run-time sizes"):

- IN/OUT unit ``k`` at the prefix sum of the sizes before it (``evaluate.sent_sizes`` /
  ``received_sizes``: the same clamping rules as the device);
- STAGE unit ``u`` of copy ``e % 2`` a slot of a header (the size, once per channel: channel
  ``c`` writes and reads word ``c`` only) and one fixed region per channel
  (``purlinc.snac.sized.slot_layout``);
- channel ``c`` of ``G`` moving bytes ``[min(b, c*t), min(b, c*t + t))`` of a ``b``-byte
  chunk, ``t = round_up(ceil(b/G), 16)``, through its own region of the slot.

A Consume reads the size headers of every STAGE unit its offset needs at the moment it runs,
so a schedule that used a header before its Wait would read a stale or unwritten one
(headers start as -1 and change every call) and give a wrong answer, which the caller's
comparison with ``evaluate_sized`` catches.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from purlinc.frontend.evaluate import check_sized_call, received_sizes, sent_sizes
from purlinc.frontend.spec import Spec
from purlinc.snac.ir import Consume, Notify, Schedule, Space, Stage, Wait
from purlinc.snac.simulate import SimulationError
from purlinc.snac.sized import slot_layout


def channel_bytes(nbytes: int, channels: int, channel: int) -> tuple[int, int]:
    """Bytes [lo, hi) of an ``nbytes`` chunk that ``channel`` of ``channels`` moves."""
    per = -(-nbytes // channels) if nbytes else 0
    per = -(-per // 16) * 16
    lo = min(nbytes, channel * per)
    return lo, min(nbytes, lo + per)


class _Call:
    """One call's buffers and sizes (bytes), shared by every (rank, channel) of that call."""

    def __init__(self, spec: Spec, inputs, sizes, outputs, expected=None, *, capacity: int):
        inputs, sizes, outputs, expected = check_sized_call(spec, inputs, sizes, capacity, outputs, expected)
        self.capacity = capacity
        self.expected = expected  # per rank: the sizes its output is laid out by, or None
        self.inputs = [np.ascontiguousarray(x).view(np.uint8) for x in inputs]
        self.outputs = [np.array(o, copy=True) for o in outputs]
        self.out_bytes = [o.view(np.uint8) for o in self.outputs]
        self.itemsize = self.outputs[0].itemsize if self.outputs else 1
        self.sent = [sent_sizes(sizes[r], capacity, len(inputs[r])) for r in range(spec.world_size)]
        self.out_sizes = [[-1] * len(spec.outputs[r]) for r in range(spec.world_size)]


class _SizedMachine:
    def __init__(self, schedule: Schedule, capacity: int, itemsize: int):
        self.schedule = schedule
        self.itemsize = itemsize
        R = schedule.world_size
        self.head, self.region, self.slot_bytes = slot_layout(schedule.channels, capacity * itemsize)
        units = schedule.stage_units * schedule.stage_copies
        self.staging = [np.full(units * self.slot_bytes, 0xAB, dtype=np.uint8) for _ in range(R)]
        self.header = [np.full((units, schedule.channels), -1, dtype=np.int64) for _ in range(R)]
        self.signals: dict[tuple[int, int], int] = {}
        self.per_call = {d.signal: d.per_call for d in schedule.signal_decls()}

    def _unit(self, unit: int, epoch: int) -> int:
        return unit + (epoch % self.schedule.stage_copies) * self.schedule.stage_units

    def stage(self, call: _Call, step: Stage, rank: int, channel: int, epoch: int) -> None:
        offsets, sent, _ = call.sent[rank]
        k = step.src.unit
        unit = self._unit(step.dst.unit, epoch)
        self.header[step.dst.rank][unit, channel] = sent[k]
        lo, hi = channel_bytes(sent[k] * self.itemsize, self.schedule.channels, channel)
        start = offsets[k] * self.itemsize
        base = unit * self.slot_bytes + self.head + channel * self.region
        self.staging[step.dst.rank][base:base + hi - lo] = call.inputs[rank][start + lo:start + hi]

    def consume(self, call: _Call, step: Consume, rank: int, channel: int, epoch: int, program) -> None:
        src, m = step.srcs[0], step.dst.unit
        incoming = []
        for before in range(m + 1):  # the sizes the offset needs, read now (as the kernel does)
            region = program[before]
            if region.space is Space.IN:
                incoming.append(call.sent[rank][1][region.unit])
            else:
                incoming.append(int(self.header[rank][self._unit(region.unit, epoch), channel]))
        if min(incoming) < 0:
            raise SimulationError(f"rank {rank} channel {channel} reads a size header never written "
                                  f"(OUT unit {m}): the schedule uses a size before its Wait")
        expected = None if call.expected is None else call.expected[rank]
        offsets, written, _ = received_sizes(incoming, len(call.outputs[rank]), expected, call.capacity)
        size = written[m]
        if channel == 0:
            call.out_sizes[rank][m] = size
        lo, hi = channel_bytes(size * self.itemsize, self.schedule.channels, channel)
        dst = offsets[m] * self.itemsize
        if src.space is Space.IN:
            start = call.sent[rank][0][src.unit] * self.itemsize
            data = call.inputs[rank][start + lo:start + hi]
        else:
            base = self._unit(src.unit, epoch) * self.slot_bytes + self.head + channel * self.region
            data = self.staging[rank][base:base + hi - lo]
        call.out_bytes[rank][dst + lo:dst + hi] = data


def simulate_sized(schedule: Schedule, spec: Spec, calls: Sequence[tuple], capacity: int,
                   *, seed: int = 0) -> list[tuple[list[np.ndarray], list[list[int]]]]:
    """Run ``len(calls)`` consecutive calls; ``calls[i] = (inputs, sizes, outputs[, expected])``
    as ``evaluate_sized`` takes them.  Returns per call (outputs, out sizes); raises
    ``SimulationError`` on a deadlock or a size read before it was written."""
    if schedule.sizes is None:
        raise SimulationError(f"{schedule.collective} has no run-time sizes: use simulate()")
    rng = random.Random(seed)
    if not calls:
        return []
    states = [_Call(spec, *call, capacity=capacity) for call in calls]  # each call's arguments checked here
    sizes = {s.itemsize for s in states}
    if len(sizes) > 1:  # the machine's staging slots are laid out for one element size
        raise ValueError(f"calls of elements of {sorted(sizes)} bytes: one simulation runs calls of one element size")
    machine = _SizedMachine(schedule, capacity, states[0].itemsize)
    G = schedule.channels
    programs = {(r, c): schedule.program(r, c).steps for r in range(schedule.world_size) for c in range(G)}
    out_sources = {r: {s.dst.unit: s.srcs[0] for s in schedule.programs[r].steps if isinstance(s, Consume)}
                   for r in range(schedule.world_size)}
    # (call, step); a program without steps (a rank that neither sends nor receives) is done
    position = {key: (0 if steps else len(calls), 0) for key, steps in programs.items()}
    # Odd seeds: a random priority order, always running the first runnable program in it, so
    # some (rank, channel) lags as far behind the others as the signals allow (a uniform
    # choice rarely lets one channel fall a whole call behind its peers).
    priority = {key: rng.random() for key in programs} if seed % 2 else None
    while True:
        runnable = [key for key, (call, step) in position.items() if call < len(calls) and
                    _ready(machine, programs[key][step], call)]
        if not runnable:
            break
        key = min(runnable, key=priority.__getitem__) if priority else rng.choice(runnable)
        call, index = position[key]
        _run(machine, states[call], programs[key][index], key, call, out_sources[key[0]])
        index += 1
        position[key] = (call + 1, 0) if index == len(programs[key]) else (call, index)
    stuck = {k: p for k, p in position.items() if p[0] < len(calls)}
    if stuck:
        raise SimulationError(f"deadlock: (rank, channel) -> (call, step) stuck at {stuck}")
    return [(s.outputs, s.out_sizes) for s in states]


def _ready(machine: _SizedMachine, step, epoch: int) -> bool:
    if isinstance(step, Wait):
        target = epoch * machine.per_call[step.signal] + step.k
        return machine.signals.get((step.signal.owner, step.signal.index), 0) >= target
    return True


def _run(machine: _SizedMachine, call: _Call, step, key, epoch: int, sources) -> None:
    rank, channel = key
    if isinstance(step, Stage):
        machine.stage(call, step, rank, channel, epoch)
    elif isinstance(step, Consume):
        machine.consume(call, step, rank, channel, epoch, sources)
    elif isinstance(step, Notify):
        machine.signals[step.signal.owner, step.signal.index] = epoch * machine.per_call[step.signal] + step.k
