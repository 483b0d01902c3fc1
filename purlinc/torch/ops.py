"""The torch.library custom ops: four per collective name, all taking a handle
(:mod:`purlinc.torch.registry`) in place of the collective.

    purlin::NAME(Tensor x, int handle, str op, SymInt count) -> Tensor         functional
    purlin::NAME_out(Tensor x, Tensor(a!) out, int handle, str op) -> ()       writes out
    purlin::NAME_inplace(Tensor(a!) t, int handle, str op) -> ()               t is input and output
    purlin::NAME_seq(Tensor x, Tensor(a!) seq, int handle, str op, SymInt count) -> Tensor
        the functional op, kept in program order by a sequence tensor (see _keep_in_order)

``x`` is this rank's input (an empty tensor on ranks that give none: it still carries the
dtype and device); the functional form returns this rank's output, 1-D, and takes ``count``
(elements per chunk) only where x cannot say it (``-1`` otherwise).  ``op`` is a reduction
(``sum``, ``prod``, ``max``, ``min``, or ``avg``: the sum divided by the world size, float16
inputs scaled first (``run``), for floating dtypes) and is ignored by copies.  Any contiguous shape is accepted: a collective
sees a tensor as its elements in order, so "chunk i" of a tensor is its i-th slice along
dim 0 when dim 0 splits evenly, which is how torch.distributed concatenates.

The fake implementations compute shapes from the handle's entry (no GPU, no load); the real
ones launch on the caller's current stream.  Both check their arguments and fail with an
:class:`~purlinc.runtime.errors.ArgumentError` naming the tensor, the expected and the actual.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import NamedTuple, NoReturn

import torch

from purlinc.dtypes import DType, ReduceOp
from purlinc.frontend.standard import SOURCES
from purlinc.runtime.errors import ArgumentError
from purlinc.runtime.validate import integer
from purlinc.torch.registry import Entry, entry

NAMESPACE = "purlin"
REDUCE_OPS = ("sum", "avg", "prod", "max", "min")
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
# The collective whose call is each one's derivative (torch.distributed.nn.functional's pairs): an
# all-reduce's gradient is all-reduced, all-gather and reduce-scatter are each other's, an equal
# all-to-all is its own inverse.  A Group links each entry to its inverse's handle (Entry.inverse).
INVERSES = {"allreduce": "allreduce", "allgather": "reduce_scatter", "reduce_scatter": "allgather",
            "alltoall": "alltoall"}
_DEFINED: dict[str, "Ops"] = {}
_DEFINING = threading.Lock()  # define() registers each name once, whatever the threads
ORDERED = True  # False if this torch could not register the functional ops as ordered effects


class Ops(NamedTuple):
    """One name's ops (what graphs call) and their Python bodies (what eager calls run, without
    the dispatcher's cost)."""

    functional: object
    out: object
    inplace: object
    sequenced: object
    eager_functional: Callable
    eager_out: Callable
    eager_inplace: Callable


# ---------------------------------------------------------------------------------------------
# checks shared by the fake and real implementations and the torch.distributed-shaped calls


def dtype_of(t) -> DType | None:
    from purlinc.runtime.interop import _torch_dtype_map

    return _torch_dtype_map().get(t.dtype)


# torch.distributed.ReduceOp members Purlin does not take, and why (a clear refusal, not "unknown op")
_REFUSED_OPS = {
    "band": "bitwise reductions are not Purlin reductions", "bor": "bitwise reductions are not Purlin reductions",
    "bxor": "bitwise reductions are not Purlin reductions",
    "premul_sum": "scale the tensor first (t.mul_(factor)), then reduce with op='sum'",
}


def normalize_op(op, where: str) -> str:
    """``op`` as a lower-case name: strings, ``torch.distributed.ReduceOp`` members (``SUM``,
    ``AVG``, ``PRODUCT``, ``MIN``, ``MAX``) and ReduceOp objects, Purlin's ReduceOp."""
    # A number is no op (refused below), read as a plain one: dynamo cannot trace getattr of a
    # number that automatic dynamic made a symbol, nor format one (see value_shown).
    if type(op) in (int, float) or isinstance(op, (torch.SymInt, torch.SymFloat)):
        name = value_shown(op)
    else:
        inner = getattr(op, "op", None)  # a torch.distributed.ReduceOp object (what a backend's options carry)
        if inner is not None and not isinstance(op, str):
            op = inner
        name = getattr(op, "name", None) or getattr(op, "value", None) or op
        name = str(name).lower().removeprefix("redoptype.").removeprefix("reduceop.")
    name = "prod" if name == "product" else name
    # fail(), not raise: these run in the Python calls while dynamo traces them too
    if name in _REFUSED_OPS:
        fail(f"{where}: op={name.upper()} is not supported; expected one of {', '.join(REDUCE_OPS)}",
             notes=(_REFUSED_OPS[name],))
    if name not in REDUCE_OPS:
        fail(f"{where}: op={value_shown(op)} is not supported; expected one of {', '.join(REDUCE_OPS)}")
    return name


def _names(records) -> str:
    return ", ".join(r.name for r in records)


def supported_dtypes(*, reducible: bool = False) -> str:
    """The dtype registry's names (those this torch has), for messages."""
    from purlinc.dtypes import DTYPES

    return _names(r for r in DTYPES.records() if (r.reducible or not reducible) and hasattr(torch, r.torch_name))


