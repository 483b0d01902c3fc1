"""Checks on a call's arguments, before anything is launched, and the per-call sizes.

Pure functions over :class:`~purlinc.runtime.interop.ArrayInfo`: testable without a GPU.

The count rule
--------------
``count`` (elements per chunk) is the same on every rank and comes from the first of:

1. the input: ``x.numel() / in_units[rank]``, when this rank has input chunks;
2. the output: ``out.numel() / out_units[rank]``, when it has none (e.g. the non-root
   ranks of a broadcast: pass ``x=None`` and ``out``);
3. the ``count=`` argument, when the rank has neither input nor output chunks (possible
   only in unusual specs).

An explicit ``count=`` must agree with whatever the buffers say.  Ranks cannot check
each other's count without a synchronisation, so a count that differs between ranks is the
caller's bug (the kernels then move ``min`` of what both sides expect at best).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from purlinc.atom.abi import StagingPlacement, slice_step
from purlinc.dtypes import DTYPES, DType, ReduceOp
from purlinc.runtime.errors import ArgumentError, MismatchError
from purlinc.runtime.interop import ArrayInfo

FAST_ALIGN = 16  # bytes: buffers aligned to this take the vectorised path


@dataclass(frozen=True, slots=True)
class CallShape:
    """What validation decided: the call's dtype, reduce op (None for copies) and count."""

    dtype: DType
    op: ReduceOp | None
    count: int
    in_ptr: int
    out_ptr: int


def _err(message: str, *notes: str) -> ArgumentError:
    return ArgumentError(message, None, notes)


def parse_op(op, is_reduce: bool, where: str | None = None) -> ReduceOp | None:
    try:
        parsed = ReduceOp.parse(op)
    except ValueError as error:  # its message, not its rendering ("error: error: unknown reduce op")
        message = getattr(error, "message", str(error))
        raise _err(f"{where}: {message}" if where else message) from None
    return parsed if is_reduce else None


def integer(value) -> int:
    """``value`` as an int, from any integer type (``operator.index``: Python's, NumPy's, a 0-d
    integer tensor) but a bool; TypeError for anything else.  Not int(), which cuts 1.5 to 1
    and reads "2" as 2.  Every count, size and rank argument is read through this."""
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")):  # a bool tensor or NumPy bool too
        raise TypeError(f"{value!r} is a bool, not a number")
    if getattr(value, "ndim", 0) != 0:  # a one-element array or tensor of more dimensions is no number
        raise TypeError(f"{value!r} has {value.ndim} dimension(s), not a number")
    return operator.index(value)


def integer_or_none(value) -> int | None:
    """``value`` as an int, read as every count is (``integer``: any integer type but a bool; a
    NumPy one was refused as "not in 1..64" while in range), or None where it is none."""
    try:
        return integer(value)
    except TypeError:
        return None


def _count_argument(where: str, count) -> int | None:
    """``count=`` as an int (any integer type) or None: a str or a float would compare unequal
    or equal to the buffers' count by accident ('7' against 7: "count=7, but the buffers say 7")."""
    if count is None:
        return None
    try:
        return integer(count)
    except TypeError:
        raise _err(f"{where}: count={count!r}, expected an int (elements per chunk) or None") from None


