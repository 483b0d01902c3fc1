"""The compiler pipeline, one pure stage after another:

    .pln text -> ast -> spec -> snac schedule -> CUDA source -> CUBIN

``compile()`` reads as that list, behind a front cache: its inputs (the .pln text, world
size, params, options, atom, arch, dtype, op) are hashed before any work is done, and a hit
rebuilds the Artifact from the entry without parsing, lowering, verifying, generating or
loading NVRTC (purlinc/atom/cache.py describes both cache levels).  Nothing here needs a
GPU: the target architecture is an explicit argument.  The runtime calls the stages at
load time.

Imports are deferred to the stage that needs them (lark, jinja2, NumPy, cuda.bindings
together cost more than a cache hit), so a hit imports little besides hashlib and json.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from purlinc.errors import PurlinError

if TYPE_CHECKING:
    from purlinc.atom.abi import KernelABI
    from purlinc.dtypes import DType, ReduceOp
    from purlinc.frontend import ast
    from purlinc.frontend.spec import Spec
    from purlinc.snac.ir import Algorithm, LowerOptions, Schedule

DEFAULT_WORLD_SIZE = 8
ARCHES = ("sm_80", "sm_90", "sm_100")


@dataclass(frozen=True)
class SourceText:
    text: str
    filename: str


def load_source(path_or_source: str | Path) -> SourceText:
    """A path to a .pln file, or .pln text itself (anything containing 'collective' and '{')."""
    if isinstance(path_or_source, SourceText):  # already read (the CLI's standard input)
        return path_or_source
    if isinstance(path_or_source, Path) or (
        isinstance(path_or_source, str) and "{" not in path_or_source
    ):
        return SourceText(_read_source(path_or_source), str(path_or_source))
    return SourceText(path_or_source, "<string>")


def _read_source(path: str | Path) -> str:
    """The file's text (bounded in size; the reader needs no lark, so a cache hit parses nothing)."""
    from purlinc.frontend.source import read_source

    return read_source(path)


def parse_stage(source: SourceText) -> ast.CollectiveDef:
    from purlinc.frontend.parse import parse

    return parse(source.text, source.filename)


def spec_stage(definition: ast.CollectiveDef, world_size: int, params: Mapping[str, int] | None) -> Spec:
    from purlinc.frontend.check import check

    return check(definition, world_size, params)


def snac_stage(spec: Spec, options: LowerOptions, *, verify: bool = True) -> Schedule:
    from purlinc.snac.lower import lower
    from purlinc.snac.verify import verify as verify_schedule

    STATS.lowerings += 1
    schedule = lower(spec, options)
    if verify:
        STATS.verifications += 1
        verify_schedule(schedule, spec)
    return schedule


def default_options(spec: Spec) -> LowerOptions:
    """The options a plain call uses when none are given (the runtime may tune per size)."""
    from purlinc.snac.lower import default_options as choose

    return choose(spec)


@dataclass(slots=True)
class Stats:
    """What this process's compile() calls did (tests assert on it, not on times)."""

    front_hits: int = 0
    front_misses: int = 0
    lowerings: int = 0
    verifications: int = 0
    generations: int = 0


STATS = Stats()


# ---- artifacts -------------------------------------------------------------------------

class Artifact:
    """Everything ``purlinc compile`` writes.

    Built by a compile, every field is there.  Rebuilt from the front cache, ``spec`` is
    re-derived (parse + check) on first access, ``schedule`` is decoded from the entry's
    JSON on first access, and ``cuda`` is a ``CachedKernel`` (KernelSource's fields, no
    Jinja): a caller that only writes or loads the kernel pays for neither.
    """

    __slots__ = ("_spec", "_spec_thunk", "_schedule", "_schedule_thunk", "cuda", "cubin", "arch", "atom",
                 "_dtype", "_op", "collective", "params", "from_cache")

    def __init__(self, spec, schedule, cuda, cubin, arch, atom, dtype, op, *, collective=None, params=None,
                 from_cache=False):
        self._spec, self._spec_thunk = (None, spec) if callable(spec) else (spec, None)
        self._schedule, self._schedule_thunk = (None, schedule) if callable(schedule) else (schedule, None)
        self.cuda = cuda
        self.cubin: bytes | None = cubin
        self.arch: str = arch
        self.atom: str = atom
        self._dtype = dtype  # a DType, or its value (decoded on access: DType imports NumPy)
        self._op = op
        self.collective: str = collective if collective is not None else spec.name
        self.params: dict[str, int] = dict(params if params is not None else spec.params)
        self.from_cache: bool = from_cache

    @property
    def spec(self) -> Spec:
        if self._spec is None:
            self._spec = self._spec_thunk()
        return self._spec

    @property
    def schedule(self) -> Schedule:
        if self._schedule is None:
            self._schedule = self._schedule_thunk()
        return self._schedule

    @property
    def dtype(self) -> DType:
        return _dtype(self._dtype)

    @property
    def op(self) -> ReduceOp | None:
        return _op(self._op)


