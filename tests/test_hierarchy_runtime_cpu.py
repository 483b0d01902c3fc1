"""The hierarchical runtime's checks that need neither a GPU nor other processes: a call's
arguments (checked as a flat call's are), the G a rank brings to the load's exchange and how
the ranks' G values settle, the per-phase algorithm (as the planner picks it), and
``purlinc.load``'s refusals with gpus_per_node.  The multi-process side (every rank raising the
same error at load) is in tests/test_hierarchy_torch.py."""

from __future__ import annotations

import os

import pytest

from purlinc.runtime import hierarchical
from purlinc.runtime.errors import ArgumentError
from purlinc.snac.hierarchy import IntraPhase, TopologyError

torch = pytest.importorskip("torch")


def _example(repo_dir, name: str) -> str:
    return os.path.join(repo_dir, "examples", f"{name}.pln")


class _Fill:
    """Stands in for an intra phase's Purlin collective: writes 1s into its destination."""

    def __init__(self):
        self.calls = []

    def __call__(self, x=None, out=None, op="sum", *, count=None, dtype=None):
        self.calls.append((x, out, count, dtype))
        if out is not None:
            out.fill_(1)
        return out


def _scatter_rank1(repo_dir):
    """Scatter from rank 0 on one node of 2 (a single intra phase): rank 1 gives nothing and
    receives one chunk."""
    plan = hierarchical.plan_for(_example(repo_dir, "scatter"), 2, 2, {"root": 0})
    assert [type(p) for p in plan.phases] == [IntraPhase]
    stand_in = _Fill()
    return hierarchical.HierarchicalCollective(plan, 1, "cpu", None, {0: stand_in}, {}), stand_in


def _allreduce_rank0(repo_dir):
    plan = hierarchical.plan_for(_example(repo_dir, "allreduce"), 2, 2)
    return hierarchical.HierarchicalCollective(plan, 0, "cpu", None, {}, {})


def _refusal(call) -> str:
    with pytest.raises(ArgumentError) as caught:
        call()
    return caught.value.message


def test_call_with_count_and_a_dtype_name(repo_dir):
    # dtype= by name, as flat calls take it (it reached torch.empty as a str: a raw TypeError).
    coll, stand_in = _scatter_rank1(repo_dir)
    out = coll(count=3, dtype="float32")
    assert out.dtype == torch.float32 and out.tolist() == [1, 1, 1]
    assert stand_in.calls[0][2] == 3


def test_an_empty_x_says_the_dtype_of_a_rank_that_only_receives(repo_dir):
    """An empty bf16 x with count= on a receive-only rank allocated a bf16 out before the calls
    were checked as flat calls are; the check then asked for dtype= (the reviewer caught it)."""
    coll, stand_in = _scatter_rank1(repo_dir)
    out = coll(torch.empty(0, dtype=torch.bfloat16), count=3)
    assert out.dtype == torch.bfloat16 and out.numel() == 3 and stand_in.calls[0][2] == 3


def test_an_in_place_call_is_refused_as_a_flat_call_is(repo_dir):
    """docs/HIERARCHY.md: x and out may not overlap (an all-reduce of two nodes read its x in the
    first phase only, but a plan of one node reads x and writes out in one schedule)."""
    coll = _allreduce_rank0(repo_dir)
    t = torch.zeros(12)
    assert "x and out overlap" in _refusal(lambda: coll(t, t))


@pytest.mark.parametrize("count,expected", [
    (-1, "count=-1 is negative"),
    (2.5, "count=2.5, expected an int (elements per chunk) or None"),
    (True, "count=True, expected an int (elements per chunk) or None"),  # was taken as 1
])
def test_call_refuses_a_bad_count(repo_dir, count, expected):
    coll, _ = _scatter_rank1(repo_dir)
    assert _refusal(lambda: coll(count=count, dtype=torch.float32)) == f"scatter (hierarchical) on rank 1: {expected}"


def test_call_without_out_or_count_on_a_rank_that_receives(repo_dir):
    # Rank 1 receives a chunk (it was told it "holds no input or output here").
    coll, _ = _scatter_rank1(repo_dir)
    assert _refusal(coll) == ("scatter (hierarchical) on rank 1: out or count= is required (this rank receives "
                              "1 chunk(s) and gives none), got neither")