def validate_call(
    x: ArrayInfo | None,
    out: ArrayInfo | None,
    *,
    name: str,
    rank: int,
    device: int,
    in_units: int,
    out_units: int,
    is_reduce: bool,
    op="sum",
    count: int | None = None,
    dtype_hint=None,
) -> CallShape:
    """Raise ArgumentError (naming the tensor, what was expected and what was given) or return the shape.

    ``dtype_hint``: the dtype (a DType or its name) of a rank that passes no buffer, so it can
    give ``count`` too and take part in the schedule (and the ranks' agreement) with the others."""
    where = f"{name} on rank {rank}"
    reduce_op = parse_op(op, is_reduce, where)
    count = _count_argument(where, count)
    x = _check_presence(where, x, out, in_units, out_units)
    dtype = _buffers_dtype(where, x, out, device)
    hinted = _parsed_hint(where, dtype_hint)
    if dtype is not None and hinted is not None and hinted is not dtype:
        raise _err(f"{where}: dtype={hinted.value}, but the buffers have dtype {dtype.value}",
                   "leave dtype= out where the call passes buffers (it is for a rank that passes none)")
    if dtype is None:
        if count in (None, 0):  # an empty call: its dtype is what the empty buffers (or dtype=) say
            dtype = hinted or _empty_buffers_dtype(x, out) or DType.FLOAT32
            return CallShape(dtype, reduce_op, 0, 0, out.ptr if out else 0)
        dtype = _hinted_dtype(where, count, hinted)
        # On through the checks below: a rank that receives chunks still needs its `out`.
    if reduce_op is not None and not dtype.reducible:
        raise _err(f"{where}: {dtype.value} cannot be reduced (fp8 is supported for copies only)")
    count = _chunk_count(where, x, out, in_units, out_units, count)
    if out_units:
        expected = out_units * count
        if out is None:
            raise _err(f"{where}: out is required: {expected} elements ({out_units} chunks x {count})")
        if out.numel != expected:
            raise _err(f"{where}: out has {out.numel} elements, expected {expected} ({out_units} chunks x {count})")
    in_ptr = x.ptr if x is not None else 0
    out_ptr = out.ptr if out is not None and out_units else 0
    if x is not None and out_ptr and count:
        itemsize = dtype.itemsize
        a0, a1 = in_ptr, in_ptr + x.numel * itemsize
        b0, b1 = out_ptr, out_ptr + out.numel * itemsize
        if overlapping((a0, a1), (b0, b1)):
            raise _err(f"{where}: x and out overlap ([{a0:#x}, {a1:#x}) and [{b0:#x}, {b1:#x}))",
                       "in-place calls are not supported: give a separate out")
    return CallShape(dtype, reduce_op, count, in_ptr, out_ptr)