def _dtype(value) -> DType:
    from purlinc.dtypes import DType

    return value if isinstance(value, DType) else DType(value)


def _op(value) -> ReduceOp | None:
    if value is None:
        return None
    from purlinc.dtypes import ReduceOp

    return value if isinstance(value, ReduceOp) else ReduceOp(value)


class CachedKernel:
    """``purlinc.atom.codegen.KernelSource``'s fields and properties, rebuilt from a front
    cache entry without importing the code generator (and with it Jinja and NumPy)."""

    __slots__ = ("source", "filename", "kernel_base", "abi", "atom", "arch", "_dtype", "_op", "atom_start", "atom_end")

    def __init__(self, header: dict, abi: KernelABI):
        self.source: str = header["source"]
        self.filename: str = header["filename"]
        self.kernel_base: str = header["kernel_base"]
        self.abi = abi
        self.atom: str = header["atom"]
        self.arch: str = header["arch"]
        self._dtype = header["dtype"]
        self._op = header["op"]
        self.atom_start: int = header["atom_start"]
        self.atom_end: int = header["atom_end"]

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


# ---- the front cache's key -------------------------------------------------------------

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
    return repr(value)


def _front_inputs(source: SourceText, *, world_size, params, arch, options, overrides, algorithm, atom, dtype, op,
                  emit_cubin) -> dict:
    """Everything compile()'s result depends on besides the package and settings (which
    cache.front_key adds).  Raw strings (a dtype or op name) enter as given: an alias
    misses where the canonical name would hit, which costs a compile, never a wrong hit."""
    from purlinc.atom.nvrtc import nvrtc_fingerprint

    return {
        "source": hashlib.sha256(source.text.encode()).hexdigest(),
        "world_size": world_size,
        "params": _normal(dict(params or {})),
        "options": None if options is None else {"key": options.key(), "fields": _normal(options)},
        "overrides": _normal(dict(overrides or {})),
        "algorithm": _normal(algorithm),
        "atom": atom,
        "arch": arch,
        "dtype": _normal(dtype),
        "op": _normal(op),
        "cubin": bool(emit_cubin),
        "nvrtc": nvrtc_fingerprint() if emit_cubin else None,
    }


def _from_entry(header: dict, blobs: dict[str, bytes], source: SourceText, world_size: int,
                params: Mapping[str, int] | None) -> Artifact:
    from purlinc.atom.abi import KernelABI
    from purlinc.atom.nvrtc import remember_version

    abi_fields = dict(header["abi"])
    for name in ("in_units", "out_units"):
        abi_fields[name] = tuple(abi_fields[name])
    abi = KernelABI(**abi_fields)
    if header.get("nvrtc"):
        remember_version(header["nvrtc"])
    schedule_json = blobs["schedule"]
    header = {**header, "source": blobs["source"].decode("utf-8")}

    def schedule() -> Schedule:
        import json

        from purlinc.snac.format import schedule_from_json

        return schedule_from_json(json.loads(schedule_json))

    def spec() -> Spec:
        return spec_stage(parse_stage(source), world_size, params)

    return Artifact(
        spec, schedule, CachedKernel(header, abi), blobs.get("cubin"), header["arch"], header["atom"], header["dtype"],
        header["op"], collective=header["collective"], params=header["params"], from_cache=True,
    )


