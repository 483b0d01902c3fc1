"""purlin::fused_add_rmsnorm without a GPU: its fake implementation (shapes, dtypes, checks
naming the tensor) under FakeTensorMode, and the refusal of a collective without that epilogue."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

from purlinc.frontend.check import check  # noqa: E402
from purlinc.frontend.parse import parse, parse_file  # noqa: E402
from purlinc.runtime.errors import ArgumentError  # noqa: E402
from purlinc.torch.epilogue import fused_add_rmsnorm_op  # noqa: E402
from test_torch_sized_cpu import _calls, ancestors  # noqa: E402
from pathlib import Path  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fused" / "allreduce_add_rmsnorm.pln"


class _Comm:
    rank, world_size, device = 0, 2, 0


class _Loaded:
    """Stands for a loaded collective: the op reads its spec and communicator only."""

    def __init__(self, spec):
        self.spec, self.comm = spec, _Comm()


def test_fake_implementation_gives_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    fused = fused_add_rmsnorm_op(_Loaded(check(parse_file(EXAMPLE), 2)), device="cpu")
    try:
        with FakeTensorMode():
            x = torch.empty(16, 4096, dtype=torch.bfloat16)
            y = fused(x, torch.empty_like(x), torch.empty(4096, dtype=torch.bfloat16), 1e-6)
            assert y.shape == (16, 4096) and y.dtype == torch.bfloat16
            with pytest.raises(ArgumentError, match=r"weight is bfloat16 \(2048,\), expected bfloat16 \(4096,\) "
                                                    r"\(one row, x's dtype\)"):
                fused(x, torch.empty_like(x), torch.empty(2048, dtype=torch.bfloat16), 1e-6)
            with pytest.raises(ArgumentError, match=r"residual is float32 \(16, 4096\), expected bfloat16 \(16, 4096\)"):
                fused(x, torch.empty(16, 4096), torch.empty(4096, dtype=torch.bfloat16), 1e-6)
    finally:
        fused.close()


def test_inputs_that_require_grad_are_refused_up_front():
    """The op has no gradient and writes residual in place: an x that requires grad gave a y whose
    backward failed later ("no autograd formula"), and a leaf residual that requires grad was
    written in place silently.  Refused at the call, naming the tensor; under no_grad it runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fused = fused_add_rmsnorm_op(_Loaded(check(parse_file(EXAMPLE), 2)), device="cpu")
    try:
        with FakeTensorMode():
            x = torch.empty(2, 4096, dtype=torch.bfloat16)
            w = torch.empty(4096, dtype=torch.bfloat16)
            for label in ("x", "residual", "weight"):
                args = {"x": x, "residual": torch.empty_like(x), "weight": w}
                args[label] = args[label].clone().requires_grad_()
                with pytest.raises(ArgumentError, match=rf"fused_add_rmsnorm: {label} requires grad, and the op has no "
                                                        r"gradient \(it writes residual in place\)"):
                    fused(args["x"], args["residual"], args["weight"], 1e-6)
                with torch.no_grad():
                    assert fused(args["x"], args["residual"], args["weight"], 1e-6).shape == (2, 4096)
    finally:
        fused.close()


def test_needs_the_add_rmsnorm_epilogue():
    plain = check(parse("collective a { in[r] = x  out[r] = x  reduce }"), 2)
    with pytest.raises(ArgumentError, match="must have an epilogue taking rows residual .written., row weight and "
                                            "scalar eps; it has no epilogue"):
        fused_add_rmsnorm_op(_Loaded(plain), device="cpu")


EPILOGUE_BODY = """ with rows residual, row weight, scalar eps {{
    {layouts}
    reduce
    epilogue rows(64) {{ h = out + residual  residual = h  out = rmsnorm(h, weight, eps) }}
}}"""


