"""Communicators: who the ranks are, where their memory is, and how they agree.

Two ways in:

- ``Communicator.from_torch(group=None)``: one process per GPU under ``torchrun``.  The
  bootstrap goes through the process group's own store (host-side object exchange that never
  touches a CUDA stream, so it is safe even while a graph is being captured, and needs no new
  group).  The symmetric heap is exported with CUDA IPC handles and opened by every peer.
- ``LocalGroup(devices)``: one process driving several GPUs with peer access; it holds one
  Communicator per device.  Pointers need no translation (one address space).

After a timeout (``PurlinTimeoutError``: a device-side wait ran out, or a host-side exchange
with the other ranks failed) the communicator refuses every further call and load with a
clear error: a peer that missed a call leaves the signals of every collective out of step,
and a peer that died cannot come back.  Create a new Communicator (or LocalGroup) and load
again, on the same store if you like (each communicator's exchange rounds live under a
generation of their own: ``rendezvous.Exchange``); the heap of the failed one is still freed
by ``close()``.

Each Communicator owns a symmetric heap from which every loaded collective takes its staging
space, signal pads and call counters, and ``comm.empty`` its tensors, at the same offsets on
every rank.  The heap starts with one segment of ``PURLIN_HEAP_MB`` and grows on demand by
further segments (``cuMemAlloc`` + CUDA IPC handles exchanged when a segment is created;
growth happens inside allocations every rank makes at the same point), up to
``PURLIN_HEAP_MAX_MB`` (0: no bound but the device's memory).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from purlinc import settings
from purlinc.errors import PurlinError
from purlinc.log import log
from purlinc.runtime import bootstrap
from purlinc.runtime.errors import ArgumentError, MismatchError, PurlinTimeoutError
from purlinc.runtime.heap import SymmetricHeap

EXCHANGE_TIMEOUT_S = 300.0  # host-side exchanges (loads, first use of a call signature)

# How long a zero-copy agreement check waits for the other ranks (they are all in the same
# call, so anything longer means a peer passed buffers outside the heap and took another path).
_CHECK_TIMEOUT_S = 60


def _reporting(exchange, rank: int, bound: float, holder: list):
    """``exchange`` that turns a failure (a timeout, a store gone) into PurlinTimeoutError and
    stops the communicator in ``holder``: its peers' state is unknown from then on."""
    from purlinc.runtime.rendezvous import RendezvousError

    def call(obj):
        comm = holder[0] if holder else None
        if comm is not None and comm.failed is not None:
            comm.refuse("exchange")
        try:
            return exchange(obj)
        except MismatchError as error:  # a peer of another world: named as it is, and the ranks are out of step
            if comm is not None:
                comm.fail(PurlinTimeoutError(f"rank {rank}: the host-side exchange failed: {error.message}"))
            raise
        except (RendezvousError, RuntimeError) as error:
            text = getattr(error, "message", None) or str(error)  # a PurlinError's own text, not its rendering
            failure = PurlinTimeoutError(
                f"rank {rank}: the host-side exchange with the other ranks failed (bound {bound:g} s): "
                f"{text.splitlines()[0] if text else type(error).__name__}",
                notes=("a peer exited, or has not made the same call (load or first use of a new "
                       "dtype, op or count)",),
            )
            log.error("%s", failure.message)
            if comm is not None:
                comm.fail(failure)
            raise failure from None
    return call


def check_exchange(comm, obj, joined_not: Callable[[Exception], MismatchError]) -> list:
    """Every rank's ``obj`` through ``comm``'s check exchange (a short timeout: under torchrun a
    peer that does not come made a mistake, it is not slow to start; a communicator without
    one uses its allgather).  The exchange failing (a peer never joined) raises the MismatchError
    ``joined_not(error)`` makes and stops the communicator: this rank's check rounds are now
    ahead of the peers', whose next check would read this one's stale record, and they wait
    on the device for a call this rank will not launch.  Purlin's other errors pass through."""
    from purlinc.runtime.rendezvous import RendezvousError

    if getattr(comm, "failed", None) is not None:
        comm.refuse("check exchange")
    exchange = getattr(comm, "_check_exchange", None) or comm.allgather
    try:
        return same_exchange(comm, exchange(obj))
    except MismatchError:
        raise
    except (PurlinTimeoutError, RendezvousError, RuntimeError) as error:  # the store's wait ran out, or the store is gone
        mismatch, cause = joined_not(error), error
    except PurlinError:
        raise
    except Exception as error:  # noqa: BLE001 -- a gloo timeout: a peer never came
        mismatch, cause = joined_not(error), error
    if hasattr(comm, "fail") and getattr(comm, "failed", None) is None:
        comm.fail(PurlinTimeoutError(f"rank {comm.rank}: {mismatch.message}"))
    raise mismatch from cause


