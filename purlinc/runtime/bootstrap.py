"""A communicator from any host-side all-gather: the heap exported through CUDA IPC, every
peer's heap opened.  ``Communicator.from_store`` / ``from_env`` come here with an
:class:`~purlinc.runtime.rendezvous.Exchange`, so no torch is involved at all (CuPy or plain
driver processes); ``from_torch`` does the same through the process group's own store.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable

from purlinc import settings
from purlinc.log import log
from purlinc.runtime.errors import MismatchError


def open_heap(cls, rank: int, world: int, device: int, exchange: Callable[[object], list],
              heap_bytes: int | None = None):
    """Check the ranks can share memory, then allocate, export and open heap segment 0
    (``communicator._ipc_segment``; later segments grow through the same exchange) and return
    ``cls(...)`` (a Communicator).  A collective: every rank calls it."""
    from purlinc.runtime import driver
    from purlinc.runtime.communicator import _ipc_segment
    from purlinc.runtime.heap import SymmetricHeap

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
    size = heap_bytes or settings.heap_bytes()
    opened: list[int] = []
    owned: list[int] = []

    def grow(index: int, nbytes: int) -> list[int]:
        return _ipc_segment(exchange, rank, device, index, nbytes, opened, owned)

    bases = grow(0, size)
    comm = cls(rank, world, device, None, exchange, opened=opened, owned=owned)
    comm.heap = SymmetricHeap(rank, size, bases, grow=grow, segment_bytes=size, limit_bytes=settings.heap_max_bytes())
    comm._opened, comm._owned = opened, owned  # the same lists grow() appends to
    comm.peer_devices = tuple(i["device"] for i in info)
    if log.isEnabledFor(logging.INFO):
        log.info("communicator: rank %d of %d on cuda:%d (pid %d), peers on %s, heap %d bytes", rank, world, device,
                 os.getpid(), ", ".join(f"cuda:{i['device']}" for i in info), size)
    return comm
