"""Callers' buffers in CUDA graphs, without staging: peers read and write them directly.

An eager call on ordinary buffers (a caching allocator's tensors) stages through the
symmetric heap: only the heap is mapped on every rank.  A call that is being *captured* into
a CUDA graph is different: it will replay on the same buffers many times, so making those
buffers reachable by the peers once, at capture, pays for itself on every replay.  Such a call
runs the collective's registered twin (``purlinc.runtime.zerocopy``), the schedule that
already serves heap buffers, with the peers' pointers found here instead of from heap offsets:

- **one process** (a LocalGroup, loopback included): every rank's buffers are in this address
  space (peer access is on between the group's GPUs).  A group call records every rank's
  pointers for its call key (``record_group``); the capturing launch of any rank (the group
  call itself, captured with one forked stream per rank, or a per-rank call captured on its own
  device) reads them from there.
- **one process per GPU** (torchrun): at the capturing call, every rank exports the allocation
  holding each buffer (``cuMemGetAddressRange`` base + offset, a CUDA IPC handle) and the ranks
  exchange them over the host-side (gloo) group, which never touches a CUDA stream; each rank
  opens the peers' handles (once per allocation: mappings are kept, keyed by handle, until the
  communicator closes) and passes base + offset to the kernel.  This is what vLLM's custom
  all-reduce does with ``register_graph_buffers``, done per captured call rather than after
  the capture.  If any rank cannot export (memory from ``cuMemCreate``, e.g. torch's
  expandable segments), every rank stages that call alike.

Which captured calls register is ``PURLIN_GRAPH_BUFFERS`` (``settings.graph_buffers``):
``auto`` (default) registers where the collective's own zero-copy rule would run its twin on
heap buffers, i.e. not where an LL-packed schedule serves the size (there the packets' flags
beat the twin's separate signal round trip: measured back to back on 2 x H200, 1 KiB
all-reduce 3.2 us staged vs 6.0 us zero-copy, 64 KiB 4.9 vs 6.6; LL packing also does its
staging inside the one kernel).  In situ (between a producer and a consumer kernel, one GPU,
ranks in loopback: ``benchmarks/results/2026-12-02-h200x1-loopback-insitu-r2.md``) the same
split holds: at 1-64 KiB the staged LL call adds 2.9-3.3 us, the registered twin 4.7-5.2; at 1
and 4 MiB the twin adds 5.8 and 9.1 us, staging 6.5 and 14.2 (at 256 KiB they were within one
sample's noise).  ``register`` registers every captured call that has a twin;
``stage`` never registers.  Eager calls always stage.

Every rank must capture the call alike (SPMD): a rank that registers while a peer stages
waits on signals nobody raises (the two schedules have separate signal pads), and its kernel
times out with PurlinTimeoutError; the exchange under torchrun also fails with MismatchError
when a peer does not join it.
"""

from __future__ import annotations

import contextlib

from purlinc import settings
from purlinc.runtime.errors import ArgumentError, CudaError, MismatchError


def capturing(driver, stream) -> bool:
    """Whether ``stream`` (a raw handle) is being captured into a CUDA graph."""
    return driver.stream_capturing(stream)


def wanted(zero_copy, stream, driver) -> bool:
    """Whether a call of ``zero_copy``'s collective on ordinary buffers, launched on ``stream``,
    should run the registered twin (the setting says so, and the stream is capturing)."""
    mode = settings.graph_buffers()
    if mode == "stage":
        return False
    if mode == "auto" and zero_copy.prefer_staged:
        return False
    return capturing(driver, stream)


# ---------------------------------------------------------------------------------------------
# one process: pointers recorded by group calls


def record_group(shared, ranks, shapes, keys) -> None:
    """A LocalGroup call on ordinary buffers: every rank's (input, output) pointers, kept for
    each rank's call key (``keys``), so a capturing launch (now, or later per rank) can reach them."""
    ins = tuple(s.in_ptr or 0 for s in shapes)
    outs = tuple(s.out_ptr or 0 for s in shapes)
    with shared.lock:
        if len(shared.pointers) > 65536:
            shared.pointers.clear()  # old buffers: a later capture needs a group call again
        for collective, key in zip(ranks, keys):
            shared.pointers[(collective.rank, key)] = (ins, outs)


def local_peers(zero_copy, key) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(every rank's input, every rank's output) for a LocalGroup rank's capturing call."""
    staged = zero_copy.staged
    with zero_copy.local.lock:
        found = zero_copy.local.pointers.get((staged.rank, key))
    if found is None:
        raise ArgumentError(
            f"{staged.name} on rank {staged.rank}: a captured per-rank call on buffers that no group call "
            "has seen (its peers' buffers are unknown)",
            notes=("call the group collective once with these buffers before capturing per-rank calls, "
                   "or capture the group call itself (one forked stream per rank)",),
        )
    return found


