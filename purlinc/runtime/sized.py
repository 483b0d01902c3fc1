"""Loaded collectives with run-time sizes (docs/LANGUAGE.md, "Run-time sizes"):
``purlinc.load(path, comm, capacity=C)`` on a spec with ``with sizes ...``.

Call (one rank): ``coll(x, sizes, out=None, out_sizes=None, stream=None, *, row=1, expected_sizes=None)
-> (out, out_sizes)``; sizes count units of ``row`` elements (1: elements; torch's split sizes
count rows of dim 0).  ``sizes`` is an int64 device tensor with one entry per chunk of this
rank's input, read by the kernel when it runs; ``out_sizes`` (int64, one per output chunk) is
written by it.  ``expected_sizes`` (int64, one per output chunk, read by the kernel), where
the caller knows what it will receive (torch's ``output_split_sizes``): the output is laid
out by them, and a chunk that arrives with another size is not written but reported.  The
host never reads either, so a call can be captured in a CUDA graph once (after one warm-up
call per dtype) and replayed with new sizes written into the same ``sizes`` tensor.

Staging, signal pads and call counters come from the symmetric heap at load, sized by the
capacity (elements per chunk) and the widest dtype the call may use (``dtype=`` at load, or
the widest dtype the copy path takes).  Sizes over the capacity, or chunks past a buffer,
are moved as size 0, chunks that differ from the expected sizes are not written, and either is
recorded on the device; ``check()`` and the next call raise them as ``SizeError`` (the
collective stays usable: no signal is out of step).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from purlinc import settings
from purlinc.atom.abi import ERROR_RECORD, ERROR_RECORD_BYTES, decode_error
from purlinc.atom.sized import SIZE_ERROR_RECORD, SIZE_ERROR_BYTES, describe_size_error, pack_sized_args, slot_bytes
from purlinc.dtypes import DType
from purlinc.errors import PurlinError
from purlinc.pipeline import Compiled
from purlinc.runtime import interop, residency
from purlinc.runtime.errors import ArgumentError, MismatchError, PurlinTimeoutError, issued_by_one_thread
from purlinc.runtime.group import per_rank, refuse_shared_writes
from purlinc.runtime.residency import Blocks
from purlinc.runtime.validate import check_readable, integer_or_none, overlapping

WIDEST = max(d.itemsize for d in DType)


class SizeError(PurlinError):
    """A call's run-time sizes exceeded the capacity or a buffer; ``record`` holds the words."""

    def __init__(self, message: str, span=None, notes=(), *, record: dict[str, int] | None = None):
        super().__init__(message, span, notes)
        self.record = dict(record or {})


def staging_bytes(compiled: Compiled, capacity: int, itemsize: int) -> int:
    schedule = compiled.schedule
    return schedule.staging_units * slot_bytes(schedule.channels, capacity * itemsize)


