"""Checker: AST + R (+ parameters) -> resolved Spec.  Exact error texts are in test_errors.py."""

from __future__ import annotations

import json

import pytest

from purlinc.errors import PurlinError
from purlinc.frontend.ast import Operation
from purlinc.frontend.check import check, check_all, supports
from purlinc.frontend.parse import parse, parse_file
from purlinc.frontend.spec import Chunk, Slot

WORLD_SIZES = range(1, 9)


def x(*index: int) -> Chunk:
    return Chunk("x", tuple(index))


def load(example_paths, name):
    return parse_file(example_paths[name])


# What each standard collective's layouts must be, written out by hand per R (root = 0).
EXPECTED_LAYOUTS = {
    "allgather": lambda R: ([[x(r)] for r in range(R)], [[x(i) for i in range(R)] for _ in range(R)]),
    "reduce_scatter": lambda R: ([[x(i) for i in range(R)] for _ in range(R)], [[x(r)] for r in range(R)]),
    "allreduce": lambda R: ([[x(i) for i in range(R)] for _ in range(R)], [[x(i) for i in range(R)] for _ in range(R)]),
    "alltoall": lambda R: ([[x(r, j) for j in range(R)] for r in range(R)], [[x(i, r) for i in range(R)] for r in range(R)]),
    "broadcast": lambda R: ([[x()]] + [[] for _ in range(R - 1)], [[x()] for _ in range(R)]),
    "reduce": lambda R: ([[x()] for _ in range(R)], [[x()]] + [[] for _ in range(R - 1)]),
    "gather": lambda R: ([[x(r)] for r in range(R)], [[x(i) for i in range(R)]] + [[] for _ in range(R - 1)]),
    "scatter": lambda R: ([[x(i) for i in range(R)]] + [[] for _ in range(R - 1)], [[x(r)] for r in range(R)]),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_LAYOUTS))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_standard_layouts(example_paths, name, world_size):
    spec = check(load(example_paths, name), world_size)
    inputs, outputs = EXPECTED_LAYOUTS[name](world_size)
    assert spec.world_size == world_size and spec.name == name
    assert [list(layout) for layout in spec.inputs] == inputs
    assert [list(layout) for layout in spec.outputs] == outputs


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_copy_sources_are_the_single_producer(example_paths, world_size):
    spec = check(load(example_paths, "alltoall"), world_size)
    for rank in range(world_size):
        # out[rank][i] = x[i][rank], held by rank i at position rank.
        assert spec.sources[rank] == tuple((Slot(i, rank),) for i in range(world_size))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_sources_are_every_occurrence_in_rank_order(example_paths, world_size):
    spec = check(load(example_paths, "reduce_scatter"), world_size)
    assert spec.is_reduce
    for rank in range(world_size):
        assert spec.sources[rank] == (tuple(Slot(i, rank) for i in range(world_size)),)


@pytest.mark.parametrize("root", [0, 2, 3])
def test_root_parameter(example_paths, root):
    spec = check(load(example_paths, "gather"), 4, {"root": root})
    assert spec.params == (("root", root),)
    assert [len(layout) for layout in spec.outputs] == [4 if rank == root else 0 for rank in range(4)]
    spec = check(load(example_paths, "scatter"), 4, {"root": root})
    assert spec.sources[1] == ((Slot(root, 1),),)


def test_default_parameters(example_paths):
    assert check(load(example_paths, "broadcast"), 3).params == (("root", 0),)
    spec = check(load(example_paths, "alltoall_blocks"), 2)
    assert spec.params == (("k", 2),)
    assert list(spec.inputs[1]) == [x(1, j, b) for j in range(2) for b in range(2)]
    spec = check(load(example_paths, "alltoall_blocks"), 2, {"k": 3})
    assert list(spec.outputs[0]) == [x(i, 0, b) for i in range(2) for b in range(3)]


