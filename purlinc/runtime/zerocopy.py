"""Zero-copy calls: when the caller's buffers live in the symmetric heap, run the registered
schedule (peers read and write those buffers directly) instead of staging through the heap.

At load every (staged) collective gets a *twin*: the same spec and options lowered with
``registered={"in", "out"}`` (or the part of it the algorithm uses), loaded as its own
Collective with its own signal pad and counters.  Where that registers nothing (a direct-push
reduction must gather every input at the consumer; an LL-packed push has no staging buffer to
pack into once it writes the output itself), the twin drops packing, then falls back to
direct-pull reading registered inputs with the same channels.  No twin for the ``ce`` atom.

The rule, per call: **zero-copy when every buffer this rank passes (``x`` where it gives
input, ``out`` where it receives output) lies in a live heap block**; otherwise the staged
schedule runs, as before.  Heap blocks come from a collective, deterministic allocator, so
an SPMD program passing corresponding heap tensors makes the same choice on every rank.  The
ranks check that they agree:

- under torchrun, at the first zero-copy use of each (input offset, output offset, count,
  dtype, op), a host exchange compares every rank's offsets (MismatchError if they differ;
  a peer that took the staged path never joins, and the exchange times out into a
  MismatchError).  The staged and zero-copy schedules use separate signal pads, so a rank
  whose peers took the other path waits on signals nobody raises: its kernel times out
  (PurlinTimeoutError), it never writes into the wrong buffer.
- in a LocalGroup (one process), every call's choice is compared across the ranks of the
  group call, rank by rank, before the last rank launches.

Buffers outside the heap stage (two copies) as before: registering arbitrary buffers at graph
capture would need an IPC export and a host exchange per new buffer, which is left for later
measurement.  A pointer into freed heap space is a FreedBufferError; a buffer in another
communicator's heap an ArgumentError.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import replace

from purlinc.errors import PurlinError
from purlinc.runtime import symmetric
from purlinc.runtime.errors import ArgumentError, MismatchError

_BOTH = frozenset({"in", "out"})
_TRIES = (_BOTH, frozenset({"out"}), frozenset({"in"}))
_MISSING = object()


def peer_spaces(schedule) -> frozenset[str]:
    """Which of the caller's buffers ("in", "out") a schedule reaches on other ranks."""
    found = set()
    for program in getattr(schedule, "programs", ()):
        for step in program.steps:
            regions = []
            for name in ("src", "dst"):
                region = getattr(step, name, None)
                if region is not None:
                    regions.append(region)
            regions += list(getattr(step, "srcs", ()) or ())
            for region in regions:
                space = getattr(getattr(region, "space", None), "value", None)
                if space in ("in", "out") and region.rank != program.rank:
                    found.add(space)
    return frozenset(found)


def _candidates(options):
    """Registered forms to try, best first: the same schedule with registered buffers; the same
    without LL packing (a registered output takes the pushes itself, so there is no staging
    buffer to pack into); direct-pull reading registered inputs (direct-push reductions always
    stage: a reduction needs every input at the consumer)."""
    from purlinc.snac.ir import Algorithm

    for registered in _TRIES:
        yield replace(options, registered=registered)
    if getattr(options, "packed", False):
        for registered in _TRIES:
            yield replace(options, packed=False, registered=registered)
    if options.algorithm is not Algorithm.DIRECT_PULL:
        unpacked = replace(options, packed=False) if hasattr(options, "packed") else options
        yield replace(unpacked, algorithm=Algorithm.DIRECT_PULL, registered=frozenset({"in"}))


def twin_compiled(compiled):
    """``compiled`` lowered for registered buffers, or None when no registered form reaches a
    peer's buffer (nothing to gain) or the atom cannot run one (``ce``)."""
    from purlinc import pipeline

    if compiled.atom == "ce" or compiled.options.registered:
        return None
    for options in _candidates(compiled.options):
        try:
            schedule = pipeline.snac_stage(compiled.spec, options)
        except PurlinError:
            continue
        spaces = peer_spaces(schedule)
        if not spaces:
            continue
        if options.registered != spaces:  # register exactly what the schedule reaches
            options = replace(options, registered=frozenset(spaces))
            schedule = pipeline.snac_stage(compiled.spec, options)
        return replace(compiled, options=options, schedule=schedule, kernels={}, lock=threading.Lock())
    return None


def attach(loaded, compiled, comm, comms):
    """Give ``loaded`` (a Collective or GroupCollective) its zero-copy twin, if there is one."""
    from purlinc.runtime.collective import GroupCollective, _load_compiled

    twin_c = twin_compiled(compiled)
    if twin_c is None:
        return loaded
    twin = _load_compiled(twin_c, comm, comms)
    if isinstance(loaded, GroupCollective):
        agreement = LocalAgreement(len(loaded.ranks))
        for staged, registered in zip(loaded.ranks, twin.ranks):
            staged._zc = ZeroCopy(staged, registered, agreement)
    else:
        loaded._zc = ZeroCopy(loaded, twin, None)
    return loaded


