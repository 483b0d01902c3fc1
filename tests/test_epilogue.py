"""Epilogues in the language: parsing, printing, checking (exact error texts) and the
reference evaluator's meaning (docs/LANGUAGE.md, "Epilogues")."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from purlinc.dtypes import DType, from_float32, to_float32
from purlinc.errors import PurlinError
from purlinc.frontend import ast
from purlinc.frontend.check import check
from purlinc.frontend.epilogue import row_problem
from purlinc.frontend.evaluate import evaluate
from purlinc.frontend.parse import parse

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "fused" / "allreduce_add_rmsnorm.pln"
FUSED = EXAMPLE.read_text()  # the example is the spec these tests take apart
BF16 = DType.BFLOAT16


def test_parse_and_print_round_trip():
    definition = parse(FUSED)
    assert [o.format() for o in definition.operands] == ["rows residual", "row weight", "scalar eps"]
    assert [s.format() for s in definition.epilogue.statements] == [
        "h = out + residual", "residual = h", "out = rmsnorm(h, weight, eps)"]
    assert parse(definition.format()) == definition
    # Precedence survives printing; decimal literals keep their text.
    text = FUSED.replace("h = out + residual", "h = (out - residual) * 2.5e-1 - -out / (1.0 + out)")
    again = parse(parse(text).format())
    assert again == parse(text)
    assert again.epilogue.statements[0].format() == "h = (out - residual) * 2.5e-1 - -out / (1.0 + out)"


def test_ranges_still_lex_as_ranges():
    spec = check(parse("collective a { in[r] = x[0..R]  out[r] = x[1..R] reduce }"), 3)
    assert [str(c) for c in spec.outputs[0]] == ["x[1]", "x[2]"]


def test_checked_epilogue():
    spec = check(parse(FUSED), 2, {"hidden": 64})
    epilogue = spec.epilogue
    assert epilogue.row == 64 and epilogue.writes == ("residual", "out")
    assert [(o.name, o.kind, o.written) for o in epilogue.operands] == [
        ("residual", ast.OperandKind.ROWS, True), ("weight", ast.OperandKind.ROW, False),
        ("eps", ast.OperandKind.SCALAR, False)]
    assert epilogue.norm.format() == "rmsnorm(h, weight, eps)"
    assert spec.format().endswith(
        "epilogue rows(64)\n  with rows residual (written)\n  with row weight\n  with scalar eps\n"
        "  h = out + residual\n  residual = h\n  out = rmsnorm(h, weight, eps)\n")
    assert spec.to_json()["epilogue"]["row"] == 64
    assert check(parse(FUSED), 2, {"hidden": 64}) == spec
    assert check(parse(FUSED), 2, {"hidden": 32}) != spec


ERRORS = [
    ('copy',
     'collective f(hidden = 8) with rows residual {\n    in[r] = x[r]\n    out[r] = x[0..R]\n    copy\n    epilogue rows(hidden) {\n        residual = out\n    }\n}\n',
     ('fused.pln:5:5: error: an epilogue applies to reduced data; f is a copy collective', '        epilogue rows(hidden) {', '        ^^^^^^^^', 'note: while checking f for R=2')),
    ('unknown',
     'collective f(hidden = 8) with rows residual, row weight, scalar eps {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(hidden) {\n        out = rmsnorm(out + resid, weight, eps)\n        residual = out\n    }\n}\n',
     ("fused.pln:6:29: error: unknown name 'resid' in the epilogue", '            out = rmsnorm(out + resid, weight, eps)', '                                ^^^^^', 'note: names defined here: out, residual, weight, eps', 'note: while checking f for R=2')),
    ('parameter',  # parameters and R name layouts: "unknown name 'e'" said nothing of what e is
     'collective f(e = 1) with row w {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(8) {\n        out = rmsnorm(out, w, e)\n    }\n}\n',
     ("fused.pln:6:31: error: 'e' is a parameter, which an epilogue's statements cannot read", '            out = rmsnorm(out, w, e)', '                                  ^',
      "note: they compute on the call's data in float32: write the number, or pass the value as a scalar operand",
      'note: names defined here: out, w', 'note: while checking f for R=2')),
    ('assign_row',
     'collective f(hidden = 8) with rows residual, row weight, scalar eps {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(hidden) {\n        weight = out\n    }\n}\n',
     ("fused.pln:6:9: error: 'weight' is a row operand: only out and rows operands can be written", '            weight = out', '            ^^^^^^', 'note: while checking f for R=2')),
    ('twice',
     'collective f(hidden = 8) with rows residual, row weight, scalar eps {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(hidden) {\n        out = out + residual\n        out = rmsnorm(out, weight, eps)\n    }\n}\n',
     ('fused.pln:7:9: error: out is written twice in the epilogue (a buffer is written once, after every read)', '            out = rmsnorm(out, weight, eps)', '            ^^^', 'note: while checking f for R=2')),
    ('local_twice',
     'collective f(hidden = 8) with rows residual, row weight, scalar eps {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(hidden) {\n        h = out\n        h = h + residual\n        out = rmsnorm(h, weight, eps)\n    }\n}\n',
     ("fused.pln:7:9: error: local 'h' is assigned twice (locals are defined once)", '            h = h + residual', '            ^', 'note: while checking f for R=2')),
    ('unused',
     'collective f(hidden = 8) with rows residual, row weight, scalar eps {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(hidden) {\n        out = out + residual * eps\n    }\n}\n',
     ("fused.pln:1:46: error: operand 'weight' is declared but the epilogue never uses it", '    collective f(hidden = 8) with rows residual, row weight, scalar eps {', '                                                 ^^^^^^^^^^', 'note: while checking f for R=2')),
    ('local_unused',  # a misspelt target: the local is computed, nothing reads it
     'collective f(hidden = 8) with rows residual, row weight, scalar eps {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(hidden) {\n        h = out + residual\n        hh = rmsnorm(h, weight, eps)\n        residual = h\n    }\n}\n',
     ("fused.pln:7:9: error: local 'hh' is assigned but never used", '            hh = rmsnorm(h, weight, eps)', '            ^^', 'note: use it in a later statement, assign out or a rows operand instead, or remove it', 'note: while checking f for R=2')),
    ('no_epilogue',
     'collective f with row weight {\n    in[r] = x\n    out[r] = x\n    reduce\n}\n',
     ("fused.pln:1:19: error: operand 'weight' is an epilogue operand, but f has no epilogue", '    collective f with row weight {', '                      ^^^^^^^^^^', "note: add 'epilogue rows(E) { ... }' after the operation, or remove the operand", 'note: while checking f for R=2')),
    ('weight_kind',
     'collective f(hidden = 8) with rows residual, row weight, scalar eps {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(hidden) {\n        out = rmsnorm(out, residual, eps)\n        residual = out * weight\n    }\n}\n',
     ("fused.pln:6:28: error: rmsnorm's weight must be a row operand (declared 'row NAME')", '            out = rmsnorm(out, residual, eps)', '                               ^^^^^^^^', 'note: while checking f for R=2')),
    ('eps_kind',
     'collective f(hidden = 8) with rows residual, row weight, scalar eps {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(hidden) {\n        out = rmsnorm(out, weight, residual)\n        residual = out * eps\n    }\n}\n',
     ("fused.pln:6:36: error: rmsnorm's eps must be a scalar operand or a non-negative number, not 'residual'", '            out = rmsnorm(out, weight, residual)', '                                       ^^^^^^^^', 'note: while checking f for R=2')),
    ('two_norms',
     'collective f(hidden = 8) with rows residual, row weight, scalar eps {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(hidden) {\n        residual = rmsnorm(out, weight, eps)\n        out = rmsnorm(out, weight, 1e-5)\n    }\n}\n',
     ('fused.pln:7:15: error: an epilogue has at most one rmsnorm (one reduction over the row)', '            out = rmsnorm(out, weight, 1e-5)', '                  ^^^^^^^^^^^^^^^^^^^^^^^^^^', 'note: while checking f for R=2')),
    ('unknown_fn',
     'collective f(hidden = 8) with rows residual, row weight, scalar eps {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(hidden) {\n        out = layernorm(out, weight, eps)\n        residual = out\n    }\n}\n',
     ("fused.pln:6:15: error: unknown function 'layernorm'", '            out = layernorm(out, weight, eps)', '                  ^^^^^^^^^^^^^^^^^^^^^^^^^^^', 'note: an epilogue may call: rmsnorm', 'note: while checking f for R=2')),
    ('arity',
     'collective f(hidden = 8) with rows residual, row weight, scalar eps {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(hidden) {\n        out = rmsnorm(out, weight)\n        residual = out * eps\n    }\n}\n',
     ('fused.pln:6:15: error: rmsnorm takes 3 arguments (value, weight, eps), not 2', '            out = rmsnorm(out, weight)', '                  ^^^^^^^^^^^^^^^^^^^^', 'note: while checking f for R=2')),
    ('row_small',
     'collective f(hidden = 8) with rows residual {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(hidden - 8 * R) {\n        residual = out\n    }\n}\n',
     ('fused.pln:5:19: error: a row must hold at least one element, not -8', '        epilogue rows(hidden - 8 * R) {', '                      ^^^^^^^^^^^^^^', 'note: with hidden=8 (its default)', 'note: while checking f for R=2')),
    ('dtype',
     'collective f with rows q: int32 {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(8) {\n        q = out\n    }\n}\n',
     ('fused.pln:1:27: error: an epilogue cannot write or read int32: rows operands take bfloat16, float16, float32, float8_e4m3', '    collective f with rows q: int32 {', '                              ^^^^^', 'note: while checking f for R=2')),
    ('dtype_unknown',  # the names --dtype takes; the ones an epilogue cannot use are refused by name
     'collective f with rows q: bogus {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(8) {\n        q = out\n    }\n}\n',
     ("fused.pln:1:27: error: unknown dtype 'bogus'", '    collective f with rows q: bogus {', '                              ^^^^^',
      'note: expected one of: float32, float16, bfloat16, int32, int64, float8_e4m3, float8_e5m2',
      'note: rows operands take bfloat16, float16, float32, float8_e4m3', 'note: while checking f for R=2')),
    ('dtype_row',
     'collective f with row w: float32 {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(8) {\n        out = out * w\n    }\n}\n',
     ("fused.pln:1:26: error: a row operand has the call's dtype (only rows operands declare a dtype)", '    collective f with row w: float32 {', '                             ^^^^^^^', 'note: while checking f for R=2')),
    ('writes_nothing',
     'collective f {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(8) {\n        h = out\n    }\n}\n',
     ('fused.pln:5:5: error: the epilogue writes nothing: assign out or a rows operand', '        epilogue rows(8) {', '        ^^^^^^^^', 'note: while checking f for R=2')),
    ('dup',
     'collective f with rows a, row a {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(8) {\n        a = out\n    }\n}\n',
     ("fused.pln:1:27: error: operand 'a' is declared twice", '    collective f with rows a, row a {', '                              ^^^^^', 'note: while checking f for R=2')),
    ('float_index',
     'collective f {\n    in[r] = x[1.5]\n    out[r] = x\n    reduce\n}\n',
     ("fused.pln:2:15: error: unexpected decimal number '1.5'; expected '(', '-', a name, a number", '        in[r] = x[1.5]', '                  ^^^')),
]


# A local follows the operands' naming rule for the spec's names (check.spec_names): each name
# below is refused at the local, as it is at an operand.
LOCAL = ('collective c(hidden = 8) with row w, scalar e {{\n    in[r] = x[r][0..1] for i in 0..1\n    out[r] = x[r][0]\n'
         '    reduce\n    epilogue rows(hidden) {{\n        {name} = out * 2\n        out = rmsnorm({name}, w, e)\n'
         '    }}\n}}\n')


@pytest.mark.parametrize("name, what", [
    ("rmsnorm", "a function"), ("R", "the world size"), ("r", "the rank"), ("hidden", "a parameter"),
    ("x", "a chunk"), ("i", "a loop variable"),
])
def test_a_local_named_like_something_else_is_refused(name, what):
    with pytest.raises(PurlinError) as info:
        check(parse(LOCAL.format(name=name), "fused.pln"), 2, {})
    assert info.value.render().splitlines() == [
        f"fused.pln:6:9: error: local '{name}' has the name of {what}", f"            {name} = out * 2",
        "            " + "^" * len(name), "note: while checking c for R=2"]
    # ... and an operand of that name is refused the same way
    operand = LOCAL.format(name="h").replace("scalar e", f"scalar {name}").replace("w, e)", f"w, {name})")
    with pytest.raises(PurlinError) as info:
        check(parse(operand, "fused.pln"), 2, {})
    assert info.value.message == f"operand '{name}' has the name of {what}"


def test_other_local_names_and_dtype_aliases_are_accepted():
    spec = check(parse(LOCAL.format(name="c"), "fused.pln"), 2, {})  # the collective's own name: no clash
    assert [s.target for s in spec.epilogue.statements] == ["c", "out"]
    # the Python call's names bind operands (keyword arguments), never a local: a local may take them
    for name, what in (("count", "an argument of the Python call"),
                       ("lambda", "a Python keyword (no call could pass it by name)")):
        assert check(parse(LOCAL.format(name=name), "fused.pln"), 2, {}).epilogue is not None
        operand = LOCAL.format(name="h").replace("scalar e", f"scalar {name}").replace("w, e)", f"w, {name})")
        with pytest.raises(PurlinError) as info:
            check(parse(operand, "fused.pln"), 2, {})
        assert info.value.message == f"operand '{name}' has the name of {what}"
    for alias, dtype in (("bf16", DType.BFLOAT16), ("half", DType.FLOAT16), ("fp32", DType.FLOAT32)):
        source = FUSED.replace("rows residual", f"rows residual: {alias}")
        assert check(parse(source), 2).epilogue.operand("residual").dtype is dtype


@pytest.mark.parametrize("name, source, expected", ERRORS, ids=[case[0] for case in ERRORS])
def test_error_text(name, source, expected):
    with pytest.raises(PurlinError) as info:
        check(parse(source, "fused.pln"), 2, {})
    assert info.value.render() == "\n".join(expected)


def _bf16(rng, *shape):
    return from_float32(rng.standard_normal(shape).astype(np.float32), BF16)


def _unfused(xs, residual, weight, eps, hidden):
    """The unfused reference: all-reduce (float32, rounded to bf16), then add and RMSNorm in
    float32, each result rounded to bf16."""
    reduced = to_float32(from_float32(sum(to_float32(x, BF16) for x in xs), BF16), BF16)
    h = (reduced + to_float32(residual, BF16)).reshape(-1, hidden)
    y = h / np.sqrt((h * h).mean(axis=1, keepdims=True) + eps) * to_float32(weight, BF16)
    return to_float32(from_float32(y.reshape(-1), BF16), BF16), to_float32(from_float32(h.reshape(-1), BF16), BF16)


@settings(max_examples=25, deadline=None)
@given(world=st.integers(1, 8), rows=st.integers(1, 6), hidden=st.sampled_from([8, 16, 40, 64]),
       seed=st.integers(0, 2**31))
def test_evaluator_is_the_unfused_reference(world, rows, hidden, seed):
    spec = check(parse(FUSED), world, {"hidden": hidden})
    rng = np.random.default_rng(seed)
    n = rows * hidden
    xs = [_bf16(rng, n) for _ in range(world)]
    operands = [{"residual": _bf16(rng, n), "weight": _bf16(rng, hidden), "eps": 1e-5} for _ in range(world)]
    before = [dict(o, residual=o["residual"].copy()) for o in operands]
    outs = evaluate(spec, xs, n, BF16, "sum", operands)
    for rank in range(world):
        y, h = _unfused(xs, before[rank]["residual"], before[rank]["weight"], 1e-5, hidden)
        # The reduction adds in rank order, the reference in Python's sum order: equal within
        # one bf16 rounding of h, which RMSNorm scales by at most |weight| / rms.
        np.testing.assert_allclose(to_float32(operands[rank]["residual"], BF16), h, rtol=2**-7, atol=2**-6)
        np.testing.assert_allclose(to_float32(outs[rank], BF16), y, rtol=2**-6, atol=2**-5)


def test_evaluator_needs_operands_of_the_right_shape():
    spec = check(parse(FUSED), 2, {"hidden": 8})
    xs = [np.zeros(16, np.uint16)] * 2
    with pytest.raises(ValueError, match="has an epilogue: give operands"):
        evaluate(spec, xs, 16, BF16, "sum")
    bad = [{"residual": np.zeros(16, np.uint16), "weight": np.zeros(4, np.uint16), "eps": 1e-5}] * 2
    with pytest.raises(ValueError, match=r"operand 'weight': expected uint16 \(8,\), got uint16 \(4,\)"):
        evaluate(spec, xs, 16, BF16, "sum", bad)
    good = {"residual": np.zeros(16, np.uint16), "weight": np.zeros(8, np.uint16), "eps": 1e-5}
    with pytest.raises(ValueError, match=r"unknown epilogue operand 'bias'; the epilogue takes residual, weight, eps"):
        evaluate(spec, xs, 16, BF16, "sum", [{**good, "bias": 1.0}] * 2)  # the runtime refuses it: so does the oracle
    with pytest.raises(ValueError, match=r"operand 'residual': expected a NumPy array of uint16 \(16,\), got list"):
        evaluate(spec, xs, 16, BF16, "sum", [{**good, "residual": [0] * 16}] * 2)  # was an AttributeError
    with pytest.raises(ValueError, match=r"count=12 is not a whole number of rows of 8 elements"):
        evaluate(spec, [np.zeros(12, np.uint16)] * 2, 12, BF16, "sum",
                 [{"residual": np.zeros(12, np.uint16), "weight": np.zeros(8, np.uint16), "eps": 1e-5}] * 2)
    # Rows never straddle chunks: the oracle normalised 8-element rows across two 4-element
    # chunks, which the simulator and the runtime refuse
    chunked = check(parse(ALLREDUCE_CHUNKS), 2, {"hidden": 8})
    with pytest.raises(ValueError, match=r"count=4 is not a whole number of rows of 8 elements"):
        evaluate(chunked, [np.zeros(8, np.uint16)] * 2, 4, BF16, "sum",
                 [{"residual": np.zeros(8, np.uint16), "weight": np.zeros(8, np.uint16), "eps": 1e-5}] * 2)


# --- the schedule: placement, proof, simulation -------------------------------------------------

from dataclasses import replace  # noqa: E402

from purlinc.frontend.evaluate import run_epilogue  # noqa: E402
from purlinc.snac.format import format_schedule, schedule_from_json, schedule_to_json  # noqa: E402
from purlinc.snac.ir import Algorithm, Epilogue, LowerOptions, Program  # noqa: E402
from purlinc.snac.lower import lower  # noqa: E402
from purlinc.snac.simulate import simulate_calls  # noqa: E402
from purlinc.snac.verify import VerificationError, verify  # noqa: E402

ALLREDUCE_CHUNKS = FUSED.replace("in[r]  = x", "in[r]  = x[0..R]").replace("out[r] = x", "out[r] = x[0..R]")

OPTIONS = [
    LowerOptions(Algorithm.DIRECT_PUSH),
    LowerOptions(Algorithm.DIRECT_PUSH, channels=2, slices=2, stage_copies=2),
    LowerOptions(Algorithm.DIRECT_PUSH, channels=3, packed=True, stage_copies=2),
    LowerOptions(Algorithm.DIRECT_PULL, channels=2, registered=frozenset({"in"})),
    LowerOptions(Algorithm.TWO_SHOT, channels=2),
    LowerOptions(Algorithm.RING, slices=2, slots=1),
]


def _operands(rng, world, n, hidden):
    return [{"residual": _bf16(rng, n), "weight": _bf16(rng, hidden), "eps": 1e-5} for _ in range(world)]


@settings(max_examples=30, deadline=None)
@given(world=st.integers(2, 8), rows=st.integers(1, 5), hidden=st.sampled_from([8, 16, 24]),
       spec_text=st.sampled_from([FUSED, ALLREDUCE_CHUNKS]), option=st.integers(0, len(OPTIONS) - 1),
       piece_rows=st.integers(0, 3), seed=st.integers(0, 2**31))
def test_simulator_equals_evaluator(world, rows, hidden, spec_text, option, piece_rows, seed):
    """Two back-to-back calls: outputs and the residual written back (which the second call
    reads) equal the evaluator's, bit for bit, for every algorithm, channels, slices, LL and
    rounds of whole rows."""
    spec = check(parse(spec_text), world, {"hidden": hidden})
    options = OPTIONS[option]
    schedule = lower(spec, options)
    verify(schedule, spec)
    per_chunk = world if spec_text is ALLREDUCE_CHUNKS else 1
    count = rows * hidden
    n = count * per_chunk
    rng = np.random.default_rng(seed)
    calls = [[_bf16(rng, n) for _ in range(world)] for _ in range(2)]
    operands = _operands(rng, world, n, hidden)
    expected_operands = [dict(o, residual=o["residual"].copy()) for o in operands]
    initial = [dict(o, residual=o["residual"].copy()) for o in expected_operands]
    expected = [evaluate(spec, xs, count, BF16, "sum", expected_operands) for xs in calls]
    piece = piece_rows * hidden or None
    if options.algorithm is Algorithm.RING:
        # A ring rounds at every hop: its oracle is its own reduction (the schedule without the
        # epilogue, simulated), then the evaluator's epilogue on that.
        expected_operands = initial
        plain = replace(spec, epilogue=None)
        reduced = simulate_calls(lower(plain, options), plain, calls, count, BF16, "sum", seed=seed, piece=piece)
        for call in range(2):
            for rank in range(world):
                run_epilogue(spec.epilogue, reduced[call][rank], expected_operands[rank], BF16)
        expected = reduced
    got = simulate_calls(schedule, spec, calls, count, BF16, "sum", seed=seed, piece=piece, operands=operands)
    for call in range(2):
        for rank in range(world):
            assert np.array_equal(got[call][rank], expected[call][rank]), (call, rank)
    for rank in range(world):
        assert np.array_equal(operands[rank]["residual"], expected_operands[rank]["residual"]), rank


@pytest.mark.parametrize("value", ["s", "2.0", "s * 3.0 - 1.0", "w"])
def test_rmsnorm_of_a_value_constant_along_the_row(value):
    """rmsnorm(V, ...) where V does not vary along the row (a scalar, a literal, a row operand):
    V is a row of that value, V * rsqrt(V * V + EPS) * W; the oracle raised numpy's AxisError
    for a 0-d V, the simulator with it."""
    declared = "row w, scalar s" if "s" in value.split() else "row w"  # an operand declared is used
    spec = check(parse(f"collective f with {declared} {{\n    in[r] = x\n    out[r] = x\n    reduce\n"
                       f"    epilogue rows(8) {{\n        out = rmsnorm({value}, w, 1e-6) + out * 0.0\n    }}\n}}\n"), 2)
    rng = np.random.default_rng(len(value))
    w = rng.standard_normal(8).astype(np.float32)
    xs = [rng.standard_normal(16).astype(np.float32) for _ in range(2)]
    operands = [{"w": w, "s": 2.5} if "s" in declared else {"w": w} for _ in range(2)]
    v = {"s": np.float32(2.5), "2.0": np.float32(2.0), "s * 3.0 - 1.0": np.float32(6.5), "w": w}[value]
    v = np.broadcast_to(v, (8,)).astype(np.float32)
    want = np.tile(v / np.sqrt(np.mean(v * v) + np.float32(1e-6)) * w, 2)
    outs = evaluate(spec, xs, 16, DType.FLOAT32, "sum", operands)
    for out in outs:
        np.testing.assert_allclose(out, want, rtol=1e-6)
    got = simulate_calls(lower(spec, LowerOptions(Algorithm.DIRECT_PUSH, channels=2)), spec, [xs], 16, DType.FLOAT32,
                         "sum", calls=1, operands=[dict(o) for o in operands])
    for rank in range(2):
        assert np.array_equal(got[0][rank], outs[rank])


# --- the example: dumps (golden), kernels for every target --------------------------------------

import os  # noqa: E402

from purlinc import pipeline  # noqa: E402
from purlinc.atom import nvrtc  # noqa: E402
from purlinc.atom.codegen import generate  # noqa: E402
from purlinc.dtypes import ReduceOp  # noqa: E402

GOLDEN = Path(__file__).resolve().parent / "golden" / "epilogue"


def _example(world):
    return check(parse(EXAMPLE.read_text(), str(EXAMPLE)), world)


@pytest.mark.parametrize("stage, options", [
    ("spec", None), ("snac", LowerOptions(Algorithm.DIRECT_PUSH, packed=True, stage_copies=2)),
    ("snac", LowerOptions(Algorithm.TWO_SHOT, channels=2, slices=2)),
])
def test_example_dump_golden(stage, options):
    spec = _example(3)
    text = spec.format() if stage == "spec" else format_schedule(lower(spec, options))
    name = f"allreduce_add_rmsnorm.R3.{stage}" + (f".{options.key().replace('/', '_')}" if options else "") + ".txt"
    path = GOLDEN / name
    if os.environ.get("PURLIN_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs (PURLIN_UPDATE_GOLDEN=1 rewrites it)"


def test_schedule_json_round_trip():
    spec = _example(4)
    for options in OPTIONS:
        schedule = lower(spec, options)
        assert schedule_from_json(schedule_to_json(schedule)) == schedule


@pytest.mark.parametrize("arch, atom, options, dtype", [
    ("sm_80", "ldst", LowerOptions(Algorithm.DIRECT_PUSH, packed=True, stage_copies=2), DType.BFLOAT16),
    ("sm_90", "ldst", LowerOptions(Algorithm.DIRECT_PUSH, channels=4, slices=2, stage_copies=2), DType.FLOAT16),
    ("sm_100", "tma", LowerOptions(Algorithm.TWO_SHOT, channels=2), DType.FLOAT32),
    ("sm_90", "tma", LowerOptions(Algorithm.DIRECT_PUSH, channels=2), DType.BFLOAT16),
])
def test_example_compiles_with_nvrtc(arch, atom, options, dtype):
    spec = _example(2)
    kernel = generate(lower(spec, options), spec, atom=atom, arch=arch, dtype=dtype, op=ReduceOp.SUM)
    assert kernel.abi.epilogue_slots == 3 and kernel.abi.row_bytes == 4096 * dtype.itemsize
    assert "purlin_epilogue(" in kernel.source and "PURLIN_EPILOGUE_SLOTS 3" in kernel.source
    assert nvrtc.compile_cubin(kernel.source, kernel.filename, arch)


def test_an_epilogue_without_operands_compiles():
    """No operand: no argument words (a zero-length array is not C++), the rows still cut slices."""
    source = ("collective ar_scale(hidden = 4096) { in[r] = x  out[r] = x  reduce\n"
              "    epilogue rows(hidden) { out = out * 2.0 } }")
    spec = check(parse(source, "scale.pln"), 2)
    for options in (LowerOptions(Algorithm.DIRECT_PUSH, channels=2), LowerOptions(Algorithm.DIRECT_PUSH, packed=True)):
        kernel = generate(lower(spec, options), spec, atom="ldst", arch="sm_90", dtype=DType.BFLOAT16, op=ReduceOp.SUM)
        assert kernel.abi.epilogue_slots == 0 and kernel.abi.row_bytes == 8192
        assert kernel.abi.to_json()["row_bytes"] == 8192
        assert nvrtc.compile_cubin(kernel.source, kernel.filename, "sm_90")


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("options, fused", [
    (LowerOptions(Algorithm.DIRECT_PUSH, channels=4, slices=2), True),  # the reduce is the last step on its rows
    (LowerOptions(Algorithm.DIRECT_PUSH, packed=True), False),  # LL: packets reduced in the receive loop
    (LowerOptions(Algorithm.TWO_SHOT, channels=2), False),  # the all-gather's copy lands the rows last
])
def test_a_reduce_and_the_epilogue_of_its_rows_are_one_pass(world, options, fused):
    """Where the Epilogue step follows the reduce Consume that wrote its region, the kernel runs
    both in one pass (the reduced rows stay in registers; no barrier between them); every other
    Epilogue keeps its own pass."""
    spec = _example(world)
    schedule = lower(spec, options)
    kernel = generate(schedule, spec, atom="ldst", arch="sm_90", dtype=DType.BFLOAT16, op=ReduceOp.SUM)
    epilogues = sum(1 for p in schedule.concrete_programs() if p.rank == 0 for s in p.steps if isinstance(s, Epilogue))
    calls = kernel.source.count("purlin_reduce_epilogue_apply<")
    separate = re.search(r"purlin_epilogue_apply<(true|false)>\(args", kernel.source) is not None
    assert (calls > 0) == fused and separate != fused
    if fused:
        assert "__device__ __noinline__ void purlin_reduce_epilogue(" in kernel.source
        assert "barrier: step" not in kernel.source.split("one pass, the reduced rows")[0].rsplit("consume reduce", 1)[1]
        assert calls <= epilogues
    else:
        assert "purlin_reduce_epilogue" not in kernel.source


@pytest.mark.parametrize("dtype, op, paired", [
    (DType.BFLOAT16, ReduceOp.SUM, True), (DType.BFLOAT16, ReduceOp.MAX, False), (DType.FLOAT16, ReduceOp.SUM, False),
])
def test_the_fused_pass_sums_two_bf16_sources_a_pair_at_a_time(dtype, op, paired):
    """A bf16 sum's fused pass adds two sources a pair per instruction (elem.cuh's
    purlin_bf16_sum2_n: the bits of the float sum rounded, which the GPU test checks over every
    bf16 value); other element types and reductions keep the accumulator path."""
    from purlinc.atom.codegen.elems import pair_sum

    assert pair_sum(dtype, op) == ("purlin_bf16_sum2_n" if paired else None)
    spec = _example(2)
    kernel = generate(lower(spec, LowerOptions(Algorithm.DIRECT_PUSH, channels=4)), spec, atom="ldst", arch="sm_90",
                      dtype=dtype, op=op)
    assert ("purlin_bf16_sum2_n<PURLIN_VEC>(s[0].e, s[1].e, o);" in kernel.source) == paired
    assert nvrtc.compile_cubin(kernel.source, kernel.filename, "sm_90")


@pytest.mark.parametrize("statements, early, late", [
    ("h = out + residual  residual = h  out = rmsnorm(h, weight, eps)", ["residual"], ["out"]),
    # a store of a local that needs the norm waits for it; one of a norm-free expression does not
    ("h = out + residual  y = rmsnorm(h, weight, eps)  residual = y * 2.0  out = h * 0.5", ["out"], ["residual"]),
    ("residual = rmsnorm(out + residual, weight, eps)", [], ["residual"]),  # out not written: the reduced value
])
def test_stores_that_do_not_need_the_norm_leave_before_it(statements, early, late):
    """Pass 1 stores every buffer whose value does not need the row's rmsnorm (the residual of
    a decoder's add + RMSNorm), so those stores overlap the sum of squares; the others follow
    it.  Generated code stores them before the barrier that gathers the row's sums; a fused
    reduce whose epilogue does not write out stores the reduced value there too."""
    from purlinc.atom.epilogue import template_values

    source = FUSED.split("epilogue rows(hidden) {")[0] + "epilogue rows(hidden) { " + statements + " } }"
    spec = check(parse(source, "early.pln"), 2)
    values = template_values(spec.epilogue, DType.BFLOAT16, 512)
    assert [b["name"] for b in values["norm"]["early_stores"]] == early
    assert [b["name"] for b in values["late_stores"]] == late
    kernel = generate(lower(spec, LowerOptions(Algorithm.DIRECT_PUSH, channels=4)), spec, atom="ldst", arch="sm_90",
                      dtype=DType.BFLOAT16, op=ReduceOp.SUM)
    fused = kernel.source.split("void purlin_reduce_epilogue(")[1].split("\n}\n")[0]
    before, after = fused.split("__syncthreads();\n        float total")
    for name in early:
        assert f"(e_{name}, row0 + v) = q_{name};" in before and f"(e_{name}, row0 + v) = q_" not in after
    for name in late:
        assert f"(e_{name}, row0 + v) = q_{name};" in after and f"(e_{name}, row0 + v) = q_" not in before
    reduced = "q_out;  // the reduced value, as the consume stores it"
    assert (reduced in before) == ("out" not in early + late) and reduced not in after
    assert nvrtc.compile_cubin(kernel.source, kernel.filename, "sm_90")


def test_an_epilogue_ends_with_a_barrier_unless_the_next_block_starts_with_one():
    """Row sums are read after one barrier; the next Epilogue could write them again, so an
    epilogue block ends with a barrier (Trailing) unless the block after it begins with one."""
    from purlinc.atom.codegen.blocks import _mark_trailing_barriers

    def kinds(*names):
        return [{"kind": n} for n in names]

    marked = _mark_trailing_barriers(kinds("reduce_epilogue", "epilogue", "notify_one", "epilogue", "copy",
                                           "epilogue", "wait", "epilogue"))
    assert [b.get("trailing_barrier") for b in marked] == [True, False, None, True, None, False, None, True]
    for world, options in ((2, LowerOptions(Algorithm.DIRECT_PUSH, channels=8)), (4, LowerOptions(Algorithm.TWO_SHOT))):
        spec = _example(world)
        source = generate(lower(spec, options), spec, atom="ldst", arch="sm_90", dtype=DType.BFLOAT16,
                          op=ReduceOp.SUM).source
        calls = re.findall(r"epilogue_apply<(?:\d+, )?(true|false)>\(args", source)
        assert calls and set(calls) == {"false"}  # each is the round's last block, before its barrier
        for call in re.finditer(r"epilogue_apply<(?:\d+, )?false>\(args[^\n]*\n", source):
            after = (line.strip() for line in source[call.end():].splitlines())
            code = next(line for line in after if line and line != "}" and not line.startswith("//"))
            assert code.startswith("__syncthreads"), code  # a barrier, or a notify's opening one


def test_codegen_refusals_are_located():
    with pytest.raises(PurlinError) as info:
        spec = check(parse(FUSED.replace("hidden = 4096", "hidden = 4100"), "f.pln"), 2)
        generate(lower(spec, LowerOptions()), spec, atom="ldst", arch="sm_90", dtype=BF16, op=ReduceOp.SUM)
    assert info.value.render().splitlines()[:3] == [
        "f.pln:8:19: error: a row of 4100 bfloat16 elements is 8200 bytes, not a multiple of 16 (the kernels "
        "move 16-byte vectors)", "        epilogue rows(hidden) {", "                      ^^^^^^"]
    with pytest.raises(PurlinError) as info:
        spec = _example(2)
        generate(lower(spec, LowerOptions()), spec, atom="ldst", arch="sm_90", dtype=DType.INT32, op=ReduceOp.SUM)
    assert info.value.message == "an epilogue computes in float32; int32 outputs are not supported"
    with pytest.raises(PurlinError, match="the ce atom moves data with the copy engines and cannot compute an epilogue"):
        pipeline.prepare(EXAMPLE, world_size=2, arch="sm_90", atom="ce")
    for algorithm in (Algorithm.TWO_SHOT, Algorithm.RING):  # the owner or a neighbour writes a peer's rows
        with pytest.raises(PurlinError, match="an epilogue needs outputs no peer writes: with registered outputs, "
                                              f"{algorithm.value} has rank 0 write r1.out"):
            lower(_example(2), LowerOptions(algorithm, registered=frozenset({"in", "out"})))
    # Registered outputs change nothing in a one-shot reduction (it was refused for them)
    for algorithm in (Algorithm.DIRECT_PUSH, Algorithm.DIRECT_PULL):
        plain = lower(_example(3), LowerOptions(algorithm))
        registered = lower(_example(3), LowerOptions(algorithm, registered=frozenset({"out"})))
        assert registered.programs == plain.programs


def test_a_row_past_the_registers_is_refused_as_too_long():
    # 16,384 elements: bfloat16's longest row (so the checker passes it), past float32's
    with pytest.raises(PurlinError) as info:
        spec = check(parse(FUSED.replace("hidden = 4096", "hidden = 16384"), "f.pln"), 2)
        generate(lower(spec, LowerOptions()), spec, atom="ldst", arch="sm_90", dtype=DType.FLOAT32, op=ReduceOp.SUM)
    assert info.value.message == "a row of 16,384 float32 elements is longer than the epilogue supports (8,192 elements)"
    assert (info.value.span.line, info.value.span.column) == (8, 19)
    # odd bytes too: the length is the reason (a row no dtype runs; the checker refuses it first)
    assert row_problem(2**63 - 1, BF16) == ("a row of 9,223,372,036,854,775,807 bfloat16 elements is longer than "
                                            "the epilogue supports (16,384 elements)")


ROW_RULE = ("note: that is a multiple of 4 elements, at most 8,192, in float32; a multiple of 8 elements, "
            "at most 16,384, in float16 and bfloat16")


@pytest.mark.parametrize("hidden, message, nearest", [
    (6, "a row of 6 elements", "the nearest lengths that run: 4 (float32) and 8 (float32, float16, bfloat16)"),
    (1, "a row of 1 element", "the nearest length that runs: 4 (float32)"),
    (8196, "a row of 8,196 elements",  # float32's 16-byte vectors, past its length; not bf16's vectors
     "the nearest lengths that run: 8,192 (float32, float16, bfloat16) and 8,200 (float16, bfloat16)"),
    (16392, "a row of 16,392 elements", "the nearest length that runs: 16,384 (float16, bfloat16)"),
    (2**63 - 1, "a row of 9,223,372,036,854,775,807 elements", "the nearest length that runs: 16,384 (float16, bfloat16)"),
])
def test_a_row_no_dtype_runs_is_refused_by_the_checker(hidden, message, nearest):
    """Every compile of these would fail, whatever the dtype: check says so, at rows(E)."""
    source = f"collective six(hidden = {hidden}) {{\n    in[r] = x\n    out[r] = x\n    reduce\n" \
             "    epilogue rows(hidden) { out = out * 2.0 }\n}\n"
    with pytest.raises(PurlinError) as info:
        check(parse(source, "six.pln"), 2)
    assert info.value.render().splitlines() == [
        f"six.pln:5:19: error: {message} runs in no dtype: a row is a whole number of 16-byte vectors, at most "
        "32 KiB (the kernels move rows as vectors held in registers)",
        "        epilogue rows(hidden) { out = out * 2.0 }", "                      ^^^^^^",
        ROW_RULE, f"note: {nearest}", f"note: with hidden={hidden} (its default)", "note: while checking six for R=2"]


@pytest.mark.parametrize("hidden, runs", [(4, {DType.FLOAT32}), (12, {DType.FLOAT32}),
                                          (8, {DType.FLOAT32, DType.FLOAT16, BF16}), (16384, {DType.FLOAT16, BF16})])
def test_a_row_some_dtypes_run_is_valid(hidden, runs):
    """The checker refuses only lengths no dtype runs; the call's dtype is checked at generation."""
    spec = check(parse(FUSED.replace("hidden = 4096", f"hidden = {hidden}")), 2)
    assert spec.epilogue.row == hidden
    assert {d for d in DType if row_problem(hidden, d) is None} == runs


