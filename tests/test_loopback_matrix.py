"""The loopback scale matrix (tests/gpu/scale.py; run by tests/gpu/test_loopback_scale.py on one
GPU) covers what issue 25 asks, checked on the CPU: every example and many-unit user spec at
R = 2, 3, 4, 5, 8 by plain load, every algorithm x kernel atom x packed option, every dtype x op, graphs,
the hierarchical intra-node phases at G = 4 and 8, the R=8 first call and the residency refusal
first; and a plain load's calls straddle every size bucket's bound."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))

import scale  # noqa: E402

from purlinc import pipeline  # noqa: E402
from purlinc.dtypes import DType  # noqa: E402
from purlinc.runtime import tuning  # noqa: E402

CASES = scale.cases()


def test_ids_are_unique_and_issue_25s_own_cases_come_first():
    assert len({c.id for c in CASES}) == len(CASES)
    head = [c.kind for c in CASES[:7]]
    assert sorted(head) == ["big"] * 2 + ["first"] * 4 + ["refuse"]
    assert [c.priority for c in CASES] == sorted(c.priority for c in CASES)


def test_every_spec_at_every_world_by_plain_load():
    tuned = {(c.world, c.spec) for c in CASES if c.kind == "tuned"}
    for world in scale.WORLDS:
        for spec in scale.spec_names():
            assert (world, spec) in tuned
    assert {(16, s) for s in scale.WORLDS_16} <= tuned


def test_every_option_dtype_and_op_is_pinned_somewhere_at_every_world():
    options = defaultdict(set)
    for c in CASES:
        if c.kind == "pinned":
            o = dict(c.options)
            options[(c.world, c.spec)].add((o["algorithm"], o["atom"], o["packed"]))
    # not the ce atom: it is refused where ranks share a GPU (tests/gpu/test_loopback.py)
    want = {(a, t, p) for a in scale.ALGORITHMS for t in scale.ATOMS for p in (False, True)
            if not p or a == "direct-push"}
    for world in scale.WORLDS:
        for spec in scale.spec_names():
            assert options[(world, spec)] == want
    for world in scale.WORLDS:
        seen = {(d, o) for c in CASES if c.world == world and c.kind in ("pinned", "dtypes") for _, d, o in c.calls}
        assert seen >= {(d, o) for d in scale.DTYPES for o in scale.OPS}


def test_graphs_hier_phases_and_big_calls():
    assert {(c.world, c.spec) for c in CASES if c.kind == "graph"} == {
        (w, s) for w in (2, 4, 8) for s in scale.GRAPH_SPECS}
    hier = {(c.spec.split(":")[1], c.world) for c in CASES if c.kind == "hier"}
    assert hier == {(s, g) for s in scale.HIER_SPECS for g in (4, 8)}
    assert all(c.world == 8 and c.calls[0][0] >= 262_144 for c in CASES if c.kind == "big")


def test_user_specs_have_many_units_per_rank_and_uneven_layouts():
    for world in (3, 8):
        units = {}
        for name in scale.USER_SPECS:
            spec = pipeline.spec_of(pipeline.load_source(scale.source_of(name)), world, None)
            units[name] = [max(len(i), len(o)) for i, o in zip(spec.inputs, spec.outputs)]
        for name in ("ar_2d", "ag_3", "rs_4"):
            assert all(2 * world <= u <= 4 * world for u in units[name]), (name, units[name])
        spec = pipeline.spec_of(pipeline.load_source(scale.source_of("ag_uneven")), world, None)
        assert len({len(i) for i in spec.inputs}) == 2  # ranks give 1 or 2 chunks
        spec = pipeline.spec_of(pipeline.load_source(scale.source_of("rs_uneven")), world, None)
        assert len({len(o) for o in spec.outputs}) > 1


def test_a_plain_loads_calls_straddle_every_bucket_bound():
    buckets = tuple(tuning.Bucket(b) for b in (16_384, 131_072, 2_097_152)) + (tuning.Bucket(None),)
    case = scale.Case("tuned", 8, "ar_2d", seed=3)  # seed % 3 == 0: the large bounds too
    calls = scale.case_calls(case, buckets, 16)
    chosen = [tuning.choose(buckets, n * DType.parse(d).itemsize * 16) for n, d, _ in calls]
    assert set(chosen) == {0, 1, 2, 3}
    for index, bucket in enumerate(buckets[:-1]):
        sides = [(n, d) for (n, d, _), k in zip(calls, chosen) if k in (index, index + 1)]
        assert any(n * DType.parse(d).itemsize * 16 <= bucket.max_bytes < (n + 1) * DType.parse(d).itemsize * 16
                   for n, d in sides), bucket


def test_the_first_call_case_compiles_the_hangs_bucket():
    """The plain load's first call (count 1, float32) of the 16-unit all-reduce at R=8 runs the
    packed direct-push bucket with one channel: the schedule that hung."""
    first = next(c for c in CASES if c.kind == "first" and not c.options and c.calls[0][1] == "float32")
    (compiled, dtype, op), = scale.case_kernels(first, "sm_90", 132)
    assert (compiled.options.key(), dtype, op) == ("direct-push/c1/s1/slotsall/reg-/ll", "float32", "sum")
