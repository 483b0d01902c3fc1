"""The reference evaluator: a spec's meaning, computed directly on NumPy arrays.

Every later layer (the SNAC simulator, the GPU kernels) is tested against this.  It is
deliberately the most literal reading of the spec: an output chunk is a copy of its
producer's chunk, or the reduction of every occurrence of its name, accumulated in
float32 (int32 wraps) in (rank, position) order and rounded once.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np

from purlinc.dtypes import DType, ReduceOp, e4m3_from_float32, e4m3_to_float32, from_float32, to_float32
from purlinc.frontend.ast import OperandKind
from purlinc.frontend.epilogue import OUT, Epilogue, apply_rows, eps_operand, row_problem, scalar_problem
from purlinc.frontend.spec import Spec

_REDUCERS = {
    ReduceOp.SUM: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum,
}


def _check_inputs(spec: Spec, inputs: Sequence[np.ndarray], count: int, dtype: DType) -> None:
    if len(inputs) != spec.world_size:
        raise ValueError(f"expected {spec.world_size} input arrays (one per rank), got {len(inputs)}")
    for rank, array in enumerate(inputs):
        expected = len(spec.inputs[rank]) * count
        if array.dtype != dtype.storage:
            raise ValueError(
                f"input of rank {rank}: expected NumPy dtype {dtype.storage} (storage of {dtype.value}), "
                f"got {array.dtype}"
            )
        if array.ndim != 1 or array.shape[0] != expected:
            raise ValueError(
                f"input of rank {rank}: expected shape ({expected},) "
                f"({len(spec.inputs[rank])} chunks x {count} elements), got {array.shape}"
            )


def reduce_chunks(chunks: Sequence[np.ndarray], dtype: DType, op: ReduceOp) -> np.ndarray:
    """Reduce equally sized stored chunks in the given order, in float32, rounding once.  One
    chunk is its own reduction, bit for bit: the lowerings copy it (a Consume of one source)."""
    if len(chunks) == 1:
        return np.array(chunks[0], copy=True)
    reducer = _REDUCERS[op]
    accumulator = to_float32(chunks[0], dtype)
    # IEEE overflow to infinity and inf - inf = NaN are the semantics the kernels have, not errors
    with np.errstate(over="ignore", invalid="ignore"):
        for chunk in chunks[1:]:
            accumulator = reducer(accumulator, to_float32(chunk, dtype))
            if dtype is DType.INT32:
                accumulator = accumulator.astype(np.int32).astype(np.int64)  # wrap at each step, like int32 math
            elif dtype.is_float:
                accumulator = accumulator.astype(np.float32)
            # int64: NumPy's int64 array arithmetic wraps as the kernels' does
        return from_float32(accumulator, dtype)


def check_count(name: str, value, *, least: int = 0) -> None:
    """``value`` an integer (a NumPy one too) of at least ``least``: a float count would slice
    arrays by accident, a bool means neither."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < least:
        raise ValueError(f"{name} must be >= {least}, got {value}")


def check_epilogue_dtype(spec: Spec, dtype: DType) -> None:
    """An epilogue computes in float32 (docs/LANGUAGE.md, "Epilogues"): what the kernels refuse,
    the oracle refuses too, rather than defining results no kernel produces."""
    problem = None if spec.epilogue is None else row_problem(spec.epilogue.row, dtype)
    if problem is not None:  # an int32 output, or rows(12) in bf16 (the kernels move 16-byte vectors)
        raise ValueError(problem)


def check_rows_count(epilogue: Epilogue | None, count: int) -> None:
    """An epilogue's rows lie inside chunks (docs/LANGUAGE.md, "Rows"): a count that is not a
    whole number of rows is refused, as the runtime refuses the call."""
    if epilogue is not None and count % epilogue.row:
        raise ValueError(f"count={count} is not a whole number of rows of {epilogue.row} elements")