def test_call_without_x_on_a_rank_that_gives(repo_dir):
    # count and dtype given, x missing: it went on into the phases (a raw TypeError there, and
    # the other ranks waiting in NCCL); now refused before any exchange.
    coll = _allreduce_rank0(repo_dir)
    assert _refusal(lambda: coll(None, count=4, dtype=torch.float32)) == (
        "allreduce (hierarchical) on rank 0: x is required (this rank gives 2 chunk(s)), got None")


@pytest.mark.parametrize("call,expected", [
    (lambda c: c(torch.empty(12), op="avg"), "unknown reduce op 'avg'; expected one of sum, prod, max, min"),
    (lambda c: c(torch.empty(12, dtype=torch.float64)), "x has dtype float64, which Purlin does not support"),
    (lambda c: c(torch.empty(12), out=torch.empty(12, dtype=torch.float16)),
     "out has dtype float16, expected float32 (the dtype of x)"),
    (lambda c: c(torch.empty(12), count=4), "count=4, but the buffers say 6 elements per chunk"),
    (lambda c: c(torch.empty(12), count=6, dtype="int32"), "dtype=int32, but the buffers have dtype float32"),
    (lambda c: c(torch.empty(13)), "x has 13 elements, expected a multiple of 2"),
])
def test_call_refusals_name_the_argument(repo_dir, call, expected):
    coll = _allreduce_rank0(repo_dir)
    assert _refusal(lambda: call(coll)).startswith(f"allreduce (hierarchical) on rank 0: {expected}")


# ---------------------------------------------------------------------------------------------
# the G each rank brings to the load's exchange, and how the ranks' values settle


@pytest.mark.parametrize("text", ["²", "1.0", "+1", "", "0", "-1"])
def test_local_world_size_that_is_not_a_whole_number(monkeypatch, text):
    # "²".isdigit() is True, and int("²") then raised a raw ValueError.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", text)
    G, source, problem = hierarchical._own_gpus_per_node(None)
    assert (G, source) == (None, "LOCAL_WORLD_SIZE")
    assert problem == f"gpus_per_node: not given, and LOCAL_WORLD_SIZE={text!r} is not a whole number >= 1"