def exchange_kind(record) -> str | None:
    """The kind a runtime record names (its first field), or None for another object."""
    return record[0] if isinstance(record, tuple) and record and isinstance(record[0], str) else None


def different_exchanges(rank: int, everyone: list) -> MismatchError | None:
    """A MismatchError when the gathered records name different kinds of exchange: the ranks
    made different communicator calls at the same point (rank 0 a heap allocation, rank 1 the
    first call of a new shape), and each would read the others' records as its own (a
    barrier passed by a rank doing something else, or an IndexError on a record's fields)."""
    kinds = [exchange_kind(e) for e in everyone]
    if len(set(kinds)) <= 1:
        return None
    shown = ", ".join(f"rank {r}: {k or 'another object'}" for r, k in enumerate(kinds))
    return MismatchError(f"rank {rank}: the ranks made different host-side exchanges at the same point ({shown})",
                         notes=("every rank must make the same communicator calls in the same order (loads, heap "
                                "allocations, first calls of each dtype, op and count)",))


def same_exchange(comm, everyone: list) -> list:
    """``everyone`` when the ranks made the same kind of exchange; else ``comm`` stops (the
    ranks' rounds are out of step from here on) and the MismatchError is raised."""
    problem = different_exchanges(comm.rank, everyone)
    if problem is None:
        return everyone
    if hasattr(comm, "fail") and getattr(comm, "failed", None) is None:
        comm.fail(PurlinTimeoutError(problem.message))
    raise problem


