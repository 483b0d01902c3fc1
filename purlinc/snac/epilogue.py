"""Epilogue steps: where each rank applies the spec's epilogue, and the proof that it is right.

``place_epilogues`` runs after any lowering: for every slice of every output chunk of a rank it
inserts one ``Epilogue`` step after the last step of that rank's program touching the slice
(its final consume, or the stage that forwards the reduced value, as a two-shot owner's
all-gather send does), then past the consumes and notifies that directly follow: a batch of
consumes after one wait stays one batch (the LL datapath unpacks them together), and a notify
(a release, which waits for this block's earlier stores) is not held up by the epilogue's
work, which no peer waits for.  With pipelined slices a slice's epilogue then runs while
later slices are in flight.

``epilogue_problem`` is the verifier's part: every slice of every output chunk of every
rank gets exactly one Epilogue step, in its own rank's program, and no step touches the
slice after it.  Outputs of these schedules are touched by their own rank only (a schedule
whose peers write a rank's output, as registered outputs let some lowerings do, is refused),
so program order alone orders the epilogue after every write of the
slice; the verifier's result check proves the value written last is the full reduction, and
it is that value the epilogue sees.
"""

from __future__ import annotations

from dataclasses import replace

from purlinc.errors import PurlinError
from purlinc.frontend.spec import Spec
from purlinc.snac.ir import Consume, Epilogue, Notify, Program, Region, Schedule, Space, Stage


def _touched(step) -> tuple[Region, ...]:
    if isinstance(step, Stage):
        return (step.src, step.dst)
    if isinstance(step, Consume):
        return (*step.srcs, step.dst)
    if isinstance(step, Epilogue):
        return (step.region,)
    return ()


def _out_regions(schedule: Schedule, rank: int) -> list[Region]:
    S = schedule.options.slices
    return [Region(Space.OUT, rank, unit, s) for unit in range(schedule.out_units[rank]) for s in range(S)]


def _refuse_peer_written_outputs(schedule: Schedule) -> None:
    """A rank sees when its rows are final only where no peer touches its output.  That is
    what registered outputs let some lowerings do (ring, two-shot, a copy's direct-push), not
    what the option says: a direct-push or direct-pull reduction lowers to the same programs
    with it or without it, and was refused for nothing."""
    for program in schedule.programs:
        for step in program.steps:
            for region in _touched(step):
                if region.space is Space.OUT and region.rank != program.rank:
                    raise PurlinError(
                        f"an epilogue needs outputs no peer writes: with registered outputs, "
                        f"{schedule.options.algorithm.value} has rank {program.rank} write {region.format()} "
                        f"directly, and rank {region.rank} cannot see when its rows are final",
                        notes=("use an algorithm that leaves each rank's output to it (direct-push, direct-pull), "
                               "or a schedule without registered out",))


def place_epilogues(schedule: Schedule, spec: Spec) -> Schedule:
    """``schedule`` with the spec's epilogue placed (unchanged when the spec has none)."""
    epilogue = spec.epilogue
    if epilogue is None:
        return schedule
    _refuse_peer_written_outputs(schedule)
    line = epilogue.span.line if epilogue.span is not None else None
    programs = []
    for program in schedule.programs:
        last: dict[Region, int] = {}
        for index, step in enumerate(program.steps):
            for region in _touched(step):
                if region.space is Space.OUT and region.rank == program.rank:
                    last[region] = index
        after: dict[int, list[Region]] = {}
        for region in _out_regions(schedule, program.rank):
            if region not in last:
                raise PurlinError(f"internal: no step of rank {program.rank} writes {region.format()}")
            index = last[region]
            while index + 1 < len(program.steps) and isinstance(program.steps[index + 1], (Consume, Notify)):
                index += 1
            after.setdefault(index, []).append(region)
        steps = []
        for index, step in enumerate(program.steps):
            steps.append(step)
            steps += [Epilogue(region, f"epilogue rows({epilogue.row}) of {region.format()}", line)
                      for region in after.get(index, ())]
        programs.append(Program(program.rank, program.channel, tuple(steps)))
    return replace(schedule, programs=tuple(programs), epilogue=epilogue)


def epilogue_problem(schedule: Schedule, spec: Spec) -> tuple[int, int | None, str] | None:
    """The first violation as (rank, step index or None, message), or None."""
    if (schedule.epilogue is None) != (spec.epilogue is None) or schedule.epilogue != spec.epilogue:
        return 0, None, "the schedule's epilogue is not the spec's"
    for program in schedule.programs:
        rank = program.rank
        applied: dict[Region, int] = {}
        for index, step in enumerate(program.steps):
            for region in _touched(step):
                if region in applied:
                    what = "applies the epilogue again to" if isinstance(step, Epilogue) else "touches"
                    return rank, index, f"{what} {region.format()} after its epilogue (step {applied[region]})"
                if region.space is Space.OUT and region.rank != rank and schedule.epilogue is not None:
                    return rank, index, f"touches {region.format()}, another rank's output, in a schedule with an epilogue"
            if isinstance(step, Epilogue):
                if schedule.epilogue is None:
                    return rank, index, "applies an epilogue, but the spec has none"
                region = step.region
                if (region.space is not Space.OUT or region.rank != rank or region.unit >= schedule.out_units[rank]
                        or not 0 <= region.slice < schedule.options.slices):
                    return rank, index, f"applies the epilogue to {region.format()}, not an output slice of rank {rank}"
                applied[region] = index
        if schedule.epilogue is not None:
            missing = [r for r in _out_regions(schedule, rank) if r not in applied]
            if missing:
                return rank, None, f"{missing[0].format()} never gets its epilogue"
    return None