def carrier(where: str, label: str, t, *, reduce: bool):
    """``t`` itself when Purlin has its dtype; for a copy, a flat view of its bytes as the widest
    registered dtype whose size divides its element size (int64 as int32 pairs, bool as bytes,
    complex64 as int32 pairs): a copy moves bytes, so any fixed-size dtype travels.  Reductions
    need the dtype itself."""
    if dtype_of(t) is not None or not isinstance(t, torch.Tensor):
        return t
    name = str(t.dtype).removeprefix("torch.")
    if reduce:
        fail(f"{where}: {label} has dtype {name}, which Purlin cannot reduce; expected one of "
             f"{supported_dtypes(reducible=True)}",
             notes=("copy collectives (all_gather, all_to_all, broadcast, gather, scatter) take every "
                    "fixed-size dtype",))
    check_contiguous(where, label, t)
    width = _carrier_width(t.element_size())
    if width is None:
        fail(f"{where}: {label} has dtype {name} ({t.element_size()} bytes), which no Purlin dtype divides; expected "
             f"one of {supported_dtypes()}")
    return t.reshape(-1).view(width)


def _carrier_width(itemsize: int):
    """The torch dtype a copy of ``itemsize``-byte elements travels as, or None.  A plain loop,
    not ``max(..., key=...)``: dynamo cannot trace a key function, and this runs inside compiled
    copies of dtypes Purlin lacks (a graph break there breaks fullgraph=True)."""
    from purlinc.dtypes import DTYPES

    best = None
    for r in DTYPES.records():
        if itemsize % r.itemsize or not hasattr(torch, r.torch_name):
            continue
        # the widest; at equal widths integers first (no float semantics to doubt); first of ties kept
        if best is None or (r.itemsize, not r.is_float) > (best.itemsize, not best.is_float):
            best = r
    return None if best is None else getattr(torch, best.torch_name)


def require_tensors(where: str, named) -> None:
    """Each ``(label, value)`` a torch.Tensor: checked before anything reads a tensor attribute,
    so a list or a NumPy array is an ArgumentError, not an AttributeError from deep inside
    (compiled, :func:`fail`'s RuntimeError with the same text)."""
    for label, t in named:
        if not isinstance(t, torch.Tensor):
            fail(f"{where}: {label} must be a torch.Tensor, got {type(t).__name__}")
        _require_dense(where, label, t)


def _require_dense(where: str, label: str, t) -> None:
    """A dense tensor, whose memory is its values: a quantized tensor's bytes lack its scale and
    zero point (carried as bytes, its view crashed torch), a sparse one's are an index."""
    if t.is_quantized:
        fail(f"{where}: {label} is a quantized tensor ({str(t.dtype).removeprefix('torch.')}); expected a dense "
             "tensor of plain values", notes=("pass t.int_repr() (its integers) and carry the scale apart, or "
                                              "t.dequantize()",))
    if t.layout != torch.strided:
        fail(f"{where}: {label} has layout {str(t.layout).removeprefix('torch.')}; expected a dense (strided) tensor",
             notes=("pass t.to_dense()",))


def torch_device(where: str, device) -> "torch.device":
    """``device=`` as a torch.device: an int is a CUDA ordinal; torch's own refusal of a bad
    string ("Invalid device string") named by the argument."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", device)
    if isinstance(device, str):
        try:
            return torch.device(device)
        except RuntimeError:
            pass
    raise ArgumentError(f"{where}: device={device!r}, expected a torch.device, a device string such as 'cuda:0', "
                        "or a CUDA ordinal")


def require_communicator(where: str, comm) -> None:
    """``comm`` what a Group stands on: a Purlin communicator (rank, world size, device)."""
    if not all(hasattr(comm, attr) for attr in ("rank", "world_size", "device")):
        raise ArgumentError(f"{where}: comm must be a Purlin communicator (purlinc.Communicator.from_env(), "
                            f"from_store(...)), got {type(comm).__name__}")


def require_loaded(where: str, coll) -> None:
    """``coll`` one rank's loaded collective (``purlinc.load(...)`` on a Communicator): a LocalGroup's
    takes a list per call, which these ops cannot pass, and a path or text is not loaded yet."""
    if isinstance(coll, (str, bytes)) or hasattr(coll, "__fspath__"):
        raise ArgumentError(f"{where}: expected a loaded collective, got {type(coll).__name__} {coll!r}",
                            notes=("load it first: purlinc.load(path, comm)",))
    if hasattr(coll, "ranks") and hasattr(coll, "__getitem__"):  # GroupCollective, TunedGroup
        raise ArgumentError(f"{where}: expected one rank's collective, got a LocalGroup's ({type(coll).__name__}), "
                            "whose calls take a list of tensors", notes=("pass one rank's: coll[rank]",))
    if not hasattr(coll, "comm") or not (hasattr(coll, "spec") or hasattr(coll, "compiled")):
        raise ArgumentError(f"{where}: expected a loaded collective (purlinc.load(path, comm)), "
                            f"got {type(coll).__name__}")


def require_list(where: str, label: str, value) -> None:
    """``value`` a list or tuple (of tensors, checked apart): ``5`` gave len()'s TypeError."""
    if not isinstance(value, (list, tuple)):
        fail(f"{where}: {label} must be a list of tensors, got {type(value).__name__}")


def may_be_integer(value) -> bool:
    """Whether ``integer(value)`` may succeed, told by type alone (a tensor's dtype and shape it
    checks itself): what a trace asks first, so that it never meets integer()'s TypeError,
    which dynamo before torch 2.13 raised as an InternalTorchDynamoError that no except clause
    catches (operator.index(1.5)), nor calls integer() on a symbolic float, which it cannot trace."""
    return isinstance(value, torch.Tensor) or (hasattr(type(value), "__index__") and not isinstance(value, bool))


