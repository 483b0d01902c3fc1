"""Mutation tests: the verifier is not vacuous.

From a lowered schedule, each mutant changes one thing:
- delete one Notify;
- delete one Wait;
- move one Stage to just after the Notify that publishes it: the first later Notify raised
  to a rank that reads the staged region (or, for a region in some rank's OUT, to that
  rank, whose caller reads it).

With the default algorithm every mutant must be rejected.  Other algorithms batch notifies
and wait for more than strictly needed (an ack of the previous call that a later wait
already implies), so a few single mutations are genuinely harmless there: each mutant the
verifier accepts must then run correctly in the simulator too (many interleavings, three
calls), which is the verifier's claim checked independently.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from purlinc.dtypes import DType, random_values
from purlinc.frontend.evaluate import evaluate
from purlinc.snac.ir import Algorithm, Consume, LowerOptions, Notify, Space, Stage, Wait
from purlinc.snac.simulate import SimulationError, simulate_calls
from purlinc.snac.verify import VerificationError, verify
from test_snac_properties import NAMES, applicable_algorithms, default_options, lower, lowered, spec_for

WORLD = 4


def _readers(schedule) -> dict:
    """region -> ranks whose programs read it."""
    readers: dict = {}
    for program in schedule.programs:
        for step in program.steps:
            srcs = (step.src,) if isinstance(step, Stage) else step.srcs if isinstance(step, Consume) else ()
            for region in srcs:
                readers.setdefault(region, set()).add(program.rank)
    return readers


def mutants(schedule):
    """(description, mutated schedule) for every single mutation."""
    readers = _readers(schedule)
    for p, program in enumerate(schedule.programs):
        steps = program.steps
        where = f"r{program.rank}c{program.channel}"
        for i, step in enumerate(steps):
            new = None
            if isinstance(step, (Notify, Wait)):
                new = steps[:i] + steps[i + 1:]
                what = f"delete {where} step {i} ({type(step).__name__})"
            elif isinstance(step, Stage):
                who = set(readers.get(step.dst, ())) | ({step.dst.rank} if step.dst.space is Space.OUT else set())
                who.discard(program.rank)
                j = next(
                    (j for j in range(i + 1, len(steps)) if isinstance(steps[j], Notify) and steps[j].signal.owner in who),
                    None,
                )
                if j is not None:
                    new = steps[:i] + steps[i + 1:j + 1] + (step,) + steps[j + 1:]
                    what = f"move {where} step {i} (Stage) after step {j}"
            if new is not None:
                programs = list(schedule.programs)
                programs[p] = replace(program, steps=new)
                yield what, replace(schedule, programs=tuple(programs))


def rejected(schedule, spec) -> bool:
    try:
        verify(schedule, spec)
    except VerificationError:
        return True
    return False


def simulates_correctly(schedule, spec, seeds: int = 12) -> str | None:
    """None if every interleaving tried gives the evaluator's answer, else what went wrong."""
    count, dtype = 5, DType.INT32
    rng = np.random.default_rng(0)
    sets = [
        [random_values(rng, len(spec.inputs[r]) * count, dtype) for r in range(spec.world_size)]
        for _ in range(3)
    ]
    op = "sum" if spec.is_reduce else None
    for seed in range(seeds):
        try:
            per_call = simulate_calls(schedule, spec, sets, count, dtype, op, calls=3, seed=seed)
        except SimulationError as error:
            return str(error)
        for call, (inputs, got) in enumerate(zip(sets, per_call)):
            want = evaluate(spec, inputs, count, dtype, op)
            if not all(np.array_equal(g, w) for g, w in zip(got, want)):
                return f"wrong output in call {call} (seed {seed})"
    return None


@pytest.mark.parametrize("name", NAMES)
def test_every_mutant_of_the_default_schedule_is_rejected(name):
    spec = spec_for(name, WORLD)
    schedule = lower(spec, default_options(spec))
    verify(schedule, spec)
    survivors = [what for what, mutant in mutants(schedule) if not rejected(mutant, spec)]
    total = sum(1 for _ in mutants(schedule))
    assert total > 0
    assert not survivors, f"{len(survivors)} of {total} mutants verified: {survivors[:5]}"


def _other_cases(extra_options: bool):
    cases = []
    for name in NAMES:
        spec = spec_for(name, WORLD)
        for algorithm in applicable_algorithms(spec):
            variants = [LowerOptions(algorithm=algorithm)]
            if extra_options:
                variants += [
                    LowerOptions(algorithm=algorithm, channels=2, slices=2, slots=1),
                    LowerOptions(algorithm=algorithm, registered=frozenset({"in", "out"})),
                ]
            for options in variants:
                if options == default_options(spec):
                    continue
                cases.append(pytest.param(name, options, id=f"{name}-{options.key()}"))
    return cases


def _check_mutants(name: str, options: LowerOptions) -> None:
    spec = spec_for(name, WORLD)
    schedule = lowered(spec, options)
    if schedule is None:
        pytest.skip(f"{options.key()} does not lower {name}")
    verify(schedule, spec)
    total = killed = 0
    for what, mutant in mutants(schedule):
        total += 1
        if rejected(mutant, spec):
            killed += 1
            continue
        problem = simulates_correctly(mutant, spec)
        assert problem is None, f"verifier accepted '{what}', but the simulator found: {problem}"
    assert total > 0
    assert killed >= total // 2, f"only {killed} of {total} mutants rejected"


