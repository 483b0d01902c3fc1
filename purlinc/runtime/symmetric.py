"""The symmetric allocator: caller buffers in Purlin's heap, at the same offset on every rank.

Three ways in (all collectives: every rank calls them in the same order with the same sizes,
like ``torch.distributed._symmetric_memory.empty``):

- ``comm.empty(shape, dtype)``: a torch tensor; its block is freed when the tensor and all
  its views are gone (the tensor holds the :class:`HeapBlock` through
  ``__cuda_array_interface__``, which torch keeps referenced).
- ``comm.alloc(nbytes)``: a :class:`HeapBlock` for CuPy (``cupy.asarray(block)``), Numba or
  raw pointers (``block.ptr``, ``block.peer_ptr(rank)``); ``block.free()`` gives it back.
- ``comm.mem_pool(nbytes)``: a ``torch.cuda.MemPool`` over a heap region of ``nbytes``, so
  ordinary torch code allocates there (``with torch.cuda.use_mem_pool(pool): ...``).  The
  pool's allocator sub-allocates the region deterministically (no communication inside the
  allocator callback); torch's caching allocator asks for whole segments (2 MiB and up), so
  size the region for what the code allocates plus that rounding.

Under torchrun every block's offset is checked across ranks when it is made (a host
exchange), so later calls can name it by offset.  Collectives called on buffers that live in
a live block take the zero-copy schedules (``purlinc.runtime.zerocopy``).
"""

from __future__ import annotations

import ctypes
import weakref

from purlinc.runtime.errors import ArgumentError, MismatchError
from purlinc.runtime.validate import integer

# Communicators that have handed out blocks: a buffer of another communicator is then named
# in the error instead of being taken for an ordinary (staged) buffer.
_OWNERS: "weakref.WeakSet" = weakref.WeakSet()
_KEEP: list = []  # ctypes callbacks of memory pools: torch holds raw pointers to them


class HeapBlock:
    """``nbytes`` of one rank's symmetric heap at heap offset ``offset`` (``ptr`` here)."""

    __slots__ = ("comm", "offset", "nbytes", "ptr", "freed", "__weakref__")

    def __init__(self, comm, offset: int, nbytes: int):
        self.comm = comm
        self.offset = offset
        self.nbytes = nbytes
        self.ptr = comm.heap.ptr(comm.rank, offset)
        self.freed = False

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"{self.ptr:#x}"
        return f"HeapBlock(rank={self.comm.rank}, offset={self.offset}, nbytes={self.nbytes}, {state})"

    @property
    def __cuda_array_interface__(self) -> dict:
        if self.freed:
            raise ArgumentError(f"{self!r} was freed")
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3,
                "strides": None}

    def peer_ptr(self, rank: int) -> int:
        """Where this block of ``rank``'s heap is mapped in this process."""
        return self.comm.heap.ptr(rank, self.offset)

    def free(self) -> None:
        """Give the block back (local; free in the same order on every rank)."""
        if self.freed:
            return
        self.freed = True
        if not getattr(self.comm, "closed", False):
            self.comm.heap.free_user(self.offset)

    def __del__(self):
        try:
            self.free()
        except Exception:  # interpreter shutdown, or a communicator already torn down
            pass


def _check_open(comm) -> None:
    if getattr(comm, "closed", False):
        raise ArgumentError(f"{comm!r} is closed")


def _byte_count(nbytes, what: str) -> int:
    """``nbytes`` as an int >= 0 (any integer type): int() would take 1.5 as 1 and "16" as 16."""
    try:
        count = integer(nbytes)
    except TypeError:
        count = -1
    if count < 0:
        raise ArgumentError(f"{what}: nbytes={nbytes!r}, expected an int >= 0")
    return count


def alloc(comm, nbytes: int, what: str = "comm.alloc") -> HeapBlock:
    _check_open(comm)
    nbytes = _byte_count(nbytes, what)
    offset = comm.heap.alloc_user(max(nbytes, 1), f"{what}({nbytes} bytes)")
    block = HeapBlock(comm, offset, nbytes)
    if comm._exchange is not None:  # torchrun: every rank must have the block at the same offset
        try:
            everyone = comm.allgather(("heap-block", offset, nbytes))
        except BaseException:  # the peers are elsewhere (a mismatch, a timeout): the block is not theirs
            block.free()
            raise
        if len({tuple(e[1:]) for e in everyone}) != 1:
            block.free()
            raise MismatchError(
                f"{what}: ranks got different heap blocks: "
                + ", ".join(f"rank {r}: offset {e[1]}, {e[2]} bytes" for r, e in enumerate(everyone)),
                notes=("allocate and free heap blocks in the same order, with the same sizes, on every rank",),
            )
    _OWNERS.add(comm)
    return block


def _torch_dtype(torch, dtype, where: str):
    if isinstance(dtype, str):
        found = getattr(torch, dtype, None)
        if not isinstance(found, torch.dtype):
            raise ArgumentError(f"{where}: unknown torch dtype {dtype!r}")
        return found
    if not isinstance(dtype, torch.dtype):
        raise ArgumentError(f"{where}: dtype {dtype!r}: expected a torch.dtype or its name")
    return dtype


