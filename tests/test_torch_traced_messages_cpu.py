"""Refusals made while dynamo traces (ops.fail / ops.require) carry their text when the ints in
it are symbols.

Dynamo reads an int as a symbol (a SymInt) under ``torch.compile(dynamic=True)``, and, through
automatic dynamic, once an int it reads (an argument, or an attribute of an object: a Group's
rank, an Entry's units) changed between compiles of the same code.  A symbol formatted in an
f-string inside the trace fails with dynamo's "BUILD_STRING type error" (``repr`` of a list
holding one: "does not know how to trace builtin operator `repr`"), which the caller then saw
in place of the refusal.  Every int in a traced message goes through ``ops.shown`` and its
kin (``value_shown``, ``ints_shown``, ``shape_shown``).  Each test compiles one piece of code
for several values, without a reset in between, and expects each call's own message; torch
2.11 failed all but the first of them with BUILD_STRING before these were wrapped.
"""

from __future__ import annotations

import contextlib
import enum
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import purlinc.torch as pt  # noqa: E402
from purlinc.frontend.check import check  # noqa: E402
from purlinc.frontend.parse import parse, parse_file  # noqa: E402
from purlinc.runtime.errors import ArgumentError  # noqa: E402
from purlinc.torch import ops  # noqa: E402
from purlinc.torch.epilogue import fused_add_rmsnorm_op  # noqa: E402
from test_torch_cpu import StandInWorlds, _Calls  # noqa: E402
from test_torch_epilogue_cpu import EXAMPLE, SPLIT_ROWS, _Loaded  # noqa: E402

# dynamic=None: automatic dynamic (the values after the first are symbols, the code being
# recompiled for them); dynamic=True: symbols from the first compile on
MODES = pytest.mark.parametrize("dynamic", [None, True], ids=["recompiled", "dynamic"])


@pytest.fixture(autouse=True)
def _default_group_kept():
    """pt.init(...) below sets the module-level calls' default group: the one before comes back."""
    from purlinc.torch import groups

    kept = list(groups._DEFAULT)
    yield
    groups._DEFAULT[:] = kept


def _refused_alike(dynamic, calls) -> None:
    """``calls``: (function, args, message) triples whose functions share one code object (made
    by one ``def``), compiled one after the other, each expected to be refused with its message
    (a compile-time refusal: dynamo's error carries ``fail``'s RuntimeError text)."""
    torch._dynamo.reset()  # once, before all of them: the later compiles see the ints change
    for fn, args, message in calls:
        with pytest.raises(Exception, match=re.escape(message)) as info:
            torch.compile(fn, backend="eager", fullgraph=True, dynamic=dynamic)(*args)
        assert "BUILD_STRING" not in str(info.value)
    torch._dynamo.reset()


def test_an_int_read_from_an_object_is_a_symbol_when_it_changed_between_compiles():
    """What the tests below rest on: this torch's dynamo reads a Group's rank as a symbol (a
    graph input) in the second compile of the same code for another group, and under
    dynamic=True at once.  Were it ever a constant again, the tests below would pass without
    testing anything, and this one says so.  (``isinstance(g.rank, torch.SymInt)`` in the
    trace answers False even for a symbol: the graph's inputs are the evidence.)"""
    groups = StandInWorlds(3).groups()
    inputs = []

    def backend(gm, example_inputs):
        inputs.append([n.name for n in gm.graph.nodes if n.op == "placeholder"])
        return gm.forward

    def probe(g):
        def f(x):
            return x + g.rank
        return f
    torch._dynamo.reset()
    for g in groups[1:]:
        assert torch.compile(probe(g), backend=backend, fullgraph=True)(torch.zeros(1)).item() == g.rank
    recompiled = inputs[-1]  # the graph the second group ran (torch 2.11 may read rank as a symbol from the
    torch._dynamo.reset()    # first compile on, carrying automatic dynamic over from earlier tests' compiles)
    assert torch.compile(probe(groups[2]), backend=backend, fullgraph=True, dynamic=True)(torch.zeros(1)).item() == 2
    torch._dynamo.reset()
    assert any("rank" in name for name in recompiled), inputs
    assert any("rank" in name for name in inputs[-1]), inputs