@pytest.mark.parametrize("layouts, rank, counts", [
    ("in[r] = x[0..R]  out[r] = x[r]", 0, "2 input chunk(s) and 1 output chunk(s)"),  # a reduce-scatter's shape
    ("in[r] = x  out[0] = x", 1, "1 input chunk(s) and 0 output chunk(s)"),  # a reduce to rank 0
])
def test_needs_outputs_shaped_like_the_inputs(layouts, rank, counts):
    """y is made x-shaped (empty_like(x)): other shapes were taken, the fake said y was x's
    shape, and a real call failed naming an 'out' the caller never passed."""
    spec = check(parse("collective rs" + EPILOGUE_BODY.format(layouts=layouts)), 2)
    with pytest.raises(ArgumentError) as info:
        fused_add_rmsnorm_op(_Loaded(spec), device="cpu")
    assert info.value.message == (f"fused_add_rmsnorm: rs must give every rank an output the size of its input (an "
                                  f"all-reduce's shape); rank {rank} has {counts}")


SPLIT_ROWS = """collective ar2(hidden = 64) with rows residual, row weight, scalar eps {
    in[r]  = x[0..R]
    out[r] = x[0..R]
    reduce
    epilogue rows(hidden) {
        h = out + residual
        residual = h
        out = rmsnorm(h, weight, eps)
    }
}"""


