"""The hierarchical plan IR: a collective over ``nodes x G`` ranks as an ordered list of phases.

Purlin's kernels need peer-mapped memory, so a SNAC ``Schedule`` ends at the edge of one
NVLink domain (a *node* here).  A ``HierPlan`` keeps SNAC inside each node and hands the
traffic between nodes to NCCL (see docs/HIERARCHY.md):

- ``IntraPhase``: one SNAC sub-collective per node, a ``Spec`` over the node's G ranks
  (local rank ``l`` is global rank ``node * G + l``), lowered by the ordinary lowerings and
  proved by the ordinary verifier.  Nodes whose sub-specs have the same shape (the same
  spec up to the chunks' names) share one ``Schedule``.
- ``InterPhase``: an opaque NCCL step with explicit semantics: a list of ``Move``s, each
  "unit ``dst`` of buffer ``dst`` := unit ``srcs[0]`` (copy) or the reduction of
  ``srcs`` in that order (reduce)", every unit in a move on ranks of one local index (one
  NCCL sub-group per local index, the ranks ``l, G + l, 2G + l, ...``).  A move whose source
  and destination are on the same rank is a local copy (no network).

Phases read one named buffer and write another (``Layout``: per rank, the chunk names its
units hold): ``in`` and ``out`` are the caller's buffers, the others are scratch buffers the
runtime allocates.  Phases run one after the other on the caller's stream, so a phase sees
everything the previous one wrote; every intra phase has its own staging buffer and
signals, so each schedule's own two-call proof covers it across calls.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from purlinc.errors import PurlinError
from purlinc.frontend.ast import Operation
from purlinc.frontend.spec import Chunk, Spec
from purlinc.snac.ir import Schedule

IN, OUT = "in", "out"


class TopologyError(PurlinError):
    """Ranks that cannot be grouped into nodes as asked."""


@dataclass(frozen=True, slots=True)
class Topology:
    """``nodes`` nodes of ``gpus_per_node`` ranks each; rank ``r`` = ``node * G + local``."""

    nodes: int
    gpus_per_node: int

    @classmethod
    def of(cls, world_size: int, gpus_per_node: int) -> "Topology":
        if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, numbers.Integral) or gpus_per_node < 1:
            raise TopologyError(f"gpus_per_node must be an integer >= 1, got {gpus_per_node!r}")
        gpus_per_node = int(gpus_per_node)
        if world_size < 1 or world_size % gpus_per_node:
            raise TopologyError(
                f"world size R={world_size} is not a multiple of gpus_per_node={gpus_per_node}",
                notes=("ranks are grouped into nodes of gpus_per_node ranks each: R = nodes x gpus_per_node",),
            )
        return cls(world_size // gpus_per_node, gpus_per_node)

    def format(self) -> str:
        """``2 nodes x 4 GPUs`` (``1 node x 1 GPU``): as the dumps and messages name it."""
        return f"{plural(self.nodes, 'node')} x {plural(self.gpus_per_node, 'GPU')}"

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def local_of(self, rank: int) -> int:
        return rank % self.gpus_per_node

    def rank(self, node: int, local: int) -> int:
        return node * self.gpus_per_node + local

    def node_ranks(self, node: int) -> range:
        return range(node * self.gpus_per_node, (node + 1) * self.gpus_per_node)

    def group(self, local: int) -> range:
        """The ranks with local index ``local``: one NCCL sub-group."""
        return range(local, self.world_size, self.gpus_per_node)


@dataclass(frozen=True, slots=True)
class Layout:
    """A named buffer: ``units[rank]`` are the chunk names its units hold on each rank."""

    name: str
    units: tuple[tuple[Chunk, ...], ...]


@dataclass(frozen=True, slots=True, order=True)
class Unit:
    rank: int
    unit: int

    def format(self, buffer: str) -> str:
        return f"r{self.rank}.{buffer}[{self.unit}]"


@dataclass(frozen=True, slots=True)
class Move:
    """``dst := srcs[0]`` (copy) or ``dst := srcs[0] (+) srcs[1] (+) ...`` (reduce, in order)."""

    dst: Unit
    srcs: tuple[Unit, ...]
    chunk: Chunk  # what it carries (for dumps)


@dataclass(frozen=True, slots=True)
class IntraPhase:
    src: str
    dst: str
    operation: Operation
    specs: tuple[Spec, ...]  # per node, over its G local ranks, with the real chunk names
    schedules: tuple[int, ...]  # per node: index into HierPlan.schedules


@dataclass(frozen=True, slots=True)
class InterPhase:
    src: str
    dst: str
    operation: Operation
    moves: tuple[Move, ...]
    # The NCCL operation the moves amount to on every sub-group (descriptive; the moves are
    # the semantics): all_reduce, reduce_scatter, reduce, broadcast, all_gather, gather, scatter, send_recv
    # (batch_isend_irecv) or local (no network: copies within a rank).
    nccl: str


Phase = IntraPhase | InterPhase


@dataclass(frozen=True, slots=True)
class HierPlan:
    spec: Spec  # the whole collective, over R = nodes x G ranks
    topology: Topology
    layouts: tuple[Layout, ...]  # every buffer, ``in`` and ``out`` included
    phases: tuple[Phase, ...]
    # Distinct intra-node schedules and the canonical sub-spec each was lowered and proved for
    # (chunks renamed c[0], c[1], ... in order of appearance; slots are what the proof sees).
    schedules: tuple[Schedule, ...]
    canonical: tuple[Spec, ...]

    def layout(self, name: str) -> Layout:
        for layout in self.layouts:
            if layout.name == name:
                return layout
        raise KeyError(name)


def _chunks(chunks: tuple[Chunk, ...], limit: int = 8) -> str:
    text = " ".join(map(str, chunks[:limit]))
    return text + (f" ... ({len(chunks)} units)" if len(chunks) > limit else "") if chunks else "(empty)"


def plural(n: int, word: str) -> str:
    """``1 node``, ``2 nodes``."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def format_plan(plan: HierPlan, *, max_moves: int = 64) -> str:
    """A human-readable dump: buffers, then phases (intra: per-node schedule; inter: NCCL moves)."""
    t = plan.topology
    lines = [
        f"hierarchical {plan.spec.name} (R={t.world_size} = {t.format()}, {plan.spec.operation.value}): "
        f"{plural(len(plan.phases), 'phase')}, {plural(len(plan.schedules), 'distinct intra-node schedule')}",
        "buffers:",
    ]
    for layout in plan.layouts:
        sizes = sorted({len(u) for u in layout.units})
        units = "unit" if set(sizes) == {1} else "units"
        lines.append(f"  {layout.name}: {'/'.join(map(str, sizes))} {units} per rank")
    for index, phase in enumerate(plan.phases):
        if isinstance(phase, IntraPhase):
            lines.append(f"phase {index}: intra-node SNAC {phase.operation.value} {phase.src} -> {phase.dst}")
            for node, (spec, which) in enumerate(zip(phase.specs, phase.schedules)):
                schedule = plan.schedules[which]
                steps = sum(len(p.steps) for p in schedule.programs)
                lines.append(f"  node {node}: schedule #{which} ({schedule.options.key()}, {plural(steps, 'step')})")
                for local in range(t.gpus_per_node):
                    rank = t.rank(node, local)
                    lines.append(f"    r{rank} (local {local}): {_chunks(spec.inputs[local])} -> {_chunks(spec.outputs[local])}")
        else:
            remote = sum(1 for m in phase.moves if any(s.rank != m.dst.rank for s in m.srcs))
            lines.append(
                f"phase {index}: inter-node NCCL {phase.nccl} ({phase.operation.value}) {phase.src} -> {phase.dst}: "
                f"{plural(len(phase.moves), 'move')}, {remote} over the network, sub-groups by local index"
            )
            for move in phase.moves[:max_moves]:
                how = " + ".join(s.format(phase.src) for s in move.srcs)
                # a move whose sources are all on its rank is a local copy, not NCCL's
                by = "NCCL" if any(s.rank != move.dst.rank for s in move.srcs) else "local"
                lines.append(f"  {by} {move.dst.format(phase.dst)} = {how}  ({move.chunk})")
            if len(phase.moves) > max_moves:
                lines.append(f"  ... {plural(len(phase.moves) - max_moves, 'more move')}")
    return "\n".join(lines) + "\n"
