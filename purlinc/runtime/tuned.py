"""The collective a plain ``load(path, comm)`` returns: one loaded schedule per size bucket,
chosen per call by message size (``purlinc.runtime.tuning`` says which buckets).

Every rank must run the same schedule for a call, so the size that picks the bucket is
rank-independent: ``count * itemsize * U``, with ``U`` the most chunks any rank's input or
output holds (for a gather, the root's output).  All buckets are loaded up front, so a
first call of a new size allocates nothing and can be captured in a CUDA graph (after a
warm-up call per (dtype, op), as for any collective).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

from purlinc import settings
from purlinc.log import log
from purlinc.atom.abi import slice_step
from purlinc.atom.atoms import DEFAULT_ATOM, lookup_atom
from purlinc.errors import PurlinError
from purlinc.pipeline import Compiled
from purlinc.runtime import communicator, residency, tuning
from purlinc.runtime.collective import (
    Collective, FastPath, GroupCollective, check_residency, group_operand_words, prepare, prepare_group,
    relay_needs_count,
)
from purlinc.runtime.errors import ArgumentError
from purlinc.runtime.options import LoadOptions
from purlinc.runtime.placement import load_compiled
from purlinc.runtime.prepared import least_stage_bytes, slice_aligns
from purlinc.snac.algorithms import DEFAULT_ALGORITHM
from purlinc.snac.ir import LowerOptions

_MIN_STAGE = 64 << 10


@dataclass(frozen=True, slots=True)
class PreparedBucket:
    """One size bucket, ready to load: its Compiled and the staging space it needs."""

    bucket: tuning.Bucket
    compiled: Compiled
    stage_bytes: int | None  # None: the default (PURLIN_STAGE_MB)

    @property
    def load_key(self) -> tuple:
        """Buckets with equal keys share one load (the same schedule and staging)."""
        return (self.compiled.key, self.stage_bytes)


def _prepare_bucket(source, world_size, bucket: tuning.Bucket, params, arch, units: int = 1) -> PreparedBucket:
    """Lower one bucket's schedule; a bucket whose options do not apply to the spec falls back
    to plain direct-push with the same channels (deterministic, so every rank agrees)."""
    kwargs = dict(params=params, algorithm=bucket.algorithm, atom=bucket.atom, channels=bucket.channels,
                  slices=bucket.slices, arch=arch)
    if "packed" in {f.name for f in fields(LowerOptions)}:
        kwargs["packed"] = bucket.packed
    try:
        compiled = prepare(source, world_size, **kwargs)
    except PurlinError as error:
        if log.isEnabledFor(logging.INFO):
            log.info("size bucket %s does not apply (%s): plain direct-push on %d channels instead",
                     tuning.Bucket.to_json(bucket), error.message, bucket.channels)
        kwargs.update(algorithm=DEFAULT_ALGORITHM.value, atom=DEFAULT_ATOM, slices=1)
        kwargs.pop("packed", None)
        compiled = prepare(source, world_size, **kwargs)
    stage_bytes = None
    if bucket.max_bytes is not None and compiled.schedule.staging_units:
        # The bucket counts count * itemsize * units, so a unit moves at most this much.
        most = max(1, bucket.max_bytes // max(1, units))
        need = bucket_stage_bytes(compiled.schedule, most)
        least = least_stage_bytes(compiled.schedule, most)
        stage_bytes = max(min(settings.stage_bytes(), max(_MIN_STAGE, -(-need // 4096) * 4096)), least)
    return PreparedBucket(bucket, compiled, stage_bytes)


def bucket_stage_bytes(schedule, most: int) -> int:
    """Staging (large region, every unit) that holds in one round any call whose units move at
    most ``most`` bytes: its slices sit a fixed step apart (``StagingPlacement``), each cut as
    the kernels cut it, ceil(bytes / slices) rounded up to one of ``slice_aligns`` (16 bytes,
    or an epilogue's row, which may hold more than its share: a bucket of 4 rows on 8 slices
    takes a row per slice, and wider rows for wider elements)."""
    step = max(slice_step(most, schedule.slices, align) for align in slice_aligns(schedule, most))
    return schedule.staging_units * schedule.slices * -(-step // 16) * 16  # every copy (ir.py)


def prepare_tuned(path_or_source, world_size: int, *, params: Mapping[str, int] | None = None,
                  arch: str = "sm_90", max_channels: int | None = None) -> tuple[tuple[PreparedBucket, ...], int]:
    """Everything a plain ``load()`` decides before touching a GPU: the size buckets, each
    lowered and verified (no GPU needed).  Returns the buckets and ``U``, the most chunks any
    rank's input or output holds.  The source is read once, and parsed and checked once for
    every bucket (``pipeline.spec_of``).  ``max_channels`` caps every bucket's channels (ranks
    that share a GPU: ``residency.max_channels``)."""
    from purlinc import pipeline

    source = pipeline.load_source(path_or_source)
    spec = pipeline.spec_of(source, world_size, params)
    packed_supported = "packed" in {f.name for f in fields(LowerOptions)}
    buckets = tuning.buckets_for(spec, packed_supported=packed_supported)
    if max_channels is not None:
        buckets = tuple(replace(b, channels=min(b.channels, max_channels)) for b in buckets)
    units = max(max(len(ins), len(outs)) for ins, outs in zip(spec.inputs, spec.outputs))
    prepared = tuple(_prepare_bucket(source, world_size, bucket, params, arch, units) for bucket in buckets)
    return prepared, units


def compile_tuned_kernels(prepared: tuple[PreparedBucket, ...], dtype, op="sum") -> int:
    """Every bucket's kernel of (dtype, op) (host-driven atoms have none), compiled
    concurrently (``purlinc.concurrent``): what the buckets' first calls would compile one
    after another.  Returns how many distinct kernels that is."""
    from purlinc.concurrent import compile_kernels

    compileds = [c for c in {p.compiled.key: p.compiled for p in prepared}.values() if c.plan is None]
    compile_kernels(compileds, dtype, op)
    return len(compileds)


def _precompile_jobs(prepared: tuple[PreparedBucket, ...]) -> list[tuple]:
    """(Compiled, dtype, "sum") for every distinct kernel-atom bucket and every PURLIN_PRECOMPILE
    dtype it can run (a reduction skips dtypes that cannot be reduced)."""
    from purlinc.frontend.ast import Operation

    dtypes = _precompile_dtypes()
    compileds = [c for c in {p.compiled.key: p.compiled for p in prepared}.values() if c.plan is None]
    return [(c, dtype, "sum") for c in compileds for dtype in dtypes
            if dtype.reducible or c.schedule.operation is not Operation.REDUCE]


def _precompile_dtypes() -> list:
    """PURLIN_PRECOMPILE's dtypes, each once, read by ``DType.parse`` as a dtype is everywhere
    else (bf16, BFLOAT16 and torch.float16 are names for it too)."""
    from purlinc.dtypes import DType

    dtypes = []
    for name in settings.precompile_dtypes():
        try:
            dtypes.append(DType.parse(name))
        except PurlinError:
            raise PurlinError(f"{settings.PRECOMPILE.name}={settings.PRECOMPILE.raw()!r}: not a list of element "
                              f"types: {name!r} is not one",
                              notes=(f"expected names among {', '.join(d.value for d in DType)} (or aliases such "
                                     "as bf16), separated by commas, or 0 to switch it off",)) from None
    return list(dict.fromkeys(dtypes))


def precompile(prepared: tuple[PreparedBucket, ...], comm) -> int:
    """Compile the buckets' kernels of the PURLIN_PRECOMPILE dtypes now, in threads (NVRTC
    releases the GIL: ``purlinc.concurrent``), so no first call of those dtypes waits for NVRTC.
    Ranks in processes of their own split the work: each compiles its share into the disk cache,
    all meet (``comm.allgather``), then each takes the rest from the cache (compiling what a rank
    on another machine's disk left out).  Returns how many kernels the load holds ready."""
    from purlinc.concurrent import compile_jobs

    jobs = _precompile_jobs(prepared)
    if not jobs:
        return 0
    world = getattr(comm, "world_size", 1)
    if not isinstance(comm, communicator.LocalGroup) and world > 1 and settings.cache_enabled():
        compile_jobs(jobs[comm.rank::world])
        comm.allgather(("precompiled", len(jobs)))
    compile_jobs(jobs)
    return len(jobs)


def load_tuned(path_or_source: str | Path, comm, comms: list, options: LoadOptions):
    """Every size bucket's schedule placed on the ranks (buckets that lower alike share one):
    a Tuned (a TunedGroup for a LocalGroup) that picks one per call by message size."""
    from purlinc.runtime import driver

    # Ranks that share a GPU (a loopback group) must have all their blocks resident at once:
    # every bucket gets at most the channels that fit at one block per SM, so no size is refused.
    local = isinstance(comm, communicator.LocalGroup)
    cap = residency.max_channels([c.device for c in comms], driver.sm_count) if local else None
    prepared, units = prepare_tuned(path_or_source, comms[0].world_size, params=options.param_map,
                                    arch=options.arch, max_channels=cap)
    precompile(prepared, comm)
    buckets = tuple(p.bucket for p in prepared)
    loaded: dict[tuple, object] = {}
    per_bucket = []
    for p in prepared:
        if p.load_key not in loaded:  # buckets that lower to the same schedule share one load
            loaded[p.load_key] = load_compiled(p.compiled, comm, comms, p.stage_bytes)
        per_bucket.append(loaded[p.load_key])
    if log.isEnabledFor(logging.INFO):
        log.info("load %s (R=%d): %d size buckets, %d schedules: %s", prepared[0].compiled.name,
                 comms[0].world_size, len(buckets), len(loaded), "; ".join(_bucket_text(p) for p in prepared))
    if local:
        return TunedGroup(buckets, per_bucket, units)
    return Tuned(buckets, per_bucket, units)


def _bucket_text(p: PreparedBucket) -> str:
    b = p.bucket
    return (f"<= {b.max_bytes if b.max_bytes is not None else 'any'} B: {p.compiled.options.key()}")


def raise_untraced(name: str):
    raise PurlinError(f"{name}: not loaded with trace=True: this load picks a schedule per call size, and "
                      "nothing was recorded", notes=("load(..., trace=True) pins one schedule and records its "
                                                     "blocks' times for trace()",))


class Tuned:
    """``coll(x, out=None, op="sum", stream=None)``: each call runs its size bucket's schedule."""

    def __init__(self, buckets, variants: list[Collective], units: int):
        self.buckets = tuple(buckets)
        self.variants = list(variants)
        self.units = max(units, 1)
        self.name = variants[0].name
        self.comm = variants[0].comm
        self.rank = variants[0].rank
        self._distinct = list({id(v): v for v in variants}.values())
        self._flags = _timeout_flags(self._distinct)
        # A bucket whose schedule relays through this chunkless rank: which bucket the others'
        # count picks is unknown here, so every call without count= is refused.
        self._relay = next((v for v in self._distinct if getattr(v, "relays", False)), None)
        self._chosen: dict = {}
        self._fast: FastPath | None = None

    def __repr__(self) -> str:
        rows = ", ".join(f"<={b.max_bytes if b.max_bytes is not None else 'inf'}: {v.compiled.options.key()}"
                         for b, v in zip(self.buckets, self.variants))
        return f"Tuned({self.name}, rank={self.rank}, {rows})"

    @property
    def spec(self):
        return self.variants[0].compiled.spec

    @property
    def compiled(self):
        """The smallest bucket's compiled collective (all buckets share the spec and layouts)."""
        return self.variants[0].compiled

    def trace(self):
        """Refused: a tuned load runs one of several schedules per call; a traced load pins one."""
        raise_untraced(self.name)

    def variant_for(self, count: int, itemsize: int) -> Collective:
        key = (count, itemsize)
        index = self._chosen.get(key)
        if index is None:
            index = self._chosen[key] = tuning.choose(self.buckets, count * itemsize * self.units)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s rank %d: %d elements of %d bytes (%d bytes per call) take bucket %d: %s", self.name,
                          self.rank, count, itemsize, count * itemsize * self.units, index,
                          self.variants[index].compiled.options.key())
        return self.variants[index]

    def sms_for(self, count: int, itemsize: int) -> int:
        variant = self.variant_for(count, itemsize)
        return variant.compiled.options.channels if lookup_atom(variant.compiled.atom).uses_sms else 0

    def __call__(self, x=None, out=None, op="sum", stream=None, *, count: int | None = None, dtype=None,
                 **operands):
        """As ``Collective.__call__`` (a rank without chunks passes ``count=`` and ``dtype=``;
        an epilogue's operands come by name)."""
        if self.variants[0].closed:  # closed with its communicator: the flags below are freed memory
            self._fast = None
            raise ArgumentError(f"{self.name}: this collective was closed")
        for flag in self._flags:  # the host-mapped error flags: a word read each, no call
            if flag.value:
                self.check()  # raises the timeout (a bucket's or its zero-copy twin's)
        fast = self._fast
        if fast is not None and not operands and stream is None and dtype is None \
                and fast.matches(x, out, op, count) and fast.launch(self.variants[0]):
            return out
        if self._relay is not None and count is None:
            raise relay_needs_count(self._relay)
        # Buffers are validated once (every variant has the same layouts), then launched by
        # the bucket's variant.
        shape, handle, result = self.variants[0].prepare_call(x, out, op, stream, count, dtype, agree=False)
        variant = self.variant_for(shape.count, shape.dtype.itemsize)
        fused = operands or getattr(variant, "epilogue", None) is not None
        words = variant.operand_words(shape, operands) if fused else ()
        self.variants[0].agree(shape)
        variant.launch(shape, handle, words)
        if stream is None and not fused:  # operands change per call: the full path checks them
            target, heap = variant.replay_target(shape)
            self._fast = FastPath.make(x, out, result, op, count, target, variant.out_units, heap)
        return result

    def warm(self, dtype, op="sum") -> None:
        if self.variants[0].closed:
            raise ArgumentError(f"{self.name}: this collective was closed")
        _compile_all(self._distinct, dtype, op)  # every bucket's kernel at once, then load each
        for variant in self._distinct:
            variant.warm(dtype, op)

    def check(self) -> None:
        for variant in self._distinct:
            variant.check()

    def close(self) -> None:
        self._fast = None
        for variant in self._distinct:
            variant.close()


