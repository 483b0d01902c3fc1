"""A torch process group's own store as a Purlin rendezvous store (the runtime side of
:mod:`purlinc.torch.groups`; ``Communicator.from_torch`` bootstraps through it).

torch makes one ``PrefixStore`` per process group, which only that group's members use.  A
communicator's host exchanges (:class:`purlinc.runtime.rendezvous.Exchange`) run inside it under
``purlin/<n>/``, ``n`` counting the communicators this process made on that group (the same on
every member: they make them in the same order), so no group ever reads another's keys and
nothing but the group's members takes part: no ``new_group`` call on a subset of the world.
torch is imported by the functions here, never by ``import purlinc.runtime``.
"""

from __future__ import annotations

import datetime
import itertools
import threading

from purlinc.runtime.errors import ArgumentError
from purlinc.runtime.rendezvous import DEFAULT_TIMEOUT_S, RendezvousTimeout

_LOCK = threading.Lock()
_COUNTERS: dict[str, itertools.count] = {}


class TorchStore:
    """A ``torch.distributed.Store`` seen through the interface of
    :class:`purlinc.runtime.rendezvous.Exchange` (``set``, ``get`` with a bound, ``add``, ``delete``)."""

    def __init__(self, store, prefix: str, *, timeout: float = DEFAULT_TIMEOUT_S):
        import torch.distributed as dist

        self._store = dist.PrefixStore(prefix, store)
        self.prefix = prefix
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"TorchStore({self.prefix!r})"

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        bound = self.timeout if timeout is None else timeout
        try:
            self._store.wait([key], datetime.timedelta(seconds=bound))
        except RuntimeError as error:  # DistStoreError (a RuntimeError): the wait ran out, or the store is gone
            raise RendezvousTimeout(f"{self!r}: key {key!r} did not appear within {bound:g} s "
                                    f"({str(error).splitlines()[0] if str(error) else type(error).__name__})") from None
        return self._store.get(key)

    def add(self, key: str, delta: int) -> int:
        return self._store.add(key, delta)

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            self._store.delete_key(key)


def group_store(pg):
    """The store torch made for ``pg`` alone (its ``PrefixStore``)."""
    from torch.distributed.distributed_c10d import _world

    hit = _world.pg_map.get(pg)
    if hit is None:
        raise ArgumentError(f"{pg!r} is not a process group of this process (torch.distributed knows no store "
                            f"for it); expected dist.group.WORLD, a group from new_group or a DeviceMesh dimension")
    return hit[1]


def _key(pg) -> str:
    try:
        return pg.group_name
    except RuntimeError:  # a Python process group without a name: its object is its identity
        return f"pg@{id(pg):x}"


def store_for(pg, *, timeout: float = DEFAULT_TIMEOUT_S) -> TorchStore:
    """A fresh key space for one communicator on ``pg``: ``purlin/<n>/`` inside the group's store."""
    key = _key(pg)
    with _LOCK:
        n = next(_COUNTERS.setdefault(key, itertools.count()))
    return TorchStore(group_store(pg), f"purlin/{n}/", timeout=timeout)