def evaluate(
    spec: Spec,
    inputs: Sequence[np.ndarray],
    count: int,
    dtype: DType | str = DType.FLOAT32,
    op: ReduceOp | str | None = None,
    operands: Sequence[dict] | None = None,
) -> list[np.ndarray]:
    """Each rank's expected output for ``inputs`` (one 1-D storage array per rank).

    ``count`` is the number of elements in one chunk.  ``op`` is required for a reduce
    collective and ignored for a copy.  Under ``copy replicated`` the producers must agree.

    With an epilogue, ``operands[rank]`` maps each operand's name to its value on that rank
    (``Epilogue.operands`` says which); the epilogue then runs on every rank's reduced output,
    and the rows operands it writes are updated in place, as the kernels do.
    """
    dtype = DType.parse(dtype.value if isinstance(dtype, DType) else dtype)
    check_count("count", count)
    check_epilogue_dtype(spec, dtype)
    check_rows_count(spec.epilogue, count)  # rows that straddled chunks were normalised across them
    _check_inputs(spec, inputs, count, dtype)

    def chunk_of(slot) -> np.ndarray:
        return inputs[slot.rank][slot.position * count:(slot.position + 1) * count]

    reduce_op = None
    if spec.is_reduce:
        if op is None:
            raise ValueError(f"{spec.name} is a reduction: give op (sum, prod, max or min)")
        reduce_op = ReduceOp.parse(op)
        if not dtype.reducible:
            raise ValueError(f"{dtype.value} cannot be reduced (fp8 is supported for copies only)")

    outputs = []
    for rank in range(spec.world_size):
        out = np.empty(len(spec.outputs[rank]) * count, dtype=dtype.storage)
        for position, slots in enumerate(spec.sources[rank]):
            target = out[position * count:(position + 1) * count]
            if reduce_op is not None:
                target[:] = reduce_chunks([chunk_of(s) for s in slots], dtype, reduce_op)
                continue
            first = chunk_of(slots[0])
            for other in slots[1:]:
                if not np.array_equal(first.view(np.uint8), chunk_of(other).view(np.uint8)):
                    raise ValueError(
                        f"'copy replicated' promises identical producers, but {spec.outputs[rank][position]} "
                        f"differs between {slots[0]} and {other}"
                    )
            target[:] = first
        outputs.append(out)
    if spec.epilogue is not None:
        if operands is None or len(operands) != spec.world_size:
            raise ValueError(f"{spec.name} has an epilogue: give operands, one dict per rank")
        for rank, out in enumerate(outputs):
            run_epilogue(spec.epilogue, out, operands[rank], dtype)
    return outputs


def run_epilogue(epilogue: Epilogue, out: np.ndarray, operands: dict, dtype: DType,
                 lo: int = 0, hi: int | None = None) -> None:
    """Apply ``epilogue`` to elements ``[lo, hi)`` (whole rows) of one rank's output ``out``
    (storage of ``dtype``), in place; the rows operands it writes are updated in place too."""
    hi = out.shape[0] if hi is None else hi
    row = epilogue.row
    if lo % row or hi % row:
        raise ValueError(f"elements [{lo}, {hi}) are not whole rows of {row}")
    check_operands(epilogue, operands, out.shape[0], dtype)
    values = {}
    for operand in epilogue.operands:
        value = operands[operand.name]
        if operand.kind is OperandKind.ROWS:
            value = _widen(value[lo:hi], operand.dtype or dtype).reshape(-1, row)
        elif operand.kind is OperandKind.ROW:
            value = to_float32(value, dtype)
        values[operand.name] = value
    reduced = to_float32(out[lo:hi], dtype).reshape(-1, row)
    for name, result in apply_rows(epilogue, reduced, values).items():
        if name == OUT:
            out[lo:hi] = from_float32(result.reshape(-1), dtype)
            continue
        operands[name][lo:hi] = _narrow(result.reshape(-1), epilogue.operand(name).dtype or dtype)


def _widen(bits: np.ndarray, dtype: DType) -> np.ndarray:
    """Stored values -> float32 (fp8 too: an epilogue may read and write it)."""
    return e4m3_to_float32(bits) if dtype is DType.FLOAT8_E4M3 else to_float32(bits, dtype)


def _narrow(values: np.ndarray, dtype: DType) -> np.ndarray:
    """float32 -> stored values, round to nearest even (fp8 saturates)."""
    return e4m3_from_float32(values) if dtype is DType.FLOAT8_E4M3 else from_float32(values, dtype)


