"""Element types: the C storage, accumulator and conversion names of each dtype (elem.cuh),
read from its record in the dtype registry (``purlinc.dtypes.DTYPES``)."""

from __future__ import annotations

from purlinc.dtypes import DType, ReduceOp


def elem_values(dtype: DType, op: ReduceOp | None) -> dict:
    info = dtype.info
    if op is None:
        return {"storage": info.c_storage, "reduce": False}
    return {
        "storage": info.c_storage,
        "reduce": True,
        "acc": info.c_acc,
        "to_acc": f"purlin_{info.c_suffix}_to_acc",
        "from_acc": f"purlin_acc_to_{info.c_suffix}",
        "combine": f"purlin_{op.value}_{info.c_ops}",
    }
