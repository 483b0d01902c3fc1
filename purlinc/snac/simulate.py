"""The SNAC simulator: runs a schedule on NumPy buffers, in random interleavings.

Every rank has its IN (the caller's input for that call), OUT (poisoned before each call),
STAGE (``stage_units`` units, poisoned once) and a signal pad of int64 counters, exactly as
the kernels see them.  The ranks' programs advance one step at a time, the next program
picked uniformly among those not blocked; a ``Wait`` blocks until the pad holds at least
``epoch * per_call + k``, a ``Notify`` *stores* ``epoch * per_call + k`` (as the kernels do:
a value going backwards shows up as a hang or a wrong result here too).

Channels run concretely: every (rank, channel) program of ``Schedule.program`` is a
program here, with its own slices and signals (``purlinc.snac.ir``).

A rank starts call ``c + 1`` only when all its channels finished call ``c`` (the kernel
boundary); its caller then reads OUT, puts the next input in IN and poisons OUT.  Other
ranks may still be in call ``c`` meanwhile, so schedules that race across calls fail here.

With ``piece`` (see ``purlinc.atom.abi``) a call runs in rounds of ``piece`` elements per
chunk, STAGE units are ``piece`` elements, and round ``i`` of call ``c`` has epoch
``c * rounds + i``.  Without it a call is one round of ``count`` elements.
"""

from __future__ import annotations

import random
from collections import defaultdict

import numpy as np

from purlinc.dtypes import DType, ReduceOp
from purlinc.errors import PurlinError
from purlinc.frontend.ast import Operation
from purlinc.frontend.evaluate import check_count, check_epilogue_dtype, check_rows_count, reduce_chunks, run_epilogue
from purlinc.frontend.spec import Spec
from purlinc.snac.ir import Consume, Epilogue, Notify, Region, Schedule, Space, Stage, Wait
from purlinc.snac.packing import normalized
from purlinc.snac.verify import describe

POISON_OUT = 0xA5  # byte pattern of OUT before each call
POISON_STAGE = 0x5A  # byte pattern of STAGE before the first call
SLICE_ALIGN = 16  # bytes; slices start on 16-byte boundaries (vector width of the kernels)


class SimulationError(PurlinError):
    """The schedule deadlocked (or was given unusable inputs) in the simulator."""


