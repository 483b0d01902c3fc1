"""Element types and reduction operators, shared by every layer.

NumPy has no bfloat16 or fp8, so each type has a NumPy *storage* dtype holding its bits
(uint16 for bf16, uint8 for fp8) and exact conversions to and from float32.  Reductions
accumulate in float32 (int32 wraps in int32) and round once, which is also what the
generated kernels do, so the evaluator's answer is bit-exact for a fixed summation order.
"""

from __future__ import annotations

from enum import Enum

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # NumPy is imported where values are touched: DType alone stays cheap
    import numpy as np


class DType(Enum):
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    INT32 = "int32"
    FLOAT8_E4M3 = "float8_e4m3"
    FLOAT8_E5M2 = "float8_e5m2"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def storage(self) -> np.dtype:
        """The NumPy dtype whose values are this type's bit patterns (or values)."""
        import numpy as np

        return np.dtype(_STORAGE[self])

    @property
    def reducible(self) -> bool:
        """fp8 is a storage format here: copies only."""
        return self not in (DType.FLOAT8_E4M3, DType.FLOAT8_E5M2)

    @property
    def is_float(self) -> bool:
        return self is not DType.INT32

    @property
    def short(self) -> str:
        return _SHORT[self]

    @classmethod
    def parse(cls, text: str) -> "DType":
        key = str(text).lower().replace("torch.", "")
        if key in _ALIASES:
            return _ALIASES[key]
        names = ", ".join(sorted({d.value for d in cls}))
        raise ValueError(f"unknown dtype {text!r}; expected one of {names}")


class ReduceOp(Enum):
    SUM = "sum"
    PROD = "prod"
    MAX = "max"
    MIN = "min"

    @classmethod
    def parse(cls, text: "str | ReduceOp") -> "ReduceOp":
        if isinstance(text, ReduceOp):
            return text
        try:
            return cls(str(text).lower())
        except ValueError:
            names = ", ".join(op.value for op in cls)
            raise ValueError(f"unknown reduce op {text!r}; expected one of {names}") from None


_ITEMSIZE = {
    DType.FLOAT32: 4, DType.FLOAT16: 2, DType.BFLOAT16: 2, DType.INT32: 4,
    DType.FLOAT8_E4M3: 1, DType.FLOAT8_E5M2: 1,
}
_STORAGE = {
    DType.FLOAT32: "float32", DType.FLOAT16: "float16", DType.BFLOAT16: "uint16", DType.INT32: "int32",
    DType.FLOAT8_E4M3: "uint8", DType.FLOAT8_E5M2: "uint8",
}
_SHORT = {
    DType.FLOAT32: "f32", DType.FLOAT16: "f16", DType.BFLOAT16: "bf16", DType.INT32: "i32",
    DType.FLOAT8_E4M3: "e4m3", DType.FLOAT8_E5M2: "e5m2",
}
_ALIASES = {
    **{d.value: d for d in DType},
    **{d.short: d for d in DType},
    "float": DType.FLOAT32, "half": DType.FLOAT16, "bf16": DType.BFLOAT16, "int": DType.INT32,
    "float8_e4m3fn": DType.FLOAT8_E4M3, "float8_e5m2": DType.FLOAT8_E5M2, "fp32": DType.FLOAT32,
    "fp16": DType.FLOAT16, "fp8_e4m3": DType.FLOAT8_E4M3, "fp8_e5m2": DType.FLOAT8_E5M2,
}


def to_float32(bits: np.ndarray, dtype: DType) -> np.ndarray:
    """Exact widening of stored values to float32 (int32 is returned as int64)."""
    import numpy as np

    if dtype is DType.FLOAT32:
        return bits.astype(np.float32)
    if dtype is DType.FLOAT16:
        return bits.astype(np.float32)
    if dtype is DType.BFLOAT16:
        return (bits.astype(np.uint32) << 16).view(np.float32)
    if dtype is DType.INT32:
        return bits.astype(np.int64)
    raise ValueError(f"{dtype.value} cannot be reduced (fp8 is supported for copies only)")


def from_float32(values: np.ndarray, dtype: DType) -> np.ndarray:
    """Round float32 (or int64 for int32) values to ``dtype``'s storage, round-to-nearest-even."""
    import numpy as np

    if dtype is DType.FLOAT32:
        return values.astype(np.float32)
    if dtype is DType.FLOAT16:
        return values.astype(np.float32).astype(np.float16)
    if dtype is DType.BFLOAT16:
        bits = values.astype(np.float32).view(np.uint32)
        nan = np.isnan(values)
        rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
        rounded = ((bits + rounding) >> 16).astype(np.uint16)
        return np.where(nan, np.uint16(0x7FC0), rounded).astype(np.uint16)
    if dtype is DType.INT32:
        return values.astype(np.int64).astype(np.int32)  # wraps, as int32 addition does on the GPU
    raise ValueError(f"{dtype.value} cannot be reduced (fp8 is supported for copies only)")


def random_values(rng: np.random.Generator, size: int, dtype: DType, *, small: bool = False) -> np.ndarray:
    """Fresh random data in ``dtype``'s storage; ``small`` keeps products and sums exact-ish.

    Floats avoid NaN patterns so results can be compared bitwise.
    """
    import numpy as np

    if dtype is DType.INT32:
        high = 8 if small else 1 << 20
        return rng.integers(-high, high, size=size, dtype=np.int64).astype(np.int32)
    if dtype in (DType.FLOAT8_E4M3, DType.FLOAT8_E5M2):
        bits = rng.integers(0, 256, size=size, dtype=np.uint16).astype(np.uint8)
        return bits
    values = rng.uniform(0.5, 2.0, size=size) if small else rng.standard_normal(size)
    return from_float32(values.astype(np.float32), dtype)