def peer_args(collective, shape) -> dict:
    """``in_peer`` / ``out_peer`` pointers of a zero-copy call (the same heap offset everywhere)."""
    heap = collective.comm.heap
    out = {}
    for key, ptr in (("in_peer", shape.in_ptr), ("out_peer", shape.out_ptr)):
        hit = heap.offset_of(ptr) if ptr else None
        out[key] = heap.ptrs(hit[0]) if hit is not None else [0] * collective.compiled.world_size
    return out


class LocalAgreement:
    """The choices of one LocalGroup collective's ranks, compared call by call."""

    def __init__(self, world: int):
        self.queues = [deque() for _ in range(world)]
        self.lock = threading.Lock()

    def record(self, name: str, rank: int, choice) -> None:
        with self.lock:
            self.queues[rank].append(choice)
            if not all(self.queues):
                if len(self.queues[rank]) > 4096:
                    raise MismatchError(f"{name}: rank {rank} made 4096 calls its peers did not make")
                return
            heads = [q.popleft() for q in self.queues]
        if len(set(heads)) != 1:
            raise _disagree(name, heads)


def _describe(choice) -> str:
    if choice is None:
        return "staged (a buffer outside the heap)"
    in_off, out_off = choice[:2]
    return f"zero-copy, x at heap offset {in_off}, out at {out_off}"


def _disagree(name: str, choices) -> MismatchError:
    return MismatchError(
        f"{name}: ranks disagree on the zero-copy path: "
        + "; ".join(f"rank {r}: {_describe(c)}" for r, c in enumerate(choices)),
        notes=("pass buffers from comm.empty (the same blocks) on every rank, or ordinary buffers on every rank",),
    )


class ZeroCopy:
    """Per staged Collective: its registered twin and the per-call choice."""

    def __init__(self, staged, twin, agreement: LocalAgreement | None):
        self.staged = staged
        self.twin = twin
        self.agreement = agreement
        self.heap = staged.comm.heap
        self._cache: dict = {}
        self._generation = -1
        self._agreed: set = set()

    def pick(self, shape, *, record: bool = True):
        """The Collective to launch ``shape`` with: the twin (zero-copy) or None (staged).

        ``record=False``: only look (no agreement bookkeeping), for the fast-path decision."""
        if not symmetric.any_blocks():
            return None  # no heap block anywhere in this process: every call stages, on every rank
        if self.heap.generation != self._generation:
            self._cache.clear()
            self._generation = self.heap.generation
        key = (shape.in_ptr, shape.out_ptr, shape.count, shape.dtype, shape.op)
        choice = self._cache.get(key, _MISSING)
        if choice is _MISSING:
            choice = self._cache[key] = self._choose(shape)
        if not record:
            return self.twin if choice is not None else None
        if self.agreement is not None:
            self.agreement.record(self.staged.name, self.staged.rank, choice)
        elif choice is not None and key not in self._agreed:
            self._check_peers(choice)
            self._agreed.add(key)
        return self.twin if choice is not None else None

    def _choose(self, shape):
        staged = self.staged
        itemsize = shape.dtype.itemsize
        where = f"{staged.name} on rank {staged.rank}"
        offsets = []
        for label, ptr, units in (("x", shape.in_ptr, staged.in_units), ("out", shape.out_ptr, staged.out_units)):
            if not units or not ptr:
                offsets.append(None)
                continue
            located = self.heap.locate(ptr, units * shape.count * itemsize, f"{where}: {label}")
            if located is None:
                other = symmetric.owner_of(ptr, staged.comm)
                if other is not None:
                    raise ArgumentError(f"{where}: {label} lives in the symmetric heap of another communicator "
                                        f"({other!r}), not this collective's ({staged.comm!r})")
                return None
            offsets.append(located.offset)
        return (offsets[0], offsets[1], shape.count, shape.dtype.value, shape.op.value if shape.op else None)

    def _check_peers(self, choice) -> None:
        comm = self.staged.comm
        check = getattr(comm, "_check_exchange", None) or comm.allgather
        try:
            everyone = check(("zero-copy", self.staged.name, choice))
        except PurlinError:
            raise
        except Exception as error:  # a gloo timeout: a peer never came
            raise MismatchError(
                f"{self.staged.name}: rank {comm.rank} called with heap buffers (zero-copy), but a peer did not "
                f"join the check ({type(error).__name__}): it passed buffers outside the heap",
                notes=("pass buffers from comm.empty on every rank, or on none",),
            ) from error
        choices = [e[2] if isinstance(e, tuple) and len(e) == 3 and e[0] == "zero-copy" else None for e in everyone]
        if len(set(choices)) != 1:
            raise _disagree(self.staged.name, choices)
