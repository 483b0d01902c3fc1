"""Fused epilogues as torch custom ops: ``purlin::fused_add_rmsnorm``.

    fused = purlinc.torch.fused_add_rmsnorm_op(purlinc.load("examples/fused/allreduce_add_rmsnorm.pln", comm))
    y = fused(x, residual, weight, 1e-6)   # y = rmsnorm(residual + allreduce(x)) * weight; residual <- h

The op's schema is ``purlin::fused_add_rmsnorm(Tensor x, Tensor(a!) residual, Tensor weight,
float eps, Tensor(b!) seq, int handle) -> Tensor``: ``residual`` is updated in place (it becomes
``h``, the next layer's residual, as vLLM's ``fused_add_rms_norm`` does), ``y`` is returned.
``seq`` is the communicator's sequence tensor (:func:`purlinc.torch.ops.sequence`), which the op
only "writes": like the other collectives' ``NAME_seq`` ops it keeps the call in program order
under ``torch.compile`` and never dropped, even where ``y`` and ``residual`` go unused (every
rank must still take part).  The fake implementation gives ``y``'s shape and dtype without a
GPU, so the call stays whole under ``torch.compile(fullgraph=True)``; it checks what the real
one checks (``_check``), and the real one checks before it loads or launches anything.  Any
collective whose epilogue takes exactly ``rows residual`` (written), ``row weight`` and
``scalar eps`` serves.
"""

from __future__ import annotations

import math
import numbers

import torch

from purlinc.frontend.ast import OperandKind
from purlinc.frontend.epilogue import scalar_problem
from purlinc.runtime.errors import ArgumentError
from purlinc.torch import ops as _ops
from purlinc.torch.registry import Entry, entry

_SIGNATURE = (("residual", OperandKind.ROWS, True), ("weight", OperandKind.ROW, False), ("eps", OperandKind.SCALAR, False))
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the epilogue's kernels compute in
_FLOAT32_MAX = torch.finfo(torch.float32).max  # eps reaches the kernel as a float32
_ALIGN = 16  # bytes: the epilogue's vectors (purlinc.runtime.validate.FAST_ALIGN)
_OP = None
_NAME = "fused_add_rmsnorm"
# reserved at import: a user's collective may not take the name before the op is first defined
_ops.reserve(_NAME, "purlinc.torch.fused_add_rmsnorm_op's fused all-reduce + add + RMSNorm")


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check(where: str, e: Entry, x, residual, weight, eps, *, fake: bool = False) -> None:
    """Everything the kernel assumes, in the fake and the real implementation alike: ``fake``
    lets meta tensors pass the device check (shape inference only)."""
    if not e.row:  # a handle of a collective without the epilogue (a Group's all-reduce, say)
        raise ArgumentError(f"{where}: handle {e.handle} names {e.name!r}, which has no add + RMSNorm epilogue; "
                            f"expected a handle of purlinc.torch.fused_add_rmsnorm_op(...)")
    named = (("x", x), ("residual", residual), ("weight", weight))
    _ops.require_tensors(where, named)
    for label, t in named:
        _ops.check_device(where, label, t, e.device, e.rank, e.world_size, fake=fake)
    _ops.same_device(where, named)  # meta passes the fake's check alone: never beside a real tensor
    _check_x(where, e, x)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ArgumentError(f"{where}: residual is {_name(residual.dtype)} {_ops.shape_shown(residual)}, "
                            f"expected {_name(x.dtype)} {_ops.shape_shown(x)} (x's dtype and shape)")
    if weight.dim() != 1 or weight.numel() != e.row or weight.dtype != x.dtype:
        raise ArgumentError(f"{where}: weight is {_name(weight.dtype)} {_ops.shape_shown(weight)}, expected "
                            f"{_name(x.dtype)} ({e.row},) (one row, x's dtype)")
    for label, t in named:
        _ops.check_contiguous(where, label, t)
    for label, t in (("residual", residual), ("weight", weight)):
        _check_aligned(where, label, t, fake=fake)
    for label, t in (("x", x), ("weight", weight)):
        if _ops.overlap(residual, t, fake=fake):
            raise ArgumentError(f"{where}: residual overlaps {label} in memory, expected a tensor of its own",
                                notes=("the op writes residual while it reads x and weight; pass a copy "
                                       "(residual.clone())",))
    _check_eps(where, eps)


