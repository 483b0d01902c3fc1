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
- in a LocalGroup (one process), a group call compares every rank's choice before any rank
  launches; per-rank calls (one device's graph capture) reuse what a group call agreed on.

The agreed offsets also give every rank its peers' pointers: a rank without input (a
broadcast's non-root) reaches the root's input at the offset the root reported.

An eager call that passes the same heap tensors as the one before replays that call's twin
launch without the checks above (``Collective.replay_target``), for as long as no heap block
has been allocated or freed since (``FastPath`` keys on the heap's generation): a freed block
still takes the full path, which refuses it.

The twin's kernel is compiled and loaded at its first zero-copy call (or by
``coll.warm(dtype, op, zero_copy=True)``): make one eager call on the heap buffers before
capturing a CUDA graph, as for any new (dtype, op).

Buffers outside the heap stage (two copies), except in a call being captured into a CUDA graph:
there the twin runs on the caller's own buffers, made reachable by the peers at capture
(``purlinc.runtime.graphbuffers``; ``PURLIN_GRAPH_BUFFERS`` says where).  A pointer into freed
heap space is a FreedBufferError; a buffer in another communicator's heap an ArgumentError.
"""

from __future__ import annotations

import threading
from dataclasses import replace

from purlinc.errors import PurlinError
from purlinc.runtime import graphbuffers, symmetric
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
        # slots=None: a ring's slots would be refused for direct-pull (they do not apply to it)
        yield replace(unpacked, algorithm=Algorithm.DIRECT_PULL, registered=frozenset({"in"}), slots=None)


def twin_compiled(compiled):
    """``compiled`` lowered for registered buffers, or None when no registered form reaches a
    peer's buffer (nothing to gain) or the atom cannot run one (its record's ``registered``)."""
    from purlinc import pipeline
    from purlinc.atom.atoms import lookup_atom

    if not lookup_atom(compiled.atom).registered or compiled.options.registered:
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
        # The pipeline's Compiled for these options (same source, world, atom and target): the
        # twin's schedule and kernels are cached like any other's.
        return pipeline.prepare(compiled.source, world_size=compiled.world_size, params=dict(compiled.params),
                                arch=compiled.arch, atom=compiled.atom, options=options,
                                trace=compiled.trace).prepared()
    return None


def call_key(shape) -> tuple:
    return (shape.in_ptr, shape.out_ptr, shape.count, shape.dtype, shape.op)


def peer_args(collective, shape) -> dict:
    """``in_peer`` / ``out_peer`` of a zero-copy call: every rank's buffer at the heap offset the
    ranks agreed on (a rank without input, e.g. a broadcast's non-root, still reaches the root's
    input through the offset the root reported)."""
    given = getattr(collective, "_graph_peers", {}).get(call_key(shape))
    if given is not None:  # a captured call on the caller's own buffers (graphbuffers.py)
        return {"in_peer": list(given[0]), "out_peer": list(given[1])}
    heap = collective.comm.heap
    world = collective.compiled.world_size
    offsets = getattr(collective, "_zc_offsets", {}).get(call_key(shape))
    if offsets is None:  # not agreed through pick(): this rank's own offsets
        offsets = tuple((heap.offset_of(ptr) or (None,))[0] if ptr else None for ptr in (shape.in_ptr, shape.out_ptr))
    return {key: heap.ptrs(off) if off is not None else [0] * world
            for key, off in (("in_peer", offsets[0]), ("out_peer", offsets[1]))}


def agree(name: str, choices: list) -> tuple[int | None, int | None] | None:
    """Every rank's choice -> the agreed (input offset, output offset), or None (all staged).

    A choice is None (a buffer outside the heap) or (in offset, out offset, count, dtype, op),
    offsets None where the rank passes no such buffer.  The ranks must all choose zero-copy or
    all stage, and the ranks that pass a buffer on a side must pass it at the same offset."""
    if all(c is None for c in choices):
        return None
    if any(c is None for c in choices):
        raise _disagree(name, choices)
    if len({tuple(c[2:]) for c in choices}) != 1:
        raise MismatchError(f"{name}: ranks called with different (count, dtype, op): "
                            + "; ".join(f"rank {r}: {tuple(c[2:])}" for r, c in enumerate(choices)))
    agreed = []
    for side in (0, 1):
        offsets = {c[side] for c in choices if c[side] is not None}
        if len(offsets) > 1:
            raise _disagree(name, choices)
        agreed.append(offsets.pop() if offsets else None)
    return agreed[0], agreed[1]


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


class LocalAgreement:
    """A LocalGroup's agreed choices, shared by every loaded collective of the group:
    (rank, call key) -> agreed offsets or None.  A group call settles them for every rank
    before any rank launches (``agree_group``); per-rank calls (one rank's graph capture)
    then find them here."""

    def __init__(self):
        self.agreed: dict = {}
        self.pointers: dict = {}  # (rank, call key) -> every rank's (inputs, outputs): graphbuffers.py
        self.lock = threading.Lock()


def agreement_of(comm) -> LocalAgreement | None:
    group = getattr(comm, "local_group", None)
    if group is None:
        return None
    found = getattr(group, "_zc_agreement", None)
    if found is None:
        found = group._zc_agreement = LocalAgreement()
    return found


def agree_group(ranks, prepared) -> None:
    """A LocalGroup call: settle the zero-copy choice of every rank before any launches."""
    if not ranks:
        return
    shapes = [p[0] for p in prepared]
    if all(s.count == 0 for s in shapes):
        return
    if any(getattr(c, "_zc", None) is not None for c in ranks):  # a capturing launch may reach these buffers directly
        graphbuffers.record_group(agreement_of(ranks[0].comm), ranks, shapes, [call_key(s) for s in shapes])
    if not symmetric.any_blocks():
        return
    choices = [c._zc.local_choice(s) if c._zc is not None else choose(c, s) for c, s in zip(ranks, shapes)]
    agreed = agree(ranks[0].name, choices)
    shared = agreement_of(ranks[0].comm)
    with shared.lock:
        if len(shared.agreed) > 65536:
            shared.agreed.clear()  # old buffers; a later per-rank call without a group call is refused
        for c, s in zip(ranks, shapes):
            shared.agreed[(c.rank, call_key(s))] = agreed


def choose(collective, shape):
    """One rank's choice for a call: None (some buffer it passes is outside the heap: staged)
    or (in offset, out offset, count, dtype, op).  Raises for freed or foreign heap buffers."""
    heap = collective.comm.heap
    itemsize = shape.dtype.itemsize
    where = f"{collective.name} on rank {collective.rank}"
    offsets = []
    for label, ptr, units in (("x", shape.in_ptr, collective.in_units), ("out", shape.out_ptr, collective.out_units)):
        if not units or not ptr:
            offsets.append(None)
            continue
        located = heap.locate(ptr, units * shape.count * itemsize, f"{where}: {label}")
        if located is None:
            other = symmetric.owner_of(ptr, collective.comm)
            if other is not None:
                raise ArgumentError(f"{where}: {label} lives in the symmetric heap of another communicator "
                                    f"({other!r}), not this collective's ({collective.comm!r})")
            return None
        offsets.append(located.offset)
    return (offsets[0], offsets[1], shape.count, shape.dtype.value, shape.op.value if shape.op else None)


class ZeroCopy:
    """Per staged Collective: its registered twin and the per-call choice."""

    def __init__(self, staged, twin):
        self.staged = staged
        self.twin = twin
        self.heap = staged.comm.heap
        self.local = agreement_of(staged.comm)  # None under torchrun
        self._cache: dict = {}  # call key -> this rank's choice (cleared when the heap changes)
        self._generation = -1
        self.offsets: dict = {}  # call key -> agreed (in, out) offsets, read by the twin's peer_args
        twin._zc_offsets = self.offsets
        self.graph_peers: dict = {}  # call key -> every rank's (inputs, outputs): captured calls
        twin._graph_peers = self.graph_peers
        # Captured calls on ordinary buffers that ran the twin (no staging), and those that
        # staged because some rank could not export its buffer: for tests and tools.
        self.graph_registered = 0
        self.graph_staged = 0
        # A packed (LL) schedule serves small calls, where its packets' flags beat the twin's
        # separate signal round trip (registered pushes cannot carry LL packets): heap buffers
        # then stage too.  Measured on 2 x H200 (benchmarks/RESULTS.md): 1 KiB all-reduce 3.2 us
        # staged vs 6.0 us zero-copy, 64 KiB 4.9 vs 6.6; zero-copy wins from ~1 MiB, where the
        # size buckets use unpacked schedules.  The same on every rank: it is the schedule's.
        self.prefer_staged = staged.compiled.options.packed

    def local_choice(self, shape):
        """This rank's choice for ``shape`` (raises for freed or foreign heap buffers)."""
        if self.heap.generation != self._generation:
            self._cache.clear()
            self._generation = self.heap.generation
        key = call_key(shape)
        choice = self._cache.get(key, _MISSING)
        if choice is _MISSING:
            choice = self._cache[key] = choose(self.staged, shape)
        return choice

    def pick(self, shape, *, record: bool = True, stream=None):
        """The Collective to launch ``shape`` with: the twin (zero-copy) or None (staged).

        ``record=False``: only look (no agreement with the peers), for the fast-path decision.
        ``stream``: the launch's stream; a capturing one lets ordinary buffers take the twin."""
        # No heap block anywhere in this process: every call is on ordinary buffers, every rank.
        choice = self.local_choice(shape) if symmetric.any_blocks() else None
        if choice is None:
            return self._ordinary(shape, stream, record)
        if self.prefer_staged:
            return None
        if not record:
            return self.twin if choice is not None else None
        key = call_key(shape)
        if self.local is not None:
            with self.local.lock:
                agreed = self.local.agreed.get((self.staged.rank, key), _MISSING)
            if agreed is _MISSING:
                if choice is None:
                    return None  # not a heap call: staged, as every rank's identical buffers say
                raise ArgumentError(
                    f"{self.staged.name} on rank {self.staged.rank}: heap buffers in a per-rank call that no "
                    "group call has agreed on yet",
                    notes=("call the group collective once with these buffers (it checks every rank takes the "
                           "zero-copy path), then per-rank calls and graph captures reuse that",),
                )
        elif key in self.offsets:
            agreed = self.offsets[key]
        elif choice is None:
            return None  # ordinary buffers: never a host exchange (their addresses differ by rank)
        else:
            agreed = self._check_peers(choice)
        if (agreed is None) != (choice is None):
            raise MismatchError(f"{self.staged.name} on rank {self.staged.rank}: the buffers changed since the "
                                "ranks agreed on this call's path")
        if agreed is None:
            return None
        self.offsets[key] = agreed
        return self.twin

    def _ordinary(self, shape, stream, record: bool):
        """A call on ordinary buffers: staged (None), or the twin when it is being captured
        and the setting registers it (graphbuffers.py)."""
        if stream is None:
            return None
        driver = self.staged._driver
        if not graphbuffers.wanted(self, stream, driver):
            return None
        if not record:
            return self.twin
        if self.local is not None:
            peers = graphbuffers.local_peers(self, call_key(shape))
        else:
            peers = graphbuffers.exchanged_peers(self, shape, driver)
        if peers is None:
            self.graph_staged += 1
            return None
        self.graph_peers[call_key(shape)] = peers
        self.graph_registered += 1
        self.load_twin(shape)
        return self.twin

    def load_twin(self, shape) -> None:
        """The twin's kernel for ``shape``, loaded now: a captured call on ordinary buffers may be
        the twin's first use (eager calls there stage), and a module load is not stream work."""
        with graphbuffers.relaxed_capture(self.staged._driver):
            self.twin.variant(shape.dtype, shape.op)

    def _check_peers(self, choice):
        """Under torchrun: every rank's choice, once per call key; the agreed offsets."""
        from purlinc.runtime.communicator import check_exchange

        comm = self.staged.comm
        everyone = check_exchange(comm, ("zero-copy", self.staged.name, choice), lambda error: MismatchError(
            f"{self.staged.name}: rank {comm.rank} called with heap buffers (zero-copy), but a peer did not "
            f"join the check ({type(error).__name__}): it passed buffers outside the heap",
            notes=("pass buffers from comm.empty on every rank, or on none",)))
        choices = [e[2] if isinstance(e, (tuple, list)) and len(e) == 3 and e[0] == "zero-copy" else None
                   for e in everyone]
        choices = [tuple(c) if c is not None else None for c in choices]
        return agree(self.staged.name, choices)
