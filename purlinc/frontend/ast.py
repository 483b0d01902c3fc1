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


# Binding strength for printing with the fewest parentheses that keep the meaning.
_PRECEDENCE = {BinaryOp.ADD: 1, BinaryOp.SUB: 1, BinaryOp.MUL: 2, BinaryOp.DIV: 2, BinaryOp.MOD: 2}
_UNARY_PRECEDENCE = 3
_ATOM_PRECEDENCE = 4


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

    precedence = _ATOM_PRECEDENCE

    def format(self) -> str:
        return str(self.value)


@dataclass(frozen=True, slots=True)
class Name:
    name: str
    span: Span | None = span_field()

    precedence = _ATOM_PRECEDENCE

    def format(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True)
class Negate:
    operand: "Expr"
    span: Span | None = span_field()

    precedence = _UNARY_PRECEDENCE

    def format(self) -> str:
        return format_expr(self)


@dataclass(frozen=True, slots=True)
class Binary:
    op: BinaryOp
    left: "Expr"
    right: "Expr"
    span: Span | None = span_field()

    @property
    def precedence(self) -> int:
        return _PRECEDENCE[self.op]

    def format(self) -> str:
        return format_expr(self)


Expr = Number | Name | Negate | Binary


def format_expr(expr: "Expr | FExpr") -> str:
    """``expr`` (an index or an epilogue expression) printed with the fewest parentheses that
    keep its meaning.

    Iterative, not recursive: a sum of 10,000 terms is 10,000 levels deep (the checkers refuse
    such epilogues, but ``purlinc dump --stage ast`` prints what was written).  Left-associative
    operators: the right operand needs parentheses at equal precedence, so a - (b - c) and
    a * (b % c) survive a round trip.
    """
    texts: list[str] = []
    stack: list[tuple[object, bool]] = [(expr, False)]
    while stack:
        node, ready = stack.pop()
        if isinstance(node, (Number, Name, FNumber, FName)):
            texts.append(node.format())
        elif not ready:
            stack.append((node, True))
            stack.extend((child, False) for child in reversed(_operands(node)))
        else:
            count = len(_operands(node))
            parts = texts[len(texts) - count:]
            del texts[len(texts) - count:]
            texts.append(_join(node, parts))
    return texts[0]


def _operands(node) -> tuple:
    if isinstance(node, (Negate, FNeg)):
        return (node.operand,)
    if isinstance(node, (Binary, FBinary)):
        return (node.left, node.right)
    return node.args  # FCall


def _join(node, parts: list[str]) -> str:
    """``node`` printed from its operands' texts."""
    if isinstance(node, (Negate, FNeg)):
        return "-" + _wrap(parts[0], node.operand, _UNARY_PRECEDENCE)
    if isinstance(node, (Binary, FBinary)):
        left = _wrap(parts[0], node.left, node.precedence)
        right = _wrap(parts[1], node.right, node.precedence + 1)
        return f"{left} {node.op.value} {right}"
    return f"{node.function}({', '.join(parts)})"


def _wrap(text: str, expr: "Expr", precedence: int) -> str:
    """``expr``'s ``text``, parenthesized if it binds less tightly than ``precedence``."""
    return f"({text})" if expr.precedence < precedence else text


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

    def format(self) -> str:
        return f"for {self.variable} in {self.range.format()}"


@dataclass(frozen=True, slots=True)
class Item:
    """One layout entry: a chunk reference followed by zero or more ``for v in lo..hi``.

    The first loop is the outermost, so ``x[i][j] for i in 0..2 for j in 0..3`` is row-major.
    """

    chunk: ChunkRef
    loops: tuple[Loop, ...]
    span: Span | None = span_field()

    def format(self) -> str:
        return " ".join((self.chunk.format(), *(loop.format() for loop in self.loops)))


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

    def format(self) -> str:
        layout = ", ".join(item.format() for item in self.layout)
        return f"{self.buffer.value}[{self.rank.format()}] = {layout}"


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    default: int | None
    span: Span | None = span_field()

    def format(self) -> str:
        return self.name if self.default is None else f"{self.name} = {self.default}"


@dataclass(frozen=True, slots=True)
class Condition:
    left: Expr
    compare: Compare
    right: Expr
    span: Span | None = span_field()

    def format(self) -> str:
        return f"{self.left.format()} {self.compare.value} {self.right.format()}"


@dataclass(frozen=True, slots=True)
class SizesOperand:
    """``sizes n[E1][E2] of x``: chunk ``x[i][j]`` has ``n[i][j]`` elements, given per call
    on the device (docs/LANGUAGE.md, "Run-time sizes")."""

    name: str
    extents: tuple[Expr, ...]
    chunk: str
    span: Span | None = span_field()

    def format(self) -> str:
        extents = "".join(f"[{extent.format()}]" for extent in self.extents)
        return f"sizes {self.name}{extents} of {self.chunk}"




