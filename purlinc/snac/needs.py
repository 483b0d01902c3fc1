"""The spec, regrouped by chunk name: where each output chunk must land and what it is made from.

Shared by every lowering in ``purlinc.snac.lower``; like them, it looks only at slots."""

from __future__ import annotations

from dataclasses import dataclass

from purlinc.frontend.spec import Chunk, Slot, Spec


# --------------------------------------------------------------------------------------
# The spec, regrouped by chunk name


@dataclass(frozen=True, slots=True)
class _Need:
    """One output chunk name: where it must land and what it is made from."""

    chunk: Chunk
    positions: tuple[tuple[int, tuple[int, ...]], ...]  # (rank, its output positions), rank order
    sources: tuple[Slot, ...]  # copy: candidate producers; reduce: all, in spec order

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(rank for rank, _ in self.positions)

    def at(self, rank: int) -> tuple[int, ...]:
        return dict(self.positions).get(rank, ())


def _needs(spec: Spec) -> tuple[_Need, ...]:
    """Output chunk names in order of first appearance (rank, then position)."""
    order: list[Chunk] = []
    where: dict[Chunk, dict[int, list[int]]] = {}
    sources: dict[Chunk, tuple[Slot, ...]] = {}
    for rank in range(spec.world_size):
        for position, chunk in enumerate(spec.outputs[rank]):
            if chunk not in where:
                order.append(chunk)
                where[chunk] = {}
                sources[chunk] = spec.sources[rank][position]
            where[chunk].setdefault(rank, []).append(position)
    return tuple(
        _Need(chunk, tuple((rank, tuple(ps)) for rank, ps in sorted(where[chunk].items())), sources[chunk])
        for chunk in order
    )


def _copy_source(need: _Need, rank: int) -> Slot:
    """The producer a copy reads for ``rank``: a local one when the spec offers it."""
    for slot in need.sources:
        if slot.rank == rank:
            return slot
    return need.sources[0]


def _owners(needs: tuple[_Need, ...]) -> dict[Chunk, int]:
    """Round-robin over the ranks that need each chunk (chunk i -> i-th such rank, cyclically)."""
    return {need.chunk: need.ranks[i % len(need.ranks)] for i, need in enumerate(needs)}
