"""Placing a Compiled on the ranks: heap space (staging, signal pad, call counters) at the same
offsets on every rank, zeroed, and the ranks' agreement that they loaded the same thing.

  take the space from every rank's symmetric heap, then exchange a hash of (source, world
  size, params, options, atom, arch, heap offsets) and refuse to go on if any rank
  disagrees; zero the space only after that exchange, and exchange once more before the
  first call (see ``load_compiled``).  A zero-copy twin (``zerocopy.twin_compiled``) is
  placed the same way and attached to the staged collective.
"""

from __future__ import annotations

import hashlib
import json

from purlinc import settings
from purlinc.atom.atoms import lookup_atom
from purlinc.errors import PurlinError
from purlinc.log import log
from purlinc.pipeline import Compiled
from purlinc.runtime import communicator
from purlinc.runtime.collective import Collective, GroupCollective, Layout, layout_sizes
from purlinc.runtime.errors import MismatchError
from purlinc.runtime.prepared import staging_placement
from purlinc.runtime.residency import group_shares_a_gpu
from purlinc.runtime.zerocopy import ZeroCopy, twin_compiled


def _allocate(comm, compiled: Compiled, stage_bytes: int | None) -> Layout:
    staging = staging_placement(compiled, stage_bytes)
    stage, pad, counters = layout_sizes(compiled, staging=staging)
    if staging.units * staging.large > settings.stage_bytes():
        # The floor (prepared.least_stage_bytes): one epilogue row per slice, whatever the cap.
        log.warning("%s: staging of %.1f MiB per rank, above %s (%.1f MiB): each of its %d slice(s) per unit "
                    "holds %d bytes, at least 16 and a whole row of every dtype its epilogue runs", compiled.name,
                    staging.units * staging.large / 2**20, settings.STAGE_MB.name, settings.stage_bytes() / 2**20,
                    staging.slices, staging.largest_step)
    heap = comm.heap
    stage_off = heap.alloc(stage, f"{compiled.name} staging") if stage else 0
    pad_off = heap.alloc(pad, f"{compiled.name} signal pad")
    counters_off = heap.alloc(counters, f"{compiled.name} call counters")
    return Layout(stage_off, stage, pad_off, pad, counters_off, counters, staging)


def zero_space(comm, compiled: Compiled, layout: Layout) -> None:
    from purlinc.runtime import driver

    driver.set_current(comm.device)
    own = comm.heap.ptr  # heap offsets -> this rank's pointers (segment by segment)
    # Staging is zeroed too: a packed (LL) schedule takes a packet whose flag word matches as
    # arrived data, and heap space can be reused from an earlier collective.
    if layout.stage_bytes:
        driver.memset_d8(own(comm.rank, layout.stage), 0, layout.stage_bytes)
    driver.memset_d8(own(comm.rank, layout.pad), 0, layout.pad_bytes)
    driver.memset_d8(own(comm.rank, layout.counters), 0, layout.counters_bytes)
    if compiled.plan is not None:
        host = lookup_atom(compiled.atom).host_module()
        driver.copy_htod(own(comm.rank, layout.pad), host.init_image(compiled.plan, comm.rank))


def fingerprint(compiled: Compiled, layout: Layout) -> str:
    body = {**compiled.identity(), "layout": [layout.stage, layout.stage_bytes, layout.pad, layout.pad_bytes,
                                              layout.counters]}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def load_mismatch(name: str, prints: list, identities: list) -> MismatchError:
    groups: dict[str, list[int]] = {}
    for rank, fp in enumerate(prints):
        groups.setdefault(fp, []).append(rank)
    lines = [f"ranks {ranks}: {identities[ranks[0]]}" for ranks in groups.values()]
    return MismatchError(
        f"ranks disagree on what {name} is (source, world size, params, options, atom, arch or heap layout)",
        notes=tuple(lines) + ("every rank must load the same collective, in the same order",),
    )


def load_compiled(compiled: Compiled, comm, comms: list, stage_bytes: int | None = None):
    """Take heap space for ``compiled`` on every rank of ``comms`` and check the ranks agree."""
    from purlinc.runtime import driver

    first = comms[0]
    for c in comms:
        if getattr(c, "failed", None) is not None:
            c.refuse(f"loading {compiled.name}")
    if compiled.plan is not None and group_shares_a_gpu(first):
        # Stream waits (cuStreamWaitValue64) are not dependencies CUDA's scheduler sees: the
        # streams of ranks on one GPU share its hardware queues, so a rank's wait can sit ahead
        # of the notify it waits for (seen: a loopback broadcast at R=5 on two channels never
        # finished, and the watchdog's releasing write queued behind the wait as well).
        raise PurlinError(f"{compiled.name}: the {compiled.atom} atom cannot run where ranks share a GPU",
                          notes=("its stream waits are invisible to CUDA's scheduler: on one GPU a rank's wait "
                                 "can block the queue its peer's notify needs (a deadlock)",
                                 "use a kernel atom (ldst or tma), whose waits are bounded"))
    if compiled.plan is not None and not driver.supports_stream_mem_ops(first.device):
        raise PurlinError(f"the {compiled.atom} atom needs 64-bit stream memory operations, "
                          f"which cuda:{first.device} lacks")
    layouts = [_allocate(c, compiled, stage_bytes) for c in comms]

    def zero_all() -> None:
        for c, layout in zip(comms, layouts):
            zero_space(c, compiled, layout)
        for c in comms:
            driver.synchronize(c.device)

    if isinstance(comm, communicator.LocalGroup):
        if len({(l.stage, l.pad, l.counters) for l in layouts}) != 1:
            raise MismatchError(f"{compiled.name}: the LocalGroup's heaps are out of step: {layouts}")
        zero_all()  # one process: every device was synchronized when the last collective closed
        group = GroupCollective([Collective(compiled, c, l, agree=False) for c, l in zip(comms, layouts)])
        return attach_twin(group, compiled, comm, comms)

    layout = layouts[0]
    fp = fingerprint(compiled, layout)
    everyone = comm.allgather(("load", fp, {**compiled.identity(),
                                            "layout": (layout.stage, layout.pad, layout.counters)}))
    if len({e[1] for e in everyone}) != 1:
        raise load_mismatch(compiled.name, [e[1] for e in everyone], [e[2] for e in everyone])
    # Zero only after the exchange: the space may have belonged to a collective closed just
    # before, and a peer's last call of it can still write into it (its final notify lands in
    # our pad) until that peer has closed it too -- which it has, once it reached this
    # exchange (close() synchronizes the device).  Zeroing first let such a late write survive
    # into the new collective's signals (seen on 2 x H200: an intermittent wrong first call).
    zero_all()
    # ...and no rank may call the new collective before every rank has zeroed: our first call
    # writes into the peers' staging and pads, and a peer still zeroing would wipe that notify
    # (its wait would then time out).  The second exchange is that barrier.
    comm.allgather(("zeroed", fp))
    return attach_twin(Collective(compiled, comm, layout, agree=True), compiled, comm, comms)


def attach_twin(loaded, compiled: Compiled, comm, comms):
    """Give ``loaded`` (a Collective or GroupCollective) its zero-copy twin, if there is one."""
    twin_c = twin_compiled(compiled)
    if twin_c is None:
        return loaded
    twin = load_compiled(twin_c, comm, comms)
    if isinstance(loaded, GroupCollective):
        for staged, registered in zip(loaded.ranks, twin.ranks):
            staged._zc = ZeroCopy(staged, registered)
    else:
        loaded._zc = ZeroCopy(loaded, twin)
    return loaded
