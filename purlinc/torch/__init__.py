"""PyTorch integration: Purlin collectives as torch.library custom ops, and calls shaped like
torch.distributed.  ``import purlinc.torch`` (or ``purlin.torch``) imports torch;
``import purlinc`` never does.

    import purlinc, purlinc.torch as pt
    comm = purlinc.Communicator.from_torch()            # or from_env(): no torch.distributed
    pt.init(comm)                                       # the default group of the calls below
    pt.all_reduce(t, op="avg")                          # in place, like torch.distributed
    pt.all_gather_into_tensor(out, inp)
    y = pt.functional.all_reduce(t)                     # a new tensor (cheapest under torch.compile)

    shift = pt.op(purlinc.load("ring_shift.pln", comm), name="ring_shift")
    y = shift(x); shift(x, out=y)                       # torch.ops.purlin.ring_shift / ring_shift_out

``import purlinc.torch`` also registers the torch.distributed backend ``purlin``
(``dist.init_process_group("cuda:purlin,cpu:gloo")``, :mod:`purlinc.torch.backend`); ``group=``
takes any torch ProcessGroup (:mod:`purlinc.torch.groups`); the functional forms are
differentiable; :mod:`purlinc.torch.serving` has a serving stack's custom all-reduce.

Every call works eagerly, under ``torch.compile(fullgraph=True)`` (one custom op per call,
no graph break) and in CUDA graphs (after one warm-up call per dtype and op, which
``mode="reduce-overhead"`` makes by itself).  See docs/TORCH.md.
"""

from __future__ import annotations

try:
    import torch
except ModuleNotFoundError as error:  # the [torch] extra: the base install keeps torch out (several GB)
    if error.name != "torch":
        raise
    raise ModuleNotFoundError("purlinc.torch needs PyTorch: pip install 'purlinc[torch]' (or torch itself)",
                              name="torch") from None

from purlinc.runtime.errors import ArgumentError
from purlinc.torch import functional, ops
from purlinc.torch.distributed import Group, Work
from purlinc.torch.epilogue import FusedAddRMSNorm, fused_add_rmsnorm_op
from purlinc.torch.groups import default_group, group_of, init
from purlinc.torch.ops import define
from purlinc.torch.registry import Entry, entry
from purlinc.torch import sized  # registers torch.ops.purlin.alltoallv* (docs/TORCH.md)

if torch.distributed.is_available():  # the backend: dist.init_process_group("cuda:purlin,cpu:gloo")
    from purlinc.torch import backend

    backend.register()

__all__ = [
    "FusedAddRMSNorm", "Group", "TorchCollective", "Work", "all_gather", "all_gather_into_tensor", "all_reduce",
    "all_to_all", "all_to_all_single", "all_to_all_vdev", "barrier", "broadcast", "default_group", "define", "entry",
    "functional", "fused_add_rmsnorm_op", "gather", "group_of", "init", "op", "ops", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "sized",
]

_group = group_of


