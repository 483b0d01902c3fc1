"""Unit tests of the SNAC verifier on small hand-written schedules: one correct schedule,
then each class of violation caught with its exact rank / channel / step and message."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from purlinc.errors import PurlinError
from purlinc.frontend.ast import Operation
from purlinc.frontend.check import check
from purlinc.frontend.parse import parse as parse_text, parse_file
from purlinc.snac.ir import (
    HIERARCHICAL_NOTE, Consume, LowerOptions, Notify, Program, Region, Role, Schedule, Signal, SignalDecl, Space, Stage, Wait,
)
from purlinc.snac.verify import VerificationError, describe, verify

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
COPY, REDUCE = Operation.COPY, Operation.REDUCE


def spec_of(name: str, world: int = 2):
    return check(parse_file(EXAMPLES / f"{name}.pln"), world)


def IN(rank, unit, s=0):
    return Region(Space.IN, rank, unit, s)


def OUT(rank, unit, s=0):
    return Region(Space.OUT, rank, unit, s)


def ST(rank, unit, s=0):
    return Region(Space.STAGE, rank, unit, s)


def sig(owner, index):
    return Signal(owner, index)


def schedule_of(spec, programs, signals, *, stage_units=1, registered=frozenset(), channels=1, slices=1,
                channel_signals=None):
    """A Schedule from {rank: [steps]}: channel-relative programs, one per rank, run by
    every channel; ``channel_signals`` defaults to the widest declared pad."""
    world = spec.world_size
    progs = [Program(rank, 0, tuple(programs.get(rank, ()))) for rank in range(world)]
    if channel_signals is None:
        channel_signals = max((d.signal.index + 1 for d in signals), default=0)
    return Schedule(
        collective=spec.name,
        world_size=world,
        operation=spec.operation,
        options=LowerOptions(channels=channels, slices=slices, registered=frozenset(registered)),
        slices=channels * slices,
        in_units=tuple(len(x) for x in spec.inputs),
        out_units=tuple(len(x) for x in spec.outputs),
        stage_units=stage_units,
        signals=tuple(signals),
        programs=tuple(progs),
        channel_signals=channel_signals,
    )


def allgather2_programs():
    """Push allgather, R=2, through the peer's staging unit 0.

    r.sig[0] (DATA): the peer staged my chunk.  r.sig[1] (ACK): the peer consumed what I
    staged, so its staging unit may be rewritten next call (waited with k=0).
    """
    programs = {}
    for r in (0, 1):
        peer = 1 - r
        programs[r] = [
            Consume(COPY, (IN(r, 0),), OUT(r, r)),  # 0
            Wait(sig(r, 1), 0),  # 1 previous call's ack: peer's staging unit is free
            Stage(IN(r, 0), ST(peer, 0)),  # 2
            Notify(sig(peer, 0), 1),  # 3
            Wait(sig(r, 0), 1),  # 4
            Consume(COPY, (ST(r, 0),), OUT(r, peer)),  # 5
            Notify(sig(peer, 1), 1),  # 6 ack
        ]
    return programs


def allgather2_signals():
    return [SignalDecl(sig(r, i), 1, role) for r in (0, 1) for i, role in ((0, Role.DATA), (1, Role.ACK))]


def allgather2(edit=None):
    """(spec, schedule) of the correct allgather, after ``edit(programs)`` if given."""
    spec = spec_of("allgather")
    programs = allgather2_programs()
    if edit is not None:
        edit(programs)
    return spec, schedule_of(spec, programs, allgather2_signals())


def allreduce2_programs():
    """Direct push allreduce, R=2: each rank stages its full input to the peer, then reduces
    in rank order (r0's contribution first), like the spec."""
    programs = {}
    for r in (0, 1):
        peer = 1 - r
        steps = [Wait(sig(r, 1), 0)]
        steps += [Stage(IN(r, u), ST(peer, u)) for u in (0, 1)]
        steps += [Notify(sig(peer, 0), 1), Wait(sig(r, 0), 1)]
        for u in (0, 1):
            srcs = (IN(r, u), ST(r, u)) if r == 0 else (ST(r, u), IN(r, u))
            steps.append(Consume(REDUCE, srcs, OUT(r, u)))
        steps.append(Notify(sig(peer, 1), 1))
        programs[r] = steps
    return programs


def allreduce2(edit=None):
    spec = spec_of("allreduce")
    programs = allreduce2_programs()
    if edit is not None:
        edit(programs)
    return spec, schedule_of(spec, programs, allgather2_signals(), stage_units=2)


def fails(spec, schedule) -> VerificationError:
    with pytest.raises(VerificationError) as info:
        verify(schedule, spec)
    return info.value


# ----------------------------------------------------------------------------- correct ones


def test_correct_allgather_verifies():
    spec, schedule = allgather2()
    verify(schedule, spec)


def test_correct_allreduce_verifies():
    spec, schedule = allreduce2()
    verify(schedule, spec)


def test_error_is_a_purlin_error_with_location():
    spec, schedule = allgather2(lambda p: p[1].pop(4))
    error = fails(spec, schedule)
    assert isinstance(error, PurlinError)
    assert (error.rank, error.channel, error.step, error.call) == (1, 0, 4, 0)
    assert error.render().startswith("error: rank 1, channel 0, step 4")
    assert error.with_note("while verifying").rank == 1


def test_describe():
    assert describe(Consume(COPY, (ST(2, 1),), OUT(2, 1))) == "consume r2.stage[1].s0 -> r2.out[1].s0"
    assert describe(Consume(REDUCE, (IN(0, 0), ST(0, 0)), OUT(0, 0))) == "reduce r0.in[0].s0 + r0.stage[0].s0 -> r0.out[0].s0"
    assert describe(Stage(IN(0, 0), ST(1, 0))) == "stage r0.in[0].s0 -> r1.stage[0].s0"
    assert describe(Notify(sig(1, 0), 1)) == "notify r1.sig[0] k=1"
    assert describe(Wait(sig(1, 0), 0)) == "wait r1.sig[0] k=0"


# ----------------------------------------------------------------------------- well-formedness


def test_shape_mismatch():
    spec, schedule = allgather2()
    error = fails(spec_of("allgather", 3), schedule)
    assert "it is for R=2, the spec for R=3" in error.message


@pytest.mark.parametrize(
    "region, problem",
    [
        (OUT(1, 2), "r1.out[2].s0 is out of bounds: rank 1's out has 2 units"),
        (ST(1, 1), "r1.stage[1].s0 is out of bounds: rank 1's stage has 1 units"),
        (OUT(1, 0, 1), "r1.out[0].s1 lies outside the channel's slices 0..0 (programs are channel-relative: channel c adds c * slices, so another channel would own it)"),
        (OUT(5, 0), "r5.out[0].s0 names no rank (R=2)"),
        (OUT(0, 1), "touches r0.out[1].s0, another rank's out buffer, which is not registered"),
        (IN(1, 0), "writes r1.in[0].s0, the caller's input"),
    ],
)
def test_bad_region(region, problem):
    def edit(p):
        p[1][5] = Consume(COPY, (ST(1, 0),), region)

    error = fails(*allgather2(edit))
    assert (error.rank, error.channel, error.step) == (1, 0, 5)
    assert error.message == f"rank 1, channel 0, step 5 (consume r1.stage[0].s0 -> {region.format()}): {problem}"


def test_remote_registered_out_is_allowed_in_bounds():
    spec, schedule = allgather2(lambda p: p[1].__setitem__(5, Consume(COPY, (ST(1, 0),), OUT(0, 1))))
    schedule = replace(schedule, options=replace(schedule.options, registered=frozenset({"out"})))
    error = fails(spec, schedule)  # well-formed now; fails later (rank 0's out[1] is then raced)
    assert "not registered" not in error.message


def test_slice_of_another_channel():
    spec = spec_of("allgather")
    programs = {0: [Consume(COPY, (IN(0, 0, 1),), OUT(0, 0, 1))]}
    schedule = schedule_of(spec, programs, [], channels=2)
    error = fails(spec, schedule)
    assert (error.rank, error.channel, error.step) == (0, 0, 0)
    assert error.message.endswith(
        "r0.in[0].s1 lies outside the channel's slices 0..0 (programs are channel-relative: "
        "channel c adds c * slices, so another channel would own it)"
    )


def test_signal_of_another_channel():
    """A signal index >= channel_signals would be channel 1's: rejected, declared or used."""
    spec, schedule = allgather2()
    narrow = replace(schedule, channel_signals=1, options=replace(schedule.options, channels=2), slices=2)
    error = fails(spec, narrow)
    assert error.message == (
        "signal r0.sig[1] lies outside its channel's signals 0..0 (channel_signals = 1): channel 1 would share it"
    )
    undeclared = replace(schedule, signals=schedule.signals[:1] + schedule.signals[2:])  # r0.sig[1] used, not declared
    assert "r0.sig[1] is not declared" in fails(spec, undeclared).message


def test_one_program_per_rank():
    spec, schedule = allgather2()
    doubled = replace(schedule, programs=schedule.programs + (Program(0, 1, ()),))
    assert "not one per rank" in fails(spec, doubled).message


def test_channels_run_the_same_program_on_their_own_slices_and_signals():
    spec, schedule = allgather2()
    wide = replace(schedule, options=replace(schedule.options, channels=3), slices=3)
    verify(wide, spec)
    program = wide.program(1, 2)
    assert program.channel == 2 and program.steps[2] == Stage(IN(1, 0, 2), ST(0, 0, 2))
    assert program.steps[3] == Notify(sig(0, 2 * 2 + 0), 1) and wide.signal_pad_size() == 6
    assert [d.signal for d in wide.signal_decls()][:4] == [sig(0, 0), sig(0, 1), sig(0, 2), sig(0, 3)]


def test_mixed_slices():
    spec = spec_of("allgather")
    programs = {0: [Consume(COPY, (IN(0, 0, 1),), OUT(0, 0, 0))]}
    error = fails(spec, schedule_of(spec, programs, [], slices=2))
    assert error.message.endswith("mixes slices [0, 1] (data only moves within one slice)")


def test_wait_on_a_signal_of_another_rank():
    error = fails(*allgather2(lambda p: p[1].__setitem__(4, Wait(sig(0, 0), 1))))
    assert (error.rank, error.step) == (1, 4)
    assert error.message.endswith("waits on r0.sig[0], which rank 0 owns (only the owner may wait)")


def test_undeclared_signal():
    error = fails(*allgather2(lambda p: p[0].__setitem__(3, Notify(sig(1, 7), 1))))
    assert (error.rank, error.step) == (0, 3)
    assert error.message.endswith("r1.sig[7] is not declared")


def test_notify_k_out_of_range_and_wait_k_too_large():
    error = fails(*allgather2(lambda p: p[0].__setitem__(3, Notify(sig(1, 0), 2))))
    assert error.message.endswith("k=2 is outside 1..1 (per_call of r1.sig[0])")
    error = fails(*allgather2(lambda p: p[0].__setitem__(4, Wait(sig(0, 0), 2))))
    assert error.message.endswith("k=2 exceeds per_call = 1 of r0.sig[0]")
    error = fails(*allgather2(lambda p: p[0].__setitem__(4, Wait(sig(0, 0), -1))))
    assert error.message.endswith("k=-1 reaches back more than one call (per_call = 1)")


def test_notified_too_few_times_points_at_the_wait_that_would_hang():
    error = fails(*allgather2(lambda p: p[0].pop(3)))
    assert (error.rank, error.channel, error.step) == (1, 0, 4)
    assert error.message == ("rank 1, channel 0, step 4 (wait r1.sig[0] k=1): would wait forever: r1.sig[0] is "
                             "notified 0 times per call, but declared per_call = 1 (no notify with k=1)")
    assert error.notes == ()


def test_notified_too_few_times_names_who_notifies_the_rest():
    spec = spec_of("allgather")
    programs = allgather2_programs()
    programs[1].insert(5, Wait(sig(1, 0), 2))  # waits for a second notify that rank 0 never sends
    signals = [SignalDecl(d.signal, 2 if d.signal == sig(1, 0) else 1, d.role) for d in allgather2_signals()]
    error = fails(spec, schedule_of(spec, programs, signals))
    assert (error.rank, error.step) == (1, 5)
    assert "would wait forever: r1.sig[0] is notified 1 times per call, but declared per_call = 2 (no notify with k=2)" in error.message
    assert error.notes == ("notified with k=1 by rank 0 channel 0 step 3",)


def test_notified_too_few_times_with_no_waiter_names_the_signal():
    error = fails(*allgather2(lambda p: (p[0].pop(6), p[1].__setitem__(1, Consume(COPY, (IN(1, 0),), OUT(1, 1))))))
    assert error.message == "r1.sig[1] is notified 0 times per call, but declared per_call = 1 (no notify with k=1)"
    assert error.rank == 1 and error.step is None


def test_notified_twice_with_the_same_k():
    error = fails(*allgather2(lambda p: p[0].insert(4, Notify(sig(1, 0), 1))))
    assert (error.rank, error.channel, error.step) == (0, 0, 4)
    assert error.message.endswith("r1.sig[0] is notified with k=1 more than once per call")


def test_copy_with_two_sources_and_reduce_in_copy_collective():
    error = fails(*allgather2(lambda p: p[0].__setitem__(0, Consume(COPY, (IN(0, 0), IN(0, 0)), OUT(0, 0)))))
    assert error.message.endswith("a copy needs exactly one source, not 2")
    error = fails(*allgather2(lambda p: p[0].__setitem__(0, Consume(REDUCE, (IN(0, 0),), OUT(0, 0)))))
    assert error.message.endswith("reduces in a copy collective")


# ----------------------------------------------------------------------------- ordering


def test_deadlock_reports_the_cycle():
    def edit(p):
        for r in (0, 1):  # wait for the peer's data before staging ours: both wait forever
            p[r][2], p[r][3], p[r][4] = p[r][4], p[r][2], p[r][3]

    error = fails(*allgather2(edit))
    assert (error.rank, error.channel, error.step, error.call) == (0, 0, 2, 0)
    assert error.message == (
        "rank 0, channel 0, step 2 (wait r0.sig[0] k=1): deadlock: waits for rank 1 channel 0 step 4 "
        "(notify r0.sig[0] k=1), which is behind rank 1 channel 0 step 2 (wait r1.sig[0] k=1) waits for "
        "rank 0 channel 0 step 4 (notify r1.sig[0] k=1) (a cycle of waits)"
    )


def test_deadlock_only_in_the_second_call():
    # The ack wait asks for this call's ack (k=1) instead of the previous call's: call 0 is
    # fine only if... it is not: each rank waits for an ack the peer sends after consuming.
    error = fails(*allgather2(lambda p: p[0].__setitem__(1, Wait(sig(0, 1), 1))))
    assert "deadlock" in error.message
    assert (error.rank, error.step) == (0, 1)


def test_deadlock_of_a_channel_past_the_call_boundary_is_reported():
    """A ring's rank 2 asks one ack too many (k=1 instead of 0) at its first step: the cycle
    runs through a program blocked on the first step of call 1, after its rank passed the
    boundary.  The cycle search read that position as "at the end of call 0" and looked for a
    channel of the rank that had not arrived: there was none (StopIteration, a traceback)."""
    from purlinc.snac.lower import lower

    spec = check(parse_text("collective ring_shift { in[r] = x[r] out[r] = x[(r + 1) % R] copy }"), 3)
    schedule = lower(spec, LowerOptions())
    program = schedule.programs[2]
    steps = list(program.steps)
    steps[0] = replace(steps[0], k=steps[0].k + 1)
    broken = replace(schedule, programs=schedule.programs[:2] + (replace(program, steps=tuple(steps)),))
    with pytest.raises(VerificationError) as caught:
        verify(broken, spec)
    assert "deadlock: " in caught.value.message and caught.value.message.endswith("(a cycle of waits)")


def test_non_monotone_signal():
    # r1.sig[0] gets k=1 from rank 0 and k=2 from rank 1 itself, unordered: the value could
    # go from 2 back to 1.
    spec = spec_of("allgather")
    programs = allgather2_programs()
    programs[1].insert(0, Notify(sig(1, 0), 2))
    signals = [d if d.signal != sig(1, 0) else replace(d, per_call=2) for d in allgather2_signals()]
    error = fails(spec, schedule_of(spec, programs, signals))
    assert (error.rank, error.step, error.call) == (1, 0, 0)
    assert error.message == (
        "rank 1, channel 0, step 0 (notify r1.sig[0] k=2): is not ordered after rank 0 channel 0 step 3 "
        "(notify r1.sig[0] k=1), which stores the value before it (1); r1.sig[0] could go backwards "
        "and a waiter miss its value"
    )


# ----------------------------------------------------------------------------- races


def test_missing_data_wait_is_a_read_race():
    error = fails(*allgather2(lambda p: p[1].pop(4)))
    assert error.message == (
        "rank 1, channel 0, step 4 (consume r1.stage[0].s0 -> r1.out[0].s0): reads r1.stage[0].s0, "
        "whose stage at rank 0 channel 0 step 2 is not ordered before it by any notify/wait"
    )


def test_stage_after_notify_is_a_read_race():
    def edit(p):
        p[0][2], p[0][3] = p[0][3], p[0][2]

    error = fails(*allgather2(edit))
    assert (error.rank, error.step, error.call) == (1, 5, 0)
    assert "whose stage at rank 0 channel 0 step 3 is not ordered before it" in error.message


def test_slot_reused_too_early_across_calls():
    error = fails(*allgather2(lambda p: p[0].pop(1)))  # rank 0 no longer waits for the ack
    assert (error.rank, error.channel, error.step, error.call) == (0, 0, 1, 1)
    assert error.message == (
        "rank 0, channel 0, step 1 in call 1 (stage r0.in[0].s0 -> r1.stage[0].s0): overwrites "
        "r1.stage[0].s0, which the consume at rank 1 channel 0 step 5 reads, without being ordered "
        "after that read by any notify/wait (the slot is reused too early)"
    )


def test_slot_reused_too_early_within_a_call():
    # allreduce staging both units through one staging unit without an ack between them.
    def edit(p):
        for r in (0, 1):
            p[r] = [
                Stage(IN(r, 0), ST(1 - r, 0)), Notify(sig(1 - r, 0), 1),
                Stage(IN(r, 1), ST(1 - r, 0)), Notify(sig(1 - r, 0), 2),
                Wait(sig(r, 0), 1), Consume(REDUCE, (IN(r, 0), ST(r, 0)) if r == 0 else (ST(r, 0), IN(r, 0)), OUT(r, 0)),
                Wait(sig(r, 0), 2), Consume(REDUCE, (IN(r, 1), ST(r, 0)) if r == 0 else (ST(r, 0), IN(r, 1)), OUT(r, 1)),
            ]

    spec, schedule = allreduce2(edit)
    schedule = replace(schedule, signals=(SignalDecl(sig(0, 0), 2, Role.DATA), SignalDecl(sig(1, 0), 2, Role.DATA)))
    error = fails(spec, schedule)
    # The second stage overwrites the slot before the first reduce: seen from the reader.
    assert (error.rank, error.step, error.call) == (0, 5, 0)
    assert error.message.endswith(
        "reads r0.stage[0].s0, whose stage at rank 1 channel 0 step 2 is not ordered before it by any notify/wait"
    )


def test_write_write_race():
    # Both ranks write rank 0's registered out[1]; nothing orders them.
    def edit(p):
        p[1].append(Stage(IN(1, 0), OUT(0, 1)))

    spec, schedule = allgather2(edit)
    schedule = replace(schedule, options=replace(schedule.options, registered=frozenset({"out"})))
    error = fails(spec, schedule)
    assert "r0.out[1].s0" in error.message
    assert error.rank == 1 or error.rank == 0


def test_push_into_registered_out_needs_the_peer_to_have_finished_the_previous_call():
    # Push straight into the peer's registered OUT, with a data signal only: in call 1 the push
    # can land while the peer's caller still reads call 0's output.
    spec = spec_of("allgather")
    programs = {}
    for r in (0, 1):
        peer = 1 - r
        programs[r] = [
            Consume(COPY, (IN(r, 0),), OUT(r, r)),
            Stage(IN(r, 0), OUT(peer, r)),
            Notify(sig(peer, 0), 1),
            Wait(sig(r, 0), 1),
        ]
    schedule = schedule_of(spec, programs, [SignalDecl(sig(r, 0), 1, Role.DATA) for r in (0, 1)], registered={"out"})
    error = fails(spec, schedule)
    assert (error.rank, error.step, error.call) == (0, 1, 1)
    assert error.message == (
        "rank 0, channel 0, step 1 in call 1 (stage r0.in[0].s0 -> r1.out[0].s0): writes r1.out[0].s0 "
        "without being ordered after rank 1 finishing the previous call by any notify/wait "
        "(its caller may still be using its out buffer)"
    )


def test_pull_from_registered_in_must_finish_before_the_owner_returns():
    # Pull the peer's input after its "ready" notify, but never tell it we are done reading.
    spec = spec_of("allgather")
    programs = {}
    for r in (0, 1):
        peer = 1 - r
        programs[r] = [
            Consume(COPY, (IN(r, 0),), OUT(r, r)),
            Notify(sig(peer, 0), 1),  # my input is ready to be read
            Wait(sig(r, 0), 1),
            Consume(COPY, (IN(peer, 0),), OUT(r, peer)),
        ]
    schedule = schedule_of(spec, programs, [SignalDecl(sig(r, 0), 1, Role.DATA) for r in (0, 1)], registered={"in"})
    error = fails(spec, schedule)
    assert (error.rank, error.step, error.call) == (0, 3, 0)
    assert error.message == (
        "rank 0, channel 0, step 3 (consume r1.in[0].s0 -> r0.out[1].s0): reads r1.in[0].s0, which "
        "rank 1's caller owns again once rank 1 finishes the call; it is not ordered before that by "
        "any notify/wait"
    )


def test_correct_pull_allgather_verifies():
    spec = spec_of("allgather")
    programs = {}
    for r in (0, 1):
        peer = 1 - r
        programs[r] = [
            Consume(COPY, (IN(r, 0),), OUT(r, r)),
            Notify(sig(peer, 0), 1),  # ready: my input may be read this call
            Wait(sig(r, 0), 1),
            Consume(COPY, (IN(peer, 0),), OUT(r, peer)),
            Notify(sig(peer, 1), 1),  # done: I no longer read your input
            Wait(sig(r, 1), 1),
        ]
    verify(schedule_of(spec, programs, allgather2_signals(), registered={"in"}), spec)


# ----------------------------------------------------------------------------- result


def test_wrong_chunk_lands_in_the_output():
    def edit(p):  # rank 1 puts its own chunk and the peer's in each other's place
        p[1][0] = Consume(COPY, (IN(1, 0),), OUT(1, 0))
        p[1][5] = Consume(COPY, (ST(1, 0),), OUT(1, 1))

    error = fails(*allgather2(edit))
    assert (error.rank, error.channel, error.step) == (1, 0, 0)
    assert error.message == (
        "rank 1 out[0] (x[0], line 4) slice 0 holds r1.in[0], expected a copy of r0.in[0] "
        "(last written by rank 1 channel 0 step 0: consume r1.in[0].s0 -> r1.out[0].s0)"
    )


def test_output_never_written():
    error = fails(*allgather2(lambda p: p[0].pop(0)))
    assert error.message == "rank 0 out[0] (x[0], line 4) slice 0 is never written (holds garbage)"
    assert (error.rank, error.channel, error.step) == (0, 0, None)


def test_double_counted_contribution():
    def edit(p):
        p[0][5] = Consume(REDUCE, (IN(0, 0), ST(0, 0), IN(0, 0)), OUT(0, 0))

    error = fails(*allreduce2(edit))
    assert (error.rank, error.step) == (0, 5)
    assert error.message.startswith(
        "rank 0 out[0] (x[0], line 4) slice 0 holds r0.in[0] + r0.in[0] + r1.in[0]: r0.in[0] is counted 2 times"
    )


def test_missing_contribution():
    error = fails(*allreduce2(lambda p: p[1].__setitem__(6, Consume(REDUCE, (IN(1, 1),), OUT(1, 1)))))
    assert error.message.startswith("rank 1 out[1] (x[1], line 4) slice 0 holds r1.in[1]: missing r0.in[1]")


def test_reads_garbage():
    # Rank 1 copies its own (never written) out[0] into out[1] before anything lands there.
    def edit(p):
        p[1].insert(0, Consume(COPY, (OUT(1, 0),), OUT(1, 1)))

    error = fails(*allgather2(edit))
    assert (error.rank, error.step) == (1, 0)
    assert error.message.endswith("reads r1.out[0].s0, which holds no data in call 0 (nothing writes it before)")


# ----------------------------------------------------------------------------- scale


def test_large_direct_allgather_is_fast():
    """A hand-built one-slot-per-peer push allgather at R = 72 verifies in seconds."""
    import time

    world = 72
    spec = spec_of("allgather", world)
    # One data and one ack signal per (producer, consumer) edge; staging unit p holds p's chunk.
    programs = {}
    signals = []
    for r in range(world):
        signals += [SignalDecl(sig(r, p), 1, Role.DATA) for p in range(world) if p != r]
        signals += [SignalDecl(sig(r, world + p), 1, Role.ACK) for p in range(world) if p != r]
        steps = [Consume(COPY, (IN(r, 0),), OUT(r, r))]
        for i in range(1, world):
            peer = (r + i) % world
            steps += [Wait(sig(r, world + peer), 0), Stage(IN(r, 0), ST(peer, r)), Notify(sig(peer, r), 1)]
        for i in range(1, world):
            src = (r - i) % world
            steps += [Wait(sig(r, src), 1), Consume(COPY, (ST(r, src),), OUT(r, src)), Notify(sig(src, world + r), 1)]
        programs[r] = steps
    schedule = schedule_of(spec, programs, signals, stage_units=world)
    start = time.perf_counter()
    verify(schedule, spec)
    assert time.perf_counter() - start < 30


def test_a_schedule_whose_proof_is_too_big_is_refused_before_it(monkeypatch):
    """The read cap bounds a lowering, not its proof: an all-gather's proof grows as R^3 (R=600
    took 140 s and 16 GB).  The bound is on the proof's clock entries, checked first."""
    import purlinc.snac.verify as verifier
    from purlinc.snac.lower import lower

    spec = spec_of("allgather", 4)
    schedule = lower(spec, LowerOptions())
    steps = sum(len(p.steps) for p in schedule.programs)
    entries = 2 * steps * (4 + 4)
    monkeypatch.setattr(verifier, "MAX_CLOCK_ENTRIES", entries)
    verify(schedule, spec)  # at the bound: proved
    monkeypatch.setattr(verifier, "MAX_CLOCK_ENTRIES", entries - 1)
    with pytest.raises(PurlinError) as caught:
        verify(schedule, spec)
    assert caught.value.message == (f"allgather for R=4 lowers to {steps:,} steps over 4 programs: its proof would "
                                    f"hold {entries:,} clock entries, more than one verification holds "
                                    f"({entries - 1:,})")
    assert caught.value.notes == (HIERARCHICAL_NOTE,)


# ---- schedules that were never lowered: loaded or built by hand ------------------------------

def _allgather_with(rank, change):
    from purlinc.snac.lower import lower

    spec = spec_of("allgather")
    schedule = lower(spec, LowerOptions())
    programs = list(schedule.programs)
    programs[rank] = replace(programs[rank], steps=tuple(change(programs[rank].steps)))
    return replace(schedule, programs=tuple(programs)), spec


@pytest.mark.parametrize("stray", [None, "stage everything"])
def test_an_object_that_is_no_step_is_refused(stray):
    """simulate() skipped it: the schedule verified and ran without whatever it stood for."""
    schedule, spec = _allgather_with(0, lambda steps: (stray, *steps))
    with pytest.raises(VerificationError, match=r"rank 0, channel 0, step 0 \(not a step: \w+\): .* is not a SNAC "
                                                r"step \(Stage, Notify, Wait, Consume, Epilogue\)"):
        verify(schedule, spec)


def test_positions_and_signal_numbers_that_are_not_integers_are_refused():
    """0.0 passed every bound (and failed the simulator's indexing); k=0.5 failed the proof's
    lookups with a KeyError."""
    def float_unit(steps):
        return [replace(s, srcs=(replace(s.srcs[0], unit=0.0),)) if isinstance(s, Consume) else s for s in steps]

    schedule, spec = _allgather_with(1, float_unit)
    with pytest.raises(VerificationError, match=r"a region's rank, unit and slice are integers, not 1, 0.0 and 0"):
        verify(schedule, spec)
    schedule, spec = _allgather_with(1, lambda steps: [replace(s, k=0.5) if isinstance(s, Wait) else s for s in steps])
    with pytest.raises(VerificationError, match=r"\(wait r1.sig\[\d\] k=0.5\): k=0.5 is not an integer"):
        verify(schedule, spec)


def test_stage_copies_the_kernels_cannot_address_are_refused():
    schedule, spec = _allgather_with(0, lambda steps: steps)
    with pytest.raises(VerificationError, match=r"stage_copies = 3 \(staging has 1 or 2 copies\)"):
        verify(replace(schedule, stage_copies=3), spec)


def test_a_missing_notify_list_is_cut_short():
    schedule, spec = _allgather_with(0, lambda steps: steps)
    many = replace(schedule, signals=tuple(replace(d, per_call=10**6) for d in schedule.signals))
    with pytest.raises(VerificationError) as info:
        verify(many, spec)
    assert "no notify with k=2, 3, 4, 5, 6, 7, 8, 9, ... (999,999 in all)" in info.value.message
    assert len(info.value.message) < 200


def test_a_ring_whose_proof_is_bound_to_be_too_big_stops_while_it_is_lowered(monkeypatch):
    """The proof's bound was checked after the whole lowering: a ring of millions of steps took
    gigabytes to build before the refusal (alltoall_blocks at R=128: 3.4 GB).  The ring counts
    its steps every few wavefronts and stops once the bound is passed, with the verifier's words."""
    import purlinc.snac.ring as ring
    import purlinc.snac.verify as verifier
    from purlinc.snac.ir import Algorithm
    from purlinc.snac.lower import lower

    spec = spec_of("allgather", 8)
    monkeypatch.setattr(ring, "_least_steps", lambda spec, options: 0)  # past the count made before any hop
    monkeypatch.setattr(ring, "_BUDGET_EVERY", 1)
    monkeypatch.setattr(verifier, "MAX_CLOCK_ENTRIES", 2 * 40 * (8 + 8))  # 40 steps' worth
    with pytest.raises(PurlinError) as caught:
        lower(spec, LowerOptions(algorithm=Algorithm.RING))
    assert caught.value.message.startswith("allgather for R=8 lowers to at least ")
    assert "steps over 8 programs: its proof would hold at least " in caught.value.message
    assert caught.value.notes[0] == HIERARCHICAL_NOTE


def test_a_ring_bound_to_be_too_big_is_refused_before_any_hop_is_routed(monkeypatch):
    """alltoall at R=128 routed 1.04 million hops and emitted 2.4 million steps (14 s, 1.4 GB)
    before the emission's own budget check refused it.  The ring now counts the fewest steps
    its hops will write before it routes one, and refuses there."""
    import purlinc.snac.ring as ring
    from purlinc.snac.ir import Algorithm
    from purlinc.snac.lower import lower

    def routed(*args):
        raise AssertionError("the hops were routed")
    monkeypatch.setattr(ring, "_ring_hops", routed)
    with pytest.raises(PurlinError) as caught:
        lower(spec_of("alltoall", 128), LowerOptions(algorithm=Algorithm.RING))
    assert caught.value.message.startswith("alltoall for R=128 lowers to at least 3,121,152 steps over 128 programs")


@pytest.mark.parametrize("name, world, params", [
    ("allgather", 5, {}), ("alltoall", 4, {}), ("allreduce", 3, {}), ("allreduce", 8, {}), ("reduce_scatter", 5, {}),
    ("broadcast", 5, {"root": 3}), ("reduce", 4, {"root": 1}), ("gather", 3, {"root": 2}), ("alltoall_blocks", 4, {}),
    ("ring_shift", 5, {}),
])
def test_the_rings_least_steps_never_exceed_the_steps_it_writes(name, world, params):
    """The count that refuses a ring before routing it is a lower bound of what the ring
    writes, for every slice count and with OUT registered or not: it must never refuse a ring
    the verifier would take."""
    import purlinc.snac.ring as ring
    from purlinc.snac.ir import Algorithm

    spec = check(parse_file(EXAMPLES / f"{name}.pln"), world, params)
    for slices in (1, 3):
        for registered in ((), ("out",)):
            options = LowerOptions(algorithm=Algorithm.RING, slices=slices, registered=registered)
            written = sum(len(program.steps) for program in ring.ring(spec, options).programs)
            assert 0 < ring._least_steps(spec, options) <= written, (slices, registered)


@pytest.mark.parametrize("text, world", [
    ("collective c { in[r] = x[0..r+1]  out[r] = x[r]  reduce }", 5),  # contributions on some ranks only
    ("collective c { in[r] = x, x, y[r]  out[r] = x, y[(r+1)%R]  reduce }", 4),  # one input names x twice
    ("collective c { in[r] = x, y[r]  out[r] = x, y[(r+2)%R], x  copy replicated }", 5),  # a producer on every rank
    ("collective c where R >= 3 { in[1] = x, y  out[2] = y, x  copy }", 4),  # ranks with no buffers
    ("collective c { in[r] = x[r]  out[r] = x[0], x[r], x[0], x[(r+1)%R]  copy }", 5),  # a chunk twice in an output
])
def test_the_rings_least_steps_count_exactly_the_hops_it_routes(text, world):
    """The count that refuses a ring before routing it follows the routes ``_ring_hops`` builds
    (one ``_routes`` for both): a Stage or partial reduce per slice of every hop, plus a slot
    wait and an acknowledgement for each hop landing in STAGE."""
    import purlinc.snac.ring as ring
    from purlinc.snac.ir import Algorithm

    spec = check(parse_text(text), world)
    for slices in (1, 3):
        for registered in ((), ("out",)):
            options = LowerOptions(algorithm=Algorithm.RING, slices=slices, registered=frozenset(registered))
            hops, _ = ring._ring_hops(spec, options)
            routed = sum(slices + (2 if hop.to_out is None else 0) for hop in hops)
            assert ring._least_steps(spec, options) == routed > 0, (slices, registered)
