"""The compiler pipeline, one pure stage after another:

    .pln text -> ast -> spec -> snac schedule -> CUDA source -> CUBIN

One path from source to kernel, for the CLI and the runtime alike:

    prepare(source, world_size=..., arch=..., atom=..., overrides=...)   -> Compiled
    Compiled.schedule                 lowered + verified (or read from the cache)
    Compiled.kernel(dtype, op)        generated + NVRTC-compiled, once per (dtype, op)
    compile(...)                      = prepare(...).kernel(dtype, op), as an Artifact

``Compiled`` is frozen: its inputs are fixed, its products are computed on first use and
kept (per (dtype, op) for kernels).  Caches hang off that one path (purlinc/atom/cache.py):

* in this process, ``prepare`` returns the same ``Compiled`` for the same inputs, and the
  frontend (parse + check) runs once per (source, world size, params), so the size buckets
  of a tuned ``load()`` share one parse and check;
* on disk, a *schedule* entry per Compiled (keyed on its inputs before any work: the .pln
  text, world size, params, options and overrides, atom, arch) and a *kernel* entry per
  (Compiled, dtype, op) holding the CUDA source and CUBIN.  A hit skips parsing, lowering,
  verification, generation and NVRTC.

Options are applied in one place, ``resolve_options``: the spec's defaults, replaced by a
full ``LowerOptions`` if given, then the overrides (field name -> value; algorithm names are
looked up in the algorithm registry).

Nothing here needs a GPU: the target architecture is an explicit argument.  Imports are
deferred to the stage that needs them (lark, jinja2, NumPy, cuda.bindings together cost
more than a cache hit), so a hit imports little besides hashlib and json.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from purlinc.atom.atoms import DEFAULT_ATOM, lookup_atom, parse_arch
from purlinc.errors import PurlinError

if TYPE_CHECKING:
    from purlinc.atom.abi import KernelABI
    from purlinc.dtypes import DType, ReduceOp
    from purlinc.frontend import ast
    from purlinc.frontend.spec import Spec
    from purlinc.snac.ir import Algorithm, LowerOptions, Schedule

DEFAULT_WORLD_SIZE = 8
ARCHES = ("sm_80", "sm_90", "sm_100")  # the targets the test suite and benchmarks cover
_MEMO_LIMIT = 128  # Compiled objects and checked specs kept per process


@dataclass(frozen=True)
class SourceText:
    text: str
    filename: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def load_source(path_or_source: str | Path | SourceText) -> SourceText:
    """A path to a .pln file, or .pln text itself (anything containing 'collective' and '{')."""
    if isinstance(path_or_source, SourceText):
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


# ---- stages ----------------------------------------------------------------------------

def parse_stage(source: SourceText) -> ast.CollectiveDef:
    from purlinc.frontend.parse import parse

    STATS.parses += 1
    return parse(source.text, source.filename)


def spec_stage(definition: ast.CollectiveDef, world_size: int, params: Mapping[str, int] | None) -> Spec:
    from purlinc.frontend.check import check

    STATS.checks += 1
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


def with_atom_defaults(changes: Mapping[str, object], atom: str | None = None) -> dict[str, object]:
    """``changes`` (LowerOptions overrides) plus what the atom decides where they say nothing:
    as many staging copies as it can address (kernels: 2; the copy engines: 1, see
    ``Atom.stage_copies``).  The one place compile, the runtime, dump, check and draw get it."""
    from purlinc.atom.atoms import DEFAULT_ATOM, lookup_atom

    return {"stage_copies": lookup_atom(atom or DEFAULT_ATOM).stage_copies, **changes}


def default_options(spec: Spec) -> LowerOptions:
    """The options a plain call uses when none are given (the runtime may tune per size)."""
    from purlinc.snac.lower import default_options as choose

    return choose(spec)


def _params_key(params: Mapping[str, int] | None) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((str(k), int(v)) for k, v in (params or {}).items()))


_definitions: OrderedDict = OrderedDict()
_specs: OrderedDict = OrderedDict()
_frontend_lock = threading.Lock()


def _remember(memo: OrderedDict, key, value):
    memo[key] = value
    memo.move_to_end(key)
    while len(memo) > _MEMO_LIMIT:
        memo.popitem(last=False)
    return value


def definition_of(source: SourceText) -> ast.CollectiveDef:
    """The parsed file, once per (text, filename) per process (the AST is frozen)."""
    key = (source.digest, source.filename)
    with _frontend_lock:
        hit = _definitions.get(key)
    if hit is None:
        hit = parse_stage(source)
        with _frontend_lock:
            _remember(_definitions, key, hit)
    return hit


def spec_of(source: SourceText, world_size: int, params: Mapping[str, int] | None) -> Spec:
    """The checked spec, once per (source, world size, params) per process (the Spec is
    frozen): every size bucket of a tuned load, and the CLI's stages, share it."""
    key = (source.digest, source.filename, world_size, _params_key(params))
    with _frontend_lock:
        hit = _specs.get(key)
    if hit is None:
        hit = spec_stage(definition_of(source), world_size, params)
        with _frontend_lock:
            _remember(_specs, key, hit)
    return hit


