"""Element types and reduction operators, shared by every layer.

NumPy has no bfloat16 or fp8, so each type has a NumPy *storage* dtype holding its bits
(uint16 for bf16, uint8 for fp8) and exact conversions to and from float32.  Reductions
accumulate in float32 (int32 and int64 wrap in their own width) and round once, which is also what the
generated kernels do, so the evaluator's answer is bit-exact for a fixed summation order.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from typing import TYPE_CHECKING

from purlinc.registry import Registry, UnknownNameError

if TYPE_CHECKING:  # NumPy is imported where values are touched: DType alone stays cheap
    import numpy as np


class DType(Enum):
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    INT32 = "int32"
    INT64 = "int64"
    FLOAT8_E4M3 = "float8_e4m3"
    FLOAT8_E5M2 = "float8_e5m2"

    @property
    def info(self) -> "DTypeInfo":
        """This type's record in ``DTYPES``: everything every layer knows about it."""
        return DTYPES.get(self.value)

    @property
    def itemsize(self) -> int:
        return self.info.itemsize

    @property
    def storage(self) -> np.dtype:
        """The NumPy dtype whose values are this type's bit patterns (or values)."""
        import numpy as np

        return np.dtype(self.info.numpy_storage)

    @property
    def reducible(self) -> bool:
        """fp8 is a storage format here: copies only."""
        return self.info.reducible

    @property
    def is_float(self) -> bool:
        return self.info.is_float

    @property
    def short(self) -> str:
        return self.info.short

    @classmethod
    def parse(cls, text: "str | DType") -> "DType":
        """A DType from its name or an alias (``bf16``, ``torch.float16``, ...); an
        UnknownNameError (a PurlinError and a ValueError) listing the names otherwise."""
        if isinstance(text, DType):
            return text
        try:
            return DTYPES.get(str(text).lower().replace("torch.", "")).dtype
        except UnknownNameError as error:  # named as given: True was shown as 'true', None as 'none'
            raise UnknownNameError(f"unknown dtype {str(text)!r}", notes=error.notes) from None


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
        except ValueError:  # a PurlinError (rendered, exit 2) and a ValueError, as an unknown dtype is
            names = ", ".join(op.value for op in cls)
            raise UnknownNameError(f"unknown reduce op {text!r}; expected one of {names}") from None


@dataclass(frozen=True, slots=True)
class DTypeInfo:
    """One element type, for every layer: the evaluator's NumPy storage, the generated
    code's C types and ``elem.cuh`` helpers, the runtime's torch / DLPack /
    ``__cuda_array_interface__`` names."""

    dtype: DType
    itemsize: int
    short: str  # kernel names, benchmark labels
    numpy_storage: str  # the NumPy dtype holding its bits (NumPy has no bf16 / fp8)
    c_storage: str  # C type holding one element's bits
    c_acc: str | None  # accumulator C type; None: not reducible (a storage format, copies only)
    c_suffix: str  # elem.cuh: purlin_<suffix>_to_acc / purlin_acc_to_<suffix>
    c_ops: str  # elem.cuh: purlin_<op>_<c_ops> ("f" or "i")
    is_float: bool
    torch_name: str  # attribute of the torch module
    typestr: str | None  # __cuda_array_interface__ typestr, where it has its own
    dlpack: tuple[int, int]  # (type code, bits): 0 int, 1 uint, 2 float, 4 bfloat, 10 e4m3fn, 12 e5m2
    aliases: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.dtype.value

    @property
    def reducible(self) -> bool:
        return self.c_acc is not None


_RECORDS = (
    DTypeInfo(DType.FLOAT32, 4, "f32", "float32", "float", "float", "f32", "f", True, "float32", "<f4", (2, 32),
              ("float", "fp32")),
    DTypeInfo(DType.FLOAT16, 2, "f16", "float16", "unsigned short", "float", "f16", "f", True, "float16", "<f2",
              (2, 16), ("half", "fp16")),
    DTypeInfo(DType.BFLOAT16, 2, "bf16", "uint16", "unsigned short", "float", "bf16", "f", True, "bfloat16", None,
              (4, 16), ()),
    DTypeInfo(DType.INT32, 4, "i32", "int32", "int", "int", "i32", "i", False, "int32", "<i4", (0, 32), ("int",)),
    DTypeInfo(DType.INT64, 8, "i64", "int64", "long long", "long long", "i64", "l", False, "int64", "<i8", (0, 64),
              ("long",)),
    DTypeInfo(DType.FLOAT8_E4M3, 1, "e4m3", "uint8", "unsigned char", None, "", "", True, "float8_e4m3fn", None,
              (10, 8), ("float8_e4m3fn", "fp8_e4m3")),
    DTypeInfo(DType.FLOAT8_E5M2, 1, "e5m2", "uint8", "unsigned char", None, "", "", True, "float8_e5m2", None,
              (12, 8), ("fp8_e5m2",)),
)

DTYPES: Registry[DTypeInfo] = Registry(
    "dtype", _RECORDS, aliases={alias: r.name for r in _RECORDS for alias in (r.short, *r.aliases)},
)


def reduction_problem(dtype: DType, collective: str) -> tuple[str, str] | None:
    """(reason, note) where the reduction ``collective`` cannot run in ``dtype`` (fp8, a storage
    format), or None: the words the command line's --dtype check and draw's timeline share."""
    if dtype.reducible:
        return None
    reducible = ", ".join(d.value for d in DType if d.reducible)
    return (f"{dtype.value} cannot be reduced, and the collective {collective} is a reduction",
            f"a reduction takes {reducible}; fp8 is supported for copies only")