def split_sizes(where: str, label: str, sizes, world_size: int) -> list[int]:
    """Split sizes (a list, a tuple or a 1-D tensor) as Python ints, each an integer of any
    type but a bool (``validate.integer``): ``int()`` cut 1.5 to 1 and read "2" as 2, so sizes
    that were never row counts passed wherever the cut ones summed right."""
    def refuse() -> NoReturn:
        fail(f"{where}: {label}={value_shown(sizes)}, expected a list of {shown(world_size)} integers (rows of dim 0 "
             "per rank)")
    # Traced, the types first (see may_be_integer)
    if torch.compiler.is_compiling() and not (isinstance(sizes, (list, tuple, torch.Tensor))
                                              and all(may_be_integer(s) for s in sizes)):
        refuse()
    try:
        return [integer(s) for s in sizes]
    except TypeError:
        pass
    refuse()


def check_contiguous(where: str, label: str, t) -> None:
    """``t``'s memory holds its values, in order: contiguous, and no lazy conjugate or negative
    bit (the kernels read and write memory, where such a view keeps the values un-negated)."""
    if not t.is_contiguous():  # (the sizes as plain ints: dynamo cannot format symbolic ones, see shown)
        fail(f"{where}: {label} is not contiguous (shape {shape_shown(t)}, strides {ints_shown(t.stride())})",
             notes=("pass .contiguous() (a copy)",))
    if torch.compiler.is_compiling():  # dynamo cannot trace is_conj/is_neg (a graph break): the real ops check at run time
        return
    for kind, lazy, resolve in _lazy_bits(t):
        if lazy:
            raise ArgumentError(f"{where}: {label} is a lazy {kind} view (torch's {kind} bit): its memory holds "
                                f"other values than it reads as; expected a resolved tensor",
                                notes=(f"pass .{resolve}() (a copy)",))


def _lazy_bits(t):
    """(kind, set, how to resolve) of ``t``'s lazy conjugate and negative bits."""
    return (("conjugate", t.is_conj(), "resolve_conj"), ("negative", t.is_neg(), "resolve_neg"))


def is_lazy_view(t) -> bool:
    """Whether ``t`` is a lazy conjugate or negative view, as :func:`check_contiguous` refuses;
    False under torch.compile, where dynamo cannot trace is_conj/is_neg (a graph break under
    fullgraph=True) and the real ops check at run time."""
    if torch.compiler.is_compiling():
        return False
    return any(lazy for _, lazy, _ in _lazy_bits(t))


def check_device(where: str, label: str, t, device, rank: int, world_size: int, *, fake: bool = False) -> None:
    """``t`` on ``device``.  Only a fake implementation lets a meta tensor pass (shape inference,
    nothing runs); a real one refuses it like any other device, before anything is launched."""
    if t.device == device or (fake and t.device.type == "meta"):
        return
    fail(f"{where}: {label} is on {t.device}, expected {device} (the device of this Purlin communicator, "
         f"rank {shown(rank)} of {shown(world_size)})",
         notes=("a tensor of another device or communicator cannot take part in this one's collectives",))


def same_device(where: str, named) -> None:
    """The tensors of one call (``(label, tensor)`` pairs, the first the reference) on one device.
    Each tensor's own check lets a meta tensor pass where a fake implementation checks it (shape
    inference), so a meta x with a CPU out reached the fake alone (the dispatcher picks it for
    any meta argument) and the call returned with out unwritten, silently."""
    (first, reference), *rest = named
    for label, t in rest:
        if t.device != reference.device:
            fail(f"{where}: {label} is on {t.device}, expected {reference.device} (the device of {first})",
                 notes=("the tensors of one call live on one device: meta tensors (shape inference) with meta "
                        "tensors only",))


def overlap(a, b, *, fake: bool) -> bool:
    """Whether two contiguous tensors share bytes: their byte ranges in memory, or, for fake
    tensors (no data pointer), in one storage."""
    if not a.numel() or not b.numel():
        return False
    if fake:
        if a.untyped_storage()._cdata != b.untyped_storage()._cdata:
            return False
        a0, b0 = a.storage_offset() * a.element_size(), b.storage_offset() * b.element_size()
    else:
        a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def check_tensor(where: str, label: str, t, e: Entry, op: str | None = None, *, fake: bool = False) -> None:
    """Type, device, dtype and contiguity of one tensor for entry ``e``; ``fake``: called by a
    fake implementation (meta tensors pass the device check)."""
    require_tensors(where, [(label, t)])
    check_device(where, label, t, e.device, e.rank, e.world_size, fake=fake)
    dtype = dtype_of(t)
    if dtype is None and e.is_reduce:  # no carrier for a reduction: the message lists what Purlin reduces
        carrier(where, label, t, reduce=True)
    if dtype is None:
        fail(f"{where}: {label} has dtype {str(t.dtype).removeprefix('torch.')}, which Purlin does not support; "
             f"expected one of {supported_dtypes()} (the torch.distributed-shaped calls carry other fixed-size "
             f"dtypes' bytes in copies)")
    if e.is_reduce and t.numel():
        if not dtype.reducible:
            fail(f"{where}: {label} has dtype {dtype.value}, which cannot be reduced; expected one of "
                 f"{supported_dtypes(reducible=True)}")
        if op == "avg" and not dtype.is_float:
            fail(f"{where}: op='avg' needs a floating dtype, {label} has {dtype.value}",
                 notes=("use op='sum' and divide (integer averages would truncate)",))
    check_contiguous(where, label, t)


_MAX_BYTES = 2**63 - 1  # the most bytes one torch storage holds (its size is an int64)