def overlapping(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether byte ranges ``[a0, a1)`` and ``[b0, b1)`` share a byte (an empty one shares none)."""
    return a[0] < b[1] and b[0] < a[1] and a[0] < a[1] and b[0] < b[1]


def _check_presence(where: str, x, out, in_units: int, out_units: int):
    """x and out given exactly where this rank gives and receives chunks; x (None for an empty
    input on a rank that gives nothing)."""
    if x is not None and x.numel == 0 and in_units == 0:
        x = None  # an empty input on a rank that gives nothing: same as None
    if x is None and in_units > 0:
        raise _err(f"{where}: x is required (this rank gives {in_units} chunk(s)), got None")
    if x is not None and in_units == 0:
        raise _err(
            f"{where}: this rank gives no input, but x has {x.numel} elements",
            "pass x=None (and out=...) on ranks without input",
        )
    if out is not None and out_units == 0 and out.numel != 0:
        raise _err(f"{where}: this rank receives no output, but out has {out.numel} elements",
                   "pass out=None on ranks without output")
    return x


def supported_dtypes_text() -> str:
    """The element types a call takes, by their torch names (from the dtype registry)."""
    records = DTYPES.records()
    copies = "/".join(r.torch_name for r in records if not r.reducible)
    return ", ".join([r.torch_name for r in records if r.reducible] + ([f"{copies} (copies only)"] if copies else []))


_CONTIGUOUS = {  # what to do instead: a copy of x serves; a copy of out would not receive the result
    "x": "pass x.contiguous() (a copy) instead",
    "out": "pass a contiguous out (then copy it into the strided view), or leave out=None",
}


def _buffers_dtype(where: str, x, out, device: int) -> DType | None:
    """The dtype of the non-empty buffers (None: there are none), each checked: a supported
    dtype, the same for both, on this rank's device, contiguous, aligned to its element."""
    dtype: DType | None = None
    for label, info in ((label, info) for label, info in (("x", x), ("out", out)) if info is not None and info.numel):
        if info.dtype is None:
            raise _err(f"{where}: {label} has dtype {info.dtype_name}, which Purlin does not support",
                       f"supported: {supported_dtypes_text()}")
        if dtype is None:
            dtype = info.dtype
        elif info.dtype is not dtype:
            raise _err(f"{where}: out has dtype {info.dtype.value}, expected {dtype.value} (the dtype of x)")
        if info.device != device:
            actual = f"cuda:{info.device}" if info.device >= 0 else f"{info.place} (not a CUDA device)"
            raise _err(f"{where}: {label} is on {actual}, expected cuda:{device} (this rank's device)")
        if not info.contiguous:
            shown = f" ({info.layout})" if info.layout else ""
            raise _err(f"{where}: {label} is not contiguous{shown}", _CONTIGUOUS[label])
        check_readable(f"{where}: {label}", info)
        if info.ptr % info.dtype.itemsize:
            raise _err(
                f"{where}: {label} at {info.ptr:#x} is not aligned to its element size ({info.dtype.itemsize} bytes)"
            )
    return dtype


ADDRESS_LIMIT = 1 << 64


def check_readable(what: str, info) -> None:
    """Refuse ``info`` (named ``what``: "allreduce on rank 0: x") where its memory does not
    hold its values (``unreadable``)."""
    problem = unreadable(info)
    if problem is not None:
        raise _err(f"{what} {problem[0]}", problem[1])


def unreadable(info) -> tuple[str, str] | None:
    """Why a non-empty array's memory does not hold its values (the problem, then what to do),
    or None: a kernel reads memory, not a torch view's lazy negation, and a fake tensor has no
    memory at all (its address is 0: a kernel would fault, and the context with it)."""
    if not info.numel:
        return None
    if info.ptr + info.nbytes > ADDRESS_LIMIT:
        return (f"spans [{info.ptr:#x}, {info.ptr + info.nbytes:#x}), past the end of the 64-bit address space",
                "an array interface that describes it is wrong: check its pointer and shape")
    if info.negated:
        return ("is a lazily negated view: its memory holds the negation of its values",
                "resolve it first: .resolve_neg() makes a copy holding the values")
    if not info.ptr:
        return (f"has {info.numel} elements at address 0, expected memory on the GPU",
                "a fake or meta tensor has no memory: trace collectives through purlinc.torch's ops")
    return None


def _parsed_hint(where: str, dtype_hint) -> DType | None:
    """``dtype=`` as a DType (None: not given)."""
    if dtype_hint is None or isinstance(dtype_hint, DType):
        return dtype_hint
    try:
        return DType.parse(str(dtype_hint))
    except ValueError:
        raise _err(f"{where}: dtype={dtype_hint!r} is not a dtype Purlin knows",
                   f"supported: {supported_dtypes_text()}") from None


def _empty_buffers_dtype(x, out) -> DType | None:
    """The dtype of a call's empty buffers (x first), where Purlin has it: an empty batch of a
    call with bf16 operands is a bf16 call, which its operands' checks compare against."""
    return next((info.dtype for info in (x, out) if info is not None and info.dtype is not None), None)


def _hinted_dtype(where: str, count: int, hinted: DType | None) -> DType:
    """The dtype of a rank that passes no buffer but a count: its ``dtype=``."""
    if hinted is None:
        raise _err(f"{where}: count={count} but no buffer on this rank says what dtype it has", "pass dtype= too")
    if count < 0:
        raise _err(f"{where}: count={count} is negative")
    return hinted


def _chunk_count(where: str, x, out, in_units: int, out_units: int, count: int | None) -> int:
    """Elements per chunk: what the buffers say (x first), checked against ``count`` if given."""
    derived: int | None = None
    if x is not None:
        if x.numel % in_units:
            raise _err(
                f"{where}: x has {x.numel} elements, expected a multiple of {in_units} "
                f"(this rank gives {in_units} chunks of count elements)"
            )
        derived = x.numel // in_units
    elif out is not None and out_units:
        if out.numel % out_units:
            raise _err(f"{where}: out has {out.numel} elements, expected a multiple of {out_units} "
                       f"(this rank receives {out_units} chunks)")
        derived = out.numel // out_units
    if count is not None and derived is not None and count != derived:
        raise _err(f"{where}: count={count}, but the buffers say {derived} elements per chunk")
    return derived if derived is not None else int(count or 0)


def choose_piece(count: int, staging: StagingPlacement, itemsize: int, row: int = 1) -> int:
    """Elements per chunk per round: the whole chunk when its slices fit the large region's
    (``staging.largest_step`` each), else the largest piece whose do: a multiple of 16 bytes
    per slice, or of ``row`` elements (an epilogue's rows: rounds never split a row)."""
    if count <= 0:
        return 1
    if staging.units == 0:
        return count
    align = row * itemsize if row > 1 else FAST_ALIGN  # as KernelABI.step rounds a slice
    if slice_step(count * itemsize, staging.slices, align) <= staging.largest_step:
        return count  # one round: no later round's start to align
    cap = staging.slices * (staging.largest_step // align * align) // itemsize
    cap -= cap % max(1, FAST_ALIGN // itemsize)
    cap -= cap % row
    if cap < 1:
        least = max(FAST_ALIGN, row * itemsize)
        raise _err(f"a staging slice holds {staging.largest_step} bytes ({staging.units} unit(s) of {staging.large} "
                   f"bytes, {staging.slices} slice(s) each), less than one round's least share of "
                   f"{least} bytes" + (f" (a row of {row} elements)" if row > 1 else ""), "raise PURLIN_STAGE_MB")
    return min(count, cap)


def rounds(count: int, piece: int) -> int:
    return 0 if count == 0 else -(-count // piece)


# ---------------------------------------------------------------------------------------------
# agreement between ranks

_FIELDS = ("collective", "dtype", "op", "count")


@dataclass(frozen=True, slots=True)
class CallSignature:
    """What every rank of one call must agree on.  ``dtype`` and ``count`` are None on a rank
    whose buffers say nothing (no input and no output chunks): it agrees with anything."""

    collective: str
    dtype: str | None
    op: str | None
    count: int | None

    def as_tuple(self) -> tuple:
        return (self.collective, self.dtype, self.op, self.count)

    @classmethod
    def from_tuple(cls, values) -> "CallSignature":
        return cls(*values)


def call_signature(collective: str, shape: CallShape, has_chunks: bool) -> CallSignature:
    return CallSignature(
        collective,
        # A rank without chunks that gave count= and dtype= agrees on them like the others.
        shape.dtype.value if has_chunks or shape.count else None,
        shape.op.value if shape.op is not None else None,
        shape.count if has_chunks or shape.count else None,
    )


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def disagreement(name: str, signatures) -> MismatchError | None:
    """A ``MismatchError`` naming the first field the ranks' signatures disagree on (collective,
    dtype, op, count), the ranks, the expected value (the lowest such rank's) and the actual
    ones; None when they agree."""
    for field in _FIELDS:
        by_value: dict[object, list[int]] = {}
        for rank, signature in enumerate(signatures):
            value = getattr(signature, field)
            if value is not None or field in ("collective", "op"):
                by_value.setdefault(value, []).append(rank)
        if len(by_value) <= 1:
            continue
        (expected, agreeing), *others = sorted(by_value.items(), key=lambda item: item[1][0])
        shown = "elements per chunk" if field == "count" else ""
        actual = "; ".join(f"{_ranks(ranks)} passed {value}{' ' + shown if shown else ''}" for value, ranks in others)
        what = "called" if field == "collective" else "passed"
        actual = actual.replace("passed", what)
        return MismatchError(
            f"{name}: the ranks disagree on the {field}: expected {expected}{' ' + shown if shown else ''} "
            f"(as {_ranks(agreeing)}), but {actual}",
            None,
            ("every rank must make the same call: the same collective, dtype, op and count; nothing was launched",),
        )
    return None