# ---------------------------------------------------------------------------------------------
# one process per GPU: IPC export, exchange, open


def export(driver, ptr: int, nbytes: int):
    """(IPC handle bytes, offset in its allocation, nbytes) of a buffer, or None when its
    allocation cannot be exported (not from cuMemAlloc)."""
    if not ptr:
        return None
    try:
        handle, offset = driver.ipc_handle(ptr)
    except CudaError:
        return None
    return (handle, offset, nbytes)


class PeerMappings:
    """A communicator's opened peer allocations: IPC handle bytes -> base here.  A handle names
    one allocation for its lifetime, so the same handle maps the same memory; the bases are
    closed with the communicator (``comm._opened``)."""

    def __init__(self, comm):
        self.comm = comm
        self.bases: dict[bytes, int] = {}

    def open(self, driver, handle: bytes, offset: int) -> int:
        base = self.bases.get(handle)
        if base is None:
            base = self.bases[handle] = driver.ipc_open(handle, 0)
            self.comm._opened.append(base)
        return base + offset


def mappings_of(comm) -> PeerMappings:
    found = getattr(comm, "_graph_mappings", None)
    if found is None:
        found = comm._graph_mappings = PeerMappings(comm)
    return found


def exchanged_peers(zero_copy, shape, driver):
    """Under torchrun: every rank's (input, output) pointers as mapped here, from an exchange
    of IPC exports made while capturing; None when some rank cannot export (all stage)."""
    staged = zero_copy.staged
    comm = staged.comm
    nbytes = shape.count * shape.dtype.itemsize
    registered = zero_copy.twin.compiled.options.registered  # the sides peers reach
    schedule = staged.compiled.schedule
    with relaxed_capture(driver):
        mine = tuple(export(driver, ptr, units * nbytes) if side in registered and units else None
                     for side, ptr, units in (("in", shape.in_ptr, staged.in_units),
                                              ("out", shape.out_ptr, staged.out_units)))
        everyone = _exchange(zero_copy, shape, mine)
        if any(("in" in registered and schedule.in_units[r] and e[0] is None)
               or ("out" in registered and schedule.out_units[r] and e[1] is None) for r, e in enumerate(everyone)):
            return None  # some rank's buffer cannot be exported: every rank stages this call
        maps = mappings_of(comm)
        peers = ([], [])
        for peer, entry in enumerate(everyone):
            for side, own in ((0, shape.in_ptr), (1, shape.out_ptr)):
                if peer == comm.rank:
                    peers[side].append(own or 0)
                elif entry[side] is None:
                    peers[side].append(0)  # a side peers do not reach, or a rank without that buffer
                else:
                    handle, offset, _ = entry[side]
                    peers[side].append(maps.open(driver, handle, offset))
    return tuple(peers[0]), tuple(peers[1])


def _exchange(zero_copy, shape, mine) -> list:
    from purlinc.runtime.communicator import check_exchange

    staged = zero_copy.staged
    comm = staged.comm
    signature = (shape.count, shape.dtype.value, shape.op.value if shape.op else None)
    everyone = check_exchange(comm, ("graph-buffers", staged.name, signature, mine), lambda error: MismatchError(
        f"{staged.name}: rank {comm.rank} captured a call on ordinary buffers (registered for the graph), "
        f"but a peer did not join the exchange ({type(error).__name__}): it did not capture the same call",
        notes=("capture the same calls on every rank, or set PURLIN_GRAPH_BUFFERS=stage on every rank",)))
    def same_call(entry) -> bool:
        return (isinstance(entry, (tuple, list)) and len(entry) == 4 and entry[0] == "graph-buffers"
                and tuple(entry[2]) == signature)

    bad = [r for r, e in enumerate(everyone) if not same_call(e)]
    if bad:
        raise MismatchError(
            f"{staged.name}: ranks {bad} did not capture the same call as rank {comm.rank} "
            f"(count, dtype, op) = {signature}: " + "; ".join(f"rank {r}: {everyone[r]!r:.120}" for r in bad))
    return [e[3] for e in everyone]


@contextlib.contextmanager
def relaxed_capture(driver):
    """Run the block with this thread's stream-capture mode relaxed (as NCCL does around its
    own set-up during a capture): exporting and opening IPC handles, and loading the twin's
    kernel, are not stream work, but a global-mode capture on another thread refuses them."""
    previous = driver.exchange_capture_mode(driver.CAPTURE_MODE_RELAXED)
    try:
        yield
    finally:
        driver.exchange_capture_mode(previous)
