"""Element types: the C storage, accumulator and conversion names of each dtype (elem.cuh),
read from its record in the dtype registry (``purlinc.dtypes.DTYPES``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from purlinc.dtypes import DType, ReduceOp


@dataclass(frozen=True, slots=True)
class VectorConversions:
    """elem.cuh's conversions of a vector's elements at once (a word or a pair per instruction):
    widening to the accumulator, rounding to the element type, and rounding there and back in
    place.  None: one element at a time."""

    to_acc_n: str | None = None
    from_acc_n: str | None = None
    round_acc_n: str | None = None


_VECTOR_CONVERSIONS = {"bf16": VectorConversions("purlin_bf16_to_acc_n", "purlin_acc_to_bf16_n", "purlin_round_bf16_n")}


# elem.cuh's sum of two sources' vectors rounded and widened at once (a pair per instruction),
# by element type: where a reduce of two sources feeds a fused epilogue, whose reduced values
# are used, not stored.
_PAIR_SUMS = {"bf16": "purlin_bf16_sum2_n"}


def pair_sum(dtype: DType, op: ReduceOp | None) -> str | None:
    """elem.cuh's function summing two sources' vectors of ``dtype`` in one step, or None
    (another element type or reduction: the accumulator path)."""
    return _PAIR_SUMS.get(dtype.info.c_suffix) if op is ReduceOp.SUM else None


def vector_conversions(suffix: str) -> VectorConversions:
    """Those of the element type with this elem.cuh suffix (``DTypeInfo.c_suffix``)."""
    return _VECTOR_CONVERSIONS.get(suffix, VectorConversions())


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
        **asdict(vector_conversions(info.c_suffix)),  # to_acc_n, from_acc_n, round_acc_n
    }
