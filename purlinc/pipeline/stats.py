"""Counters of the work this process's pipeline did: one ``STATS`` object, which every module
of the pipeline updates and tests read (``purlinc.pipeline.STATS`` is this object)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Stats:
    """What this process's pipeline did (tests assert on it, not on times).

    ``front_hits`` / ``front_misses``: kernel requests (``compile``, ``Compiled.kernel``)
    answered from a cache (on disk, or ``memo_hits`` in this process) or not;
    ``schedule_hits`` / ``schedule_misses``: the same for schedules."""

    front_hits: int = 0
    front_misses: int = 0
    memo_hits: int = 0
    schedule_hits: int = 0
    schedule_misses: int = 0
    parses: int = 0
    checks: int = 0
    lowerings: int = 0
    verifications: int = 0
    generations: int = 0


STATS = Stats()
