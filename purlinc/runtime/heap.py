"""The symmetric heap: segments of equal size on every rank, every rank mapping every peer's.

Offsets are *heap offsets*: segment ``k`` covers ``[start_k, start_k + size_k)`` of one
offset space, the same on every rank, and ``ptr(peer, offset)`` is where this rank reaches
that byte of ``peer``'s heap (``segment.bases[peer] + offset - start_k``).  A region never
straddles two segments, so it is contiguous in memory.

Space is handed out by a deterministic first-fit allocator per segment: ranks that make the
same sequence of ``alloc``/``free`` calls get the same offsets, so one offset names the same
region on every rank.  When no segment has room, the heap *grows*: ``grow(index, nbytes)``
(supplied by the communicator) allocates a new segment on every rank and exchanges its
pointers.  Growth is collective: it happens inside an ``alloc`` that every rank makes at the
same point (loads and ``comm.empty`` are collectives).  Collectives check at load that every
rank got the same offsets (see collective.py), and ``comm.empty`` checks its block, so a
divergent sequence is an error, never a silent corruption.

Caller-visible blocks (``comm.empty``/``comm.alloc``) are tracked as *user blocks*:
``locate(ptr, nbytes)`` says whether a buffer lies in a live one (the zero-copy path), in
freed heap space (an error), or outside the heap.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from purlinc.log import log

ALIGN = 256  # every region starts 256-byte aligned (16-byte vectors, TMA's 128-byte rule)
SEGMENT_ALIGN = 2 << 20  # segments are whole 2 MiB pages (cuMemAlloc's granularity for IPC)


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


@dataclass
class Segment:
    """One growth step: ``size`` bytes on every rank; ``bases[p]`` is rank p's as mapped here."""

    index: int
    start: int  # heap offset of its first byte
    size: int
    bases: list[int]
    allocator: FirstFit = None

    def __post_init__(self):
        if self.allocator is None:
            self.allocator = FirstFit(self.size)

    @property
    def end(self) -> int:
        return self.start + self.size


# grow(index, nbytes) -> the new segment's base on every rank (rank order), as mapped here.
Grow = Callable[[int, int], list[int]]


@dataclass(frozen=True, slots=True)
class Located:
    """Where a caller's buffer sits: a live user block of this heap (``offset``: its heap
    offset; ``block``: the block's heap offset and length)."""

    offset: int
    segment: int
    block: tuple[int, int]