class Operation(Enum):
    COPY = "copy"
    REDUCE = "reduce"


# --- epilogues (docs/LANGUAGE.md, "Epilogues") -------------------------------------------------


class OperandKind(Enum):
    """What an epilogue operand is: a tensor shaped like the output, one row, or a number."""

    ROWS = "rows"
    ROW = "row"
    SCALAR = "scalar"


@dataclass(frozen=True, slots=True)
class OperandDecl:
    """``rows residual`` / ``row weight`` / ``scalar eps`` / ``rows q: float8_e4m3`` in ``with``."""

    kind: OperandKind
    name: str
    dtype: str | None = None  # rows only: the operand's dtype when it is not the call's
    span: Span | None = span_field()
    dtype_span: Span | None = span_field()

    def format(self) -> str:
        return f"{self.kind.value} {self.name}" + (f": {self.dtype}" if self.dtype else "")


class FloatOp(Enum):
    ADD = "+"
    SUB = "-"
    MUL = "*"
    DIV = "/"


_FLOAT_PRECEDENCE = {FloatOp.ADD: 1, FloatOp.SUB: 1, FloatOp.MUL: 2, FloatOp.DIV: 2}


@dataclass(frozen=True, slots=True)
class FNumber:
    value: float
    text: str  # as written (printed back unchanged)
    span: Span | None = span_field()

    precedence = _ATOM_PRECEDENCE

    def format(self) -> str:
        return self.text


@dataclass(frozen=True, slots=True)
class FName:
    """``out``, an operand or a local."""

    name: str
    span: Span | None = span_field()

    precedence = _ATOM_PRECEDENCE

    def format(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True)
class FNeg:
    operand: "FExpr"
    span: Span | None = span_field()

    precedence = _UNARY_PRECEDENCE

    def format(self) -> str:
        return format_expr(self)


@dataclass(frozen=True, slots=True)
class FBinary:
    op: FloatOp
    left: "FExpr"
    right: "FExpr"
    span: Span | None = span_field()

    @property
    def precedence(self) -> int:
        return _FLOAT_PRECEDENCE[self.op]

    def format(self) -> str:
        return format_expr(self)


@dataclass(frozen=True, slots=True)
class FCall:
    """``rmsnorm(h, weight, eps)``: the functions are listed in purlinc.frontend.epilogue."""

    function: str
    args: tuple["FExpr", ...]
    span: Span | None = span_field()

    precedence = _ATOM_PRECEDENCE

    def format(self) -> str:
        return format_expr(self)


FExpr = FNumber | FName | FNeg | FBinary | FCall


@dataclass(frozen=True, slots=True)
class EpilogueAssign:
    target: str  # "out", a rows operand, or a new local
    value: FExpr
    span: Span | None = span_field()
    target_span: Span | None = span_field()

    def format(self) -> str:
        return f"{self.target} = {self.value.format()}"


@dataclass(frozen=True, slots=True)
class EpilogueDef:
    """``epilogue rows(E) { ... }``: what every rank does to each row of its reduced output."""

    row: Expr  # elements per row
    statements: tuple[EpilogueAssign, ...]
    span: Span | None = span_field()
    keyword_span: Span | None = span_field()  # the word 'epilogue', for errors about the whole block

    def format_lines(self) -> list[str]:
        return [f"    epilogue rows({self.row.format()}) {{",
                *(f"        {statement.format()}" for statement in self.statements), "    }"]


Operand = SizesOperand | OperandDecl  # what a `with` clause declares


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
    # Per-call operands (``with ...``), in the order written: run-time sizes and epilogue operands.
    operands: tuple[Operand, ...] = ()
    epilogue: EpilogueDef | None = None

    @property
    def sizes(self) -> SizesOperand | None:
        """The run-time sizes operand, if the collective has one."""
        return next((o for o in self.operands if isinstance(o, SizesOperand)), None)

    def format(self) -> str:
        """The collective re-printed canonically: parsing this text gives an equal AST."""
        header = f"collective {self.name}"
        if self.params:
            header += "(" + ", ".join(param.format() for param in self.params) + ")"
        if self.operands:
            header += " with " + ", ".join(operand.format() for operand in self.operands)
        if self.constraints:
            header += " where " + ", ".join(condition.format() for condition in self.constraints)
        lines = [header + " {"]
        lines.extend(f"    {assignment.format()}" for assignment in self.assignments)
        lines.append(f"    {self.operation.value}{' replicated' if self.replicated else ''}")
        if self.epilogue is not None:
            lines.extend(self.epilogue.format_lines())
        lines.append("}")
        return "\n".join(lines) + "\n"