class SizedCollective:
    """One rank of a loaded collective with run-time sizes."""

    def __init__(self, compiled: Compiled, comm, layout, *, capacity: int, itemsize: int, agree: bool):
        from purlinc.runtime import driver

        schedule = compiled.schedule
        self.compiled, self.name, self.comm = compiled, compiled.name, comm
        self.rank, self.device, self.layout = comm.rank, comm.device, layout
        self.capacity, self.itemsize = capacity, itemsize
        self.in_units = schedule.in_units[self.rank]
        self.out_units = schedule.out_units[self.rank]
        self.timeout_ns = settings.wait_timeout_ns()
        self._driver, self._agree, self._agreed = driver, agree, set()
        self.stage_ptrs = comm.heap.ptrs(layout.stage)
        self.pad_ptrs = comm.heap.ptrs(layout.pad)
        self.counters_ptr = comm.heap.ptr(self.rank, layout.counters)
        driver.set_current(self.device)
        self.error_host, self.error_dev = driver.host_alloc_mapped(ERROR_RECORD_BYTES)
        self.size_host, self.size_dev = driver.host_alloc_mapped(SIZE_ERROR_BYTES)
        ctypes.memset(self.error_host, 0, ERROR_RECORD_BYTES)
        ctypes.memset(self.size_host, 0, SIZE_ERROR_BYTES)
        from purlinc.runtime.collective import dependent_launch  # not where ranks share a GPU

        self._pdl = dependent_launch(comm, driver.has_dependent_launch)
        self._variants: dict = {}
        self._per_sm: dict = {}  # dtype -> blocks of its kernel one SM holds (residency)
        self._args: dict = {}
        self.closed = False
        comm.register(self)

    def __repr__(self) -> str:
        return (f"SizedCollective({self.name}, rank={self.rank}/{self.compiled.world_size}, "
                f"capacity={self.capacity}, {self.compiled.options.key()}, cuda:{self.device})")

    # ---- errors
    def _words(self, address: int, names) -> tuple[int, ...]:
        return tuple((ctypes.c_uint64 * len(names)).from_address(address))

    def check(self) -> None:
        """Raise what an earlier call recorded on the device: a wait that timed out
        (PurlinTimeoutError; the collective is then out of step) or a size error (SizeError,
        cleared once raised).  Reads host-mapped memory only: no synchronisation.  A closed
        collective has nothing to report (its records are freed host memory)."""
        if self.closed:
            return
        record = decode_error(self._words(self.error_host, ERROR_RECORD))
        if record["flag"]:
            error = PurlinTimeoutError(
                f"{self.name}: rank {record['rank']} timed out in channel {record['channel']}, step {record['step']}, "
                f"waiting for signal r{record['signal_owner']}.sig[{record['signal_index']}] >= {record['expected']}, "
                f"observed {record['observed']}", notes=("a peer did not call this collective", *issued_by_one_thread(self.comm)), record=record)
            self.comm.fail(error)
            raise error
        words = self._words(self.size_host, SIZE_ERROR_RECORD)
        if words[0]:
            ctypes.memset(self.size_host, 0, SIZE_ERROR_BYTES)
            raise SizeError(f"{self.name}: {describe_size_error(words, self.compiled.spec)}",
                            notes=("the other chunks of that call were moved; out_sizes says what was written",),
                            record=dict(zip(SIZE_ERROR_RECORD, words)))

    # ---- kernels
    def variant(self, dtype: DType):
        hit = self._variants.get(dtype)
        if hit is not None:
            return hit
        if self.closed:  # a module loaded now would never be unloaded
            raise ArgumentError(f"{self.name}: this collective was closed")
        if dtype.itemsize > self.itemsize:
            raise ArgumentError(f"{self.name}: dtype {dtype.value} ({dtype.itemsize} bytes) is wider than this load's "
                                f"staging allows ({self.itemsize} bytes per element)", notes=(
                                    "load with dtype= the widest dtype the calls use",))
        if self._agree:
            everyone = self.comm.allgather(("sized-variant", self.name, dtype.value))
            if len({e for e in everyone}) != 1:
                raise MismatchError(f"{self.name}: the ranks disagree on the dtype of a call: {everyone}")
        kernel = self.compiled.kernel(dtype)
        self._driver.set_current(self.device)
        module = self._driver.module_load(kernel.cubin)
        function = self._driver.get_function(module, kernel.abi.entry(self.rank))
        per_sm = self._driver.blocks_per_sm(function, kernel.abi.threads, 0)
        residency.check_placed_peers(self.name, self.comm, kernel.abi.channels, kernel.abi.threads, per_sm,
                                     self._driver.sm_count)
        self._per_sm[dtype] = per_sm
        hit = self._variants[dtype] = (function, module, kernel.abi)
        return hit

    def blocks(self, dtype: DType) -> Blocks:
        """The blocks a call of ``dtype`` launches (its kernel loaded: ``variant``)."""
        abi = self.variant(dtype)[2]
        return Blocks(self.rank, self.device, abi.channels, abi.threads, self._per_sm[dtype])

    def _launch_args(self, dtype: DType, shape: tuple):
        from purlinc.runtime.driver import DependentLaunch, PackedArgs

        key = (dtype, shape)
        hit = self._args.get(key)
        if hit is None:
            function, _, abi = self.variant(dtype)
            in_ptr, in_elems, sizes_ptr, out_ptr, out_elems, out_sizes_ptr, expected_ptr, row = shape
            data = pack_sized_args(
                abi, capacity_bytes=self.capacity * self.itemsize, capacity=self.capacity // row,
                unit_bytes=row * dtype.itemsize, in_len=in_elems // row, out_len=out_elems // row,
                timeout_ns=self.timeout_ns,
                in_ptr=in_ptr, out_ptr=out_ptr, sizes_ptr=sizes_ptr, out_sizes_ptr=out_sizes_ptr,
                counters_ptr=self.counters_ptr, error_ptr=self.error_dev, size_error_ptr=self.size_dev,
                stage=self.stage_ptrs, signals=self.pad_ptrs, expected_ptr=expected_ptr)
            config = DependentLaunch(abi.channels, abi.threads, 0) if self._pdl else None
            if len(self._args) > 4096:
                self._args.clear()
            hit = self._args[key] = (function, abi, PackedArgs(data, config))
        return hit

    # ---- calls
    def prepare_call(self, x, sizes, out, out_sizes, stream, row: int = 1, expected_sizes=None):
        """Validate (nothing launched on a mistake); allocate ``out`` (capacity per output
        chunk) and ``out_sizes`` when not given.  Sizes count units of ``row`` elements (torch's
        splits count rows).  Returns (dtype, shape, stream, out, out_sizes)."""
        self._check_usable()
        whole = integer_or_none(row)  # a NumPy integer too, as an int (it keyed the launch cache apart from the int)
        if whole is None or not 1 <= whole <= self.capacity:
            raise ArgumentError(f"{self.name}: row={row!r}, expected elements per size unit in 1..{self.capacity} "
                                "(the capacity)")
        row = whole
        where = f"{self.name} on rank {self.rank}"
        if x is None and not self.in_units:  # a rank that gives nothing: the call's dtype is its out's
            if out is None:
                raise ArgumentError(f"{where}: this rank gives no chunks and x is None: pass out= (its dtype is the "
                                    "call's), or an empty x")
            oi = interop.described(where, "out", out)
            dtype = _check_data(self, "out", oi, None, row)
            xi = _nothing(oi.kind, dtype, self.device)
        else:
            xi = interop.described(where, "x", x)
            dtype = _check_data(self, "x", xi, None, row)
            if out is None and (self.out_units or xi.kind in (interop.TORCH, interop.CUPY)):
                try:
                    out = interop.empty_like_kind(xi.kind, self.out_units * (self.capacity // row) * row, dtype,
                                                  self.device)
                except TypeError as error:  # no library to allocate with: an argument mistake like the others
                    raise ArgumentError(f"{where}: out is required: {error}") from None
            oi = _nothing(xi.kind, dtype, self.device) if out is None else interop.described(where, "out", out)
            _check_data(self, "out", oi, dtype, row)
        if out_sizes is None and (self.out_units or xi.kind in (interop.TORCH, interop.CUPY)):
            out_sizes = _empty_int64(where, xi.kind, self.out_units, self.device)
        si = _check_sizes(self, "sizes", interop.described(where, "sizes", sizes), self.in_units)
        osi = (_nothing(xi.kind, DType.INT64, self.device) if out_sizes is None else
               _check_sizes(self, "out_sizes", interop.described(where, "out_sizes", out_sizes), self.out_units))
        read = [("x", xi), ("sizes", si)]
        if expected_sizes is not None:
            ei = _check_sizes(self, "expected_sizes", interop.described(where, "expected_sizes", expected_sizes),
                              self.out_units)
            read.append(("expected_sizes", ei))
        _check_apart(self, read + [("out", oi), ("out_sizes", osi)], written=("out", "out_sizes"))
        handle = interop.stream_handle(stream) if stream is not None else interop.current_stream(xi.kind, self.device)
        expected_ptr = ei.ptr if expected_sizes is not None else 0
        return dtype, (xi.ptr, xi.numel, si.ptr, oi.ptr, oi.numel, osi.ptr, expected_ptr, row), handle, out, out_sizes

    def _check_usable(self) -> None:
        if self.closed:
            raise ArgumentError(f"{self.name}: this collective was closed")
        if getattr(self.comm, "failed", None) is not None:
            self.comm.refuse(self.name)
        self.check()

    def launch(self, dtype: DType, shape: tuple, stream: int) -> None:
        function, abi, packed = self._launch_args(dtype, shape)
        self._driver.set_current(self.device)
        self._driver.launch(function, abi.channels, abi.threads, 0, stream, packed)

    def __call__(self, x, sizes=None, out=None, out_sizes=None, stream=None, *, row: int = 1, expected_sizes=None,
                 **operands):
        """``sizes`` positionally or by the operand's name (``n=`` for ``with sizes n[..] of x``)."""
        sizes = _named_sizes(self, sizes, operands)
        dtype, shape, handle, out, out_sizes = self.prepare_call(x, sizes, out, out_sizes, stream, row, expected_sizes)
        self.launch(dtype, shape, handle)
        return out, out_sizes

    def warm(self, dtype) -> None:
        self.variant(dtype if isinstance(dtype, DType) else DType.parse(dtype))

    def close(self) -> None:
        if self.closed:
            return
        driver = self._driver
        driver.synchronize(self.device)
        for _, module, _ in self._variants.values():
            driver.module_unload(module)
        driver.host_free(self.error_host)
        driver.host_free(self.size_host)
        self._variants.clear()
        for offset in (self.layout.stage, self.layout.pad, self.layout.counters):
            self.comm.heap.free(offset)
        self.closed = True
        self.comm.unregister(self)


def _named_sizes(coll: SizedCollective, sizes, operands: dict):
    name = coll.compiled.spec.sizes.operand
    unknown = sorted(set(operands) - {name})
    if unknown:
        raise ArgumentError(f"{coll.name}: unknown operand(s) {', '.join(unknown)}; this collective takes '{name}' "
                            "(its sizes)")
    if name in operands:
        if sizes is not None:
            raise ArgumentError(f"{coll.name}: sizes given twice (positionally and as {name}=)")
        sizes = operands[name]
    if sizes is None:
        raise ArgumentError(f"{coll.name} on rank {coll.rank}: {name} (the sizes of this rank's input chunks) is "
                            "required, got None")
    return sizes


def _check_data(coll: SizedCollective, label: str, info, dtype: DType | None, row: int) -> DType:
    where = f"{coll.name} on rank {coll.rank}: {label}"
    if info.dtype is None:
        raise ArgumentError(f"{where} has dtype {info.dtype_name}, which Purlin does not support")
    if dtype is not None and info.dtype is not dtype:
        raise ArgumentError(f"{where} has dtype {info.dtype.value}, expected {dtype.value} (the dtype of x)")
    _check_device(coll, where, info)
    if not info.contiguous:
        raise ArgumentError(f"{where} is not contiguous")
    check_readable(where, info)
    if info.ptr % info.dtype.itemsize:  # the kernel moves whole elements (as validate_call checks)
        raise ArgumentError(f"{where} at {info.ptr:#x} is not aligned to its element size ({info.dtype.itemsize} bytes)")
    if info.numel % row:
        raise ArgumentError(f"{where} has {info.numel} elements, expected a multiple of row={row}")
    return info.dtype


def _check_apart(coll: SizedCollective, named, *, written) -> None:
    """Each buffer the kernel writes (``written``) apart in memory from every buffer before it in
    ``named`` (``(label, ArrayInfo)``): it reads x and sizes while it writes out and out_sizes."""
    for n, (label, info) in enumerate(named):
        if label not in written or not info.nbytes:
            continue
        for other, seen in named[:n]:
            a0, a1, b0, b1 = info.ptr, info.ptr + info.nbytes, seen.ptr, seen.ptr + seen.nbytes
            if overlapping((a0, a1), (b0, b1)):
                raise ArgumentError(f"{coll.name} on rank {coll.rank}: {label} overlaps {other} in memory ([{a0:#x}, "
                                    f"{a1:#x}) and [{b0:#x}, {b1:#x})), expected a buffer of its own",
                                    notes=(f"the kernel writes {label} while it reads or writes {other}",))


def _nothing(kind: str, dtype: DType, device: int) -> interop.ArrayInfo:
    """An empty buffer where a rank passes none (it gives or receives no chunks)."""
    return interop.ArrayInfo(0, 0, dtype, dtype.value, device, True, kind)


def _check_sizes(coll: SizedCollective, label: str, info, count: int):
    where = f"{coll.name} on rank {coll.rank}: {label}"
    # By the dtype, not its name: "uint64" contains "int64" (and then, itemsize unknown, its
    # overlap check was skipped), and a DLPack int64 is named by its type code
    if info.dtype is not DType.INT64:
        raise ArgumentError(f"{where} has dtype {info.dtype_name}, expected int64 (one size per chunk)")
    if info.numel != count:
        raise ArgumentError(f"{where} has {info.numel} entries, expected {count} (one per chunk of this rank's "
                            f"{'input' if label == 'sizes' else 'output'})")
    _check_device(coll, where, info, " (sizes stay on the GPU)")
    if not info.contiguous:
        raise ArgumentError(f"{where} is not contiguous")
    check_readable(where, info)
    if info.ptr % 8:
        raise ArgumentError(f"{where} at {info.ptr:#x} is not aligned to 8 bytes (int64 sizes)")
    return info


def _check_device(coll: SizedCollective, where: str, info, why: str = "") -> None:
    """An empty buffer has no device to check (an empty CUDA array interface reports none), so a
    rank that gives or receives no chunks can pass empty arrays of any kind."""
    if info.numel and info.device != coll.device:
        raise ArgumentError(f"{where} is on {'cuda:%d' % info.device if info.device >= 0 else info.place}, "
                            f"expected cuda:{coll.device}{why}")


def _empty_int64(where: str, kind: str, numel: int, device: int):
    if kind == interop.TORCH:
        import torch

        return torch.zeros(numel, dtype=torch.int64, device=f"cuda:{device}")
    if kind == interop.CUPY:
        import cupy

        with cupy.cuda.Device(device):
            return cupy.zeros(numel, dtype="int64")
    raise ArgumentError(f"{where}: out_sizes is required: Purlin allocates it with torch or CuPy, like the "
                        f"call's buffers, and these are {kind} arrays", notes=("pass out_sizes= (int64, one per "
                                                                               "output chunk)",))


class GroupSized:
    """A LocalGroup's sized collective: ``g(xs, sizes, outs=None, out_sizes=None, streams=None)``
    with one entry per rank; every rank is validated and its kernel loaded before any launch."""

    def __init__(self, ranks: Sequence[SizedCollective]):
        self.ranks = list(ranks)
        self.name = ranks[0].name
        self._fits: set = set()  # launches found to fit their GPUs (residency.check)

    def __getitem__(self, rank: int) -> SizedCollective:
        return self.ranks[rank]

    def __len__(self) -> int:
        return len(self.ranks)

    def __call__(self, xs, sizes=None, outs=None, out_sizes=None, streams=None, *, row: int = 1, expected_sizes=None,
                 **operands):
        sizes = _named_sizes(self.ranks[0], sizes, operands)  # one per rank, positionally or by name
        world = len(self.ranks)
        xs, outs, out_sizes, streams, expected_sizes = (
            per_rank(self.name, label, values, world) for label, values in
            (("xs", xs), ("outs", outs), ("out_sizes", out_sizes), ("streams", streams),
             ("expected_sizes", expected_sizes)))
        sizes = per_rank(self.name, "sizes", sizes, world)
        prepared = [c.prepare_call(x, n, out, out_n, stream, row, expect) for c, x, n, out, out_n, stream, expect in
                    zip(self.ranks, xs, sizes, outs, out_sizes, streams, expected_sizes)]
        if len({p[0] for p in prepared}) != 1:
            raise MismatchError(f"{self.name}: the ranks' inputs have different dtypes: {[p[0].value for p in prepared]}")
        # one process holds every rank's buffers: one rank's outputs may not be another's buffers
        refuse_shared_writes(self.name, [_call_extents(c, p[0], p[1]) for c, p in zip(self.ranks, prepared)])
        seen = {}
        for c, p in zip(self.ranks, prepared):
            if seen.setdefault((c.device, p[2]), c.rank) != c.rank:
                raise ArgumentError(f"{self.name}: ranks {seen[c.device, p[2]]} and {c.rank} share cuda:{c.device} and "
                                    "one stream; each would wait for the other: pass streams= with one stream per rank")
        for c, p in zip(self.ranks, prepared):
            c.variant(p[0])  # every module loaded before any rank runs (a load waits for running kernels)
        # Ranks that share a GPU wait for each other's blocks: all of them must be resident at once.
        launches = tuple(c.blocks(p[0]) for c, p in zip(self.ranks, prepared))
        if launches not in self._fits:
            residency.check(self.name, launches, self.ranks[0]._driver.sm_count)
            self._fits.add(launches)
        for c, p in zip(self.ranks, prepared):
            c.launch(p[0], p[1], p[2])
        return [p[3] for p in prepared], [p[4] for p in prepared]

    def check(self) -> None:
        for c in self.ranks:
            c.check()

    def close(self) -> None:
        for c in self.ranks:
            c.close()


def _call_extents(c: SizedCollective, dtype: DType, args: tuple) -> list[tuple[str, int, int, bool]]:
    """(label, start, end, written) of one rank's call buffers, from its prepared kernel
    arguments (``prepare_call``: pointers and element counts; sizes are int64)."""
    x, x_numel, sizes, out, out_numel, out_sizes, expected, _ = args
    extents = [("x", x, x + x_numel * dtype.itemsize, False), ("sizes", sizes, sizes + 8 * c.in_units, False),
               ("out", out, out + out_numel * dtype.itemsize, True),
               ("out_sizes", out_sizes, out_sizes + 8 * c.out_units, True)]
    if expected:
        extents.append(("expected_sizes", expected, expected + 8 * c.out_units, False))
    return extents


def load_sized(compiled: Compiled, comm, comms: list, *, capacity: int, dtype=None):
    """Take heap space on every rank of ``comms`` for ``compiled`` at ``capacity`` elements
    per chunk, zero it, and check the ranks agree (as every load: purlinc.runtime.collective)."""
    from purlinc.runtime import driver
    from purlinc.runtime.collective import Layout
    from purlinc.runtime.placement import fingerprint, load_mismatch, zero_space
    from purlinc.runtime.communicator import LocalGroup

    whole = integer_or_none(capacity)  # a NumPy integer too
    if whole is None or whole < 1:
        raise ArgumentError(f"{compiled.name}: capacity must be a positive number of elements per chunk, got {capacity!r}")
    capacity = whole
    itemsize = DType.parse(dtype).itemsize if dtype is not None else WIDEST
    stage = staging_bytes(compiled, capacity, itemsize)
    layouts = []
    for c in comms:
        heap = c.heap
        layouts.append(Layout(heap.alloc(stage, f"{compiled.name} staging"), stage,
                              heap.alloc(8 * max(compiled.schedule.signal_pad_size(), 1), f"{compiled.name} signal pad"),
                              8 * max(compiled.schedule.signal_pad_size(), 1),
                              heap.alloc(8 * compiled.schedule.channels, f"{compiled.name} call counters"),
                              8 * compiled.schedule.channels))
    if not isinstance(comm, LocalGroup):
        fp = fingerprint(compiled, layouts[0]) + f"/c{capacity}/i{itemsize}"
        everyone = comm.allgather(("load", fp, {**compiled.identity(), "capacity": capacity, "itemsize": itemsize}))
        if len({e[1] for e in everyone}) != 1:
            raise load_mismatch(compiled.name, [e[1] for e in everyone], [e[2] for e in everyone])
    for c, layout in zip(comms, layouts):
        zero_space(c, compiled, layout)
        driver.synchronize(c.device)
    ranks = [SizedCollective(compiled, c, l, capacity=capacity, itemsize=itemsize,
                             agree=not isinstance(comm, LocalGroup)) for c, l in zip(comms, layouts)]
    if isinstance(comm, LocalGroup):
        return GroupSized(ranks)
    comm.allgather(("zeroed", compiled.name))
    return ranks[0]