def test_verifier_rejects_misplaced_epilogues():
    spec = _example(2)
    schedule = lower(spec, LowerOptions(Algorithm.DIRECT_PUSH))
    program = schedule.programs[0]
    steps = list(program.steps)
    at = next(i for i, s in enumerate(steps) if isinstance(s, Epilogue))
    epilogue = steps.pop(at)
    # missing
    broken = replace(schedule, programs=(Program(0, 0, tuple(steps)), *schedule.programs[1:]))
    with pytest.raises(VerificationError, match=r"rank 0: r0.out\[0\].s0 never gets its epilogue"):
        verify(broken, spec)
    # before the consume that makes the slice's value
    early = replace(schedule, programs=(Program(0, 0, (epilogue, *steps)), *schedule.programs[1:]))
    with pytest.raises(VerificationError, match=r"touches r0.out\[0\].s0 after its epilogue"):
        verify(early, spec)
    # twice
    twice = replace(schedule, programs=(Program(0, 0, (*program.steps, epilogue)), *schedule.programs[1:]))
    with pytest.raises(VerificationError, match="applies the epilogue again"):
        verify(twice, spec)
    # a schedule without the spec's epilogue
    with pytest.raises(VerificationError, match="the schedule's epilogue is not the spec's"):
        verify(replace(schedule, epilogue=None), spec)


