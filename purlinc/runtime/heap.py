"""The symmetric heap: one equal-size device allocation per rank, every rank mapping every peer's.

Space inside it is handed out by a deterministic first-fit allocator, so ranks that make
the same sequence of ``alloc``/``free`` calls get the same offsets: one offset then names
the same region on every rank, and ``ptr(peer, offset)`` is where this rank reaches it.
Collectives check at load that every rank got the same offsets (see collective.py), so a
divergent sequence is an error, never a silent corruption.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALIGN = 256  # every region starts 256-byte aligned (16-byte vectors, TMA's 128-byte rule)


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@dataclass
class FirstFit:
    """A first-fit allocator over ``[0, size)`` with coalescing frees.  Pure bookkeeping."""

    size: int
    free_list: list[tuple[int, int]] = field(default_factory=list)  # sorted (offset, length)
    used: dict[int, int] = field(default_factory=dict)  # offset -> length

    def __post_init__(self):
        if not self.free_list and not self.used:
            self.free_list = [(0, self.size)]

    def alloc(self, nbytes: int) -> int | None:
        length = _round_up(max(int(nbytes), 1), ALIGN)
        for i, (offset, free) in enumerate(self.free_list):
            if free >= length:
                if free == length:
                    del self.free_list[i]
                else:
                    self.free_list[i] = (offset + length, free - length)
                self.used[offset] = length
                return offset
        return None

    def free(self, offset: int) -> None:
        length = self.used.pop(offset)
        self.free_list.append((offset, length))
        self.free_list.sort()
        merged: list[tuple[int, int]] = []
        for start, size in self.free_list:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((start, size))
        self.free_list = merged

    @property
    def largest_free(self) -> int:
        return max((size for _, size in self.free_list), default=0)

    @property
    def in_use(self) -> int:
        return sum(self.used.values())


class SymmetricHeap:
    """``bases[p]``: rank p's heap as mapped in this process (``bases[rank]`` is our own)."""

    def __init__(self, rank: int, size: int, bases: list[int]):
        self.rank = rank
        self.size = size
        self.bases = list(bases)
        self.allocator = FirstFit(size)

    def alloc(self, nbytes: int, what: str) -> int:
        offset = self.allocator.alloc(nbytes)
        if offset is None:
            from purlinc.runtime.errors import ArgumentError
            from purlinc.settings import HEAP_MB

            raise ArgumentError(
                f"symmetric heap exhausted: {what} needs {nbytes} bytes, the largest free block is "
                f"{self.allocator.largest_free} of {self.size} bytes",
                notes=(f"close collectives you no longer use (coll.close()) or raise {HEAP_MB.name}",),
            )
        return offset

    def free(self, offset: int) -> None:
        self.allocator.free(offset)

    def ptr(self, rank: int, offset: int) -> int:
        return self.bases[rank] + offset

    def ptrs(self, offset: int) -> list[int]:
        return [base + offset for base in self.bases]