def _dims(shape, where: str) -> tuple[int, ...]:
    """A shape (an int, or a sequence of them) as a tuple of ints >= 0, checked before any
    allocation: (-2, -3) would take a heap block (a collective under torchrun) before torch
    refused the view, and 2.5 would be cut to 2."""
    dims = None
    if not isinstance(shape, (str, bytes)):
        try:
            dims = (integer(shape),)
        except TypeError:
            try:
                dims = tuple(integer(d) for d in shape)
            except TypeError:
                dims = None
    if dims is None or any(d < 0 for d in dims):
        raise ArgumentError(f"{where}: shape {shape!r}: expected dimensions that are ints >= 0")
    return dims


def tensor_of(block: HeapBlock, shape, dtype):
    """A torch tensor viewing ``block`` (it keeps the block alive)."""
    import torch

    shape, dtype, numel, itemsize = _tensor_size(torch, shape, dtype, "a heap tensor")
    if numel * itemsize > block.nbytes:
        raise ArgumentError(f"a {shape} {dtype} tensor needs {numel * itemsize} bytes; {block!r} holds {block.nbytes}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype, device=f"cuda:{block.comm.device}")
    with torch.cuda.device(block.comm.device):
        raw = torch.as_tensor(block, device=f"cuda:{block.comm.device}")
    if raw.data_ptr() != block.ptr:
        raise RuntimeError(f"torch copied the heap block instead of viewing it ({raw.data_ptr():#x} != {block.ptr:#x})")
    return raw[: numel * itemsize].view(dtype).view(shape)


def empty(comm, shape, dtype):
    import torch

    dims, dtype, numel, itemsize = _tensor_size(torch, shape, dtype, "comm.empty")
    block = alloc(comm, numel * itemsize, f"comm.empty({list(dims)}, {dtype})")
    return tensor_of(block, dims, dtype)


def _tensor_size(torch, shape, dtype, where: str) -> tuple[tuple[int, ...], object, int, int]:
    """(dims, torch dtype, elements, bytes per element) of a tensor of ``shape`` and ``dtype``."""
    dtype = _torch_dtype(torch, dtype, where)
    dims = _dims(shape, where)
    numel = 1
    for dim in dims:
        numel *= dim
    return dims, dtype, numel, torch.empty((), dtype=dtype).element_size()


def group_empty(group, shape, dtype) -> list:
    tensors = [empty(comm, shape, dtype) for comm in group.comms]
    offsets = {comm.heap.offset_of(t.data_ptr())[0] for comm, t in zip(group.comms, tensors)}
    if len(offsets) != 1:
        raise MismatchError(f"the LocalGroup's heaps are out of step: one tensor at offsets {sorted(offsets)}")
    return tensors


def owner_of(ptr: int, comm):
    """Another communicator whose heap holds ``ptr`` (on this process), or None."""
    for other in list(_OWNERS):
        if other is comm or getattr(other, "closed", False):
            continue
        if other.heap.offset_of(ptr) is not None:
            return other
    return None


def any_blocks() -> bool:
    return any(other.heap.user for other in list(_OWNERS) if not getattr(other, "closed", False))


# ---------------------------------------------------------------------------------------------
# torch MemPool over a heap region

_ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)


class PoolRegion:
    """The bookkeeping behind ``comm.mem_pool``: a heap block and a first-fit over it.

    ``malloc``/``free`` are what torch's pluggable allocator calls (through ctypes); they touch
    only this region, so they never communicate.  A request that does not fit returns NULL,
    which torch reports as out of memory.
    """

    def __init__(self, block: HeapBlock):
        from purlinc.runtime.heap import FirstFit

        self.block = block
        self.fit = FirstFit(block.nbytes)
        self.failed: list[str] = []
        self.calls = 0  # malloc calls torch made (diagnostics)

    def malloc(self, size: int, device: int, stream) -> int:
        self.calls += 1
        try:
            if device != self.block.comm.device:
                self.failed.append(f"asked for {size} bytes on cuda:{device}; the pool lives on "
                                   f"cuda:{self.block.comm.device}")
                return 0
            offset = self.fit.alloc(size)
            if offset is None:
                self.failed.append(f"{size} bytes asked for, the largest free block is {self.fit.largest_free}")
                return 0
            return self.block.ptr + offset
        except Exception as error:  # never raise through C
            self.failed.append(f"{type(error).__name__}: {error}")
            return 0

    def free(self, ptr, size: int, device: int, stream) -> None:
        try:
            self.fit.free(int(ptr) - self.block.ptr)
        except Exception as error:
            self.failed.append(f"free({ptr}): {type(error).__name__}: {error}")


def mem_pool(comm, nbytes: int):
    import torch

    custom = getattr(torch._C, "_cuda_customAllocator", None)
    if custom is None or not hasattr(torch.cuda, "MemPool"):
        raise ArgumentError(f"this torch ({torch.__version__}) offers no pluggable allocator / MemPool: "
                            "use comm.empty instead")
    block = alloc(comm, nbytes, "comm.mem_pool")
    region = PoolRegion(block)
    malloc, free = _ALLOC_FN(region.malloc), _FREE_FN(region.free)
    allocator = custom(ctypes.cast(malloc, ctypes.c_void_p).value, ctypes.cast(free, ctypes.c_void_p).value)
    # A MemPool binds its allocator on the device current at its creation: made while another
    # device was current, allocations on this one bypass it (seen on 2 x H200: torch never
    # called the allocator for cuda:0).
    with torch.cuda.device(comm.device):
        pool = torch.cuda.MemPool(allocator)
    _KEEP.append((region, malloc, free, allocator))
    try:
        pool.purlin_region = region  # for error messages and tests
    except AttributeError:
        pass
    return pool
