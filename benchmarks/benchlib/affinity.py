"""CPU affinity per local rank (``--cpu-affinity cores``): whole physical cores, none shared."""

from __future__ import annotations

from pathlib import Path

import report


def _physical_cores(cpus: list[int]) -> list[tuple[int, ...]]:
    """``cpus`` grouped by physical core (SMT siblings together, from sysfs), in order of each
    core's first CPU; one group per CPU where the topology is not readable."""
    groups: dict[tuple[int, ...], None] = {}
    for cpu in cpus:
        try:
            text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
            siblings = set(report.parse_cpu_list(text))
        except (OSError, ValueError):
            siblings = {cpu}
        groups[tuple(sorted(siblings & set(cpus)) or [cpu])] = None
    return sorted(groups, key=lambda g: g[0])


def cpu_cores_for(local_rank: int, local_world: int, cpus: list[int]) -> list[int]:
    """The CPUs of ``local_rank``'s share of the physical cores: core i goes to rank
    i % local_world, so no two ranks share a core (or its SMT sibling) and each gets an equal
    share.  With fewer cores than ranks, every rank keeps them all."""
    cores = _physical_cores(cpus)
    if len(cores) < local_world:
        return sorted(cpus)
    return sorted(cpu for i, core in enumerate(cores) if i % local_world == local_rank for cpu in core)