def count_of(where: str, e: Entry, x, out=None, count: int = -1, names=("x", "out")):
    """Elements per chunk: from x (ranks with input), else from out, else the ``count`` argument.
    A ``count`` given where x says the count must agree with it (-1: not given).  Sizes in the
    messages through :func:`shown`: traced with dynamic shapes they are symbols, which printed
    as "s77" and "(s77//3)" (the fakes raise these; the caller knows its sizes, not symbols)."""
    count = _count_argument(where, count)
    if e.in_units:
        n = x.numel()
        if n % e.in_units:
            raise ArgumentError(f"{where}: {names[0]} has {shown(n)} elements, expected a multiple of {e.in_units} "
                                f"(rank {e.rank} gives {e.in_units} chunks)")
        if count != -1 and count != n // e.in_units:
            raise ArgumentError(f"{where}: count={shown(count)}, expected -1 or {shown(n // e.in_units)} (what "
                                f"{names[0]} says: {shown(n)} elements in {e.in_units} chunks)")
        _check_output_bytes(where, e, x, n // e.in_units)  # an all-gather of a huge x: more than a tensor holds
        return n // e.in_units
    if x is not None and x.numel():
        raise ArgumentError(f"{where}: rank {e.rank} gives no input, but {names[0]} has {shown(x.numel())} elements; "
                            f"expected an empty tensor")
    if out is not None and e.out_units:
        n = out.numel()
        if n % e.out_units:
            raise ArgumentError(f"{where}: {names[1]} has {shown(n)} elements, expected a multiple of {e.out_units} "
                                f"(rank {e.rank} receives {e.out_units} chunks)")
        return n // e.out_units
    if count < 0:
        raise ArgumentError(f"{where}: rank {e.rank} gives no input, so count (elements per chunk) is needed; "
                            f"got {shown(count)}")
    _check_output_bytes(where, e, x, count)
    return count


def _count_argument(where: str, count):
    """``count`` as an int (-1 for None) or a traced SymInt.  Eager calls skip the dispatcher,
    whose schema would check it: 3.0 would reach new_empty (torch's TypeError) and '3' be
    refused as "count=3, expected -1 or 3"."""
    if count is None:
        return -1
    if isinstance(count, (int, torch.SymInt)) and not isinstance(count, bool):
        return count
    try:
        return integer(count)
    except TypeError:
        raise ArgumentError(f"{where}: count={count!r}, expected an int (elements per chunk) or -1") from None


def _check_output_bytes(where: str, e: Entry, x, count) -> None:
    """A count no tensor can hold is the caller's mistake, said as such (torch would raise a
    storage overflow allocating the output).  Only a plain int: a traced count is a size."""
    itemsize = x.element_size() if x is not None else 1
    if isinstance(count, int) and e.out_units * count * itemsize > _MAX_BYTES:
        raise ArgumentError(f"{where}: count={count} elements per chunk is too large: rank {e.rank} receives "
                            f"{e.out_units} chunks of {itemsize}-byte elements, expected at most {_MAX_BYTES} "
                            f"bytes in all (what one tensor holds)")


def check_out(where: str, e: Entry, x, out, count, names=("x", "out")) -> None:
    """``out`` holds this rank's chunks of ``count`` elements, in x's dtype: eagerly and traced
    alike (``require``; the sizes may be symbols, so the messages are functions of ``shown``)."""
    same_device(where, ((names[0], x), (names[1], out)))
    expected = e.out_units * count
    require(out.numel() == expected,
            lambda: f"{where}: {names[1]} has {shown(out.numel())} elements, expected {shown(expected)} "
                    f"({shown(e.out_units)} chunks x {shown(count)} elements per chunk)")
    if e.in_units:
        require(out.dtype == x.dtype, lambda: f"{where}: {names[1]} has dtype {str(out.dtype).removeprefix('torch.')}, "
                                              f"expected {str(x.dtype).removeprefix('torch.')} (the dtype of {names[0]})")


# ---------------------------------------------------------------------------------------------
# the real call


def _capturing(t) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _variant(coll, count: int, itemsize: int):
    """The loaded Collective a call of this size runs (a Tuned picks one per size bucket)."""
    pick = getattr(coll, "variant_for", None)
    return pick(count, itemsize) if pick is not None else coll


def is_warm(e: Entry, coll, dtype: DType, op: ReduceOp | None, count: int) -> bool:
    """Whether calling ``coll`` with (dtype, op) and this count launches without compiling,
    loading or agreeing on anything (what a graph capture needs)."""
    probe = getattr(coll, "is_warm", None)
    if probe is not None:
        return probe(dtype, op, count)
    variant = _variant(coll, count, dtype.itemsize)
    if getattr(variant, "_ce", None) is not None:  # host-driven copy engines: warm once run outside a capture
        return id(variant) in e.warmed
    return (dtype, op) in variant._variants


def run(e: Entry, x, out, op: str, *, count: int | None = None, like=None) -> None:
    """Launch entry ``e`` on (x, out) on the current stream; ``None`` for a side a rank lacks.
    A rank without chunks passes neither: ``count`` and ``like`` (a tensor of the call's dtype
    and device) then say what the runtime needs to run its part (Collective.__call__).

    Outside a capture the collective compiles and loads what the call needs (its size
    bucket's kernel for the dtype and op) on first use; inside one that is refused, clearly.
    """
    chunkless = x is None and out is None
    probe = like if chunkless else x if x is not None else out
    capturing = _capturing(probe)
    coll = e.collective(capturing)
    dtype = dtype_of(probe)
    purlin_op = "sum" if op == "avg" else op
    reduce_op = ReduceOp.parse(purlin_op) if e.is_reduce else None
    if not chunkless:
        count = (x.numel() // e.in_units) if e.in_units else (out.numel() // max(e.out_units, 1))
    if capturing and not is_warm(e, coll, dtype, reduce_op, count):
        label = "out" if x is None and out is not None else "x"
        raise ArgumentError(
            f"purlin::{e.name} on rank {e.rank}: {label} ({dtype.value}, {probe.numel()} elements) reached a "
            f"CUDA graph capture before a warm-up call: expected one call with dtype {dtype.value}"
            f"{', op ' + purlin_op if e.is_reduce else ''} and this size outside the capture, got none",
            notes=("the first call of a dtype and size bucket compiles and loads its kernel, and the ranks "
                   "agree on it; a graph can capture neither",
                   "torch.compile(mode='reduce-overhead') makes that call by itself"),
        )
    # avg: a float16 sum rounds to infinity past 65504 before a division after it could bring it
    # back (two ranks of 60000), so float16 inputs are scaled first, as NCCL scales floats; the
    # others keep the caller's buffers (a heap tensor's zero-copy path) and divide the output.
    # The choice is the dtype's, the same on every rank: a rank that only receives divides too.
    avg = op == "avg" and e.is_reduce
    scale_first = avg and dtype is DType.FLOAT16
    if scale_first and x is not None and x.numel():
        x = x * (1.0 / e.world_size)
    if chunkless:
        coll(None, None, op=purlin_op, count=count, dtype=dtype)
    else:
        coll(x, out, op=purlin_op)
    if not capturing:
        variant = _variant(coll, count, dtype.itemsize)
        if getattr(variant, "_ce", None) is not None:
            e.warmed.add(id(variant))
    if avg and not scale_first and out is not None and out.numel():
        out.div_(e.world_size)


# ---------------------------------------------------------------------------------------------
# the three ops of one name


def _where(name: str, e: Entry) -> str:
    return f"purlin::{name} on rank {shown(e.rank)}"


def _entry_of(name: str, handle: int) -> Entry:
    """The entry of ``handle``, which must be one of ``name``'s collectives: a handle of another
    collective would run that one (its chunks, its reduction) under this op's name."""
    e = entry(handle)
    if e.name != name:
        raise ArgumentError(f"purlin::{name} on rank {e.rank}: handle {handle} names a collective of "
                            f"{e.name!r}, expected one of {name!r}",
                            notes=(f"pass a handle made for {name} (its TorchCollective's or Group's), or call "
                                   f"torch.ops.purlin.{e.name}",))
    return e


def define(name: str, where: str = "define") -> Ops:
    """The functional, out and in-place ops for collectives called ``name``; defined once per
    process, under a lock: ranks on threads (or two Groups made at once) register a name's ops
    once, not twice at the same time (torch.library refuses, or tears down, the second).
    ``where`` names the caller's call in a refusal (``op`` for ``purlinc.torch.op``)."""
    hit = _DEFINED.get(name)
    if hit is not None:
        return hit
    with _DEFINING:
        return _DEFINED.get(name) or _define(name, where)


_SUFFIXES = ("", "_out", "_inplace", "_seq")  # the ops _define registers for a name
# Who owns each op name of the namespace: (the family whose define() may register it, or None;
# the owner, as a refusal names it).  purlinc.torch's own ops are reserved here up front, at
# import, before any user op can take one of their names (the standard collectives' families
# are defined only when a Group is made, the fused op when fused_add_rmsnorm_op is first
# called): a collective called ``allgather_out`` would otherwise take the out form of
# ``allgather`` and make every later Group fail, and one called ``fused_add_rmsnorm`` would
# have its schema replaced.  Each family define() registers is recorded too.
_OWNERS: dict[str, tuple[str | None, str]] = {}


def reserve(op: str, owner: str) -> None:
    """Reserve ``purlin::op`` for one of purlinc.torch's own ops (``owner`` says whose, for the
    message), before it is registered: define() refuses a collective whose ops would take it."""
    _OWNERS.setdefault(op, (None, owner))


def _reserve_family(name: str, owner: str) -> None:
    for suffix in _SUFFIXES:
        _OWNERS[name + suffix] = (name, f"the {suffix.removeprefix('_') or 'functional'} form of {owner}")


for _kind in SOURCES:  # a Group defines these families when it is made; pt.op(coll, name=kind) shares them
    _reserve_family(_kind, f"the standard collective {_kind!r} (purlinc.torch's torch.distributed-shaped calls)")
reserve("no_gradient", "purlinc.torch's no-gradient marker (purlin::no_gradient: a compiled backward of max, "
                       "min or prod)")


def _owner(op: str, name: str) -> str | None:
    """Who holds ``purlin::op`` other than ``name``'s own family: an owner of the table, or, for an
    op registered outside purlinc.torch (or a name torch's namespace object holds, like ``name``,
    whose torch.ops.purlin.<op> could never reach an op), what that is; None where it is free."""
    family, owner = _OWNERS.get(op, (None, None))
    if owner is not None:
        return None if family == name else owner
    found = getattr(getattr(torch.ops, NAMESPACE), op, None)  # a lookup of torch's registry (None: free)
    if found is None:
        return None
    if isinstance(found, torch._ops.OpOverloadPacket):
        return "registered, outside purlinc.torch"
    return (f"an attribute of torch's op namespace object ({type(found).__name__}), so torch.ops.{NAMESPACE}.{op} "
            "could never reach an op of that name")


def _refuse_taken(name: str, where: str) -> None:
    """Each name registers purlin::NAME, NAME_out, NAME_inplace and NAME_seq: each must be free,
    or this family's own (torch.library refused a second registration with its own
    RuntimeError, or replaced it silently)."""
    for suffix in _SUFFIXES:
        owner = _owner(name + suffix, name)
        if owner is not None:
            raise ArgumentError(f"{where}: name {name!r}: torch.ops.{NAMESPACE}.{name + suffix} is already {owner}",
                                notes=("rename the collective (pt.op(coll, name=...), or its name in the .pln file, "
                                       "which names its ops by default)",))


def require_unregistered(op: str, where: str) -> None:
    """Before purlinc.torch registers one of its own reserved ops (``reserve``) lazily: refuse if
    something else registered ``purlin::op`` first (torch.library would replace it silently)."""
    if getattr(getattr(torch.ops, NAMESPACE), op, None) is not None:
        raise ArgumentError(f"{where}: torch.ops.{NAMESPACE}.{op} is already registered, outside purlinc.torch; "
                            f"expected it free (purlinc.torch reserves it for {_OWNERS[op][1]})")


def _define(name: str, where: str) -> Ops:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ArgumentError(f"{where}: name {name!r} is not an identifier (letters, digits, _; a letter first)")
    _refuse_taken(name, where)
    impl = _implementations(name)
    lib = f"{NAMESPACE}::{name}"
    ops: list = []
    for suffix, fn, fake, schema, mutates in (  # in _SUFFIXES' order
        ("", impl["functional"], impl["functional_fake"], "(Tensor x, int handle, str op, SymInt count) -> Tensor", ()),
        ("_out", impl["out_form"], impl["out_fake"], "(Tensor x, Tensor(a!) out, int handle, str op) -> ()", ("out",)),
        ("_inplace", impl["inplace"], impl["inplace_fake"], "(Tensor(a!) t, int handle, str op) -> ()", ("t",)),
        ("_seq", impl["sequenced"], impl["sequenced_fake"],
         "(Tensor x, Tensor(a!) seq, int handle, str op, SymInt count) -> Tensor", ("seq",)),
    ):
        custom = torch.library.custom_op(lib + suffix, fn, mutates_args=mutates, schema=schema)
        custom.register_fake(fake)
        if suffix == "":  # the one functional op (autograd formulas need one): see differentiate
            custom.register_autograd(_backward, setup_context=_save)
        overload = getattr(getattr(torch.ops, NAMESPACE), name + suffix).default
        _keep_in_order(overload, mutable=bool(mutates))
        ops.append(overload)
    if name not in SOURCES:
        _reserve_family(name, f"collective {name!r}")
    _DEFINED[name] = hit = Ops(*ops, impl["functional"], impl["out_form"], impl["inplace"])
    return hit


def _implementations(name: str) -> dict:
    """The real and fake implementations of ``name``'s ops, by role."""

    def functional(x, handle, op, count):
        e = _entry_of(name, handle)
        where = _where(name, e)
        op = normalize_op(op, where)
        check_tensor(where, "x", x, e, op)
        n = count_of(where, e, x, None, count)
        result = x.new_empty(e.out_units * n)
        if n:  # a rank without chunks calls too: its program may relay the others' data (a ring)
            run(e, x if e.in_units else None, result if e.out_units else None, op, count=n, like=x)
        return result

    def functional_fake(x, handle, op, count):
        e = _entry_of(name, handle)
        where = _where(name, e)
        check_tensor(where, "x", x, e, normalize_op(op, where), fake=True)
        return x.new_empty(e.out_units * count_of(where, e, x, None, count))

    def out_form(x, out, handle, op):
        e = _entry_of(name, handle)
        where = _where(name, e)
        op = normalize_op(op, where)
        for label, t in (("x", x), ("out", out)):
            check_tensor(where, label, t, e, op)
        n = count_of(where, e, x, out)
        check_out(where, e, x, out, n)
        if n and e.in_units and e.out_units and overlap(x, out, fake=False):
            # torch's in-place forms (an all-gather's input in its own slot of out, a reduce-scatter's
            # out in its input): the kernels never run in place, so x is read from a copy
            x = x.clone()
        if n:
            run(e, x if e.in_units else None, out if e.out_units else None, op)

    def out_fake(x, out, handle, op):
        e = _entry_of(name, handle)
        where = _where(name, e)
        for label, t in (("x", x), ("out", out)):
            check_tensor(where, label, t, e, normalize_op(op, where), fake=True)
        check_out(where, e, x, out, count_of(where, e, x, out))

    def inplace(t, handle, op):
        e = _entry_of(name, handle)
        where = _where(name, e)
        op = normalize_op(op, where)
        check_tensor(where, "t", t, e, op)
        _inplace_units(where, e, t)
        if not t.numel():
            return
        if e.in_units and e.out_units:
            run(e, t.clone(), t, op)  # the kernels never run in place: read from a copy
        else:
            run(e, t if e.in_units else None, t if e.out_units else None, op)

    def inplace_fake(t, handle, op):
        e = _entry_of(name, handle)
        where = _where(name, e)
        check_tensor(where, "t", t, e, normalize_op(op, where), fake=True)
        _inplace_units(where, e, t)

    def sequenced(x, seq, handle, op, count):  # seq is only "written": the order it imposes is the point
        return functional(x, handle, op, count)

    def sequenced_fake(x, seq, handle, op, count):
        return functional_fake(x, handle, op, count)

    return {"functional": functional, "functional_fake": functional_fake, "out_form": out_form, "out_fake": out_fake,
            "inplace": inplace, "inplace_fake": inplace_fake, "sequenced": sequenced, "sequenced_fake": sequenced_fake}


# ---------------------------------------------------------------------------------------------
# autograd


def differentiate(kind: str, op: str, world_size: int, grad, inverse):
    """dx from dy for collective ``kind`` reducing with ``op``, as torch.distributed.nn.functional
    defines it; ``inverse(grad, op)`` runs the inverse collective (INVERSES) on the gradient."""
    if kind not in INVERSES:
        raise ArgumentError(f"purlin::{kind}: no gradient is defined for this collective; expected one of "
                            f"{', '.join(INVERSES)} (all_reduce, all_gather, reduce_scatter, all_to_all)")
    if kind in ("allreduce", "reduce_scatter") and op not in ("sum", "avg"):
        message = f"purlin::{kind}: the gradient of op={op!r} is not defined here; expected sum or avg"
        note = "a max/min/prod reduction has no gradient that one collective of the gradient gives"
        if torch.compiler.is_compiling():  # the forward compiles; the backward raises when it runs
            numel = grad.numel() * (world_size if kind == "reduce_scatter" else 1)
            return torch.ops.purlin.no_gradient(grad, numel, f"{message}\nnote: {note}")
        raise ArgumentError(message, notes=(note,))
    if kind == "allreduce":
        return inverse(grad, op)  # sum: the sum of the gradients; avg: their average
    dx = inverse(grad, "sum")
    return dx / world_size if kind == "reduce_scatter" and op == "avg" else dx


@torch.library.custom_op(f"{NAMESPACE}::no_gradient", mutates_args=())
def _no_gradient_op(grad: torch.Tensor, numel: int, message: str) -> torch.Tensor:
    """``purlin::no_gradient(grad, numel, message)``: a gradient of ``numel`` elements in a
    compiled graph that raises ArgumentError(message) when the backward runs.  Raising while the
    backward is traced would refuse the forward too: dynamo traces an autograd function's
    backward ahead of time, and cannot trace building the error.  Defined at import: an op
    cannot be defined inside a traced function."""
    text, _, note = message.partition("\nnote: ")
    raise ArgumentError(text, notes=(note,) if note else ())


@_no_gradient_op.register_fake
def _(grad, numel, message):
    return grad.new_empty(numel)


def _save(ctx, inputs, output) -> None:
    x, handle, op, _count = inputs
    ctx.handle, ctx.op, ctx.shape = handle, op, x.shape


def _backward(ctx, grad):
    e = entry(ctx.handle)
    op = normalize_op(ctx.op, f"purlin::{e.name} backward")
    if e.inverse is None and e.name in INVERSES:
        raise ArgumentError(f"purlin::{e.name}: handle {ctx.handle} has no inverse collective (made outside a Group)")
    kind = entry(e.inverse).name if e.inverse is not None else e.name

    def inverse(g, inverse_op):
        return getattr(torch.ops.purlin, kind)(g.contiguous(), e.inverse, inverse_op, -1)
    dx = differentiate(e.name, op, e.world_size, grad, inverse)
    return dx.view(ctx.shape), None, None, None


def _keep_in_order(op, *, mutable: bool) -> None:
    """Every rank must call its collectives in the same order, and a call whose result a rank
    does not use (a gather on a non-root rank) must still happen: a compiler may neither drop
    nor reorder them.  Mutating ops are never dropped (marked side-effectful); the functional op
    is also an ORDERED effect.  Effect tokens alone did not hold inductor's order (torch 2.13
    reordered them when reordering for peak memory, differently per rank since graphs differ
    at the root), so compiled code goes through ``NAME_seq``: the functional op that also
    "mutates" a one-element sequence tensor of the communicator (:func:`sequence`), a real
    write-after-write chain that every scheduler keeps (see distributed.py)."""
    global ORDERED
    if mutable:
        torch.fx.node.has_side_effect(op)
        return
    try:
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

        _register_effectful_op(op, _EffectType.ORDERED)
    except (ImportError, AttributeError, TypeError, AssertionError):  # a torch without this private API
        torch.fx.node.has_side_effect(op)  # still never dropped; order then rests on the compiler
        ORDERED = False


_SEQUENCES: dict = {}
_SEQUENCING = threading.Lock()


def tracing() -> bool:
    """Whether collectives are being traced rather than run: torch.compile (dynamo), or a fake or
    proxy dispatch mode (FakeTensorMode shape inference, make_fx).  Traced, a call records the
    ordered op (NAME_seq); run eagerly it would launch a real collective on fake tensors."""
    if torch.compiler.is_compiling():
        return True
    return _active_mode("FAKE") is not None or _active_mode("PROXY") is not None


def _active_mode(name: str):
    """The active infrastructure dispatch mode of that kind (FAKE, PROXY), or None; None too on a
    torch without these (private) accessors."""
    key = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), name, None)
    return torch._C._get_dispatch_mode(key) if key is not None else None