def test_given_gpus_per_node_overrides_local_world_size(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert hierarchical._own_gpus_per_node(1) == (1, "gpus_per_node", None)
    assert hierarchical._own_gpus_per_node(None) == (2, "LOCAL_WORLD_SIZE", None)
    assert hierarchical._own_gpus_per_node(True)[2] == "gpus_per_node must be an integer >= 1, got True"


def _view(G, source="LOCAL_WORLD_SIZE", problem=None, host="h"):
    return hierarchical._RankView(host, G, source, problem, ("ok", "allreduce", "f"))


def test_unequal_nodes_name_every_rank_and_source():
    views = [_view(2), _view(2), _view(1)]
    with pytest.raises(TopologyError) as caught:
        hierarchical._agreed_gpus_per_node(views, 3)
    assert caught.value.message == ("nodes of unequal size: the ranks disagree on gpus_per_node: ranks 0, 1: "
                                    "LOCAL_WORLD_SIZE=2; rank 2: LOCAL_WORLD_SIZE=1")
    unset = "gpus_per_node: not given and LOCAL_WORLD_SIZE (torchrun) is not set"
    with pytest.raises(TopologyError) as caught:
        hierarchical._agreed_gpus_per_node([_view(1), _view(None, problem=unset)], 2)
    assert caught.value.message == ("nodes of unequal size: the ranks disagree on gpus_per_node: rank 0: "
                                    f"LOCAL_WORLD_SIZE=1; rank 1: {unset}")


def test_not_a_multiple_says_where_g_came_from():
    with pytest.raises(TopologyError) as caught:
        hierarchical._agreed_gpus_per_node([_view(4)], 1)
    assert caught.value.message == "world size R=1 is not a multiple of gpus_per_node=4 (torchrun's LOCAL_WORLD_SIZE)"
    with pytest.raises(TopologyError) as caught:
        hierarchical._agreed_gpus_per_node([_view(4, "gpus_per_node")], 1)
    assert caught.value.message == "world size R=1 is not a multiple of gpus_per_node=4"


def test_given_g_groups_ranks_whatever_local_world_size_says():
    # LOCAL_WORLD_SIZE=2,2,1 but gpus_per_node=1 on every rank: only the hosts decide.
    views = [_view(1, "gpus_per_node", host=h) for h in ("a", "a", "b")]
    assert hierarchical._agreed_gpus_per_node(views, 3) == 1
    hierarchical._check_nodes(views, 1)
    with pytest.raises(TopologyError, match=r"node 0 \(ranks 0\.\.2\) spans hosts \['a', 'b'\]"):
        hierarchical._check_nodes(views, 3)


# ---------------------------------------------------------------------------------------------
# the algorithm of each intra phase


@pytest.mark.parametrize("algorithm", ["two-shot", "ring", "direct-pull"])
@pytest.mark.parametrize("name,R,G", [("allreduce", 4, 2), ("reduce_scatter", 4, 2), ("broadcast", 4, 2)])
def test_phase_algorithm_as_the_planner_picks_it(repo_dir, algorithm, name, R, G):
    """Each intra phase loads with the algorithm the planner proves for it (two-shot falls back
    to direct-push where it does not apply, as ``purlinc check --gpus-per-node -a`` verifies),
    and that lowers: load_hierarchical(..., algorithm="two-shot") failed on such phases."""
    from purlinc.runtime.collective import prepare_options
    from purlinc.runtime.options import LoadOptions
    from purlinc.snac.hierplan import plan_hierarchical
    from purlinc.snac.ir import Algorithm, LowerOptions

    plan = hierarchical.plan_for(_example(repo_dir, name), R, G)
    proved = plan_hierarchical(plan.spec, G, LowerOptions(algorithm=Algorithm(algorithm)))
    sources = hierarchical.intra_sources(plan, 0)
    for index, phase in enumerate(plan.phases):
        if isinstance(phase, IntraPhase) and index in sources:
            shape = plan.canonical[phase.schedules[0]]
            chosen = hierarchical._phase_algorithm(algorithm, shape)
            assert chosen == proved.schedules[proved.phases[index].schedules[0]].options.algorithm.value
            compiled = prepare_options(sources[index], G, LoadOptions(algorithm=chosen, arch="sm_90"))
            assert compiled.spec.world_size == G


# ---------------------------------------------------------------------------------------------
# purlinc.load with gpus_per_node: each refusal names its argument


_TAKES = ("load(..., gpus_per_node=G) takes comm=None, no trace, no orchestration options and no capacity or "
          "dtype; got ")


@pytest.mark.parametrize("kwargs,expected,notes", [
    ({"trace": True}, "trace=True", ["trace=True: hierarchical collectives are not traced"]),
    ({"channels": 2}, "channels=2", ["channels=2: the plan fixes each intra-node phase's schedule"]),
    ({"algorithm": "ring", "slices": 2}, "algorithm='ring', slices=2",
     ["algorithm='ring': the plan fixes each intra-node phase's schedule",
      "slices=2: the plan fixes each intra-node phase's schedule"]),
    ({"capacity": 8}, "capacity=8", ["capacity=8: a hierarchical plan moves fixed-size chunks"]),
])
def test_load_with_gpus_per_node_names_the_argument(repo_dir, kwargs, expected, notes):
    # Each used to get one message naming none of them (and never trace).
    import purlinc

    with pytest.raises(ArgumentError) as caught:
        purlinc.load(_example(repo_dir, "allreduce"), None, gpus_per_node=1, **kwargs)
    assert caught.value.message == _TAKES + expected
    assert list(caught.value.notes) == notes


def test_load_with_gpus_per_node_and_a_comm(repo_dir):
    import purlinc

    with pytest.raises(ArgumentError) as caught:
        purlinc.load(_example(repo_dir, "allreduce"), object(), gpus_per_node=1, trace=True)
    assert caught.value.message == _TAKES + "comm=<object>, trace=True"
    assert caught.value.notes[0] == "comm=<object>: it builds a communicator per node"
