"""Two staging copies by epoch parity on plain (unpacked) direct-push schedules: what the
kernel atoms run by default.  Every example over world sizes and channel/slice shapes is
proved by the verifier (on two calls per call, purlinc.snac.parity) and simulated over three
calls -- every copy reused -- against the evaluator, including in rounds; single mutations are
rejected by the verifier or shown harmless by the simulator; the ce atom keeps one copy."""

from __future__ import annotations

from dataclasses import replace

import pytest

from purlinc.dtypes import DType
from purlinc.frontend.evaluate import evaluate
from purlinc.snac.ir import LowerOptions, Notify, Stage, Wait
from purlinc.snac.simulate import simulate_calls
from purlinc.snac.verify import VerificationError, verify
from test_packed import _inputs, _without
from test_simulate import same_bits
from test_snac_properties import NAMES, check_run, lowered, spec_for, world_sizes

SHAPES = ((1, 1), (2, 1), (1, 3), (2, 2))
CASES = [(name, world, channels, slices) for name in NAMES for world in world_sizes(name, range(2, 7))
         for channels, slices in SHAPES if (channels, slices) == (1, 1) or world in (2, 3, 5)]


def two_copies(name: str, world: int, channels: int = 1, slices: int = 1):
    spec = spec_for(name, world)
    return spec, lowered(spec, LowerOptions(channels=channels, slices=slices, stage_copies=2))


@pytest.mark.parametrize("name,world,channels,slices", CASES, ids=[f"{n}-R{w}-c{c}-s{s}" for n, w, c, s in CASES])
def test_two_copies_equal_the_evaluator(name, world, channels, slices):
    spec, schedule = two_copies(name, world, channels, slices)
    assert schedule.options.key().endswith("/x2")
    if schedule.stage_units:
        assert schedule.stage_copies == 2
    dtype, op = (DType.FLOAT32, "sum") if spec.is_reduce else (DType.BFLOAT16, None)
    for count in (1, 13):
        check_run(spec, schedule, count=count, dtype=dtype, op=op, seed=count + world)
    check_run(spec, schedule, count=37, dtype=dtype, op=op, seed=3, piece=8)  # rounds: epochs alternate within a call


@pytest.mark.parametrize("name", ["allgather", "allreduce", "broadcast", "reduce", "alltoall"])
def test_every_single_mutation_of_a_two_copy_schedule_is_caught(name):
    """Each Stage moved past the Notify that publishes it (to the rank it stages for) is
    rejected; each deleted Wait or Notify is rejected, or -- a wait another one implies --
    runs correctly in the simulator over four calls (the verifier's claim, checked)."""
    spec, schedule = two_copies(name, 3)
    dtype, op = (DType.INT32, "sum") if spec.is_reduce else (DType.INT32, None)
    sets = [_inputs(spec, 5, dtype, seed) for seed in range(4)]
    rejected = 0
    for rank, program in enumerate(schedule.programs):
        steps = program.steps
        for index, step in enumerate(steps):
            if isinstance(step, Stage):
                later = next((j for j in range(index + 1, len(steps))  # the notify that publishes it
                              if isinstance(steps[j], Notify) and steps[j].signal.owner == step.dst.rank), None)
                if later is None:
                    continue
                moved = steps[:index] + steps[index + 1:later + 1] + (step,) + steps[later + 1:]
                mutant = replace(schedule, programs=tuple(
                    replace(p, steps=moved) if p.rank == rank else p for p in schedule.programs))
                with pytest.raises(VerificationError):
                    verify(mutant, spec)
                continue
            if not isinstance(step, (Wait, Notify)):
                continue
            try:
                verify(_without(schedule, rank, index), spec)
            except VerificationError:
                rejected += 1
                continue
            for seed in range(8):
                got = simulate_calls(_without(schedule, rank, index), spec, sets, 5, dtype, op, calls=4, seed=seed)
                for inputs, outputs in zip(sets, got):
                    assert all(same_bits(g, w) for g, w in zip(outputs, evaluate(spec, inputs, 5, dtype, op)))
    assert rejected > 0


def test_without_the_copies_the_elided_acks_are_a_race():
    spec, schedule = two_copies("allgather", 2)
    assert not [s for p in schedule.programs for s in p.steps if isinstance(s, Wait) and s.k <= 0]
    with pytest.raises(VerificationError, match="reused too early"):
        verify(replace(schedule, stage_copies=1), spec)