# ---- options: the one place they are assembled -----------------------------------------

def normalize_overrides(overrides: Mapping[str, object] | None) -> dict[str, object]:
    """Overrides as LowerOptions values: ``None`` means "not given" and is dropped, algorithm
    names go through the algorithm registry, ``registered`` becomes a frozenset; an unknown
    field is a PurlinError naming the known ones."""
    from purlinc.snac.algorithms import get_algorithm
    from purlinc.snac.ir import LowerOptions

    known = [f.name for f in fields(LowerOptions)]
    changes = {k: v for k, v in dict(overrides or {}).items() if v is not None}
    unknown = sorted(set(changes) - set(known))
    if unknown:
        raise PurlinError(f"unknown lowering option(s): {', '.join(unknown)}",
                          notes=(f"expected one of: {', '.join(known)}",))
    if "algorithm" in changes:
        changes["algorithm"] = get_algorithm(changes["algorithm"]).algorithm
    for name in ("channels", "slices", "slots", "stage_copies"):
        if name in changes:
            changes[name] = int(changes[name])
    if "packed" in changes:
        changes["packed"] = bool(changes["packed"])
    if "registered" in changes:
        changes["registered"] = frozenset(changes["registered"])
    return changes


def resolve_options(spec: Spec, *, options: LowerOptions | None = None,
                    overrides: Mapping[str, object] | None = None) -> LowerOptions:
    """The LowerOptions a compile uses: ``options`` (default: chosen per spec) with
    ``overrides`` applied on top."""
    from dataclasses import replace

    base = options if options is not None else default_options(spec)
    changes = normalize_overrides(overrides)
    return replace(base, **changes) if changes else base


# ---- statistics ------------------------------------------------------------------------

@dataclass(slots=True)
class Stats:
    """What this process's pipeline did (tests assert on it, not on times).

    ``front_hits`` / ``front_misses``: kernel requests (``compile``, ``Compiled.kernel``)
    answered from a cache (on disk, or ``memo_hits`` in this process) or not;
    ``schedule_hits`` / ``schedule_misses``: the same for schedules."""

    front_hits: int = 0
    front_misses: int = 0
    memo_hits: int = 0
    schedule_hits: int = 0
    schedule_misses: int = 0
    parses: int = 0
    checks: int = 0
    lowerings: int = 0
    verifications: int = 0
    generations: int = 0


STATS = Stats()


# ---- cache keys and entries ------------------------------------------------------------

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

    __slots__ = ("source", "filename", "kernel_base", "abi", "atom", "arch", "_dtype", "_op", "atom_start", "atom_end")

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


# ---- Compiled --------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Request:
    """What a Compiled is made from, normalised (atom and arch checked, params sorted)."""

    source: SourceText
    world_size: int
    params: tuple[tuple[str, int], ...]
    arch: str
    atom: str
    options: LowerOptions | None  # a full replacement of the spec's defaults
    overrides: tuple[tuple[str, object], ...]  # applied on top (resolve_options)
    trace: bool = False  # kernels stamp every block (purlinc.atom.trace); coll.trace() reads them