def to_float32(bits: np.ndarray, dtype: DType) -> np.ndarray:
    """Exact widening of stored values to float32 (int32 and int64 are returned as int64)."""
    import numpy as np

    if dtype is DType.FLOAT32:
        return bits.astype(np.float32)
    if dtype is DType.FLOAT16:
        return bits.astype(np.float32)
    if dtype is DType.BFLOAT16:
        return (bits.astype(np.uint32) << 16).view(np.float32)
    if dtype in (DType.INT32, DType.INT64):
        return bits.astype(np.int64)
    raise ValueError(f"{dtype.value} cannot be reduced (fp8 is supported for copies only)")


def from_float32(values: np.ndarray, dtype: DType, *, canonical_nan: bool = True) -> np.ndarray:
    """Round float32 (or int64 for int32) values to ``dtype``'s storage, round-to-nearest-even.

    A result's NaN leaves as the canonical quiet NaN, whatever NumPy's loops made of its
    operands' payloads (its SIMD loop and its remainder keep different ones, so the bits
    depended on the count); the kernels' NaN payloads are the GPU's own, which no test
    compares.  ``canonical_nan=False`` keeps float32 and float16 payloads (inputs made to carry
    them, as the GPU tests' are); bfloat16's NaN is 0x7fc0 either way, as the kernels make it."""
    import numpy as np

    if dtype is DType.FLOAT32:
        values = values.astype(np.float32)
        return np.where(np.isnan(values), np.float32(np.nan), values) if canonical_nan else values
    if dtype is DType.FLOAT16:
        with np.errstate(over="ignore"):  # past 65504 rounds to infinity, as the GPU's conversion does
            values = values.astype(np.float32).astype(np.float16)
        return np.where(np.isnan(values), np.float16(np.nan), values) if canonical_nan else values
    if dtype is DType.BFLOAT16:
        bits = values.astype(np.float32).view(np.uint32)
        nan = np.isnan(values)
        rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
        rounded = ((bits + rounding) >> 16).astype(np.uint16)
        return np.where(nan, np.uint16(0x7FC0), rounded).astype(np.uint16)
    if dtype is DType.INT32:
        return values.astype(np.int64).astype(np.int32)  # wraps, as int32 addition does on the GPU
    if dtype is DType.INT64:
        return values.astype(np.int64)
    raise ValueError(f"{dtype.value} cannot be reduced (fp8 is supported for copies only)")


FLOAT32_MAX = 3.4028234663852886e38  # float32's largest finite value (epilogues compute in float32)
FLOAT32_TINY = 1.401298464324817e-45  # the smallest positive float32 (a subnormal)
E4M3_MAX = 448.0  # largest finite float8_e4m3 (fn: no infinities; 0x7F / 0xFF are NaN)


def e4m3_from_float32(values: np.ndarray) -> np.ndarray:
    """float32 -> float8_e4m3 bits, round to nearest even, saturating to +-448 (NaN -> 0x7F).
    The kernels' ``purlin_acc_to_e4m3`` (templates/epilogue.cuh.j2) computes the same bits."""
    import numpy as np

    v = np.asarray(values, dtype=np.float32)
    sign = ((v.view(np.uint32) >> 24) & 0x80).astype(np.uint8)
    nan = np.isnan(v)
    a = np.minimum(np.where(nan, np.float32(0), np.abs(v)), np.float32(E4M3_MAX)).astype(np.float32)
    subnormal = np.rint(a * np.float32(512)).astype(np.int64)  # below 2^-6: steps of 2^-9 (8 = 2^-6)
    u = a.view(np.uint32).astype(np.int64)
    u = u + 0x7FFFF + ((u >> 20) & 1)  # keep 3 mantissa bits, round half to even
    normal = np.minimum((((u >> 23) - 120) << 3) | ((u >> 20) & 7), 0x7E)
    bits = np.where(a < np.float32(2.0**-6), subnormal, normal).astype(np.uint8) | sign
    return np.where(nan, np.uint8(0x7F), bits).astype(np.uint8)


def e4m3_to_float32(bits: np.ndarray) -> np.ndarray:
    """float8_e4m3 bits -> float32, exactly."""
    import numpy as np

    b = np.asarray(bits, dtype=np.uint8).astype(np.uint32)
    e, m = (b >> 3) & 15, b & 7
    normal = (((e + 120) << 23) | (m << 20)).astype(np.uint32).view(np.float32)
    magnitude = np.where(e > 0, normal, m.astype(np.float32) * np.float32(2.0**-9)).astype(np.float32)
    values = np.where((b & 0x80) != 0, -magnitude, magnitude).astype(np.float32)
    return np.where((b & 0x7F) == 0x7F, np.float32(np.nan), values).astype(np.float32)


def random_values(rng: np.random.Generator, size: int, dtype: DType, *, small: bool = False) -> np.ndarray:
    """Fresh random data in ``dtype``'s storage; ``small`` keeps products and sums exact-ish.

    Floats avoid NaN patterns so results can be compared bitwise.
    """
    import numpy as np

    if dtype is DType.INT32:
        high = 8 if small else 1 << 20
        return rng.integers(-high, high, size=size, dtype=np.int64).astype(np.int32)
    if dtype is DType.INT64:  # beyond 32 bits, so a kernel that dropped the high word would show
        high = 8 if small else 1 << 40
        return rng.integers(-high, high, size=size, dtype=np.int64)
    if dtype in (DType.FLOAT8_E4M3, DType.FLOAT8_E5M2):
        bits = rng.integers(0, 256, size=size, dtype=np.uint16).astype(np.uint8)
        return bits
    values = rng.uniform(0.5, 2.0, size=size) if small else rng.standard_normal(size)
    return from_float32(values.astype(np.float32), dtype)
