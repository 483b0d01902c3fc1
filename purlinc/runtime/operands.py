"""A call's epilogue operands (docs/LANGUAGE.md, "Epilogues"): checked before any launch and
packed into the kernel's argument words (``purlin_args.epi``, ``purlinc.atom.abi``).

Operands are read and written only by their own rank, on its own GPU, so they need no
registration and no staging: the words are their device pointers (rows and row operands)
or a float32's bits (scalars).  Pure functions over ``ArrayInfo``: testable without a GPU.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

from purlinc.frontend.ast import OperandKind
from purlinc.frontend.epilogue import Epilogue, eps_operand, scalar_problem
from purlinc.runtime.errors import ArgumentError
from purlinc.runtime.interop import ArrayInfo, describe
from purlinc.runtime.validate import FAST_ALIGN, CallShape, check_readable


def _err(message: str, *notes: str) -> ArgumentError:
    return ArgumentError(message, None, notes)


def check_rows(name: str, epilogue: Epilogue, count: int, out_chunks: int = 1) -> None:
    """Every chunk must hold whole rows (rows never straddle chunks).  ``out_chunks``: how many
    chunks the output is cut into (the note on fewer rows than chunks applies only past one)."""
    if count % epilogue.row:
        notes = () if out_chunks <= 1 else (
            f"with an output of {out_chunks} chunks (out[r] = x[0..R]) a chunk is numel / {out_chunks} elements: use "
            "a spec whose output is one chunk (out[r] = x) for fewer rows than chunks",)
        raise _err(f"{name}: out has {count} elements per chunk, not a whole number of rows of {epilogue.row} "
                   f"(the epilogue's rows({epilogue.row}))", *notes)


def operand_words(name: str, epilogue: Epilogue, operands: Mapping[str, object], shape: CallShape,
                  out_numel: int, device: int, buffers: tuple[tuple[int, int], ...] = (),
                  describe=describe) -> tuple[int, ...]:
    """The kernel's words for ``operands`` (by name), after checking each (and that the call's
    ``out`` is 16-byte aligned, as the epilogue's vectors need): present, known,
    on ``device``, the expected dtype and element count, contiguous, 16-byte aligned, and not
    overlapping the call's buffers (``buffers``: (pointer, bytes)) or a written operand.
    ``describe`` reads a tensor's ``ArrayInfo`` (``interop.describe``)."""
    unknown = sorted(set(operands) - {o.name for o in epilogue.operands})
    if unknown:
        declared = ", ".join(o.name for o in epilogue.operands)
        raise _err(f"{name}: unknown operand {unknown[0]!r}; the epilogue takes {declared}")
    check_rows(name, epilogue, shape.count, out_numel // shape.count if shape.count else 1)
    if shape.out_ptr % FAST_ALIGN:
        # The epilogue reads and writes out's rows as 16-byte vectors (epilogue_rows.cuh.j2),
        # with no scalar path: a misaligned out would fault the kernel (and the context).
        raise _err(f"{name}: out at {shape.out_ptr:#x} is not {FAST_ALIGN}-byte aligned: an epilogue reads and "
                   f"writes its rows as {FAST_ALIGN}-byte vectors",
                   "pass an aligned tensor (a fresh one: torch's allocator aligns to 512 bytes), not a view at an offset")
    words, extents = [], []
    eps = eps_operand(epilogue)
    for operand in epilogue.operands:
        if operand.name not in operands or operands[operand.name] is None:
            raise _err(f"{name}: missing operand {operand.name!r} ({operand.format()})")
        value = operands[operand.name]
        if operand.kind is OperandKind.SCALAR:
            words.append(_scalar_word(name, operand, value, is_eps=operand.name == eps))
            continue
        try:
            info = describe(value)
        except (TypeError, BufferError) as error:  # not an array (or a read-only one): named by the operand
            raise _err(f"{name}: operand {operand.name!r}: {error}") from None
        numel = out_numel if operand.kind is OperandKind.ROWS else epilogue.row
        _check_tensor(name, operand, info, operand.dtype or shape.dtype, numel, device)
        words.append(info.ptr)
        extents.append((operand, info.ptr, info.nbytes))
    _check_overlap(name, extents, buffers)
    return tuple(words)


def _scalar_word(name: str, operand, value, *, is_eps: bool = False) -> int:
    """A scalar's float32 bits, once ``scalar_problem`` (the oracle's rule too) finds nothing."""
    problem = scalar_problem(value, is_eps=is_eps)
    if problem is not None:
        text, note = problem
        raise _err(f"{name}: operand {operand.name!r}: {text}", *((note,) if note else ()))
    return struct.unpack("<I", struct.pack("<f", float(value)))[0]


def _check_tensor(name: str, operand, info: ArrayInfo, dtype, numel: int, device: int) -> None:
    what = f"{name}: operand {operand.name!r}"
    if info.device != device:
        where = "host memory" if info.device < 0 else f"cuda:{info.device}"
        raise _err(f"{what}: expected a tensor on cuda:{device}, got one in {where}")
    if info.dtype is not dtype:
        raise _err(f"{what}: expected dtype {dtype.value}, got {info.dtype_name}")
    if info.numel != numel:
        shape = "the output's" if operand.kind is OperandKind.ROWS else "one row's"
        raise _err(f"{what}: expected {numel} elements ({shape}), got {info.numel}")
    if not info.contiguous:
        raise _err(f"{what}: expected a contiguous tensor, got a strided one", "pass .contiguous()")
    check_readable(what, info)
    if info.ptr % FAST_ALIGN:
        raise _err(f"{what}: expected a {FAST_ALIGN}-byte aligned address, got {info.ptr:#x}")


def _check_overlap(name: str, extents, buffers) -> None:
    """A written operand may share memory with nothing else.  A read operand may share it with
    other read operands and the input, but not the output: blocks write their rows of ``out``
    while others still read the operand (a weight inside ``out`` is half old, half new)."""
    labelled = list(zip(("the input", "the output"), buffers))
    for i, (operand, ptr, nbytes) in enumerate(extents):
        if operand.written:
            others = [(f"operand {o.name!r}", p, n) for j, (o, p, n) in enumerate(extents) if j != i]
            others += [(label, p, n) for label, (p, n) in labelled]
        else:
            others = [(label, p, n) for label, (p, n) in labelled if label == "the output"]
        for label, p, n in others:
            if n and nbytes and ptr < p + n and p < ptr + nbytes:
                verb = "written" if operand.written else "read"
                raise _err(f"{name}: operand {operand.name!r} is {verb} by the epilogue and overlaps {label}")
