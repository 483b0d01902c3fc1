"""A communicator from any host-side all-gather: the heap exported through CUDA IPC, every
peer's heap opened.  ``Communicator.from_store`` / ``from_env`` come here with an
:class:`~purlinc.runtime.rendezvous.Exchange`, so no torch is involved at all (CuPy or plain
driver processes); ``from_torch`` does the same through a gloo group.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

from purlinc import settings
from purlinc.runtime.errors import MismatchError


def open_heap(cls, rank: int, world: int, device: int, exchange: Callable[[object], list],
              heap_bytes: int | None = None):
    """Allocate this rank's heap on ``device``, exchange IPC handles, open every peer's heap
    and return ``cls(...)`` (a Communicator).  A collective: every rank calls it."""
    from purlinc.runtime import driver
    from purlinc.runtime.heap import SymmetricHeap

    count = driver.device_count()
    if not 0 <= device < count:
        raise MismatchError(f"rank {rank}: cuda:{device} does not exist (this process sees {count} device(s))",
                            notes=("the device defaults to LOCAL_RANK; check CUDA_VISIBLE_DEVICES or pass device=",))
    driver.set_current(device)
    size = heap_bytes or settings.heap_bytes()
    base = driver.mem_alloc(size)
    driver.memset_d8(base, 0, size)
    driver.synchronize(device)
    handle, offset = driver.ipc_handle(base)
    info = exchange({"host": socket.gethostname(), "pid": os.getpid(), "device": device,
                     "size": size, "handle": bytes(handle), "offset": offset})
    hosts = {i["host"] for i in info}
    if len(hosts) != 1:
        raise MismatchError(f"Purlin needs every rank on one host (one NVLink domain); got hosts {sorted(hosts)}")
    sizes = {i["size"] for i in info}
    if len(sizes) != 1:
        raise MismatchError(f"ranks disagree on the heap size ({sorted(sizes)} bytes): set {settings.HEAP_MB.name} alike")
    for peer, i in enumerate(info):
        if peer != rank and i["pid"] == os.getpid():
            raise MismatchError(f"ranks {rank} and {peer} are one process: use LocalGroup for one process and several GPUs")
        if peer != rank and i["device"] != device and not driver.can_access_peer(device, i["device"]):
            raise MismatchError(f"cuda:{device} (rank {rank}) cannot access cuda:{i['device']} (rank {peer}) as a peer")
    bases, opened = [], []
    for peer, i in enumerate(info):
        if peer == rank:
            bases.append(base)
        else:
            ptr = driver.ipc_open(i["handle"], i["offset"])
            opened.append(ptr - i["offset"])
            bases.append(ptr)
    exchange("heap-open")  # every rank has mapped every heap before anyone writes into one
    return cls(rank, world, device, SymmetricHeap(rank, size, bases), exchange, opened=opened, owned=base)
