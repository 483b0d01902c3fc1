"""Blocks that must run at the same time, against what a GPU holds at once.

A kernel's channel ``c`` waits only for channel ``c`` of the other ranks.  Where every rank
has a GPU of its own, a rank's channels never wait for each other, so a grid larger than its
GPU holds still completes (docs/RELIABILITY.md).  Ranks that share a GPU (a loopback group)
are different: their kernels wait for each other's blocks, so every block of every rank on
that GPU must be resident at once.  Blocks that cannot start leave the started ones waiting
until their waits time out, so such a call is refused before anything is launched: a group
call checks its ranks on every new set of launches (``collective.check_residency``), a torchrun
rank the ranks placed on its own GPU when it loads a kernel (``Collective._check_shared_device``).

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


def shares_gpu(comm) -> bool:
    """Whether another rank of ``comm``'s group runs on ``comm``'s GPU: a loopback LocalGroup, or
    torchrun ranks the bootstrap found placed on one GPU (``comm.peer_devices``; one host only)."""
    group = getattr(comm, "local_group", None)
    devices = group.devices if group is not None else getattr(comm, "peer_devices", ())
    return list(devices).count(comm.device) > 1


def group_shares_a_gpu(comm) -> bool:
    """Whether any two ranks of ``comm``'s group run on one GPU (the same answer on every rank,
    unlike ``shares_gpu``, so a load that refuses this refuses it everywhere)."""
    group = getattr(comm, "local_group", None)
    devices = list(group.devices if group is not None else getattr(comm, "peer_devices", ()))
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