def test_draw_shows_the_epilogue_steps(tmp_path):
    from purlinc.cli import main

    for algorithm in ("direct-push", "two-shot"):
        out = tmp_path / f"{algorithm}.svg"
        assert main(["draw", str(EXAMPLE), "--ranks", "3", "--algorithm", algorithm, "-o", str(out)]) == 0
        assert out.read_text().count(">epilogue<") >= 3  # one box per rank at least


def test_check_cli_verifies_every_algorithm(capsys):
    from purlinc.cli import main

    assert main(["check", str(EXAMPLE), "--ranks", "1..4"]) == 0
    assert "allreduce_add_rmsnorm: ok for R=1..4" in capsys.readouterr().out


# --- fp8: the quantized variant -----------------------------------------------------------------

from purlinc.dtypes import e4m3_from_float32, e4m3_to_float32  # noqa: E402

FP8 = ROOT / "examples" / "fused" / "allreduce_add_rmsnorm_fp8.pln"


def test_e4m3_conversion_round_trips_and_saturates():
    bits = np.arange(256, dtype=np.uint8)
    values = e4m3_to_float32(bits)
    finite = ~np.isnan(values)
    assert np.array_equal(e4m3_from_float32(values[finite]), bits[finite])
    assert e4m3_to_float32(np.uint8(0x7E)) == 448.0 and e4m3_to_float32(np.uint8(0x01)) == 2.0**-9
    got = e4m3_from_float32(np.array([1e9, -1e9, 464.0, 0.5 * 2**-9, 1.5 * 2**-9, 1.0625, 1.1875, np.nan],
                                     dtype=np.float32))
    # saturate; saturate; beyond 448 saturates; ties to even: 0, 2 (x 2^-9), 1.0 (even), 1.25
    assert got.tolist() == [0x7E, 0xFE, 0x7E, 0x00, 0x02, 0x38, 0x3A, 0x7F]


