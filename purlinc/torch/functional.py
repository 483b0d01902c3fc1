"""Functional forms (a new tensor out, nothing mutated): what a compiled graph handles best,
like torch.distributed's functional collectives.  Chunks are slices along dim 0.

They are differentiable, as ``torch.distributed.nn.functional`` defines it: the gradient of an
all-reduce is the all-reduce (same op: sum or avg) of the output's gradient; all-gather and
reduce-scatter are each other's backward; an all-to-all's backward is the all-to-all back (with
the split sizes swapped).  Eagerly and under ``torch.compile`` (an ``autograd.Function`` whose
forward and backward are the ordered custom ops, so compiled backward graphs keep every rank's
collectives in program order too).  max, min and prod reductions have no gradient here: their
backward raises, naming the op.
"""

from __future__ import annotations

import torch

from purlinc.runtime.errors import ArgumentError
from purlinc.torch import ops as _ops
from purlinc.torch.groups import group_of


def _group(group):
    return group_of(group)


_COPIES = ("allgather", "alltoall")  # the functional forms' collectives that move bytes, reducing nothing


def _run(kind: str, x, seq, handle: int, op: str, where: str | None = None):
    """One collective's functional op: the ordered one while traced (ops.sequence), the op body
    eagerly.  A copy of a dtype Purlin lacks travels as a view of its bytes (ops.carrier), as
    the Group calls carry it, and comes back in x's dtype; ``where`` names the caller's call in
    a refusal (None in a backward: the op's own name)."""
    c = _ops.carrier(where or f"purlin::{kind}", "x", x, reduce=False) if kind in _COPIES else x
    if _ops.tracing():  # torch.compile, FakeTensorMode or make_fx: record the op, launch nothing
        if seq is None:  # in a backward: the communicator's sequence tensor, found from the handle
            e = _ops.entry(handle)
            seq = _ops.traced(_ops.sequence(e.comm, e.device), c)
        y = getattr(torch.ops.purlin, kind + "_seq")(c, seq, handle, op, -1)
    else:
        y = _ops.define(kind).eager_functional(c, handle, op, -1)
    return y if c is x else y.view(x.dtype)


class _Collective(torch.autograd.Function):
    """y = collective ``kind`` of x; dx = its inverse collective of dy (ops.differentiate)."""

    @staticmethod
    def forward(ctx, x, kind, inverse_kind, handle, inverse, op, world_size, where=None):
        # the sequence tensor is not an argument: the backward finds it from the handle (a tensor
        # kept on ctx and mutated in the backward trips the compiled graph's partitioner)
        ctx.args = kind, inverse_kind, handle, inverse, op, world_size
        ctx.shape = x.shape
        return _run(kind, x, None, handle, op, where)

    @staticmethod
    def backward(ctx, grad):
        kind, inverse_kind, handle, inverse, op, world_size = ctx.args

        def collective(g, inverse_op):
            g = g.contiguous()
            if torch.is_grad_enabled() and g.requires_grad:
                # create_graph=True: the backward is differentiated too (its derivative is this
                # collective again); the bare op body left dx with no history, so a second
                # derivative came out zero, silently
                return _Collective.apply(g, inverse_kind, kind, inverse, handle, inverse_op, world_size)
            return _run(inverse_kind, g, None, inverse, inverse_op)
        dx = _ops.differentiate(kind, op, world_size, grad, collective)
        return dx.reshape(ctx.shape), None, None, None, None, None, None, None


def _call(group, kind: str, x, op: str, where: str):
    handle = group._handle(kind)
    if torch.is_grad_enabled() and x.requires_grad:
        inverse_kind = _ops.INVERSES[kind]
        return _Collective.apply(x, kind, inverse_kind, handle, group._handle(inverse_kind), op, group.world_size,
                                 where)
    return _run(kind, x, group._seq(x), handle, op, where)


def all_reduce(x, op="sum", group=None):
    """The reduction of every rank's ``x``, shaped like ``x``."""
    _ops.require_tensors("all_reduce", [("x", x)])
    group = _group(group)
    op = _ops.normalize_op(op, "all_reduce")
    n, R = x.numel(), group.world_size
    if n % R or not torch.compiler.is_compiling():
        # the padded copy would hide x's strides: refused before padding, with the message the
        # unpadded path gives eagerly (compiled, the op's fake implementation refuses those)
        _ops.check_contiguous("all_reduce", "x", x)
    if n % R:  # the spec splits x into R chunks: pad to a multiple of R (torch takes any size)
        padded = torch.cat([x.reshape(-1), x.new_zeros(R - n % R)])
        return _call(group, "allreduce", padded, op, "all_reduce")[:n].view(x.shape)
    return _call(group, "allreduce", x, op, "all_reduce").view(x.shape)