def _timeout_flags(variants) -> tuple:
    """The error flags (``ctypes.c_uint64`` over each host-mapped error record) of the variants
    and of their zero-copy twins: what an eager call reads before replaying a launch."""
    flags = []
    for variant in variants:
        for collective in (variant, getattr(getattr(variant, "_zc", None), "twin", None)):
            flag = getattr(collective, "_flag", None)
            if flag is not None:
                flags.append(flag)
    return tuple(flags)


class TunedGroup:
    """The LocalGroup form: ``gcoll(xs, outs=None, op="sum", streams=None)``."""

    def __init__(self, buckets, variants: list[GroupCollective], units: int):
        self.buckets = tuple(buckets)
        self.variants = list(variants)
        self.name = variants[0].name
        self.ranks = [Tuned(buckets, [v[rank] for v in variants], units) for rank in range(len(variants[0]))]
        self._distinct = list({id(v): v for v in variants}.values())
        self._fits: set = set()  # launches found to fit their GPUs (check_residency)

    def __getitem__(self, rank: int) -> Tuned:
        return self.ranks[rank]

    def trace(self):
        """Refused, as Tuned.trace."""
        raise_untraced(self.name)

    def __len__(self) -> int:
        return len(self.ranks)

    def __call__(self, xs, outs=None, op="sum", streams=None, *, count: int | None = None, **operands):
        for tuned in self.ranks:  # a timeout in any bucket's schedule is reported now
            tuned.check()
        prepared = prepare_group(self.name, [t.variants[0] for t in self.ranks], xs, outs, op, streams, count)
        chosen = [tuned.variant_for(shape.count, shape.dtype.itemsize)
                  for tuned, (shape, _, _) in zip(self.ranks, prepared)]
        words = group_operand_words(self.name, chosen, prepared, operands)
        for variant, (shape, handle, _) in zip(chosen, prepared):
            variant.prime(shape, handle)  # every rank's kernel loaded before any rank runs (Collective.prime)
        check_residency(self.name, chosen, prepared, self._fits)
        for variant, (shape, handle, _), w in zip(chosen, prepared, words):
            variant.launch(shape, handle, *((w,) if w else ()))
        return [out for _, _, out in prepared]

    def warm(self, dtype, op="sum") -> None:
        if self.ranks[0].variants[0].closed:  # refused before NVRTC runs, as a rank's own warm() is
            raise ArgumentError(f"{self.name}: this collective was closed")
        _compile_all([v for tuned in self.ranks for v in tuned._distinct], dtype, op)
        for tuned in self.ranks:
            tuned.warm(dtype, op)

    def check(self) -> None:
        for group in self._distinct:
            group.check()

    def close(self) -> None:
        for group in self._distinct:
            group.close()


def _compile_all(variants, dtype, op) -> None:
    """The kernels the variants' ``warm`` would compile one by one, compiled concurrently
    first (the kernel atoms' only: a host-driven atom's variant has ``_ce`` set)."""
    from purlinc.concurrent import compile_kernels

    compile_kernels([v.compiled for v in variants if getattr(v, "_ce", None) is None], dtype, op)
