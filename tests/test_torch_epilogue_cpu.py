"""purlin::fused_add_rmsnorm without a GPU: its fake implementation (shapes, dtypes, checks
naming the tensor) under FakeTensorMode, and the refusal of a collective without that epilogue."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from purlinc.frontend.check import check  # noqa: E402
from purlinc.frontend.parse import parse, parse_file  # noqa: E402
from purlinc.runtime.errors import ArgumentError  # noqa: E402
from purlinc.torch.epilogue import fused_add_rmsnorm_op  # noqa: E402
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
            with pytest.raises(ArgumentError, match=r"weight: expected 4096 elements of torch.bfloat16 \(one row\), "
                                                    r"got 2048 of torch.bfloat16"):
                fused(x, torch.empty_like(x), torch.empty(2048, dtype=torch.bfloat16), 1e-6)
            with pytest.raises(ArgumentError, match="residual: expected torch.bfloat16"):
                fused(x, torch.empty(16, 4096), torch.empty(4096, dtype=torch.bfloat16), 1e-6)
    finally:
        fused.close()


def test_needs_the_add_rmsnorm_epilogue():
    plain = check(parse("collective a { in[r] = x  out[r] = x  reduce }"), 2)
    with pytest.raises(ArgumentError, match="must have an epilogue taking rows residual .written., row weight and "
                                            "scalar eps; it has no epilogue"):
        fused_add_rmsnorm_op(_Loaded(plain), device="cpu")


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
