"""Fused epilogues as torch custom ops: ``purlin::fused_add_rmsnorm``.

    fused = purlinc.torch.fused_add_rmsnorm_op(purlinc.load("examples/fused/allreduce_add_rmsnorm.pln", comm))
    y = fused(x, residual, weight, 1e-6)   # y = rmsnorm(residual + allreduce(x)) * weight; residual <- h

The op's schema is ``purlin::fused_add_rmsnorm(Tensor x, Tensor(a!) residual, Tensor weight,
float eps, int handle) -> Tensor``: ``residual`` is updated in place (it becomes ``h``, the next
layer's residual, as vLLM's ``fused_add_rms_norm`` does), ``y`` is returned.  The fake
implementation gives ``y``'s shape and dtype without a GPU, so the call stays whole under
``torch.compile(fullgraph=True)``.  Any collective whose epilogue takes exactly
``rows residual`` (written), ``row weight`` and ``scalar eps`` serves.
"""

from __future__ import annotations

import torch

from purlinc.frontend.ast import OperandKind
from purlinc.runtime.errors import ArgumentError
from purlinc.torch.registry import Entry, entry

_SIGNATURE = (("residual", OperandKind.ROWS, True), ("weight", OperandKind.ROW, False), ("eps", OperandKind.SCALAR, False))
_OP = None


def _check(where: str, x, residual, weight, row: int) -> None:
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ArgumentError(f"{where}: residual: expected {x.dtype} {tuple(x.shape)} (x's), "
                            f"got {residual.dtype} {tuple(residual.shape)}")
    if weight.numel() != row or weight.dtype != x.dtype:
        raise ArgumentError(f"{where}: weight: expected {row} elements of {x.dtype} (one row), "
                            f"got {weight.numel()} of {weight.dtype}")


def _define():
    global _OP
    if _OP is not None:
        return _OP

    def real(x, residual, weight, eps, handle):
        e = entry(handle)
        coll = e.collective(torch.cuda.is_current_stream_capturing())
        y = torch.empty_like(x)
        _check(f"purlin::fused_add_rmsnorm on rank {e.rank}", x, residual, weight, coll_row(coll))
        coll(x.reshape(-1), y.view(-1), residual=residual.view(-1), weight=weight.view(-1), eps=float(eps))
        return y

    def fake(x, residual, weight, eps, handle):
        e = entry(handle)
        _check(f"purlin::fused_add_rmsnorm on rank {e.rank}", x, residual, weight, e.row)
        return torch.empty_like(x)

    schema = "(Tensor x, Tensor(a!) residual, Tensor weight, float eps, int handle) -> Tensor"
    _OP = torch.library.custom_op("purlin::fused_add_rmsnorm", real, mutates_args=("residual",), schema=schema)
    _OP.register_fake(fake)
    return _OP


def coll_row(coll) -> int:
    spec = coll.spec if hasattr(coll, "spec") else coll.compiled.spec
    return spec.epilogue.row


class FusedAddRMSNorm:
    """``f(x, residual, weight, eps) -> y`` over a loaded collective with such an epilogue."""

    def __init__(self, coll, *, device=None):
        spec = coll.spec if hasattr(coll, "spec") else coll.compiled.spec
        epilogue = spec.epilogue
        shape = tuple((o.name, o.kind, o.written) for o in epilogue.operands) if epilogue else None
        if shape != _SIGNATURE:
            have = ", ".join(o.format() for o in epilogue.operands) if epilogue else "no epilogue"
            raise ArgumentError(f"fused_add_rmsnorm: {spec.name} must have an epilogue taking rows residual "
                                f"(written), row weight and scalar eps; it has {have}")
        dev = coll.comm.device if device is None else device
        dev = torch.device("cuda", dev) if isinstance(dev, int) else torch.device(dev)
        self.entry = Entry(spec.name, spec, coll.comm, dev, collective=coll)
        self.op = _define()

    def __call__(self, x, residual, weight, eps: float):
        return self.op(x, residual, weight, float(eps), self.entry.handle)

    def close(self) -> None:
        self.entry.close()


def fused_add_rmsnorm_op(coll, *, device=None) -> FusedAddRMSNorm:
    """Expose a loaded collective with an add + RMSNorm epilogue as ``purlin::fused_add_rmsnorm``."""
    return FusedAddRMSNorm(coll, device=device)