class Communicator:
    """One rank's view: ``rank``, ``world_size``, ``device`` and the symmetric heap."""

    def __init__(self, rank: int, world_size: int, device: int, heap: SymmetricHeap,
                 exchange: Callable[[object], list] | None, *, local_group: "LocalGroup | None" = None,
                 opened: Sequence[int] = (), owned: int = 0):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.heap = heap
        self._exchange = exchange
        self.local_group = local_group
        self._opened = list(opened)  # peer bases opened through IPC (closed on close())
        self._owned = [owned] if isinstance(owned, int) and owned else list(owned or ())  # our segments
        self._check_exchange = None  # from_torch: an exchange with a short timeout (zero-copy checks)
        self._collectives: list = []  # weak bookkeeping for check()
        # Every rank's device ordinal (open_heap sets it under torchrun): ranks of one GPU wait
        # for each other's blocks, so their kernels must fit on it together (residency.py).
        self.peer_devices: tuple[int, ...] = ()
        self._lock = threading.Lock()
        self.closed = False
        self.failed: PurlinTimeoutError | None = None  # the timeout that stopped this communicator

    def fail(self, error: PurlinTimeoutError) -> None:
        """Stop this communicator (and its LocalGroup's other members) after ``error``."""
        members = self.local_group.comms if self.local_group is not None else [self]
        for comm in members:
            if comm.failed is None:
                comm.failed = error
            for collective in list(comm._collectives):
                collective._fast = None  # the fast path must take the checking path from now on

    def refuse(self, what: str) -> None:
        """Raise the error that says this communicator stopped (called for every later use)."""
        first = self.failed.message.splitlines()[0] if self.failed is not None else "a timeout"
        raise PurlinTimeoutError(
            f"{what}: rank {self.rank}'s communicator stopped after an earlier timeout ({first})",
            notes=("the ranks' signals are out of step (or a peer is gone): create a new "
                   "Communicator or LocalGroup and load the collectives again",),
            record=getattr(self.failed, "record", None),
        )

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, world_size={self.world_size}, device=cuda:{self.device})"

    # -----------------------------------------------------------------------------------------
    @classmethod
    def from_torch(cls, group=None, *, heap_bytes: int | None = None) -> "Communicator":
        """The communicator of this process's rank in ``group`` (default: the whole world).

        Call after ``torch.distributed.init_process_group`` and ``torch.cuda.set_device``;
        every rank of the group, and only those, must call it (it is a collective of the group).
        The host exchanges run over the group's own store (:mod:`purlinc.runtime.torchstore`): no
        CUDA stream is involved (safe during graph capture), and no group is created, so a
        sub-group's members alone can make theirs.
        """
        try:
            import torch
            import torch.distributed as dist
        except ModuleNotFoundError as error:
            if error.name != "torch":
                raise
            raise PurlinError("Communicator.from_torch needs PyTorch: pip install 'purlinc[torch]' (or torch "
                              "itself); Communicator.from_env() needs none") from None

        from purlinc.runtime.rendezvous import Exchange
        from purlinc.runtime.torchstore import store_for

        if not dist.is_initialized():
            raise RuntimeError("Communicator.from_torch: call torch.distributed.init_process_group first")
        _init_cuda(torch)  # before the group's store is touched
        pg = group if group is not None else dist.group.WORLD
        rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        # Bounded: a peer that died (or never arrives) is reported, not waited for.  Generous,
        # since a peer may be compiling a kernel (NVRTC) while this rank waits.
        bound = max(settings.wait_timeout_ns() / 1e9, EXCHANGE_TIMEOUT_S)
        holder: list = []
        exchange = _reporting(Exchange(store_for(pg, timeout=bound), rank, world), rank, bound, holder)
        comm = bootstrap.open_heap(cls, rank, world, torch.cuda.current_device(), exchange, heap_bytes)
        holder.append(comm)
        # zero-copy agreement checks: the ranks are all in the same call, so a short bound
        comm._check_exchange = Exchange(store_for(pg, timeout=_CHECK_TIMEOUT_S), rank, world)
        return comm

    # ----------------------------------------------------------------------------- allocation
    def empty(self, shape, dtype):
        """A torch tensor in this communicator's symmetric heap, at the same offset on every rank
        (a collective: every rank calls it, in the same order, with the same shape and dtype).

        Collectives called on heap tensors use the zero-copy (registered) schedules: peers read
        and write them directly, with no staging copy.  The block is freed when the tensor (and
        every view of it) is gone.
        """
        from purlinc.runtime import symmetric

        return symmetric.empty(self, shape, dtype)

    def alloc(self, nbytes: int):
        """A raw :class:`~purlinc.runtime.symmetric.HeapBlock` (``ptr``, ``nbytes``, ``free()``,
        ``__cuda_array_interface__`` for CuPy/Numba, ``peer_ptr(rank)``); a collective like ``empty``."""
        from purlinc.runtime import symmetric

        return symmetric.alloc(self, nbytes)

    def mem_pool(self, nbytes: int):
        """A ``torch.cuda.MemPool`` whose allocations land in a ``nbytes`` region of the heap, for
        ordinary torch code: ``with torch.cuda.use_mem_pool(comm.mem_pool(n)): x = torch.empty(...)``
        (a collective; allocate in the same order on every rank so offsets match)."""
        from purlinc.runtime import symmetric

        return symmetric.mem_pool(self, nbytes)

    @classmethod
    def from_store(cls, store, rank: int, world_size: int, *, device: int | None = None,
                   heap_bytes: int | None = None, timeout: float | None = None) -> "Communicator":
        """A communicator bootstrapped through a ``rendezvous.TCPStore`` / ``FileStore``: no torch.

        ``device`` defaults to ``rank``; every rank of the world calls it (it is a collective).
        """
        from purlinc.runtime.rendezvous import Exchange

        plain = Exchange(store, rank, world_size, timeout=timeout)
        # As from_torch: a failed exchange is a PurlinTimeoutError and stops the communicator
        # (a rank that went on to its next round would be out of step with its peers).
        holder: list = []
        exchange = _reporting(plain, rank, plain.timeout, holder)
        comm = bootstrap.open_heap(cls, rank, world_size, rank if device is None else device, exchange, heap_bytes)
        holder.append(comm)
        return comm

    @classmethod
    def from_env(cls, *, device: int | None = None, heap_bytes: int | None = None,
                 timeout: float | None = None) -> "Communicator":
        """RANK, WORLD_SIZE, LOCAL_RANK (the device by default), MASTER_ADDR, MASTER_PORT: rank 0
        serves a TCP store there (standard library only, no torch needed)."""
        from purlinc.runtime import rendezvous

        info = rendezvous.env_info()
        # The arguments before the store: a rank other than 0 connects first, and waited for
        # rank 0 (up to 300 s) before its device="0" was refused; timeout=0 read as 300 s there.
        bound = rendezvous.DEFAULT_TIMEOUT_S if timeout is None else rendezvous.checked_timeout(timeout)
        bootstrap.checked_device(info.local_rank if device is None else device)
        bootstrap.heap_size(heap_bytes)
        store = rendezvous.store_from_env(info, timeout=bound)
        try:
            return cls.from_store(store, info.rank, info.world_size, heap_bytes=heap_bytes, timeout=timeout,
                                  device=info.local_rank if device is None else device)
        except BaseException:  # the store is this call's own: rank 0's server must not outlive it
            store.close(wait=False)
            raise

    # -----------------------------------------------------------------------------------------
    def allgather(self, obj) -> list:
        """Every rank's ``obj``, in rank order (a collective over the host).  The runtime's
        records are tuples that begin with the exchange's kind ("load", "call", "heap-block",
        ...): ranks whose records name different kinds made different calls at the same point,
        and are refused (MismatchError; the communicator stops).  ``obj`` is plain data
        (``rendezvous.PLAIN_DATA``); anything else is refused before it is sent (ArgumentError;
        the communicator goes on)."""
        if self._exchange is None:
            raise RuntimeError("a LocalGroup member exchanges through its group (use the group's calls)")
        if self.failed is not None:  # its peers' rounds are not this one's any more
            self.refuse("exchange")
        return same_exchange(self, self._exchange(obj))

    def register(self, collective) -> None:
        with self._lock:
            self._collectives.append(collective)

    def unregister(self, collective) -> None:
        with self._lock:
            if collective in self._collectives:
                self._collectives.remove(collective)

    def check(self) -> None:
        """Raise PurlinTimeoutError if any collective of this rank recorded a device-side timeout."""
        for collective in list(self._collectives):
            collective.check()

    def close(self) -> None:
        from purlinc.runtime import driver

        if self.closed:
            return
        for collective in list(self._collectives):
            collective.close()
        try:
            driver.synchronize(self.device)
            for base in self._opened:
                driver.ipc_close(base)
            for base in self._owned:
                driver.mem_free(base)
        finally:
            self.closed = True


