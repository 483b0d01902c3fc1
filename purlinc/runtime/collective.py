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
"""

from __future__ import annotations

import ctypes
import hashlib
import numbers
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from purlinc import settings
from purlinc.log import log
from purlinc.atom.abi import ERROR_RECORD, ERROR_RECORD_BYTES, decode_error
from purlinc.atom.cubin import stack_bytes
from purlinc.dtypes import DType, ReduceOp
from purlinc.errors import InternalError
from purlinc.runtime import interop, residency, zerocopy
from purlinc.runtime.errors import ArgumentError, PurlinTimeoutError, issued_by_one_thread
from purlinc.runtime.options import LoadOptions
from purlinc.runtime.residency import Blocks
from purlinc.runtime.validate import (
    CallShape, CallSignature, call_signature, choose_piece, disagreement, validate_call,
)
from purlinc.atom.atoms import DEFAULT_ATOM, lookup_atom
from purlinc.pipeline import Compiled
from purlinc.snac.ir import Algorithm

_ARGS_CACHE_LIMIT = 4096


# ---------------------------------------------------------------------------------------------
# compile-side state: the pipeline's Compiled, shared by every rank of a process


def prepare(
    path_or_source: str | Path,
    world_size: int,
    *,
    params: Mapping[str, int] | None = None,
    algorithm: Algorithm | str | None = None,
    atom: str | None = None,
    channels: int | None = None,
    slices: int | None = None,
    packed: bool | None = None,
    arch: str = "sm_90",
    trace: bool = False,
) -> Compiled:
    """Parse, check and lower (no GPU needed): everything a load decides before touching memory.
    ``prepare_options`` with these keywords as a LoadOptions."""
    return prepare_options(path_or_source, world_size, LoadOptions.of(
        params=params, algorithm=algorithm, atom=atom, channels=channels, slices=slices, packed=packed,
        arch=arch, trace=trace))


def prepare_options(path_or_source: str | Path, world_size: int, options: LoadOptions) -> Compiled:
    """The Compiled a load of ``options`` runs: the same path, and for the same inputs the same
    Compiled, as ``purlinc compile`` (``pipeline.prepare``).  The caller's buffers are never
    registered (no per-call pointers are exchanged), which the default options already say.
    Raises the PurlinError of an option, atom or algorithm that does not apply."""
    from purlinc import pipeline

    compiled = pipeline.prepare(path_or_source, world_size=world_size, params=options.param_map,
                                arch=options.arch or "sm_90", atom=options.atom or DEFAULT_ATOM,
                                overrides=options.overrides(), trace=bool(options.trace)).prepared()
    if compiled.options.registered:  # the defaults register nothing, and no override here does
        raise InternalError(f"{compiled.name}: a runtime schedule asks for registered buffers")
    return compiled


# ---------------------------------------------------------------------------------------------
# per-rank state


@dataclass(frozen=True)
class Layout:
    """Offsets of one collective's regions in the symmetric heap (equal on every rank)."""

    stage: int
    stage_bytes: int
    pad: int
    pad_bytes: int
    counters: int
    counters_bytes: int


def layout_sizes(compiled: Compiled, stage_bytes: int | None = None) -> tuple[int, int, int]:
    """(staging, signal pad, counters) bytes for one rank; ``stage_bytes`` caps the staging
    space (default PURLIN_STAGE_MB): larger messages run in several rounds."""
    schedule = compiled.schedule
    stage = (stage_bytes or settings.stage_bytes()) if schedule.stage_units else 0
    words = compiled.plan.pad_words if compiled.plan is not None else schedule.signal_pad_size()
    return stage, 8 * max(words, 1), 8 * schedule.channels


class _Variant:
    """A kernel for one (dtype, op) loaded on one device: its entry points and launch shape
    (``lean``: the rank's lean entry, for the calls ``abi.lean_fits`` admits; None without)."""

    __slots__ = ("function", "lean", "module", "grid", "block", "shared", "abi", "key", "per_sm")

    def __init__(self, function, module, abi, key, lean=None, per_sm=1):
        self.function, self.module, self.abi, self.key, self.lean = function, module, abi, key, lean
        self.grid, self.block, self.shared = abi.channels, abi.threads, abi.shared_bytes
        self.per_sm = per_sm  # blocks of this kernel one SM holds (the fewer of its two entries)