def test_unknown_parameter(example_paths):
    with pytest.raises(PurlinError, match=r"broadcast has no parameter 'rooot' \(its parameters: root\)"):
        check(load(example_paths, "broadcast"), 4, {"rooot": 1})
    with pytest.raises(PurlinError, match=r"allgather has no parameter 'k' \(its parameters: none\)"):
        check(load(example_paths, "allgather"), 4, {"k": 1})


def test_row_major_loops():
    definition = parse("collective c { in[r] = y[i][j] for i in 0..2 for j in 0..3  out[r] = y[1][0..3] copy }")
    spec = check(definition, 1)
    assert [str(c) for c in spec.inputs[0]] == ["y[0][0]", "y[0][1]", "y[0][2]", "y[1][0]", "y[1][1]", "y[1][2]"]
    assert spec.sources[0] == tuple((Slot(0, p),) for p in (3, 4, 5))


def test_multi_dimensional_ranges_are_row_major():
    spec = check(parse("collective c { in[0] = y[0..2][0..2] out[r] = y[r][0] copy }"), 2)
    assert [str(c) for c in spec.inputs[0]] == ["y[0][0]", "y[0][1]", "y[1][0]", "y[1][1]"]


def test_several_items_and_chunk_names():
    spec = check(parse("collective c { in[r] = a[r], b[r] out[r] = b[0..R], a[(r + 1) % R] copy }"), 3)
    assert [str(c) for c in spec.outputs[2]] == ["b[0]", "b[1]", "b[2]", "a[0]"]
    assert spec.sources[2][3] == (Slot(0, 0),)


def test_negative_operands_use_floor_semantics():
    # (r - 1) % R wraps like a ring wants; -1 / 2 is -1 (floor), as in Python.
    spec = check(parse("collective c { in[r] = x[r] out[r] = x[(r - 1) % R], x[(r - 1) / 2 + 1] copy }"), 3)
    assert [str(c) for c in spec.outputs[0]] == ["x[2]", "x[0]"]


def test_copy_replicated_accepts_identical_producers():
    definition = parse("collective c { in[r] = x out[r] = x copy replicated }")
    spec = check(definition, 3)
    assert spec.replicated
    assert spec.sources == tuple(((Slot(0, 0), Slot(1, 0), Slot(2, 0)),) for _ in range(3))


def test_copy_rejects_several_producers():
    with pytest.raises(PurlinError, match="conflicting producers"):
        check(parse("collective c { in[r] = x out[r] = x copy }"), 2)
    check(parse("collective c { in[r] = x out[r] = x copy }"), 1)  # one rank: one producer


def test_unused_input_chunks_are_allowed():
    spec = check(parse("collective c { in[r] = x[r], y[r] out[r] = x[r] copy }"), 2)
    assert spec.outputs == ((x(0),), (x(1),))


def test_where_constraints(example_paths):
    definition = load(example_paths, "pairwise_exchange")
    assert [supports(definition, size) for size in range(1, 7)] == [False, True, False, True, False, True]
    spec = check(definition, 4)
    assert [list(layout) for layout in spec.outputs] == [[x(1)], [x(0)], [x(3)], [x(2)]]
    with pytest.raises(PurlinError, match=r"pairwise_exchange is not defined for R=3: it requires R % 2 == 0"):
        check(definition, 3)


def test_check_all_returns_the_admitted_sizes(example_paths):
    assert check_all(load(example_paths, "pairwise_exchange"), range(1, 9)) == [2, 4, 6, 8]
    assert check_all(load(example_paths, "allgather"), range(1, 9)) == list(range(1, 9))
    for path in example_paths.values():
        assert check_all(parse_file(path), range(1, 17))


