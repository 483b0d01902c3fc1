"""What the epilogue kernels need of a row: the rule that code generation checks (``epilogue.
check_rows``) and the runtime sizes staging by (``runtime.prepared.least_stage_bytes``), in a
module of its own so the runtime reads it without importing the code generator."""

from __future__ import annotations

from purlinc.dtypes import DType

# The rule itself is the front end's (a row no dtype runs is refused when a spec is checked);
# the atom layer, the runtime and draw read it from here, beside what staging makes of it.
from purlinc.frontend.epilogue import MAX_ROW_VECTORS, VECTOR_BYTES, row_problem

__all__ = ["MAX_ROW_VECTORS", "VECTOR_BYTES", "row_bytes_run", "row_problem"]


def row_bytes_run(row: int) -> tuple[int, ...]:
    """The bytes of a row of ``row`` elements in each dtype an epilogue runs them in (what a
    slice of staging must hold one of)."""
    return tuple(sorted({row * d.itemsize for d in DType if row_problem(row, d) is None}))