def fail(message: str, notes=()) -> NoReturn:
    """Refuse a caller's mistake: an ArgumentError; under torch.compile a RuntimeError with the
    same text (and notes), as :func:`require` does.  Dynamo cannot trace building an
    ArgumentError (with fullgraph=True it reported only "Attempted to call a super()
    attribute"), but it traces raising a builtin exception: with fullgraph=True the text is in
    its "Observed exception" report; without it dynamo runs the call eagerly, which raises the
    ArgumentError itself.  (``torch._check(False, message)`` did that on torch 2.13 only: 2.11
    refuses a message function that reads a local, and one that takes it as a default makes
    every failed check an InternalTorchDynamoError, fullgraph or not.)  For checks that run in
    the Python calls while traced (the torch.distributed-shaped calls check their tensors
    before they record an op)."""
    if torch.compiler.is_compiling():
        text = message
        for note in notes:
            text = f"{text}\nnote: {note}"
        raise RuntimeError(text)
    raise ArgumentError(message, notes=tuple(notes))


def require(condition, message) -> None:
    """A caller's mistake: an ArgumentError, and under torch.compile a RuntimeError with the
    same text (see :func:`fail`).  ``message``: the text, or a function giving it, called only
    when the check fails; a message that names sizes must be one (see :func:`shown`).

    Compiled, ``if not condition`` decides the condition (on dynamic sizes a symbol: a guard
    on the sizes, as any shape check makes) before any message is made."""
    if not condition:
        fail(message() if callable(message) else message)


