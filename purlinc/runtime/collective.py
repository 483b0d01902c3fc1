"""Loaded collectives: the callables ``purlinc.load`` returns (``loader.py`` loads them;
``placement.py`` lays them out in the heap).

Prepare: parse -> check -> lower once (the schedule fixes the heap layout); no GPU.

Call (``coll(x, out=None, op="sum", stream=None)``):
  check the error record (a timeout of an earlier call is raised now), describe and
  validate the buffers (cached per buffer identity), pick the kernel for (dtype, op) --
  generated, compiled and loaded on first use only; under torchrun that first use is also
  a host-side exchange checking every rank asked for the same (dtype, op), so warm up
  before capturing a graph -- and launch it on the caller's stream with packed arguments
  cached per (in, out, count).  Nothing is allocated, synchronised or compiled after the
  first call of a given shape, so calls can be captured in CUDA graphs.

One rank's ``Collective`` is assembled from parts, a module each: its error record and
timeouts (``timeouts.py``), its kernels and launches (``launch.py``); the checks of a group
call are ``group.py``; what a load decides before touching memory (``prepare``, ``Layout``),
``prepared.py``.  Every name is importable from here.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
from collections.abc import Sequence

from purlinc import settings
from purlinc.atom.abi import ERROR_RECORD_BYTES, slice_step
from purlinc.atom.atoms import lookup_atom
from purlinc.dtypes import DType, ReduceOp
from purlinc.pipeline import Compiled
from purlinc.runtime import interop
from purlinc.runtime.errors import ArgumentError
from purlinc.runtime.group import check_residency, group_operand_words, prepare_group
from purlinc.runtime.launch import _ARGS_CACHE_LIMIT, FastPath, Launches, dependent_launch
from purlinc.runtime.prepared import Layout, layout_sizes, prepare, prepare_options
from purlinc.runtime.timeouts import Timeouts
from purlinc.runtime.validate import (
    CallShape, CallSignature, call_signature, choose_piece, disagreement, validate_call,
)
from purlinc.snac.ir import Consume, Stage

__all__ = [
    "Collective", "FastPath", "GroupCollective", "Layout", "check_residency", "dependent_launch",
    "group_operand_words", "layout_sizes", "prepare", "prepare_group", "prepare_options", "relay_needs_count",
]


def relay_needs_count(collective) -> ArgumentError:
    """The refusal of a call without ``count=`` on a rank without chunks whose schedule
    (``collective``'s) carries other ranks' data through it: at count 0 it would pass nothing
    on, and the ranks waiting for that data would wait until their timeout."""
    return ArgumentError(
        f"{collective.name} on rank {collective.rank}: this rank has no chunks, but its schedule "
        f"({collective.compiled.options.algorithm.value}) carries other ranks' data through it, so it needs "
        "their count and dtype", None,
        ("pass count= and dtype= as the ranks with chunks have them (a group call does this for you)",))


class Collective(Timeouts, Launches):
    """One rank's loaded collective: ``coll(x, out=None, op="sum", stream=None)``."""

    def __init__(self, compiled: Compiled, comm, layout: Layout, *, agree: bool):
        from purlinc.runtime import driver

        self.compiled = compiled
        self.name = compiled.name
        self.comm = comm
        self.rank = comm.rank
        self.device = comm.device
        self.layout = layout
        schedule = compiled.schedule
        self.in_units = schedule.in_units[self.rank]
        self.out_units = schedule.out_units[self.rank]
        self.stage_units = schedule.staging_units  # every staging copy (snac/ir.py)
        self.is_reduce = schedule.operation.value == "reduce"
        # A rank without chunks whose program still moves data (a ring relays through it)
        # must run the others' count: a call that gives none is refused (prepare_call).
        self.relays = not self.in_units and not self.out_units and any(
            isinstance(step, (Stage, Consume)) for step in schedule.programs[self.rank].steps)
        self.epilogue = schedule.epilogue  # its operands come with every call (runtime/operands.py)
        self.row = schedule.epilogue.row if schedule.epilogue is not None else 1  # pieces are whole rows
        self.timeout_ns = settings.wait_timeout_ns()
        self._agree = agree  # exchange (dtype, op) with the other ranks on first use
        self._driver = driver
        self._multi_device = comm.local_group is not None
        heap = comm.heap
        self.stage_ptrs = heap.ptrs(layout.stage)
        self.pad_ptrs = heap.ptrs(layout.pad)
        self.counters_ptr = heap.ptr(self.rank, layout.counters)
        driver.set_current(self.device)
        self.error_host, self.error_dev = driver.host_alloc_mapped(ERROR_RECORD_BYTES)
        self._flag = ctypes.c_uint64.from_address(self.error_host)
        # Programmatic dependent launch where the device has it (sm_90+) and it is not turned
        # off: every kernel waits for its predecessor on the device (prelude.cuh), so only
        # the launch changes (driver.DependentLaunch).  Not where ranks share the GPU: the next
        # call's blocks take SMs as soon as this call's blocks have started, and wait there; on
        # a shared GPU they can hold the SMs that another rank's current call still needs in
        # order to start, while this rank's current call waits for that one (back-to-back calls
        # at R=8 in loopback: a timeout in the second call).
        self._pdl = dependent_launch(comm, driver.has_dependent_launch)
        self._variants: dict = {}
        self._args: dict = {}
        self._fast: FastPath | None = None
        self._shapes: dict = {}
        self._ce = None
        self.registered = bool(compiled.options.registered)  # a zero-copy twin (see zerocopy.py)
        self._zc = None  # staged collectives: their ZeroCopy (twin + per-call choice), if any
        self._host = lookup_atom(compiled.atom).host_module()  # a host-driven atom (ce): no kernels
        if self._host is not None:
            self._ce = self._host.Runner(compiled.plan, self.rank, self.device, driver)
        if self._ce is not None:  # the ce atom's waits have no clock: the watchdog bounds each call
            from purlinc.runtime.watchdog import watchdog

            self._ce.watchdog = watchdog()
            self._ce.watchdog.register(id(self._ce), self.device, self.timeout_ns / 1e9, self._ce_timed_out)
        # Under torchrun, the (dtype, op, count) signatures the ranks have agreed on: a new
        # one costs one host-side exchange before its first launch, a known one nothing.
        self._identity = f"{compiled.name} ({hashlib.sha256(json.dumps(compiled.identity(), sort_keys=True).encode()).hexdigest()[:8]})"
        self._agreed: set = set()
        self.closed = False
        comm.register(self)

    def __repr__(self) -> str:
        c = self.compiled
        return (f"Collective({self.name}, rank={self.rank}/{c.world_size}, atom={c.atom}, "
                f"{c.options.key()}, cuda:{self.device})")

    # -------------------------------------------------------------------------------- calls
    def _describe(self, label: str, value):
        """``interop.describe``, its refusal of a non-array named as the argument it was."""
        return None if value is None else interop.described(f"{self.name} on rank {self.rank}", label, value)

    def prepare_call(self, x, out, op, stream, count, dtype=None, *, agree: bool = True):
        """Validate and resolve everything a launch needs (raises before anything is launched).
        ``agree=False`` leaves the ranks' agreement to the caller (``agree``), for checks of
        its own to come first."""
        if self.closed:
            raise ArgumentError(f"{self.name}: this collective was closed")
        if self._flag.value:
            self._raise_timeout()
        if self._zc is not None and self._zc.twin._flag.value:
            self._zc.twin._raise_timeout()
        if getattr(self.comm, "failed", None) is not None:
            self.comm.refuse(self.name)
        xi = self._describe("x", x)
        oi = self._describe("out", out)
        if oi is None and self.out_units and xi is not None and self.in_units and xi.dtype is not None \
                and xi.numel % self.in_units == 0 and xi.device == self.device:
            try:
                out = interop.empty_like_kind(xi.kind, self.out_units * (xi.numel // self.in_units), xi.dtype,
                                              self.device)
            except TypeError as error:  # no library to allocate with: an argument mistake like the others
                raise ArgumentError(f"{self.name} on rank {self.rank}: out is required: {error}") from None
            oi = interop.describe(out)
        key = (xi, oi, op, count, dtype)
        try:
            shape = self._shapes.get(key)
        except TypeError:  # an unhashable op, count or dtype: validate_call names it
            key, shape = None, None
        if shape is None:
            shape = validate_call(
                xi, oi, name=self.name, rank=self.rank, device=self.device, in_units=self.in_units,
                out_units=self.out_units, is_reduce=self.is_reduce, op=op, count=count, dtype_hint=dtype,
            )
            if len(self._shapes) >= _ARGS_CACHE_LIMIT:
                self._shapes.clear()
            if key is not None:
                self._shapes[key] = shape
        if self.relays and count is None and not shape.count:
            raise relay_needs_count(self)
        # The stream before the ranks' agreement: a rank refused for its own argument after its
        # peers agreed would leave them launched, waiting for it until their timeout.
        if stream is not None:
            try:
                handle = interop.stream_handle(stream)
            except ArgumentError as error:  # named as the other arguments are: the collective and rank
                raise ArgumentError(f"{self.name} on rank {self.rank}: {error.message}", notes=error.notes) from None
        else:
            kind = xi.kind if xi is not None else (oi.kind if oi is not None else interop.TORCH)
            handle = interop.current_stream(kind, self.device)
        if agree:
            self.agree(shape)
        return shape, handle, (out if self.out_units else None)

    def agree(self, shape: CallShape) -> None:
        """The ranks' agreement on the call (under torchrun; nothing in one process).  Every
        check of a rank's own arguments comes first: a rank refused after its peers agreed
        would leave them launched, waiting for it until their timeout."""
        if self._agree:
            self._agree_on(shape)

    def _agree_on(self, shape: CallShape) -> None:
        """Under torchrun: the first call of each (dtype, op, count) exchanges it with the other
        ranks (one small host-side all-gather) and raises MismatchError before launching if any
        rank differs.  Known signatures cost a set lookup.  A rank that repeats a known
        signature while another makes a new one cannot be caught here: the device-side bound
        (PurlinTimeoutError) and the exchange's own timeout catch that."""
        mine = call_signature(self._identity, shape, bool(self.in_units or self.out_units))
        if mine in self._agreed:
            return
        everyone = self.comm.allgather(("call", mine.as_tuple()))
        problem = disagreement(self.name, [CallSignature.from_tuple(e[1]) if e[0] == "call" else
                                           CallSignature(f"another exchange ({e[0]})", None, None, None)
                                           for e in everyone])
        if problem is not None:
            raise problem
        if len(self._agreed) >= _ARGS_CACHE_LIMIT:
            self._agreed.clear()
        self._agreed.add(mine)

    def operand_words(self, shape: CallShape, operands: dict) -> tuple[int, ...]:
        """The call's epilogue operands checked and packed (``runtime/operands.py``); () for a
        collective without an epilogue, which takes none."""
        if self.epilogue is None:
            if operands:
                raise ArgumentError(f"{self.name}: unknown operand {sorted(operands)[0]!r}: "
                                    "this collective has no epilogue and takes no operands")
            return ()
        from purlinc.runtime.operands import operand_words

        itemsize = shape.dtype.itemsize
        out_numel = self.out_units * shape.count
        buffers = ((shape.in_ptr, self.in_units * shape.count * itemsize), (shape.out_ptr, out_numel * itemsize))
        return operand_words(self.name, self.epilogue, operands, shape, out_numel, self.device, buffers)

    def launch(self, shape: CallShape, stream: int, epilogue: tuple[int, ...] = ()) -> None:
        if shape.count == 0:
            return  # every rank sees count 0 and skips alike
        if self._zc is not None:
            twin = self._zc.pick(shape, stream=stream)
            if twin is not None:
                twin.launch(shape, stream, epilogue)
                return
        if self._multi_device:
            self._driver.set_current(self.device)
        if self._ce is not None:
            Buffers = self._host.Buffers
            itemsize = shape.dtype.itemsize
            piece = choose_piece(shape.count, self.layout.staging, itemsize)
            region, stride, step = self._ce_staging(piece, itemsize)
            self._ce.run(Buffers(shape.in_ptr, shape.out_ptr, tuple(p + region for p in self.stage_ptrs),
                                 tuple(self.pad_ptrs), shape.count, piece, itemsize, stride, step), stream)
            return
        function, grid, block, shared, packed = self.target(shape, epilogue)
        self._driver.launch(function, grid, block, shared, stream, packed)

    def _ce_staging(self, piece: int, itemsize: int) -> tuple[int, int, int]:
        """(region, unit stride, slice step) of a ce call: its slices' step as the ce atom cuts
        them (16-byte multiples), placed as a kernel's would be."""
        if not self.stage_units:
            return 0, 0, 0
        return self.layout.staging.place(slice_step(piece * itemsize, self.layout.staging.slices))

    def __call__(self, x=None, out=None, op="sum", stream=None, *, count: int | None = None, dtype=None,
                 **operands):
        """Run on this rank's buffers; returns ``out`` (allocated like ``x`` when None).

        A rank the spec gives no chunks passes no buffers; under torchrun it should pass
        ``count=`` and ``dtype=`` as the others' buffers have them, so that it joins their
        agreement on each new count (otherwise they wait for it, up to the exchange's bound).
        A collective with an epilogue takes its operands by name (``residual=``, ``eps=``...)."""
        fast = self._fast
        if fast is not None and not operands and stream is None and dtype is None and fast.matches(x, out, op, count) \
                and not self.timed_out() and fast.launch(self):
            return out
        shape, handle, result = self.prepare_call(x, out, op, stream, count, dtype, agree=False)
        words = self.operand_words(shape, operands)
        self.agree(shape)
        self.launch(shape, handle, words)
        if stream is None and self.epilogue is None:  # operands change per call: the full path checks them
            target, heap = self.replay_target(shape)
            self._fast = FastPath.make(x, out, result, op, count, target, self.out_units, heap)
        return result

    def warm(self, dtype: DType | str, op: ReduceOp | str | None = "sum", *, zero_copy: bool = False) -> None:
        """Compile and load the kernel for (dtype, op) now (a collective under torchrun);
        ``zero_copy=True`` also the zero-copy twin's (otherwise its first heap call does)."""
        if self.closed:  # a host-driven (ce) collective loads nothing here, but is closed all the same
            raise ArgumentError(f"{self.name}: this collective was closed")
        if self._ce is None:
            dtype = dtype if isinstance(dtype, DType) else DType.parse(dtype)
            self.variant(dtype, ReduceOp.parse(op) if self.is_reduce else None)
        if zero_copy and self._zc is not None:
            self._zc.twin.warm(dtype, op)

    def trace(self) -> dict:
        """The last call's device trace, every rank's, as JSON (purlinc.draw.trace; docs/DRAW.md).
        Under torchrun a collective: call it on every rank.  Needs ``load(..., trace=True)``."""
        from purlinc.runtime.trace import collect

        return collect([self], self.comm.allgather)

    def close(self) -> None:
        """Give the heap regions back (call on every rank, in the same order as loads)."""
        if self.closed:
            return
        self._fast = None  # a closed collective must take the path that says so
        if self._zc is not None:
            self._zc.twin.close()
        driver = self._driver
        failure = None
        try:
            driver.synchronize(self.device)
            for variant in self._variants.values():
                driver.module_unload(variant.module)
            if self._ce is not None:
                self._ce.close()
            driver.host_free(self.error_host)
        except Exception as error:  # still give the regions back, so later loads stay in step
            failure = error
        self._variants.clear()
        heap = self.comm.heap
        for offset, size in ((self.layout.stage, self.layout.stage_bytes), (self.layout.pad, 1),
                             (self.layout.counters, 1)):
            if size:
                heap.free(offset)
        if getattr(self, "_trace_slots", None) is not None:  # clock-alignment flags (runtime/trace.py)
            heap.free(self._trace_slots)
        self.closed = True
        self.comm.unregister(self)
        if failure is not None:
            raise failure


class GroupCollective:
    """A LocalGroup's collective: ``gcoll(xs, outs=None, op="sum", streams=None)`` with one
    buffer per rank; ``gcoll[r]`` is rank r's Collective (e.g. to capture per-device graphs)."""

    def __init__(self, ranks: Sequence[Collective]):
        self.ranks = list(ranks)
        self.name = ranks[0].name
        self._fits: set = set()  # launches found to fit their GPUs (check_residency)

    def __getitem__(self, rank: int) -> Collective:
        return self.ranks[rank]

    def __len__(self) -> int:
        return len(self.ranks)

    def __call__(self, xs, outs=None, op="sum", streams=None, *, count: int | None = None, **operands):
        """``operands``: an epilogue's, each a list of one value per rank (a scalar may be one
        number for every rank)."""
        prepared = prepare_group(self.name, self.ranks, xs, outs, op, streams, count)
        words = group_operand_words(self.name, self.ranks, prepared, operands)
        for collective, (shape, handle, _) in zip(self.ranks, prepared):
            collective.prime(shape, handle)  # every rank's kernel loaded before any rank runs
        check_residency(self.name, self.ranks, prepared, self._fits)
        for collective, (shape, handle, _), w in zip(self.ranks, prepared, words):
            collective.launch(shape, handle, *((w,) if w else ()))
        return [out for _, _, out in prepared]

    def check(self) -> None:
        for collective in self.ranks:
            collective.check()

    def trace(self) -> dict:
        """The last call's device trace of every rank (see Collective.trace)."""
        from purlinc.runtime.trace import collect

        return collect(self.ranks)

    def close(self) -> None:
        for collective in self.ranks:
            collective.close()