def test_check_all_names_the_failing_world_size():
    # x[r + 1] runs off the end at r = R - 1, so already R=1 fails.
    with pytest.raises(PurlinError) as info:
        check_all(parse("collective c { in[r] = x[r] out[r] = x[r + 1] copy }"), range(1, 9))
    assert info.value.message == "output chunk x[1] of rank 0 has no producer: no input names it"
    assert info.value.notes[-1] == "while checking c for R=1"

    with pytest.raises(PurlinError) as info:
        check_all(parse("collective c { in[r] = x[r] out[r] = x[1..R] copy }"), range(1, 9))
    assert info.value.message == "range 1..R is empty (1..1)"
    assert info.value.notes == ("while checking c for R=1",)

    with pytest.raises(PurlinError) as info:  # its values said once, not twice ("range 0..0 is empty (0..0)")
        check_all(parse("collective c { in[r] = x[r][0..0] out[r] = x[r][0..0] copy }"), range(1, 3))
    assert info.value.message == "range 0..0 is empty"

    # Only breaks from R=3 on: rank 2 names x[2] but the inputs stop at x[1].
    with pytest.raises(PurlinError) as info:
        check_all(parse("collective c { in[0] = x[0..2] out[r] = x[r] copy }"), range(1, 9))
    assert info.value.notes[-1] == "while checking c for R=3"


def test_check_all_with_a_root_too_large_for_small_worlds(example_paths):
    with pytest.raises(PurlinError) as info:
        check_all(load(example_paths, "broadcast"), range(1, 9), {"root": 2})
    assert info.value.message == "rank index 'root' is 2, outside 0..0"
    assert info.value.notes == ("while checking broadcast for R=1, root=2",)
    assert check_all(load(example_paths, "broadcast"), range(3, 9), {"root": 2}) == list(range(3, 9))


def test_check_all_when_no_size_is_admitted():
    definition = parse("collective c where R > 100 { in[r] = x[r] out[r] = x[r] copy }")
    with pytest.raises(PurlinError, match=r"c is defined for no world size in 1\.\.8"):
        check_all(definition, range(1, 9))


def test_check_all_names_the_parameter_values_the_conditions_use():
    definition = parse("collective ag(k = 1, m = 0) where k > 5, R > 0 { in[r] = x[r] out[r] = x[(r + k + m) % R] copy }")
    with pytest.raises(PurlinError) as info:
        check_all(definition, range(3, 4))
    assert info.value.message == "ag is defined for no world size in 3..3"
    assert info.value.notes == ("with k=1 (its default)",)  # m: not in a condition
    with pytest.raises(PurlinError) as info:
        check_all(definition, range(1, 9), {"k": 2})
    assert info.value.notes == ("with k=2",)  # no "while checking" note here to show a given value


def test_check_all_points_at_the_condition_that_refused_the_sizes():
    """Not at the first condition: 'R > 0' admits every size and explains nothing."""
    text = "collective c where R > 0, R > 100 { in[r] = x[r] out[r] = x[r] copy }"
    with pytest.raises(PurlinError) as info:
        check_all(parse(text), range(1, 9))
    assert info.value.span.column == text.index("R > 100") + 1
    assert info.value.notes == ()
    text = "collective c where R > 3, R < 3 { in[r] = x[r] out[r] = x[r] copy }"
    with pytest.raises(PurlinError) as info:
        check_all(parse(text), range(1, 9))
    assert info.value.span.column == text.index("R < 3") + 1  # refused 6 of the 8 (R=3 by both)
    assert info.value.notes == ("world sizes each condition refused: 'R < 3' 6, 'R > 3' 3",)


def test_every_condition_a_size_fails_is_counted_not_only_the_first():
    """A size counted only against the first condition it failed: 'R % 2 == 0' (written first)
    was pointed at with 5 refusals, though 'R > 100' refuses all 10 and fixing the first
    admits none.  A condition guarded by a failed one (k > 0, then R % k) counts as neither."""
    text = "collective f(k = 1) where R % 2 == 0, R > 100, R >= k { in[r] = x[r] out[r] = x[0] copy }"
    with pytest.raises(PurlinError) as info:
        check_all(parse(text), range(1, 11))
    assert info.value.span.column == text.index("R > 100") + 1
    assert info.value.notes == ("world sizes each condition refused: 'R > 100' 10, 'R % 2 == 0' 5",)
    guarded = "collective g(k = 0) where k > 0, R % k == 0 { in[r] = x[r] out[r] = x[0] copy }"
    with pytest.raises(PurlinError) as info:
        check_all(parse(guarded), range(1, 5))
    assert info.value.span.column == guarded.index("k > 0") + 1


