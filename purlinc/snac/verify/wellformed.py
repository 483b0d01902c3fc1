"""1. Well-formedness, step by step (see the package docstring): shapes, signal declarations,
regions, waits and notify counts."""

from __future__ import annotations

import reprlib
from collections import defaultdict

from purlinc.frontend.ast import Operation
from purlinc.frontend.spec import Spec
from purlinc.snac.ir import Consume, Epilogue, Notify, Region, Schedule, SignalDecl, Space, Stage, Step, Wait
from purlinc.snac.verify.common import Failure, VerificationError, reads_of, writes_of


STEP_TYPES = (Stage, Notify, Wait, Consume, Epilogue)


def check_step_types(schedule: Schedule, fail: Failure) -> None:
    """Every step is one of the IR's (a loaded or hand-built schedule may hold anything):
    simulate() skipped another object, and the checks below would fail on it obscurely."""
    for program in schedule.programs:
        for index, step in enumerate(program.steps):
            if not isinstance(step, STEP_TYPES):
                raise fail.at(program.rank, program.channel, index,
                              f"{reprlib.repr(step)} is not a SNAC step ({', '.join(t.__name__ for t in STEP_TYPES)})")


def check_shape(schedule: Schedule, spec: Spec) -> None:
    world = spec.world_size
    problems = []
    if schedule.collective != spec.name:  # as simulate refuses the pair
        problems.append(f"it is {schedule.collective!r}, the spec {spec.name!r}")
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
    if type(schedule.stage_copies) is not int or schedule.stage_copies not in (1, 2):
        problems.append(f"stage_copies = {schedule.stage_copies!r} (staging has 1 or 2 copies)")
    if problems:
        raise VerificationError(f"schedule {schedule.collective} does not fit its spec: " + "; ".join(problems))


def check_signals_declared(schedule: Schedule) -> None:
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
    if type(region.rank) is not int or type(region.unit) is not int or type(region.slice) is not int:
        # 0.0 passed every bound below and failed in the simulator's indexing (a loaded schedule)
        return (f"a region's rank, unit and slice are integers, not {region.rank!r}, {region.unit!r} and "
                f"{region.slice!r}")
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
    if isinstance(step, (Stage, Notify, Wait)) and step.k is not None and type(step.k) is not int:
        return f"k={step.k!r} is not an integer"
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
    for region in (*reads_of(step), *writes_of(step)):
        problem = _region_problem(schedule, region, rank, channel, writes=region in writes_of(step))
        if problem is not None:
            return problem
    slices = {r.slice for r in (*reads_of(step), *writes_of(step))}
    if len(slices) > 1:
        return f"mixes slices {sorted(slices)} (data only moves within one slice)"
    return None


def check_steps(schedule: Schedule, fail: Failure) -> None:
    per_call = schedule.per_call()
    known: dict[int, int] = {}  # id(Signal) -> per_call, for declared signals (see Order)
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
                    in_range = (1 <= k <= total) if kind is Notify else (signal.owner == rank and -total < k <= total)
                    if type(k) is int and in_range:  # 0.5 is in range (and fails the proof's lookups)
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


def check_signal_counts(schedule: Schedule, fail: Failure) -> None:
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
            raise _missing_notifies(schedule, decl, by_k, missing, fail)


def _missing_notifies(schedule: Schedule, decl: SignalDecl, by_k: dict, missing: list, fail: Failure) -> VerificationError:
    """The error for a signal notified fewer times than declared.  It points at a wait that
    can never be satisfied where there is one (the step that would hang), and names the
    steps that do notify the signal, so the reader sees whose notify is missing."""
    shown = ", ".join(map(str, missing[:_SHOWN_KS])) + (f", ... ({len(missing):,} in all)"
                                                       if len(missing) > _SHOWN_KS else "")
    summary = (f"{decl.signal.format()} is notified {len(by_k)} times per call, but declared "
               f"per_call = {decl.per_call} (no notify with k={shown})")
    notes = _notifier_notes(schedule, by_k, fail)
    stuck = _first_unmet_wait(schedule, decl, set(missing))
    if stuck is None:
        return VerificationError(summary, notes=notes, rank=decl.signal.owner)
    channel, index = stuck
    error = fail.at(decl.signal.owner, channel, index, f"would wait forever: {summary}")
    error.notes = notes
    return error


def _first_unmet_wait(schedule: Schedule, decl: SignalDecl, missing: set) -> tuple[int, int] | None:
    """(channel, step index) of the owner's first wait for a notify that never comes."""
    owner, per_call = decl.signal.owner, decl.per_call
    for channel in range(schedule.channels):
        for index, step in enumerate(schedule.program(owner, channel).steps):
            if type(step) is Wait and step.signal == decl.signal:
                k = step.k if step.k > 0 else step.k + per_call  # k <= 0: the previous call's
                if k in missing:
                    return channel, index
    return None


def _notifier_notes(schedule: Schedule, by_k: dict, fail: Failure) -> tuple[str, ...]:
    """Who notifies the signal now, with which k (at most _SHOWN_KS of them)."""
    channels = schedule.channels
    sites = sorted((p, index, k) for k, places in by_k.items() for p, index in places)
    notes = [f"notified with k={k} by {fail.short(p // channels, p % channels, index)}"
             for p, index, k in sites[:_SHOWN_KS]]
    if len(sites) > _SHOWN_KS:
        notes.append(f"... and {len(sites) - _SHOWN_KS:,} more notifies")
    return tuple(notes)


_SHOWN_KS = 8  # missing notify numbers a message lists (per_call = 10**6 listed them all: 7.9 MB)