def slice_bounds(n_elems: int, itemsize: int, slices: int, s: int, align: int = SLICE_ALIGN) -> tuple[int, int]:
    """Elements ``[lo, hi)`` of slice ``s`` of a unit of ``n_elems`` elements cut into ``slices``.

    In bytes: L = n * itemsize, a slice is ceil(L / slices) rounded up to ``align`` bytes (16,
    or a row's bytes for schedules with an epilogue: ``slice_align``), so all slices but the
    last start aligned; trailing slices may be short or empty.  The CUDA side computes the
    same bounds.
    """
    total = n_elems * itemsize
    size = -(-total // slices)
    size = -(-size // align) * align
    lo = min(total, s * size)
    hi = min(total, lo + size)
    return lo // itemsize, hi // itemsize


def slice_align(schedule: Schedule, itemsize: int) -> int:
    """Bytes slices are aligned to: 16, or one row's bytes when the schedule has an epilogue
    (a slice then holds whole rows; a row is a whole number of 16-byte vectors)."""
    if schedule.epilogue is None:
        return SLICE_ALIGN
    row_bytes = schedule.epilogue.row * itemsize
    if row_bytes % SLICE_ALIGN:
        raise ValueError(f"a row of {schedule.epilogue.row} elements is {row_bytes} bytes, not a multiple of 16")
    return row_bytes


def round_slice_bounds(piece: int, n_round: int, itemsize: int, slices: int, s: int,
                       align: int = SLICE_ALIGN) -> tuple[int, int]:
    """Slice ``s`` of one round of ``n_round`` (<= ``piece``) elements.

    The bounds are those of a full round (``piece`` elements) clipped to this round: a
    slice then covers the same staging bytes in every round.  Channels advance through
    the rounds independently, so bounds recomputed from a shorter last round would let a
    channel's slice overlap another channel's slice of the previous round.
    """
    lo, hi = slice_bounds(piece, itemsize, slices, s, align)
    return min(lo, n_round), min(hi, n_round)


def _per_call_inputs(spec: Spec, inputs, calls: int, count: int, dtype: DType) -> list[list[np.ndarray]]:
    """One input set for every call, checked."""
    if len(inputs) and isinstance(inputs[0], np.ndarray):
        sets = [list(inputs)] * calls
    else:
        sets = [list(x) for x in inputs]
        if len(sets) != calls:
            raise ValueError(f"expected one input set per call ({calls}), got {len(sets)}")
    for inputs_ in sets:
        if len(inputs_) != spec.world_size:
            raise ValueError(f"expected {spec.world_size} input arrays (one per rank), got {len(inputs_)}")
        for rank, array in enumerate(inputs_):
            expected = len(spec.inputs[rank]) * count
            if array.dtype != dtype.storage or array.shape != (expected,):
                raise ValueError(
                    f"input of rank {rank}: expected a ({expected},) array of {dtype.storage}, "
                    f"got {array.shape} {array.dtype}"
                )
    return sets


class _Machine:
    """Buffers, pads and program cursors of one simulation."""

    def __init__(self, schedule: Schedule, count: int, dtype: DType, op: ReduceOp | None, piece: int | None,
                 operands=None):
        self.schedule = schedule
        self.align = slice_align(schedule, dtype.itemsize)
        self.operands = operands  # per rank: the epilogue's operands, updated in place
        self.count = count
        self.dtype = dtype
        self.op = op
        self.piece = count if piece is None else piece
        if piece is None:
            self.rounds = 1
        else:
            check_count("piece", piece, least=1)
            self.rounds = -(-count // piece)
        world = schedule.world_size
        storage = dtype.storage
        self.ins = [np.zeros(0, dtype=storage) for _ in range(world)]
        self.outs = [np.zeros(schedule.out_units[r] * count, dtype=storage) for r in range(world)]
        self.stages = [self._poisoned(schedule.staging_units * self.piece, POISON_STAGE) for _ in range(world)]
        self.pads = [np.zeros(schedule.signal_pad_size(), dtype=np.int64) for _ in range(world)]
        self.per_call = {d.signal: d.per_call for d in schedule.signal_decls()}
        self._bounds: dict[int, list[tuple[int, int]]] = {}

    def _poisoned(self, size: int, byte: int) -> np.ndarray:
        array = np.empty(size, dtype=self.dtype.storage)
        array.view(np.uint8)[:] = byte
        return array

    def start_call(self, rank: int, inputs: np.ndarray) -> None:
        self.ins[rank] = inputs.copy()
        self.outs[rank] = self._poisoned(self.schedule.out_units[rank] * self.count, POISON_OUT)

    def round_length(self, round_: int) -> int:
        return min(self.piece, self.count - round_ * self.piece)

    def view(self, region: Region, round_: int, epoch: int = 0) -> np.ndarray:
        n = self.round_length(round_)
        bounds = self._bounds.get(n)
        if bounds is None:
            bounds = [
                round_slice_bounds(self.piece, n, self.dtype.itemsize, self.schedule.slices, s, self.align)
                for s in range(self.schedule.slices)
            ]
            self._bounds[n] = bounds
        lo, hi = bounds[region.slice]
        if region.space is Space.STAGE:  # the copy of the epoch's parity (ir.py, "Staging copies")
            copy = epoch % self.schedule.stage_copies
            base = (region.unit + copy * self.schedule.stage_units) * self.piece
            return self.stages[region.rank][base + lo:base + hi]
        buffer = self.ins[region.rank] if region.space is Space.IN else self.outs[region.rank]
        base = region.unit * self.count + round_ * self.piece
        return buffer[base + lo:base + hi]

    def target(self, step: Notify | Wait, epoch: int) -> int:
        return epoch * self.per_call[step.signal] + step.k

    def ready(self, step: Wait, epoch: int) -> bool:
        return int(self.pads[step.signal.owner][step.signal.index]) >= self.target(step, epoch)

    def execute(self, step, epoch: int, round_: int) -> None:
        if isinstance(step, Stage):
            self.view(step.dst, round_, epoch)[:] = self.view(step.src, round_, epoch)
        elif isinstance(step, Notify):
            self.pads[step.signal.owner][step.signal.index] = self.target(step, epoch)
        elif isinstance(step, Consume):
            if step.operation is Operation.COPY:
                self.view(step.dst, round_, epoch)[:] = self.view(step.srcs[0], round_, epoch)
            else:
                chunks = [self.view(r, round_, epoch).copy() for r in step.srcs]  # dst may be a source
                self.view(step.dst, round_, epoch)[:] = reduce_chunks(chunks, self.dtype, self.op)
        elif isinstance(step, Epilogue):
            self.apply_epilogue(step.region, round_)
        elif not isinstance(step, Wait):  # a Wait moves no data; anything else is no step (verify refuses it)
            raise ValueError(f"{type(step).__name__} is not a SNAC step: the schedule cannot run")

    def apply_epilogue(self, region: Region, round_: int) -> None:
        """The epilogue on the whole rows of ``region`` in this round, in place."""
        n = self.round_length(round_)
        lo, hi = round_slice_bounds(self.piece, n, self.dtype.itemsize, self.schedule.slices, region.slice,
                                    self.align)
        base = region.unit * self.count + round_ * self.piece
        run_epilogue(self.schedule.epilogue, self.outs[region.rank], self.operands[region.rank], self.dtype,
                     base + lo, base + hi)


def simulate_calls(
    schedule: Schedule,
    spec: Spec,
    inputs,
    count: int,
    dtype: DType | str,
    op: ReduceOp | str | None = None,
    *,
    calls: int = 2,
    seed: int = 0,
    piece: int | None = None,
    operands=None,
) -> list[list[np.ndarray]]:
    """Like ``simulate`` but returns every call's outputs: ``result[call][rank]``, each read
    by that rank's caller right after its call ended.  With an epilogue, ``operands[rank]``
    maps its operands' names to values (as for ``evaluate``); the rows operands it writes are
    updated in place, call after call, as on the GPU."""
    dtype, reduce_op = _checked_args(schedule, spec, count, dtype, op, calls)
    # A packed stage is its Stage followed by its Notify (purlinc.snac.packing).
    schedule, _ = normalized(schedule)
    per_call_inputs = _per_call_inputs(spec, inputs, calls, count, dtype)
    _check_rows(schedule, count, piece, operands)
    machine = _Machine(schedule, count, dtype, reduce_op, piece, operands)
    return _Run(schedule, machine, per_call_inputs, calls, seed).run()


def _check_rows(schedule: Schedule, count: int, piece: int | None, operands) -> None:
    """An epilogue needs its operands, and chunks and rounds of whole rows."""
    if schedule.epilogue is None:
        return
    row = schedule.epilogue.row
    if operands is None or len(operands) != schedule.world_size:
        raise ValueError(f"{schedule.collective} has an epilogue: give operands, one dict per rank")
    check_rows_count(schedule.epilogue, count)
    if piece is not None and piece % row:
        raise ValueError(f"piece={piece} is not a whole number of rows of {row} elements")


def _checked_args(schedule: Schedule, spec: Spec, count: int, dtype, op, calls: int):
    """(dtype, reduce op or None) of a simulation; ValueError for arguments that cannot be run."""
    dtype = DType.parse(dtype.value if isinstance(dtype, DType) else dtype)
    if (schedule.collective, schedule.world_size) != (spec.name, spec.world_size):
        raise ValueError(f"the schedule is {schedule.collective} for R={schedule.world_size}, the spec "
                         f"{spec.name} for R={spec.world_size}: simulate a schedule with the spec it was lowered from")
    check_count("count", count)
    check_count("calls", calls, least=1)
    check_epilogue_dtype(spec, dtype)
    reduce_op = None
    if schedule.operation is Operation.REDUCE:
        if op is None:
            raise ValueError(f"{spec.name} is a reduction: give op (sum, prod, max or min)")
        reduce_op = ReduceOp.parse(op)
        if not dtype.reducible:
            raise ValueError(f"{dtype.value} cannot be reduced (fp8 is supported for copies only)")
    return dtype, reduce_op


class _Run:
    """The concrete programs run in a random (seeded) order: a program blocked on a wait or on
    its rank's next call leaves the runnable set until the notify or the call comes."""

    def __init__(self, schedule: Schedule, machine: _Machine, per_call_inputs, calls: int, seed: int):
        self.machine, self.per_call_inputs, self.calls = machine, per_call_inputs, calls
        self.rng = random.Random(seed)
        self.world, self.channels = schedule.world_size, schedule.channels
        self.programs = schedule.concrete_programs()  # ordered by (rank, channel)
        self.steps_per_call = [len(p.steps) * machine.rounds for p in self.programs]
        self.position = [0] * len(self.programs)  # flattened over calls, rounds, steps
        self.finished_call = [[0] * self.world for _ in range(calls)]  # channels of each rank done with call c
        self.started = [0] * self.world  # calls each rank has started (the caller set its inputs up)
        self.results: list[list[np.ndarray | None]] = [[None] * self.world for _ in range(calls)]
        self.runnable = list(range(len(self.programs)))
        self.waiting_signal: dict = defaultdict(list)  # (owner, index) -> blocked programs
        self.waiting_rank: dict = defaultdict(list)  # rank -> programs waiting for its next call to start

    def end_of_call(self, p: int, call: int) -> None:
        rank = p // self.channels
        self.finished_call[call][rank] += 1
        if self.finished_call[call][rank] < self.channels:
            return
        self.results[call][rank] = self.machine.outs[rank].copy()
        if call + 1 < self.calls:
            self.machine.start_call(rank, self.per_call_inputs[call + 1][rank])
            self.started[rank] = call + 2
            self.runnable.extend(self.waiting_rank.pop(rank, []))

    def run(self) -> list[list[np.ndarray]]:
        machine, programs, calls, channels = self.machine, self.programs, self.calls, self.channels
        steps_per_call, position, started = self.steps_per_call, self.position, self.started
        for rank in range(self.world):
            machine.start_call(rank, self.per_call_inputs[0][rank])
            started[rank] = 1
        # Programs with no work at all still take part in the call boundaries.
        for p, per_call in enumerate(steps_per_call):
            if per_call == 0:
                for call in range(calls):
                    self.end_of_call(p, call)
        runnable = self.runnable = [p for p in self.runnable if steps_per_call[p] > 0]
        while runnable:
            slot = self.rng.randrange(len(runnable))
            p = runnable[slot]
            per_call = steps_per_call[p]
            call, within = divmod(position[p], per_call)
            rank = p // channels
            if started[rank] <= call:
                runnable[slot] = runnable[-1]
                runnable.pop()
                self.waiting_rank[rank].append(p)
                continue
            round_, index = divmod(within, len(programs[p].steps))
            step = programs[p].steps[index]
            epoch = call * machine.rounds + round_
            if isinstance(step, Wait) and not machine.ready(step, epoch):
                runnable[slot] = runnable[-1]
                runnable.pop()
                self.waiting_signal[(step.signal.owner, step.signal.index)].append(p)
                continue
            machine.execute(step, epoch, round_)
            if isinstance(step, Notify):
                runnable.extend(self.waiting_signal.pop((step.signal.owner, step.signal.index), []))
            position[p] += 1
            if position[p] % per_call == 0:
                self.end_of_call(p, call)
                if position[p] == calls * per_call:
                    runnable[slot] = runnable[-1]
                    runnable.pop()
        stuck = [p for p in range(len(programs)) if position[p] < calls * steps_per_call[p]]
        if stuck:
            raise SimulationError(_deadlock_report(machine, programs, steps_per_call, position, stuck, channels))
        return [list(outputs) for outputs in self.results]


def _deadlock_report(machine: _Machine, programs, steps_per_call, position, stuck, channels) -> str:
    lines = []
    for p in stuck:
        call, within = divmod(position[p], steps_per_call[p])
        round_, index = divmod(within, len(programs[p].steps))
        step = programs[p].steps[index]
        rank, channel = p // channels, p % channels
        where = f"rank {rank}, channel {channel}, step {index} (call {call}, round {round_})"
        if isinstance(step, Wait):
            epoch = call * machine.rounds + round_
            have = int(machine.pads[step.signal.owner][step.signal.index])
            lines.append(f"{where}: {describe(step)} needs {machine.target(step, epoch)}, the pad holds {have}")
        else:
            lines.append(f"{where}: waits for rank {rank} to start call {call}")
    return "deadlock in simulation: " + "; ".join(lines)


def simulate(
    schedule: Schedule,
    spec: Spec,
    inputs,
    count: int,
    dtype: DType | str,
    op: ReduceOp | str | None = None,
    *,
    calls: int = 2,
    seed: int = 0,
    piece: int | None = None,
    operands=None,
) -> list[np.ndarray]:
    """Run ``calls`` back-to-back calls of ``schedule`` and return the last call's outputs.

    ``inputs`` is one input set (a list of one 1-D storage array per rank, used for every
    call) or a list of ``calls`` such sets.  ``seed`` picks the interleaving.  Raises
    ``SimulationError`` on deadlock.
    """
    return simulate_calls(
        schedule, spec, inputs, count, dtype, op, calls=calls, seed=seed, piece=piece, operands=operands
    )[-1]


__all__ = ["simulate", "simulate_calls", "slice_bounds", "round_slice_bounds", "SimulationError", "POISON_OUT", "POISON_STAGE"]
