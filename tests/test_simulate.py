"""Unit tests of the SNAC simulator on small hand-written schedules."""

from __future__ import annotations

import numpy as np
import pytest

from purlinc.dtypes import DType, random_values
from purlinc.frontend.evaluate import evaluate
from purlinc.snac.simulate import POISON_OUT, SimulationError, simulate, simulate_calls, slice_bounds
from test_verify import allgather2, allreduce2
from purlinc.snac.ir import Wait


def inputs_for(spec, count, dtype, seed=0, small=False):
    rng = np.random.default_rng(seed)
    return [random_values(rng, len(spec.inputs[r]) * count, dtype, small=small) for r in range(spec.world_size)]


def same_bits(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


# ----------------------------------------------------------------------------- slice bounds


def test_slice_bounds_cover_the_unit_in_aligned_pieces():
    for n in (0, 1, 3, 4, 5, 17, 100, 1000):
        for itemsize in (1, 2, 4):
            for slices in (1, 2, 3, 5, 8):
                bounds = [slice_bounds(n, itemsize, slices, s) for s in range(slices)]
                assert bounds[0][0] == 0 and bounds[-1][1] == n
                for (lo, hi), (lo2, _) in zip(bounds, bounds[1:]):
                    assert hi == lo2 and lo <= hi
                for lo, _ in bounds:
                    assert (lo * itemsize) % 16 == 0 or lo == n


def test_slice_bounds_examples():
    assert slice_bounds(10, 4, 2, 0) == (0, 8)  # 40 bytes -> 20 -> rounded to 32 bytes
    assert slice_bounds(10, 4, 2, 1) == (8, 10)
    assert slice_bounds(3, 4, 3, 0) == (0, 3)  # 12 bytes: one 16-byte slice holds it all
    assert slice_bounds(3, 4, 3, 1) == (3, 3)
    assert slice_bounds(3, 4, 3, 2) == (3, 3)
    assert slice_bounds(0, 2, 4, 3) == (0, 0)
    assert slice_bounds(64, 2, 4, 3) == (48, 64)


# ----------------------------------------------------------------------------- correct schedules


@pytest.mark.parametrize("count", [0, 1, 7, 64])
@pytest.mark.parametrize("dtype", list(DType))
def test_allgather_equals_the_evaluator(count, dtype):
    spec, schedule = allgather2()
    inputs = inputs_for(spec, count, dtype)
    for seed in range(4):
        got = simulate(schedule, spec, inputs, count, dtype, seed=seed)
        want = evaluate(spec, inputs, count, dtype)
        assert all(same_bits(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("dtype", [DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16, DType.INT32])
@pytest.mark.parametrize("op", ["sum", "prod", "max", "min"])
def test_allreduce_is_bitwise_in_spec_order(dtype, op):
    spec, schedule = allreduce2()
    inputs = inputs_for(spec, 33, dtype)
    got = simulate(schedule, spec, inputs, 33, dtype, op, seed=1)
    want = evaluate(spec, inputs, 33, dtype, op)
    assert all(same_bits(g, w) for g, w in zip(got, want))


def test_fresh_inputs_every_call():
    spec, schedule = allreduce2()
    sets = [inputs_for(spec, 9, DType.INT32, seed=s) for s in range(3)]
    per_call = simulate_calls(schedule, spec, sets, 9, "int32", "sum", calls=3, seed=5)
    for inputs, got in zip(sets, per_call):
        want = evaluate(spec, inputs, 9, DType.INT32, "sum")
        assert all(same_bits(g, w) for g, w in zip(got, want))
    last = simulate(schedule, spec, sets, 9, "int32", "sum", calls=3, seed=5)
    assert all(same_bits(g, w) for g, w in zip(last, per_call[-1]))


@pytest.mark.parametrize("count, piece", [(10, 3), (10, 10), (10, 16), (1, 1), (0, 4)])
def test_pieces_run_in_rounds(count, piece):
    spec, schedule = allreduce2()
    sets = [inputs_for(spec, count, DType.FLOAT32, seed=s) for s in range(2)]
    got = simulate(schedule, spec, sets, count, DType.FLOAT32, "sum", seed=3, piece=piece)
    want = evaluate(spec, sets[-1], count, DType.FLOAT32, "sum")
    assert all(same_bits(g, w) for g, w in zip(got, want))


# ----------------------------------------------------------------------------- broken schedules


def test_deadlock_is_detected():
    def edit(p):
        for r in (0, 1):
            p[r][2], p[r][3], p[r][4] = p[r][4], p[r][2], p[r][3]

    spec, schedule = allgather2(edit)
    inputs = inputs_for(spec, 4, DType.FLOAT32)
    with pytest.raises(SimulationError, match=r"deadlock in simulation: rank 0, channel 0, step 2 \(call 0, round 0\): "
                       r"wait r0.sig\[0\] k=1 needs 1, the pad holds 0"):
        simulate(schedule, spec, inputs, 4, DType.FLOAT32)


def test_a_race_shows_up_in_some_interleaving():
    spec, schedule = allgather2(lambda p: p[1].pop(4))  # rank 1 no longer waits for the data
    inputs = inputs_for(spec, 8, DType.FLOAT32)
    want = evaluate(spec, inputs, 8, DType.FLOAT32)
    results = [simulate(schedule, spec, [inputs], 8, DType.FLOAT32, calls=1, seed=s) for s in range(20)]
    wrong = [r for r in results if not all(same_bits(g, w) for g, w in zip(r, want))]
    assert wrong, "some interleaving must consume the staging unit before it is written"
    assert any((r[1][:8].view(np.uint8) == 0x5A).all() for r in wrong)  # the stage poison came through


def test_unwritten_output_keeps_the_poison():
    spec, schedule = allgather2(lambda p: p[0].pop(0))
    inputs = inputs_for(spec, 4, DType.FLOAT32)
    got = simulate(schedule, spec, inputs, 4, DType.FLOAT32)
    assert (got[0][:4].view(np.uint8) == POISON_OUT).all()


def test_slot_reuse_without_ack_loses_data_across_calls():
    spec, schedule = allgather2(lambda p: p[0].pop(1))  # rank 0 ignores the ack
    sets = [inputs_for(spec, 4, DType.INT32, seed=s) for s in range(2)]
    outcomes = set()
    for seed in range(40):
        per_call = simulate_calls(schedule, spec, sets, 4, DType.INT32, calls=2, seed=seed)
        want = evaluate(spec, sets[0], 4, DType.INT32)
        outcomes.add(all(same_bits(g, w) for g, w in zip(per_call[0], want)))
    assert False in outcomes


def test_bad_inputs_are_rejected():
    spec, schedule = allgather2()
    with pytest.raises(ValueError, match="expected a \\(4,\\) array of float32"):
        simulate(schedule, spec, inputs_for(spec, 3, DType.FLOAT32), 4, DType.FLOAT32)
    with pytest.raises(ValueError, match="one input set per call"):
        simulate(schedule, spec, [inputs_for(spec, 4, DType.FLOAT32)], 4, DType.FLOAT32, calls=2)
    spec, schedule = allreduce2()
    with pytest.raises(ValueError, match="give op"):
        simulate(schedule, spec, inputs_for(spec, 4, DType.FLOAT32), 4, DType.FLOAT32)
    with pytest.raises(ValueError, match=r"count must be an integer, got 4.0 \(float\)"):
        simulate(schedule, spec, inputs_for(spec, 4, DType.FLOAT32), 4.0, DType.FLOAT32, "sum")
    with pytest.raises(ValueError, match="piece must be >= 1, got 0"):
        simulate(schedule, spec, inputs_for(spec, 4, DType.FLOAT32), 4, DType.FLOAT32, "sum", piece=0)
    other, _ = allgather2()
    with pytest.raises(ValueError, match="the schedule is allreduce for R=2, the spec allgather for R=2"):
        simulate(schedule, other, inputs_for(other, 4, DType.FLOAT32), 4, DType.FLOAT32, "sum")


def test_wait_value_is_epoch_based():
    # With k=0 flow control, call 0 must not wait at all: a schedule whose only wait is k=0
    # runs even though nobody notifies in call 0 first.
    spec, schedule = allgather2()
    assert isinstance(schedule.program(0, 0).steps[1], Wait) and schedule.program(0, 0).steps[1].k == 0
    got = simulate(schedule, spec, inputs_for(spec, 2, DType.FLOAT32), 2, DType.FLOAT32, calls=5, seed=9)
    assert len(got) == 2


def test_round_slice_bounds_are_the_full_rounds_clipped():
    from purlinc.snac.simulate import round_slice_bounds

    assert [slice_bounds(9, 4, 2, s) for s in range(2)] == [(0, 8), (8, 9)]
    assert [slice_bounds(7, 4, 2, s) for s in range(2)] == [(0, 4), (4, 7)]  # would overlap (0, 8)
    assert [round_slice_bounds(9, 7, 4, 2, s) for s in range(2)] == [(0, 7), (7, 7)]
    assert [round_slice_bounds(9, 9, 4, 2, s) for s in range(2)] == [(0, 8), (8, 9)]