@dataclass(frozen=True, slots=True, eq=False)
class Compiled:
    """One collective for one world size, atom and target: its schedule (and, for a
    host-driven atom, its host plan), and its kernels per (dtype, op).

    Frozen: the inputs (``request``) never change; the products are computed on first use
    and kept in ``_cells`` (the schedule) and ``_kernels`` (per (dtype, op)).
    ``prepare`` returns the same object for the same inputs in one process."""

    request: Request
    key: str  # the schedule's cache key (a hash of the request)
    cached: bool  # whether the disk cache is read and written (PURLIN_NO_CACHE)
    _cells: dict = field(default_factory=dict, repr=False)
    _kernels: dict = field(default_factory=dict, repr=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    # -- inputs
    @property
    def source(self) -> SourceText:
        return self.request.source

    @property
    def source_text(self) -> str:
        return self.request.source.text

    @property
    def filename(self) -> str:
        return self.request.source.filename

    @property
    def world_size(self) -> int:
        return self.request.world_size

    @property
    def atom(self) -> str:
        return self.request.atom

    @property
    def arch(self) -> str:
        return self.request.arch

    @property
    def trace(self) -> bool:
        return self.request.trace

    # -- products
    @property
    def spec(self) -> Spec:
        return spec_of(self.request.source, self.request.world_size, dict(self.request.params))

    @property
    def name(self) -> str:
        head = self._cells.get("head")
        return head[0] if head is not None else self.spec.name

    @property
    def params(self) -> tuple[tuple[str, int], ...]:
        """The collective's parameters as bound (the spec's defaults included)."""
        head = self._cells.get("head")
        return head[1] if head is not None else tuple(self.spec.params)

    @property
    def schedule(self) -> Schedule:
        with self._lock:
            schedule = self._cells.get("schedule")
            if schedule is None:
                schedule = self._cells["schedule"] = self._load_schedule()
            return schedule

    @property
    def options(self) -> LowerOptions:
        return self.schedule.options

    @property
    def plan(self):
        """The host-driven atom's plan (``purlinc.atom.ce.CePlan``), None for kernel atoms;
        a PurlinError when the schedule cannot run on the atom."""
        with self._lock:
            if "plan" not in self._cells:
                self._cells["plan"] = lookup_atom(self.atom).plan(self.schedule)
            return self._cells["plan"]

    def prepared(self) -> "Compiled":
        """Lower and verify now (and plan, for a host-driven atom): what a load needs before
        it touches memory.  Returns self."""
        self.schedule
        self.plan
        return self

    def _load_schedule(self) -> Schedule:
        from purlinc.atom import cache

        if self.cached:
            entry = cache.load_front(self.key)
            if entry is not None:
                try:
                    schedule = _schedule_from_entry(*entry)
                    self._cells["head"] = (entry[0]["collective"], tuple((k, int(v)) for k, v in entry[0]["params"]))
                    STATS.schedule_hits += 1
                    return schedule
                except (KeyError, TypeError, ValueError):  # an entry of another shape: lower (and rewrite)
                    pass
            STATS.schedule_misses += 1
        spec = self.spec
        options = resolve_options(spec, options=self.request.options, overrides=dict(self.request.overrides))
        schedule = snac_stage(spec, options)
        self._cells["head"] = (spec.name, tuple(spec.params))
        if self.cached:
            cache.store_front(self.key, *_schedule_entry(spec, schedule))
        return schedule

    def kernel(self, dtype: DType | str, op: ReduceOp | str | None = None, *, emit_cubin: bool = True) -> Kernel:
        """The kernel of one (dtype, op): generated and compiled on first use, then kept.
        ``op`` is ignored for copy collectives."""
        dtype = _dtype(dtype)
        memo_key = (dtype, _op_text(op))
        with self._lock:
            hit = self._kernels.get(memo_key)
            if hit is not None and (hit.cubin is not None or not emit_cubin):
                STATS.memo_hits += 1
                STATS.front_hits += 1
                return hit
            kernel = self._kernel(dtype, op, emit_cubin)
            self._kernels[memo_key] = kernel
            return kernel

    def _kernel(self, dtype: DType, op, emit_cubin: bool) -> Kernel:
        from purlinc.atom import cache

        key = None
        if self.cached:
            key = cache.front_key(_kernel_inputs(self.key, dtype, _op_text(op), emit_cubin))
            entry = cache.load_front(key)
            if entry is not None and ("cubin" in entry[1] or not emit_cubin):
                try:
                    kernel = _kernel_from_entry(*entry)
                except (KeyError, TypeError, ValueError):  # an entry of another shape: recompile (and rewrite)
                    kernel = None
                if kernel is not None:
                    self._cells.setdefault("head", (kernel.collective, kernel.params))
                    STATS.front_hits += 1
                    return kernel
            STATS.front_misses += 1
        from purlinc.atom.codegen import generate  # run-time sizes go on to purlinc.atom.sized from there
        from purlinc.atom.nvrtc import compile_cubin
        from purlinc.frontend.ast import Operation

        schedule = self.schedule
        reduce_op = _op(op) if schedule.operation is Operation.REDUCE else None
        STATS.generations += 1
        extra = {"trace": True} if self.trace else {}  # the untraced source stays byte-identical
        cuda = generate(schedule, self.spec, atom=self.atom, arch=self.arch, dtype=dtype, op=reduce_op, **extra)
        cubin = compile_cubin(cuda.source, cuda.filename, self.arch) if emit_cubin else None
        kernel = Kernel(cuda, cubin, self.name, self.params, False)
        if key is not None:
            cache.store_front(key, *_kernel_entry(kernel))
        return kernel

    def identity(self) -> dict:
        """What every rank of a runtime load must agree on (hashed at load)."""
        return {
            "source": self.source.digest, "name": self.name, "world_size": self.world_size,
            "params": [list(p) for p in self.params], "options": self.options.key(), "atom": self.atom,
            "arch": self.arch, **({"trace": True} if self.trace else {}),
        }


def _schedule_entry(spec: Spec, schedule: Schedule) -> tuple[dict, dict[str, bytes]]:
    import json

    from purlinc.snac.format import schedule_to_json

    header = {"collective": spec.name, "params": [list(p) for p in spec.params]}
    return header, {"schedule": json.dumps(schedule_to_json(schedule), separators=(",", ":")).encode()}


def _schedule_from_entry(header: dict, blobs: dict[str, bytes]) -> Schedule:
    import json

    from purlinc.snac.format import schedule_from_json

    return schedule_from_json(json.loads(blobs["schedule"]))


_compiled: OrderedDict = OrderedDict()


def prepare(
    path_or_source: str | Path | SourceText,
    *,
    world_size: int = DEFAULT_WORLD_SIZE,
    params: Mapping[str, int] | None = None,
    arch: str = "sm_90",
    atom: str = DEFAULT_ATOM,
    options: LowerOptions | None = None,
    overrides: Mapping[str, object] | None = None,
    algorithm: Algorithm | str | None = None,
    trace: bool = False,
) -> Compiled:
    """The Compiled for these inputs: nothing is parsed or lowered yet (``Compiled.prepared()``
    does that now).  The atom and arch are checked here, against the atom registry.

    ``options`` replaces the default LowerOptions (chosen per spec); ``overrides`` (field
    name -> value, e.g. ``{"channels": 2}``; None values are ignored) and ``algorithm`` are
    applied on top of either.  Passing overrides rather than options computed from a spec
    lets a cache hit skip the frontend entirely."""
    from purlinc.atom import cache

    source = load_source(path_or_source)
    target = parse_arch(arch)
    record = lookup_atom(atom)
    if not record.supports(target):
        from purlinc.atom.atoms import applicable_atoms

        raise PurlinError(f"atom {record.name!r} needs sm_{record.min_arch} or newer, not {target.name}",
                          notes=(f"atoms for {target.name}: {', '.join(applicable_atoms(target, kernels=False))}",))
    changes = {k: v for k, v in dict(overrides or {}).items() if v is not None}
    if algorithm is not None:
        changes["algorithm"] = algorithm
    if options is None:  # lowerings other than direct-push have one copy whatever this says
        changes = with_atom_defaults(changes, record.name)
    if not record.generates_kernels and definition_of(source).epilogue is not None:
        raise PurlinError(f"the {record.name} atom moves data with the copy engines and cannot compute an epilogue",
                          definition_of(source).epilogue.keyword_span, ("use a kernel atom: ldst or tma",))
    if trace and not record.generates_kernels:
        raise PurlinError(f"trace=True needs a kernel atom: the {record.name} atom runs no kernel to stamp")
    request = Request(source, int(world_size), _params_key(params), target.name, record.name, options,
                      tuple(sorted(changes.items(), key=lambda kv: kv[0])), bool(trace))
    key = cache.front_key(_front_inputs(source, world_size=request.world_size, params=params, arch=request.arch,
                                        options=options, overrides=changes, atom=request.atom))
    if trace:  # the same schedule, other kernels: a key of its own (kernel entries hang off it)
        key = cache.front_key({"traced": key})
    cached = cache.settings.cache_enabled()
    if not cached:  # PURLIN_NO_CACHE: no cache at any level, in this process either
        return Compiled(request, key, False)
    # The memo stands for that cache directory; the file name rides along in diagnostics.
    memo_key = (key, source.filename, str(cache.settings.cache_dir()))
    with _frontend_lock:
        hit = _compiled.get(memo_key)
        if hit is None:
            hit = _remember(_compiled, memo_key, Compiled(request, key, True))
        else:
            _compiled.move_to_end(memo_key)
    return hit


def forget() -> None:
    """Drop this process's memos (Compiled objects, parsed files, checked specs); the disk
    cache stays.  For tests and benchmarks that measure a fresh process's work."""
    with _frontend_lock:
        _compiled.clear()
        _specs.clear()
        _definitions.clear()


# ---- compile: one kernel, as purlinc compile writes it ---------------------------------

class Artifact:
    """Everything ``purlinc compile`` writes: a Compiled and one of its kernels."""

    __slots__ = ("compiled", "kernel", "dtype", "op", "from_cache")

    def __init__(self, compiled: Compiled, kernel: Kernel, *, from_cache: bool):
        self.compiled = compiled
        self.kernel = kernel
        self.dtype: DType = kernel.cuda.dtype
        self.op: ReduceOp | None = kernel.cuda.op
        self.from_cache = from_cache

    @property
    def spec(self) -> Spec:
        return self.compiled.spec

    @property
    def schedule(self) -> Schedule:
        return self.compiled.schedule

    @property
    def cuda(self):
        return self.kernel.cuda

    @property
    def cubin(self) -> bytes | None:
        return self.kernel.cubin

    @property
    def arch(self) -> str:
        return self.compiled.arch

    @property
    def atom(self) -> str:
        return self.compiled.atom

    @property
    def collective(self) -> str:
        return self.kernel.collective

    @property
    def params(self) -> dict[str, int]:
        return dict(self.kernel.params)


def compile(
    path_or_source: str | Path | SourceText,
    *,
    world_size: int = DEFAULT_WORLD_SIZE,
    params: Mapping[str, int] | None = None,
    arch: str = "sm_90",
    options: LowerOptions | None = None,
    overrides: Mapping[str, object] | None = None,
    algorithm: Algorithm | str | None = None,
    atom: str = DEFAULT_ATOM,
    dtype: DType | str = "bfloat16",
    op: ReduceOp | str | None = "sum",
    emit_cubin: bool = True,
) -> Artifact:
    """Compile one collective for one world size, target, dtype and op: ``prepare`` + ``kernel``."""
    compiled = prepare(path_or_source, world_size=world_size, params=params, arch=arch, atom=atom, options=options,
                       overrides=overrides, algorithm=algorithm)
    hits = STATS.front_hits
    kernel = compiled.kernel(dtype, op, emit_cubin=emit_cubin)
    return Artifact(compiled, kernel, from_cache=STATS.front_hits > hits)
