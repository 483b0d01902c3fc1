"""A rank's kernels and their launches: a kernel per (dtype, op) loaded on the rank's device
(``_Variant``), its packed arguments cached per call, the launch configuration (programmatic
dependent launch, ``dependent_launch``), and the last eager launch replayed (``FastPath``).

``Launches`` is a part of ``Collective`` (runtime/collective.py), kept apart because it is
one concern; it reads the attributes ``Collective.__init__`` sets (``compiled``, ``comm``,
``rank``, ``device``, ``layout``, the heap pointers, ``_variants``, ``_args``, ``_zc``, ``_ce``)."""

from __future__ import annotations

import logging

from purlinc import settings
from purlinc.atom.cubin import stack_bytes
from purlinc.dtypes import DType, ReduceOp
from purlinc.errors import InternalError
from purlinc.log import log
from purlinc.runtime import interop, residency, zerocopy
from purlinc.runtime.errors import ArgumentError
from purlinc.runtime.residency import Blocks
from purlinc.runtime.validate import CallShape, CallSignature, choose_piece, disagreement

_ARGS_CACHE_LIMIT = 4096


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


def dependent_launch(comm, has_pdl) -> bool:
    """Whether ``comm``'s calls launch as programmatic dependents (see Collective.__init__)."""
    return settings.pdl() and has_pdl(comm.device) and not residency.shares_gpu(comm)


class Launches:
    """A Collective's kernels: loaded per (dtype, op), launched with cached arguments."""

    def variant(self, dtype: DType, op: ReduceOp | None) -> _Variant:
        key = (dtype, op)
        hit = self._variants.get(key)
        if hit is not None:
            return hit
        if self.closed:  # a module loaded now would never be unloaded, nor its peers' exchange answered
            raise ArgumentError(f"{self.name}: this collective was closed")
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
        residency.check_placed_peers(self.name, self.comm, abi.channels, abi.threads, per_sm, driver.sm_count)
        hit = _Variant(function, module, abi, key, lean, per_sm)
        self._variants[key] = hit
        if log.isEnabledFor(logging.INFO):
            log.info("%s rank %d: kernel for %s%s loaded: %s", self.name, self.rank, dtype.value,
                     f" {op.value}" if op else "", self.compiled.options.key())
        return hit

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
                stage=self.stage_ptrs, staging=self.layout.staging, signals=self.pad_ptrs, epilogue=epilogue,
            )
            pointers = (shape.in_ptr, shape.out_ptr, *(p for ptrs in peers.values() for p in ptrs))
            lean = variant.lean is not None and variant.abi.lean_fits(shape.count, piece, pointers, self.layout.staging)
            config = DependentLaunch(variant.grid, variant.block, variant.shared) if self._pdl else None
            hit = self._args[key] = (variant.lean if lean else variant.function, PackedArgs(data, config))
        return hit

    def target(self, shape: CallShape, epilogue: tuple[int, ...] = ()):
        """What launching ``shape`` takes: (function, grid, block, shared, packed args), or None
        when there is no kernel to launch (count 0, or the ce atom, which is host-driven)."""
        if shape.count == 0 or self._ce is not None:
            return None
        if self._zc is not None and self._zc.pick(shape, record=False) is not None:
            return None  # zero-copy calls take the full path: it checks the heap blocks are still live
        variant = self.variant(shape.dtype, shape.op)  # first: a dtype it cannot run says so
        piece = choose_piece(shape.count, self.layout.staging, shape.dtype.itemsize, self.row)
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
