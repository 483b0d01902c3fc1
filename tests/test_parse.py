"""Parser: .pln text -> AST, spans, canonical re-printing.  Error rendering lives in test_errors.py."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from purlinc.errors import PurlinError
from purlinc.frontend import ast
from purlinc.frontend.parse import parse, parse_file

R = ast.Name("R")
r = ast.Name("r")


def n(value: int) -> ast.Number:
    return ast.Number(value)


def test_allgather_ast(example_paths):
    definition = parse_file(example_paths["allgather"])
    assert definition == ast.CollectiveDef(
        name="allgather",
        params=(),
        constraints=(),
        assignments=(
            ast.Assignment(ast.Buffer.IN, r, (ast.Item(ast.ChunkRef("x", (r,)), ()),)),
            ast.Assignment(ast.Buffer.OUT, r, (ast.Item(ast.ChunkRef("x", (ast.Range(n(0), R),)), ()),)),
        ),
        operation=ast.Operation.COPY,
        replicated=False,
    )


def test_params_constraints_and_loops():
    definition = parse(
        "collective c(a, b = 3, c = -2) where R % 2 == 0, R >= 2 {\n"
        "  in[r] = x[r][i] for i in 0..b\n"
        "  out[a] = x[j][i] for j in 0..R for i in 0..b\n"
        "  reduce\n"
        "}\n"
    )
    assert definition.params == (ast.Param("a", None), ast.Param("b", 3), ast.Param("c", -2))
    assert definition.constraints == (
        ast.Condition(ast.Binary(ast.BinaryOp.MOD, R, n(2)), ast.Compare.EQ, n(0)),
        ast.Condition(R, ast.Compare.GE, n(2)),
    )
    out = definition.assignments[1]
    assert out.buffer is ast.Buffer.OUT and not out.every_rank and out.rank == ast.Name("a")
    assert [loop.variable for loop in out.layout[0].loops] == ["j", "i"]  # first loop outermost
    assert definition.operation is ast.Operation.REDUCE and not definition.replicated


def test_copy_replicated_and_semicolons():
    definition = parse("collective c { in[r] = x; out[r] = x; copy replicated; }")
    assert definition.operation is ast.Operation.COPY and definition.replicated


@pytest.mark.parametrize("name", ["copy", "reduce"])
def test_operation_words_can_name_a_collective(name):
    assert parse(f"collective {name} {{ in[r] = x out[0] = x reduce }}").name == name


@pytest.mark.parametrize("chunk", ["index", "input", "output", "copyx", "r2", "Rx", "replicated_x", "_"])
def test_names_that_start_with_a_keyword_are_names(chunk):
    definition = parse(f"collective c {{ in[r] = {chunk}[r] out[r] = {chunk}[r] copy }}")
    assert definition.assignments[0].layout[0].chunk.name == chunk


def test_comments_are_ignored():
    with_comments = parse(
        "// line comment\ncollective c /* inline */ {\n  in[r] = x[r] // trailing\n"
        "  /* a\n  block */ out[r] = x[0..R]\n  copy\n}\n"
    )
    assert with_comments == parse("collective c { in[r] = x[r] out[r] = x[0..R] copy }")


def test_operator_precedence_and_associativity():
    (index,) = parse("collective c { in[r] = x[r - 1 - 2 * r % 3 / 4] out[r] = x copy }").assignments[0].layout[0].chunk.indices
    # (r - 1) - (((2 * r) % 3) / 4)
    product = ast.Binary(ast.BinaryOp.DIV, ast.Binary(ast.BinaryOp.MOD, ast.Binary(ast.BinaryOp.MUL, n(2), r), n(3)), n(4))
    assert index == ast.Binary(ast.BinaryOp.SUB, ast.Binary(ast.BinaryOp.SUB, r, n(1)), product)


def test_spans_point_at_the_source():
    definition = parse("collective c {\n    in[r]  = x[r]\n    out[r] = x[0..R]\n    copy\n}\n", "f.pln")
    out = definition.assignments[1]
    rng = out.layout[0].chunk.indices[0]
    assert (out.span.line, out.span.column) == (3, 5)
    assert (rng.span.line, rng.span.column, rng.span.end_column) == (3, 16, 20)
    assert rng.span.where() == "f.pln:3:16"
    assert (definition.operation_span.line, definition.operation_span.column) == (4, 5)


def test_spans_do_not_take_part_in_equality():
    assert parse("collective c { in[r] = x out[r] = x copy }") == parse(
        "collective c {\n\n   in[r]   =   x\n out[r]=x\n copy\n}"
    )


def test_every_example_reprints_canonically(example_paths):
    for name, path in example_paths.items():
        definition = parse_file(path)
        text = definition.format()
        assert parse(text) == definition, name
        assert parse(text).format() == text, name  # a fixed point


def test_format_keeps_needed_parentheses_only():
    definition = parse("collective c { in[r] = x[(r + 1) % R][r - (1 - r)][-(r)][(r * 2)] out[r] = x copy }")
    assert definition.assignments[0].format() == "in[r] = x[(r + 1) % R][r - (1 - r)][-r][r * 2]"


# Expressions generated at random must survive print -> parse unchanged.
_leaves = st.one_of(st.integers(0, 9).map(ast.Number), st.sampled_from(["r", "R", "k"]).map(ast.Name))
_exprs = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        inner.map(ast.Negate),
        st.builds(ast.Binary, st.sampled_from(list(ast.BinaryOp)), inner, inner),
    ),
    max_leaves=8,
)


@given(_exprs)
def test_expression_format_round_trips(expr):
    definition = parse(f"collective c(k = 1) {{ in[r] = x[{expr.format()}] out[r] = x copy }}")
    assert definition.assignments[0].layout[0].chunk.indices == (expr,)


def test_parse_errors_are_purlin_errors():
    with pytest.raises(PurlinError) as info:
        parse("collective c { in[r] = x }", "bad.pln")
    assert info.value.span is not None and info.value.span.source.name == "bad.pln"


def test_a_semicolon_after_the_epilogue():
    """LANGUAGE.md: "a `;` after any of them is allowed": after the epilogue too."""
    source = ("collective f(hidden = 16) with rows residual, row weight, scalar eps {\n"
              "  in[r] = x; out[r] = x; reduce;\n"
              "  epilogue rows(hidden) { h = out + residual; residual = h; out = rmsnorm(h, weight, eps) };\n}\n")
    assert parse(source).epilogue is not None


FUSED_LINES = ("collective f(hidden = 8) with rows res, row w, scalar eps {\n  in[r] = x[0..R]\n  out[r] = x[0..R]\n"
               "  reduce\n  epilogue rows(hidden) {\n    h = out + res\n    res = h\n    out = rmsnorm(h, w, eps)\n  }\n}\n")


def test_statements_of_every_kind_may_share_a_line():
    """LANGUAGE.md, "Syntax": no statement needs a separator, an epilogue's included: one rule for
    the whole language, whose documented one-liners (`{ in[r] = x out[r] = x copy }`) need it."""
    shared = parse("collective f(hidden = 8) with rows res, row w, scalar eps { in[r] = x[0..R] out[r] = x[0..R] "
                   "reduce epilogue rows(hidden) { h = out + res res = h out = rmsnorm(h, w, eps) } }")
    assert shared == parse(FUSED_LINES)
    assert [s.format() for s in shared.epilogue.statements] == ["h = out + res", "res = h", "out = rmsnorm(h, w, eps)"]


def test_a_statement_may_run_on_over_several_lines():
    split = FUSED_LINES.replace("h = out + res", "h = out\n      + res")
    split = split.replace("rmsnorm(h, w, eps)", "rmsnorm(h,\n  w, eps)")
    assert parse(split.replace("out[r] = x[0..R]", "out[r] =\n    x[0..R]")) == parse(FUSED_LINES)