def shown(size) -> int:
    """A size for a :func:`require` message, as a plain int.  Under torch.compile(dynamic=True)
    a size is a symbol, which dynamo cannot format ("BUILD_STRING type error"); ``int()`` makes
    it this call's number (a guard on that size, on the failing path only: so the message is a
    function, called only when the check fails)."""
    return int(size)


def shape_shown(t) -> str:
    """``t``'s shape for a :func:`require` message, as ``tuple(t.shape)`` prints (see :func:`shown`).
    Built of f-strings of ints: dynamo keeps a formatted tuple, or str() of an int, a traced
    value, which a message cannot carry out of the trace."""
    return ints_shown(t.shape)


def ints_joined(values) -> str:
    """Integers (sizes, ranks) joined by ", ", each a plain int, built as shape_shown says."""
    return _joined(f"{int(n)}" for n in values)


def _joined(texts) -> str:
    """Texts joined by ", ", with f-strings (as shape_shown says)."""
    text = ""
    for item in texts:
        text = f"{text}, {item}" if text else item
    return text


def _bracketed(text: str, count: int, brackets: str) -> str:
    """``count`` items, joined in ``text``, as a tuple (``"()"``: one item takes a comma) or a list prints them."""
    if brackets == "()" and count == 1:
        return f"({text},)"
    return f"{brackets[0]}{text}{brackets[1]}"