def _entry(artifact: Artifact) -> tuple[dict, dict[str, bytes]]:
    """The front cache entry of a fresh artifact: a small JSON header and big blobs."""
    import json

    from purlinc.atom.nvrtc import nvrtc_version
    from purlinc.snac.format import schedule_to_json

    kernel = artifact.cuda
    abi = {f.name: getattr(kernel.abi, f.name) for f in fields(kernel.abi)}
    header = {
        "collective": artifact.collective,
        "params": artifact.params,
        "filename": kernel.filename,
        "kernel_base": kernel.kernel_base,
        "atom": kernel.atom,
        "arch": kernel.arch,
        "dtype": kernel.dtype.value,
        "op": kernel.op.value if kernel.op else None,
        "atom_start": kernel.atom_start,
        "atom_end": kernel.atom_end,
        "abi": {k: list(v) if isinstance(v, tuple) else v for k, v in abi.items()},
        "nvrtc": nvrtc_version() if artifact.cubin is not None else None,
    }
    blobs = {
        "source": kernel.source.encode("utf-8"),
        "schedule": json.dumps(schedule_to_json(artifact.schedule), separators=(",", ":")).encode(),
    }
    if artifact.cubin is not None:
        blobs["cubin"] = artifact.cubin
    return header, blobs


# ---- compile ---------------------------------------------------------------------------

def compile(
    path_or_source: str | Path,
    *,
    world_size: int = DEFAULT_WORLD_SIZE,
    params: Mapping[str, int] | None = None,
    arch: str = "sm_90",
    options: LowerOptions | None = None,
    overrides: Mapping[str, object] | None = None,
    algorithm: Algorithm | str | None = None,
    atom: str = "ldst",
    dtype: DType | str = "bfloat16",
    op: ReduceOp | str | None = "sum",
    emit_cubin: bool = True,
) -> Artifact:
    """Compile one collective for one world size and target.

    ``options`` replaces the default LowerOptions (chosen per spec); ``overrides`` (field
    name -> value, e.g. ``{"channels": 2}``) and ``algorithm`` are applied on top of either.
    Passing overrides rather than options computed from a spec lets a cache hit skip the
    frontend entirely."""
    from purlinc.atom import cache

    source = load_source(path_or_source)
    key = None
    if cache.settings.cache_enabled():
        key = cache.front_key(_front_inputs(
            source, world_size=world_size, params=params, arch=arch, options=options, overrides=overrides,
            algorithm=algorithm, atom=atom, dtype=dtype, op=op, emit_cubin=emit_cubin,
        ))
        entry = cache.load_front(key)
        if entry is not None and ("cubin" in entry[1] or not emit_cubin):
            try:
                artifact = _from_entry(*entry, source, world_size, params)
            except (KeyError, TypeError, ValueError):  # an entry of another shape: recompile (and rewrite)
                artifact = None
            if artifact is not None:
                STATS.front_hits += 1
                return artifact
        STATS.front_misses += 1
    artifact = _compile(source, world_size=world_size, params=params, arch=arch, options=options,
                        overrides=overrides, algorithm=algorithm, atom=atom, dtype=dtype, op=op,
                        emit_cubin=emit_cubin)
    if key is not None:
        cache.store_front(key, *_entry(artifact))
    return artifact


def _compile(source: SourceText, *, world_size, params, arch, options, overrides, algorithm, atom, dtype, op,
             emit_cubin) -> Artifact:
    from dataclasses import replace

    from purlinc.atom.codegen import generate
    from purlinc.atom.nvrtc import compile_cubin
    from purlinc.dtypes import DType, ReduceOp
    from purlinc.snac.ir import Algorithm

    dtype = dtype if isinstance(dtype, DType) else DType.parse(dtype)
    definition = parse_stage(source)
    spec = spec_stage(definition, world_size, params)
    reduce_op = ReduceOp.parse(op) if spec.is_reduce else None
    if options is None:
        options = default_options(spec)
    changes = dict(overrides or {})
    if algorithm is not None:
        changes["algorithm"] = Algorithm(algorithm) if isinstance(algorithm, str) else algorithm
    if changes:
        unknown = sorted(set(changes) - {f.name for f in fields(options)})
        if unknown:
            raise PurlinError(f"unknown lowering option(s): {', '.join(unknown)}")
        options = replace(options, **changes)
    schedule = snac_stage(spec, options)
    STATS.generations += 1
    kernel = generate(schedule, spec, atom=atom, arch=arch, dtype=dtype, op=reduce_op)
    cubin = compile_cubin(kernel.source, kernel.filename, arch) if emit_cubin else None
    return Artifact(spec, schedule, kernel, cubin, arch, atom, dtype, reduce_op)
