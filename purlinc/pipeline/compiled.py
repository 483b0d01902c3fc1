"""``Compiled``: one collective for one world size, atom and target, made by ``prepare`` and
kept per process (``forget`` drops this process's memos); its schedule and kernels are
computed on first use, from the disk cache where it holds them."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from purlinc.atom.atoms import DEFAULT_ATOM, lookup_atom, parse_arch
from purlinc.errors import InternalError, PurlinError
from purlinc.pipeline import stages  # the lowering by module, so that a test can stand in for it
from purlinc.pipeline.entries import (
    Kernel, _dtype, _front_inputs, _kernel_entry, _kernel_from_entry, _kernel_inputs, _op, _op_text,
    _schedule_entry, _schedule_from_entry,
)
from purlinc.pipeline.options import (
    check_bool, check_slots, check_stage_copies, checked_options, given_overrides, resolve_options,
    with_atom_defaults,
)
from purlinc.pipeline.source import SourceText, load_source
from purlinc.pipeline.stages import (
    _definitions, _frontend_lock, _params_key, _remember, _specs, definition_of, spec_of, whole_number,
)
from purlinc.pipeline.stats import STATS

if TYPE_CHECKING:
    from purlinc.dtypes import DType, ReduceOp
    from purlinc.frontend.spec import Spec
    from purlinc.snac.ir import Algorithm, LowerOptions, Schedule

DEFAULT_WORLD_SIZE = 8
ARCHES = ("sm_80", "sm_90", "sm_100")  # the targets the test suite and benchmarks cover


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
        schedule = stages.snac_stage(spec, options)
        self._cells["head"] = (spec.name, tuple(spec.params))
        if self.cached:
            cache.store_front(self.key, *_schedule_entry(spec, schedule))
        return schedule

    def kernel(self, dtype: DType | str, op: ReduceOp | str | None = None, *, emit_cubin: bool = True) -> Kernel:
        """The kernel of one (dtype, op): generated and compiled on first use, then kept.
        ``op`` is ignored for copy collectives."""
        return self.kernel_and_hit(dtype, op, emit_cubin=emit_cubin)[0]

    def kernel_and_hit(self, dtype: DType | str, op: ReduceOp | str | None = None, *,
                       emit_cubin: bool = True) -> tuple[Kernel, bool]:
        """``kernel``, and whether this call found it made (in this process, or in the disk
        cache): this call's own answer, which the process-wide STATS counters cannot give
        while other threads compile."""
        dtype = _dtype(dtype)
        check_bool("emit_cubin", emit_cubin)  # bool("no") is True: a CUBIN made where none was asked for
        if op is not None:  # ignored by a copy, but a misspelt one is still a mistake
            op = _op(op)
        memo_key = (dtype, _op_text(op))
        with self._lock:
            hit = self._kernels.get(memo_key)
            if hit is not None and (hit.cubin is not None or not emit_cubin):
                STATS.memo_hits += 1
                STATS.front_hits += 1
                return hit, True
            kernel = self._kernel(dtype, op, emit_cubin)
            self._kernels[memo_key] = kernel
            return kernel, kernel.from_cache

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
        from purlinc.atom.nvrtc import CompilationError, compile_cubin
        from purlinc.frontend.ast import Operation

        schedule = self.schedule
        reduce_op = _op(op) if schedule.operation is Operation.REDUCE else None
        STATS.generations += 1
        extra = {"trace": True} if self.trace else {}  # the untraced source stays byte-identical
        try:
            cuda = generate(schedule, self.spec, atom=self.atom, arch=self.arch, dtype=dtype, op=reduce_op, **extra)
        except PurlinError as error:  # a dtype's limits depend on R too (rows(R)): say which
            raise error.with_note(f"while generating {self.name}'s {dtype.value} kernels for R={self.world_size}") from None
        try:
            cubin = compile_cubin(cuda.source, cuda.filename, self.arch) if emit_cubin else None
        except CompilationError as error:  # the input was checked: code it yields must compile
            raise InternalError(f"NVRTC refused the CUDA generated for {self.name}'s {dtype.value} kernels (R="
                                f"{self.world_size}, atom {self.atom}, {self.arch}): a bug in the code generator; "
                                f"please report it with the kept source\n{error.render()}") from None
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
    options, trace = checked_options(options), check_bool("trace", trace)
    target = parse_arch(arch)
    record = lookup_atom(atom)
    if not record.supports(target):
        from purlinc.atom.atoms import applicable_atoms

        raise PurlinError(f"atom {record.name!r} needs sm_{record.min_arch} or newer, not {target.name}",
                          notes=(f"atoms for {target.name}: {', '.join(applicable_atoms(target, kernels=False))}",))
    changes = given_overrides(overrides)
    if algorithm is not None:
        changes["algorithm"] = algorithm
    if "stage_copies" in changes:  # asked for by the caller (an atom's default is a request the lowering caps)
        check_stage_copies(changes.get("algorithm", options.algorithm if options is not None else None),
                           changes["stage_copies"], definition_of(source).sizes is not None)
    if options is None:  # lowerings other than direct-push have one copy whatever this says
        changes = with_atom_defaults(changes, record.name)
    if "slots" in changes and (options is not None or "algorithm" in changes):
        # refused here too, not only when the schedule is lowered: a cached schedule skips that
        check_slots(changes["algorithm"] if "algorithm" in changes else options.algorithm, changes["slots"],
                    chosen=True)
    if not record.generates_kernels and definition_of(source).epilogue is not None:
        raise PurlinError(f"the {record.name} atom moves data with the copy engines and cannot compute an epilogue",
                          definition_of(source).epilogue.keyword_span, ("use a kernel atom: ldst or tma",))
    if trace and not record.generates_kernels:
        raise PurlinError(f"trace=True needs a kernel atom: the {record.name} atom runs no kernel to stamp")
    request = Request(source, whole_number("the world size", world_size), _params_key(params), target.name, record.name, options,
                      tuple(sorted(changes.items(), key=lambda kv: kv[0])), trace)
    key = cache.front_key(_front_inputs(source, world_size=request.world_size, params=params, arch=request.arch,
                                        options=options, overrides=changes, atom=request.atom))
    if trace:  # the same schedule, other kernels: a key of its own (kernel entries hang off it)
        key = cache.front_key({"traced": key})
    if cache.settings.cache_switched_off():  # PURLIN_NO_CACHE: no cache at any level, in this process either
        return Compiled(request, key, False)
    disk = cache.settings.cache_enabled()
    if not disk:  # no place for it (no home directory): this process's memo still serves
        _say_the_cache_has_no_place()
    # The memo stands for that cache directory; the file name rides along in diagnostics.
    memo_key = (key, source.filename, str(cache.settings.cache_dir()) if disk else "")
    with _frontend_lock:
        hit = _compiled.get(memo_key)
        if hit is None:
            hit = _remember(_compiled, memo_key, Compiled(request, key, disk))
        else:
            _compiled.move_to_end(memo_key)
    return hit


_UNPLACED_SAID = False


def cache_placelessness_told() -> None:
    """The caller has told the user already (``purlinc compile``'s warning): not twice."""
    global _UNPLACED_SAID
    _UNPLACED_SAID = True


def _say_the_cache_has_no_place() -> None:
    """Once per process, as a warning (Python's logging shows one with no handler set up): every
    process then compiles afresh, which a torchrun job's ranks would pay each time unawares."""
    global _UNPLACED_SAID
    if not _UNPLACED_SAID:
        _UNPLACED_SAID = True
        from purlinc import settings
        from purlinc.log import get

        get("cache").warning("the compile cache is not used: %s; every process compiles afresh (set %s)",
                             settings.unplaced_cache(), settings.CACHE_DIR.name)


def forget() -> None:
    """Drop this process's memos (Compiled objects, parsed files, checked specs); the disk
    cache stays.  For tests and benchmarks that measure a fresh process's work."""
    with _frontend_lock:
        _compiled.clear()
        _specs.clear()
        _definitions.clear()
