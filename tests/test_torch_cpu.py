"""purlinc.torch without a GPU: the custom ops register, their fake implementations give the
right shapes and dtypes, torch.compile traces the torch.distributed-shaped calls whole
(fullgraph=True, no graph break), and bad input fails clearly.

A CPU stand-in takes the loaded collective's place: R threads, one per rank, each a Group
whose loader returns a StandIn; a call deposits the rank's input, meets the others at a
barrier and takes its output from the NumPy evaluator (the spec's own oracle).  Expected
values below are computed independently with NumPy (sums, concatenations).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import purlinc.torch as pt  # noqa: E402
from purlinc.dtypes import DType, ReduceOp  # noqa: E402
from purlinc.frontend.check import check  # noqa: E402
from purlinc.frontend.evaluate import evaluate  # noqa: E402
from purlinc.frontend.parse import parse  # noqa: E402
from purlinc.frontend.standard import SOURCES  # noqa: E402
from purlinc.runtime.errors import ArgumentError  # noqa: E402
from purlinc.torch import ops as ops_module  # noqa: E402
from rank_threads import on_threads  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
_TORCH_TO_DTYPE = {torch.float32: DType.FLOAT32, torch.float16: DType.FLOAT16, torch.int32: DType.INT32,
                   torch.int64: DType.INT64}  # int64: what float64 and complex64 copies travel as


class Comm:
    def __init__(self, rank, world_size, device="cpu"):
        self.rank, self.world_size, self.device = rank, world_size, device


class Sequence:
    """One barrier for every collective of a set of ranks, and what each rank is calling: a
    rank that calls its collectives in another order than its peers (a compiler that dropped
    or reordered one) is caught at once, not left waiting."""

    def __init__(self, world_size):
        self.barrier = threading.Barrier(world_size, timeout=30)
        self.calling = [None] * world_size


class World:
    """What the ranks of one stand-in collective share."""

    def __init__(self, source, world_size, params, sequence=None):
        self.spec = check(parse(source), world_size, params)
        self.sequence = sequence or Sequence(world_size)
        self.barrier = self.sequence.barrier
        self.slots = [None] * world_size


class StandIn:
    """One rank's collective on CPU tensors (float32 / int32), through the spec's evaluator."""

    def __init__(self, world: World, rank: int):
        self.world, self.spec, self.rank = world, world.spec, rank
        self.comm = Comm(rank, world.spec.world_size)
        self.warmed = set()
        self.closed = False

    def is_warm(self, dtype, op, count):
        return (dtype, op) in self.warmed

    def close(self):
        self.closed = True

    def __call__(self, x=None, out=None, op="sum", *rest, row=1, expected_sizes=None):
        if self.spec.sizes is not None:  # the all-to-all with run-time sizes: (x, sizes, out, out_sizes)
            return self._sized(x, out, op, *rest, row=row, expected_sizes=expected_sizes)
        spec, w, r = self.spec, self.world, self.rank
        ins, outs = len(spec.inputs[r]), len(spec.outputs[r])
        probe = x if x is not None else out
        dtype = _TORCH_TO_DTYPE[probe.dtype]
        count = x.numel() // ins if ins else out.numel() // outs
        self.warmed.add((dtype, ReduceOp.parse(op) if spec.is_reduce else None))  # as a kernel load would
        w.sequence.calling[r] = (spec.name, spec.params)
        w.barrier.wait()
        if len(set(w.sequence.calling)) != 1:
            raise AssertionError(f"ranks call different collectives at once: {w.sequence.calling}")
        w.barrier.wait()  # everyone has compared before anyone moves on
        # detached: a Group call writes a tensor that requires grad as a kernel writes memory, unseen by autograd
        w.slots[r] = x.detach().reshape(-1).numpy().copy() if x is not None else np.empty(0, dtype.storage)
        w.barrier.wait()
        result = evaluate(spec, w.slots, count, dtype, op if spec.is_reduce else None)[r]
        w.barrier.wait()  # every rank has read the slots before any rank's next call refills them
        if out is not None:
            out.copy_(torch.from_numpy(np.ascontiguousarray(result)).view(out.shape))
        return out

    def _sized(self, x, sizes, out, out_sizes, row=1, expected_sizes=None):
        """Split sizes in rows of ``row`` elements, through the evaluator of run-time sizes."""
        from purlinc.frontend.evaluate import evaluate_sized

        w, r = self.world, self.rank
        expected = None if expected_sizes is None else [int(v) * row for v in expected_sizes.tolist()]
        w.slots[r] = (x.reshape(-1).numpy().copy(), [int(v) * row for v in sizes.tolist()], out.reshape(-1).numpy().copy(),
                      expected)
        w.barrier.wait()
        outs, written, _ = evaluate_sized(self.spec, [s[0] for s in w.slots], [s[1] for s in w.slots], 1 << 40,
                                          [s[2] for s in w.slots], [s[3] for s in w.slots])
        w.barrier.wait()
        out.reshape(-1).copy_(torch.from_numpy(outs[r]))
        out_sizes.copy_(torch.tensor([v // row for v in written[r]], dtype=torch.int64))
        return out, out_sizes


class StandInWorlds:
    """Loaders for R ranks' Groups: the same (source, params) gives one shared World."""

    def __init__(self, world_size):
        self.world_size = world_size
        self.worlds: dict = {}
        self.lock = threading.Lock()
        self.sequence = Sequence(world_size)

    def loader(self, rank):
        def load(source, params):
            key = (source, tuple(sorted((params or {}).items())))
            with self.lock:
                world = self.worlds.get(key)
                if world is None:
                    world = self.worlds[key] = World(source, self.world_size, params, self.sequence)
            return StandIn(world, rank)
        return load

    def groups(self, device=None):
        return [pt.Group(Comm(r, self.world_size), loader=self.loader(r), device=device)
                for r in range(self.world_size)]


def on_ranks(groups, fn):
    """fn(rank, group) on one thread per rank; returns the results, re-raises the first error."""
    def wake():  # the others may wait at a stand-in's barrier for the rank that failed
        for g in groups:
            for e in g._entries.values():
                if e.loaded:
                    e.collective().world.barrier.abort()
    return on_threads(len(groups), lambda rank: fn(rank, groups[rank]), wake)


