"""Functional forms (a new tensor out, nothing mutated): what a compiled graph handles best,
like torch.distributed's functional collectives.  Chunks are slices along dim 0."""

from __future__ import annotations

import torch

from purlinc.runtime.errors import ArgumentError
from purlinc.torch import ops as _ops


def _group(group):
    from purlinc.torch import group_of

    return group_of(group)


def _call(group, kind: str, x, op: str):
    handle = group._handle(kind)
    if torch.compiler.is_compiling():
        return getattr(torch.ops.purlin, kind + "_seq")(x, group._seq, handle, op, -1)  # ordered: ops.sequence
    return _ops.define(kind).eager_functional(x, handle, op, -1)


def all_reduce(x, op="sum", group=None):
    """The reduction of every rank's ``x``, shaped like ``x``."""
    group = _group(group)
    op = _ops.normalize_op(op, "all_reduce")
    n, R = x.numel(), group.world_size
    if n % R:  # the spec splits x into R chunks: pad to a multiple of R (torch takes any size)
        padded = torch.cat([x.reshape(-1), x.new_zeros(R - n % R)])
        return _call(group, "allreduce", padded, op)[:n].view(x.shape)
    return _call(group, "allreduce", x, op).view(x.shape)


def all_gather_tensor(x, gather_dim: int = 0, group=None):
    """Every rank's ``x`` concatenated along dim 0: shape ``(R * x.shape[0], *x.shape[1:])``."""
    group = _group(group)
    if gather_dim != 0:
        raise ArgumentError(f"all_gather_tensor: gather_dim={gather_dim}, expected 0 (transpose around the call)")
    y = _call(group, "allgather", x, "sum")
    return y.view(group.world_size * x.shape[0], *x.shape[1:]) if x.dim() else y


def reduce_scatter_tensor(x, op="sum", scatter_dim: int = 0, group=None):
    """Rank r's slice (of R along dim 0) of the reduction of every rank's ``x``."""
    group = _group(group)
    if scatter_dim != 0:
        raise ArgumentError(f"reduce_scatter_tensor: scatter_dim={scatter_dim}, expected 0")
    if x.dim() == 0 or x.shape[0] % group.world_size:
        raise ArgumentError(f"reduce_scatter_tensor: x has shape {tuple(x.shape)}, expected dim 0 a multiple of "
                            f"{group.world_size} (the world size)")
    y = _call(group, "reduce_scatter", x, _ops.normalize_op(op, "reduce_scatter_tensor"))
    return y.view(x.shape[0] // group.world_size, *x.shape[1:])


def all_to_all_single(x, group=None):
    """Slice j (of R along dim 0) of ``x`` goes to rank j; the result holds slice r of every rank."""
    group = _group(group)
    if x.dim() == 0 or x.shape[0] % group.world_size:
        raise ArgumentError(f"all_to_all_single: x has shape {tuple(x.shape)}, expected dim 0 a multiple of "
                            f"{group.world_size} (the world size)")
    return _call(group, "alltoall", x, "sum").view(x.shape)
