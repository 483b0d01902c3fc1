"""Element types: the C storage, accumulator and conversion names of each dtype (elem.cuh)."""

from __future__ import annotations

from dataclasses import dataclass

from purlinc.dtypes import DType, ReduceOp


@dataclass(frozen=True, slots=True)
class Elem:
    storage: str  # C type holding one element's bits
    acc: str  # accumulator type
    suffix: str  # purlin_<suffix>_to_acc / purlin_acc_to_<suffix> in elem.cuh
    ops: str  # "f" or "i": purlin_<op>_<ops>


ELEMS = {
    DType.FLOAT32: Elem("float", "float", "f32", "f"),
    DType.FLOAT16: Elem("unsigned short", "float", "f16", "f"),
    DType.BFLOAT16: Elem("unsigned short", "float", "bf16", "f"),
    DType.INT32: Elem("int", "int", "i32", "i"),
    DType.INT64: Elem("long long", "long long", "i64", "l"),
    DType.FLOAT8_E4M3: Elem("unsigned char", "", "", ""),
    DType.FLOAT8_E5M2: Elem("unsigned char", "", "", ""),
}


def elem_values(dtype: DType, op: ReduceOp | None) -> dict:
    elem = ELEMS[dtype]
    if op is None:
        return {"storage": elem.storage, "reduce": False}
    return {
        "storage": elem.storage,
        "reduce": True,
        "acc": elem.acc,
        "to_acc": f"purlin_{elem.suffix}_to_acc",
        "from_acc": f"purlin_acc_to_{elem.suffix}",
        "combine": f"purlin_{op.value}_{elem.ops}",
    }