def ints_shown(values, brackets: str = "()") -> str:
    """A tuple of sizes (a shape, strides) as ``tuple(...)`` prints it, or with ``brackets="[]"``
    a list as ``list(...)`` does, built as shape_shown says."""
    return _bracketed(ints_joined(values), len(values), brackets)


def value_shown(value) -> str:
    """``repr(value)`` for a message, each int or float in it (a list's or a tuple's members
    too) a plain number, built as shape_shown says: a number that dynamo reads as a symbol
    (under dynamic=True, or through automatic dynamic: an argument or an attribute that
    changed between compiles of the same code) cannot be formatted in a trace ("BUILD_STRING
    type error"), nor a list holding one.  Anything else (a string, a NumPy int, a tensor) as
    repr() gives it."""
    if type(value) is int or isinstance(value, torch.SymInt):  # not a bool, nor an int subclass (an IntEnum)
        return f"{int(value)}"
    if type(value) is float or isinstance(value, torch.SymFloat):  # not a NumPy float (a float subclass)
        return f"{float(value)!r}"
    if type(value) is list or type(value) is tuple:
        return _bracketed(_joined(value_shown(v) for v in value), len(value), "[]" if type(value) is list else "()")
    return f"{value!r}"


def traced(seq, like):
    """The sequence tensor as the active FakeTensorMode sees it (it refuses real tensors);
    itself under torch.compile and eagerly.  Without one (``seq`` None: a device this torch
    cannot reach, so nothing can run) a fresh stand-in on ``like``'s device, never cached: the
    trace still records the ordered op, and its checks still name the caller's tensors."""
    if seq is None:
        return torch.zeros(1, dtype=torch.int32, device=like.device)
    if torch.compiler.is_compiling():  # dynamo lifts the real tensor itself
        return seq
    mode = _active_mode("FAKE")
    if mode is None:
        return seq
    from torch._subclasses.fake_tensor import FakeTensor

    return seq if isinstance(seq, FakeTensor) else mode.from_tensor(seq)


