"""Handles: the int a custom op carries in place of a collective (which is not a tensor).

An :class:`Entry` knows, without loading anything, what a fake implementation needs: this
rank's input and output chunks (``in_units``, ``out_units``), whether the collective reduces,
the world size and the device.  The loaded collective itself comes lazily, on the first real
call (a load is a collective over the ranks, and every rank makes that first call).

Handles are ints fixed for the life of the process, so torch.compile bakes them into a graph
as constants.  A compiled graph is also cached *across* processes (inductor's FX graph cache,
keyed by the graph, handles included), with the output shapes its fakes gave: so a handle is a
function of everything a fake reads through it (:func:`new_handle`), never a counter that
names a world of two in one process and a world of one in the next.
"""

from __future__ import annotations

import hashlib
import threading

from purlinc.runtime.errors import ArgumentError

_LOCK = threading.Lock()
ENTRIES: dict[int, "Entry"] = {}
_ISSUED: set[int] = set()  # every handle this process gave out (entries and other op families)
_MADE: dict[tuple, int] = {}  # handles made per description


def handle_of(what: tuple, occurrence: int) -> int:
    """The handle of the ``occurrence``-th state described by ``what`` (a tuple of plain values)
    in a process: a 62-bit hash, the same in every process."""
    digest = hashlib.sha256(repr((what, occurrence)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 2


def new_handle(what: tuple) -> int:
    """A new handle for a state whose fake implementations read ``what`` through it."""
    with _LOCK:
        while True:
            occurrence = _MADE[what] = _MADE.get(what, 0) + 1
            handle = handle_of(what, occurrence)
            if handle not in _ISSUED:
                _ISSUED.add(handle)
                return handle


class Entry:
    """One collective on one rank, as the ops see it."""

    __slots__ = ("handle", "name", "rank", "world_size", "device", "in_units", "out_units", "is_reduce",
                 "comm", "warmed", "inverse", "row", "_collective", "_loader", "__weakref__")

    def __init__(self, name: str, spec, comm, device, *, collective=None, loader=None):
        self.name = name
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.device = device  # a torch.device
        self.in_units = len(spec.inputs[self.rank])
        self.out_units = len(spec.outputs[self.rank])
        self.is_reduce = spec.is_reduce
        self.comm = comm
        self.warmed: set = set()  # ids of host-driven (ce) variants run outside a capture
        self.inverse: int | None = None  # the handle whose call is this one's derivative (autograd)
        self.row = spec.epilogue.row if getattr(spec, "epilogue", None) is not None else 0  # an epilogue's row
        self._collective = collective
        self._loader = loader
        self.handle = new_handle(("entry", name, self.world_size, self.rank, self.in_units, self.out_units,
                                  self.is_reduce, self.row, str(device)))
        with _LOCK:
            ENTRIES[self.handle] = self

    def __repr__(self) -> str:
        return (f"Entry(#{self.handle} {self.name}, rank {self.rank}/{self.world_size}, in {self.in_units}, "
                f"out {self.out_units}, {self.device})")

    @property
    def loaded(self) -> bool:
        return self._collective is not None

    def collective(self, capturing: bool = False):
        """The loaded collective; loads it now (a collective over the ranks) on first use."""
        if self._collective is None:
            if capturing:
                raise ArgumentError(
                    f"purlin::{self.name} on rank {self.rank}: called inside a CUDA graph capture before its "
                    f"warm-up call: expected one call outside the capture first, got none",
                    notes=("the first call loads the collective (every rank takes part), which a graph cannot "
                           "capture; torch.compile(mode='reduce-overhead') makes that call by itself",),
                )
            self._collective = self._loader()
        return self._collective

    def close(self) -> None:
        with _LOCK:
            ENTRIES.pop(self.handle, None)
        if self._collective is not None and self._loader is not None:  # we loaded it: we close it
            self._collective.close()
        self._collective = None


def entry(handle: int) -> Entry:
    found = ENTRIES.get(handle)
    if found is None:
        raise ArgumentError(f"no Purlin collective has handle {handle}: expected one made by purlinc.torch "
                            f"(op() or a Group) and not closed")
    return found