@settings(max_examples=10, deadline=None)
@given(world=st.integers(2, 6), rows=st.integers(1, 4), option=st.integers(0, len(OPTIONS) - 2),
       seed=st.integers(0, 2**31))
def test_fp8_variant(world, rows, option, seed):
    """The fp8 output is the bf16 output's float value times the scale, saturated to e4m3;
    the simulator equals the evaluator bit for bit (every algorithm but the ring)."""
    spec = check(parse(FP8.read_text(), str(FP8)), world, {"hidden": 16})
    rng = np.random.default_rng(seed)
    n = rows * 16
    xs = [_bf16(rng, n) for _ in range(world)]

    def operands():
        return [{"residual": _bf16(np.random.default_rng(seed + r), n), "weight": _bf16(np.random.default_rng(r), 16),
                 "eps": 1e-5, "q": np.zeros(n, np.uint8), "inv_scale": 64.0} for r in range(world)]

    want_ops, got_ops = operands(), operands()
    want = evaluate(spec, xs, n, BF16, "sum", want_ops)
    got = simulate_calls(lower(spec, OPTIONS[option]), spec, [xs], n, BF16, "sum", calls=1, seed=seed,
                         operands=got_ops)[0]
    for rank in range(world):
        assert np.array_equal(got[rank], want[rank]) and np.array_equal(got_ops[rank]["q"], want_ops[rank]["q"])
        scaled = to_float32(want[rank], BF16)  # out is y rounded to bf16; q is y (unrounded) * scale
        q = e4m3_to_float32(want_ops[rank]["q"])
        assert np.all(np.abs(q) <= 448)  # saturated (the conversion test covers the rounding at the top)
        close = np.abs(scaled * 64) < 400
        np.testing.assert_allclose(q[close], scaled[close] * 64, rtol=2**-3, atol=2**-9 * 64)


