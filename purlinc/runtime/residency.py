"""Blocks that must run at the same time, against what a GPU holds at once.

A kernel's channel ``c`` waits only for channel ``c`` of the other ranks.  Where every rank
has a GPU of its own, a rank's channels never wait for each other, so a grid larger than its
GPU holds still completes (docs/RELIABILITY.md).  Ranks that share a GPU (a loopback group)
are different: their kernels wait for each other's blocks, so every block of every rank on
that GPU must be resident at once.  Blocks that cannot start leave the started ones waiting
until their waits time out, so such a call is refused before anything is launched: a group
call checks its ranks on every new set of launches (``collective.check_residency``), a torchrun
rank the ranks placed on its own GPU when it loads a kernel (``check_placed_peers``).

What a GPU holds: ``cuOccupancyMaxActiveBlocksPerMultiprocessor`` (the kernel's registers,
shared memory and threads) blocks per SM, times the SM count.  Ranks running different entry
points share the SMs: each block takes ``1 / per_sm`` of one, so the blocks fit while those
fractions add up to at most the SM count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from purlinc.runtime.errors import ResidencyError


@dataclass(frozen=True, slots=True)
class Blocks:
    """One rank's launch: its grid, block size and how many of its blocks one SM holds."""

    rank: int
    device: int
    grid: int
    threads: int
    per_sm: int


def check(name: str, launches: Sequence[Blocks], sm_count: Callable[[int], int]) -> None:
    """Raise ResidencyError if the ranks that share a GPU need more resident blocks than it holds."""
    by_device: dict[int, list[Blocks]] = {}
    for launch in launches:
        by_device.setdefault(launch.device, []).append(launch)
    for device, shared in by_device.items():
        if len(shared) < 2:
            continue  # a rank alone on its GPU: its channels wait only for other GPUs' blocks
        sms = sm_count(device)
        if sum(Fraction(b.grid, max(b.per_sm, 1)) for b in shared) > sms or any(b.per_sm < 1 for b in shared):
            raise _refusal(name, device, shared, sms)


def _refusal(name: str, device: int, shared: list[Blocks], sms: int) -> ResidencyError:
    needed = sum(b.grid for b in shared)
    per_sm = min(b.per_sm for b in shared)
    limit = per_sm * sms
    grids = sorted({b.grid for b in shared})
    threads = sorted({b.threads for b in shared})
    shape = (f"{len(shared)} ranks x {grids[0]} channels" if len(grids) == 1 else
             f"{len(shared)} ranks, {'/'.join(map(str, grids))} channels")
    most = max(1, limit // len(shared))
    return ResidencyError(
        f"{name}: this call needs {needed:,} blocks resident at once on cuda:{device} ({shape} of "
        f"{'/'.join(map(str, threads))} threads, ranks {_ranks(shared)} sharing that GPU), but cuda:{device} holds "
        f"at most {limit:,} of them ({per_sm} per SM x {sms} SMs, by the kernel's registers, shared memory and "
        f"threads); nothing was launched",
        notes=(
            "ranks that share a GPU wait for each other's blocks: blocks that cannot start would leave "
            "the others waiting until they time out",
            f"load it with fewer channels (channels={most} or fewer per rank here), "
            "or give each rank a GPU of its own",
        ),
        device=device, needed=needed, limit=limit,
    )


def _ranks(shared: list[Blocks]) -> str:
    ranks = sorted(b.rank for b in shared)
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _group_devices(comm) -> list[int]:
    """The device of every rank of ``comm``'s group: a LocalGroup's, or the torchrun ranks' the
    bootstrap found (``comm.peer_devices``; one host only); empty where neither is known."""
    group = getattr(comm, "local_group", None)
    return list(group.devices if group is not None else getattr(comm, "peer_devices", ()))


def shares_gpu(comm) -> bool:
    """Whether another rank of ``comm``'s group runs on ``comm``'s GPU: a loopback LocalGroup, or
    torchrun ranks the bootstrap found placed on one GPU."""
    return _group_devices(comm).count(comm.device) > 1


def check_placed_peers(name: str, comm, channels: int, threads: int, per_sm: int,
                       sm_count: Callable[[int], int]) -> None:
    """Under torchrun, ranks placed on this rank's GPU (``comm.peer_devices``) run their kernels
    on its SMs together: refuse (ResidencyError) before the first launch when their blocks cannot
    all be resident, counting each with this rank's kernel.  A LocalGroup's call checks its
    ranks per call instead (``check`` over the group's launches)."""
    devices = list(getattr(comm, "peer_devices", ()))
    if getattr(comm, "local_group", None) is not None or devices.count(comm.device) < 2:
        return
    check(name, [Blocks(r, d, channels, threads, per_sm) for r, d in enumerate(devices) if d == comm.device],
          sm_count)


def group_shares_a_gpu(comm) -> bool:
    """Whether any two ranks of ``comm``'s group run on one GPU (the same answer on every rank,
    unlike ``shares_gpu``, so a load that refuses this refuses it everywhere)."""
    devices = _group_devices(comm)
    return len(set(devices)) < len(devices)


def max_channels(devices: Sequence[int], sm_count: Callable[[int], int]) -> int | None:
    """The most channels per rank that fit whatever the kernel (one block per SM), where ranks
    share a GPU; None where every rank has a GPU of its own."""
    counts: dict[int, int] = {}
    for device in devices:
        counts[device] = counts.get(device, 0) + 1
    shared = {d: n for d, n in counts.items() if n > 1}
    if not shared:
        return None
    return max(1, min(sm_count(d) // n for d, n in shared.items()))
