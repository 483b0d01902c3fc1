"""Packed (LL) stages: what they mean, and which steps the datapath fuses around them.

A packed ``Stage`` (``Stage.signal`` set) is a Stage and a ``Notify(signal, k)`` in one: every
16-byte packet it writes carries the flag ``epoch * per_call + k``, so the consumer learns
that the data is there from the data itself (NCCL's LL protocol).  Its meaning is exactly
the Stage followed by the Notify: ``normalized`` rewrites a schedule so, and the verifier
and the simulator run on the result, so every proof about plain schedules applies.

What the datapath needs on top (``ll_groups``, checked by the verifier, relied on by codegen):

- A packed region is read only by ``Consume`` steps in the *consume group* of a Wait on its
  signal: a maximal run of Wait steps followed by the run of Consume steps right after it.
  The consumer polls each packet's flag itself (no separate flag to read), so the group's
  packed waits become nothing and its consumes read the packets directly.
- The packed regions a group reads are exactly those its packed waits guard: the regions
  packed with that signal and a ``k`` above the previous wait's on that signal, up to the
  wait's.  A wait then is no more and no less than "poll the packets the next steps read",
  and every packet is polled before its consumer says (ACK) the unit may be rewritten.
- A packed message occupies two STAGE units (``PACKED_UNITS``): the unit a region names and
  the next, which nothing else may touch.
- A consume that reads packets has at most ``MAX_PACKED_SOURCES`` sources.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from purlinc.snac.ir import Consume, Notify, Program, Region, Schedule, Signal, Space, Stage, Step, Wait

PACKED_UNITS = 2  # STAGE units per packed message: packets hold 8 data bytes in 16
# Sources of one consume that reads packets: the datapath's receive loop marks which of its
# sources are packets, and which packets it still waits for, one bit each in a 32-bit word
# (and holds a 16-byte packet per source in registers).  A one-shot all-reduce's consume reads
# one source per rank, so packed stages serve R <= 32.
MAX_PACKED_SOURCES = 32


def unpack_steps(steps: tuple[Step, ...]) -> tuple[tuple[Step, ...], tuple[int, ...]]:
    """``steps`` with every packed Stage split into Stage + Notify, and for every resulting
    step the index of the step it came from."""
    out: list[Step] = []
    origin: list[int] = []
    for index, step in enumerate(steps):
        if isinstance(step, Stage) and step.packed:
            out.append(replace(step, signal=None, k=0))
            out.append(Notify(step.signal, step.k, step.note))
            origin += [index, index]
        else:
            out.append(step)
            origin.append(index)
    return tuple(out), tuple(origin)


def is_packed(schedule: Schedule) -> bool:
    # ``signal is not None`` is ``Stage.packed`` without a property call per step (10^5..10^6 steps).
    return any(isinstance(s, Stage) and s.signal is not None for p in schedule.programs for s in p.steps)


def normalized(schedule: Schedule) -> tuple[Schedule, dict[tuple[int, int], tuple[int, ...]] | None]:
    """(the schedule with packed stages split into Stage + Notify, origin map): the origin map
    gives, per (rank, channel), the original step index of every normalized step; it is None
    for a schedule with no packed stage, its own normal form (every index maps to itself)."""
    if not is_packed(schedule):
        return schedule, None
    programs = []
    origins = {}
    for program in schedule.programs:
        steps, origin = unpack_steps(program.steps)
        programs.append(Program(program.rank, program.channel, steps))
        origins[program.rank, program.channel] = origin
    return replace(schedule, programs=tuple(programs)), origins


def packed_stages(schedule: Schedule) -> dict[Region, Stage]:
    """Every region written by a packed stage -> that stage (the first, if several)."""
    found: dict[Region, Stage] = {}
    for program in schedule.programs:
        for step in program.steps:
            if isinstance(step, Stage) and step.signal is not None:  # step.packed, as in is_packed
                found.setdefault(step.dst, step)
    return found


@dataclass(frozen=True, slots=True)
class LLGroup:
    """One consume group: the packed waits (fused away) and the consumes reading packets."""

    waits: tuple[int, ...]  # step indices of the Waits on packed signals
    consumes: tuple[int, ...]  # step indices of the Consumes that read packed regions
    end: int  # index after the group's last Consume
    guarded: frozenset[Region]  # packed regions the waits guard (== those the consumes read)


def ll_groups(program: Program, packed: dict[Region, Stage]) -> tuple[tuple[LLGroup, ...], list[tuple[int, str]]]:
    """The consume groups of ``program`` and the problems found: (step index, message)."""
    signals: set[Signal] = {stage.signal for stage in packed.values()}
    by_signal: dict[Signal, list[tuple[int, Region]]] = {}
    for region, stage in packed.items():
        by_signal.setdefault(stage.signal, []).append((stage.k, region))
    steps = program.steps
    groups: list[LLGroup] = []
    problems: list[tuple[int, str]] = []
    fused: set[int] = set()
    previous_k: dict[Signal, int] = {}
    i = 0
    while i < len(steps):
        if not isinstance(steps[i], Wait):
            i += 1
            continue
        j = i
        while j < len(steps) and isinstance(steps[j], Wait):
            j += 1
        waits = [w for w in range(i, j) if steps[w].signal in signals]
        if not waits:
            i = j
            continue
        guarded: set[Region] = set()
        for w in waits:
            wait = steps[w]
            if wait.k <= 0:
                problems.append((w, f"waits on {wait.signal.format()}, a packed signal, for an earlier call "
                                    "(packets are polled only within their call)"))
                continue
            low = previous_k.get(wait.signal, 0)
            guarded |= {region for k, region in by_signal[wait.signal] if low < k <= wait.k}
            previous_k[wait.signal] = max(low, wait.k)
        end = j
        while end < len(steps) and isinstance(steps[end], Consume):
            end += 1
        consumes = tuple(c for c in range(j, end) if any(r in packed for r in steps[c].srcs))
        read = {r for c in consumes for r in steps[c].srcs if r in packed}
        if read != guarded:
            unread = sorted(guarded - read, key=Region.sort_key)
            extra = sorted(read - guarded, key=Region.sort_key)
            parts = []
            if unread:
                parts.append("guards packed " + ", ".join(r.format() for r in unread) + ", which the consumes right after it do not read")
            if extra:
                parts.append("its consumes read packed " + ", ".join(r.format() for r in extra) + ", which it does not guard")
            problems.append((waits[-1], "; ".join(parts) + " (a packed wait must guard exactly the packets the next consumes read)"))
        fused.update(consumes)
        groups.append(LLGroup(tuple(waits), consumes, end, frozenset(guarded)))
        i = end
    for index, step in enumerate(steps):
        if isinstance(step, Stage) and step.src in packed:
            problems.append((index, f"stages packed {step.src.format()} onward (packets are read only by consumes)"))
        if isinstance(step, Consume) and index not in fused and any(r in packed for r in step.srcs):
            region = next(r for r in step.srcs if r in packed)
            problems.append((index, f"reads packed {region.format()} outside the consume group of a wait on "
                                    f"{packed[region].signal.format()}"))
    return tuple(groups), problems


def layout_problems(schedule: Schedule) -> list[tuple[int, int, int, str]]:
    """Packed stages that do not fit the schedule: (rank, channel, step index, message)."""
    packed = packed_stages(schedule)
    if not packed:  # every check below is about packed stages, their units and signals
        return []
    units = {(r.rank, r.unit) for r in packed}
    signals = {stage.signal for stage in packed.values()}
    problems = []
    writers: dict[Region, int] = {}
    for program in schedule.programs:
        at = (program.rank, program.channel)
        for index, step in enumerate(program.steps):
            if isinstance(step, Notify) and step.signal in signals:
                problems.append((*at, index, f"{step.signal.format()} is a packed signal: only packed stages may notify it"))
            if isinstance(step, Stage) and step.packed:
                dst = step.dst
                if dst.space is not Space.STAGE:
                    problems.append((*at, index, f"a packed stage must write a staging buffer, not {dst.format()}"))
                if step.signal.owner != dst.rank:
                    problems.append((*at, index, f"packs {step.signal.format()} into {dst.format()}: the flag must "
                                                 "belong to the rank that reads the packets"))
                if dst.unit + PACKED_UNITS > schedule.stage_units:
                    problems.append((*at, index, f"{dst.format()} is packed: it needs units {dst.unit} and "
                                                 f"{dst.unit + 1}, but stage has {schedule.stage_units} units"))
                if (dst.rank, dst.unit - 1) in units:
                    problems.append((*at, index, f"packs into {dst.format()}, the second half of a packed "
                                                 f"message in unit {dst.unit - 1}"))
                writers[dst] = writers.get(dst, 0) + 1
                if writers[dst] > 1:
                    problems.append((*at, index, f"{dst.format()} is written by two packed stages"))
                continue
            if isinstance(step, Consume) and len(step.srcs) > MAX_PACKED_SOURCES and any(r in packed for r in step.srcs):
                problems.append((*at, index, f"reads packets and {len(step.srcs)} sources in all: a consume that "
                                             f"reads packets has at most {MAX_PACKED_SOURCES}"))
            regions = ()
            if isinstance(step, Stage):
                regions = ((step.src, False), (step.dst, True))
            elif isinstance(step, Consume):
                regions = (*((r, False) for r in step.srcs), (step.dst, True))
            remote = next((region for region, _ in regions if region.rank != program.rank), None)
            if remote is not None:
                # The proof reads a packed stage as Stage + Notify, a release; the device's LL
                # send is a plain store with no fence, and the packed wait polls its own
                # packets only.  So nothing would order unpacked data between the ranks.
                problems.append((*at, index, f"{'stages' if isinstance(step, Stage) else 'consumes'} "
                                             f"{remote.format()} of rank {remote.rank} unpacked: in a packed "
                                             "schedule data crosses ranks in packets only (an LL send orders no "
                                             "other data)"))
            for region, writes in regions:
                if region.space is not Space.STAGE:
                    continue
                if (region.rank, region.unit - 1) in units:
                    problems.append((*at, index, f"touches {region.format()}, the second half of a packed "
                                                 f"message in unit {region.unit - 1}"))
                elif writes and (region.rank, region.unit) in units:
                    problems.append((*at, index, f"writes {region.format()} unpacked, a unit that holds packed messages"))
    return problems
