"""The random collectives that tests/gpu/test_fuzz_specs.py runs on the GPU, checked here on
the CPU: each spec checks, each case's schedules lower (or the options are refused with a
PurlinError that says why) and verify, and the simulator of each schedule gives what the
evaluator gives for the case's calls.  The GPU test then holds the kernels to the simulator."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from purlinc.dtypes import DType, random_values, to_float32
from purlinc.errors import PurlinError
from purlinc.frontend.evaluate import evaluate
from purlinc.snac.ir import Algorithm
from purlinc.snac.simulate import simulate
from purlinc.snac.verify import verify

GPU_TESTS = Path(__file__).resolve().parent / "gpu"
sys.path.insert(0, str(GPU_TESTS))
import fuzz_specs  # noqa: E402  (the GPU test's generator; it imports nothing GPU-bound)

CASES = fuzz_specs.cases(120)


def test_cases_are_a_function_of_their_seed():
    assert fuzz_specs.case(1234) == fuzz_specs.case(1234)
    assert len({c.text for c in CASES}) == len(CASES)


def test_the_cases_cover_what_they_mean_to():
    # empty buffers, repeated output chunks, reduce inputs naming a chunk twice, every world
    # size, plain loads and every algorithm: a generator change that lost any would show here
    texts = [c.text for c in CASES]
    assert {c.world for c in CASES} == set(fuzz_specs.WORLDS)
    assert any(c.reduce for c in CASES) and any(not c.reduce for c in CASES)
    assert any(not c.options for c in CASES)
    assert {dict(c.options).get("algorithm") for c in CASES if c.options} == set(fuzz_specs.ALGORITHMS)
    assert any(c.world > text.count("in[") for c, text in zip(CASES, texts)), "no rank without input"
    assert any(c.world > text.count("out[") for c, text in zip(CASES, texts)), "no rank without output"

    def repeats(line: str) -> bool:
        items = line.split("=", 1)[1].split(", ")
        return len(items) != len(set(items))

    lines = [line.strip() for t in texts for line in t.splitlines()]
    assert any(repeats(line) for line in lines if line.startswith("out["))
    assert any(repeats(line) for line in lines if line.startswith("in[") and "z[" in line)


def _kernels(case):
    try:
        return fuzz_specs.case_kernels(case, "sm_90", 132)
    except PurlinError as error:
        error.render()  # a refusal renders like any located error
        return None


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_schedules_verify_and_simulate_like_the_evaluator(case):
    kernels = _kernels(case)
    if kernels is None:
        algorithm = dict(case.options).get("algorithm")
        assert algorithm in ("two-shot", "ring", "direct-pull"), f"{case.id}: refused\n{case.text}"
        return
    rng = np.random.default_rng(case.seed)
    for compiled, dtype_name, op_name in kernels:
        spec, schedule = compiled.spec, compiled.schedule
        verify(schedule, spec)
        dtype, op = DType.parse(dtype_name), (op_name or None)
        for count, d, o in case.calls:
            if (d, o or "") != (dtype_name, op_name):
                continue
            inputs = [random_values(rng, len(spec.inputs[r]) * count, dtype, small=case.reduce)
                      for r in range(spec.world_size)]
            got = simulate(schedule, spec, inputs, count, dtype, op, calls=1)
            want = evaluate(spec, inputs, count, dtype, op)
            exact = not case.reduce or dtype is DType.INT32 or schedule.options.algorithm is not Algorithm.RING
            for rank, (g, w) in enumerate(zip(got, want)):
                where = f"{case.id}, rank {rank}, count {count}, {dtype.value} {op}\n{case.text}"
                if exact:
                    assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), where
                else:  # the ring sums in another order
                    assert np.allclose(to_float32(g, dtype), to_float32(w, dtype), rtol=3e-2, atol=3e-2), where
