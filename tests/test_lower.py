"""Structural tests of the SNAC lowering (purlinc.snac.lower) and its dumps (purlinc.snac.format)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from purlinc import pipeline
from purlinc.cli import main as cli_main
from purlinc.errors import PurlinError
from purlinc.frontend.evaluate import evaluate
from purlinc.snac.format import format_schedule, schedule_from_json, schedule_to_json
from purlinc.snac.ir import Algorithm, Consume, LowerOptions, Notify, Operation, Role, Space, Stage, Wait
from purlinc.snac.lower import applicable_algorithms, default_options, lower
from purlinc.snac.simulate import simulate
from purlinc.snac.verify import verify

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EXAMPLE_NAMES = sorted(p.stem for p in EXAMPLES.glob("*.pln"))


def spec_of(name: str, world_size: int, **params):
    source = pipeline.load_source(str(EXAMPLES / f"{name}.pln"))
    return pipeline.spec_stage(pipeline.parse_stage(source), world_size, params)


def steps(schedule, rank, channel=0, kind=None):
    program = schedule.program(rank, channel)
    return [s for s in program.steps if kind is None or isinstance(s, kind)]


def remote_stages(schedule, rank, channel=0):
    return [s for s in steps(schedule, rank, channel, Stage) if s.dst.rank != rank]


# ---------------------------------------------------------------- every example, every algorithm


def _lowerable():
    for name in EXAMPLE_NAMES:
        for world_size in range(1, 9):
            try:
                spec = spec_of(name, world_size)
            except PurlinError:  # e.g. pairwise_exchange at odd R
                continue
            yield name, world_size, spec


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_every_example_algorithm_size_channels_slices_verifies(name):
    for _, world_size, spec in (x for x in _lowerable() if x[0] == name):
        for algorithm in applicable_algorithms(spec):
            for channels in (1, 2):
                for slices in (1, 3):
                    options = LowerOptions(algorithm, channels, slices)
                    schedule = lower(spec, options)
                    _check_consistent(schedule, spec)
                    # The full proof is the slow part: every option at small R, the plain one at any R.
                    if world_size <= 4 or (channels, slices) == (1, 1):
                        verify(schedule, spec)


@pytest.mark.parametrize("registered", (frozenset({"in"}), frozenset({"out"}), frozenset({"in", "out"})))
@pytest.mark.parametrize("name", ("allgather", "allreduce", "alltoall", "broadcast", "reduce", "gather", "scatter", "reduce_scatter"))
def test_registered_buffers_verify(name, registered):
    for world_size in (1, 2, 3, 5):
        spec = spec_of(name, world_size)
        for algorithm in applicable_algorithms(spec):
            for slices in (1, 2):
                schedule = lower(spec, LowerOptions(algorithm, 2, slices, registered=registered))
                verify(schedule, spec)
                touched = {r.space for p in schedule.programs for s in p.steps if isinstance(s, (Stage, Consume))
                           for r in ((s.src, s.dst) if isinstance(s, Stage) else (*s.srcs, s.dst)) if r.rank != p.rank}
                allowed = {Space.STAGE} | {Space(x) for x in registered}
                assert touched <= allowed


def _check_consistent(schedule, spec):
    world, channels, S = schedule.world_size, schedule.channels, schedule.options.slices
    assert schedule.slices == channels * S
    # One channel-relative program per rank; the concrete ones shift it per channel.
    assert [(p.rank, p.channel) for p in schedule.programs] == [(r, 0) for r in range(world)]
    concrete = schedule.concrete_programs()
    assert [(p.rank, p.channel) for p in concrete] == [(r, c) for r in range(world) for c in range(channels)]
    W = schedule.channel_signals
    # Stage units: exactly the number used (max over ranks).
    used = [-1]
    for program in concrete:
        for step in program.steps:
            regions = (step.src, step.dst) if isinstance(step, Stage) else (*step.srcs, step.dst) if isinstance(step, Consume) else ()
            used += [r.unit for r in regions if r.space is Space.STAGE]
            # Every region lies on the program's channel, and so does every signal.
            assert all(r.slice // S == program.channel for r in regions)
            if isinstance(step, (Notify, Wait)):
                assert step.signal.index // W == program.channel
    assert schedule.stage_units == max(used) + 1
    # Signals: dense from 0 per rank and channel, notified exactly per_call times per call, k in 1..per_call.
    per_call = schedule.per_call()
    for rank in range(world):
        indices = sorted(d.signal.index for d in schedule.signals if d.signal.owner == rank)
        assert indices == list(range(len(indices))) and len(indices) <= W
    assert W == max((sum(1 for d in schedule.signals if d.signal.owner == r) for r in range(world)), default=0)
    assert schedule.signal_pad_size() == channels * W
    decls = schedule.signal_decls()
    assert len(decls) == channels * len(schedule.signals) and len({d.signal for d in decls}) == len(decls)
    counts = Counter(s.signal for p in schedule.programs for s in p.steps if isinstance(s, Notify))
    assert counts == Counter(per_call)
    for program in schedule.programs:
        for step in program.steps:
            if isinstance(step, Notify):
                assert 1 <= step.k <= per_call[step.signal]
            if isinstance(step, Wait):
                assert step.signal.owner == program.rank
                assert -per_call[step.signal] < step.k <= per_call[step.signal]
            if isinstance(step, Consume) and step.dst.space is Space.OUT:
                assert step.line is not None
            if not isinstance(step, Consume):
                assert step.note


# ---------------------------------------------------------------- structural facts


@pytest.mark.parametrize("channels", (1, 2))
def test_direct_push_allgather_stages_once_to_each_peer(channels):
    schedule = lower(spec_of("allgather", 4), LowerOptions(Algorithm.DIRECT_PUSH, channels=channels))
    for rank in range(4):
        for channel in range(channels):
            stages = remote_stages(schedule, rank, channel)
            assert len(stages) == 3
            assert sorted(s.dst.rank for s in stages) == sorted(set(range(4)) - {rank})
    # One DATA and one ACK signal per edge and channel, each notified once per call.
    assert len(schedule.signals) == 2 * 4 * 3 and len(schedule.signal_decls()) == 2 * 4 * 3 * channels
    assert {d.per_call for d in schedule.signals} == {1}
    assert schedule.stage_units == 3


def test_direct_push_slices_share_one_signal_per_edge():
    schedule = lower(spec_of("allgather", 3), LowerOptions(Algorithm.DIRECT_PUSH, slices=3))
    data = [d for d in schedule.signals if d.role is Role.DATA]
    assert {d.per_call for d in data} == {3}
    waits = [s for s in steps(schedule, 0, kind=Wait) if s.k > 0]
    assert sorted(w.k for w in waits) == [1, 1, 2, 2, 3, 3]


def test_direct_push_reduce_consumes_in_spec_order():
    spec = spec_of("allreduce", 4)
    schedule = lower(spec, default_options(spec))
    for rank in range(4):
        reduces = steps(schedule, rank, kind=Consume)
        assert len(reduces) == 4
        for consume in reduces:
            assert consume.operation is Operation.REDUCE and len(consume.srcs) == 4
            # the local IN sits at the position of this rank among the sources
            assert consume.srcs[rank].space is Space.IN


def _moved_units(schedule, rank):
    return sum(1 for p in schedule.concrete_programs() if p.rank == rank for s in p.steps
               if (isinstance(s, Stage) and s.dst.rank != rank) or (isinstance(s, Consume) and s.dst.rank != rank))


@pytest.mark.parametrize("world_size", (2, 3, 4, 8))
def test_ring_allreduce_moves_2_r_minus_1_over_r_of_the_data(world_size):
    schedule = lower(spec_of("allreduce", world_size), LowerOptions(Algorithm.RING))
    for rank in range(world_size):
        # the data is R chunks; each rank sends 2(R-1) chunks = 2(R-1)/R of it
        assert _moved_units(schedule, rank) == 2 * (world_size - 1)
        assert all(s.dst.rank in (rank, (rank + 1) % world_size)
                   for s in steps(schedule, rank) if isinstance(s, (Stage, Consume)))


@pytest.mark.parametrize("world_size", (2, 3, 4, 8))
def test_two_shot_reduces_each_chunk_exactly_once(world_size):
    spec = spec_of("allreduce", world_size)
    schedule = lower(spec, LowerOptions(Algorithm.TWO_SHOT))
    reduces = Counter(s.note for p in schedule.programs for s in p.steps
                      if isinstance(s, Consume) and s.operation is Operation.REDUCE)
    assert reduces == Counter({f"x[{i}]": 1 for i in range(world_size)})
    for rank in range(world_size):
        # phase 1: R-1 contributions, phase 2: R-1 results
        assert len(remote_stages(schedule, rank)) == 2 * (world_size - 1)


def test_two_shot_and_copy_rejections():
    with pytest.raises(PurlinError, match="reductions only"):
        lower(spec_of("allgather", 4), LowerOptions(Algorithm.TWO_SHOT))
    with pytest.raises(PurlinError, match="exactly direct-push"):
        lower(spec_of("reduce_scatter", 4), LowerOptions(Algorithm.TWO_SHOT))
    assert Algorithm.TWO_SHOT not in applicable_algorithms(spec_of("reduce", 4))
    assert Algorithm.TWO_SHOT in applicable_algorithms(spec_of("allreduce", 4))


def test_world_size_one_is_local_only():
    for name in ("allgather", "allreduce", "broadcast", "reduce"):
        spec = spec_of(name, 1)
        for algorithm in applicable_algorithms(spec):
            schedule = lower(spec, LowerOptions(algorithm))
            assert schedule.signals == () and schedule.stage_units == 0
            assert all(isinstance(s, Consume) for s in schedule.programs[0].steps)


def test_ring_slots_reuse_within_a_call():
    spec = spec_of("allreduce", 4)
    schedule = lower(spec, LowerOptions(Algorithm.RING, slots=2))
    assert schedule.stage_units == 2
    verify(schedule, spec)
    acks = {d.signal for d in schedule.signals if d.role is Role.ACK}
    ack_waits = sorted(s.k for s in steps(schedule, 0, kind=Wait) if s.signal in acks)
    # message m waits for ack k = m - slots + 1: -1, 0 (previous call), then 1, 2, 3, 4 (this call)
    assert ack_waits == [-1, 0, 1, 2, 3, 4]
    with pytest.raises(PurlinError, match=r"use 2 slots or more \(slots=2, or --slots 2 on the command line\)"):
        lower(spec, LowerOptions(Algorithm.RING, slots=1))


def test_direct_pull_reads_remotely():
    spec = spec_of("allgather", 3)
    schedule = lower(spec, LowerOptions(Algorithm.DIRECT_PULL))
    for rank in range(3):
        assert remote_stages(schedule, rank) == []
        remote = [s for s in steps(schedule, rank, kind=Consume) if s.srcs[0].rank != rank]
        assert len(remote) == 2 and all(s.srcs[0].space is Space.STAGE for s in remote)
    registered = lower(spec, LowerOptions(Algorithm.DIRECT_PULL, registered=frozenset({"in"})))
    assert registered.stage_units == 0


# ---------------------------------------------------------------- results on NumPy buffers


@pytest.mark.parametrize("algorithm", list(Algorithm))
@pytest.mark.parametrize("name", ("allreduce", "reduce_scatter", "reduce"))
def test_simulated_reductions(name, algorithm):
    rng = np.random.default_rng(1)
    for world_size in (1, 3, 4):
        spec = spec_of(name, world_size)
        if algorithm not in applicable_algorithms(spec):
            continue
        count = 20
        schedule = lower(spec, LowerOptions(algorithm, 2, 2))
        floats = [rng.standard_normal(len(x) * count).astype(np.float32) for x in spec.inputs]
        got = simulate(schedule, spec, floats, count, "float32", "sum", seed=3)
        want = evaluate(spec, floats, count, "float32", "sum")
        for a, b in zip(got, want):
            if algorithm is Algorithm.RING:  # another association order: close, not bitwise
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
            else:
                assert a.tobytes() == b.tobytes()
        if name == "allreduce":  # every rank holds the same bits
            assert all(a.tobytes() == got[0].tobytes() for a in got)
        ints = [rng.integers(-1000, 1000, len(x) * count).astype(np.int32) for x in spec.inputs]
        got = simulate(schedule, spec, ints, count, "int32", "sum", seed=4)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(got, evaluate(spec, ints, count, "int32", "sum")))


# ---------------------------------------------------------------- dumps and CLI


def test_json_round_trip_and_text():
    spec = spec_of("allreduce", 3)
    for algorithm in applicable_algorithms(spec):
        schedule = lower(spec, LowerOptions(algorithm, 2, 2))
        data = schedule_to_json(schedule)
        assert schedule_from_json(json.loads(json.dumps(data))) == schedule
    text = format_schedule(lower(spec, default_options(spec)))
    assert "reduce  (r0.in[0].s0, r0.stage[0].s0, r0.stage[3].s0) -> r0.out[0].s0" in text
    assert "wait    r0.sig[0] >= e*1+1" in text


def test_default_options():
    options = default_options(spec_of("allreduce", 4))
    assert (options.algorithm, options.channels, options.slices) == (Algorithm.DIRECT_PUSH, 1, 1)


def test_cli_dump_and_check(capsys):
    assert cli_main(["dump", str(EXAMPLES / "allreduce.pln"), "--ranks", "8", "--stage", "snac"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("schedule allreduce (R=8, reduce)") and "rank 7 (every channel)" in out
    assert cli_main(["check", str(EXAMPLES / "alltoall.pln"), "--ranks", "1..16"]) == 0
    assert "alltoall: ok for R=1..16" in capsys.readouterr().out
    assert cli_main(["dump", str(EXAMPLES / "allgather.pln"), "-R", "4", "-s", "snac", "-a", "two-shot"]) == 2
    assert "two-shot applies to reductions only" in capsys.readouterr().err


# ---------------------------------------------------------------- direct-push: slices pipelined

@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_direct_push_pipelines_slices(name, world):
    """With several slices, every rank sends slice s before it copies out (or reduces) slice
    s-1, and does that before the notify whose release waits for slice s's stores: the
    copy-out overlaps the stores' flight (docs/SNAC.md).  The schedule still verifies and
    computes the spec."""
    try:
        spec = spec_of(name, world)
    except PurlinError as error:  # e.g. pairwise_exchange needs an even R
        pytest.skip(str(error).splitlines()[0])
    S = 3
    schedule = lower(spec, LowerOptions(Algorithm.DIRECT_PUSH, channels=1, slices=S))
    verify(schedule, spec)
    overlapped = 0
    for rank in range(world):
        program = schedule.program(rank, 0).steps
        stages = {s: [i for i, st in enumerate(program) if isinstance(st, Stage) and st.src.slice == s]
                  for s in range(S)}
        consumes = {s: [i for i, st in enumerate(program) if isinstance(st, Consume) and st.dst.slice == s
                        and any(r.space is Space.STAGE for r in st.srcs)] for s in range(S)}
        notifies = [i for i, st in enumerate(program) if isinstance(st, Notify)]
        for s in range(1, S):
            if not (stages[s] and consumes[s - 1]):
                continue  # a rank that only sends or only receives keeps the plain order
            assert max(stages[s]) < min(consumes[s - 1]), f"r{rank}: slice {s - 1} consumed before slice {s} is sent"
            release = min(n for n in notifies if n > max(stages[s]))
            assert max(consumes[s - 1]) < release, f"r{rank}: slice {s} notified before slice {s - 1} is consumed"
            overlapped += 1
    if name in ("allgather", "allreduce", "alltoall", "reduce_scatter"):  # every rank sends and receives
        assert overlapped == world * (S - 1), overlapped
    rng = np.random.default_rng(world)
    from purlinc.dtypes import DType, random_values

    inputs = [random_values(rng, len(spec.inputs[r]) * 37, DType.FLOAT32) for r in range(world)]
    op = "sum" if spec.is_reduce else None
    got = simulate(schedule, spec, inputs, 37, DType.FLOAT32, op, calls=2)
    want = evaluate(spec, inputs, 37, DType.FLOAT32, op)
    for r in range(world):
        np.testing.assert_array_equal(got[r], want[r])


@pytest.mark.parametrize("channels, slices", [(1025, 1), (1, 257), (1, 100_000)])
def test_channels_and_slices_are_bounded(channels, slices, capsys):
    """A mistyped --slices 100000 is an error at once, not minutes of lowering."""
    with pytest.raises(PurlinError, match="channels must be at most 1024 and slices per channel at most 256"):
        lower(spec_of("allreduce", 4), LowerOptions(channels=channels, slices=slices))
    argv = ["dump", str(EXAMPLES / "allreduce.pln"), "-R", "4", "-s", "snac", "--channels", str(channels),
            "--slices", str(slices)]
    assert cli_main(argv) == 2 and "at most 256" in capsys.readouterr().err


def test_the_bounds_themselves_lower():
    assert lower(spec_of("allgather", 2), LowerOptions(channels=1024, slices=1)).channels == 1024
    assert lower(spec_of("allgather", 2), LowerOptions(channels=1, slices=256)).options.slices == 256


def test_a_schedule_too_large_to_lower_is_refused_at_once():
    """All-reduce at R=128 took 60 s and 4 GB to lower, at R=300 the process ran out of memory:
    past 2^20 chunk reads the lowering refuses before building anything."""
    import time

    start = time.monotonic()
    with pytest.raises(PurlinError, match=r"allreduce for R=128 reads 2,097,152 chunks .* more than one schedule "
                                          r"holds \(1,048,576\)"):
        lower(spec_of("allreduce", 128), LowerOptions())
    assert time.monotonic() - start < 5
    with pytest.raises(PurlinError, match=r"x 64 slice\(s\) per channel"):
        lower(spec_of("allreduce", 32), LowerOptions(slices=64))


@pytest.mark.parametrize("options, message", [
    ({"channels": 0}, "channels and slices must be >= 1 (got channels=0, slices=1)"),
    ({"slices": -1}, "channels and slices must be >= 1 (got channels=1, slices=-1)"),
    ({"channels": 1025}, "channels must be at most 1024 and slices per channel at most 256"),
    ({"slots": 0}, "slots must be >= 1 (got 0)"),
    # these lowered and verified, keyed the cache as "cTrue" / "c2.0" and failed in the simulator
    ({"channels": True}, "channels must be an integer, got True"),
    ({"channels": 2.0}, "channels must be an integer, got 2.0"),
    ({"slices": "2"}, "slices must be an integer, got '2'"),
    ({"slots": 1.5}, "slots must be an integer, got 1.5"),
])
def test_lowering_options_are_checked(options, message):
    with pytest.raises(PurlinError) as caught:
        lower(spec_of("allgather", 2), LowerOptions(**options))
    assert caught.value.message.startswith(message)


def test_the_options_key_pattern_reads_every_key_the_options_write():
    """draw --trace reads slots and registered buffers back from a trace's key with it."""
    from purlinc.snac.ir import KEY_PATTERN

    for options in (LowerOptions(), LowerOptions(Algorithm.RING, channels=3, slices=2, slots=4),
                    LowerOptions(registered=frozenset({"in", "out"}), packed=True),
                    LowerOptions(registered=frozenset({"out"}), stage_copies=2)):
        match = KEY_PATTERN.fullmatch(options.key())
        assert match is not None, options.key()
        assert match["slots"] == ("all" if options.slots is None else str(options.slots))
        assert match["registered"] == (",".join(sorted(options.registered)) or "-")