def all_reduce(tensor, op="sum", group=None, async_op=False):
    return _group(group).all_reduce(tensor, op=op, async_op=async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    return _group(group).all_gather_into_tensor(output_tensor, input_tensor, async_op=async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    return _group(group).all_gather(tensor_list, tensor, async_op=async_op)


def reduce_scatter_tensor(output, input, op="sum", group=None, async_op=False):
    return _group(group).reduce_scatter_tensor(output, input, op=op, async_op=async_op)


def reduce_scatter(output, input_list, op="sum", group=None, async_op=False):
    return _group(group).reduce_scatter(output, input_list, op=op, async_op=async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    return _group(group).all_to_all_single(output, input, output_split_sizes, input_split_sizes, async_op=async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    return _group(group).all_to_all(output_tensor_list, input_tensor_list, async_op=async_op)


def all_to_all_vdev(input, out, in_splits, out_splits, out_offsets=None, group=None, async_op=False):
    """Uneven all-to-all with split sizes on the GPU (see purlinc.torch.sized)."""
    return _group(group).all_to_all_vdev(input, out, in_splits, out_splits, out_offsets, async_op=async_op)


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    return _group(group).broadcast(tensor, src=src, async_op=async_op, group_src=group_src)


def reduce(tensor, dst=None, op="sum", group=None, async_op=False, group_dst=None):
    return _group(group).reduce(tensor, dst=dst, op=op, async_op=async_op, group_dst=group_dst)


def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
    return _group(group).gather(tensor, gather_list, dst=dst, async_op=async_op, group_dst=group_dst)


def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
    return _group(group).scatter(tensor, scatter_list, src=src, async_op=async_op, group_src=group_src)


def barrier(group=None, async_op=False):
    return _group(group).barrier(async_op=async_op)


class TorchCollective:
    """A loaded collective as custom ops: ``tc(x)`` (functional), ``tc(x, out=y)``,
    ``tc.inplace(t)``; the ops are ``torch.ops.purlin.<name>[_out|_inplace]``."""

    def __init__(self, coll, name: str | None = None, *, device=None):
        ops.require_loaded("purlinc.torch.op", coll)
        spec = coll.spec if hasattr(coll, "spec") else coll.compiled.spec
        name = spec.name if name is None else name
        _callable_as_ops(spec, name)
        comm = coll.comm
        dev = ops.torch_device("purlinc.torch.op", comm.device if device is None else device)
        self.ops = define(name, "op")  # first: a refused name leaves no entry behind
        self.collective = coll
        self.name = name
        self.entry = Entry(name, spec, comm, dev, collective=coll)
        self.handle = self.entry.handle
        self._seq = ops.sequence(comm, dev)  # compiled calls stay in program order (ops._keep_in_order)

    def __repr__(self) -> str:
        return f"TorchCollective(purlin::{self.name}, handle {self.handle}, rank {self.entry.rank})"

    def __call__(self, x, out=None, op="sum", *, count: int = -1):
        """This rank's output (1-D), or ``out`` filled.  ``x`` is an empty tensor on ranks that
        give no input (it says the dtype and device); ``count`` then says the chunk size."""
        if x is None:  # ops.fail: compiled too, by name (dynamo cannot build an ArgumentError)
            ops.fail(f"purlin::{self.name}: x is None; expected a tensor (an empty one on ranks without input: its "
                     f"dtype and device say what to allocate)")
        self._no_grad("x", x)
        op = self._op(op)
        if out is None:
            if ops.tracing():
                return self.ops.sequenced(x, ops.traced(self._seq, x), self.handle, op, count)
            return self.ops.eager_functional(x, self.handle, op, count)
        if ops.tracing():  # the ordered functional op, then a copy (see ops._keep_in_order)
            self._check_out(x, out, op)
            n = out.numel() // self.entry.out_units if self.entry.out_units else 0
            y = self.ops.sequenced(x, ops.traced(self._seq, x), self.handle, op, -1 if self.entry.in_units else n)
            if self.entry.out_units:
                out.copy_(y.view(out.shape))
        else:
            self.ops.eager_out(x, out, self.handle, op)
        return out

    def inplace(self, t, op="sum"):
        e = self.entry
        self._no_grad("t", t)
        op = self._op(op)
        if ops.tracing():  # what the eager in-place op checks of t (the functional op may not see t: x is empty
            where = self._where()  # on a rank without input)
            ops.check_tensor(where, "t", t, e, op, fake=True)
            ops._inplace_units(where, e, t)  # unequal sizes: a clear error
            x = t if e.in_units else t.new_empty(0)
            n = -1 if e.in_units else t.numel() // max(e.out_units, 1)
            y = self.ops.sequenced(x, ops.traced(self._seq, x), self.handle, op, n)
            if e.out_units:
                t.copy_(y.view(t.shape))
        else:
            self.ops.eager_inplace(t, self.handle, op)
        return t

    def _check_out(self, x, out, op) -> None:
        """What the eager out form checks of ``out`` (check_tensor, ops.check_out), for the traced
        call, whose functional op never sees it: a wrong size would fail in view(), unnamed,
        another dtype would be cast into silently, and a strided out written by copy_ where the
        eager call refuses it."""
        e = self.entry
        where = self._where()
        ops.require_tensors(where, [("x", x), ("out", out)])
        for label, t in (("x", x), ("out", out)):
            ops.check_tensor(where, label, t, e, op, fake=True)
        count = x.numel() // e.in_units if e.in_units else (out.numel() // e.out_units if e.out_units else 0)
        ops.check_out(where, e, x, out, count)

    def _where(self) -> str:
        return f"purlin::{self.name} on rank {ops.shown(self.entry.rank)}"  # dynamic=True reads rank as a symbol

    def _op(self, op) -> str:
        """``op`` as the ops' schema takes it, a name (ops.normalize_op), as the Group calls pass
        it: a torch.distributed.ReduceOp passed through ran eagerly (the op bodies normalize it)
        but not traced, where the dispatcher refuses it for the schema's ``str op``."""
        return ops.normalize_op(op, self._where())

    def _no_grad(self, label: str, t) -> None:
        """These ops have no gradient (eagerly they skip the dispatcher, so one would not flow,
        silently; compiled, the graph had no formula): refused with grad on, by name."""
        if isinstance(t, torch.Tensor):
            ops.require(not (torch.is_grad_enabled() and t.requires_grad),
                        f"purlin::{self.name}: {label} requires grad, and pt.op(...) objects have no gradient; use "
                        "purlinc.torch.functional (differentiable), or call under torch.no_grad() or detach it")

    def close(self) -> None:
        self.entry.close()


def _callable_as_ops(spec, name: str) -> None:
    """The ops call ``coll(x, out, op=...)``: a collective whose call takes more is refused when
    the object is made, not at its first call (after the others have loaded theirs)."""
    if spec.sizes is not None:  # its call is coll(x, sizes, out, out_sizes): out would arrive as its sizes
        raise ArgumentError(f"purlin::{name}: {spec.name} has run-time sizes ({spec.sizes.format()}); expected a "
                            "collective of fixed sizes",
                            notes=("an all-to-all with run-time sizes: purlinc.torch.all_to_all_vdev, or "
                                   "all_to_all_single with split sizes",))
    epilogue = getattr(spec, "epilogue", None)
    if epilogue is not None:  # its call needs the epilogue's operands, which these ops have no place for
        operands = ", ".join(o.format() for o in epilogue.operands)
        raise ArgumentError(f"purlin::{name}: {spec.name} has an epilogue (taking {operands}); expected a collective "
                            "without one (these ops pass only x, out and op)",
                            notes=("an all-reduce with the add + RMSNorm epilogue: "
                                   "purlinc.torch.fused_add_rmsnorm_op",))


def op(coll, name: str | None = None, *, device=None) -> TorchCollective:
    """Expose a loaded collective (``purlinc.load(...)``, one rank's) as torch custom ops."""
    return TorchCollective(coll, name, device=device)
