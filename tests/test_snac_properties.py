"""Property tests of lowering + verifier + simulator against the reference evaluator.

For every example, every applicable algorithm, R from 2 to 16, random counts, channels,
slices, slots and registered buffers: the verifier accepts the schedule, and simulating it
(two calls, fresh inputs each, random interleavings) gives what ``evaluate`` gives: bitwise
for copies and for direct / two-shot reductions (they add in the spec's order), exact for
int32, close for ring reductions of floats (a ring adds in ring order).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from purlinc.dtypes import DType, random_values
from purlinc.errors import PurlinError
from purlinc.frontend.check import check, supports
from purlinc.frontend.evaluate import evaluate
from purlinc.frontend.parse import parse_file
from purlinc.snac.ir import Algorithm, LowerOptions
from purlinc.snac.simulate import simulate_calls
from purlinc.snac.verify import verify

lower_module = pytest.importorskip("purlinc.snac.lower")
lower, applicable_algorithms, default_options = (
    lower_module.lower, lower_module.applicable_algorithms, lower_module.default_options,
)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NAMES = tuple(sorted(p.stem for p in EXAMPLES.glob("*.pln")))
REGISTERED = (frozenset(), frozenset({"in"}), frozenset({"out"}), frozenset({"in", "out"}))
COUNTS = (0, 1, 2, 3, 5, 7, 8, 13, 16, 31, 33, 64, 100)
REDUCIBLE = (DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16, DType.INT32)

settings.register_profile(
    "snac-ci", derandomize=True, deadline=None, max_examples=40, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
CI = settings.get_profile("snac-ci")


@lru_cache(maxsize=None)
def definition(name: str):
    return parse_file(EXAMPLES / f"{name}.pln")


@lru_cache(maxsize=256)
def spec_for(name: str, world: int):
    return check(definition(name), world)


def world_sizes(name: str, sizes) -> list[int]:
    return [r for r in sizes if supports(definition(name), r)]


def lowered(spec, options: LowerOptions):
    """The schedule, or None when the lowering refuses these options (a PurlinError)."""
    try:
        return lower(spec, options)
    except PurlinError:
        return None


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def check_run(spec, schedule, *, count: int, dtype: DType, op: str | None, seed: int, piece: int | None = None):
    """verify, then simulate back-to-back calls (every staging copy reused) with fresh inputs and
    compare each with evaluate."""
    verify(schedule, spec)
    rng = np.random.default_rng(seed)
    small = spec.is_reduce  # keeps float sums well conditioned for the ring's tolerance
    calls = 1 + schedule.stage_copies  # a staging copy is reused stage_copies calls later
    sets = [
        [random_values(rng, len(spec.inputs[r]) * count, dtype, small=small) for r in range(spec.world_size)]
        for _ in range(calls)
    ]
    per_call = simulate_calls(schedule, spec, sets, count, dtype, op, calls=calls, seed=seed, piece=piece)
    exact = not spec.is_reduce or dtype is DType.INT32 or schedule.options.algorithm is not Algorithm.RING
    for call, (inputs, got) in enumerate(zip(sets, per_call)):
        want = evaluate(spec, inputs, count, dtype, op)
        for rank, (g, w) in enumerate(zip(got, want)):
            where = f"call {call}, rank {rank}, {schedule.options.key()}, count={count}, {dtype.value}"
            if exact:
                assert same_bits(g, w), f"{where}: simulator differs from evaluate bitwise"
            else:
                from purlinc.dtypes import to_float32

                tol = 1e-5 if dtype is DType.FLOAT32 else 3e-2
                assert np.allclose(to_float32(g, dtype), to_float32(w, dtype), rtol=tol, atol=tol), where


@st.composite
def cases(draw, max_world: int = 16):
    name = draw(st.sampled_from(NAMES))
    sizes = world_sizes(name, range(2, max_world + 1))
    world = draw(st.sampled_from(sizes))
    spec = spec_for(name, world)
    algorithm = draw(st.sampled_from(applicable_algorithms(spec)))
    options = LowerOptions(
        algorithm=algorithm,
        channels=draw(st.integers(1, 3)),
        slices=draw(st.integers(1, 3)),
        slots=draw(st.sampled_from((None, 1, 2, 3))),
        registered=draw(st.sampled_from(REGISTERED)),
    )
    count = draw(st.sampled_from(COUNTS))
    dtype = draw(st.sampled_from(REDUCIBLE if spec.is_reduce else tuple(DType)))
    op = draw(st.sampled_from(("sum", "max", "min", "prod"))) if spec.is_reduce else None
    piece = draw(st.one_of(st.none(), st.integers(1, max(1, count)))) if count > 1 else None
    return name, world, options, count, dtype, op, piece, draw(st.integers(0, 2**16))


@CI
@given(cases())
def test_lowered_schedules_verify_and_simulate_like_the_spec(case):
    name, world, options, count, dtype, op, piece, seed = case
    spec = spec_for(name, world)
    schedule = lowered(spec, options)
    assume(schedule is not None)
    check_run(spec, schedule, count=count, dtype=dtype, op=op, seed=seed, piece=piece)


def _every_algorithm_cases():
    out = []
    for name in NAMES:
        for world in world_sizes(name, (2, 3, 4, 6)):
            for algorithm in applicable_algorithms(spec_for(name, world)):
                out.append(pytest.param(name, world, algorithm, id=f"{name}-R{world}-{algorithm.value}"))
    return out


@pytest.mark.parametrize("name, world, algorithm", _every_algorithm_cases())
def test_every_example_and_algorithm(name, world, algorithm):
    spec = spec_for(name, world)
    dtype = DType.BFLOAT16 if spec.is_reduce else DType.FLOAT16
    op = "sum" if spec.is_reduce else None
    variants = (
        LowerOptions(algorithm=algorithm),
        LowerOptions(algorithm=algorithm, channels=2, slices=2, slots=1),
        LowerOptions(algorithm=algorithm, channels=3, slices=1, slots=2, registered=frozenset({"in", "out"})),
    )
    ran = 0
    for options in variants:
        schedule = lowered(spec, options)
        if schedule is None:
            continue
        for count in (0, 1, 37):
            check_run(spec, schedule, count=count, dtype=dtype, op=op, seed=count)
        ran += 1
    assert ran, f"{algorithm.value} is said to apply to {name} but lowers with none of the options"


@pytest.mark.parametrize("name", NAMES)
def test_default_options_verify(name):
    for world in world_sizes(name, (2, 5, 8)):
        spec = spec_for(name, world)
        verify(lower(spec, default_options(spec)), spec)


def test_verifier_is_usable_at_72_ranks():
    import time

    spec = spec_for("allgather", 72)
    schedule = lower(spec, default_options(spec))
    start = time.perf_counter()
    verify(schedule, spec)
    assert time.perf_counter() - start < 60


@pytest.mark.slow
@settings(CI, max_examples=600)
@given(cases())
def test_big_sweep(case):
    test_lowered_schedules_verify_and_simulate_like_the_spec.hypothesis.inner_test(case)


def test_short_last_round_keeps_channels_apart():
    # Regression: with 2 channels and a short last round (count 16, piece 9), slice bounds
    # recomputed from the round's own length made channel 1's round-1 slice overlap channel
    # 0's round-0 slice in STAGE.  Bounds are now the full round's, clipped.
    spec = spec_for("allgather", 2)
    schedule = lower(spec, LowerOptions(channels=2))
    for seed in range(4):
        check_run(spec, schedule, count=16, dtype=DType.FLOAT32, op=None, seed=seed, piece=9)