class SymmetricHeap:
    """``segments[k].bases[p]``: rank p's part of segment k as mapped in this process."""

    def __init__(self, rank: int, size: int, bases: list[int], *, grow: Grow | None = None,
                 segment_bytes: int | None = None, limit_bytes: int = 0):
        self.rank = rank
        self.segments: list[Segment] = [Segment(0, 0, size, list(bases))]
        self._grow = grow
        self.segment_bytes = segment_bytes or size  # the least a growth step adds
        self.limit_bytes = limit_bytes  # 0: no limit but the device's memory
        self.user: dict[int, int] = {}  # live user blocks: heap offset -> length
        self._user_starts: list[int] = []  # sorted keys of ``user``
        self.generation = 0  # bumped on every user alloc/free (zero-copy caches key on it)

    # ------------------------------------------------------------------ sizes
    @property
    def size(self) -> int:
        """Bytes reserved per rank (all segments)."""
        return sum(s.size for s in self.segments)

    @property
    def bases(self) -> list[int]:
        """The first segment's bases (kept for callers that predate growth)."""
        return self.segments[0].bases

    @property
    def in_use(self) -> int:
        return sum(s.allocator.in_use for s in self.segments)

    @property
    def largest_free(self) -> int:
        return max(s.allocator.largest_free for s in self.segments)

    def available(self) -> int:
        """The largest request ``alloc`` could satisfy now: the largest free block, or what a
        new segment may still take under the limit (unbounded heaps: the device decides)."""
        room = self.largest_free
        if self._grow is not None and self.limit_bytes:
            room = max(room, (self.limit_bytes - self.size) // SEGMENT_ALIGN * SEGMENT_ALIGN)
        return room

    # ------------------------------------------------------------------ alloc / free
    def alloc(self, nbytes: int, what: str) -> int:
        """A heap offset of ``nbytes`` (256-byte aligned); grows the heap if no segment has room."""
        for segment in self.segments:
            offset = segment.allocator.alloc(nbytes)
            if offset is not None:
                return segment.start + offset
        segment = self._add_segment(nbytes, what)
        offset = segment.allocator.alloc(nbytes)
        assert offset is not None, (nbytes, segment.size)
        return segment.start + offset

    def _add_segment(self, nbytes: int, what: str) -> Segment:
        from purlinc.runtime.errors import HeapExhaustedError

        need = _round_up(_round_up(max(int(nbytes), 1), ALIGN), SEGMENT_ALIGN)
        size = max(need, _round_up(self.segment_bytes, SEGMENT_ALIGN))
        if self.limit_bytes and self.size + size > self.limit_bytes:
            size = need  # a smaller step may still fit under the limit
        if self._grow is None or (self.limit_bytes and self.size + size > self.limit_bytes):
            available = self.available()
            raise HeapExhaustedError(
                f"symmetric heap exhausted: {what} needs {nbytes} bytes, {available} are available "
                f"(largest free block {self.largest_free} bytes; {self.in_use} of {self.size} bytes in use"
                + (f", limit {self.limit_bytes} bytes)" if self.limit_bytes else ")"),
                notes=self._exhaustion_notes(),
                requested=int(nbytes), available=available,
            )
        bases = self._grow(len(self.segments), size)
        segment = Segment(len(self.segments), self.size, size, list(bases))
        self.segments.append(segment)
        if log.isEnabledFor(logging.INFO):
            log.info("heap of rank %d grew by segment %d of %d bytes for %s (%d bytes in all)", self.rank,
                     segment.index, size, what, self.size)
        return segment

    def _exhaustion_notes(self) -> tuple[str, ...]:
        from purlinc.settings import HEAP_MAX_MB

        if self._grow is None:
            return ("this heap cannot grow", "close collectives or free blocks you no longer use")
        return ("close collectives (coll.close()) or free blocks (comm.empty tensors) you no longer use",
                f"or raise {HEAP_MAX_MB.name} (0 means no limit)")

    def segment_of(self, offset: int) -> Segment:
        for segment in self.segments:
            if segment.start <= offset < segment.end:
                return segment
        raise KeyError(f"heap offset {offset} is outside every segment")

    def free(self, offset: int) -> None:
        segment = self.segment_of(offset)
        segment.allocator.free(offset - segment.start)

    # ------------------------------------------------------------------ pointers
    def ptr(self, rank: int, offset: int) -> int:
        segment = self.segment_of(offset)
        return segment.bases[rank] + offset - segment.start

    def ptrs(self, offset: int) -> list[int]:
        segment = self.segment_of(offset)
        return [base + offset - segment.start for base in segment.bases]

    # ------------------------------------------------------------------ user blocks
    def alloc_user(self, nbytes: int, what: str) -> int:
        offset = self.alloc(nbytes, what)
        length = self.segment_of(offset).allocator.used[offset - self.segment_of(offset).start]
        self.user[offset] = length
        bisect.insort(self._user_starts, offset)
        self.generation += 1
        return offset

    def free_user(self, offset: int) -> None:
        if offset not in self.user:
            raise KeyError(f"heap offset {offset} is not a live user block")
        del self.user[offset]
        self._user_starts.remove(offset)
        self.free(offset)
        self.generation += 1

    def offset_of(self, ptr: int) -> tuple[int, Segment] | None:
        """(heap offset, segment) of a pointer into this rank's own heap, or None."""
        for segment in self.segments:
            base = segment.bases[self.rank]
            if base <= ptr < base + segment.size:
                return segment.start + ptr - base, segment
        return None

    def locate(self, ptr: int, nbytes: int, what: str = "buffer") -> Located | None:
        """A live user block holding ``[ptr, ptr + nbytes)``; None when the buffer is outside
        this heap.  Raises FreedBufferError for heap space that is not a live user block
        (freed, or Purlin's own staging) and ArgumentError for a buffer running past its block."""
        from purlinc.runtime.errors import ArgumentError, FreedBufferError

        hit = self.offset_of(ptr)
        if hit is None:
            return None
        offset, segment = hit
        i = bisect.bisect_right(self._user_starts, offset) - 1
        if i >= 0:
            start = self._user_starts[i]
            length = self.user[start]
            if offset < start + length:
                if offset + max(nbytes, 0) > start + length:
                    raise ArgumentError(
                        f"{what} at heap offset {offset} runs {offset + nbytes - start - length} bytes past "
                        f"the end of its heap block ([{start}, {start + length}))")
                return Located(offset, segment.index, (start, length))
        raise FreedBufferError(
            f"{what} at {ptr:#x} lies in Purlin's symmetric heap (offset {offset}) but not in a live block: "
            "it was freed (or it is Purlin's own staging space)",
            notes=("keep the HeapBlock (or the tensor comm.empty returned) alive while it is in use",),
        )