def all_gather_tensor(x, gather_dim: int = 0, group=None):
    """Every rank's ``x`` concatenated along dim 0: shape ``(R * x.shape[0], *x.shape[1:])``."""
    _ops.require_tensors("all_gather_tensor", [("x", x)])
    group = _group(group)
    if gather_dim != 0:  # fail, not raise: these forms are what compiled code calls (see ops.fail)
        _ops.fail(f"all_gather_tensor: gather_dim={_ops.value_shown(gather_dim)}, expected 0 (transpose around the "
                  "call)")
    y = _call(group, "allgather", x, "sum", "all_gather_tensor")
    return y.view(group.world_size * x.shape[0], *x.shape[1:]) if x.dim() else y


def reduce_scatter_tensor(x, op="sum", scatter_dim: int = 0, group=None):
    """Rank r's slice (of R along dim 0) of the reduction of every rank's ``x``."""
    _ops.require_tensors("reduce_scatter_tensor", [("x", x)])
    group = _group(group)
    if scatter_dim != 0:
        _ops.fail(f"reduce_scatter_tensor: scatter_dim={_ops.value_shown(scatter_dim)}, expected 0")
    _rows_divide("reduce_scatter_tensor", x, group.world_size)
    y = _call(group, "reduce_scatter", x, _ops.normalize_op(op, "reduce_scatter_tensor"), "reduce_scatter_tensor")
    return y.view(x.shape[0] // group.world_size, *x.shape[1:])


def all_to_all_single(x, output_split_sizes=None, input_split_sizes=None, group=None):
    """Slice j (along dim 0) of ``x`` goes to rank j; the result holds every rank's slice for this
    rank, in rank order.  Without split sizes the slices are equal (R of them); with them (rows
    per rank, as torch's), ``output_split_sizes`` may be left out: the ranks then tell each other."""
    _ops.require_tensors("all_to_all_single", [("x", x)])
    group = _group(group)
    if output_split_sizes is None and input_split_sizes is None:
        _rows_divide("all_to_all_single", x, group.world_size)
        return _call(group, "alltoall", x, "sum", "all_to_all_single").view(x.shape)
    return _Uneven.apply(x, group, output_split_sizes, input_split_sizes)


def _rows_divide(where: str, x, world_size: int) -> None:
    """x's dim 0 splits into one equal slice per rank.  ``ops.fail`` with sizes as plain ints
    (``ops.shape_shown``): compiled with fullgraph=True a raised ArgumentError reached the caller
    as dynamo's "Attempted to call a super() attribute", without the reason."""
    if x.dim() == 0 or x.shape[0] % world_size:
        _ops.fail(f"{where}: x has shape {_ops.shape_shown(x)}, expected dim 0 a multiple of "
                  f"{_ops.shown(world_size)} (the world size)")


class _Uneven(torch.autograd.Function):
    """The all-to-all with split sizes (eager: the sizes are agreed on the host); backward sends
    the gradient back with the sizes swapped."""

    @staticmethod
    def forward(ctx, x, group, output_split_sizes, input_split_sizes):
        ins, outs = _uneven_sizes(group, x, output_split_sizes, input_split_sizes)
        y = x.new_empty(sum(outs), *x.shape[1:])
        group.all_to_all_single(y, x.contiguous(), outs, ins)
        ctx.group, ctx.sizes = group, (outs, ins)
        return y

    @staticmethod
    def backward(ctx, grad):
        outs, ins = ctx.sizes
        if torch.is_grad_enabled() and grad.requires_grad:  # create_graph=True: differentiable, as _Collective's
            return _Uneven.apply(grad, ctx.group, ins, outs), None, None, None
        dx = grad.new_empty(sum(ins), *grad.shape[1:])
        ctx.group.all_to_all_single(dx, grad.contiguous(), ins, outs)
        return dx, None, None, None


def _uneven_sizes(group, x, output_split_sizes, input_split_sizes):
    """Both split lists of the functional form, this rank's checked on the host before the
    ranks exchange anything (an exchange is a collective: a rank must be refused for its own
    list, not a peer for what it sent, nor the exchange reach a device x is not on); without
    ``output_split_sizes`` the receivers learn theirs from the senders."""
    from purlinc.torch import sized
    from purlinc.torch.distributed import _rows_carrier

    where = "all_to_all_single"
    group._require_open(where)
    group._refuse_traced_lists(where, "split size lists")
    _ops.check_device(where, "x", x, group.device, group.rank, group.world_size)
    R = group.world_size
    ins = sized.host_splits(where, "input_split_sizes", input_split_sizes, "x", x, R)
    state = sized.state_of(group)
    row = sized._row_elements(where, _rows_carrier(where, "x", x.contiguous()), "x")  # the elements the kernel moves
    sized.check_capacity(where, state, "input_split_sizes", ins, row, sending=True)
    outs = None if output_split_sizes is None else _ops.split_sizes(where, "output_split_sizes", output_split_sizes, R)
    if outs:  # the result is made of their sum: all_to_all_single checks them against it, not their signs
        if len(outs) != R or min(outs) < 0:
            raise ArgumentError(f"{where}: output_split_sizes={outs}, expected {R} sizes >= 0 (rows from each rank)")
        return ins, outs
    table = group._split_table(ins)
    return ins, [table[j][group.rank] for j in range(R)]