def _check_aligned(where: str, label: str, t, *, fake: bool) -> None:
    """The epilogue reads residual and weight as 16-byte vectors, with no scalar path: the runtime
    refuses a misaligned operand (operands.operand_words), but only inside the call, after the
    load.  Real: the address; fake (no address): the offset into its storage, which torch's
    allocator aligns (to 512 bytes), so both give the same answer for tensors torch made."""
    offset = t.storage_offset() * t.element_size() if fake else t.data_ptr()
    if t.numel() and offset % _ALIGN:
        raise ArgumentError(f"{where}: {label} starts {_ops.shown(offset % _ALIGN)} bytes past a {_ALIGN}-byte "
                            f"boundary; expected a {_ALIGN}-byte aligned tensor (the epilogue reads it as "
                            f"{_ALIGN}-byte vectors)",
                            notes=(f"pass a fresh tensor or {label}.clone(), not a view at an offset",))


def _check_x(where: str, e: Entry, x) -> None:
    if x.dtype not in _DTYPES:
        raise ArgumentError(f"{where}: x has dtype {_name(x.dtype)}, expected one of "
                            f"{', '.join(_name(d) for d in _DTYPES)}")
    if x.dim() < 1 or x.shape[-1] != e.row:
        raise ArgumentError(f"{where}: x has shape {_ops.shape_shown(x)}, expected whole rows of {e.row} elements "
                            f"(the last dimension; the spec's rows({e.row}))")
    rows = x.numel() // e.row
    if e.in_units > 1 and rows % e.in_units:  # what the runtime's check_rows refuses, found when traced
        raise ArgumentError(f"{where}: x has {_ops.shown(rows)} row{'' if rows == 1 else 's'}, expected a multiple of "
                            f"{e.in_units}: {e.name} splits x into {e.in_units} chunks, and a row never straddles two",
                            notes=("use a spec whose input and output are one chunk (x) for any number of rows",))


def _check_eps(where: str, eps) -> None:
    if isinstance(eps, torch.SymFloat):  # traced as a symbol: the real implementation checks the value
        return
    if not (math.isfinite(eps) and 0 <= eps <= _FLOAT32_MAX):  # a float: _as_float read it
        raise ArgumentError(f"{where}: eps={eps!r}, expected a finite number >= 0 that float32 holds "
                            f"(at most {_FLOAT32_MAX:.6g})")
    # and what else the runtime's rule refuses (a value float32 rounds to 0): the fake agrees with the real call
    problem = scalar_problem(eps, is_eps=True)
    if problem is not None:
        raise ArgumentError(f"{where}: eps: {problem[0]}", notes=(problem[1],) if problem[1] else ())


def _define():
    global _OP
    if _OP is not None:
        return _OP

    def real(x, residual, weight, eps, seq, handle):  # seq is only "written": the order it imposes is the point
        e = entry(handle)
        _check(f"purlin::fused_add_rmsnorm on rank {e.rank}", e, x, residual, weight, eps)
        coll = e.collective(_ops._capturing(x))  # a load: every rank takes part (and CPU tensors never capture)
        y = torch.empty_like(x)
        # contiguous (checked), so these views are the tensors' own memory
        coll(x.view(-1), y.view(-1), residual=residual.view(-1), weight=weight.view(-1), eps=float(eps))
        return y

    def fake(x, residual, weight, eps, seq, handle):
        e = entry(handle)
        _check(f"purlin::fused_add_rmsnorm on rank {e.rank}", e, x, residual, weight, eps, fake=True)
        return torch.empty_like(x)

    schema = "(Tensor x, Tensor(a!) residual, Tensor weight, float eps, Tensor(b!) seq, int handle) -> Tensor"
    _ops.require_unregistered(_NAME, "fused_add_rmsnorm_op")  # torch.library would replace another's silently
    _OP = torch.library.custom_op(f"purlin::{_NAME}", real, mutates_args=("residual", "seq"), schema=schema)
    _OP.register_fake(fake)
    # a collective: never dropped, whatever uses its results (as ops._keep_in_order marks mutating ops)
    torch.fx.node.has_side_effect(torch.ops.purlin.fused_add_rmsnorm.default)
    return _OP


