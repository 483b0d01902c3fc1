"""The disk cache's side of the pipeline: the keys of a Compiled's schedule and kernel entries
(a stable picture of their inputs), and the entries made from a schedule or kernel and read
back into one (``CachedKernel``: a kernel's source without the code generator)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass
from enum import Enum
from typing import TYPE_CHECKING

from purlinc.pipeline.source import SourceText

if TYPE_CHECKING:
    from purlinc.atom.abi import KernelABI
    from purlinc.dtypes import DType, ReduceOp
    from purlinc.frontend.spec import Spec
    from purlinc.snac.ir import Schedule


def _normal(value):
    """A JSON-able, order-stable picture of option values: dataclasses field by field (so a
    new LowerOptions field enters every key without anyone remembering to add it), enums
    by value, sets sorted."""
    if is_dataclass(value) and not isinstance(value, type):
        return {"@": type(value).__name__, **{f.name: _normal(getattr(value, f.name)) for f in fields(value)}}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (frozenset, set)):
        return sorted((_normal(v) for v in value), key=repr)
    if isinstance(value, (tuple, list)):
        return [_normal(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _normal(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "__index__"):  # a NumPy integer is the int it equals (its repr keyed np.int64(2) apart)
        return int(value.__index__())
    return repr(value)


def _front_inputs(source: SourceText, *, world_size, params, arch, options, overrides, atom,
                  algorithm=None, dtype=None, op=None, emit_cubin=None) -> dict:
    """Everything a Compiled depends on besides the package and settings (which
    cache.front_key adds).  Raw values (an algorithm name in overrides) enter as given: an
    alias misses where the canonical name would hit, which costs a compile, never a wrong
    hit.  ``dtype``, ``op`` and ``emit_cubin`` are kept for callers of the old signature."""
    overrides = dict(overrides or {})
    if algorithm is not None:
        overrides["algorithm"] = algorithm
    picture = {
        "kind": "schedule",
        "source": source.digest,
        "world_size": world_size,
        "params": _normal(dict(params or {})),
        "options": None if options is None else {"key": options.key(), "fields": _normal(options)},
        "overrides": _normal({k: v for k, v in overrides.items() if v is not None}),
        "atom": atom,
        "arch": arch,
    }
    if dtype is not None or emit_cubin is not None:
        picture.update(_kernel_inputs("", dtype, op, bool(emit_cubin)))
    return picture


def _kernel_inputs(schedule_key: str, dtype, op, emit_cubin: bool) -> dict:
    from purlinc.atom.nvrtc import nvrtc_fingerprint

    return {
        "kind": "kernel",
        "schedule": schedule_key,
        "dtype": _normal(dtype),
        "op": _normal(op),
        "cubin": bool(emit_cubin),
        "nvrtc": nvrtc_fingerprint() if emit_cubin else None,
    }


def _dtype(value) -> DType:
    from purlinc.dtypes import DType

    return DType.parse(value)


def _op(value) -> ReduceOp | None:
    if value is None:
        return None
    from purlinc.dtypes import ReduceOp

    return ReduceOp.parse(value)


def _op_text(op) -> str | None:
    if op is None:
        return None
    return str(getattr(op, "value", op)).lower()


class CachedKernel:
    """``purlinc.atom.codegen.KernelSource``'s fields and properties, rebuilt from a kernel
    cache entry without importing the code generator (and with it Jinja and NumPy)."""

    __slots__ = ("source", "filename", "kernel_base", "abi", "atom", "arch", "_dtype", "_op", "atom_start", "atom_end",
                 "trace_blocks")

    def __init__(self, header: dict, source: str, abi: KernelABI):
        self.source: str = source
        self.filename: str = header["filename"]
        self.kernel_base: str = header["kernel_base"]
        self.abi = abi
        self.atom: str = header["atom"]
        self.arch: str = header["arch"]
        self._dtype = header["dtype"]
        self._op = header["op"]
        self.atom_start: int = header["atom_start"]
        self.atom_end: int = header["atom_end"]
        # a traced kernel's blocks (per rank, per channel, the step indices of each): what its stamps mean
        self.trace_blocks: tuple = tuple(tuple(tuple(tuple(block) for block in channel) for channel in rank)
                                         for rank in header.get("trace_blocks", ()))

    @property
    def dtype(self) -> DType:
        return _dtype(self._dtype)

    @property
    def op(self) -> ReduceOp | None:
        return _op(self._op)

    @property
    def atom_source(self) -> str:
        return self.source[self.atom_start:self.atom_end]

    @property
    def orchestration_source(self) -> str:
        rest = self.source[: self.atom_start] + "<atom>" + self.source[self.atom_end:]
        return rest.replace(self.kernel_base, "<kernel>").replace(f"atom '{self.atom}'", "atom '<atom>'")


@dataclass(frozen=True, slots=True)
class Kernel:
    """One (dtype, op) of a Compiled: its CUDA source (a KernelSource, or a CachedKernel from
    the disk cache) and CUBIN (None when not asked for)."""

    cuda: object
    cubin: bytes | None
    collective: str
    params: tuple[tuple[str, int], ...]
    from_cache: bool

    @property
    def abi(self) -> KernelABI:
        return self.cuda.abi

    def __iter__(self):  # (source, cubin), as the runtime's kernel() returned before
        return iter((self.cuda, self.cubin))


def _kernel_entry(kernel: Kernel) -> tuple[dict, dict[str, bytes]]:
    from purlinc.atom.nvrtc import nvrtc_version

    cuda = kernel.cuda
    abi = {f.name: getattr(cuda.abi, f.name) for f in fields(cuda.abi)}
    header = {
        "collective": kernel.collective,
        "params": [list(p) for p in kernel.params],
        "filename": cuda.filename,
        "kernel_base": cuda.kernel_base,
        "atom": cuda.atom,
        "arch": cuda.arch,
        "dtype": cuda.dtype.value,
        "op": cuda.op.value if cuda.op else None,
        "atom_start": cuda.atom_start,
        "atom_end": cuda.atom_end,
        "trace_blocks": [[[list(block) for block in channel] for channel in rank] for rank in cuda.trace_blocks],
        "abi": {k: list(v) if isinstance(v, tuple) else v for k, v in abi.items()},
        "nvrtc": nvrtc_version() if kernel.cubin is not None else None,
    }
    blobs = {"source": cuda.source.encode("utf-8")}
    if kernel.cubin is not None:
        blobs["cubin"] = kernel.cubin
    return header, blobs


def _kernel_from_entry(header: dict, blobs: dict[str, bytes]) -> Kernel:
    from purlinc.atom.abi import KernelABI
    from purlinc.atom.nvrtc import remember_version

    abi_fields = dict(header["abi"])
    for name in ("in_units", "out_units", "bodies"):
        abi_fields[name] = tuple(abi_fields[name])
    if header.get("nvrtc"):
        remember_version(header["nvrtc"])
    cuda = CachedKernel(header, blobs["source"].decode("utf-8"), KernelABI(**abi_fields))
    params = tuple((str(k), int(v)) for k, v in header["params"])
    return Kernel(cuda, blobs.get("cubin"), header["collective"], params, True)


def _schedule_entry(spec: Spec, schedule: Schedule) -> tuple[dict, dict[str, bytes]]:
    import json

    from purlinc.snac.format import schedule_to_json

    header = {"collective": spec.name, "params": [list(p) for p in spec.params]}
    return header, {"schedule": json.dumps(schedule_to_json(schedule), separators=(",", ":")).encode()}


def _schedule_from_entry(header: dict, blobs: dict[str, bytes]) -> Schedule:
    import json

    from purlinc.snac.format import schedule_from_json

    return schedule_from_json(json.loads(blobs["schedule"]))