def check_operands(epilogue: Epilogue, operands: dict, numel: int, dtype: DType) -> None:
    """Every operand present, with its storage dtype and shape (``numel``: the rank's output)."""
    eps = eps_operand(epilogue)
    unknown = sorted(set(operands) - {o.name for o in epilogue.operands})
    if unknown:  # as the runtime refuses it: a misspelt operand is not silently unused
        raise ValueError(f"unknown epilogue operand '{unknown[0]}'; the epilogue takes "
                         f"{', '.join(o.name for o in epilogue.operands)}")
    for operand in epilogue.operands:
        if operand.name not in operands:
            raise ValueError(f"missing epilogue operand '{operand.name}'")
        value = operands[operand.name]
        if operand.kind is OperandKind.SCALAR:  # what the runtime refuses, the oracle refuses too
            problem = scalar_problem(value, is_eps=operand.name == eps)
            if problem is not None:
                raise ValueError(f"operand '{operand.name}': {problem[0]}")
            continue
        want = (operand.dtype or dtype).storage
        shape = (numel,) if operand.kind is OperandKind.ROWS else (epilogue.row,)
        if not hasattr(value, "dtype") or not hasattr(value, "shape"):
            raise ValueError(f"operand '{operand.name}': expected a NumPy array of {want} {shape}, "
                             f"got {type(value).__name__}")
        if value.dtype != want or value.shape != shape:
            raise ValueError(f"operand '{operand.name}': expected {want} {shape}, got {value.dtype} {value.shape}")


# ---- run-time sizes (docs/LANGUAGE.md, "Run-time sizes") ----------------------------------

SIZE_ERROR_KINDS = ("capacity", "input", "output", "expected")  # what a size error is about (codes 1 to 4)


def sent_sizes(given: Sequence[int], capacity: int, in_length: int) -> tuple[list[int], list[int], list[tuple]]:
    """What a producer sends for its input chunks of sizes ``given``: (offsets, sent sizes,
    errors).  Offsets are the prefix sums of the given sizes clamped to 0..capacity (the
    caller packed its input by its sizes); a size outside 0..capacity, or a chunk reaching past
    ``in_length`` elements, is sent as 0 and reported as (position, kind, size, bound)."""
    offsets, sent, errors = [], [], []
    offset = 0
    for position, size in enumerate(int(v) for v in given):
        offsets.append(offset)
        if not 0 <= size <= capacity:
            sent.append(0)
            errors.append((position, "capacity", size, capacity))
        elif offset + size > in_length:
            sent.append(0)
            errors.append((position, "input", size, in_length - offset))
        else:
            sent.append(size)
        offset += min(max(size, 0), capacity)
    return offsets, sent, errors


def received_sizes(incoming: Sequence[int], out_length: int, expected: Sequence[int] | None = None,
                   capacity: int | None = None) -> tuple[list[int], list[int], list[tuple]]:
    """What a consumer writes for output chunks arriving with sizes ``incoming``: (offsets,
    written sizes, errors); a chunk reaching past ``out_length`` is written as 0.

    With ``expected`` (the sizes the caller expects to receive, as torch's
    ``output_split_sizes``), the output is laid out by them instead: chunk m starts at the sum
    of the expected sizes before it (each clamped to 0..capacity), whatever arrives, and a
    chunk arriving with another size than expected is written as 0 and reported, so the other
    chunks land where the caller looks for them."""
    if expected is not None and capacity is None:
        raise ValueError("expected sizes need the capacity (offsets clamp them to 0..capacity)")
    offsets, written, errors = [], [], []
    offset = 0
    for position, size in enumerate(incoming):
        offsets.append(offset)
        want = None if expected is None else int(expected[position])
        if want is not None and size != want:
            written.append(0)
            errors.append((position, "expected", size, want))
        elif offset + size > out_length:
            written.append(0)
            errors.append((position, "output", size, out_length - offset))
        else:
            written.append(size)
        offset += written[-1] if want is None else min(max(want, 0), capacity)
    return offsets, written, errors


def arriving_sizes(spec: Spec, sent: Sequence[Sequence[int]]) -> list[list[int]]:
    """Per rank, the size each of its output chunks arrives with: what its producer sends
    (``sent[r]``: rank r's sent sizes, ``sent_sizes``), in output order."""
    return [[sent[slot.rank][slot.position] for (slot, *_) in spec.sources[rank]] for rank in range(spec.world_size)]