def _init_cuda(torch) -> None:
    """torch's CUDA state, or an ArgumentError saying why there is none, before any exchange
    (every rank refuses alike): torch.cuda.init() raised "Torch not compiled with CUDA enabled"
    (an AssertionError) on a CPU build and "No CUDA GPUs are available" where none is visible."""
    try:
        torch.cuda.init()
    except (AssertionError, RuntimeError) as error:
        raise ArgumentError(f"Communicator.from_torch: a Purlin communicator needs a CUDA device, and torch has "
                            f"none: {error}", notes=("Communicator.from_torch runs on CUDA builds of torch, on "
                                                     "machines with a visible GPU",)) from None


class LocalGroup:
    """One process, several GPUs with peer access: ``group[r]`` is rank r's Communicator.

    ``share_devices=True`` admits a device named more than once: a *loopback* group, whose
    ranks share a GPU (``LocalGroup([0, 0], share_devices=True)``), for running and checking
    multi-rank schedules on a machine with one GPU.  Its "remote" stores stay in that GPU's
    memory, so it says nothing about link speed.  The ranks' kernels wait for each other, so
    they must run at the same time: every group call needs one stream per rank (``streams=``,
    checked), and the ranks' grids must fit on the GPU together (checked before any launch:
    ``ResidencyError``; a plain ``load()`` caps its channels to fit, ``runtime/residency.py``).
    """

    def __init__(self, devices: Sequence[int] | None = None, *, heap_bytes: int | None = None,
                 share_devices: bool = False):
        from purlinc.runtime import driver

        if devices is None:
            devices = range(driver.device_count())
        devices = [bootstrap.checked_device(d, f"LocalGroup device {i}") for i, d in enumerate(devices)]
        size = bootstrap.heap_size(heap_bytes)
        if not devices:
            raise ArgumentError("LocalGroup needs at least one device, got none")
        if len(set(devices)) != len(devices) and not share_devices:
            raise ArgumentError(f"LocalGroup needs distinct devices, got {devices} "
                                "(share_devices=True runs several ranks on one GPU: a loopback group for tests)")
        count = driver.device_count()
        for d in devices:
            if not 0 <= d < count:
                raise ArgumentError(f"LocalGroup: cuda:{d} does not exist (this process sees {count} device(s))")
        for d in devices:
            for p in devices:
                if d != p:
                    if not driver.can_access_peer(d, p):
                        raise MismatchError(f"cuda:{d} cannot access cuda:{p} as a peer (no NVLink/P2P path)")
                    driver.enable_peer_access(d, p)
        self.devices = devices
        self._segments: dict[int, list[int]] = {}  # index -> base on every device
        self._sizes: dict[int, int] = {}
        self.comms = [Communicator(r, len(devices), d, None, None, local_group=self) for r, d in enumerate(devices)]
        bases = self._grow(0, size)
        for r, comm in enumerate(self.comms):
            # One process: every rank's heap grows through the group, which allocates the new
            # segment on every device once (the first rank to need it) and hands out the same bases.
            comm.heap = SymmetricHeap(r, size, bases, grow=self._grow, segment_bytes=size,
                                      limit_bytes=settings.heap_max_bytes())
        log.info("LocalGroup: %d ranks on devices %s, heap %d bytes each", len(devices), devices, size)

    def _grow(self, index: int, size: int) -> list[int]:
        from purlinc.runtime import driver

        hit = self._segments.get(index)
        if hit is not None:
            if self._sizes[index] != size:
                raise MismatchError(f"the LocalGroup's heaps are out of step: segment {index} of {size} bytes "
                                    f"asked for, {self._sizes[index]} bytes exist")
            return hit
        if index != len(self._segments):
            raise MismatchError(f"the LocalGroup's heaps are out of step: segment {index} asked for, "
                                f"{len(self._segments)} exist")
        bases = []
        try:
            for d in self.devices:
                driver.set_current(d)
                base = driver.mem_alloc(size)
                bases.append(base)
                driver.memset_d8(base, 0, size)
            for d in self.devices:
                driver.synchronize(d)
        except Exception:
            for d, base in zip(self.devices, bases):
                driver.set_current(d)
                driver.mem_free(base)
            raise
        for comm, base in zip(self.comms, bases):
            comm._owned.append(base)
        self._segments[index] = bases
        self._sizes[index] = size
        return bases

    def empty(self, shape, dtype) -> list:
        """One torch tensor per rank, in the symmetric heap (see ``Communicator.empty``)."""
        from purlinc.runtime import symmetric

        return symmetric.group_empty(self, shape, dtype)

    def __len__(self) -> int:
        return len(self.comms)

    def __getitem__(self, rank: int) -> Communicator:
        return self.comms[rank]

    def __iter__(self):
        return iter(self.comms)

    @property
    def world_size(self) -> int:
        return len(self.comms)

    def check(self) -> None:
        errors: list[PurlinTimeoutError] = []
        for comm in self.comms:
            try:
                comm.check()
            except PurlinTimeoutError as error:
                errors.append(error)
        if errors:
            raise errors[0]

    def synchronize(self) -> None:
        from purlinc.runtime import driver

        for d in self.devices:
            driver.synchronize(d)

    def close(self) -> None:
        for comm in self.comms:
            comm.close()