def test_too_many_reads_suggests_fewer_slices_only_where_fewer_fit():
    """Past the reads bound at one slice, the note "or with fewer slices" named an option that
    cannot help (there is no fewer); where a smaller count fits, the note says which."""
    from purlinc.snac.ir import HIERARCHICAL_NOTE

    with pytest.raises(PurlinError) as caught:
        lower(spec_of("allreduce", 102), LowerOptions())
    assert caught.value.notes == (HIERARCHICAL_NOTE,)
    with pytest.raises(PurlinError) as caught:
        lower(spec_of("allreduce", 128), LowerOptions(slices=4))
    assert caught.value.notes == (HIERARCHICAL_NOTE,)  # 2,097,152 reads at one slice already
    with pytest.raises(PurlinError) as caught:
        lower(spec_of("allreduce", 32), LowerOptions(slices=64))  # 32,768 reads a slice: 32 fit
    assert caught.value.notes == (HIERARCHICAL_NOTE, "or with at most 32 slice(s) per channel")
    from purlinc.snac.lower import MAX_READS

    assert spec_of("allreduce", 32).reads * 32 == MAX_READS  # 32 slices is exactly the bound


def test_too_many_packed_sources_suggests_only_algorithms_that_apply():
    """Packed stages over more than 32 sources: the note named two-shot for a rooted reduce too,
    which two-shot refuses (every chunk goes to one rank)."""
    with pytest.raises(PurlinError) as caught:
        lower(spec_of("reduce", 33), LowerOptions(packed=True))
    assert caught.value.notes[0] == "drop packed: plain direct-push reduces any number of sources"
    with pytest.raises(PurlinError) as caught:
        lower(spec_of("allreduce", 33), LowerOptions(packed=True))
    assert caught.value.notes[0] == "drop packed: plain direct-push (or two-shot) reduces any number of sources"