def _integers(name: str, values, length: int) -> list[int]:
    """``values`` as ``length`` Python ints: integers only (NumPy's too), since a float or a
    bool size would be truncated into a size nobody gave."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer):
            raise ValueError(f"{name}: expected a 1-D array of {length} integers, got {values.dtype} {values.shape}")
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise ValueError(f"{name}: expected a sequence of {length} integers, got {type(values).__name__}")
    if len(values) != length:
        raise ValueError(f"{name}: expected {length} integers, got {len(values)}")
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name}[{i}]: expected an integer, got {value!r} ({type(value).__name__})")
    return [int(v) for v in values]


def _per_rank(name: str, values, world_size: int) -> None:
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)) or len(values) != world_size:
        got = len(values) if isinstance(values, (Sequence, np.ndarray)) else type(values).__name__
        raise ValueError(f"{name}: expected one per rank ({world_size}), got {got}")


def check_sized_call(spec: Spec, inputs, sizes, capacity, outputs, expected=None):
    """A sized call's arguments as ``evaluate_sized`` and the simulator take them, checked and
    normalized: (inputs, sizes, outputs, expected), buffers 1-D arrays of one dtype, sizes and
    expected sizes Python ints.  Sizes may be negative or past the capacity (the call reports
    those as size errors); what is refused is what no call could be given."""
    R = spec.world_size
    check_count("capacity", capacity, least=1)  # as a load: a capacity of 0 holds no chunk
    for name, values in (("inputs", inputs), ("outputs", outputs), ("sizes", sizes)):
        _per_rank(name, values, R)
    buffers = {}
    for name, values in (("input", inputs), ("output", outputs)):
        for rank, array in enumerate(values):
            if not isinstance(array, np.ndarray) or array.ndim != 1:
                shape = array.shape if isinstance(array, np.ndarray) else type(array).__name__
                raise ValueError(f"{name} of rank {rank}: expected a 1-D NumPy array (the rank's whole buffer), got {shape}")
            buffers[(name, rank)] = array
    first = inputs[0].dtype
    for (name, rank), array in buffers.items():
        if array.dtype != first:
            raise ValueError(f"{name} of rank {rank}: dtype {array.dtype}, expected {first} (that of rank 0's input): "
                             "a call moves one dtype")
    sizes = [_integers(f"sizes of rank {r}", sizes[r], len(spec.inputs[r])) for r in range(R)]
    if expected is not None:
        _per_rank("expected", expected, R)
        expected = [None if expected[r] is None else
                    _integers(f"expected sizes of rank {r}", expected[r], len(spec.outputs[r])) for r in range(R)]
    return list(inputs), sizes, list(outputs), expected


def evaluate_sized(spec: Spec, inputs: Sequence[np.ndarray], sizes: Sequence[Sequence[int]], capacity: int,
                   outputs: Sequence[np.ndarray], expected: Sequence[Sequence[int] | None] | None = None,
                   ) -> tuple[list[np.ndarray], list[list[int]], list[list[tuple]]]:
    """The meaning of a call with run-time sizes: (outputs, out sizes, errors per rank).

    ``inputs[r]`` and ``outputs[r]`` are rank r's whole buffers (1-D, any length: their
    lengths are the bounds), ``sizes[r]`` the sizes of rank r's input chunks in layout order.
    The outputs returned are copies of ``outputs`` with the received chunks written, packed;
    elements past them keep their values.  ``expected[r]`` (optional, one per output chunk of
    rank r, or None) lays rank r's output out by the sizes it expects (``received_sizes``).
    Errors: (buffer, position, kind, size, bound)."""
    if spec.sizes is None:
        raise ValueError(f"{spec.name} has no run-time sizes: use evaluate()")
    R = spec.world_size
    inputs, sizes, outputs, expected = check_sized_call(spec, inputs, sizes, capacity, outputs, expected)
    sent = [sent_sizes(sizes[r], capacity, len(inputs[r])) for r in range(R)]
    arriving = arriving_sizes(spec, [s[1] for s in sent])
    results, out_sizes, errors = [], [], []
    for rank in range(R):
        offsets, written, out_errors = received_sizes(arriving[rank], len(outputs[rank]),
                                                      None if expected is None else expected[rank], capacity)
        out = np.array(outputs[rank], copy=True)
        for position, ((slot, *_), offset, size) in enumerate(zip(spec.sources[rank], offsets, written)):
            start = sent[slot.rank][0][slot.position]
            out[offset:offset + size] = inputs[slot.rank][start:start + size]
        results.append(out)
        out_sizes.append(written)
        errors.append([("in", *e) for e in sent[rank][2]] + [("out", *e) for e in out_errors])
    return results, out_sizes, errors
