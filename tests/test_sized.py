"""Run-time sizes (docs/LANGUAGE.md, "Run-time sizes"; docs/SNAC.md): the language, the
checker's located errors, the lowering and its proof obligations, and the simulator against
the evaluator on thousands of size vectors (zeros, everything to one rank, exactly at
capacity, over it)."""

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from purlinc.errors import PurlinError
from purlinc.frontend.evaluate import arriving_sizes, evaluate_sized, received_sizes, sent_sizes
from purlinc.frontend.parse import parse
from purlinc.pipeline import load_source, spec_of
from purlinc.snac.format import schedule_from_json, schedule_to_json
from purlinc.snac.ir import Consume, LowerOptions, Wait
from purlinc.snac.lower import lower
from purlinc.snac.simulate import SimulationError
from purlinc.snac.simulate_sized import channel_bytes, simulate_sized
from purlinc.snac.verify import VerificationError, verify

SIZED = Path(__file__).resolve().parent.parent / "examples" / "sized"


def _spec(name: str, R: int):
    return spec_of(load_source(SIZED / f"{name}.pln"), R, None)


def _render(error: PurlinError) -> str:
    return error.render()


def test_parse_round_trip_and_format():
    definition = parse((SIZED / "alltoallv.pln").read_text(), "a.pln")
    assert definition.sizes.format() == "sizes n[R][R] of x"
    assert parse(definition.format()) == definition
    spec = _spec("alltoallv", 3)
    assert spec.sizes.extents == (3, 3) and spec.sizes.size_name(spec.inputs[1][2]) == "n[1][2]"
    assert "sizes n[3][3] of x (run-time, packed)" in spec.format()
    assert spec.to_json()["sizes"] == {"operand": "n", "chunk": "x", "extents": [3, 3]}


@pytest.mark.parametrize("source, expected", [
    ("collective a with sizes n[R][R] of x { in[r] = x[r][0..R] out[r] = x[0..R][r] reduce }",
     "s.pln:1:79: error: 'reduce' cannot have run-time sizes: a reduction adds chunks of equal length"),
    ("collective a with sizes n[R][R] of x { in[r] = x[r][0..R] out[r] = x[0..R][r] copy replicated }",
     "s.pln:1:79: error: 'copy replicated' cannot have run-time sizes"),
    ("collective a with sizes n[R] of x { in[r] = x[r][0..R] out[r] = x[0..R][r] copy }",
     "s.pln:1:19: error: 'n' has 1 extent(s) but chunk 'x' is used with 2 indices"),
    ("collective a with sizes n[R][R - 1] of x { in[r] = x[r][0..R] out[r] = x[0..R][r] copy }",
     "s.pln:1:52: error: chunk x[0][2] of in[0] lies outside the extents of 'n[3][2]'"),
    ("collective a with sizes n[R][0] of x { in[r] = x[r][0..R] out[r] = x[0..R][r] copy }",
     "s.pln:1:30: error: extent '0' of 'n' is 0; it must be at least 1"),
    ("collective a with sizes x[R] of x { in[r] = x[r] out[r] = x[0..R] copy }",
     "s.pln:1:19: error: operand 'x' has the name of a chunk"),
    ("collective a(k = 1) with sizes k[R] of x { in[r] = x[r] out[r] = x[0..R] copy }",
     "s.pln:1:26: error: operand 'k' has the name of a parameter"),
    ("collective a with sizes n[R] of y { in[r] = x[r] out[r] = x[0..R] copy }",
     "s.pln:1:19: error: 'sizes n ... of y': no layout names a chunk 'y'"),
    ("collective a with sizes n[R] of x { in[r] = x[r], y[r] out[r] = x[0..R] copy }",
     "s.pln:1:51: error: chunk 'y' has no size: in a collective with run-time sizes every chunk is sized by 'n' (of 'x')"),
    ("collective a with sizes n[R] of x, sizes m[R] of x { in[r] = x[r] out[r] = x[0..R] copy }",
     "s.pln:1:36: error: a collective has at most one 'sizes' operand"),
])
def test_checker_refuses_with_a_location(source, expected):
    from purlinc.frontend.check import check

    with pytest.raises(PurlinError) as caught:
        check(parse(source, "s.pln"), 3)
    assert _render(caught.value).splitlines()[0].startswith(expected)
    assert "note: while checking a for R=3" in _render(caught.value)


def test_sizes_is_a_keyword():
    with pytest.raises(PurlinError, match="unexpected keyword 'sizes'"):
        parse("collective a { in[r] = sizes[r] out[r] = sizes[0..R] copy }", "s.pln")