class FastPath:
    """The last call's launch, replayed when the next call passes the same torch tensors.

    Describing and validating two tensors costs more than the launch itself; an eager call
    whose buffers are unchanged (the same pointers, shapes, dtypes and contiguity, read off
    the tensors, which covers a tensor freed and replaced by an identical one) only needs the
    current stream and the launch.  Anything else takes the full path, which validates.

    A collective with a zero-copy twin also keys on its heap's ``generation`` (bumped by every
    user allocation and free): a replayed zero-copy launch is valid only while every heap
    block it was checked against is still live, and a staged one only while its buffers are
    still outside the heap, so any allocation or free sends the next call through the full
    path (which raises FreedBufferError for a freed block).  It also never replays a staged
    launch into a CUDA graph being captured: a captured call on ordinary buffers may run the
    twin on the caller's buffers instead (``purlinc.runtime.graphbuffers``), which the full
    path decides.
    """

    __slots__ = ("tensor_type", "x_key", "out_key", "op", "count", "target", "heap", "generation", "capturing")

    @staticmethod
    def key(t, tensor_type):
        if t is None:
            return None
        if type(t) is not tensor_type:
            return False  # not a plain torch tensor: never matches
        return (t.data_ptr(), t.shape, t.dtype, t.is_contiguous())

    @classmethod
    def make(cls, x, out, result, op, count, target, out_units, heap=None):
        torch = interop.torch_module()
        if torch is None or target is None or (out is None and out_units):
            return None  # nothing to replay, or an output allocated per call
        fast = cls()
        fast.tensor_type = torch.Tensor
        fast.x_key, fast.out_key = cls.key(x, torch.Tensor), cls.key(out, torch.Tensor)
        if fast.x_key is False or fast.out_key is False or (x is None and out is None):
            return None
        fast.op, fast.count, fast.target = op, count, target
        fast.heap, fast.generation = heap, heap.generation if heap is not None else None
        # torch's check of the current stream (the one launch() uses), where there is a twin
        cuda = getattr(torch, "cuda", None)
        live = heap is not None and cuda is not None and cuda.is_available()
        fast.capturing = cuda.is_current_stream_capturing if live else None
        return fast

    def matches(self, x, out, op, count) -> bool:
        return (op == self.op and count == self.count and self.key(x, self.tensor_type) == self.x_key
                and self.key(out, self.tensor_type) == self.out_key
                and (self.heap is None or self.heap.generation == self.generation))

    def launch(self, collective) -> bool:
        """Replay the launch; False (nothing launched) while the current stream is capturing
        and the collective has a twin: the caller then takes the full path."""
        if getattr(collective.comm, "failed", None) is not None:
            collective.comm.refuse(collective.name)
        if self.capturing is not None and self.capturing():
            return False
        driver = collective._driver
        if collective._multi_device:
            driver.set_current(collective.device)
        function, grid, block, shared, packed = self.target
        driver.launch(function, grid, block, shared, interop.current_stream(interop.TORCH, collective.device), packed)
        return True