@MODES
def test_a_closed_groups_refusal_names_it_on_every_rank(dynamic):
    """``{self!r}``: the Group's repr formats its rank, world size and ranks."""
    groups = StandInWorlds(3).groups()
    for g in groups:
        g.close()

    def program(g):
        def f(x):
            g.all_reduce(x)
            return x
        return f
    _refused_alike(dynamic, [(program(g), (torch.ones(6),),
                              f"allreduce: purlinc.torch.Group(rank {r} of 3, cpu, global ranks [0, 1, 2]) was closed; "
                              "expected an open group") for r, g in enumerate(groups)])
    assert repr(groups[1]) == "purlinc.torch.Group(rank 1 of 3, cpu, global ranks [0, 1, 2])"  # eagerly the same


@MODES
def test_src_and_group_src_both_given_are_named(dynamic):
    g = StandInWorlds(2).groups()[0]

    def f(x, src):
        g.broadcast(x, src=src, group_src=src)
        return x
    _refused_alike(dynamic, [(f, (torch.ones(6), v), f"broadcast: src={v} and group_src={v}; expected one of them")
                             for v in (1, 2, 3)])


@MODES
def test_a_gather_or_scatter_dim_other_than_0_is_named(dynamic):
    pt.init(StandInWorlds(1).groups()[0])

    def gather(x, d):
        return pt.functional.all_gather_tensor(x, d)

    def scatter(x, d):
        return pt.functional.reduce_scatter_tensor(x, scatter_dim=d)
    _refused_alike(dynamic, [(gather, (torch.ones(4, 2), d), f"all_gather_tensor: gather_dim={d}, expected 0")
                             for d in (1, 2, 3)])
    _refused_alike(dynamic, [(scatter, (torch.ones(4, 2), d), f"reduce_scatter_tensor: scatter_dim={d}, expected 0")
                             for d in (1, 2, 3)])


@MODES
def test_split_sizes_that_are_not_integers_are_named(dynamic):
    """``{sizes!r}``: repr of a list holding a symbol is a call dynamo cannot trace."""
    g = StandInWorlds(2).groups()[0]

    def f(x, a):
        out = torch.empty_like(x)
        g.all_to_all_single(out, x, [a, 1.5], (a, "2"))
        return out
    _refused_alike(dynamic, [(f, (torch.ones(6), a), f"all_to_all_single: output_split_sizes=[{a}, 1.5], expected a "
                                                     "list of 2 integers (rows of dim 0 per rank)") for a in (1, 2, 3)])


@MODES
def test_an_int_op_is_named(dynamic):
    """An int is no reduction: dynamo could not trace getattr(op, ...) of a symbol, before the message."""
    g = StandInWorlds(1).groups()[0]

    def f(x, op):
        g.all_reduce(x, op=op)
        return x
    _refused_alike(dynamic, [(f, (torch.ones(4), op), f"all_reduce: op={op} is not supported; expected one of sum, "
                                                      "avg, prod, max, min") for op in (11, 12, 13)])


@MODES
def test_an_int_group_is_named(dynamic):
    def f(x, group):
        return pt.functional.all_reduce(x, group=group)
    _refused_alike(dynamic, [(f, (torch.ones(4), v), f"group={v}: expected a purlinc.torch.Group or a "
                                                     "torch.distributed ProcessGroup") for v in (11, 12, 13)])


@MODES
def test_a_float_where_an_int_belongs_is_named(dynamic):
    """Floats are read as symbols too (SymFloat): src= went through integer(), which dynamo could
    not trace for one (nor, before torch 2.13, for a float at all), and the messages formatted them."""
    g = StandInWorlds(2).groups()[0]
    pt.init(g)

    def broadcast(x, v):
        g.broadcast(x, src=v)
        return x

    def gather(x, v):
        return pt.functional.all_gather_tensor(x, v)

    def reduce(x, v):
        return pt.functional.all_reduce(x, op=v)

    def splits(x, v):
        out = torch.empty_like(x)
        g.all_to_all_single(out, x, None, [v, 1])
        return out
    for fn, message in ((broadcast, "broadcast: src={}, expected an int (a rank)"),
                        (gather, "all_gather_tensor: gather_dim={}, expected 0"),
                        (reduce, "all_reduce: op={} is not supported; expected one of sum"),
                        (splits, "all_to_all_single: input_split_sizes=[{}, 1], expected a list of 2 integers")):
        _refused_alike(dynamic, [(fn, (torch.ones(4), v), message.format(v)) for v in (1.5, 2.5, 3.5)])


