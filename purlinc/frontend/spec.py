"""The resolved spec: for one world size, every rank's input and output layout and, for each
output chunk, the input slots it is made from.  Pure data; the SNAC layer's only input."""

from __future__ import annotations

from dataclasses import dataclass, field

from purlinc.frontend.ast import Operation
from purlinc.errors import Span, span_field
from purlinc.frontend.epilogue import Epilogue


@dataclass(frozen=True, slots=True, order=True)
class Chunk:
    """A chunk name with concrete indices, e.g. ``x[2][0]``."""

    name: str
    index: tuple[int, ...] = ()

    def __str__(self) -> str:
        return self.name + "".join(f"[{i}]" for i in self.index)


@dataclass(frozen=True, slots=True, order=True)
class Slot:
    """Position ``position`` (in chunks) of rank ``rank``'s input buffer."""

    rank: int
    position: int

    def __str__(self) -> str:
        return f"r{self.rank}.in[{self.position}]"


@dataclass(frozen=True, slots=True)
class Sizes:
    """Run-time sizes: chunk ``chunk[i][j]...`` has ``operand[i][j]...`` elements in a call,
    each in ``0..capacity`` (the capacity comes at load).  Buffers are packed: a chunk starts
    at the sum of the sizes of the chunks before it in its buffer (docs/LANGUAGE.md)."""

    operand: str
    chunk: str
    extents: tuple[int, ...]
    span: Span | None = span_field()  # the 'with sizes' operand (where a refusal points)

    def format(self) -> str:
        return f"sizes {self.operand}{''.join(f'[{e}]' for e in self.extents)} of {self.chunk}"

    def size_name(self, chunk: Chunk) -> str:
        """The operand entry that gives ``chunk``'s size, e.g. ``n[2][0]``."""
        return self.operand + "".join(f"[{i}]" for i in chunk.index)


@dataclass(frozen=True, slots=True)
class Spec:
    name: str
    world_size: int
    params: tuple[tuple[str, int], ...]
    operation: Operation
    # copy only: producers of one chunk hold identical data, any may serve.
    replicated: bool
    inputs: tuple[tuple[Chunk, ...], ...]
    outputs: tuple[tuple[Chunk, ...], ...]
    # sources[rank][position]: the input slots output chunk ``outputs[rank][position]`` is
    # made from.  copy: one slot (several only when replicated); reduce: every occurrence,
    # in (rank, position) order, which is also the order a bitwise-exact reduction adds them.
    sources: tuple[tuple[tuple[Slot, ...], ...], ...]
    # The .pln spans each layout entry came from (for diagnostics and generated comments).
    input_spans: tuple[tuple[Span | None, ...], ...] = field(default=(), compare=False, repr=False)
    output_spans: tuple[tuple[Span | None, ...], ...] = field(default=(), compare=False, repr=False)
    # Run-time chunk sizes (``with sizes ...``), or None: every chunk is the call's count.
    sizes: Sizes | None = None
    # Work on each row of the reduced output (docs/LANGUAGE.md, "Epilogues"); None: none.
    epilogue: Epilogue | None = None

    @property
    def is_reduce(self) -> bool:
        return self.operation is Operation.REDUCE

    @property
    def reads(self) -> int:
        """Producer slots over every rank's output chunks: the chunk reads a schedule of this
        spec makes (per slice), and the lines ``format`` lists."""
        return sum(len(slots) for outputs in self.sources for slots in outputs)

    @property
    def most_sources(self) -> int:
        """The most producer slots of one output chunk: what a one-shot consume of it reads."""
        return max((len(slots) for outputs in self.sources for slots in outputs), default=0)

    def output_line(self, rank: int, position: int) -> int | None:
        """The .pln line an output chunk was named on, if known."""
        if rank < len(self.output_spans) and position < len(self.output_spans[rank]):
            span = self.output_spans[rank][position]
            return span.line if span is not None else None
        return None

    def format(self) -> str:
        params = "".join(f", {k}={v}" for k, v in self.params)
        header = f"collective {self.name} (R={self.world_size}{params}, {self.operation.value}"
        header += " replicated)" if self.replicated else ")"
        lines = [header]
        if self.sizes is not None:
            lines.append(f"{self.sizes.format()} (run-time, packed)")
        for rank in range(self.world_size):
            lines.append(f"rank {rank}:")
            lines.append("  in:  " + (" ".join(map(str, self.inputs[rank])) or "(empty)"))
            lines.append("  out: " + (" ".join(map(str, self.outputs[rank])) or "(empty)"))
            for position, chunk in enumerate(self.outputs[rank]):
                slots = " ".join(map(str, self.sources[rank][position]))
                how = f"{self.operation.value}({slots})" if self.is_reduce else slots
                lines.append(f"  out[{position}] = {chunk} <- {how}")
        if self.epilogue is not None:
            lines.append(self.epilogue.format().rstrip("\n"))
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict:
        return {
            "collective": self.name,
            "world_size": self.world_size,
            "params": dict(self.params),
            "operation": self.operation.value,
            "replicated": self.replicated,
            **({"sizes": {"operand": self.sizes.operand, "chunk": self.sizes.chunk,
                          "extents": list(self.sizes.extents)}} if self.sizes is not None else {}),
            "ranks": [
                {
                    "rank": rank,
                    "in": [str(c) for c in self.inputs[rank]],
                    "out": [str(c) for c in self.outputs[rank]],
                    "sources": [
                        [{"rank": s.rank, "position": s.position} for s in slots]
                        for slots in self.sources[rank]
                    ],
                }
                for rank in range(self.world_size)
            ],
            **({"epilogue": self.epilogue.to_json()} if self.epilogue is not None else {}),
        }
