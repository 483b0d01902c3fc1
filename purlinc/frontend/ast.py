"""The AST of a .pln file: what was written, with source spans, before any world size is known."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from purlinc.errors import Span, span_field


class BinaryOp(Enum):
    ADD = "+"
    SUB = "-"
    MUL = "*"
    DIV = "/"
    MOD = "%"


class Compare(Enum):
    EQ = "=="
    NE = "!="
    LT = "<"
    LE = "<="
    GT = ">"
    GE = ">="


@dataclass(frozen=True, slots=True)
class Number:
    value: int
    span: Span | None = span_field()

    def format(self) -> str:
        return str(self.value)


@dataclass(frozen=True, slots=True)
class Name:
    name: str
    span: Span | None = span_field()

    def format(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True)
class Negate:
    operand: "Expr"
    span: Span | None = span_field()

    def format(self) -> str:
        return f"-{self.operand.format()}"


@dataclass(frozen=True, slots=True)
class Binary:
    op: BinaryOp
    left: "Expr"
    right: "Expr"
    span: Span | None = span_field()

    def format(self) -> str:
        return f"({self.left.format()} {self.op.value} {self.right.format()})"


Expr = Number | Name | Negate | Binary


@dataclass(frozen=True, slots=True)
class Range:
    """``lo..hi``: the integers lo, lo+1, ..., hi-1 (half-open, never empty)."""

    lo: Expr
    hi: Expr
    span: Span | None = span_field()

    def format(self) -> str:
        return f"{self.lo.format()}..{self.hi.format()}"


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """``x[r][0..R]``: a chunk name with one index (expression or range) per dimension."""

    name: str
    indices: tuple[Expr | Range, ...]
    span: Span | None = span_field()

    def format(self) -> str:
        return self.name + "".join(f"[{index.format()}]" for index in self.indices)


@dataclass(frozen=True, slots=True)
class Loop:
    variable: str
    range: Range
    span: Span | None = span_field()


@dataclass(frozen=True, slots=True)
class Item:
    """One layout entry: a chunk reference followed by zero or more ``for v in lo..hi``.

    The first loop is the outermost, so ``x[i][j] for i in 0..2 for j in 0..3`` is row-major.
    """

    chunk: ChunkRef
    loops: tuple[Loop, ...]
    span: Span | None = span_field()


class Buffer(Enum):
    IN = "in"
    OUT = "out"


@dataclass(frozen=True, slots=True)
class Assignment:
    """``in[r] = ...`` (every rank, ``r`` bound to it) or ``out[root] = ...`` (one rank)."""

    buffer: Buffer
    rank: Expr
    layout: tuple[Item, ...]
    span: Span | None = span_field()

    @property
    def every_rank(self) -> bool:
        return isinstance(self.rank, Name) and self.rank.name == "r"


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    default: int | None
    span: Span | None = span_field()


@dataclass(frozen=True, slots=True)
class Condition:
    left: Expr
    compare: Compare
    right: Expr
    span: Span | None = span_field()

    def format(self) -> str:
        return f"{self.left.format()} {self.compare.value} {self.right.format()}"


class Operation(Enum):
    COPY = "copy"
    REDUCE = "reduce"


@dataclass(frozen=True, slots=True)
class CollectiveDef:
    name: str
    params: tuple[Param, ...]
    constraints: tuple[Condition, ...]
    assignments: tuple[Assignment, ...]
    operation: Operation
    replicated: bool
    span: Span | None = span_field()
    operation_span: Span | None = span_field()