@contextlib.contextmanager
def _gather_all_on_three_ranks(name: str):
    """An all-gather op named ``name`` on each of 3 ranks (entries whose rank differs), closed after."""
    spec = check(parse("collective gather_all { in[r] = x[r]  out[r] = x[0..R]  copy }"), 3, {})
    colls = [pt.op(_Calls(spec, r), name=name) for r in range(3)]
    try:
        yield colls
    finally:
        for c in colls:
            c.close()


@MODES
def test_an_in_place_call_of_unequal_sizes_is_named_on_every_rank(dynamic):
    """Entries whose rank and units differ (_inplace_units, _where, shown): one chunk in, three out."""
    def program(coll):
        def f(t):
            coll.inplace(t)
            return t
        return f
    with _gather_all_on_three_ranks("gather_all_traced_message") as colls:
        _refused_alike(dynamic, [(program(c), (torch.ones(6),),
                                  f"purlin::gather_all_traced_message on rank {r}: cannot run in place: rank {r} "
                                  "gives 1 chunks and receives 3; expected equal sizes (use the functional form or "
                                  "out=)")
                                 for r, c in enumerate(colls)])


@MODES
def test_an_out_of_the_wrong_size_is_named_on_every_rank(dynamic):
    """check_out's sizes and the rank in its where (TorchCollective._where), traced."""
    def program(coll):
        def f(x):
            return coll(x, out=torch.empty(7))
        return f
    with _gather_all_on_three_ranks("gather_all_traced_out") as colls:
        _refused_alike(dynamic, [(program(c), (torch.ones(2),),
                                  f"purlin::gather_all_traced_out on rank {r}: out has 7 elements, expected 6 (3 "
                                  "chunks x 2 elements per chunk)") for r, c in enumerate(colls)])


def test_the_fused_ops_fake_names_sizes_as_numbers_under_symbolic_shapes():
    """The fake implementation runs under symbolic shapes (make_fx's, torch.compile's dynamic
    ones): its refusals printed the symbols ("residual is float32 (s0, s1)")."""
    from torch.fx.experimental.proxy_tensor import make_fx

    fused = fused_add_rmsnorm_op(_Loaded(check(parse_file(EXAMPLE), 2, {"hidden": 64})), device="cpu")
    split = fused_add_rmsnorm_op(_Loaded(check(parse(SPLIT_ROWS), 2)), device="cpu")
    try:
        cases = [
            (fused, (torch.randn(6, 64), torch.randn(6, 64, dtype=torch.float64), torch.randn(64)),
             "residual is float64 (6, 64), expected float32 (6, 64) (x's dtype and shape)"),
            (fused, (torch.randn(6, 64), torch.randn(6, 64), torch.randn(32)),
             "weight is float32 (32,), expected float32 (64,) (one row, x's dtype)"),
            (fused, (torch.randn(6, 32), torch.randn(6, 32), torch.randn(64)),
             "x has shape (6, 32), expected whole rows of 64 elements"),
            (split, (torch.randn(3, 64), torch.randn(3, 64), torch.randn(64)),
             "x has 3 rows, expected a multiple of 2: ar2 splits x into 2 chunks"),
            (fused, (torch.randn(4, 64), torch.randn(4 * 64 + 1)[1:].view(4, 64), torch.randn(64)),
             "residual starts 4 bytes past a 16-byte boundary"),
        ]
        for op, args, message in cases:
            with pytest.raises(ArgumentError, match=re.escape(message)):
                op(*args, 1e-6)  # eagerly: the real implementation's text
            with pytest.raises(Exception, match=re.escape(message)):
                make_fx(_calling(op), tracing_mode="symbolic")(*args)
    finally:
        fused.close()
        split.close()


def _calling(op):
    def call(x, residual, weight):
        return op(x, residual, weight, 1e-6)
    return call


class _Color(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize("value", [0, -7, 2**70, True, 1.5, -0.0, 1e300, float("inf"), float("nan"), np.float64(2.5),
                                   "2", b"x", None, np.int64(3), _Color.RED, [], [1, 2.5],
                                   (), (4,), (4, "a", None), [[1, 2], (3,)], torch.tensor([1, 2])])
def test_value_shown_is_repr(value):
    """The messages keep their text: value_shown is repr() (an int a plain int, a list's too)."""
    assert ops.value_shown(value) == repr(value)