def test_a_proof_bound_to_be_too_big_is_refused_before_lowering(monkeypatch):
    """All-gather on direct-push at R=700 lowered 3.9 million steps (14 s, 1.4 GB) before the
    verifier refused its proof: every output slice needs a step of its own, so past the bound
    the lowering is refused before it builds anything, in the verifier's words."""
    import purlinc.snac.direct as direct
    from purlinc.snac.ir import HIERARCHICAL_NOTE

    def lowered(*args):
        raise AssertionError("the schedule was lowered")
    monkeypatch.setattr(direct, "direct_push", lowered)
    with pytest.raises(PurlinError) as caught:
        lower(spec_of("allgather", 520), LowerOptions(stage_copies=2))
    assert caught.value.message.startswith("allgather for R=520 lowers to at least 540,800 steps over 520 programs")
    assert caught.value.notes[0] == HIERARCHICAL_NOTE


@pytest.mark.parametrize("text", [
    "collective c { in[r] = x[r]  out[r] = x[0..R]  copy }",
    "collective c { in[r] = x[0..R]  out[r] = x[0..R], x[0]  reduce }",
    "collective c { in[r] = x[r]  out[r] = x[0], x[r], x[0]  copy }",
    "collective c with sizes n[R] of x { in[r] = x[r]  out[r] = x[0..R], x[r]  copy }",
    "collective c(h = 8) with rows res { in[r] = x  out[r] = x  reduce  epilogue rows(h) { out = out + res } }",
])
def test_the_least_proof_steps_never_exceed_the_proofs_steps(text):
    """The count that refuses a schedule before it is lowered is a lower bound of the steps the
    verifier counts (``verify._check_proof_size``) for every algorithm and option: it must never
    refuse a schedule the verifier would take."""
    from purlinc.frontend.check import check
    from purlinc.frontend.parse import parse
    from purlinc.snac.lower import _least_proof_steps

    options_list = [dict(), dict(stage_copies=2), dict(packed=True), dict(slices=3, channels=2),
                    dict(registered=frozenset({"in", "out"})), dict(slices=2, stage_copies=2)]
    for world in (1, 2, 3, 5):
        spec = check(parse(text), world)
        for algorithm in applicable_algorithms(spec):
            for changes in options_list:
                options = LowerOptions(algorithm=algorithm, **changes)
                try:
                    schedule = lower(spec, options)
                except PurlinError:
                    continue
                written = sum(len(program.steps) for program in schedule.programs)
                packed = sum(1 for p in schedule.programs for step in p.steps if isinstance(step, Stage) and step.packed)
                assert 0 < _least_proof_steps(spec, options) <= (written + packed) * schedule.stage_copies, \
                    (world, options.key())
