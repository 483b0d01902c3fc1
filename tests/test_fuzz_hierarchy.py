"""Random collectives through hierarchical plans, at every split of their world into nodes of
G ranks (G dividing R): tests/gpu/fuzz_specs.py's cases (per-rank layouts, copies and
reductions) and 'copy replicated' ones drawn here (a chunk on several ranks, several times on
one rank).  Each plan is proved and simulated to the evaluator's answer (copies and int32
bitwise, float32 sums within the rounding of node partials), and every node's phase source,
the .pln text the runtime loads, checks back to the sub-spec its schedule was proved for.

The default run takes a few dozen cases; ``-m slow`` sweeps two thousand."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest

from purlinc import pipeline
from purlinc.dtypes import DType, random_values
from purlinc.frontend.evaluate import evaluate
from purlinc.runtime.hierarchical import intra_sources, plan_for
from purlinc.snac.hiercheck import simulate_plan

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import fuzz_specs  # noqa: E402  (the GPU test's generator; it imports nothing GPU-bound)


def _replicated_source(seed: int) -> tuple[str, int]:
    """A 'copy replicated' collective: each chunk held by one or more ranks (a rank may hold
    it twice), outputs picking held chunks with repetition."""
    rng = random.Random(seed)
    world = rng.choice(fuzz_specs.WORLDS)
    pool = [f"x[{i}]" for i in range(rng.randint(1, world + 1))]
    inputs = [[rng.choice(pool) for _ in range(rng.choice((0, 1, 2, 3)))] for _ in range(world)]
    inputs[rng.randrange(world)].append(pool[0])
    held = sorted({c for layout in inputs for c in layout})
    outputs = [[rng.choice(held) for _ in range(rng.choice((0, 1, 2, 3)))] for _ in range(world)]
    outputs[rng.randrange(world)].append(held[0])
    lines = [f"collective rep_{seed} {{"]
    for buffer, layouts in (("in", inputs), ("out", outputs)):
        lines += [f"    {buffer}[{rank}] = {', '.join(layout)}" for rank, layout in enumerate(layouts) if layout]
    return "\n".join(lines + ["    copy replicated", "}", ""]), world


def _sources(n: int, first: int) -> list[tuple[str, str, int]]:
    """(id, source, world): fuzz_specs' cases and replicated ones, alternately."""
    out = []
    for seed in range(first, first + n):
        case = fuzz_specs.case(seed)
        out.append((case.id, case.text, case.world))
        text, world = _replicated_source(seed)
        out.append((f"replicated{seed}-R{world}", text, world))
    return out


def _inputs(spec, count: int, dtype: DType, rng) -> list[np.ndarray]:
    if not spec.replicated:
        return [random_values(rng, len(layout) * count, dtype) for layout in spec.inputs]
    values: dict = {}  # 'copy replicated' promises identical producers: one value per chunk
    return [np.concatenate([values.setdefault(c, random_values(rng, count, dtype)) for c in layout]
                           or [random_values(rng, 0, dtype)]) for layout in spec.inputs]


def _check(text: str, world: int, G: int, seed: int) -> None:
    source = pipeline.load_source(text)
    plan = plan_for(source, world, G)  # derived and proved
    for node in range(plan.topology.nodes):
        for index, phase_text in intra_sources(plan, node).items():
            sub = pipeline.spec_of(pipeline.load_source(phase_text), G, {})
            shape = plan.canonical[plan.phases[index].schedules[node]]
            assert (sub.operation, sub.inputs, sub.outputs, sub.sources) == \
                (shape.operation, shape.inputs, shape.outputs, shape.sources), phase_text
    spec = plan.spec
    rng = np.random.default_rng(seed)
    if spec.is_reduce:
        cases = [(DType.INT32, "sum", True), (DType.INT32, "max", True), (DType.FLOAT32, "sum", False)]
    else:
        cases = [(DType.FLOAT32, None, True), (DType.INT64, None, True)]
    for dtype, op, exact in cases:
        inputs = _inputs(spec, 3, dtype, rng)
        got = simulate_plan(plan, inputs, 3, dtype, op, seed=seed)
        want = evaluate(spec, inputs, 3, dtype, op)
        for rank, (g, w) in enumerate(zip(got, want)):
            where = f"rank {rank}, {dtype.value} {op}, {world} ranks in nodes of {G}\n{text}"
            if exact:
                assert g.tobytes() == w.tobytes(), where
            else:  # node partials round once per phase
                np.testing.assert_allclose(g, w, rtol=1e-5 * world, atol=1e-5 * world, err_msg=where)


def _every_split(cases):
    return [(case_id, text, world, G) for case_id, text, world in cases for G in range(1, world + 1) if world % G == 0]


FAST = _every_split(_sources(12, fuzz_specs.FIRST_SEED))


@pytest.mark.parametrize("case_id,text,world,G", FAST, ids=[f"{c[0]}-G{c[3]}" for c in FAST])
def test_random_plans_simulate_like_the_evaluator(case_id, text, world, G):
    _check(text, world, G, seed=world * 10 + G)


def test_the_cases_hold_a_replicated_chunk_on_two_ranks_of_one_node():
    """The shape that broke the phase sources (conflicting producers of c[0]) is drawn."""
    def shared(text: str, world: int, G: int) -> bool:
        spec = pipeline.spec_of(pipeline.load_source(text), world, {})
        return spec.replicated and any(
            len({r for r in range(n * G, n * G + G) if c in spec.inputs[r]}) > 1
            for n in range(world // G) for c in {c for layout in spec.inputs for c in layout})

    assert any(shared(text, world, G) for _, text, world, G in FAST if G > 1)


@pytest.mark.slow
def test_random_plans_sweep():
    for case_id, text, world, G in _every_split(_sources(1000, 20_000)):
        _check(text, world, G, seed=world * 10 + G)
