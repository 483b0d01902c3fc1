"""Staging copies by epoch parity (``purlinc.snac.ir``, "Staging copies"), for the proof.

``unrolled(schedule)`` rewrites a schedule with ``stage_copies = 2`` as one with a single
copy whose every call is two calls of the original: each program runs its steps for an even
call, then again for the odd call with every STAGE region moved to the second copy (unit
``+ stage_units``) and every signal's ``k`` raised by its ``per_call``; ``per_call`` doubles.
Call ``E`` of the unrolled schedule is calls ``2E`` and ``2E + 1`` of the original, so the
verifier's two unrolled calls cover four original ones, in which each copy is reused: a
producer that rewrites a copy before its consumer finished reading it is a race there,
and a missing ACK a wrong result or a race, exactly as for single-copy schedules.

Why the proof carries over.  The unrolled program orders the odd call after the even one by
program order, which the kernel boundary also gives (a rank's next call starts when all its
channels finished; the proof is of one channel).  What the unrolled schedule leaves out is
the caller's turn between an even and an odd call (it reads OUT and rewrites IN and OUT);
but the two calls access IN and OUT identically -- copies exist only for STAGE -- and are
ordered by the same notifies and waits, so the caller's turn between an odd call and the
next even one, which the proof does check, stands for both.
"""

from __future__ import annotations

from dataclasses import replace

from purlinc.snac.ir import Epilogue, Consume, Notify, Program, Region, Schedule, SignalDecl, Space, Stage, Wait


class _Mover:
    """STAGE regions moved to the second copy, one object per region: the verifier numbers
    regions by object identity first (a Region's hash is Python code), so equal regions must
    stay one object, as the lowerings keep them."""

    def __init__(self, units: int):
        self.units = units
        self.moved: dict[int, Region] = {}  # id(region) -> its second-copy region
        self.keep: list[Region] = []  # keeps the keys' objects alive while ids are in use

    def __call__(self, region: Region) -> Region:
        if region.space is not Space.STAGE:
            return region
        hit = self.moved.get(id(region))
        if hit is None:
            hit = self.moved[id(region)] = Region(region.space, region.rank, region.unit + self.units, region.slice)
            self.keep.append(region)
        return hit


def _odd(step, move: _Mover, per_call: dict):
    """``step`` as the odd call runs it: second STAGE copy, k one call on."""
    kind = type(step)
    if kind is Stage:
        k = step.k + per_call[step.signal] if step.signal is not None else step.k
        return Stage(move(step.src), move(step.dst), step.note, step.signal, k)
    if kind is Consume:
        return Consume(step.operation, tuple(map(move, step.srcs)), move(step.dst), step.note, step.line)
    if kind is Notify or kind is Wait:
        return kind(step.signal, step.k + per_call[step.signal], step.note)
    if kind is Epilogue:  # OUT only: no staging copy to move
        return step
    raise AssertionError(f"not an IR step: {step!r}")


def unrolled(schedule: Schedule) -> Schedule:
    """The single-copy schedule of two calls per call (see the module docstring); a schedule
    with one copy is returned as it is."""
    if schedule.stage_copies == 1:
        return schedule
    if schedule.stage_copies != 2:
        raise AssertionError(f"stage_copies = {schedule.stage_copies}: only 1 or 2 are defined")
    move = _Mover(schedule.stage_units)
    per_call = schedule.per_call()
    programs = tuple(
        Program(p.rank, p.channel, p.steps + tuple(_odd(step, move, per_call) for step in p.steps))
        for p in schedule.programs
    )
    signals = tuple(SignalDecl(d.signal, 2 * d.per_call, d.role, d.note) for d in schedule.signals)
    return replace(schedule, programs=programs, signals=signals, stage_units=2 * schedule.stage_units, stage_copies=1)


def unrolled_reads(schedule: Schedule, reads: list[list[tuple[Region, ...]]]) -> list[list[tuple[Region, ...]]]:
    """Per-step extra reads of ``schedule``'s programs (``races._access_table``'s
    ``extra_reads``) as the steps of ``unrolled(schedule)``: the odd call's read the second copy."""
    if schedule.stage_copies == 1:
        return reads
    move = _Mover(schedule.stage_units)
    return [rows + [tuple(map(move, regions)) for regions in rows] for rows in reads]