@pytest.mark.parametrize("name", ["alltoallv", "allgatherv"])
@pytest.mark.parametrize("R", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("channels", [1, 2, 3])
def test_lowered_and_verified(name, R, channels):
    spec = _spec(name, R)
    schedule = lower(spec, LowerOptions(channels=channels))
    assert schedule.sizes == spec.sizes and schedule.stage_copies == 2
    verify(schedule, spec)
    assert schedule_from_json(schedule_to_json(schedule)) == schedule


@pytest.mark.parametrize("options, words", [
    (LowerOptions(slices=2), "2 slices per channel"),
    (LowerOptions(registered=frozenset({"out"})), "registered out buffers"),
    (LowerOptions(packed=True), "packed (LL) stages"),
])
def test_options_refused(options, words):
    with pytest.raises(PurlinError, match=r"cannot be lowered with .*" + words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        lower(_spec("alltoallv", 3), options)


def test_verifier_refuses_an_offset_used_before_its_wait():
    """Undo the deferral: rank 1's own chunk goes to OUT unit 1, whose offset needs the size
    of OUT unit 0, which rank 0 sends; copying it before the waits must be refused."""
    spec = _spec("alltoallv", 3)
    schedule = lower(spec, LowerOptions())
    program = schedule.programs[1]
    steps = list(program.steps)
    local = next(i for i, s in enumerate(steps) if isinstance(s, Consume) and s.srcs[0].space.value == "in")
    first_wait = next(i for i, s in enumerate(steps) if isinstance(s, Wait))
    assert local > first_wait  # the lowering moved it after the waits
    steps.insert(first_wait, steps.pop(local))
    bad = replace(schedule, programs=(schedule.programs[0], replace(program, steps=tuple(steps)),
                                      *schedule.programs[2:]))
    with pytest.raises(VerificationError, match="needs the size of OUT unit 0 .* no Wait before this step"):
        verify(bad, spec)


def test_verifier_counts_size_header_reads_as_reads_of_the_slot():
    """Rank 0 copies rank 1's chunk from staging into OUT unit 0, releases the slot (ACK),
    then copies its own chunk into OUT unit 1, whose offset is OUT unit 0's size, read from
    that slot's header.  Released first, the slot may be restaged by rank 1's call two on, so
    the offset read a later call's size: the simulator finds wrong data for some schedules of
    the threads.  The verifier accepted it (header reads were not reads of the slot)."""
    spec = spec_of(load_source("collective g with sizes n[R] of x { in[r] = x[r]  out[0] = x[1], x[0]  copy }"), 2, None)
    schedule = lower(spec, LowerOptions())
    verify(schedule, spec)
    program = schedule.programs[0]
    kinds = [type(step).__name__ for step in program.steps]
    assert kinds == ["Wait", "Consume", "Consume", "Notify"], kinds  # wait, own copy, staged copy, ACK
    wait, own, staged, ack = program.steps
    assert own.srcs[0].space.value == "in" and staged.srcs[0].space.value == "stage"
    bad = replace(schedule, programs=(replace(program, steps=(wait, staged, ack, own)), *schedule.programs[1:]))
    with pytest.raises(VerificationError, match=r"rank 1, channel 0, step \d+ in call 2 \(stage .*\): overwrites "
                                                r"r0\.stage\[\d+\]\.s0, which the consume at rank 0 channel 0 step 3 "
                                                r"reads.*\(the slot is reused too early\)"):
        verify(bad, spec)


def test_verifier_refuses_a_wrong_size_symbol():
    spec = _spec("alltoallv", 2)
    schedule = lower(spec, LowerOptions())
    other = spec.__class__(**{f: getattr(spec, f) for f in spec.__slots__ if f != "sizes"}, sizes=None)
    with pytest.raises(VerificationError, match="its sizes"):
        verify(schedule, other)


def test_evaluator_rules():
    assert sent_sizes([2, -1, 9, 3, 4], capacity=8, in_length=9) == (
        [0, 2, 2, 10, 13], [2, 0, 0, 0, 0],
        [(1, "capacity", -1, 8), (2, "capacity", 9, 8), (3, "input", 3, -1), (4, "input", 4, -4)])
    assert received_sizes([3, 4, 2], out_length=6) == ([0, 3, 3], [3, 0, 2], [(1, "output", 4, 3)])
    # expected sizes lay the output out whatever arrives: a chunk that differs is not written,
    # the next one still starts after the expected size (clamped to 0..capacity)
    assert received_sizes([3, 4, 2, 1], out_length=20, expected=[3, 5, 2, 1], capacity=8) == (
        [0, 3, 8, 10], [3, 0, 2, 1], [(1, "expected", 4, 5)])
    assert received_sizes([0, 2, 1], out_length=20, expected=[-4, 2, 9], capacity=8) == (
        [0, 0, 2], [0, 2, 0], [(0, "expected", 0, -4), (2, "expected", 1, 9)])
    assert received_sizes([2, 3], out_length=4, expected=[2, 3], capacity=8) == (
        [0, 2], [2, 0], [(1, "output", 3, 2)])
    with pytest.raises(ValueError, match="need the capacity"):
        received_sizes([1], out_length=4, expected=[1])
    assert channel_bytes(100, 3, 0) == (0, 48) and channel_bytes(100, 3, 2) == (96, 100)
    assert channel_bytes(0, 4, 3) == (0, 0)


@pytest.mark.parametrize("R, channels", [(2, 1), (3, 2), (5, 3)])
def test_simulator_equals_evaluator_with_expected_sizes(R, channels):
    """Every rank passes the sizes it expects; some are off by one, some negative or over the
    capacity: the simulator lays the outputs out by them, as the evaluator does."""
    spec = _spec("alltoallv", R)
    schedule = lower(spec, LowerOptions(channels=channels))
    rng = np.random.default_rng(R * 10 + channels)
    capacity = 23
    wrong = 0
    for trial in range(12):
        calls = []
        for call in range(3):
            sizes = [[int(v) for v in rng.integers(0, capacity + 1, R)] for _ in range(R)]
            expected = [[sizes[src][dst] for src in range(R)] for dst in range(R)]
            for _ in range(trial % 3):  # none, one or two wrong expectations in the call
                dst, src = int(rng.integers(R)), int(rng.integers(R))
                expected[dst][src] = int(rng.choice([expected[dst][src] + 1, expected[dst][src] - 1, -3, capacity + 2]))
            ins = [rng.integers(1, 60000, R * capacity, dtype=np.uint16) for _ in range(R)]
            outs = [np.zeros(R * capacity + 4, dtype=np.uint16) for _ in range(R)]
            calls.append((ins, sizes, outs, expected))
        got = simulate_sized(schedule, spec, calls, capacity, seed=trial)
        for (ins, sizes, outs, expected), (outputs, out_sizes) in zip(calls, got):
            want, want_sizes, errors = evaluate_sized(spec, ins, sizes, capacity, outs, expected)
            assert out_sizes == want_sizes
            for a, b in zip(outputs, want):
                np.testing.assert_array_equal(a, b)
            wrong += sum(e[2] == "expected" for rank_errors in errors for e in rank_errors)
            for dst in range(R):  # every chunk that was written lies at the offset its expectation gives it
                for m, written in enumerate(want_sizes[dst]):
                    if written:
                        offset = sum(min(max(v, 0), capacity) for v in expected[dst][:m])
                        start = sum(min(max(v, 0), capacity) for v in sizes[m][:dst])
                        np.testing.assert_array_equal(want[dst][offset:offset + written], ins[m][start:start + written])
    assert wrong >= 10


def _vectors(rng, R, capacity, trial):
    """Size vectors of every kind the issue names, by trial number."""
    kind = trial % 6
    if kind == 0:
        return [[0] * R for _ in range(R)]  # all zero
    if kind == 1:
        target = int(rng.integers(R))  # every rank sends everything to one rank
        return [[capacity if d == target else 0 for d in range(R)] for _ in range(R)]
    if kind == 2:
        return [[capacity] * R for _ in range(R)]  # exactly at capacity
    if kind == 3:  # over capacity and negative, somewhere
        sizes = [list(rng.integers(0, capacity + 1, R)) for _ in range(R)]
        sizes[int(rng.integers(R))][int(rng.integers(R))] = capacity + 1 + int(rng.integers(3))
        sizes[int(rng.integers(R))][int(rng.integers(R))] = -1
        return sizes
    return [list(rng.integers(0, capacity + 1, R)) for _ in range(R)]


@pytest.mark.parametrize("R, channels", [(1, 1), (2, 1), (2, 2), (3, 3), (4, 2), (5, 1), (8, 2)])
def test_simulator_equals_evaluator_on_many_size_vectors(R, channels):
    spec = _spec("alltoallv", R)
    schedule = lower(spec, LowerOptions(channels=channels))
    rng = np.random.default_rng(R * 100 + channels)
    capacity = 41  # 82 bytes: every channel's share of a chunk changes with its size
    vectors = 0
    for trial in range(60 if R < 8 else 24):
        calls = []
        for call in range(3):  # consecutive calls: both staging copies, changing sizes
            sizes = _vectors(rng, R, capacity, trial + call)
            ins = [rng.integers(1, 60000, R * capacity, dtype=np.uint16) for _ in range(R)]
            short = int(rng.integers(0, capacity + 1)) if trial % 4 == 3 else 0  # output too short
            outs = [np.zeros(R * capacity - short, dtype=np.uint16) for _ in range(R)]
            calls.append((ins, sizes, outs))
        got = simulate_sized(schedule, spec, calls, capacity, seed=trial)
        for (ins, sizes, outs), (outputs, out_sizes) in zip(calls, got):
            expected, expected_sizes, _ = evaluate_sized(spec, ins, sizes, capacity, outs)
            assert out_sizes == expected_sizes
            for a, b in zip(outputs, expected):
                np.testing.assert_array_equal(a, b)
            vectors += 1
    assert vectors >= 72


def test_allgatherv_simulated():
    R, capacity = 4, 30
    spec = _spec("allgatherv", R)
    schedule = lower(spec, LowerOptions(channels=2))
    rng = np.random.default_rng(7)
    for trial in range(20):
        calls = [([rng.integers(1, 99, capacity, dtype=np.int32) for _ in range(R)],
                  [[int(rng.integers(0, capacity + 1))] for _ in range(R)],
                  [np.zeros(R * capacity, dtype=np.int32) for _ in range(R)]) for _ in range(2)]
        for (ins, sizes, outs), (outputs, out_sizes) in zip(calls, simulate_sized(schedule, spec, calls, capacity, seed=trial)):
            expected, expected_sizes, _ = evaluate_sized(spec, ins, sizes, capacity, outs)
            assert out_sizes == expected_sizes == [[s[0] for s in sizes]] * R
            for a, b in zip(outputs, expected):
                np.testing.assert_array_equal(a, b)


def _bad_call(case: str):
    """A call of alltoallv at R=3, capacity 5, with one thing wrong (``case``)."""
    R, cap = 3, 5
    ins = [np.arange(R * cap, dtype=np.int32) for _ in range(R)]
    outs = [np.zeros(R * cap, dtype=np.int32) for _ in range(R)]
    sizes = [[1, 2, 3] for _ in range(R)]
    expected = None
    if case == "dtypes":
        outs[1] = outs[1].astype(np.int16)
    elif case == "2-D":
        ins[0] = ins[0].reshape(R, cap)
    elif case == "ranks":
        sizes = sizes[:2]
    elif case == "extra rank":
        sizes = sizes + [[0, 0, 0]]
    elif case == "float size":
        sizes[1][0] = 1.7
    elif case == "bool size":
        sizes[2][2] = True
    elif case == "short row":
        sizes[0] = [1, 2]
    elif case == "nested":
        sizes[0] = [[1], [2], [3]]
    elif case == "expected":
        expected = [[1, 1, 1]] * 2
    elif case == "capacity":
        cap = -1
    elif case == "no capacity":
        cap = 0
    elif case == "float capacity":
        cap = 2.5
    return ins, sizes, cap, outs, expected


@pytest.mark.parametrize("case, message", [
    ("dtypes", "output of rank 1: dtype int16, expected int32 (that of rank 0's input)"),
    ("2-D", "input of rank 0: expected a 1-D NumPy array (the rank's whole buffer), got (3, 5)"),
    ("ranks", "sizes: expected one per rank (3), got 2"),
    ("extra rank", "sizes: expected one per rank (3), got 4"),
    ("float size", "sizes of rank 1[0]: expected an integer, got 1.7 (float)"),
    ("bool size", "sizes of rank 2[2]: expected an integer, got True (bool)"),
    ("short row", "sizes of rank 0: expected 3 integers, got 2"),
    ("nested", "sizes of rank 0[0]: expected an integer, got [1] (list)"),
    ("expected", "expected: expected one per rank (3), got 2"),
    ("capacity", "capacity must be >= 1, got -1"),
    ("no capacity", "capacity must be >= 1, got 0"),  # a load refuses 0 too
    ("float capacity", "capacity must be an integer, got 2.5 (float)"),
])
def test_a_sized_call_no_kernel_could_be_given_is_refused_alike(case, message):
    """The evaluator and the simulator check a call's arguments the same way (one function):
    a wrong one is a ValueError naming it, not a truncated size, a bare IndexError or two
    different answers."""
    spec = _spec("alltoallv", 3)
    schedule = lower(spec, LowerOptions())
    ins, sizes, cap, outs, expected = _bad_call(case)
    with pytest.raises(ValueError) as evaluated:
        evaluate_sized(spec, ins, sizes, cap, outs, expected)
    with pytest.raises(ValueError) as simulated:
        simulate_sized(schedule, spec, [(ins, sizes, outs, expected)], cap)
    assert message in str(evaluated.value), evaluated.value
    assert str(simulated.value) == str(evaluated.value)


def test_sizes_as_numpy_integers_are_sizes():
    spec = _spec("alltoallv", 3)
    ins, sizes, cap, outs, _ = _bad_call("none")
    as_lists = evaluate_sized(spec, ins, sizes, cap, outs)
    for kind in (np.int32, np.int64):
        got = evaluate_sized(spec, ins, [np.array(row, dtype=kind) for row in sizes], cap, outs)
        assert got[1] == as_lists[1] and all(np.array_equal(a, b) for a, b in zip(got[0], as_lists[0]))


DUPLICATED = {  # an output that holds a run-time-sized chunk twice
    "own": "collective s with sizes n[R] of x {\n    in[r] = x[r]\n    out[r] = x[r], x[r]\n    copy\n}\n",
    "all": "collective s with sizes n[R] of x {\n    in[r] = x[r]\n    out[r] = x[0..R], x[0..R]\n    copy\n}\n",
}


@pytest.mark.parametrize("R, channels", [(1, 1), (2, 2), (3, 1), (4, 2)])
@pytest.mark.parametrize("which", sorted(DUPLICATED))
def test_a_chunk_held_twice_is_copied_from_its_source_each_time(which, R, channels):
    """The second copy of a chunk reads own IN or the STAGE slot, not the first OUT unit (whose
    offset and size symbol are another unit's): verified, and simulated equal to the oracle."""
    spec = spec_of(load_source(DUPLICATED[which]), R, {})
    schedule = lower(spec, LowerOptions(channels=channels))
    verify(schedule, spec)
    for program in schedule.programs:
        assert all(src.space.name != "OUT" for step in program.steps if isinstance(step, Consume) for src in step.srcs)
    rng, capacity = np.random.default_rng(R), 13
    calls = [([rng.integers(1, 99, capacity, dtype=np.int32) for _ in range(R)],
              [[int(rng.integers(0, capacity + 1))] for _ in range(R)],
              [np.zeros(2 * len(spec.outputs[0]) * capacity, dtype=np.int32) for _ in range(R)]) for _ in range(3)]
    for (ins, sizes, outs), (outputs, out_sizes) in zip(calls, simulate_sized(schedule, spec, calls, capacity, seed=R)):
        expected, expected_sizes, _ = evaluate_sized(spec, ins, sizes, capacity, outs)
        assert out_sizes == expected_sizes
        for a, b in zip(outputs, expected):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("R, channels", [(2, 1), (3, 2), (5, 3)])
def test_a_rank_with_nothing_to_do_is_simulated(R, channels):
    """Only rank 0 receives (a gather of one chunk each from rank 0 itself, or of every rank's
    first chunk): every other rank's program has no steps, and the simulator ran them at step 0
    of a call (IndexError).  Equal to the oracle over three calls of new sizes."""
    sources = ("collective s with sizes n[R] of x {\n    in[r] = x[r]\n    out[0] = x[0]\n    copy\n}\n",
               "collective s with sizes n[R][R] of x {\n    in[r] = x[r][0..R]\n    out[0] = x[0][0]\n    copy\n}\n")
    for source in sources:
        spec = spec_of(load_source(source), R, {})
        schedule = lower(spec, LowerOptions(channels=channels))
        verify(schedule, spec)
        assert any(not schedule.program(r, 0).steps for r in range(R))
        rng, capacity = np.random.default_rng(R), 11
        calls = [([rng.integers(1, 99, capacity * len(spec.inputs[r]), dtype=np.int32) for r in range(R)],
                  [[int(rng.integers(0, capacity + 1)) for _ in spec.inputs[r]] for r in range(R)],
                  [np.zeros(len(spec.outputs[r]) * capacity, dtype=np.int32) for r in range(R)]) for _ in range(3)]
        for seed in (0, 1):
            for (ins, sizes, outs), (outputs, out_sizes) in zip(calls, simulate_sized(schedule, spec, calls, capacity,
                                                                                        seed=seed)):
                expected, expected_sizes, _ = evaluate_sized(spec, ins, sizes, capacity, outs)
                assert out_sizes == expected_sizes
                for a, b in zip(outputs, expected):
                    np.testing.assert_array_equal(a, b)


def test_channel_regions_hold_across_calls_of_other_sizes():
    """Channel c's share of a chunk moves with the chunk's size; if it were stored at its
    offset in the chunk, a producer's channel 0 two calls later (a larger chunk) would
    overwrite what the consumer's channel 1, running a call behind, has yet to read.  Sizes
    32, 8, 40 of uint16 make exactly that overlap; priority schedules (odd seeds) make
    channel 1 lag."""
    spec = _spec("alltoallv", 2)
    schedule = lower(spec, LowerOptions(channels=2))
    rng = np.random.default_rng(0)
    calls = [([rng.integers(1, 60000, 80, dtype=np.uint16) for _ in range(2)], [[n, n], [n, n]],
              [np.zeros(80, dtype=np.uint16) for _ in range(2)]) for n in (32, 8, 40)]
    for seed in range(1, 40, 2):
        for (ins, sizes, outs), (outputs, _) in zip(calls, simulate_sized(schedule, spec, calls, 40, seed=seed)):
            for a, b in zip(outputs, evaluate_sized(spec, ins, sizes, 40, outs)[0]):
                np.testing.assert_array_equal(a, b)


def test_simulator_catches_a_shared_header():
    """The header word is per channel; a schedule whose consumer reads sizes before its Wait
    reads a header never written (or a stale one), and the simulator says so."""
    spec = _spec("alltoallv", 2)
    schedule = lower(spec, LowerOptions())
    program = schedule.programs[1]
    steps = [s for s in program.steps if not isinstance(s, Wait)]
    bad = replace(schedule, programs=(schedule.programs[0], replace(program, steps=tuple(steps))))
    calls = [([np.arange(8, dtype=np.uint16)] * 2, [[2, 3], [1, 1]], [np.zeros(8, dtype=np.uint16)] * 2)]
    with pytest.raises(SimulationError, match="size header never written"):
        for seed in range(20):  # some interleaving runs rank 1 first
            simulate_sized(bad, spec, calls, 4, seed=seed)


@pytest.mark.slow
@pytest.mark.parametrize("R", [2, 3, 4, 6, 8])
def test_simulator_thousands_of_vectors(R):
    spec = _spec("alltoallv", R)
    for channels in (1, 2, 4):
        schedule = lower(spec, LowerOptions(channels=channels))
        rng = np.random.default_rng(R * 7 + channels)
        for trial in range(400):
            capacity = int(rng.integers(1, 80))
            calls = [(_ins := [rng.integers(1, 60000, R * capacity, dtype=np.uint16) for _ in range(R)],
                      _vectors(rng, R, capacity, trial + c), [np.zeros(R * capacity, dtype=np.uint16)] * R)
                     for c in range(2)]
            for (ins, sizes, outs), (outputs, out_sizes) in zip(calls, simulate_sized(schedule, spec, calls, capacity, seed=trial)):
                expected, expected_sizes, _ = evaluate_sized(spec, ins, sizes, capacity, outs)
                assert out_sizes == expected_sizes
                for a, b in zip(outputs, expected):
                    np.testing.assert_array_equal(a, b)


# ---- kernels ---------------------------------------------------------------------------

def _compiled(name: str, R: int, channels: int = 1, arch: str = "sm_90"):
    from purlinc.pipeline import prepare

    return prepare(SIZED / f"{name}.pln", world_size=R, arch=arch, overrides={"channels": channels})


def test_kernel_source_reads_sizes_on_the_device():
    kernel = _compiled("alltoallv", 3, channels=2).kernel("bfloat16", emit_cubin=False)
    source = kernel.cuda.source
    assert "purlin_sized_args" in source and source.count("extern \"C\" __global__") == 3
    assert "run-time sizes (sizes n[3][3] of x)" in source
    # every rank writes its out sizes and reads its input sizes from device memory
    assert source.count("args.out_sizes[") == 9 and "a.sizes[k]" in source  # one per output chunk
    # a chunk a rank copies to itself is checked against the capacity as a staged one is
    assert source.count("&src_off, reporter,") == 3
    assert kernel.abi.stage_units == 2 * 2 and kernel.abi.channels == 2


def test_sized_args_layout():
    from purlinc.atom.sized import SIZED_FIELDS, pack_sized_args, slot_bytes, stage_bytes

    abi = _compiled("alltoallv", 2, channels=3).kernel("float32", emit_cubin=False).abi
    # 3 channels: a 32-byte header (3 words, rounded to 16), then 3 regions of round_up(ceil(100 / 3), 16) = 48
    assert slot_bytes(3, 100) == 32 + 3 * 48 and stage_bytes(abi, 100) == abi.stage_units * 176
    packed = pack_sized_args(abi, capacity_bytes=100, capacity=5, unit_bytes=20, in_len=10, out_len=11, timeout_ns=7,
                             in_ptr=1, out_ptr=2, sizes_ptr=3, out_sizes_ptr=4, counters_ptr=5, error_ptr=6,
                             size_error_ptr=8, stage=[9, 10], signals=[11, 12], expected_ptr=13)
    import struct

    words = struct.unpack(f"<{len(packed) // 8}Q", packed)
    assert len(words) == len(SIZED_FIELDS) + 4
    assert words[8:len(SIZED_FIELDS)] == (1, 2, 3, 4, 13, 5, 6, 8)  # in, out, sizes, out_sizes, expected, ...
    assert words[:8] == (5, 10, 11, 20, 176, 48, abi.stage_units // 2 * 176, 7) and words[-4:] == (9, 10, 11, 12)
    # what the manifest tells a launcher (purlinc compile): this struct, not purlin_args
    described = abi.to_json()
    assert described["args"] == "purlin_sized_args" and described["args_bytes"] == len(packed)
    assert described["args_fields"] == [*SIZED_FIELDS, "stage[2]", "signals[2]"]
    with pytest.raises(ValueError, match="takes purlin_sized_args"):
        abi.pack_args(count=1, piece=1, timeout_ns=0, rank=0, in_ptr=0, out_ptr=0, counters_ptr=0, error_ptr=0,
                      stage=[0, 0], staging=None, signals=[0, 0])
    with pytest.raises(ValueError, match="exceeds the staging"):
        pack_sized_args(abi, capacity_bytes=100, capacity=6, unit_bytes=20, in_len=0, out_len=0, timeout_ns=0, in_ptr=0,
                        out_ptr=0, sizes_ptr=0, out_sizes_ptr=0, counters_ptr=0, error_ptr=0, size_error_ptr=0,
                        stage=[0, 0], signals=[0, 0])


def test_size_error_sentence():
    from purlinc.atom.sized import describe_size_error

    spec = _spec("alltoallv", 4)
    assert describe_size_error((1, 2, 0, 3, 9000, 8192, 5, 0), spec) == (
        "rank 2, call 5: chunk x[2][3] from rank 2 to rank 3: size n[2][3] = 9000 outside 0..8192 "
        "(the capacity fixed at load); it was moved as size 0")
    assert describe_size_error((3, 1, 1, 2, 40, 12, 0, 0), spec) == (
        "rank 1, call 0: chunk x[2][1] from rank 2 to rank 1: size 40 reaches past the end of rank 1's "
        "output (12 element(s) left there); it was moved as size 0")
    assert describe_size_error((4, 3, 1, 0, 7, 5, 2, 0), spec) == (
        "rank 3, call 2: chunk x[0][3] from rank 0 to rank 3: size 7 differs from the 5 rank 3 expects (its "
        "expected sizes); it was not written")
    assert "size n[0][1] = -1 outside" in describe_size_error((1, 0, 0, 1, (1 << 64) - 1, 8, 0, 0), spec)


def test_size_error_sentence_counts_rows_where_the_call_did():
    """A call with row=8 (the MoE dispatcher's: a size per token) has its sizes and bounds in
    rows; the sentence said "outside 0..8 (the capacity fixed at load)" of a load of 64
    elements, and "3 element(s) left" of 3 rows."""
    from purlinc.atom.sized import describe_size_error

    spec = _spec("alltoallv", 4)
    assert describe_size_error((1, 2, 0, 3, 9, 8, 5, 8), spec) == (
        "rank 2, call 5: chunk x[2][3] from rank 2 to rank 3: size n[2][3] = 9 rows outside 0..8 (the capacity "
        "fixed at load, in rows of 8 elements); it was moved as size 0")
    assert describe_size_error((3, 1, 1, 2, 4, 3, 0, 8), spec).endswith(
        "size 4 rows reaches past the end of rank 1's output (3 row(s) of 8 elements left there); it was moved as size 0")
    assert describe_size_error((3, 1, 1, 2, 4, 3, 0, 1), spec) == describe_size_error((3, 1, 1, 2, 4, 3, 0, 0), spec)


def test_other_atoms_refused():
    with pytest.raises(PurlinError, match="'ldst' atom only"):
        from purlinc.pipeline import prepare

        prepare(SIZED / "alltoallv.pln", world_size=2, arch="sm_90", atom="tma").kernel("float32", emit_cubin=False)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_100"])
def test_nvrtc_compiles_sized_kernels(arch):
    """Every target, both examples, one and several channels, a 2-byte and a 1-byte dtype."""
    pytest.importorskip("cuda.bindings.nvrtc")
    for name, R, channels, dtype in (("alltoallv", 4, 2, "bfloat16"), ("allgatherv", 3, 1, "float8_e4m3")):
        kernel = _compiled(name, R, channels, arch).kernel(dtype)
        assert kernel.cubin and len(kernel.cubin) > 1000
        for r in range(R):  # the names the runtime looks up (cuModuleGetFunction)
            assert kernel.abi.entry(r).encode() in kernel.cubin


def test_dump_cuda_prints_the_sized_kernel(capsys):
    """`purlinc dump --stage cuda` and the pipeline take the same door: the sized template."""
    from purlinc.cli import main

    assert main(["dump", str(SIZED / "alltoallv.pln"), "--ranks", "2", "--stage", "cuda"]) == 0
    source = capsys.readouterr().out
    assert "purlin_sized_args" in source and "purlin_args args" not in source


# ---- random sized collectives ------------------------------------------------------------

def _random_sized_source(rng) -> tuple[str, int]:
    """A copy with sizes over random per-rank layouts: 1-D or 2-D chunks of 'x' inside the
    extents (some never named), ranks with no input or no output, outputs naming a chunk
    several times."""
    world = int(rng.choice([1, 2, 3, 4, 5, 8]))
    extents = [int(rng.integers(1, 2 * world + 3))] + ([int(rng.integers(1, 4))] if rng.random() < 0.5 else [])
    chunks = [tuple(int(i) for i in index) for index in np.ndindex(*extents)]
    order = rng.permutation(len(chunks))
    inputs, taken = [], 0
    for _ in range(world):
        n = min(int(rng.choice([0, 0, 1, 1, 2, 3])), len(chunks) - taken)
        inputs.append([chunks[k] for k in order[taken:taken + n]])
        taken += n
    if not taken:
        inputs[0].append(chunks[order[0]])
    held = [c for layout in inputs for c in layout]
    outputs = [[held[int(rng.integers(len(held)))] for _ in range(int(rng.choice([0, 0, 1, 2, 3, 5])))]
               for _ in range(world)]
    outputs[int(rng.integers(world))].append(held[0])

    def names(layout):
        return ", ".join("x" + "".join(f"[{i}]" for i in c) for c in layout)

    lines = [f"collective s with sizes n{''.join(f'[{e}]' for e in extents)} of x {{"]
    for buffer, layouts in (("in", inputs), ("out", outputs)):
        lines += [f"    {buffer}[{rank}] = {names(layout)}" for rank, layout in enumerate(layouts) if layout]
    return "\n".join(lines + ["    copy", "}", ""]), world


def _random_sizes(rng, spec, capacity: int, kind: int) -> list[list[int]]:
    """Per rank, its input chunks' sizes: all zero, all at capacity, random, or random with one
    over the capacity or negative."""
    sizes = []
    for layout in spec.inputs:
        row = [[0] * len(layout), [capacity] * len(layout)][kind] if kind < 2 else \
            [int(v) for v in rng.integers(0, capacity + 1, len(layout))]
        if kind == 3 and row:
            row[int(rng.integers(len(row)))] = int(rng.choice([capacity + 1, -1, 1 << 40]))
        sizes.append(row)
    return sizes


def _length(rng, packed: int) -> int:
    """A buffer's length: room for every chunk at capacity, or now and then less."""
    return int(rng.integers(0, packed + 1)) if rng.random() < 0.2 else packed


def _random_expected(rng, spec, sizes, capacity: int, in_lengths) -> list[list[int]] | None:
    """Per rank, the sizes it expects (``expected_sizes``), or None for half the calls: what
    arrives, with now and then one chunk off by one, negative or over the capacity."""
    if rng.random() < 0.5:
        return None
    expected = arriving_sizes(spec, [sent_sizes(sizes[r], capacity, in_lengths[r])[1] for r in range(len(sizes))])
    for row in expected:
        if row and rng.random() < 0.5:
            k = int(rng.integers(len(row)))
            row[k] = int(rng.choice([row[k] + 1, row[k] - 1, -1, capacity + 1]))
    return expected


def _check_random_sized(seed: int) -> None:
    rng = np.random.default_rng(seed)
    text, R = _random_sized_source(rng)
    spec = spec_of(load_source(text), R, {})
    schedule = lower(spec, LowerOptions(channels=int(rng.integers(1, 5))))
    verify(schedule, spec)
    for trial in range(4):
        capacity = int(rng.choice([1, 3, 13, 41]))
        dtype = rng.choice([np.uint8, np.uint16, np.int32, np.int64])
        calls = []
        for call in range(2):  # consecutive calls of new sizes; buffers sometimes too short
            sizes = _random_sizes(rng, spec, capacity, (trial + call) % 4)
            ins = [rng.integers(1, 100, _length(rng, len(layout) * capacity)).astype(dtype) for layout in spec.inputs]
            outs = [np.zeros(_length(rng, len(layout) * capacity), dtype=dtype) for layout in spec.outputs]
            calls.append((ins, sizes, outs, _random_expected(rng, spec, sizes, capacity, [len(x) for x in ins])))
        for (ins, sizes, outs, wants), (outputs, out_sizes) in zip(calls, simulate_sized(schedule, spec, calls, capacity,
                                                                                           seed=seed + trial)):
            expected, expected_sizes, _ = evaluate_sized(spec, ins, sizes, capacity, outs, wants)
            assert out_sizes == expected_sizes, f"seed {seed}, sizes {sizes}\n{text}"
            for a, b in zip(outputs, expected):
                assert a.tobytes() == b.tobytes(), f"seed {seed}, sizes {sizes}\n{text}"


@pytest.mark.parametrize("seed", range(24))
def test_random_sized_collectives_simulate_like_the_evaluator(seed):
    _check_random_sized(seed)


@pytest.mark.slow
def test_random_sized_collectives_sweep():
    for seed in range(1000, 2500):
        _check_random_sized(seed)