def sequence(comm, device) -> "torch.Tensor | None":
    """The communicator's sequence tensor: what NAME_seq ops "write", so compiled collectives of
    one communicator stay in program order.  Static (``mark_static_address``): CUDA graphs
    (reduce-overhead) accept mutations of static inputs.  Made eagerly, outside any trace; None
    where this torch cannot make a tensor on ``device``."""
    key = (id(comm), str(device))
    hit = _SEQUENCES.get(key)  # the common case, also inside traced code (which cannot enter a lock)
    if hit is not None or torch.compiler.is_compiling():
        # dynamo cannot enter the lock, and a tensor made in the trace is a graph value, not
        # the communicator's: without one the caller's trace takes a stand-in (traced)
        return hit
    with _SEQUENCING:  # one tensor per communicator, whichever thread makes its Groups and ops first
        hit = _SEQUENCES.get(key)
        if hit is None:
            hit = _new_sequence(device)
            if hit is None:  # a device this torch cannot reach: eager checks still work
                return None
            _SEQUENCES[key] = hit
    return hit


def _new_sequence(device) -> "torch.Tensor | None":
    """A real, ordinary tensor, whatever mode the caller is in: it is cached and shared by every
    later call on the communicator, so one made under inference_mode (an inference tensor: a
    compiled call's update of it is refused outside that mode), a FakeTensorMode (a fake
    tensor: later traces refused it, or mixed two fake modes) or make_fx (a proxy) broke every
    later compiled call; and a fake mode made a fake cuda:0 tensor where no CUDA exists."""
    from torch.utils._python_dispatch import _disable_current_modes

    try:
        with torch.inference_mode(False), _disable_current_modes():
            seq = torch.zeros(1, dtype=torch.int32, device=device)
    except (RuntimeError, AssertionError):  # "Torch not compiled with CUDA enabled", no such device
        return None
    torch._dynamo.mark_static_address(seq)
    return seq


def _inplace_units(where: str, e: Entry, t) -> None:
    """``t`` can be this rank's input and output at once.  Eagerly, traced and compiled alike
    (``require``: dynamo cannot trace building an ArgumentError; compiled, the fake op then
    checks t's size as the input's)."""
    # A rank without chunks: t would carry none, so nothing says the chunk size its part (a
    # relay) runs with; eagerly this reached the launch with neither tensor (AttributeError).
    require(e.in_units or e.out_units,
            lambda: f"{where}: cannot run in place: rank {shown(e.rank)} gives and receives no chunks, so t "
                    f"cannot say the elements per chunk (use the functional form with count=)")
    require(not (e.in_units and e.out_units and e.in_units != e.out_units),
            lambda: f"{where}: cannot run in place: rank {shown(e.rank)} gives {shown(e.in_units)} chunks and "
                    f"receives {shown(e.out_units)}; expected equal sizes (use the functional form or out=)")
    if e.in_units:
        if not torch.compiler.is_compiling():
            count_of(where, e, t, names=("t", "t"))
    else:
        require(t.numel() % e.out_units == 0,
                lambda: f"{where}: t has {shown(t.numel())} elements, expected a multiple of {shown(e.out_units)}")