@pytest.mark.parametrize("rows", [1, 3])
def test_the_fake_refuses_rows_that_straddle_chunks_as_the_runtime_does(rows):
    """x[0..R] splits x into R chunks: R=2 needs an even number of rows (operands.check_rows);
    a trace must fail where the call would, not pass and fail at run time."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fused = fused_add_rmsnorm_op(_Loaded(check(parse(SPLIT_ROWS), 2)), device="cpu")
    message = (rf"x has {rows} rows?, expected a multiple of 2: ar2 splits x into 2 chunks, and a row never "
               "straddles two")
    try:
        with FakeTensorMode():
            x = torch.empty(rows, 64)
            with pytest.raises(ArgumentError, match=message):
                fused(x, torch.empty_like(x), torch.empty(64), 1e-6)
            x = torch.empty(2 * rows, 64)
            assert fused(x, torch.empty_like(x), torch.empty(64), 1e-6).shape == (2 * rows, 64)
    finally:
        fused.close()


def test_traces_whole_with_fake_tensors():
    """make_fx in fake mode runs only the fake implementation: the op stays one node, with its
    in-place residual visible to functionalization."""
    from torch.fx.experimental.proxy_tensor import make_fx

    fused = fused_add_rmsnorm_op(_Loaded(check(parse_file(EXAMPLE), 2)), device="cpu")
    try:
        def step(x, residual, weight):
            return fused(x, residual, weight, 1e-6) * 2

        x = torch.empty(4, 4096, dtype=torch.bfloat16)
        graph = make_fx(step, tracing_mode="fake")(x, torch.empty_like(x), torch.empty(4096, dtype=torch.bfloat16))
        calls = [n for n in graph.graph.nodes if "fused_add_rmsnorm" in str(n.target)]
        assert len(calls) == 1
    finally:
        fused.close()


def test_schema_has_the_sequence_tensor():
    fused = fused_add_rmsnorm_op(_Loaded(check(parse_file(EXAMPLE), 2)), device="cpu")
    try:
        assert str(torch.ops.purlin.fused_add_rmsnorm.default._schema) == (
            "purlin::fused_add_rmsnorm(Tensor x, Tensor(a!) residual, Tensor weight, float eps, Tensor(b!) seq, "
            "int handle) -> Tensor")
    finally:
        fused.close()


def _bad_calls(row):
    """(what is wrong, the call's (x, residual, weight, eps), the message expected)."""
    def x(*shape, dtype=torch.float32):
        return torch.zeros(shape, dtype=dtype)
    shared = x(4, row)
    flat = x(5 * row)
    return [
        ("x float64", (x(4, row, dtype=torch.float64), x(4, row, dtype=torch.float64), x(row, dtype=torch.float64), 1e-6),
         r"x has dtype float64, expected one of bfloat16, float16, float32"),
        ("x int32", (x(4, row, dtype=torch.int32), x(4, row, dtype=torch.int32), x(row, dtype=torch.int32), 1e-6),
         "x has dtype int32"),
        ("partial rows", (x(4, row - 4), x(4, row - 4), x(row), 1e-6),
         rf"x has shape \(4, {row - 4}\), expected whole rows of {row} elements \(the last dimension; "
         rf"the spec's rows\({row}\)\)"),
        ("0-d x", (x(), x(), x(row), 1e-6), r"x has shape \(\), expected whole rows"),
        ("residual shape", (x(4, row), x(2, row), x(row), 1e-6),
         rf"residual is float32 \(2, {row}\), expected float32 \(4, {row}\)"),
        ("weight 2-D", (x(4, row), x(4, row), x(1, row), 1e-6), rf"weight is float32 \(1, {row}\), expected float32 \({row},\)"),
        ("weight dtype", (x(4, row), x(4, row), x(row, dtype=torch.float16), 1e-6), "weight is float16"),
        ("x strided", (x(row, 4).t(), x(4, row), x(row), 1e-6), r"x is not contiguous \(shape \(4, %d\)" % row),
        ("residual strided", (x(4, row), x(row, 4).t(), x(row), 1e-6), "residual is not contiguous"),
        ("weight strided", (x(4, row), x(4, row), x(row, 2)[:, 0], 1e-6), "weight is not contiguous"),
        ("residual is x", (shared, shared, x(row), 1e-6), "residual overlaps x in memory"),
        ("residual overlaps weight", (x(4, row), flat[:4 * row].view(4, row), flat[3 * row:4 * row], 1e-6),
         "residual overlaps weight in memory"),
        ("eps nan", (x(4, row), x(4, row), x(row), float("nan")), r"eps=nan, expected a finite number >= 0"),
        ("eps inf", (x(4, row), x(4, row), x(row), float("inf")), "eps=inf"),
        ("eps negative", (x(4, row), x(4, row), x(row), -1e-6), "eps=-1e-06"),
        ("eps past float32", (x(4, row), x(4, row), x(row), 1e39), r"eps=1e\+39, expected .* that float32 holds"),
        # float32 rounds it to 0: the runtime refuses it (scalar_problem), so the fake does too
        ("eps rounds to 0", (x(4, row), x(4, row), x(row), 1e-50),
         r"eps: expected a value float32 can hold, got 1e-50: it would be 0"),
        # an int past any float: float() raised a bare OverflowError
        ("eps past any float", (x(4, row), x(4, row), x(row), 10**400),
         r"fused_add_rmsnorm: eps=100000000000\.\.\.0000 \(401 characters\), expected a finite number >= 0"),
        # the epilogue reads residual and weight as 16-byte vectors: the runtime refused these only
        # inside the call, after the load (and the fake passed them)
        ("residual misaligned", (x(4, row), x(4 * row + 1)[1:].view(4, row), x(row), 1e-6),
         r"residual starts 4 bytes past a 16-byte boundary; expected a 16-byte aligned tensor"),
        ("weight misaligned", (x(4, row), x(4, row), x(row + 2)[2:], 1e-6), r"weight starts 8 bytes past a 16-byte"),
    ]


_BAD = _bad_calls(64)


@pytest.mark.parametrize("what, args, message", _BAD, ids=[case[0] for case in _BAD])
def test_fake_and_real_refuse_the_same_bad_calls(what, args, message):
    """The fake (FakeTensorMode) and the real implementation run one check: every bad call is
    an ArgumentError naming the tensor, in both, and the real one refuses before it loads."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    row = 64
    fused = fused_add_rmsnorm_op(_Loaded(check(parse_file(EXAMPLE), 2, {"hidden": row})), device="cpu")
    try:
        fused.entry._collective = None  # not loaded yet: a load is a collective, so a check must come first
        fused.entry._loader = lambda: pytest.fail(f"{what}: loaded before its arguments were checked")
        with pytest.raises(ArgumentError, match=message):
            fused(*args)
        with FakeTensorMode() as mode:
            fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            with pytest.raises(ArgumentError, match=message):
                fused(*fakes)
    finally:
        fused.close()


@pytest.mark.parametrize("eps", [None, "1e-6", b"1", True, [1e-6]])
def test_eps_that_is_not_a_number_is_refused_by_name(eps):
    """float(eps) read the string "1e-6" as a number and raised a bare TypeError for None."""
    coll = _Running(check(parse_file(EXAMPLE), 1, {"hidden": 64}))
    fused = fused_add_rmsnorm_op(coll, device="cpu")
    try:
        with pytest.raises(ArgumentError, match=rf"fused_add_rmsnorm: eps={re.escape(repr(eps))}, expected a number"):
            fused(torch.randn(4, 64), torch.randn(4, 64), torch.ones(64), eps)
        assert fused(torch.randn(4, 64), torch.randn(4, 64), torch.ones(64), 1).shape == (4, 64)  # ints are numbers
        assert not coll.calls[:-1]
    finally:
        fused.close()


def test_device_is_the_entrys_and_meta_passes_only_the_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    row = 64
    on_gpu = fused_add_rmsnorm_op(_Loaded(check(parse_file(EXAMPLE), 2, {"hidden": row})), device="cuda:1")
    on_cpu = fused_add_rmsnorm_op(_Loaded(check(parse_file(EXAMPLE), 2, {"hidden": row})), device="cpu")
    try:
        with FakeTensorMode():
            x = torch.empty(4, row)
            with pytest.raises(ArgumentError, match=r"x is on cpu, expected cuda:1 \(the device of this Purlin "
                                                    r"communicator, rank 0 of 2\)"):
                on_gpu(x, torch.empty_like(x), torch.empty(row), 1e-6)
        meta = torch.empty(4, row, device="meta")
        y = on_cpu(meta, torch.empty_like(meta), torch.empty(row, device="meta"), 1e-6)  # the dispatcher: the fake
        assert y.shape == (4, row) and y.device.type == "meta"
        from purlinc.torch import epilogue

        with pytest.raises(ArgumentError, match="x is on meta, expected cpu"):  # the real implementation's check
            epilogue._check("purlin::fused_add_rmsnorm on rank 0", on_cpu.entry, meta, torch.empty_like(meta),
                            torch.empty(row, device="meta"), 1e-6)
    finally:
        on_gpu.close()
        on_cpu.close()


class _Running(_Loaded):
    """A world of one: the all-reduce is x itself; records the epilogue's operands."""

    def __init__(self, spec):
        super().__init__(spec)
        self.comm = type("Comm", (), {"rank": 0, "world_size": 1, "device": "cpu"})()
        self.calls = []

    def __call__(self, x, out, **operands):
        self.calls.append(operands)
        out.copy_(x)


def test_real_runs_on_checked_contiguous_views():
    row = 64
    coll = _Running(check(parse_file(EXAMPLE), 1, {"hidden": row}))
    fused = fused_add_rmsnorm_op(coll, device="cpu")
    try:
        x = torch.randn(4, row)
        residual, weight = torch.randn(4, row), torch.ones(row)
        y = fused(x, residual, weight, 1e-6)
        assert y.shape == x.shape and len(coll.calls) == 1
        operands = coll.calls[0]
        assert operands["residual"].data_ptr() == residual.data_ptr() and operands["eps"] == 1e-6
        with pytest.raises(ArgumentError, match=r"residual is not contiguous \(shape \(4, 64\), strides \(1, 4\)\)"):
            fused(x, torch.randn(row, 4).t(), weight, 1e-6)  # was torch's RuntimeError from .view(-1)
        assert len(coll.calls) == 1
    finally:
        fused.close()


def _graphs(fn, *args):
    """The forward graphs AOTAutograd makes of fn (after functionalization); nothing runs."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def forward(gm, example):
        graphs.append(gm)
        outputs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
        values = [o.meta["val"] for o in outputs]
        return lambda *a: [torch.zeros(v.shape, dtype=v.dtype) for v in values]
    torch._dynamo.reset()
    # Static sizes: the stand-in compiler makes its outputs of the example's shapes, and torch
    # 2.11 can carry automatic dynamic sizes over from an earlier test's compile.
    torch.compile(fn, backend=aot_autograd(fw_compiler=forward), fullgraph=True, dynamic=False)(*args)
    return graphs


def test_compiled_call_is_kept_when_nothing_uses_it():
    """Every rank must make the call even where y and residual go unused: the op writes the
    communicator's sequence tensor and is side-effectful, so no compiler drops it."""
    fused = fused_add_rmsnorm_op(_Loaded(check(parse_file(EXAMPLE), 2, {"hidden": 64})), device="cpu")
    try:
        def unused(x, w):
            r = x.clone()
            fused(x, r, w, 1e-6)  # result unused, residual local
            return x * 2
        (gm,) = _graphs(unused, torch.randn(4, 64), torch.randn(64))
        assert len(_calls(gm, "fused_add_rmsnorm")) == 1, gm.graph
    finally:
        fused.close()


def test_compiled_call_is_ordered_with_the_communicators_other_collectives():
    """The fused op and a later all-reduce of the same communicator are chained through its
    one sequence tensor (nothing else links them here), so a scheduler keeps their order."""
    import purlinc.torch as pt
    from test_torch_cpu import StandInWorlds

    g = StandInWorlds(1).groups()[0]
    loaded = _Loaded(check(parse_file(EXAMPLE), 1, {"hidden": 64}))
    loaded.comm = g.comm
    fused = fused_add_rmsnorm_op(loaded, device="cpu")
    try:
        def step(x, residual, w, z):
            y = fused(x, residual, w, 1e-6)
            return y, pt.functional.all_reduce(z, group=g)
        (gm,) = _graphs(step, torch.randn(4, 64), torch.randn(4, 64), torch.randn(64), torch.randn(8))
        (first,) = _calls(gm, "fused_add_rmsnorm")
        (second,) = _calls(gm, "allreduce_seq")
        assert first in ancestors(second), gm.graph
        seqs = [n for n in ancestors(first) if n.op == "placeholder" and tuple(n.meta["val"].shape) == (1,)]
        assert seqs and seqs[0] in ancestors(second)
    finally:
        fused.close()


def test_a_handle_without_the_epilogue_is_refused():
    from test_torch_cpu import StandInWorlds

    g = StandInWorlds(2).groups()[0]
    handle = g.entry("allreduce").handle
    x = torch.empty(4, 64, device="meta")
    with pytest.raises(ArgumentError, match=rf"handle {handle} names 'allreduce', which has no add \+ RMSNorm "
                                            r"epilogue"):
        torch.ops.purlin.fused_add_rmsnorm(x, torch.empty_like(x), torch.empty(64, device="meta"), 1e-6,
                                           torch.zeros(1, dtype=torch.int32, device="meta"), handle)


def test_op_objects_refuse_a_collective_with_an_epilogue():
    """pt.op(coll) over a collective with an epilogue was accepted, though its calls cannot pass
    residual, weight or eps: it could only fail at run time, after the others loaded theirs."""
    import purlinc.torch as pt

    spec = check(parse_file(EXAMPLE), 2, {"hidden": 64})
    with pytest.raises(ArgumentError, match=r"purlin::allreduce_add_rmsnorm: allreduce_add_rmsnorm has an epilogue "
                                            r"\(taking rows residual \(written\), row weight, scalar eps\); expected a "
                                            r"collective without one"):
        pt.op(_Loaded(spec))


def test_meta_beside_real_tensors_is_refused_naming_both():
    """Meta tensors pass the fake's device check one at a time; a meta x beside a CPU residual
    reached the fake alone (the dispatcher picks it for any meta argument) and returned with
    residual unwritten, silently."""
    fused = fused_add_rmsnorm_op(_Loaded(check(parse_file(EXAMPLE), 2, {"hidden": 64})), device="cpu")
    try:
        x = torch.empty(2, 64, device="meta")
        residual = torch.zeros(2, 64)
        with pytest.raises(ArgumentError, match=r"residual is on cpu, expected meta \(the device of x\)"):
            fused(x, residual, torch.empty(64, device="meta"), 1e-6)
        with pytest.raises(ArgumentError, match=r"weight is on meta, expected cpu \(the device of x\)"):
            fused(torch.empty(2, 64), residual, torch.empty(64, device="meta"), 1e-6)
        assert torch.equal(residual, torch.zeros(2, 64))
    finally:
        fused.close()