def test_fp8_variant_compiles_with_nvrtc():
    spec = check(parse(FP8.read_text(), str(FP8)), 2)
    kernel = generate(lower(spec, LowerOptions(Algorithm.DIRECT_PUSH, packed=True, stage_copies=2)), spec,
                      atom="ldst", arch="sm_90", dtype=BF16, op=ReduceOp.SUM)
    assert "purlin_acc_to_e4m3" in kernel.source and kernel.abi.epilogue_slots == 5
    assert nvrtc.compile_cubin(kernel.source, kernel.filename, "sm_90")


def test_a_rows_value_does_not_depend_on_how_many_rows_are_evaluated_together():
    """A local that does not vary along the row (h = w) was broadcast into Fortran order, and
    NumPy summed a row's squares in another order when several rows were evaluated at once:
    the simulator (one slice at a time) then differed from the evaluator in float32 bits."""
    spec = check(parse("collective p6 with row w { in[r] = x out[r] = x reduce\n"
                       "epilogue rows(64) { h = w  out = rmsnorm(h, w, 0) + out } }", "p6.pln"), 2)
    rng = np.random.default_rng(0)
    out = rng.standard_normal(3 * 64).astype(np.float32)
    operands = {"w": rng.standard_normal(64).astype(np.float32)}
    together, one_by_one = out.copy(), out.copy()
    run_epilogue(spec.epilogue, together, dict(operands), DType.FLOAT32)
    for lo in range(0, out.size, 64):
        run_epilogue(spec.epilogue, one_by_one, dict(operands), DType.FLOAT32, lo, lo + 64)
    assert together.tobytes() == one_by_one.tobytes()


def test_the_oracle_refuses_a_row_the_dtype_cannot_run():
    """rows(12) in bf16 (24 bytes, not whole 16-byte vectors): the evaluator computed a result no
    kernel makes, and the simulator failed in its slicing with a bare message."""
    spec = check(parse("collective e(hidden = 12) with row w { in[r] = x out[r] = x reduce\n"
                       "epilogue rows(hidden) { out = out * w } }", "e.pln"), 2)
    says = "a row of 12 bfloat16 elements is 24 bytes, not a multiple of 16"
    operands = [{"w": np.zeros(12, np.uint16)}] * 2
    with pytest.raises(ValueError, match=says):
        evaluate(spec, [np.zeros(12, np.uint16)] * 2, 12, BF16, "sum", operands)
    with pytest.raises(ValueError, match=says):
        simulate_calls(lower(spec, LowerOptions()), spec, [np.zeros(12, np.uint16)] * 2, 12, BF16, "sum",
                       operands=operands)
    assert len(evaluate(spec, [np.zeros(12, np.float32)] * 2, 12, "float32", "sum",
                        [{"w": np.zeros(12, np.float32)}] * 2)) == 2  # 48 bytes: float32 runs it
