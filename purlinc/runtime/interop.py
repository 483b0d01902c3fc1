"""What the runtime needs to know about a caller's array, from torch, CuPy,
``__cuda_array_interface__`` or DLPack, without importing any of them eagerly.

``describe(x)`` returns an :class:`ArrayInfo`: pointer, element count, Purlin dtype, device,
contiguity, and which library it came from (so an output can be allocated to match).
``current_stream(x, device)`` is the caller's current stream on that device as an int.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass

from purlinc.dtypes import DTYPES, DType

TORCH, CUPY, CAI, DLPACK = "torch", "cupy", "cuda_array_interface", "dlpack"


@dataclass(frozen=True, slots=True)
class ArrayInfo:
    ptr: int
    numel: int
    dtype: DType | None  # None: a type Purlin does not support (``dtype_name`` says which)
    dtype_name: str
    device: int  # CUDA ordinal; -1 when the array is not on a CUDA device
    contiguous: bool
    kind: str  # TORCH, CUPY, CAI or DLPACK
    place: str = "the host"  # where a non-CUDA array lies, as messages name it (torch's "meta", say)
    negated: bool = False  # a torch view whose memory holds the negation of its values (x.is_neg())
    layout: str = ""  # a strided torch view's shape and strides, for the refusal that names it

    @property
    def nbytes(self) -> int:
        return self.numel * (self.dtype.itemsize if self.dtype else 0)


# ---------------------------------------------------------------------------------------------
# torch (the hot path: attribute reads only)

_TORCH_DTYPES: dict = {}


def _torch_dtype_map() -> dict:
    if not _TORCH_DTYPES:
        import torch

        # the dtype registry's torch names (fp8 types are missing from older torch builds)
        _TORCH_DTYPES.update({getattr(torch, r.torch_name): r.dtype for r in DTYPES.records()
                              if hasattr(torch, r.torch_name)})
    return _TORCH_DTYPES


def _is_torch(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _is_cupy(x) -> bool:
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray)


def _describe_torch(x) -> ArrayInfo:
    dtype = _torch_dtype_map().get(x.dtype)
    device = x.device
    contiguous = x.is_contiguous()
    return ArrayInfo(
        x.data_ptr(), x.numel(), dtype, str(x.dtype).replace("torch.", ""),
        device.index if device.type == "cuda" else -1, contiguous, TORCH,
        "the host" if device.type == "cpu" else str(device), x.is_neg(),
        "" if contiguous else f"shape {tuple(x.shape)}, strides {x.stride()}",
    )


# ---------------------------------------------------------------------------------------------
# __cuda_array_interface__ (CuPy, Numba, ...)

_TYPESTR = {r.typestr: r.dtype for r in DTYPES.records() if r.typestr}
_TYPESTR_NAMES = {"<f4": "float32", "<f2": "float16", "<f8": "float64", "<i4": "int32", "<i8": "int64",
                  "<i2": "int16", "|i1": "int8", "<u8": "uint64", "<u4": "uint32", "<u2": "uint16", "<u1": "uint8",
                  "|u1": "uint8"}


def _c_contiguous(shape, strides, itemsize: int) -> bool:
    if strides is None:
        return True
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


def _numel(shape) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def _describe_cai(x, kind: str = CAI) -> ArrayInfo:
    cai = x.__cuda_array_interface__
    typestr = cai["typestr"]
    dtype = _TYPESTR.get(typestr)
    if dtype is None and typestr in ("<V2", "|V2") and "bfloat16" in str(getattr(x, "dtype", "")):
        dtype = DType.BFLOAT16
    ptr = int(cai["data"][0] or 0)
    shape = tuple(cai["shape"])
    if any(dim < 0 for dim in shape):
        raise TypeError(f"__cuda_array_interface__ has shape {shape}, expected no negative dimension")
    itemsize = int(typestr[2:]) if typestr[2:].isdigit() else 1
    numel = _numel(shape)
    if kind == CUPY:
        device = int(x.device.id)  # CuPy knows; its pools need not answer pointer queries alike
    else:
        device = _device_of_pointer(ptr) if numel else _current_device_fallback()
    return ArrayInfo(
        ptr, numel, dtype, _TYPESTR_NAMES.get(typestr, str(getattr(x, "dtype", typestr))), device,
        _c_contiguous(shape, cai.get("strides"), itemsize), kind,
    )


def _device_of_pointer(ptr: int) -> int:
    from purlinc.runtime import driver

    try:
        return driver.pointer_device(ptr)
    except Exception:
        return -1


def _current_device_fallback() -> int:
    return -1


# ---------------------------------------------------------------------------------------------
# DLPack (anything exporting __dlpack__ / __dlpack_device__)

KDL_CUDA = 2


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64),
    ]


# (code, bits) -> DType; codes: 0 int, 1 uint, 2 float, 4 bfloat, 10 float8_e4m3fn, 12 float8_e5m2
_DL_DTYPES = {r.dlpack: r.dtype for r in DTYPES.records()}

_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def dlpack_tensor(capsule) -> _DLTensor:
    """The DLTensor inside a (legacy, unversioned) ``dltensor`` capsule; the capsule keeps it alive."""
    address = _capsule_pointer(capsule, b"dltensor")
    return _DLTensor.from_address(address)  # DLManagedTensor starts with its DLTensor


def _describe_dlpack(x) -> ArrayInfo:
    device_type, device_id = x.__dlpack_device__()
    capsule = x.__dlpack__()
    t = dlpack_tensor(capsule)
    shape = [t.shape[i] for i in range(t.ndim)]
    strides = [t.strides[i] for i in range(t.ndim)] if t.strides else None
    code, bits = t.dtype.code, t.dtype.bits
    dtype = _DL_DTYPES.get((code, bits)) if t.dtype.lanes == 1 else None
    itemsize = max(bits // 8, 1)
    info = ArrayInfo(
        int(t.data or 0) + int(t.byte_offset), _numel(shape), dtype, f"dlpack(code={code}, bits={bits})",
        int(device_id) if device_type == KDL_CUDA else -1,
        _c_contiguous(shape, [s * itemsize for s in strides] if strides else None, itemsize), DLPACK,
    )
    del capsule  # the producer (x) owns the memory; the capsule only held metadata
    return info


def describe(x) -> ArrayInfo:
    if _is_torch(x):
        return _describe_torch(x)
    if _is_cupy(x):
        return _describe_cai(x, CUPY)
    if hasattr(x, "__cuda_array_interface__"):
        return _describe_cai(x)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return _describe_dlpack(x)
    raise TypeError(
        f"expected a torch tensor, a CuPy array, or an object with __cuda_array_interface__ or "
        f"DLPack (__dlpack__/__dlpack_device__), got {type(x).__name__}"
    )


def described(where: str, label: str, value) -> ArrayInfo:
    """``describe(value)``, its refusal of a non-array (or of one DLPack cannot export: a read-only
    NumPy array's BufferError) an ArgumentError naming the argument."""
    from purlinc.runtime.errors import ArgumentError

    if value is None:
        raise ArgumentError(f"{where}: {label} is required, got None")
    try:
        return describe(value)
    except (TypeError, BufferError) as error:
        raise ArgumentError(f"{where}: {label}: {error}") from None


# ---------------------------------------------------------------------------------------------
# streams and allocation

_raw_torch_stream = None


def torch_module():
    """torch if the caller has imported it (Purlin never imports it on its own)."""
    return sys.modules.get("torch")


def current_stream(kind: str, device: int) -> int:
    """The caller's current stream on ``device`` (torch's or CuPy's), as an int handle."""
    global _raw_torch_stream
    if kind == TORCH:
        if _raw_torch_stream is None:
            import torch

            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            _raw_torch_stream = raw if raw is not None else (
                lambda dev: torch.cuda.current_stream(dev).cuda_stream
            )
        return _raw_torch_stream(device)
    if kind == CUPY:
        import cupy

        return cupy.cuda.get_current_stream().ptr
    return 0  # legacy default stream: pass stream= to order against anything else


def stream_handle(stream) -> int:
    """An int stream handle from torch.cuda.Stream, cupy Stream, a binding CUstream or an int.
    Anything else is refused by name: int() would read "7" as a stream, cut 1.5 to 1 (the
    legacy stream) and hand the driver -1."""
    if stream is None:
        return 0
    value = stream
    for attr in ("cuda_stream", "ptr"):  # torch, cupy
        if hasattr(stream, attr):
            value = getattr(stream, attr)
            break
    # a CUstream of cuda.bindings has __int__; a float or a str has an int() that is no handle
    if not isinstance(value, (str, bytes, float, bool)) and hasattr(value, "__int__") and int(value) >= 0:
        return int(value)
    from purlinc.runtime.errors import ArgumentError

    raise ArgumentError(f"stream={stream!r}: expected a CUDA stream (torch.cuda.Stream, a CuPy stream, a CUstream, "
                        "or a handle as an int >= 0)")


def empty_like_kind(kind: str, numel: int, dtype: DType, device: int, like=None):
    """A fresh 1-D output of ``numel`` elements, of the same library as the input."""
    if kind == TORCH:
        import torch

        table = {v: k for k, v in _torch_dtype_map().items()}
        return torch.empty(numel, dtype=table[dtype], device=f"cuda:{device}")
    if kind == CUPY:
        import cupy

        with cupy.cuda.Device(device):
            return cupy.empty(numel, dtype=dtype.storage)
    raise TypeError(
        f"cannot allocate an output for a {kind} input: pass out= (a torch tensor or CuPy array works too)"
    )
