"""The one heap bootstrap: a communicator from any host-side all-gather, the heap exported
through CUDA IPC, every peer's heap opened.  ``Communicator.from_store`` / ``from_env`` come
here with an :class:`~purlinc.runtime.rendezvous.Exchange`, so no torch is involved at all
(CuPy or plain driver processes); ``from_torch`` does the same through the process group's own
store, and a hierarchical load through a node's exchange.  Nothing here imports the
communicator: the class to build is passed in.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable

from purlinc import settings
from purlinc.log import log
from purlinc.runtime.errors import ArgumentError, MismatchError
from purlinc.runtime.heap import SymmetricHeap

_LEAST_HEAP_BYTES = 1 << 20  # PURLIN_HEAP_MB's least value, for the keyword too


def checked_device(device, what: str = "device") -> int:
    """A device ordinal as given by the caller: an int, not a bool or a string (``"0"`` failed
    deep in a comparison, ``True`` was read as cuda:1, ``1.5`` reached the driver)."""
    if isinstance(device, bool) or not isinstance(device, int):
        raise ArgumentError(f"{what}: expected a CUDA device ordinal (an int), got {device!r}")
    return device


def heap_size(heap_bytes) -> int:
    """The first heap segment's bytes: ``heap_bytes`` checked, or PURLIN_HEAP_MB's when None."""
    if heap_bytes is None:
        return settings.heap_bytes()
    if isinstance(heap_bytes, bool) or not isinstance(heap_bytes, int) or heap_bytes < _LEAST_HEAP_BYTES:
        raise ArgumentError(f"heap_bytes: expected an int of at least {_LEAST_HEAP_BYTES} (1 MiB), got {heap_bytes!r}",
                            notes=("None takes PURLIN_HEAP_MB (256 MiB unless set); the heap grows past it on demand",))
    return heap_bytes


def open_heap(cls, rank: int, world: int, device: int, exchange: Callable[[object], list],
              heap_bytes: int | None = None):
    """Check the ranks can share memory, then allocate, export and open heap segment 0
    (``ipc_segment``; later segments grow through the same exchange) and return ``cls(...)``
    (a Communicator).  A collective: every rank calls it."""
    from purlinc.runtime import driver

    device = checked_device(device)
    size = heap_size(heap_bytes)
    count = driver.device_count()
    if not 0 <= device < count:
        raise MismatchError(f"rank {rank}: cuda:{device} does not exist (this process sees {count} device(s))",
                            notes=("the device defaults to LOCAL_RANK; check CUDA_VISIBLE_DEVICES or pass device=",))
    driver.set_current(device)
    info = exchange({"host": socket.gethostname(), "pid": os.getpid(), "device": device})
    hosts = {i["host"] for i in info}
    if len(hosts) != 1:
        raise MismatchError(f"Purlin needs every rank on one host (one NVLink domain); got hosts {sorted(hosts)}")
    for peer, i in enumerate(info):
        if peer != rank and i["pid"] == os.getpid():
            raise MismatchError(f"ranks {rank} and {peer} are one process: use LocalGroup for one process and several GPUs")
        if peer != rank and i["device"] != device and not driver.can_access_peer(device, i["device"]):
            raise MismatchError(f"cuda:{device} (rank {rank}) cannot access cuda:{i['device']} (rank {peer}) as a peer")
    opened: list[int] = []
    owned: list[int] = []

    def grow(index: int, nbytes: int) -> list[int]:
        return ipc_segment(exchange, rank, device, index, nbytes, opened, owned)

    bases = grow(0, size)
    comm = cls(rank, world, device, None, exchange, opened=opened, owned=owned)
    comm.heap = SymmetricHeap(rank, size, bases, grow=grow, segment_bytes=size, limit_bytes=settings.heap_max_bytes())
    comm._opened, comm._owned = opened, owned  # the same lists grow() appends to
    comm.peer_devices = tuple(i["device"] for i in info)
    if log.isEnabledFor(logging.INFO):
        log.info("communicator: rank %d of %d on cuda:%d (pid %d), peers on %s, heap %d bytes", rank, world, device,
                 os.getpid(), ", ".join(f"cuda:{i['device']}" for i in info), size)
    return comm


def ipc_segment(exchange, rank: int, device: int, index: int, size: int, opened: list, owned: list) -> list[int]:
    """Allocate heap segment ``index`` (``size`` bytes, zeroed) here, export it through CUDA IPC,
    open every peer's, and return the segment's base on every rank (a collective)."""
    from purlinc.runtime import driver

    driver.set_current(device)
    base = driver.mem_alloc(size)
    try:
        driver.memset_d8(base, 0, size)
        driver.synchronize(device)
        handle, offset = driver.ipc_handle(base)
    except Exception:
        driver.mem_free(base)
        raise
    owned.append(base)
    info = exchange({"segment": index, "size": size, "handle": handle, "offset": offset})
    shapes = {(i["segment"], i["size"]) for i in info}
    if len(shapes) != 1:
        raise MismatchError(
            f"ranks disagree on heap segment {index}: " + ", ".join(
                f"rank {r}: segment {i['segment']} of {i['size']} bytes" for r, i in enumerate(info)),
            notes=(f"set {settings.HEAP_MB.name} alike, and allocate (load, comm.empty) in the same order "
                   "on every rank",),
        )
    bases = []
    for peer, i in enumerate(info):
        if peer == rank:
            bases.append(base)
        else:
            ptr = driver.ipc_open(i["handle"], i["offset"])
            opened.append(ptr - i["offset"])
            bases.append(ptr)
    exchange(("heap-open", index))  # every rank has mapped every segment before anyone writes into one
    return bases