def _as_float(eps) -> float:
    """eps a number before float() reads it: float() would take the string "1e-6", raises a bare
    TypeError for None and an OverflowError for an int past any float (a SymFloat is a number
    being traced).  The op's checks then say what of a float is refused (_check_eps)."""
    if isinstance(eps, (bool, str, bytes)) or not isinstance(eps, (numbers.Real, torch.SymFloat, torch.SymInt)):
        # _ops.fail: compiled too, by name (dynamo cannot build an ArgumentError)
        _ops.fail(f"fused_add_rmsnorm: eps={eps!r}, expected a number (a float, the RMSNorm epsilon)")
    try:
        return float(eps)
    except OverflowError:
        pass
    _ops.fail(f"fused_add_rmsnorm: eps={_shown(eps)}, expected a finite number >= 0 that float32 holds "
              f"(at most {_FLOAT32_MAX:.6g})")


def _shown(value) -> str:
    """A number for a message: an int of hundreds of digits cut short."""
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:12]}...{text[-4:]} ({len(text)} characters)"


class FusedAddRMSNorm:
    """``f(x, residual, weight, eps) -> y`` over a loaded collective with such an epilogue."""

    def __init__(self, coll, *, device=None):
        _ops.require_loaded("fused_add_rmsnorm_op", coll)
        spec = coll.spec if hasattr(coll, "spec") else coll.compiled.spec
        epilogue = spec.epilogue
        shape = tuple((o.name, o.kind, o.written) for o in epilogue.operands) if epilogue else None
        if shape != _SIGNATURE:
            have = ", ".join(o.format() for o in epilogue.operands) if epilogue else "no epilogue"
            raise ArgumentError(f"fused_add_rmsnorm: {spec.name} must have an epilogue taking rows residual "
                                f"(written), row weight and scalar eps; it has {have}")
        shaped = [r for r in range(spec.world_size) if len(spec.outputs[r]) != len(spec.inputs[r])]
        if shaped:  # y is x-shaped (empty_like(x)): a reduce-scatter's or a rooted reduce's out is not
            r = shaped[0]
            raise ArgumentError(f"fused_add_rmsnorm: {spec.name} must give every rank an output the size of its input "
                                f"(an all-reduce's shape); rank {r} has {len(spec.inputs[r])} input chunk(s) and "
                                f"{len(spec.outputs[r])} output chunk(s)",
                                notes=("load a collective with the epilogue on an all-reduce "
                                       "(examples/fused/allreduce_add_rmsnorm.pln), or call the loaded collective "
                                       "itself with its operands",))
        dev = _ops.torch_device("fused_add_rmsnorm_op", coll.comm.device if device is None else device)
        self.entry = Entry(spec.name, spec, coll.comm, dev, collective=coll)
        # the communicator's sequence tensor, shared with its other collectives (Group, op()):
        # the chain that keeps them all in program order
        self._seq = _ops.sequence(coll.comm, dev)
        self.op = _define()

    def __call__(self, x, residual, weight, eps: float):
        named = (("x", x), ("residual", residual), ("weight", weight))
        _ops.require_tensors("fused_add_rmsnorm", named)
        grad = torch.is_grad_enabled()
        for label, t in named:  # an inference op: no gradient, and residual is written in place
            _ops.require(not (grad and t.requires_grad),
                         f"fused_add_rmsnorm: {label} requires grad, and the op has no gradient (it writes residual "
                         "in place); call it under torch.no_grad() or torch.inference_mode(), or detach the tensors")
        return self.op(x, residual, weight, _as_float(eps), self._sequence(x), self.entry.handle)

    def _sequence(self, x):
        from torch._subclasses.fake_tensor import FakeTensor

        seq = self._seq
        if seq is None:  # a device this torch cannot reach (as Group's): a stand-in, so the checks still name it
            return torch.zeros(1, dtype=torch.int32, device=x.device)
        if isinstance(x, FakeTensor) and not isinstance(seq, FakeTensor):  # shape inference under a FakeTensorMode
            return x.fake_mode.from_tensor(seq)
        return seq

    def close(self) -> None:
        self.entry.close()


def fused_add_rmsnorm_op(coll, *, device=None) -> FusedAddRMSNorm:
    """Expose a loaded collective with an add + RMSNorm epilogue as ``purlin::fused_add_rmsnorm``."""
    return FusedAddRMSNorm(coll, device=device)