def rand(rank, *shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype == torch.int32:
        return torch.randint(-100, 100, shape, generator=g, dtype=torch.int32)
    return torch.randn(*shape, generator=g)


# ---------------------------------------------------------------------------------------------
# registration and fake implementations


def test_import_purlinc_does_not_import_torch():
    code = "import sys, purlinc, purlinc.runtime, purlinc.runtime.rendezvous; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.stdout.strip() == "False", done.stderr


def test_purlin_torch_is_purlinc_torch():
    import purlin.torch

    assert purlin.torch is pt


def test_standard_sources_match_examples():
    for name, text in SOURCES.items():
        params = {"root": 1} if "root" in text else None
        ours = check(parse(text), 3, params)
        theirs = check(parse((REPO / "examples" / f"{name}.pln").read_text()), 3, params)
        assert ours == theirs, name


def test_ops_register_with_schemas():
    for name in SOURCES:
        pt.define(name)
        base = getattr(torch.ops.purlin, name)
        assert str(base.default._schema) == f"purlin::{name}(Tensor x, int handle, str op, SymInt count) -> Tensor"
        assert str(getattr(torch.ops.purlin, name + "_out").default._schema) == \
            f"purlin::{name}_out(Tensor x, Tensor(a!) out, int handle, str op) -> ()"
        assert str(getattr(torch.ops.purlin, name + "_inplace").default._schema) == \
            f"purlin::{name}_inplace(Tensor(a!) t, int handle, str op) -> ()"
        assert str(getattr(torch.ops.purlin, name + "_seq").default._schema) == \
            f"purlin::{name}_seq(Tensor x, Tensor(a!) seq, int handle, str op, SymInt count) -> Tensor"
    assert pt.define("allreduce") is pt.define("allreduce")  # defined once per process
    assert ops_module.ORDERED  # the functional ops are ordered effects on this torch
    with pytest.raises(ArgumentError, match="define: name 'not-a-name' is not an identifier"):
        pt.define("not-a-name")


def test_define_racing_on_threads_defines_once():
    """Two threads' first use of one name (two Groups or pt.op(...) made at once): define()
    checked its memo, then registered, without a lock, so a second registration raced the first
    ("Library object has been destroyed", or two Ops for one name)."""
    for k in range(8):
        name = f"raced_{k}"
        start, got, errors = threading.Barrier(4, timeout=30), [], []

        def first_use():
            start.wait()
            try:
                got.append(pt.define(name))
            except Exception as error:  # noqa: BLE001 - asserted below
                errors.append(error)
        threads = [threading.Thread(target=first_use) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert len(got) == 4 and all(ops is got[0] for ops in got), name


def test_sequence_racing_on_threads_is_one_tensor():
    """The communicator's sequence tensor orders its compiled calls only if every Group and
    pt.op(...) of it shares one: two made at once on threads each made their own (a memo
    checked, then filled, without a lock)."""
    for _ in range(20):
        comm, start, got = Comm(0, 1), threading.Barrier(4, timeout=30), []

        def first_use():
            start.wait()
            got.append(ops_module.sequence(comm, "cpu"))
        threads = [threading.Thread(target=first_use) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(got) == 4 and all(seq is got[0] for seq in got)


# (kind, root, rank) -> (in_units, out_units) for R = 3
UNITS = {
    "allreduce": lambda r, root: (3, 3), "allgather": lambda r, root: (1, 3),
    "reduce_scatter": lambda r, root: (3, 1), "alltoall": lambda r, root: (3, 3),
    "broadcast": lambda r, root: (int(r == root), 1), "reduce": lambda r, root: (1, int(r == root)),
    "gather": lambda r, root: (1, 3 * (r == root)), "scatter": lambda r, root: (3 * (r == root), 1),
}


@pytest.mark.parametrize("kind", sorted(SOURCES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_fake_shapes_and_dtypes_on_meta(kind, dtype):
    groups = StandInWorlds(3).groups()
    count = 5
    for rank, group in enumerate(groups):
        e = group.entry(kind, root=1)
        ins, outs = UNITS[kind](rank, 1)
        assert (e.in_units, e.out_units) == (ins, outs)
        ops = pt.define(kind)
        x = torch.empty(ins * count, dtype=dtype, device="meta")
        y = ops.functional(x, e.handle, "sum", -1 if ins else count)
        assert y.device.type == "meta" and y.dtype == dtype and tuple(y.shape) == (outs * count,)
        ops.out(x, torch.empty(outs * count, dtype=dtype, device="meta"), e.handle, "max")
        if ins:  # (without input, out itself says the count)
            with pytest.raises(ArgumentError, match=rf"out has {outs * count + 1} elements, expected {outs * count}"):
                ops.out(x, torch.empty(outs * count + 1, dtype=dtype, device="meta"), e.handle, "sum")
        elif outs > 1:
            with pytest.raises(ArgumentError, match=rf"out has {outs * count + 1} elements, expected a multiple"):
                ops.out(x, torch.empty(outs * count + 1, dtype=dtype, device="meta"), e.handle, "sum")


def test_an_output_no_tensor_holds_is_an_argument_error():
    """An all-gather of 2**60 float32 elements over 3 ranks: the output would need more bytes than
    a tensor's int64 size (torch's "Storage size calculation overflowed" before)."""
    group = StandInWorlds(3).groups()[1]
    e = group.entry("allgather")
    with pytest.raises(ArgumentError, match=r"purlin::allgather on rank 1: count=1152921504606846976 elements per "
                                            r"chunk is too large"):
        pt.define("allgather").functional(torch.empty(2**60, device="meta"), e.handle, "sum", -1)


def test_shape_inference_and_make_fx_record_the_op_and_launch_nothing():
    """Under FakeTensorMode or make_fx (no torch.compile), pt.functional and Group calls launched
    the real collective on fake tensors; now they record purlin::NAME_seq as compiled calls do."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    g = StandInWorlds(1).groups()[0]
    launched = []
    for kind in ("allreduce", "allgather"):  # the loaded collective, replaced by one that records launches
        g.entry(kind)._collective = type("Spy", (), {"is_warm": lambda self, *a: True,
                                                     "__call__": lambda self, *a, **k: launched.append(kind)})()
    with FakeTensorMode():
        x = torch.empty(4, 3)
        assert tuple(pt.functional.all_reduce(x, group=g).shape) == (4, 3)
        g.all_reduce(x.clone())
        assert tuple(pt.functional.all_gather_tensor(x, group=g).shape) == (4, 3)
    for mode in ("fake", "symbolic"):
        graph = make_fx(lambda t: pt.functional.all_reduce(t, group=g), tracing_mode=mode)(torch.randn(4, 3))
        targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
        assert "purlin.allreduce_seq.default" in targets, targets
    assert launched == []


def test_fake_tensor_mode_gives_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    group = StandInWorlds(2).groups()[0]
    handle = group.entry("allgather").handle
    with FakeTensorMode():
        x = torch.empty(4, 3, dtype=torch.float16)
        y = torch.ops.purlin.allgather(x, handle, "sum", -1)
        assert tuple(y.shape) == (24,) and y.dtype == torch.float16


# ---------------------------------------------------------------------------------------------
# torch.distributed-shaped calls on three threaded ranks, against NumPy


def test_every_standard_collective_on_three_ranks():
    R = 3
    groups = StandInWorlds(R).groups()
    xs = [rand(r, 6, 2, seed=1) for r in range(R)]

    def body(rank, g):
        got = {}
        t = xs[rank].clone()
        g.all_reduce(t)
        got["sum"] = t
        t = xs[rank].clone()
        pt.all_reduce(t, op="avg", group=g)
        got["avg"] = t
        t = xs[rank].clone()
        g.all_reduce(t, op=torch.distributed.ReduceOp.MAX if torch.distributed.is_available() else "max")
        got["max"] = t
        out = torch.full((R * 6, 2), float("nan"))
        g.all_gather_into_tensor(out, xs[rank])
        got["gather_all"] = out
        out = torch.full((2, 2), float("nan"))
        g.reduce_scatter_tensor(out, xs[rank])
        got["rs"] = out
        out = torch.full((6, 2), float("nan"))
        g.all_to_all_single(out, xs[rank])
        got["a2a"] = out
        t = xs[rank].clone()
        g.broadcast(t, src=2)
        got["bcast"] = t
        t = xs[rank].clone()
        g.reduce(t, dst=1)
        got["reduce"] = t
        lst = [torch.full((6, 2), float("nan")) for _ in range(R)] if rank == 1 else None
        g.gather(xs[rank], lst, dst=1)
        got["gather"] = lst
        t = torch.full((2, 2), float("nan"))
        g.scatter(t, [xs[rank][2 * i:2 * i + 2].clone() for i in range(R)] if rank == 0 else None, src=0)
        got["scatter"] = t
        t = xs[rank].clone()
        work = g.all_reduce(t, async_op=True)
        assert work.wait() is True and work.is_completed()
        got["async"] = t
        got["f_ar"] = pt.functional.all_reduce(xs[rank], group=g)
        got["f_ag"] = pt.functional.all_gather_tensor(xs[rank], group=g)
        got["f_rs"] = pt.functional.reduce_scatter_tensor(xs[rank], group=g)
        got["f_a2a"] = pt.functional.all_to_all_single(xs[rank], group=g)
        return got

    results = on_ranks(groups, body)
    total = sum(x.numpy() for x in xs)
    for r, got in enumerate(results):
        np.testing.assert_allclose(got["sum"].numpy(), total, rtol=1e-6)
        np.testing.assert_allclose(got["avg"].numpy(), total / R, rtol=1e-6)
        np.testing.assert_array_equal(got["max"].numpy(), np.maximum.reduce([x.numpy() for x in xs]))
        np.testing.assert_array_equal(got["gather_all"].numpy(), np.concatenate([x.numpy() for x in xs]))
        np.testing.assert_allclose(got["rs"].numpy(), total[2 * r:2 * r + 2], rtol=1e-6)
        np.testing.assert_array_equal(got["a2a"].numpy(), np.concatenate([x.numpy()[2 * r:2 * r + 2] for x in xs]))
        np.testing.assert_array_equal(got["bcast"].numpy(), xs[2].numpy())
        want_reduce = total if r == 1 else xs[r].numpy()  # non-destination ranks keep their input
        np.testing.assert_allclose(got["reduce"].numpy(), want_reduce, rtol=1e-6)
        if r == 1:
            for i in range(R):
                np.testing.assert_array_equal(got["gather"][i].numpy(), xs[i].numpy())
        np.testing.assert_array_equal(got["scatter"].numpy(), xs[0].numpy()[2 * r:2 * r + 2])
        np.testing.assert_allclose(got["async"].numpy(), total, rtol=1e-6)
        np.testing.assert_allclose(got["f_ar"].numpy(), total, rtol=1e-6)
        assert got["f_ar"].shape == (6, 2) and got["f_ag"].shape == (18, 2) and got["f_rs"].shape == (2, 2)
        np.testing.assert_array_equal(got["f_ag"].numpy(), np.concatenate([x.numpy() for x in xs]))
        np.testing.assert_allclose(got["f_rs"].numpy(), total[2 * r:2 * r + 2], rtol=1e-6)
        np.testing.assert_array_equal(got["f_a2a"].numpy(), got["a2a"].numpy())


def test_op_objects_refuse_inputs_that_require_grad():
    """pt.op(...) objects have no gradient: eagerly a requires-grad input gave a result through
    which no gradient flowed, silently; compiled, the graph failed for want of a formula."""
    world = World((REPO / "examples" / "ring_shift.pln").read_text(), 1, {"shift": 1})
    coll = pt.op(StandIn(world, 0), name="ring_shift")
    x = torch.randn(4, requires_grad=True)
    for call, label in ((lambda: coll(x), "x"), (lambda: coll(x, out=torch.empty(4)), "x"),
                        (lambda: coll.inplace(x.clone()), "t")):
        with pytest.raises(ArgumentError, match=rf"purlin::ring_shift: {label} requires grad, and pt.op\(...\) "
                                                r"objects have no gradient"):
            call()
    with torch.no_grad():
        assert torch.equal(coll(x), x.detach())  # a world of one: the ring shifts onto itself


def test_op_objects_check_out_while_traced_as_eagerly():
    """Traced (FakeTensorMode, make_fx, torch.compile), shift(x, out=y) copies the functional op's
    result into out: an out of the wrong size failed in torch's view(), unnamed, and one of
    another dtype was cast into silently; eagerly both are ArgumentErrors naming out."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    source = (REPO / "examples" / "allgather.pln").read_text()
    gather = pt.op(StandIn(World(source, 2, None), 0), name="allgather_traced_out")
    for out, message in ((torch.empty(7), r"out has 7 elements, expected 8 \(2 chunks x 4 elements per chunk\)"),
                         (torch.empty(8, dtype=torch.int32), r"out has dtype int32, expected float32 \(the dtype of x\)")):
        with pytest.raises(ArgumentError, match=rf"purlin::allgather_traced_out on rank 0: {message}"):
            gather(torch.empty(4), out=out)  # eagerly
        with FakeTensorMode() as mode:
            with pytest.raises(ArgumentError, match=rf"purlin::allgather_traced_out on rank 0: {message}"):
                gather(mode.from_tensor(torch.empty(4)), out=mode.from_tensor(out))


def test_user_collective_through_op():
    R = 3
    source = (REPO / "examples" / "ring_shift.pln").read_text()
    world = World(source, R, {"shift": 1})
    colls = [pt.op(StandIn(world, r), name="ring_shift") for r in range(R)]
    xs = [rand(r, 4, seed=2) for r in range(R)]

    def body(rank, _):
        y = colls[rank](xs[rank])
        out = torch.empty(4)
        colls[rank](xs[rank], out=out)
        t = xs[rank].clone()
        colls[rank].inplace(t)
        return y, out, t

    class G:  # on_ranks only needs _entries to abort barriers
        _entries: dict = {}
    results = on_ranks([G(), G(), G()], body)
    for r, (y, out, t) in enumerate(results):
        want = xs[(r + 1) % R].numpy()
        for got in (y, out, t):
            np.testing.assert_array_equal(got.numpy(), want)
    assert torch.ops.purlin.ring_shift.default._schema.name == "purlin::ring_shift"


def test_avg_scales_before_it_sums_so_a_float16_average_that_fits_is_kept():
    """Summed first, two fp16 ranks of 60000 rounded to infinity before the division: NCCL
    scales floats before the sum, and so does Purlin now."""
    R = 2
    world = World(SOURCES["allreduce"], R, None)
    colls = [pt.op(StandIn(world, r), name="allreduce_avg_fp16") for r in range(R)]

    class G:
        _entries: dict = {}
    results = on_ranks([G(), G()], lambda rank, _: colls[rank](torch.full((4,), 60000.0, dtype=torch.float16),
                                                               op="avg"))
    for got in results:
        assert got.dtype == torch.float16
        np.testing.assert_array_equal(got.float().numpy(), [60000.0] * 4)


def test_a_copy_ignores_op_avg():
    """The ops' ``op`` is ignored by copies: avg must not divide an all-gather's output."""
    R = 2
    world = World(SOURCES["allgather"], R, None)
    colls = [pt.op(StandIn(world, r), name="allgather_avg_ignored") for r in range(R)]

    class G:
        _entries: dict = {}
    results = on_ranks([G(), G()], lambda rank, _: colls[rank](torch.full((2,), float(rank + 1)), op="avg"))
    for got in results:
        np.testing.assert_array_equal(got.numpy(), [1, 1, 2, 2])


# ---------------------------------------------------------------------------------------------
# torch.compile: traced whole, run through the custom ops


def _program(g, rank):
    def f(x):
        y = x * 2
        pt.all_reduce(y, group=g)
        a = pt.functional.all_reduce(x, op="avg", group=g)
        out = x.new_empty(g.world_size * x.shape[0], *x.shape[1:])
        g.all_gather_into_tensor(out, x)
        rs = x.new_empty(x.shape[0] // g.world_size, *x.shape[1:])
        g.reduce_scatter_tensor(rs, x)
        a2a = torch.empty_like(x)
        g.all_to_all_single(a2a, x)
        b = x + 1
        g.broadcast(b, src=g.world_size - 1)
        rd = x + 2
        g.reduce(rd, dst=0)
        sc = x.new_empty(x.shape[0] // g.world_size, *x.shape[1:])
        g.scatter(sc, list(x.chunk(g.world_size)) if rank == 0 else None, src=0)
        gl = [torch.empty_like(x) for _ in range(g.world_size)] if rank == 0 else None
        g.gather(x, gl, dst=0)
        w = g.all_reduce(b, async_op=True)
        w.wait()
        return y, a, out, rs, a2a, b, rd, sc
    return f


def test_explain_no_graph_breaks_on_meta():
    groups = StandInWorlds(3).groups()
    for rank, g in enumerate(groups):
        f = _program(g, rank)
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(f)(torch.empty(6, 4, device="meta"))
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1
        names = {str(n.target).removesuffix(".default") for gm in explanation.graphs for n in gm.graph.nodes
                 if n.op == "call_function"}
        # compiled code reaches every collective through the sequenced functional op
        for op in ("allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast", "reduce", "scatter", "gather"):
            assert f"purlin.{op}_seq" in names, (op, names)
        assert not [n for n in names if n.endswith(("_out", "_inplace"))], names


def test_compiled_fullgraph_runs_and_matches_eager():
    # aot_eager: dynamo + AOTAutograd's functionalization of the mutating ops, then the real
    # implementations.  (Inductor compiles C++ for minutes on the 2-core CI box; the GPU check
    # runs the default inductor backend.)
    backend = "aot_eager"
    R = 2
    eager_groups = StandInWorlds(R).groups()
    compiled_groups = StandInWorlds(R).groups()
    xs = [rand(r, 4, 3, seed=3) for r in range(R)]
    want = on_ranks(eager_groups, lambda r, g: _program(g, r)(xs[r]))
    torch._dynamo.reset()
    got = on_ranks(compiled_groups, lambda r, g: torch.compile(_program(g, r), fullgraph=True, backend=backend)(xs[r]))
    for r in range(R):
        for a, b in zip(want[r], got[r]):
            torch.testing.assert_close(a, b)
    # and the eager answer itself, for rank 0's all-reduce of 2x
    torch.testing.assert_close(want[0][0], 2 * (xs[0] + xs[1]))


def test_compiled_size_checks_with_dynamic_sizes():
    """torch.compile(dynamic=True, fullgraph=True): the size checks of all_gather_into_tensor,
    reduce_scatter_tensor, all_to_all_single and pt.op(...)(x, out=) formatted their sizes into
    the message before checking, and dynamo cannot format a symbolic size ("BUILD_STRING type
    error"), so right calls failed to compile.  A wrong size is still refused by name."""
    g = StandInWorlds(1).groups()[0]
    tc = pt.op(StandInWorlds(1).loader(0)(SOURCES["allgather"], None), name="allgather")

    def f(x):
        out = x.new_empty(x.shape)
        g.all_gather_into_tensor(out, x)
        rs = torch.empty_like(x)
        g.reduce_scatter_tensor(rs, x)
        a2a = torch.empty_like(x)
        g.all_to_all_single(a2a, x)
        return out, rs, a2a, tc(x, out=torch.empty_like(x))

    torch._dynamo.reset()
    compiled = torch.compile(f, dynamic=True, fullgraph=True, backend="aot_eager")
    for n in (4, 6):
        x = rand(0, n, 3)
        for got in compiled(x):
            torch.testing.assert_close(got, x)

    def wrong(x):
        g.all_gather_into_tensor(x.new_empty(x.shape[0] + 1, 3), x)
    with pytest.raises(Exception, match=r"all_gather_into_tensor: output_tensor has 21 elements \(shape \(7, 3\)\), "
                                        r"expected 18"):
        torch.compile(wrong, dynamic=True, fullgraph=True, backend="aot_eager")(rand(0, 6, 3))


@pytest.mark.parametrize("dynamic", [True, None])
def test_compiled_rooted_calls_with_dynamic_sizes_on_two_threads(dynamic):
    """Rooted calls (broadcast, reduce, gather, scatter) compiled with dynamic=True, or with the
    automatic dynamic sizes of a recompile (dynamic=None), on two threaded ranks: the group rank
    of src=/dst= was found with ``root in self.ranks``, which dynamo answers False for a member
    when it reads the list's ints as symbols (pytorch/pytorch#153366): "dst=0 is not a rank of
    this group", compiled only, one thread or two."""
    R = 2
    xs = [[rand(r, n, 3, seed=n) for n in (4, 6, 8)] for r in range(R)]
    _compiled_equals_eager(R, _program, xs,
                           lambda f: torch.compile(f, dynamic=dynamic, fullgraph=True, backend="aot_eager"))


def _compiled_equals_eager(R: int, program, xs, compile_) -> None:
    """Each rank's ``program(g, rank)`` on each of its inputs ``xs[rank]``, eagerly and compiled
    (``compile_(f)``) on each rank's thread at once, on two stand-in worlds: the same tensors."""
    eager_groups, compiled_groups = StandInWorlds(R).groups(), StandInWorlds(R).groups()
    want = on_ranks(eager_groups, lambda r, g: [program(g, r)(x) for x in xs[r]])
    torch._dynamo.reset()

    def body(r, g):
        f = compile_(program(g, r))
        return [f(x) for x in xs[r]]
    got = on_ranks(compiled_groups, body)
    for r in range(R):
        for a, b in zip(want[r], got[r]):
            for u, v in zip(a, b):
                torch.testing.assert_close(u, v)


def _rooted(g, rank, root):
    def f(x):
        b = x + 1
        g.broadcast(b, src=g.ranks[root])
        rd = x + 2
        g.reduce(rd, dst=g.ranks[(root + 1) % g.world_size])
        gl = [torch.empty_like(x) for _ in range(g.world_size)] if rank == root else None
        g.gather(x, gl, dst=g.ranks[root])
        sc = x.new_empty(x.shape[0] // g.world_size, *x.shape[1:])
        g.scatter(sc, list(x.chunk(g.world_size)) if rank == root else None, src=g.ranks[root])
        y = x * 2
        pt.all_reduce(y, group=g)
        out = x.new_empty(g.world_size * x.shape[0], *x.shape[1:])
        g.all_gather_into_tensor(out, x)
        return b, rd, sc, y, out, *(gl or ())
    return f


@pytest.mark.slow
@pytest.mark.parametrize("R", [2, 3])
@pytest.mark.parametrize("dynamic", [True, False, None])
@pytest.mark.parametrize("fullgraph", [True, False])
def test_compiled_rooted_calls_on_threads_stress(R, dynamic, fullgraph):
    """Every root, many sizes, each rank's thread compiling at once, against eager calls."""
    def compile_(f):
        # dynamo's config is per thread since torch 2.12 (docs/TORCH.md): set on each rank's, around
        # the calls that compile; one code object holds R groups x 4 sizes
        return torch._dynamo.config.patch(recompile_limit=64)(
            torch.compile(f, dynamic=dynamic, fullgraph=fullgraph, backend="aot_eager"))

    for root in range(R):
        xs = [[rand(r, R * (2 + i % 4), 3, seed=i) for i in range(12)] for r in range(R)]
        _compiled_equals_eager(R, lambda g, r: _rooted(g, r, root), xs, compile_)


def test_opcheck_on_a_world_of_one():
    g = StandInWorlds(1).groups()[0]
    h = g.entry("allgather").handle
    x = torch.randn(8)
    torch.library.opcheck(torch.ops.purlin.allgather.default, (x, h, "sum", -1))
    torch.library.opcheck(torch.ops.purlin.allgather_out.default, (x, torch.empty(8), h, "sum"))
    ha = g.entry("allreduce").handle
    torch.library.opcheck(torch.ops.purlin.allreduce_inplace.default, (x.clone(), ha, "avg"))


# ---------------------------------------------------------------------------------------------
# bad input


def test_bad_input_errors():
    g = StandInWorlds(2).groups()[0]
    x = torch.randn(4, 2)
    with pytest.raises(ArgumentError, match=r"all_gather_into_tensor: output_tensor has 12 elements \(shape \(6, 2\)\), "
                                            r"expected 16 \(2 ranks x the 8 of input_tensor\)"):
        g.all_gather_into_tensor(torch.empty(6, 2), x)
    with pytest.raises(ArgumentError, match="output_tensor has dtype float16, expected float32"):
        g.all_gather_into_tensor(torch.empty(8, 2, dtype=torch.float16), x)
    with pytest.raises(ArgumentError, match="all_reduce: tensor has dtype float64, which Purlin cannot reduce; "
                                            "expected one of float32, float16, bfloat16, int32"):
        g.all_reduce(torch.randn(4, dtype=torch.float64))
    with pytest.raises(ArgumentError, match=r"all_reduce: op=BXOR is not supported.*\n.*bitwise"):
        g.all_reduce(torch.ones(4, dtype=torch.int32), op=torch.distributed.ReduceOp.BXOR)
    with pytest.raises(ArgumentError, match="op='avg' needs a floating dtype, tensor has int32"):
        g.all_reduce(torch.ones(4, dtype=torch.int32), op="avg")
    with pytest.raises(ArgumentError, match=r"op=PREMUL_SUM is not supported.*\n.*t.mul_\(factor\)"):
        g.all_reduce(x, op="premul_sum")
    with pytest.raises(ArgumentError, match="input has 7 elements .*expected 6"):
        g.reduce_scatter_tensor(torch.empty(3), torch.empty(7))
    with pytest.raises(ArgumentError, match=r"tensor is not contiguous \(shape \(2, 4\)"):
        g.all_reduce(x.t())
    with pytest.raises(ArgumentError, match=r"broadcast: src=5 is not a rank of this group; expected one of its "
                                            r"global ranks \[0, 1\]"):
        g.broadcast(x, src=5)
    with pytest.raises(ArgumentError, match=r"broadcast: group_src=2, expected a rank in \[0, 2\)"):
        g.broadcast(x, group_src=2)
    with pytest.raises(ArgumentError, match=r"broadcast: src=1 and group_src=1; expected one of them"):
        g.broadcast(x, src=1, group_src=1)
    with pytest.raises(ArgumentError, match="gather_list on the dst rank must hold 2 tensors"):
        g.gather(x, [x], dst=0)
    # a number where a list goes: len()'s TypeError before
    for call, label in ((lambda: g.all_to_all(5, [torch.ones(3)] * 2), "all_to_all: output_tensor_list"),
                        (lambda: g.scatter(x, 5, src=0), "scatter: scatter_list"),
                        (lambda: g.scatter(x, 5, src=1), "scatter: scatter_list"),
                        (lambda: g.all_gather(7, x), "all_gather: tensor_list"),
                        (lambda: g.gather(x, x, dst=0), "gather: gather_list")):
        with pytest.raises(ArgumentError, match=f"{label} must be a list of tensors, got "):
            call()
    with pytest.raises(ArgumentError, match=r"input_split_sizes=\[1, 2\], expected 2 sizes >= 0 summing to the 4 "
                                            r"rows \(dim 0\) of input"):
        g.all_to_all_single(torch.empty(4, 2), x, input_split_sizes=[1, 2])
    with pytest.raises(ArgumentError, match="purlin::allgather on rank 0: x has dtype float64"):
        torch.ops.purlin.allgather(torch.randn(3, dtype=torch.float64), g.entry("allgather").handle, "sum", -1)
    with pytest.raises(ArgumentError, match="no Purlin collective has handle 999999"):
        torch.ops.purlin.allgather(x, 999999, "sum", -1)


def test_tensor_of_another_device_or_communicator():
    # A group whose communicator drives cuda:1 is handed a tensor of another device: refused
    # before anything is loaded or launched.
    g = StandInWorlds(2).groups(device=torch.device("cuda", 1))[0]
    with pytest.raises(ArgumentError, match=r"all_reduce: tensor is on cpu, expected cuda:1 \(the device of this "
                                            r"Purlin communicator, rank 0 of 2\)"):
        g.all_reduce(torch.randn(4))
    with pytest.raises(ArgumentError, match="input_tensor is on cpu, expected cuda:1"):
        g.all_gather_into_tensor(torch.empty(8), torch.empty(4))
    assert not any(e.loaded for e in g._entries.values())


def test_roots_are_integers_of_any_kind_and_nothing_else():
    """group_src=np.int64(1) was refused as "expected a rank in [0, 3)" while src=np.int64(1) ran;
    src=True ran as rank 1 and src=1.0 as rank 1 (a float found in the rank list)."""
    import numpy as np

    gs = StandInWorlds(3).groups()
    out = on_ranks(gs, lambda rank, g: (lambda t: (g.broadcast(t, group_src=np.int64(1)), t)[1])(
        torch.full((2,), float(rank))))
    assert [t.tolist() for t in out] == [[1.0, 1.0]] * 3
    out = on_ranks(gs, lambda rank, g: (lambda t: (g.reduce(t, dst=torch.tensor(2)), t)[1])(
        torch.full((2,), float(rank))))
    assert out[2].tolist() == [3.0, 3.0]
    g = gs[0]
    for label, value in (("src", True), ("src", 1.0), ("src", "1"), ("group_src", True), ("group_src", 1.5)):
        with pytest.raises(ArgumentError, match=rf"broadcast: {label}={re.escape(repr(value))}, expected an int"):
            g.broadcast(torch.ones(2), **{label: value})


class _Apart(StandIn):
    """As the runtime's validate_call: x and out may not share bytes (a kernel reads one while
    it writes the other), so the stand-in refuses what a GPU call would."""

    def __call__(self, x=None, out=None, op="sum", *rest, row=1, expected_sizes=None):
        if x is not None and out is not None and ops_module.overlap(x, out, fake=False):
            raise ArgumentError(f"{self.spec.name} on rank {self.rank}: x and out overlap")
        return super().__call__(x, out, op, *rest, row=row, expected_sizes=expected_sizes)


class _ApartWorlds(StandInWorlds):
    def loader(self, rank):
        load = super().loader(rank)

        def apart(source, params):
            inner = load(source, params)
            return _Apart(inner.world, rank)
        return apart


def test_in_place_all_gather_and_reduce_scatter_read_from_a_copy():
    """torch.distributed's in-place forms, as NCCL takes them (FSDP's flat parameters):
    all_gather_into_tensor(out, out's own slot) and reduce_scatter_tensor(input's own slot,
    input).  They reached the collective with x and out overlapping, which a GPU call refuses
    ("x and out overlap"): the ops now read from a copy of x, as the in-place form does."""
    R, n = 3, 4
    groups = _ApartWorlds(R).groups()
    xs = [rand(r, R * n, seed=21) for r in range(R)]

    def body(rank, g):
        gathered = torch.zeros(R * n)
        gathered[rank * n:(rank + 1) * n] = xs[rank][:n]
        g.all_gather_into_tensor(gathered, gathered[rank * n:(rank + 1) * n])
        scattered = xs[rank].clone()
        g.reduce_scatter_tensor(scattered[rank * n:(rank + 1) * n], scattered)
        return gathered, scattered[rank * n:(rank + 1) * n]
    for rank, (gathered, scattered) in enumerate(on_ranks(groups, body)):
        np.testing.assert_array_equal(gathered.numpy(), np.concatenate([x[:n].numpy() for x in xs]))
        np.testing.assert_allclose(scattered.numpy(), sum(x[rank * n:(rank + 1) * n].numpy() for x in xs), rtol=1e-6)


@pytest.mark.parametrize("shape, dtype, message", [
    ((-2, -3), torch.float32, "shape (-2, -3): expected dimensions that are ints >= 0"),
    ((-1, 4), torch.float32, "shape (-1, 4): expected dimensions that are ints >= 0"),
    ((2.5,), torch.float32, "shape (2.5,): expected dimensions that are ints >= 0"),
    ("ab", torch.float32, "shape 'ab': expected dimensions that are ints >= 0"),
    ((2,), 5, "dtype 5: expected a torch.dtype or its name"),
    ((2,), "tensor", "unknown torch dtype 'tensor'"),
])
def test_heap_tensors_refuse_shapes_and_dtypes_before_allocating(shape, dtype, message):
    """comm.empty((-2, -3), ...) took a 24-byte heap block (a collective under torchrun) before
    torch refused the view; (-1, 4) said 'nbytes must be >= 0, got -16'; (2.5,) allocated 2
    elements; dtype=5 and shape 'ab' raised TypeError and ValueError."""
    from purlinc.runtime import symmetric

    class Heap:
        def alloc_user(self, *args):
            pytest.fail("allocated before the shape and dtype were checked")

    comm = type("Comm", (), {"closed": False, "heap": Heap(), "_exchange": None, "device": 0})()
    with pytest.raises(ArgumentError, match=re.escape(f"comm.empty: {message}")):
        symmetric.empty(comm, shape, dtype)


@pytest.mark.parametrize("nbytes", [1.5, "16", None, True, -1])
def test_heap_blocks_refuse_sizes_that_are_not_byte_counts(nbytes):
    """comm.alloc(1.5) took 1 byte and comm.alloc("16") 16: int() read both."""
    from purlinc.runtime import symmetric

    class Heap:
        def alloc_user(self, *args):
            pytest.fail("allocated before nbytes was checked")

    comm = type("Comm", (), {"closed": False, "heap": Heap(), "_exchange": None, "device": 0})()
    with pytest.raises(ArgumentError, match=re.escape(f"comm.alloc: nbytes={nbytes!r}, expected an int >= 0")):
        symmetric.alloc(comm, nbytes)


def test_lazy_conjugate_and_negative_views_are_refused_by_name():
    """A tensor with torch's lazy negative bit holds -values in memory: the kernels read and write
    memory, so an all-gather of one would move the negated values and an in-place all-reduce
    write the sum where the view reads its negation (the stand-in resolved them: a GPU would
    not).  A conjugate view (z.conj(), complex copies) failed in torch's view(), unnamed."""
    g = StandInWorlds(2).groups()[0]
    z = torch.arange(4.0).to(torch.complex64) * 1j
    neg = torch._neg_view(torch.arange(4.0))  # what z.conj().imag is, contiguous
    assert neg.is_neg() and neg.is_contiguous() and z.conj().is_conj()
    calls = [
        ("all_reduce: tensor", lambda: g.all_reduce(neg)),
        ("all_gather_into_tensor: input_tensor", lambda: g.all_gather_into_tensor(torch.empty(8), neg)),
        ("all_gather_into_tensor: output_tensor",
         lambda: g.all_gather_into_tensor(torch.empty(8, dtype=torch.complex64).conj(), z)),
        ("broadcast: tensor", lambda: g.broadcast(z.conj(), src=1)),
        ("all_to_all_single: input", lambda: g.all_to_all_single(torch.empty(4, dtype=torch.complex64), z.conj(),
                                                                  [2, 2], [2, 2])),
        ("all_reduce: x", lambda: pt.functional.all_reduce(neg, group=g)),
    ]
    for label, call in calls:
        with pytest.raises(ArgumentError, match=rf"{label} is a lazy (conjugate|negative) view \(torch's "
                                                r"(conjugate|negative) bit\)"):
            call()
    from purlinc.torch.serving import PurlinAllReduce

    assert not PurlinAllReduce(g).should_custom_ar(neg)


@pytest.mark.parametrize("ranks, shown", [([0, 0], "[0, 0]"), ([0.5, 1], "[0.5, 1]"), ([-1, 3], "[-1, 3]"),
                                           ([1, "x"], "[1, 'x']"), ([True, 0], "[True, 0]")])
def test_a_groups_ranks_are_distinct_global_ranks(ranks, shown):
    """ranks=[0, 0] was taken (src=0 then named two members), 0.5 was cut to 0, -1 kept, and 'x'
    raised int()'s ValueError."""
    with pytest.raises(ArgumentError, match=re.escape(f"Group: ranks={shown}, expected 2 distinct global ranks "
                                                      "(ints >= 0)")):
        pt.Group(Comm(0, 2), ranks=ranks, loader=lambda *a: pytest.fail("loaded"))


@pytest.mark.parametrize("ranks, shown", [(iter([0, 0]), "[0, 0]"), (3, "3")])
def test_a_groups_ranks_are_named_as_given_when_refused(ranks, shown):
    """A generator is read once (the message listed it again, empty: 'ranks=[]'), and a
    non-iterable is refused by name, not by list()'s TypeError."""
    with pytest.raises(ArgumentError, match=re.escape(f"Group: ranks={shown}, expected 2 distinct global ranks")):
        pt.Group(Comm(0, 2), ranks=ranks, loader=lambda *a: pytest.fail("loaded"))


def test_a_generator_of_ranks_is_taken():
    assert pt.Group(Comm(0, 2), ranks=(r for r in (3, 5)), loader=lambda *a: pytest.fail("loaded")).ranks == [3, 5]


def test_a_capacity_is_an_int_not_a_bool():
    from purlinc.torch import sized

    g = pt.Group(Comm(0, 2), loader=lambda *a: pytest.fail("loaded"))
    with pytest.raises(ArgumentError, match=r"capacity=True, expected a positive number of elements"):
        sized.configure(g, capacity=True)


def test_a_closed_group_refuses_every_call_by_name():
    """A Group's calls after close() raised a bare KeyError (its handles are gone), and an uneven
    all-to-all quietly made a new state and loaded again (a collective, on this rank alone)."""
    g = StandInWorlds(2).groups()[0]
    g.close()
    g.close()  # twice is fine
    calls = [("allreduce", lambda: g.all_reduce(torch.ones(2))),
             ("allgather", lambda: g.all_gather_into_tensor(torch.ones(4), torch.ones(2))),
             ("broadcast", lambda: g.broadcast(torch.ones(2), src=1)),
             ("allreduce", lambda: g.barrier()),
             ("allreduce", lambda: pt.functional.all_reduce(torch.ones(2), group=g)),
             ("all_to_all_single", lambda: g.all_to_all_single(torch.ones(2), torch.ones(2), [1, 1], [1, 1])),
             ("all_to_all_vdev", lambda: g.all_to_all_vdev(torch.ones(2), torch.ones(8), torch.tensor([1, 1]),
                                                           torch.zeros(2, dtype=torch.int64)))]
    for name, call in calls:
        with pytest.raises(ArgumentError, match=rf"{name}: purlinc.torch.Group\(rank 0 of 2, .*\) was closed; "
                                                r"expected an open group"):
            call()
    from purlinc.torch import sized

    assert sized._BY_GROUP.get(g) is None  # nothing made again


def test_compiled_bad_shape_names_tensor_expected_actual():
    g = StandInWorlds(2).groups()[0]

    def f(x):
        return pt.functional.all_gather_tensor(x, group=g), torch.ops.purlin.reduce_scatter(x, g.entry("reduce_scatter").handle, "sum", -1)

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"purlin::reduce_scatter on rank 0: x has 5 elements, expected a multiple of 2"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(torch.randn(5))


@pytest.mark.parametrize("name", ["all_gather_into_tensor", "all_to_all_single", "reduce_scatter_tensor"])
def test_compiled_copies_check_the_output_as_eager_calls_do(name):
    """A float16 output for float32 data was refused eagerly and cast into silently when
    compiled; a wrong size gave torch's view error, naming neither op nor tensor."""
    g = StandInWorlds(1).groups()[0]
    x = torch.randn(4, 3)

    def f(out, x):
        getattr(g, name)(out, x)
        return out

    label = {"all_gather_into_tensor": "output_tensor"}.get(name, "output")
    for out, message in ((torch.zeros(4, 3, dtype=torch.float16), f"{name}: {label} has dtype float16, expected float32"),
                         (torch.zeros(5, 3), f"{name}: (output|input)\\w* has \\d+ elements")):
        with pytest.raises(ArgumentError, match=message):
            f(out.clone(), x)
        torch._dynamo.reset()
        with pytest.raises(Exception, match=message):  # torch._check's RuntimeError, or dynamo's with it
            torch.compile(f, fullgraph=True, backend="aot_eager")(out.clone(), x)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True, backend="aot_eager")(torch.zeros(4, 3), x), f(torch.zeros(4, 3), x))


def test_capture_before_warm_up_is_refused(monkeypatch):
    R = 2
    groups = StandInWorlds(R).groups()
    monkeypatch.setattr(ops_module, "_capturing", lambda t: True)

    def body(rank, g):
        g.all_reduce(torch.randn(4))

    with pytest.raises(ArgumentError, match=r"purlin::allreduce on rank \d: called inside a CUDA graph capture "
                                            r"before its warm-up call"):
        on_ranks(groups, body)
    # loaded but not warmed for this dtype: the same refusal, naming dtype and op
    for g in groups:
        g.entry("allreduce")._collective = StandIn(World(SOURCES["allreduce"], R, None), g.rank)
    with pytest.raises(ArgumentError, match=r"x \(float32, 4 elements\) reached a CUDA graph capture before a warm-up "
                                            r"call: expected one call with dtype float32, op sum and this size outside the capture"):
        groups[0].all_reduce(torch.randn(4))


def test_warm_up_marks_entry_and_capture_then_passes(monkeypatch):
    g = StandInWorlds(1).groups()[0]
    x = torch.randn(4)
    g.all_reduce(x.clone())  # eager: loads, and compiles (float32, sum)
    e = g.entry("allreduce")
    assert e.collective().warmed == {(DType.FLOAT32, ReduceOp.SUM)}
    monkeypatch.setattr(ops_module, "_capturing", lambda t: True)
    t = x.clone()
    g.all_reduce(t)  # "captured": warm, so it runs
    torch.testing.assert_close(t, x)
    with pytest.raises(ArgumentError, match="expected one call with dtype float32, op max"):
        g.all_reduce(t, op="max")


class Recorder:
    """A collective that records its calls (no peers): what order a compiled graph calls in."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def is_warm(self, *args):
        return True

    def __call__(self, x=None, out=None, op="sum"):
        self.log.append(self.name)
        if out is not None:
            out.zero_()
        return out


def test_inductor_keeps_every_ranks_collectives_in_program_order():
    # Rank 1 of 2 is the root of broadcast/reduce/gather/scatter, so its graph differs from
    # rank 0's.  Inductor (torch 2.13) reordered this program's collectives on rank 1 when they
    # were ordered by effect tokens only; the sequence tensor must keep program order.  The
    # program is the GPU check's own (tests/gpu/torch_check.py), on CPU tensors.
    import importlib.util
    import shutil

    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("inductor on CPU needs a C++ compiler")
    spec = importlib.util.spec_from_file_location("torch_check", REPO / "tests" / "gpu" / "torch_check.py")
    tc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tc)
    tc.RANK, tc.R = 1, 2
    eager_log, compiled_log = [], []

    def group(log):
        return pt.Group(Comm(1, 2), loader=lambda src, params: Recorder(src.split()[1].split("(")[0], log))

    x = torch.randn(512, 8).bfloat16()
    tc.program(group(eager_log), "sum", 1)(x)
    torch._dynamo.reset()
    torch.compile(tc.program(group(compiled_log), "sum", 1), fullgraph=True, backend="inductor")(x)
    assert compiled_log == eager_log and len(eager_log) == 12, (compiled_log, eager_log)


# ---------------------------------------------------------------------------------------------
# autograd: each rank's gradient against torch's own autograd of a single-process reference


def _reference(kind, xs, R):
    """What every rank gets, computed in one process with plain torch (differentiable)."""
    if kind == "all_reduce":
        total = sum(xs)
        return [total for _ in range(R)]
    if kind == "all_reduce_avg":
        return [sum(xs) / R for _ in range(R)]
    if kind == "all_gather":
        return [torch.cat(xs) for _ in range(R)]
    if kind == "reduce_scatter":
        return list(sum(xs).chunk(R))
    if kind == "all_to_all":
        return [torch.cat([x.chunk(R)[r] for x in xs]) for r in range(R)]
    raise AssertionError(kind)


def _distributed(kind, x, g):
    f = pt.functional
    return {"all_reduce": lambda: f.all_reduce(x, group=g), "all_reduce_avg": lambda: f.all_reduce(x, "avg", group=g),
            "all_gather": lambda: f.all_gather_tensor(x, group=g),
            "reduce_scatter": lambda: f.reduce_scatter_tensor(x, group=g),
            "all_to_all": lambda: f.all_to_all_single(x, group=g)}[kind]()


@pytest.mark.parametrize("kind", ["all_reduce", "all_reduce_avg", "all_gather", "reduce_scatter", "all_to_all"])
def test_functional_backward_matches_autograd_of_a_reference(kind):
    R = 3
    xs = [rand(r, 6, 2, seed=7) for r in range(R)]
    outs = _reference(kind, [x.clone().requires_grad_() for x in xs], R)
    ws = [rand(r, *outs[r].shape, seed=8) for r in range(R)]  # rank r's loss: (y_r * w_r).sum()
    ref_xs = [x.clone().requires_grad_() for x in xs]
    sum((y * w).sum() for y, w in zip(_reference(kind, ref_xs, R), ws)).backward()

    def body(rank, g):
        x = xs[rank].clone().requires_grad_()
        y = _distributed(kind, x, g)
        assert y.requires_grad and y.shape == outs[rank].shape
        (y * ws[rank]).sum().backward()
        return y.detach(), x.grad

    for rank, (y, grad) in enumerate(on_ranks(StandInWorlds(R).groups(), body)):
        torch.testing.assert_close(y, outs[rank].detach())
        torch.testing.assert_close(grad, ref_xs[rank].grad)


def test_functional_backward_under_torch_compile_matches_eager():
    R = 2
    xs = [rand(r, 4, 3, seed=9) for r in range(R)]

    def program(g):
        def f(x):
            a = pt.functional.all_reduce(x * 2, group=g)
            b = pt.functional.reduce_scatter_tensor(pt.functional.all_gather_tensor(a.sin(), group=g), group=g)
            c = pt.functional.all_to_all_single(b * x, group=g)
            return (c * c).sum()
        return f

    def run(rank, g, compiled):
        x = xs[rank].clone().requires_grad_()
        f = torch.compile(program(g), fullgraph=True, backend="aot_eager") if compiled else program(g)
        f(x).backward()
        return x.grad

    want = on_ranks(StandInWorlds(R).groups(), lambda r, g: run(r, g, False))
    torch._dynamo.reset()
    got = on_ranks(StandInWorlds(R).groups(), lambda r, g: run(r, g, True))
    for r in range(R):
        torch.testing.assert_close(got[r], want[r])
        assert got[r].abs().sum() > 0


def test_custom_op_autograd_and_backward_graph_is_ordered():
    # the functional op itself (register_autograd), and the compiled backward graph reaches the
    # inverse collective through the ordered _seq op
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    R = 2
    xs = [rand(r, 4, seed=10) for r in range(R)]

    def direct(rank, g):
        x = xs[rank].clone().requires_grad_()
        torch.ops.purlin.allgather(x, g.entry("allgather").handle, "sum", -1).sum().backward()
        return x.grad
    for grad in on_ranks(StandInWorlds(R).groups(), direct):
        torch.testing.assert_close(grad, torch.full((4,), float(R)))  # d/dx of the sum over R ranks' copies
    g = StandInWorlds(1).groups()[0]
    seen = []

    def backward_compiler(gm, example):
        # functionalized mutating ops appear as auto_functionalized(op, ...)
        seen.extend(str(n.args[0]) if "auto_functionalized" in str(n.target) else str(n.target)
                    for n in gm.graph.nodes if n.op == "call_function")
        return boxed_nop(gm, example)
    torch._dynamo.reset()
    torch.compile(lambda x: pt.functional.all_gather_tensor(x, group=g).sum(), fullgraph=True,
                  backend=lambda gm, example: aot_eager(gm, example, bw_compiler=backward_compiler))(
        torch.randn(4, requires_grad=True)).backward()
    assert any("reduce_scatter_seq" in s for s in seen), seen


def test_gradient_of_max_is_refused_and_rooted_ops_have_none():
    g = StandInWorlds(1).groups()[0]
    y = pt.functional.all_reduce(torch.randn(4, requires_grad=True), op="max", group=g)
    with pytest.raises(ArgumentError, match=r"purlin::allreduce: the gradient of op='max' is not defined here"):
        y.sum().backward()
    x = torch.randn(4, requires_grad=True)
    y = torch.ops.purlin.broadcast(x, g.entry("broadcast").handle, "sum", -1)
    with pytest.raises(ArgumentError, match="purlin::broadcast: no gradient is defined for this collective"):
        y.sum().backward()


@pytest.mark.parametrize("name", ["all_reduce", "reduce_scatter_tensor"])
def test_a_compiled_max_runs_forward_and_refuses_only_its_backward(name):
    """A forward of max/min/prod on an input that requires grad (a serving model's parameters)
    failed to compile: dynamo traced the backward ahead and could not build its error.  Now the
    forward compiles and runs; the backward raises ArgumentError when it runs, as eagerly."""
    g = StandInWorlds(1).groups()[0]
    fn = getattr(pt.functional, name)
    x = torch.randn(4, 2, requires_grad=True)
    torch._dynamo.reset()
    y = torch.compile(lambda t: fn(t, op="max", group=g), fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(y.detach(), x.detach())  # a world of one
    kind = {"all_reduce": "allreduce", "reduce_scatter_tensor": "reduce_scatter"}[name]
    with pytest.raises(ArgumentError, match=rf"purlin::{kind}: the gradient of op='max' is not defined here") as caught:
        y.sum().backward()
    assert caught.value.notes == ("a max/min/prod reduction has no gradient that one collective of the gradient gives",)


def test_uneven_all_to_all_forward_and_backward():
    R = 3
    sends = [[(i + j) % 3 for j in range(R)] for i in range(R)]  # rank i sends sends[i][j] rows to j
    xs = [rand(i, sum(sends[i]), 2, seed=11) for i in range(R)]

    def body(rank, g):
        x = xs[rank].clone().requires_grad_()
        y = pt.functional.all_to_all_single(x, None, sends[rank], group=g)  # output sizes learnt from the senders
        (y * (rank + 1)).sum().backward()
        return y.detach(), x.grad
    results = on_ranks(StandInWorlds(R).groups(), body)
    for r, (y, grad) in enumerate(results):
        pieces = [xs[i][sum(sends[i][:r]):sum(sends[i][:r + 1])] for i in range(R)]
        torch.testing.assert_close(y, torch.cat(pieces))
        want = torch.cat([torch.full((sends[r][j], 2), float(j + 1)) for j in range(R)])
        torch.testing.assert_close(grad, want)


def test_uneven_all_to_all_without_input_sizes_needs_equal_rows():
    """Output sizes and no input sizes: x's rows split equally, computed as rows // R, so a 0-d x
    raised IndexError and 5 rows over 2 ranks were refused as 'input_split_sizes=[2, 2]', a
    list the caller never passed."""
    g = StandInWorlds(2).groups()[0]
    for x, rows in ((torch.tensor(1.0), 1), (torch.ones(5), 5)):
        with pytest.raises(ArgumentError, match=rf"all_to_all_single: x has {rows} rows \(dim 0\) and no "
                                                r"input_split_sizes; expected a multiple of 2 \(one equal slice per rank\)"):
            pt.functional.all_to_all_single(x, [rows, 0], None, group=g)
    assert not any(e.loaded for e in g._entries.values())


# ---------------------------------------------------------------------------------------------
# the serving adapter (vLLM's custom all-reduce shape)


def test_serving_adapter_takes_and_declines_like_a_custom_all_reduce(monkeypatch):
    from purlinc.torch.serving import PurlinAllReduce

    R = 2
    groups = StandInWorlds(R).groups()
    ars = [PurlinAllReduce(g, max_bytes=1024) for g in groups]
    xs = [rand(r, 8, 4, seed=12) for r in range(R)]
    ar = ars[0]
    assert ar.should_custom_ar(xs[0])
    assert not ar.should_custom_ar(torch.randn(3))  # 12 bytes: not a multiple of 16
    assert not ar.should_custom_ar(torch.randn(512))  # 2 KiB: over max_bytes
    assert not ar.should_custom_ar(torch.randn(8, 4).t())  # not contiguous
    assert not ar.should_custom_ar(torch.randn(8, dtype=torch.float64))  # not a dtype Purlin reduces
    assert ar.custom_all_reduce(torch.randn(3)) is None

    def body(rank, g):
        a = ars[rank]
        eager = a.custom_all_reduce(xs[rank])
        with a.capture():
            assert a.capturing
            warm = a.custom_all_reduce(xs[rank])  # a warm-up run inside capture(): the real call
        assert not a.capturing
        return eager, warm

    for eager, warm in on_ranks(groups, body):
        torch.testing.assert_close(eager, xs[0] + xs[1])
        torch.testing.assert_close(warm, xs[0] + xs[1])
    # inside a (stand-in) capture, the warmed call runs
    monkeypatch.setattr(ops_module, "_capturing", lambda t: True)

    def captured(rank, g):
        with ars[rank].capture():
            return ars[rank].custom_all_reduce(xs[rank])
    for y in on_ranks(groups, captured):
        torch.testing.assert_close(y, xs[0] + xs[1])
    ars[0].close()
    assert ars[0].disabled and not ars[0].should_custom_ar(xs[0])


def test_serving_all_reduce_refuses_an_out_unlike_its_input():
    """out.copy_(inp) broadcast a (4,) input into a (2, 4) out and cast float32 into float16, so
    the call all-reduced other data than it was given, silently."""
    from purlinc.torch.serving import PurlinAllReduce

    R = 2
    groups = StandInWorlds(R).groups()
    ar = PurlinAllReduce(groups[0])
    x = torch.ones(4)
    for out, actual in ((torch.empty(2, 4), "float32 (2, 4)"), (torch.empty(4, dtype=torch.float16), "float16 (4,)"),
                        (torch.empty(8)[::2], "float32 (4,) of strides (2,)")):
        with pytest.raises(ArgumentError, match=re.escape(f"all_reduce: out is {actual}, expected float32 (4,), "
                                                          "contiguous (like inp)")):
            ar.all_reduce(x, out=out)
    with pytest.raises(ArgumentError, match="all_reduce: out must be a torch.Tensor, got list"):
        ar.all_reduce(x, out=[0.0] * 4)
    ars = [PurlinAllReduce(g) for g in groups]
    outs = on_ranks(groups, lambda rank, g: ars[rank].all_reduce(torch.full((2, 2), rank + 1.0), out=torch.empty(2, 2)))
    assert all(o.tolist() == [[3.0, 3.0], [3.0, 3.0]] for o in outs)


def test_a_handle_names_what_the_fakes_read_in_every_process():
    """torch.compile caches a compiled graph across processes (inductor's FX graph cache) with
    the handles in it as constants and the output shapes its fakes gave: a handle made for a
    world of two must never be the handle of a world of one in the next process."""
    from types import SimpleNamespace

    from purlinc.torch import registry

    def allgather(R, rank=0):
        spec = SimpleNamespace(inputs=[[0]] * R, outputs=[list(range(R))] * R, is_reduce=False, epilogue=None)
        return registry.Entry("allgather", spec, SimpleNamespace(rank=rank, world_size=R), torch.device("cpu"))

    made = [allgather(1), allgather(2), allgather(2), allgather(2, rank=1)]
    try:
        assert len({e.handle for e in made}) == 4
        for e in made:  # a pure function of (what the fakes read, occurrence): the same in any process
            what = ("entry", "allgather", e.world_size, e.rank, e.in_units, e.out_units, False, 0, "cpu")
            assert e.handle in {registry.handle_of(what, n) for n in range(1, 10_000)}
            assert 0 < e.handle < 2**62 and registry.entry(e.handle) is e
        assert registry.handle_of(("x",), 1) == registry.handle_of(("x",), 1) != registry.handle_of(("x",), 2)
    finally:
        for e in made:
            e.close()


def test_the_gpu_check_scripts_log_gathers_every_ranks_failures(tmp_path, monkeypatch):
    """tests/gpu/_common.CheckLog (the torchrun check scripts' record), in a gloo world of one:
    checks and failures counted, the JSON written, failure reported."""
    import json
    import socket

    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
    from _common import CheckLog

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("PURLIN_RESULTS", str(tmp_path))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        log = CheckLog()
        log.note(True, "fine")
        try:
            raise ValueError("boom")
        except ValueError as error:
            log.raised("broken", error)
        assert log.finish("checks.json", "test", 1.25) is True
    finally:
        dist.destroy_process_group()
    doc = json.loads((tmp_path / "checks.json").read_text())
    assert (doc["passed"], doc["total"], doc["seconds"]) == (1, 2, 1.2)
    assert doc["failures_all_ranks"][0].startswith("rank 0: broken: ValueError: boom")
    assert "Traceback" in doc["failures"][0]


# ---------------------------------------------------------------------------------------------
# argument checks found by a probe: each refused with an ArgumentError, before anything runs


@pytest.mark.parametrize("dtype", [torch.float64, torch.int16, torch.complex64])
def test_copies_of_dtypes_purlin_lacks_trace_without_graph_breaks(dtype):
    """Such copies travel as a view of their bytes (ops.carrier); picking that view's dtype must
    be traceable, or fullgraph=True breaks."""
    g = StandInWorlds(2).groups()[0]

    def gather(x):
        out = x.new_empty(2 * x.shape[0], *x.shape[1:])
        g.all_gather_into_tensor(out, x)
        return out

    def broadcast(x):
        y = x.clone()
        g.broadcast(y, src=0)
        return y

    def all_to_all(x):
        out = torch.empty_like(x)
        g.all_to_all_single(out, x)
        return out

    for fn in (gather, broadcast, all_to_all):
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(fn)(torch.empty(6, 4, dtype=dtype, device="meta"))
        assert explanation.graph_break_count == 0, (fn.__name__, explanation.break_reasons)
    from purlinc.dtypes import DTYPES

    for itemsize in range(1, 17):  # the choice max(key=...) made: the widest, integers first, the first of ties
        fits = [r for r in DTYPES.records() if itemsize % r.itemsize == 0 and hasattr(torch, r.torch_name)]
        want = getattr(torch, max(fits, key=lambda r: (r.itemsize, not r.is_float)).torch_name) if fits else None
        assert ops_module._carrier_width(itemsize) is want, itemsize
    assert ops_module._carrier_width(8) is torch.int64


def test_arguments_that_are_not_tensors_are_refused_by_name():
    import numpy

    g = StandInWorlds(2).groups()[0]
    x = torch.randn(4, 2)
    calls = [
        ("all_reduce: tensor must be a torch.Tensor, got list", lambda: g.all_reduce([1.0, 2.0])),
        ("all_reduce: tensor must be a torch.Tensor, got ndarray", lambda: g.all_reduce(numpy.ones(4, "float32"))),
        ("all_gather_into_tensor: output_tensor must be a torch.Tensor, got list",
         lambda: g.all_gather_into_tensor([1, 2], x)),
        ("all_gather_into_tensor: input_tensor must be a torch.Tensor, got list",
         lambda: g.all_gather_into_tensor(torch.empty(8, 2), [1.0])),
        ("reduce_scatter_tensor: input must be a torch.Tensor, got ndarray",
         lambda: g.reduce_scatter_tensor(torch.empty(2), numpy.ones(4, "float32"))),
        ("all_to_all_single: output must be a torch.Tensor, got list", lambda: g.all_to_all_single([0] * 8, x)),
        ("broadcast: tensor must be a torch.Tensor, got list", lambda: g.broadcast([1.0], src=0)),
        ("reduce: tensor must be a torch.Tensor, got tuple", lambda: g.reduce((1.0,), dst=0)),
        ("gather: tensor must be a torch.Tensor, got list", lambda: g.gather([1.0], None, dst=1)),
        ("scatter: tensor must be a torch.Tensor, got list", lambda: g.scatter([1.0], None, src=1)),
        (r"all_gather: tensor_list\[1\] must be a torch.Tensor, got list", lambda: g.all_gather([x, [0]], x)),
        (r"all_to_all: input_tensor_list\[0\] must be a torch.Tensor, got int", lambda: g.all_to_all([x, x], [1, 2])),
        ("all_to_all_vdev: in_splits must be a torch.Tensor, got list",
         lambda: g.all_to_all_vdev(x, x, [2, 2], torch.zeros(2, dtype=torch.int64))),
        ("all_reduce: x must be a torch.Tensor, got list", lambda: pt.functional.all_reduce([1.0], group=g)),
        ("all_gather_tensor: x must be a torch.Tensor, got ndarray",
         lambda: pt.functional.all_gather_tensor(numpy.ones(2), group=g)),
        ("purlin::allgather on rank 0: x must be a torch.Tensor, got list",
         lambda: pt.define("allgather").eager_functional([1.0], g.entry("allgather").handle, "sum", -1)),
    ]
    for message, call in calls:
        with pytest.raises(ArgumentError, match=message):
            call()
    assert not any(e.loaded for e in g._entries.values())


def test_all_reduce_refuses_strided_tensors_whether_or_not_it_pads():
    """8 elements split over 2 ranks; 15 are padded to 16 first: the padded copy must not
    hide the caller's strides (torch.distributed's NCCL backend refuses them too)."""
    g = StandInWorlds(2).groups()[0]
    for strided in (torch.randn(2, 4).t(), torch.randn(3, 5).t()):
        layout = re.escape(f"(shape {tuple(strided.shape)}, strides {tuple(strided.stride())})")
        with pytest.raises(ArgumentError, match=f"all_reduce: tensor is not contiguous {layout}"):
            g.all_reduce(strided)
        with pytest.raises(ArgumentError, match=f"all_reduce: x is not contiguous {layout}"):
            pt.functional.all_reduce(strided, group=g)
    assert not any(e.loaded for e in g._entries.values())

    def padded(x):
        y = x * 2
        g.all_reduce(y.t())
        return y
    torch._dynamo.reset()  # compiled: refused too (a check dynamo stops at, so the eager call raises it)
    with pytest.raises(ArgumentError, match=re.escape("all_reduce: tensor is not contiguous (shape (5, 3)")):
        torch.compile(padded, backend="aot_eager")(torch.randn(3, 5))


def test_meta_tensors_pass_the_fakes_only():
    """Meta tensors are shape inference: the fake implementations take them on any device (the
    dispatcher sends a meta tensor there), an eager call refuses them before it loads."""
    g = StandInWorlds(2).groups()[0]
    handle = g.entry("allgather").handle
    meta = torch.empty(8, device="meta")
    assert torch.ops.purlin.allgather(meta, handle, "sum", -1).shape == (16,)
    with pytest.raises(ArgumentError, match=r"all_gather_into_tensor: output_tensor is on meta, expected cpu"):
        g.all_gather_into_tensor(torch.empty(16, device="meta"), torch.empty(8))
    with pytest.raises(ArgumentError, match=r"all_reduce: tensor is on meta, expected cpu"):
        g.all_reduce(torch.empty(8, device="meta"))
    with pytest.raises(ArgumentError, match=r"purlin::allgather on rank 0: x is on meta, expected cpu"):
        pt.define("allgather").eager_functional(meta, handle, "sum", -1)
    assert not any(e.loaded for e in g._entries.values())


@pytest.mark.parametrize("count", [3.0, "3", True, [3]])
def test_an_op_objects_count_is_an_int(count):
    """Eager calls skip the dispatcher (which checks SymInt): a rank without input raised torch's
    TypeError from new_empty for count=3.0, and count='3' was refused as "count=3, expected -1 or 3"."""
    source = (REPO / "examples" / "broadcast.pln").read_text()
    world = World(source, 2, {"root": 0})
    root, other = (pt.op(StandIn(world, r), name="bcast_count") for r in range(2))
    for coll, x in ((root, torch.ones(3)), (other, torch.empty(0))):
        with pytest.raises(ArgumentError, match=rf"purlin::bcast_count on rank {coll.entry.rank}: "
                                                rf"count={re.escape(repr(count))}, expected an int \(elements per "
                                                r"chunk\) or -1"):
            coll(x, count=count)


class _Calls:
    """One rank's collective that records how it is called (what the runtime would be given)."""

    def __init__(self, spec, rank):
        self.spec, self.comm, self.calls = spec, Comm(rank, spec.world_size), []

    def is_warm(self, *args):
        return True

    def __call__(self, x=None, out=None, op="sum", **given):
        self.calls.append((x, out, op, given))
        return out


def test_a_rank_without_chunks_runs_its_part_with_the_count_and_dtype():
    """Ranks 2 and 3 have no chunks; on a ring rank 1's x[1] reaches rank 0 through them, so
    they must launch too, at the others' count (Collective.__call__ refuses them without one).
    The functional op skipped the call on such a rank: the ring waited for it and timed out."""
    spec = check(parse("collective chunkless { in[0] = x[0]  in[1] = x[1]  out[0] = x[1]  out[1] = x[0]  copy }"),
                 4, {})
    relay = _Calls(spec, 2)
    y = pt.op(relay, name="chunkless_relay")(torch.empty(0, dtype=torch.bfloat16), count=5)
    assert y.numel() == 0
    assert relay.calls == [(None, None, "sum", {"count": 5, "dtype": DType.BFLOAT16})]
    pt.op(relay, name="chunkless_relay")(torch.empty(0), count=0)  # an empty call: nothing to run
    assert len(relay.calls) == 1


def test_the_in_place_form_on_a_rank_without_chunks_is_refused_eagerly_and_traced():
    """t says no chunk size on such a rank: the eager form reached the launch with neither
    tensor (AttributeError) and skipped the relay for an empty t, while the traced form ran it
    with count = t.numel().  Both now refuse it alike, before any launch."""
    spec = check(parse("collective chunkless { in[0] = x[0]  in[1] = x[1]  out[0] = x[1]  out[1] = x[0]  copy }"),
                 4, {})
    relay = _Calls(spec, 2)
    coll = pt.op(relay, name="chunkless_relay")
    message = (r"purlin::chunkless_relay on rank 2: cannot run in place: rank 2 gives and receives no chunks, "
               r"so t cannot say the elements per chunk \(use the functional form with count=\)")
    for t in (torch.ones(5), torch.empty(0)):
        with pytest.raises(ArgumentError, match=message):
            coll.inplace(t)
        torch._dynamo.reset()
        with pytest.raises(Exception, match=message):  # compiled: torch._check's RuntimeError, the same text
            torch.compile(coll.inplace, backend="aot_eager", fullgraph=True)(t)
    assert relay.calls == []


def test_an_in_place_call_of_unequal_sizes_is_refused_compiled_as_eagerly():
    """The traced in-place form raised the ArgumentError itself, which dynamo cannot build: a
    compiled in-place all-gather failed with dynamo's "Unsupported", not the reason."""
    spec = check(parse("collective gather_all { in[r] = x[r]  out[r] = x[0..R]  copy }"), 2, {})
    calls = _Calls(spec, 0)
    coll = pt.op(calls, name="gather_all_inplace_probe")
    message = (r"purlin::gather_all_inplace_probe on rank 0: cannot run in place: rank 0 gives 1 chunks and "
               r"receives 2; expected equal sizes \(use the functional form or out=\)")
    with pytest.raises(ArgumentError, match=message):
        coll.inplace(torch.ones(4))
    torch._dynamo.reset()
    with pytest.raises(Exception, match=message):
        torch.compile(coll.inplace, backend="aot_eager", fullgraph=True)(torch.ones(4))
    assert calls.calls == []


def test_functional_op_checks_count_and_the_handles_collective():
    g = StandInWorlds(2).groups()[0]
    gather = g.entry("allgather").handle
    ops = pt.define("allgather")
    x = torch.empty(8, device="meta")
    assert ops.functional(x, gather, "sum", 8).shape == (16,)  # count may repeat what x says
    for count in (5, -7, 0):
        with pytest.raises(ArgumentError, match=rf"purlin::allgather on rank 0: count={count}, expected -1 or 8 "
                                                r"\(what x says: 8 elements in 1 chunks\)"):
            ops.functional(x, gather, "sum", count)
    with pytest.raises(ArgumentError, match=rf"purlin::allreduce on rank 0: handle {gather} names a collective of "
                                            r"'allgather', expected one of 'allreduce'"):
        pt.define("allreduce").functional(x, gather, "sum", -1)
    with pytest.raises(ArgumentError, match="names a collective of 'allgather'"):
        pt.define("allreduce").eager_functional(torch.empty(8), gather, "sum", -1)
    # rank 0 gives nothing to a broadcast from rank 1: count says the size, within what a tensor holds
    broadcast = g.entry("broadcast", 1).handle
    empty = torch.empty(0, device="meta")
    assert pt.define("broadcast").functional(empty, broadcast, "sum", 3).shape == (3,)
    with pytest.raises(ArgumentError, match=r"count=4611686018427387904 elements per chunk is too large: rank 0 "
                                            r"receives 1 chunks of 4-byte elements"):
        pt.define("broadcast").functional(empty, broadcast, "sum", 2**62)


# ---------------------------------------------------------------------------------------------
# regressions of the CPU probe (docs/TORCH.md's promises, traced against eager)


def _list_program(g, rank):
    def f(x):
        ins = list(x.chunk(g.world_size))
        outs = [torch.empty_like(t) for t in ins]
        pt.all_to_all(outs, ins, group=g)
        return torch.cat(outs) * 2
    return f


def test_all_to_all_lists_of_one_size_trace_whole():
    """pt.all_to_all(out_list, in_list) always went through all_to_all_single with split lists,
    which a trace refuses: FakeTensorMode, make_fx and torch.compile (fullgraph or not) all
    failed on a call TORCH.md lists as one custom op.  Traced, lists of one size run the equal
    all-to-all; compiled on threaded ranks it gives the eager (run-time sizes) answer."""
    from torch.fx.experimental.proxy_tensor import make_fx

    g = StandInWorlds(1).groups()[0]
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(_list_program(g, 0))(torch.empty(4, 3, device="meta"))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    names = {str(n.target) for gm in explanation.graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert "purlin.alltoall_seq" in names, names
    x = rand(0, 4, 3)
    traced = make_fx(_list_program(g, 0), tracing_mode="fake")(x)
    assert [n for n in traced.graph.nodes if "alltoall_seq" in str(n.target)]
    R = 2
    xs = [[rand(r, 4, 3, seed=8), rand(r, 6, 2, seed=9)] for r in range(R)]
    _compiled_equals_eager(R, lambda g, r: (lambda f: lambda x: (f(x),))(_list_program(g, r)), xs,
                           lambda f: torch.compile(f, fullgraph=True, backend="aot_eager"))


def test_all_to_all_lists_of_several_sizes_are_refused_while_traced_in_their_terms():
    """Unequal sizes are host split lists, which a graph cannot hold: refused by all_to_all's own
    names (not all_to_all_single's split lists, which the caller never passed), pointing to
    all_to_all_vdev, under FakeTensorMode and torch.compile(fullgraph=True) alike."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = StandInWorlds(2).groups()[0]
    message = (r"all_to_all: output_tensor_list holds tensors of 2, 2 elements; input_tensor_list holds tensors of "
               r"1, 3 elements; while traced \(torch.compile, FakeTensorMode, make_fx\) expected one size for every "
               r"tensor of both lists .*use all_to_all_vdev")

    def f(x):
        outs = [torch.empty(2), torch.empty(2)]
        pt.all_to_all(outs, [x[:1], x[1:]], group=g)
        return outs[0]
    with FakeTensorMode():
        with pytest.raises(ArgumentError, match=message):
            f(torch.empty(4))
    torch._dynamo.reset()
    with pytest.raises(Exception, match=message):
        torch.compile(f, fullgraph=True, backend="aot_eager")(torch.zeros(4))
    assert not any(e.loaded for e in g._entries.values())


def _refusals(g, t):
    """(what, call) of calls eager refuses before anything runs: a strided output, a strided
    tensor on a rank that gives no input, a float64 reduction."""
    def strided(*shape):
        return t(*shape[::-1]).t()
    return [
        ("all_gather_into_tensor strided output", lambda: g.all_gather_into_tensor(strided(2, 2), t(2))),
        ("reduce_scatter_tensor strided output", lambda: g.reduce_scatter_tensor(strided(2, 2), t(8))),
        ("all_to_all_single strided output", lambda: g.all_to_all_single(strided(2, 2), t(4))),
        ("broadcast strided", lambda: g.broadcast(strided(2, 2), src=0)),
        ("reduce strided", lambda: g.reduce(strided(2, 2), dst=0)),
        ("gather strided", lambda: g.gather(strided(2, 2), [t(2, 2), t(2, 2)] if g.rank == 0 else None, dst=0)),
        ("scatter strided", lambda: g.scatter(strided(2, 2), [t(2, 2), t(2, 2)] if g.rank == 1 else None, src=1)),
        ("all_reduce float64", lambda: g.all_reduce(t(4, dtype=torch.float64))),
        ("reduce float64", lambda: g.reduce(t(4, dtype=torch.float64), dst=1)),
        ("reduce_scatter_tensor float64", lambda: g.reduce_scatter_tensor(t(2, dtype=torch.float64),
                                                                          t(4, dtype=torch.float64))),
    ]


def test_traced_calls_refuse_what_eager_calls_refuse_on_every_rank():
    """Under FakeTensorMode a strided output (filled by copy_ after the op, so its fake never
    saw it) was accepted where eager calls refuse it, a strided broadcast was refused on its
    root only (the others entered the collective and waited), and a float64 reduction was
    refused as "purlin::allreduce on rank 1: x ... does not support; expected one of ...
    float8_e4m3" (fp8 is not reduced, and the caller passed no x).  Now every rank refuses
    each, traced, with the eager message."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    groups = StandInWorlds(2).groups()
    for g in groups:
        eager = {}
        for what, call in _refusals(g, torch.randn):
            with pytest.raises(ArgumentError) as caught:
                call()
            eager[what] = str(caught.value)
        with FakeTensorMode():
            for what, call in _refusals(g, torch.randn):
                with pytest.raises(ArgumentError) as caught:
                    call()
                assert str(caught.value) == eager[what], (g.rank, what)
        assert "cannot reduce" in eager["all_reduce float64"] and "float8" not in eager["all_reduce float64"]
        assert eager["broadcast strided"].startswith("error: broadcast: tensor is not contiguous")
        assert not any(e.loaded for e in g._entries.values())


def test_op_objects_check_out_and_t_while_traced_as_eagerly():
    """pt.op(...)(x, out=strided) and .inplace(strided) on a rank without input traced where
    the eager calls refuse: the traced op never sees out, nor t where x is empty."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    worlds = StandInWorlds(2)
    shift = pt.op(worlds.loader(1)(SOURCES["gather"], {"root": 0}), name="gather")  # rank 1 gives, receives nothing
    ring = pt.op(worlds.loader(0)((REPO / "examples" / "ring_shift.pln").read_text(), None), name="ring_shift")
    calls = [(ring, lambda t: ring(t(4), out=t(2, 2).t())), (shift, lambda t: shift.inplace(t(2, 2).t()))]
    for tc, call in calls:
        with pytest.raises(ArgumentError) as eager:
            call(torch.randn)
        with FakeTensorMode():
            with pytest.raises(ArgumentError) as traced:
                call(torch.randn)
        assert str(traced.value) == str(eager.value) and "is not contiguous" in str(eager.value)


def test_list_forms_name_their_own_arguments():
    """The list forms reported the internal call they delegate to: g.all_gather(...) said
    "all_gather_into_tensor: input_tensor is on cpu", g.all_to_all(...) "all_to_all_single:
    input is on cpu"."""
    g = StandInWorlds(2).groups(device=torch.device("meta"))[0]
    cases = [
        (lambda: g.all_gather([torch.empty(2), torch.empty(2)], torch.empty(2)), "all_gather: tensor is on cpu"),
        (lambda: g.all_to_all([torch.empty(2), torch.empty(2)], [torch.empty(2), torch.empty(2)]),
         r"all_to_all: output_tensor_list\[0\] is on cpu"),
        (lambda: g.reduce_scatter(torch.empty(2), [torch.empty(2), torch.empty(2)]),
         "reduce_scatter: input_list is on cpu"),
    ]
    here = StandInWorlds(2).groups()[0]
    doubles = torch.empty(2, dtype=torch.float64)
    cases.append((lambda: here.reduce_scatter(doubles, [doubles.clone(), doubles.clone()]),
                  "reduce_scatter: input_list has dtype float64, which Purlin cannot reduce"))
    for call, message in cases:
        with pytest.raises(ArgumentError, match=message):
            call()


def test_functional_uneven_all_to_all_checks_its_own_list_and_x_before_the_exchange():
    """functional.all_to_all_single(x, None, splits) exchanged the split sizes first: rank 0's
    [5, -1] made rank 1 raise "output_split_sizes=[-1, 2]", a list it never gave; and x on
    another device than the group's raised a bare AssertionError from the exchange."""
    def exchanged(*_):
        pytest.fail("the split sizes were exchanged (a collective) before this rank's own were checked")
    g = pt.Group(Comm(0, 2), loader=exchanged)
    x = torch.arange(8.0).view(4, 2)
    with pytest.raises(ArgumentError, match=r"all_to_all_single: input_split_sizes=\[5, -1\], expected 2 sizes >= 0 "
                                            r"summing to the 4 rows \(dim 0\) of x"):
        pt.functional.all_to_all_single(x, None, [5, -1], group=g)
    with pytest.raises(ArgumentError, match=r"all_to_all_single: output_split_sizes=\[3, -1\], expected 2 sizes >= 0"):
        pt.functional.all_to_all_single(x, [3, -1], [2, 2], group=g)
    elsewhere = pt.Group(Comm(0, 2, device="meta"), loader=exchanged)
    with pytest.raises(ArgumentError, match=r"all_to_all_single: x is on cpu, expected meta"):
        pt.functional.all_to_all_single(x, None, [2, 2], group=elsewhere)
    from purlinc.torch import sized

    sized.configure(g, capacity=4, loader=exchanged)
    with pytest.raises(ArgumentError, match=r"all_to_all_single: input_split_sizes\[1\] = 3 rows \(6 elements, rank 0 "
                                            r"to rank 1\) exceeds the capacity of 2 rows"):
        pt.functional.all_to_all_single(x, None, [1, 3], group=g)


def test_reserved_op_names_are_refused_naming_their_owner_in_a_fresh_process():
    """pt.op(coll, name=...) took names purlinc.torch's own ops need: "allgather_out" made every
    later Group fail, "fused_add_rmsnorm" had its schema replaced by fused_add_rmsnorm_op, and
    "name" or "no_gradient" were refused as "registered (purlinc.torch.sized registers
    alltoallv...)".  In a fresh process (nothing defined yet), each is refused up front, naming
    its owner, and the owner's ops still register."""
    code = r'''
import torch, purlinc.torch as pt
from purlinc.frontend.check import check
from purlinc.frontend.parse import parse, parse_file
from purlinc.runtime.errors import ArgumentError
class Comm: rank, world_size, device = 0, 2, "cpu"
class Loaded:
    def __init__(self, spec): self.spec, self.comm = spec, Comm()
ring = Loaded(check(parse(open("examples/ring_shift.pln").read()), 2))
for name in ("allgather_out", "reduce_seq", "fused_add_rmsnorm", "no_gradient", "name", "alltoallv_seq"):
    try:
        pt.op(ring, name=name)
    except ArgumentError as e:
        print(str(e).splitlines()[0])
g = pt.Group(Comm(), loader=lambda *a: None)
fused = pt.fused_add_rmsnorm_op(Loaded(check(parse_file("examples/fused/allreduce_add_rmsnorm.pln"), 2)), device="cpu")
print(torch.ops.purlin.fused_add_rmsnorm.default._schema)
'''
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    owners = ["the out form of the standard collective 'allgather'", "the seq form of the standard collective 'reduce'",
              "purlinc.torch.fused_add_rmsnorm_op's fused all-reduce", "purlinc.torch's no-gradient marker",
              "an attribute of torch's op namespace object", "purlinc.torch.sized's uneven all-to-all"]
    for line, name, owner in zip(lines, ("allgather_out", "reduce_seq", "fused_add_rmsnorm", "no_gradient", "name",
                                         "alltoallv_seq"), owners):
        assert line.startswith(f"error: op: name '{name}': torch.ops.purlin.{name} is already {owner}"), line
    assert lines[6].startswith("purlin::fused_add_rmsnorm(Tensor x, Tensor(a!) residual, Tensor weight"), lines


def test_a_users_collectives_names_collide_in_either_order():
    """NAME registers NAME, NAME_out, NAME_inplace and NAME_seq: "p2_out" after "p2" and "p3"
    after "p3_out" are refused naming the collective whose form the name is; a name's own ops
    are found again."""
    src = (REPO / "examples" / "ring_shift.pln").read_text()
    coll = StandInWorlds(2).loader(0)(src, None)
    pt.op(coll, name="p2")
    with pytest.raises(ArgumentError, match=r"op: name 'p2_out': torch.ops.purlin.p2_out is already the out form "
                                            r"of collective 'p2'"):
        pt.op(coll, name="p2_out")
    pt.op(coll, name="p3_out")
    with pytest.raises(ArgumentError, match=r"op: name 'p3': torch.ops.purlin.p3_out is already the functional form "
                                            r"of collective 'p3_out'"):
        pt.op(coll, name="p3")
    assert pt.op(coll, name="p2").ops is pt.op(coll, name="p2").ops
    assert pt.op(coll, name="allgather").ops is pt.define("allgather")  # a standard name: its own family


# ---------------------------------------------------------------------------------------------
# regressions of the probe of compiled refusals (ops.fail where an ArgumentError was raised)


def _compiled_refusals(g):
    """(what, call of a meta tensor t of 6 elements, the eager message) on rank 1 of three."""
    return [
        ("op", lambda t: g.all_reduce(t, op="bxor"), "all_reduce: op=BXOR is not supported; expected one of sum"),
        ("not a tensor", lambda t: g.all_reduce([t]), "all_reduce: tensor must be a torch.Tensor, got list"),
        ("src", lambda t: g.broadcast(t, src=5),
         "broadcast: src=5 is not a rank of this group; expected one of its global ranks [0, 1, 2]"),
        ("src float", lambda t: g.broadcast(t, src=1.0), "broadcast: src=1.0, expected an int (a rank)"),
        ("group_src", lambda t: g.broadcast(t, group_src=9), "broadcast: group_src=9, expected a rank in [0, 3)"),
        ("gather_list", lambda t: g.gather(t, [t], dst=1),
         "gather: gather_list on the dst rank must hold 3 tensors (one per rank), got 1 tensors"),
        ("tensor_list", lambda t: g.all_gather([t, t, t[:2]], t),
         "all_gather: tensor_list[2] is float32 x 2 on meta, expected float32 x 6 on meta (like tensor)"),
        ("lists", lambda t: g.all_to_all([t], [t, t, t]),
         "all_to_all: output_tensor_list holds 1 tensors, expected 3 (one per rank)"),
        ("split sizes", lambda t: g.all_to_all_single(t, t.clone(), [2, 2, 1.5]),
         "all_to_all_single: output_split_sizes=[2, 2, 1.5], expected a list of 3 integers"),
        ("scatter_dim", lambda t: pt.functional.reduce_scatter_tensor(t, scatter_dim=1, group=g),
         "reduce_scatter_tensor: scatter_dim=1, expected 0"),
        ("rows", lambda t: pt.functional.reduce_scatter_tensor(t[:5], group=g),
         "reduce_scatter_tensor: x has shape (5,), expected dim 0 a multiple of 3 (the world size)"),
        ("equal rows", lambda t: pt.functional.all_to_all_single(t[:4], group=g),
         "all_to_all_single: x has shape (4,), expected dim 0 a multiple of 3 (the world size)"),
        ("gather_dim", lambda t: pt.functional.all_gather_tensor(t, 1, group=g),
         "all_gather_tensor: gather_dim=1, expected 0 (transpose around the call)"),
        ("group", lambda t: pt.functional.all_reduce(t, group="tp"),
         "group='tp': expected a purlinc.torch.Group or a torch.distributed ProcessGroup"),
    ]


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_refusals_carry_the_eager_message(dynamic):
    """The Python calls' own refusals (a reduction, a root, a list, a functional form's dim or
    rows, the group) raised an ArgumentError, which dynamo cannot build: compiled with
    fullgraph=True the caller got only "Attempted to call a super() attribute that is not a
    function or method".  Now each is torch._check's error with the eager message (ops.fail),
    under dynamic sizes too, and the eager call still raises the ArgumentError."""
    g = StandInWorlds(3).groups()[1]
    for what, call, message in _compiled_refusals(g):
        with pytest.raises(ArgumentError, match=re.escape(message)):
            call(torch.empty(6, device="meta"))
        torch._dynamo.reset()
        with pytest.raises(Exception) as caught:
            torch.compile(call, fullgraph=True, backend="aot_eager", dynamic=dynamic)(torch.empty(6, device="meta"))
        assert message in str(caught.value), (what, str(caught.value)[-2000:])
        assert "super()" not in str(caught.value), what
    assert not any(e.loaded for e in g._entries.values())


def test_an_equal_all_to_all_of_0_d_tensors_is_refused_in_the_callers_terms():
    """A 0-d tensor is one row: it passed the rows check, and the op refused it as
    "purlin::alltoall on rank 1: x has 1 elements, expected a multiple of 3"."""
    g = StandInWorlds(3).groups()[1]
    message = r"all_to_all_single: input has 1 rows \(dim 0\), expected a multiple of 3 \(one equal slice per rank\)"
    with pytest.raises(ArgumentError, match=message):
        g.all_to_all_single(torch.empty(()), torch.empty(()))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), pytest.raises(ArgumentError, match=message):
        g.all_to_all_single(torch.empty(()), torch.empty(()))


@pytest.mark.parametrize("kind", ["all_reduce", "all_reduce_avg", "all_gather", "reduce_scatter", "all_to_all",
                                  "all_to_all_lists"])
def test_functional_double_backward_matches_autograd_of_a_reference(kind):
    """With create_graph=True the backward ran the bare op body, whose dx has no history: a
    second derivative through a functional collective (a gradient penalty) came out zero,
    silently.  Now the backward is itself the differentiable collective."""
    R = 3
    xs = [rand(r, 6, 2, seed=9) for r in range(R)]
    reference = "all_to_all" if kind == "all_to_all_lists" else kind
    outs = _reference(reference, xs, R)
    ws = [rand(r, *outs[r].shape, seed=10) for r in range(R)]
    vs = [rand(r, 6, 2, seed=11) for r in range(R)]
    ref_xs = [x.clone().requires_grad_() for x in xs]
    total = sum((y * y * w).sum() for y, w in zip(_reference(reference, ref_xs, R), ws))  # not linear in x
    firsts = torch.autograd.grad(total, ref_xs, create_graph=True)
    sum((d * v).sum() for d, v in zip(firsts, vs)).backward()

    def body(rank, g):
        x = xs[rank].clone().requires_grad_()
        if kind == "all_to_all_lists":  # the uneven form (_Uneven), with equal lists
            y = pt.functional.all_to_all_single(x, [2] * R, [2] * R, group=g)
        else:
            y = _distributed(kind, x, g)
        (first,) = torch.autograd.grad((y * y * ws[rank]).sum(), x, create_graph=True)
        assert first.requires_grad
        (first * vs[rank]).sum().backward()
        return first.detach(), x.grad

    for rank, (first, second) in enumerate(on_ranks(StandInWorlds(R).groups(), body)):
        torch.testing.assert_close(first, firsts[rank].detach())
        torch.testing.assert_close(second, ref_xs[rank].grad)


@pytest.mark.parametrize("dtype, scaled", [(torch.float32, False), (torch.bfloat16, False), (torch.float16, True)])
def test_avg_hands_the_collective_the_callers_buffer_except_in_float16(dtype, scaled):
    """A heap tensor (comm.empty) takes the zero-copy path only if it is what the collective
    gets: float32 and bfloat16 divide the output; float16 scales a copy first (its sum could
    overflow where the average fits)."""
    from types import SimpleNamespace

    from purlinc.torch.registry import Entry

    seen = []

    class Recorder:
        _variants: dict = {}

        def __call__(self, x, out=None, op="sum", **kwargs):
            seen.append((x.data_ptr(), op))
            out.copy_(x * 2)  # two ranks' identical inputs summed

    spec = check(parse(SOURCES["allreduce"]), 2)
    entry = Entry("allreduce", spec, SimpleNamespace(rank=0, world_size=2), torch.device("cpu"), collective=Recorder())
    x, out = torch.full((8,), 3.0, dtype=dtype), torch.empty(8, dtype=dtype)
    ops_module.run(entry, x, out, "avg")
    assert (seen[0][0] != x.data_ptr()) == scaled and seen[0][1] == "sum"
    np.testing.assert_array_equal(out.float().numpy(), [3.0] * 8)


# ---------------------------------------------------------------------------------------------
# modes, autograd and traced checks (found by a probe on a CPU-only machine)

@pytest.mark.parametrize("mode", ["inference_mode", "fake_tensor_mode", "make_fx"])
def test_a_sequence_first_made_in_a_mode_is_a_real_tensor_that_later_compiles(mode):
    """The communicator's sequence tensor is cached for every later call: made first under
    inference_mode it was an inference tensor (a compiled call's update of it refused outside
    that mode), under a FakeTensorMode a fake one ("Please convert all Tensors to FakeTensors
    first", "Mixing fake modes NYI" in later traces).  Now it is real whatever the mode."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    worlds, comm = StandInWorlds(1), Comm(0, 1)

    def make():
        return pt.Group(comm, loader=worlds.loader(0))
    if mode == "inference_mode":
        with torch.inference_mode():
            first = make()
    elif mode == "fake_tensor_mode":
        with FakeTensorMode():
            first = make()
    else:
        first = None
        make_fx(lambda x: (make(), x + 1)[1], tracing_mode="fake")(torch.zeros(2))
    g = make()
    seq = g._sequence
    assert first is None or first._sequence is seq
    assert not isinstance(seq, FakeTensor) and not seq.is_inference() and seq.device.type == "cpu"

    def f(x):
        return pt.functional.all_reduce(x, group=g) + 1
    x = torch.randn(4)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, backend="aot_eager", fullgraph=True)(x), x + 1)
    assert "allreduce_seq" in make_fx(f, tracing_mode="fake")(x).code


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a device this torch cannot reach")
def test_a_group_on_a_device_this_torch_lacks_traces_with_a_stand_in_sequence():
    """A Group on cuda:0 of a CPU build has no sequence tensor (none can be made).  Traced, the
    backward's lookup made one inside the FakeTensorMode (a fake cuda:0 tensor, cached: later
    traces mixed fake modes), and under torch.compile it reached the lock that guards the
    cache ("Dynamo does not know how to enter a lock").  Each trace now takes a stand-in on the
    call's device, cached nowhere."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    before = dict(ops_module._SEQUENCES)
    g = pt.Group(Comm(0, 2, device="cuda:0"), loader=StandInWorlds(2).loader(0))
    assert g._sequence is None

    def f(x):
        return pt.functional.all_reduce(x, group=g) * 2
    meta = torch.empty(4, device="meta", requires_grad=True)
    with FakeTensorMode():  # the backward looks the sequence up from the handle
        pt.functional.all_reduce(torch.empty(4, device="meta", requires_grad=True), group=g).sum().backward()
    torch._dynamo.reset()
    assert torch.compile(f, backend="aot_eager", fullgraph=True)(meta.detach()).shape == (4,)
    assert "allreduce_seq" in make_fx(f, tracing_mode="fake")(meta.detach()).code
    assert ops_module._SEQUENCES == before


def _in_place_program(g):
    def f(x):
        y = x * 2
        g.all_reduce(y)                               # in place, on a tensor that requires grad
        out = y.new_empty(g.world_size * y.numel())
        g.all_gather_into_tensor(out, y)
        g.broadcast(y, src=0)
        return (y * y).sum() + out.sum()
    return f


def test_in_place_group_calls_are_unseen_by_autograd_compiled_as_eagerly():
    """Group calls on a tensor that requires grad ran eagerly (the kernels write memory, unseen by
    autograd, as torch.distributed's calls are) but failed compiled, with torch's generic "no
    autograd formula was registered" for purlin.allreduce_seq.  Both now run under no_grad: a
    written tensor keeps its history, and the gradients agree (torch.distributed's too)."""
    g = StandInWorlds(1).groups()[0]
    f = _in_place_program(g)
    grads = []
    for compile_ in (None, "eager", "aot_eager"):
        x = torch.randn(4, generator=torch.Generator().manual_seed(3)).requires_grad_()
        torch._dynamo.reset()
        run = f if compile_ is None else torch.compile(f, backend=compile_, fullgraph=True)
        run(x).backward()
        grads.append(x.grad)
    for got in grads[1:]:
        torch.testing.assert_close(got, grads[0])
    x = torch.randn(4).requires_grad_()  # a leaf written in place: allowed, as under no_grad
    torch._dynamo.reset()
    torch.compile(lambda t: g.all_reduce(t), backend="aot_eager", fullgraph=True)(x)
    assert x.requires_grad and x.grad_fn is None


def test_op_objects_take_a_torch_reduce_op_traced_as_eagerly():
    """pt.op(...)(x, op=dist.ReduceOp.MAX) passed the ReduceOp through to the op: eagerly the op
    bodies normalized it, traced the dispatcher refused it for the schema's str op."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    coll = pt.op(StandIn(World("collective myreduce { in[r] = x[0..R]  out[r] = x[0..R]  reduce }", 1, {}), 0),
                 name="myreduce")
    x = torch.randn(4)
    torch.testing.assert_close(coll(x, op=dist.ReduceOp.MAX), x)
    with FakeTensorMode():
        for call in (lambda t: coll(t, op=dist.ReduceOp.MAX),
                     lambda t: coll(t, out=torch.empty(4), op=dist.ReduceOp.MAX),
                     lambda t: coll.inplace(t, op=dist.ReduceOp.PRODUCT)):
            assert call(torch.empty(4)).shape == (4,)
    torch._dynamo.reset()
    f = torch.compile(lambda t: coll(t, op=dist.ReduceOp.MAX) * 1, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(f(x), x)


def _raw_refusals(g):
    ha, hb = g.entry("allreduce").handle, g.entry("broadcast", 0).handle
    return [
        (lambda x: torch.ops.purlin.allreduce(x, ha, "sum", -1), (7,), "x has 7 elements, expected a multiple of 3"),
        (lambda x: torch.ops.purlin.allreduce(x, ha, "sum", 5), (9,), r"count=5, expected -1 or 3 \(what x says: 9 "
                                                                        r"elements in 3 chunks\)"),
        (lambda x: torch.ops.purlin.broadcast(x, hb, "sum", 3), (5,), "but x has 5 elements; expected an empty tensor"),
    ]


def test_the_fakes_messages_show_sizes_not_symbols_under_dynamic_shapes():
    """Compiled with dynamic=True the fakes' messages showed symbols ("x has s77 elements",
    "expected -1 or (s77//3)"): sizes are now shown as this call's numbers (ops.shown)."""
    g = StandInWorlds(3).groups()[1]
    for f, shape, message in _raw_refusals(g):
        torch._dynamo.reset()
        with pytest.raises(Exception) as caught:
            torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)(torch.empty(*shape, device="meta"))
        assert re.search(message, str(caught.value)), str(caught.value)[:600]


def test_serving_adapter_compiles_without_a_graph_break():
    """should_custom_ar asked inp.is_neg(), which dynamo cannot trace: a graph break, so
    fullgraph=True failed; it now skips the lazy-bit test when compiling, as check_contiguous."""
    from purlinc.torch.serving import PurlinAllReduce

    ar = PurlinAllReduce(StandInWorlds(1).groups()[0])

    def f(x):
        y = ar.custom_all_reduce(x)
        return (x.clone() if y is None else y) * 2
    x = torch.randn(8)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, backend="aot_eager", fullgraph=True)(x), x * 2)
    torch._dynamo.reset()
    assert torch._dynamo.explain(f)(x).graph_break_count == 0
    assert not ar.should_custom_ar(torch.randn(8)._neg_view())  # eagerly the lazy view is still declined


@pytest.mark.parametrize("dtype", [torch.float64, torch.int16, torch.complex64])
def test_functional_copies_take_dtypes_purlin_lacks_as_group_calls_do(dtype):
    """pt.functional.all_gather_tensor and all_to_all_single refused float64, int16, complex64
    ("purlin::allgather on rank 0: x has dtype float64 ...") where Group.all_gather_into_tensor
    carries their bytes.  They now carry them too, eagerly and traced, and refuse by their
    own name."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def body(rank, g):
        x = (torch.arange(4) + 10 * rank).to(dtype).view(2, 2)
        return pt.functional.all_gather_tensor(x, group=g), pt.functional.all_to_all_single(x, group=g)
    xs = [(torch.arange(4) + 10 * r).to(dtype).view(2, 2) for r in range(2)]
    groups = StandInWorlds(2).groups()
    for rank, (gathered, exchanged) in enumerate(on_ranks(groups, body)):
        assert gathered.dtype == dtype and exchanged.dtype == dtype
        torch.testing.assert_close(gathered, torch.cat(xs))
        torch.testing.assert_close(exchanged, torch.stack([xs[0][rank], xs[1][rank]]))
    with FakeTensorMode():
        assert pt.functional.all_gather_tensor(torch.empty(3, 2, dtype=dtype), group=groups[0]).shape == (6, 2)
    torch._dynamo.reset()
    f = torch.compile(lambda t: pt.functional.all_to_all_single(t, group=groups[0]), backend="aot_eager",
                      fullgraph=True)
    assert f(torch.empty(4, 2, dtype=dtype, device="meta")).dtype == dtype
    with pytest.raises(ArgumentError, match="^error: all_gather_tensor: x is not contiguous"):
        pt.functional.all_gather_tensor(torch.empty(3, 2, dtype=dtype).t(), group=groups[0])


def test_raw_ops_refuse_meta_beside_real_tensors_naming_both():
    """A meta x with a CPU out (or the other way round) reached only the fake (the dispatcher
    picks it for any meta argument), each tensor passed its own device check there, and the
    call returned with out unwritten, silently."""
    g = StandInWorlds(1).groups()[0]
    hg, ha = g.entry("allgather").handle, g.entry("allreduce").handle
    meta, cpu = torch.ones(4, device="meta"), torch.zeros(4)
    for call, message in ((lambda: torch.ops.purlin.allgather_out(meta, cpu, hg, "sum"),
                           r"out is on cpu, expected meta \(the device of x\)"),
                          (lambda: torch.ops.purlin.allgather_out(cpu, torch.empty(4, device="meta"), hg, "sum"),
                           r"out is on meta, expected cpu \(the device of x\)"),
                          (lambda: torch.ops.purlin.allreduce_out(meta, cpu, ha, "sum"),
                           r"out is on cpu, expected meta \(the device of x\)")):
        with pytest.raises(ArgumentError, match=message):
            call()
    assert torch.equal(cpu, torch.zeros(4))


@pytest.mark.parametrize("second", ["gloo", "purlincpu"])
def test_a_compiled_call_after_a_destroyed_default_group_says_it_has_no_communicator(second):
    """After destroy_process_group and a new init_process_group (which names its group '0'
    again), the first compiled call released the old group inside the trace and stopped at its
    lock ("Dynamo does not know how to enter a lock").  The trace now releases nothing: it
    refuses with the documented message, and an eager call then makes the new communicator.
    The new world on the purlin backend too: the lookup that lets such a group find itself by
    name alone (dynamo 2.11 cannot compare it with `is`) ran the call on the destroyed gloo
    group's communicator.  In a fresh process: it makes torch.distributed's default group."""
    code = r'''
import socket, torch, torch.distributed as dist
import purlinc.torch as pt
from purlinc.torch import backend, groups
import torch_standin
groups.factory = torch_standin.factory
backend.register("purlincpu", device_type="cpu", fallbacks={"cpu": "gloo"})
def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
def f(x):
    return pt.functional.all_reduce(x) * 2
def compiled(x):
    torch._dynamo.reset()
    return torch.compile(f, backend="aot_eager", fullgraph=True)(x)
dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port()}")
f(torch.ones(4))
assert torch.equal(compiled(torch.ones(4)), torch.full((4,), 2.0))
dist.destroy_process_group()
dist.init_process_group(SECOND, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port()}")
try:
    compiled(torch.ones(4))
    raise SystemExit("compiled without a communicator")
except Exception as error:
    text = str(error)
    assert "group '0' has no Purlin communicator yet, and a compiled region cannot make one" in text, text[-2000:]
    assert "lock" not in text.split("Developer debug context")[0], text[-2000:]
assert torch.equal(f(torch.ones(4)), torch.full((4,), 2.0))  # eager: releases the old, makes the new
assert torch.equal(compiled(torch.ones(4)), torch.full((4,), 2.0))
dist.destroy_process_group()
print("ok")
'''
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    code = code.replace("SECOND", repr(second))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-4000:]


def test_a_group_checks_each_rooted_collective_once_per_role(monkeypatch):
    """A Group checked every rooted collective's spec once per root, each check over all R
    ranks: its creation grew with R squared.  Now one check per (collective, whether this rank
    is the root), and every root's entry holds the shapes a check for that very root gives."""
    from purlinc.frontend import check as check_module
    from purlinc.frontend.standard import ROOTED

    calls = []
    real = check_module.check
    monkeypatch.setattr(check_module, "check", lambda *args, **kw: calls.append(args[1:]) or real(*args, **kw))
    world = 6
    for rank in (0, 4):
        calls.clear()
        group = pt.Group(Comm(rank, world), loader=lambda *a: None)
        assert len(calls) == len(SOURCES) + len(ROOTED), calls
        for kind in ROOTED:
            for root in range(world):
                spec = real(parse(SOURCES[kind]), world, {"root": root})
                got = group.entry(kind, root)
                assert (got.in_units, got.out_units) == (len(spec.inputs[rank]), len(spec.outputs[rank])), (kind, root)
        group.close()