class Collective:
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

    # -------------------------------------------------------------------------------- errors
    def error_record(self) -> dict[str, int]:
        words = tuple((ctypes.c_uint64 * len(ERROR_RECORD)).from_address(self.error_host))
        return decode_error(words)

    def check(self) -> None:
        """Raise PurlinTimeoutError if a device-side wait of this rank timed out (no sync needed)."""
        if self._flag.value:
            self._raise_timeout()
        if self._zc is not None:
            self._zc.twin.check()

    def _ce_timed_out(self, waits, seconds: float) -> None:
        """The watchdog's report (from its thread): a ce call ran past the bound."""
        from purlinc.runtime.watchdog import write_error_record

        channel, index, address, value = waits[0] if waits else (0, 0, 0, 0)
        owner, word = 0, 0
        for peer, base in enumerate(self.pad_ptrs):
            if base <= address < base + self.layout.pad_bytes:
                owner, word = peer, (address - base) // 8
        write_error_record(self.error_host, self.rank, channel, index, owner, word, value, 0)

    def _raise_timeout(self):
        error = self._timeout_error()
        log.error("%s", error.message.splitlines()[0])
        self.comm.fail(error)
        raise error

    def _timeout_error(self) -> PurlinTimeoutError:
        record = self.error_record()
        schedule = self.compiled.schedule
        seconds = self.timeout_ns / 1e9
        if self._ce is not None:
            return PurlinTimeoutError(
                f"{self.name}: rank {record['rank']} (ce atom) did not finish a call within {seconds:g} s: "
                f"channel {record['channel']} was still waiting for signal r{record['signal_owner']}"
                f".sig[{record['signal_index']}] >= {record['expected']} (or a later wait of that call)",
                notes=(
                    "a peer did not call this collective (or called it with another count, dtype or op)",
                    "the watchdog released the copy engines' waits: that call's output is not valid",
                    f"the bound is {settings.WAIT_TIMEOUT_S.name}={settings.WAIT_TIMEOUT_S.raw()}",
                ),
                record=record,
            )
        what = ""
        try:
            step = schedule.program(record["rank"], record["channel"]).steps[record["step"]]
            what = f" ({type(step).__name__}{': ' + step.note if getattr(step, 'note', '') else ''})"
        except (IndexError, KeyError):
            pass
        return PurlinTimeoutError(
            f"{self.name}: rank {record['rank']} timed out after {seconds:g} s in channel {record['channel']}, "
            f"step {record['step']}{what}, waiting for signal r{record['signal_owner']}.sig[{record['signal_index']}] "
            f">= {record['expected']}, observed {record['observed']}",
            notes=(
                "a peer did not call this collective (or called it with another count, dtype or op)",
                *issued_by_one_thread(self.comm),
                "this collective's signals are now out of step: load it again",
                f"the bound is {settings.WAIT_TIMEOUT_S.name}={settings.WAIT_TIMEOUT_S.raw()}",
            ),
            record=record,
        )

    # -------------------------------------------------------------------------------- kernels
    def variant(self, dtype: DType, op: ReduceOp | None) -> _Variant:
        key = (dtype, op)
        hit = self._variants.get(key)
        if hit is not None:
            return hit
        driver = self._driver
        source, cubin = self.compiled.kernel(dtype, op)  # cached per (dtype, op) by the pipeline
        abi = source.abi
        if (abi.world_size, abi.channels, abi.stage_units) != (
            self.compiled.world_size, self.compiled.schedule.channels, self.stage_units
        ) or 8 * abi.signal_pad > self.layout.pad_bytes:
            raise InternalError(f"kernel ABI {abi} does not match the loaded schedule of {self.name}")
        if (abi.needs_in_peers or abi.needs_out_peers) and not self.registered:
            raise InternalError(f"{self.name}: the kernel wants registered buffers, but this is the staged schedule")
        if self._agree:
            mine = CallSignature(self._identity, dtype.value, op.value if op else None, None)
            everyone = self.comm.allgather(("variant", mine.as_tuple()))
            problem = disagreement(self.name, [CallSignature.from_tuple(e[1]) for e in everyone])
            if problem is not None:
                raise problem
        driver.set_current(self.device)
        module = driver.module_load(cubin)
        function = driver.get_function(module, abi.entry(self.rank))
        lean = driver.get_function(module, abi.lean_entry(self.rank)) if abi.lean else None
        if abi.shared_bytes > 48 * 1024:
            for f in (function, lean):
                if f is not None:
                    driver.set_max_dynamic_shared(f, abi.shared_bytes)
        # Now, not at the launch: a launch that has to grow the stack waits for the device's
        # running kernels, among them the ranks of this call that share the GPU and wait for
        # this one (driver.reserve_stack).  A group call loads every rank before launching any.
        entries = [(abi.entry(self.rank), function)] + ([(abi.lean_entry(self.rank), lean)] if lean is not None else [])
        stacks = stack_bytes(cubin)  # ptxas's record of each entry's stack (atom/cubin.py)
        driver.reserve_stack(max(max(stacks.get(name, 0), driver.local_bytes(f)) for name, f in entries))
        per_sm = min(driver.blocks_per_sm(f, abi.threads, abi.shared_bytes) for _, f in entries)
        self._check_shared_device(abi, per_sm)
        hit = _Variant(function, module, abi, key, lean, per_sm)
        self._variants[key] = hit
        if log.isEnabledFor(logging.INFO):
            log.info("%s rank %d: kernel for %s%s loaded: %s", self.name, self.rank, dtype.value,
                     f" {op.value}" if op else "", self.compiled.options.key())
        return hit

    def _check_shared_device(self, abi, per_sm: int) -> None:
        """Under torchrun, ranks placed on this rank's GPU (``comm.peer_devices``) run their
        kernels on its SMs together: refuse (ResidencyError) before the first launch when their
        blocks cannot all be resident, counting each with this rank's kernel.  A group call
        checks its ranks per call instead (``check_residency``)."""
        from purlinc.runtime import driver

        devices = getattr(self.comm, "peer_devices", ())
        if self._multi_device or devices.count(self.device) < 2:
            return
        residency.check(self.name, [Blocks(r, d, abi.channels, abi.threads, per_sm) for r, d in enumerate(devices)
                                    if d == self.device], driver.sm_count)

    def _packed(self, variant: _Variant, shape: CallShape, piece: int, epilogue: tuple[int, ...] = ()):
        """(entry function, packed arguments) of a call: the lean entry where the call fits it;
        ``epilogue``: the epilogue's operand words (``operand_words``)."""
        from purlinc.runtime.driver import DependentLaunch, PackedArgs

        peers = zerocopy.peer_args(self, shape) if self.registered else {}
        key = (variant.key, shape.in_ptr, shape.out_ptr, shape.count, *map(tuple, peers.values()), epilogue)
        hit = self._args.get(key)
        if hit is None:
            if len(self._args) >= _ARGS_CACHE_LIMIT:
                self._args.clear()  # launches copy their arguments: dropping old ones is safe
            data = variant.abi.pack_args(**peers,
                count=shape.count, piece=piece, timeout_ns=self.timeout_ns, rank=self.rank, in_ptr=shape.in_ptr,
                out_ptr=shape.out_ptr, counters_ptr=self.counters_ptr, error_ptr=self.error_dev,
                stage=self.stage_ptrs, signals=self.pad_ptrs, epilogue=epilogue,
            )
            pointers = (shape.in_ptr, shape.out_ptr, *(p for ptrs in peers.values() for p in ptrs))
            lean = variant.lean is not None and variant.abi.lean_fits(shape.count, piece, pointers)
            config = DependentLaunch(variant.grid, variant.block, variant.shared) if self._pdl else None
            hit = self._args[key] = (variant.lean if lean else variant.function, PackedArgs(data, config))
        return hit

    # -------------------------------------------------------------------------------- calls
    def prepare_call(self, x, out, op, stream, count, dtype=None):
        """Validate and resolve everything a launch needs (raises before anything is launched)."""
        if self.closed:
            raise ArgumentError(f"{self.name}: this collective was closed")
        if self._flag.value:
            self._raise_timeout()
        if self._zc is not None and self._zc.twin._flag.value:
            self._zc.twin._raise_timeout()
        if getattr(self.comm, "failed", None) is not None:
            self.comm.refuse(self.name)
        xi = interop.describe(x) if x is not None else None
        oi = interop.describe(out) if out is not None else None
        if oi is None and self.out_units and xi is not None and self.in_units and xi.dtype is not None \
                and xi.numel % self.in_units == 0 and xi.device == self.device:
            out = interop.empty_like_kind(xi.kind, self.out_units * (xi.numel // self.in_units), xi.dtype, self.device)
            oi = interop.describe(out)
        key = (xi, oi, op, count, dtype)
        shape = self._shapes.get(key)
        if shape is None:
            shape = validate_call(
                xi, oi, name=self.name, rank=self.rank, device=self.device, in_units=self.in_units,
                out_units=self.out_units, is_reduce=self.is_reduce, op=op, count=count, dtype_hint=dtype,
            )
            if len(self._shapes) >= _ARGS_CACHE_LIMIT:
                self._shapes.clear()
            self._shapes[key] = shape
        if self._agree:
            self._agree_on(shape)
        if stream is not None:
            handle = interop.stream_handle(stream)
        else:
            kind = xi.kind if xi is not None else (oi.kind if oi is not None else interop.TORCH)
            handle = interop.current_stream(kind, self.device)
        return shape, handle, (out if self.out_units else None)

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

    def target(self, shape: CallShape, epilogue: tuple[int, ...] = ()):
        """What launching ``shape`` takes: (function, grid, block, shared, packed args), or None
        when there is no kernel to launch (count 0, or the ce atom, which is host-driven)."""
        if shape.count == 0 or self._ce is not None:
            return None
        if self._zc is not None and self._zc.pick(shape, record=False) is not None:
            return None  # zero-copy calls take the full path: it checks the heap blocks are still live
        piece = choose_piece(shape.count, self.stage_units, shape.dtype.itemsize, self.layout.stage_bytes, self.row)
        variant = self.variant(shape.dtype, shape.op)
        function, packed = self._packed(variant, shape, piece, epilogue)
        return (function, variant.grid, variant.block, variant.shared, packed)

    def replay_target(self, shape: CallShape):
        """What the fast path may replay for ``shape`` (a call that just ran the full path):
        (target, heap).  A zero-copy call replays its twin's launch once the ranks have agreed
        on it; ``heap`` (set whenever this collective has a twin) makes the replay valid only
        while the heap's blocks are unchanged (``FastPath``).  (None, None): nothing to replay."""
        if self._zc is None:
            return self.target(shape), None
        twin = self._zc.pick(shape, record=False) if shape.count else None
        if twin is None:
            return self.target(shape), self.comm.heap
        if zerocopy.call_key(shape) not in self._zc.offsets:
            return None, None  # not agreed with the peers yet: the full path does that
        return twin.target(shape), self.comm.heap

    def timed_out(self) -> bool:
        """Whether a wait of this collective (or of its zero-copy twin) has timed out."""
        return bool(self._flag.value or (self._zc is not None and self._zc.twin._flag.value))

    def prime(self, shape: CallShape, stream=None) -> None:
        """Load the kernel ``launch(shape)`` will run (this rank's or its zero-copy twin's),
        launching nothing.  A group call primes every rank before it launches any: loading a
        module may wait for the kernels running on the device, and where ranks share a GPU (a
        loopback group) a launched rank waits for the others, so a load after its launch would
        last until that rank's wait timed out."""
        if shape.count == 0 or self._ce is not None:
            return
        twin = self._zc.pick(shape, record=False, stream=stream) if self._zc is not None else None
        if twin is not None:
            self._zc.load_twin(shape)
        else:
            self.variant(shape.dtype, shape.op)

    def blocks(self, shape: CallShape, stream=None) -> Blocks | None:
        """The blocks ``launch(shape, stream)`` runs, once ``prime(shape, stream)`` has loaded its
        kernel (None: no kernel is launched)."""
        if shape.count == 0:
            return None
        twin = self._zc.pick(shape, record=False, stream=stream) if self._zc is not None else None
        runs = twin or self
        if runs._ce is not None:
            return None
        variant = runs.variant(shape.dtype, shape.op)
        return Blocks(self.rank, self.device, variant.grid, variant.block, variant.per_sm)

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
            piece = choose_piece(shape.count, self.stage_units, itemsize, self.layout.stage_bytes)
            self._ce.run(Buffers(shape.in_ptr, shape.out_ptr, tuple(self.stage_ptrs), tuple(self.pad_ptrs),
                                 shape.count, piece, itemsize), stream)
            return
        function, grid, block, shared, packed = self.target(shape, epilogue)
        self._driver.launch(function, grid, block, shared, stream, packed)

    def __call__(self, x=None, out=None, op="sum", stream=None, *, count: int | None = None, dtype=None,
                 **operands):
        """Run on this rank's buffers; returns ``out`` (allocated like ``x`` when None).

        A rank the spec gives no chunks passes no buffers; under torchrun it should pass
        ``count=`` and ``dtype=`` as the others' buffers have them, so that it joins their
        agreement on each new count (otherwise they wait for it, up to the exchange's bound).
        A collective with an epilogue takes its operands by name (``residual=``, ``eps=``...)."""
        fast = self._fast
        if fast is not None and stream is None and dtype is None and fast.matches(x, out, op, count) \
                and not self.timed_out() and fast.launch(self):
            return out
        shape, handle, result = self.prepare_call(x, out, op, stream, count, dtype)
        self.launch(shape, handle, self.operand_words(shape, operands))
        if stream is None and self.epilogue is None:  # operands change per call: the full path checks them
            target, heap = self.replay_target(shape)
            self._fast = FastPath.make(x, out, result, op, count, target, self.out_units, heap)
        return result

    def warm(self, dtype: DType | str, op: ReduceOp | str | None = "sum", *, zero_copy: bool = False) -> None:
        """Compile and load the kernel for (dtype, op) now (a collective under torchrun);
        ``zero_copy=True`` also the zero-copy twin's (otherwise its first heap call does)."""
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


def prepare_group(name: str, ranks: Sequence[Collective], xs, outs, op, streams, count):
    """Validate a group call for every rank before any launch (a launched rank would wait for
    the others): one entry per rank in xs / outs / streams, and one count for all ranks."""
    world = len(ranks)
    xs = list(xs) if xs is not None else [None] * world
    outs = list(outs) if outs is not None else [None] * world
    streams = list(streams) if streams is not None else [None] * world
    for label, values in (("xs", xs), ("outs", outs), ("streams", streams)):
        if len(values) != world:
            raise ArgumentError(f"{name}: {label} has {len(values)} entries, expected {world} (one per rank)")
    prepared = [c.prepare_call(x, o, op, s, count) for c, x, o, s in zip(ranks, xs, outs, streams)]
    # One process holds every rank's buffers: any disagreement is caught before any launch.
    problem = disagreement(name, [call_signature(name, p[0], bool(c.in_units or c.out_units))
                                  for c, p in zip(ranks, prepared)])
    if problem is not None:
        raise problem
    _check_streams(name, ranks, prepared)
    zerocopy.agree_group(ranks, prepared)  # heap buffers: every rank takes the same path
    return prepared


def group_operand_words(name: str, ranks: Sequence[Collective], prepared, operands: dict) -> list[tuple[int, ...]]:
    """Every rank's epilogue words, all checked before any launch (``()`` each where the
    collective has no epilogue and no operands were given)."""
    world = len(ranks)
    if not operands and all(getattr(c, "epilogue", None) is None for c in ranks):
        return [()] * world
    per_rank: list[dict] = [{} for _ in range(world)]
    for key, value in operands.items():
        if isinstance(value, (list, tuple)):
            if len(value) != world:
                raise ArgumentError(f"{name}: operand {key!r} has {len(value)} entries, expected {world} (one per rank)")
            for rank, v in enumerate(value):
                per_rank[rank][key] = v
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            for rank in range(world):
                per_rank[rank][key] = value  # one number for every rank
        else:
            raise ArgumentError(f"{name}: operand {key!r}: expected a list of one value per rank, "
                                f"got {type(value).__name__}")
    return [c.operand_words(shape, ops) for c, (shape, _, _), ops in zip(ranks, prepared, per_rank)]


def dependent_launch(comm, has_pdl) -> bool:
    """Whether ``comm``'s calls launch as programmatic dependents (see Collective.__init__)."""
    return settings.pdl() and has_pdl(comm.device) and not residency.shares_gpu(comm)


def check_residency(name: str, ranks: Sequence[Collective], prepared, known: set) -> None:
    """Refuse, before any launch, a group call whose ranks that share a GPU need more resident
    blocks than it holds (``residency.check``); the ranks' kernels are loaded (``prime``).
    ``known``: the launches already found to fit, so a repeated call costs a set lookup."""
    from purlinc.runtime import driver

    launches = tuple(b for b in (c.blocks(p[0], p[1]) for c, p in zip(ranks, prepared)) if b is not None)
    if launches in known:
        return
    residency.check(name, launches, driver.sm_count)
    known.add(launches)


def _check_streams(name: str, ranks, prepared) -> None:
    """Ranks that share a GPU (a loopback group) wait for each other's kernels: on one
    stream the second would only start once the first gave up waiting."""
    seen: dict[tuple[int, int], int] = {}
    for collective, (shape, handle, _) in zip(ranks, prepared):
        if shape.count == 0:  # nothing is launched
            continue
        other = seen.setdefault((collective.device, handle), collective.rank)
        if other != collective.rank:
            raise ArgumentError(
                f"{name}: ranks {other} and {collective.rank} share cuda:{collective.device} and would run "
                f"on one stream ({handle:#x}), so each would wait for the other forever: pass streams= with "
                "one stream per rank")


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
