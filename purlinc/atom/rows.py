"""What the epilogue kernels need of a row: the rule that code generation checks (``epilogue.
check_rows``) and the runtime sizes staging by (``runtime.prepared.least_stage_bytes``), in a
module of its own so the runtime reads it without importing the code generator."""

from __future__ import annotations

from purlinc.dtypes import DType

VECTOR_BYTES = 16
MAX_ROW_VECTORS = 2048  # rows up to 32 KiB (16,384 bf16 elements): at most 8 vectors per thread of 256


def row_problem(row: int, dtype: DType) -> str | None:
    """Why rows of ``row`` elements of ``dtype`` cannot run an epilogue, or None."""
    if dtype.info.c_acc != "float":
        return f"an epilogue computes in float32; {dtype.value} outputs are not supported"
    row_bytes = row * dtype.itemsize
    # the length first: of a row of 2**63 - 1 elements, "not a multiple of 16 bytes" is true but
    # suggests one element more would do
    if row_bytes > MAX_ROW_VECTORS * VECTOR_BYTES:
        return (f"a row of {row:,} {dtype.value} elements is longer than the epilogue supports "
                f"({MAX_ROW_VECTORS * VECTOR_BYTES // dtype.itemsize:,} elements)")
    if row_bytes % VECTOR_BYTES:
        return (f"a row of {row} {dtype.value} elements is {row_bytes} bytes, not a multiple of {VECTOR_BYTES} "
                "(the kernels move 16-byte vectors)")
    return None


def row_bytes_run(row: int) -> tuple[int, ...]:
    """The bytes of a row of ``row`` elements in each dtype an epilogue runs them in (what a
    slice of staging must hold one of)."""
    return tuple(sorted({row * d.itemsize for d in DType if row_problem(row, d) is None}))