@pytest.mark.parametrize("name, options", _other_cases(extra_options=False))
def test_mutants_of_other_algorithms_are_rejected_or_harmless(name, options):
    _check_mutants(name, options)


@pytest.mark.slow
@pytest.mark.parametrize("name, options", _other_cases(extra_options=True))
def test_mutants_with_channels_slots_and_registered_buffers(name, options):
    _check_mutants(name, options)


def test_default_is_direct_push():
    # The strict test above is about the default algorithm; say which one it is.
    assert default_options(spec_for("allgather", WORLD)).algorithm is Algorithm.DIRECT_PUSH


def _reordered(schedule):
    """(description, mutant) for every Consume of several sources, its sources reversed:
    the same multiset, another order of rounding."""
    for p, program in enumerate(schedule.programs):
        for i, step in enumerate(program.steps):
            if isinstance(step, Consume) and len(step.srcs) > 1 and step.srcs[::-1] != step.srcs:
                programs = list(schedule.programs)
                steps = program.steps[:i] + (replace(step, srcs=step.srcs[::-1]),) + program.steps[i + 1:]
                programs[p] = replace(program, steps=steps)
                yield f"r{program.rank}c{program.channel} step {i} sources reversed", replace(schedule, programs=tuple(programs))


@pytest.mark.parametrize("algorithm", [Algorithm.DIRECT_PUSH, Algorithm.DIRECT_PULL, Algorithm.TWO_SHOT, Algorithm.RING])
@pytest.mark.parametrize("world", (3, 4))
def test_a_reduction_order_that_differs_between_ranks_is_rejected(algorithm, world):
    """The multiset of a reduced chunk's slots is the same in any order, but its bits are not:
    a schedule whose ranks sum one chunk in different orders verifies only if every holder
    still forms it alike.  Each accepted mutant must agree bit for bit in float32 on every
    holder (the simulator, several interleavings); at least one mutant must be refused, and
    one refused mutant must really disagree in the simulator, so the check is not vacuous."""
    spec = spec_for("allreduce", world)
    schedule = lowered(spec, LowerOptions(algorithm=algorithm))
    if schedule is None:
        pytest.skip(f"{algorithm.value} does not lower allreduce at R={world}")
    verify(schedule, spec)
    rng = np.random.default_rng(world)
    count = 64
    inputs = [(rng.standard_normal(len(spec.inputs[r]) * count) * 1e4).astype(np.float32) for r in range(world)]

    def holders_agree(mutant) -> bool:
        outs = simulate_calls(mutant, spec, [inputs], count, DType.FLOAT32, "sum", calls=1, seed=0)[0]
        return all(np.array_equal(outs[0].view(np.uint32), o.view(np.uint32)) for o in outs)

    refused, disagreeing = [], 0
    for what, mutant in _reordered(schedule):
        try:
            verify(mutant, spec)
        except VerificationError as error:
            assert "another order" in str(error), f"{what}: refused for another reason: {error}"
            refused.append(what)
            disagreeing += not holders_agree(mutant)
            continue
        assert holders_agree(mutant), f"verifier accepted '{what}', whose holders differ in float32"
    if algorithm in (Algorithm.RING, Algorithm.TWO_SHOT):
        # Both form each reduced chunk once (a ring along its hops, two-shot on its owner) and
        # copy it to every holder: reordered, the chunk changes alike everywhere, and agrees.
        assert not refused, f"{refused[:3]} refused, though every holder forms the chunk alike"
        return
    assert refused, "no reordered mutant was refused"
    assert disagreeing, "no refused mutant disagrees in float32: the data cannot show the check matters"


def test_two_sources_swapped_on_one_rank_is_rejected_for_signed_zeros():
    """Two operands do not commute bit for bit under every op: max and min return the second of
    two equal values (the kernels' purlin_max_f, and NumPy's), so max(+0, -0) is -0 and
    max(-0, +0) is +0.  A two-rank all-reduce whose rank 1 swaps its sources must be refused;
    the simulator shows the ranks' sign bits differ."""
    spec = spec_for("allreduce", 2)
    schedule = lowered(spec, LowerOptions())
    verify(schedule, spec)
    programs = list(schedule.programs)
    for p, program in enumerate(programs):
        if program.rank == 1:
            steps = tuple(replace(st, srcs=st.srcs[::-1]) if isinstance(st, Consume) and len(st.srcs) == 2 else st
                          for st in program.steps)
            assert steps != program.steps
            programs[p] = replace(program, steps=steps)
    mutant = replace(schedule, programs=tuple(programs))
    with pytest.raises(VerificationError, match="another order"):
        verify(mutant, spec)
    inputs = [np.array([0.0, -0.0, 1.0, -0.0], np.float32), np.array([-0.0, 0.0, 1.0, -0.0], np.float32)]
    for op in ("max", "min"):
        outs = simulate_calls(mutant, spec, [inputs], 2, DType.FLOAT32, op, calls=1, seed=0)[0]
        assert not np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)), op