def test_an_index_error_names_the_rank_and_loop_values_it_arose_at():
    with pytest.raises(PurlinError) as info:
        check(parse("collective c { in[r] = x[r] out[r] = x[r + 2 - i] for i in 0..4 copy }"), 4)
    assert info.value.message == "index 'r + 2 - i' is -1, out of bounds (chunk indices start at 0)"
    assert info.value.notes == ("at r=0, i=3", "while checking c for R=4")
    with pytest.raises(PurlinError) as info:  # a loop's own range, at the outer loop's value
        check(parse("collective c { in[r] = x[r] out[r] = x[j] for i in 0..2 for j in 0..(r - i) copy }"), 4)
    assert info.value.message == "range 0..(r - i) is empty (0..0)"
    assert info.value.notes == ("at r=0, i=0", "while checking c for R=4")
    with pytest.raises(PurlinError) as info:  # nothing bound: the message says all
        check(parse("collective c { in[0] = x[0 - 1] out[0] = x[0] copy }"), 2)
    assert info.value.notes == ("while checking c for R=2",)


@pytest.mark.parametrize(("name", "word"), [("R", "--ranks"), ("r", "each rank's own index")])
def test_a_parameter_named_like_a_bound_variable_says_what_that_variable_is(name, word):
    with pytest.raises(PurlinError) as info:
        check(parse("collective c { in[r] = x[r] out[r] = x[0..R] copy }"), 2, {name: 2})
    assert info.value.message == f"c has no parameter '{name}' (its parameters: none)"
    assert word in info.value.notes[0]


def test_world_size_must_be_positive(example_paths):
    with pytest.raises(PurlinError, match="the world size must be at least 1, not 0"):
        check(load(example_paths, "allgather"), 0)


def test_spec_json_is_plain_data(example_paths):
    spec = check(load(example_paths, "gather"), 2, {"root": 1})
    data = json.loads(json.dumps(spec.to_json()))
    assert data["collective"] == "gather" and data["params"] == {"root": 1} and data["operation"] == "copy"
    assert data["ranks"][1]["out"] == ["x[0]", "x[1]"]
    assert data["ranks"][1]["sources"] == [[{"rank": 0, "position": 0}], [{"rank": 1, "position": 0}]]
    assert data["ranks"][0]["out"] == []


def test_output_spans_give_the_source_line(example_paths):
    spec = check(load(example_paths, "allgather"), 2)
    assert spec.output_line(1, 1) == 4
    assert spec.output_line(5, 0) is None


def test_specs_compare_structurally():
    a = check(parse("collective c { in[r] = x[r] out[r] = x[0..R] copy }"), 3)
    b = check(parse("collective c {\n  in[r] = x[r]\n  out[r] = x[i] for i in 0..R\n  copy\n}"), 3)
    assert a == b and a.operation is Operation.COPY


def test_language_reference_examples_check(repo_dir):
    # docs/LANGUAGE.md shows every example as a one-liner; keep them valid.
    section = (repo_dir / "docs" / "LANGUAGE.md").read_text().split("## Examples")[1].split("\n## ")[0]
    one_liners = [line for line in section.splitlines() if line.startswith("collective")]
    assert len(one_liners) >= 12
    for line in one_liners:
        assert check_all(parse(line), range(1, 9))


@pytest.mark.parametrize(("text", "what"), [
    ("collective c(x = 1) { in[r] = x[r] out[r] = x[x] copy }", "a parameter"),
    ("collective c { in[r] = i[r] out[r] = i[i] for i in 0..R copy }", "a loop variable"),
    ("collective c { in[r] = R[r] out[r] = R[r] copy }", "the world size"),
])
def test_a_chunk_may_not_take_another_names_name(text, what):
    with pytest.raises(PurlinError) as info:
        check(parse(text), 2)
    name = info.value.message.split("'")[1]
    assert info.value.message == f"chunk '{name}' has the name of {what}"
    assert info.value.span.column == text.index(f"{name}[") + 1
