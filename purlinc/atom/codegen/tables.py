"""Structure, not enumeration: the code of blocks and ranks that differ only in numbers, once.

A rank's program is a list of blocks, each rendered to C text in which every number of the
schedule is marked (``exprs.num``).  With the marks taken out, a block's text is its
*shape*.  Two rewrites keep the effects and their order exactly:

- **Ranks by shape.** Ranks whose programs have the same shapes, block for block (every rank
  of a symmetric collective; the non-root ranks of a rooted one), share one body, one kernel
  entry: it reads every number that differs between ranks from row ``args.rank`` of its table.
- **Runs by shape.** Consecutive blocks of one shape become one loop over ``t`` that runs
  their code in turn, so a program's code grows with its number of shapes, not of steps.

A number that is the same wherever the code runs stays a literal (so a module with nothing to
share is the text it always was).  One that advances by a fixed stride from row to row
becomes ``(a + b * t)``, with ``a`` or ``b`` taken from the rank's row where ranks differ;
any other becomes a column of the rank's row indexed by ``t``.  The table is ``__constant__``
data of the module (read through the constant cache by every thread of a block at once),
filled at compile time; the host only passes the rank (``purlin_args.rank``).
"""

from __future__ import annotations

from dataclasses import dataclass

from purlinc.atom.codegen.exprs import MARK
from purlinc.errors import InternalError

HOLE = "\x02\x03"  # where a number was, in a shape
INT_MIN, INT_MAX = -(1 << 31), (1 << 31) - 1  # the kernel's table holds C ints (negative k included)


class Cell(int):
    """A number's place in the rank's table row: the code reads ``tab[cell]``."""

    def __str__(self) -> str:
        return f"tab[{int(self)}]"

    __repr__ = __str__


@dataclass(frozen=True, slots=True)
class Hole:
    """Where a number was: ``start + stride * t`` (each a literal, or a ``Cell`` of the rank's
    row), or, with ``column`` set, ``tab[column + t]``."""

    start: int = 0
    stride: int = 0
    column: int | None = None

    def expr(self) -> str:
        if self.column is not None:
            return f"tab[{self.column} + t]"
        a, b = str(self.start), str(self.stride)
        if b == "0":
            return a
        step = "t" if b == "1" else f"{b} * t"
        return step if a == "0" else f"({a} + {step})"

    def value(self, row: tuple[int, ...], t: int) -> int:
        """The number this hole gives for a rank whose table row is ``row``, in the loop's row ``t``."""
        if self.column is not None:
            return row[self.column + t]
        return _number(self.start, row) + _number(self.stride, row) * t


def _number(part: int, row: tuple[int, ...]) -> int:
    return row[part] if isinstance(part, Cell) else part


@dataclass(frozen=True, slots=True)
class Item:
    """One block, or a run of ``rows`` blocks of one shape run as a loop over ``t``; ``code`` is
    their shape with each hole's expression filled in."""

    comments: tuple[str, ...]
    shape: str
    holes: tuple[Hole, ...]
    rows: int
    first: dict  # the first block, as the first rank of the body had it (its kind, its batches)

    @property
    def code(self) -> str:
        parts = self.shape.split(HOLE)
        return (parts[0] + "".join(hole.expr() + part for hole, part in zip(self.holes, parts[1:]))).rstrip("\n")

    def expand(self, row: tuple[int, ...]) -> list[str]:
        """The text of each of the item's blocks for the rank whose table row is ``row``."""
        parts = self.shape.split(HOLE)
        return [parts[0] + "".join(str(hole.value(row, t)) + part for hole, part in zip(self.holes, parts[1:]))
                for t in range(self.rows)]


@dataclass(frozen=True, slots=True)
class Body:
    """The code that one or more ranks run, and each rank's row of numbers."""

    index: int
    ranks: tuple[int, ...]
    steps: int  # SNAC steps of the first rank's program
    items: tuple[Item, ...]
    rows: tuple[tuple[int, ...], ...]  # per rank of ``ranks``: its numbers (all rows the same length)

    @property
    def width(self) -> int:
        return len(self.rows[0]) if self.rows else 0

    def table(self, world_size: int) -> list[tuple[int, ...]]:
        """The body's table as the kernel holds it (``int``), a row per rank (empty: a rank of
        another body)."""
        for row in self.rows:
            for value in row:
                if not INT_MIN <= value <= INT_MAX:
                    raise InternalError(f"body {self.index}: the number {value} does not fit the table's int")
        rows = dict(zip(self.ranks, self.rows))
        return [rows.get(rank, ()) for rank in range(world_size)]


def shape(text: str) -> tuple[str, tuple[int, ...]]:
    """A marked text as its shape and its numbers, in order."""
    return MARK.sub(HOLE, text), tuple(int(v) for v in MARK.findall(text))


def _cell(values: list[int], row: list[list[int]]) -> int:
    """One number per rank: a literal when they agree, else a new cell of every rank's row."""
    if len(set(values)) == 1:
        return values[0]
    for cells, value in zip(row, values):
        cells.append(value)
    return Cell(len(row[0]) - 1)


def _hole(column: list[list[int]], row: list[list[int]]) -> Hole:
    """The hole of one number: ``column[c][t]`` for rank c of the body, row t of the item."""
    starts = [values[0] for values in column]
    strides = [values[1] - values[0] if len(values) > 1 else 0 for values in column]
    if all(v == a + b * t for values, a, b in zip(column, starts, strides) for t, v in enumerate(values)):
        return Hole(start=_cell(starts, row), stride=_cell(strides, row))
    offset = len(row[0])
    for cells, values in zip(row, column):
        cells.extend(values)
    return Hole(column=offset)


def _item(texts: list[list[str]], comments: tuple[str, ...], first: dict, row: list[list[int]]) -> Item:
    """``texts[c][t]``: rank c's text of the item's row t (one shape)."""
    code, _ = shape(texts[0][0])
    numbers = [[shape(text)[1] for text in rank_texts] for rank_texts in texts]
    holes = tuple(_hole([[values[h] for values in rank_numbers] for rank_numbers in numbers], row)
                  for h in range(code.count(HOLE)))
    return Item(comments=comments, shape=code, holes=holes, rows=len(texts[0]), first=first)


def _classes(shapes: list[tuple[str, ...]], share: bool) -> list[tuple[int, ...]]:
    """Ranks grouped by their programs' shapes (first rank's order), or one rank per group."""
    if not share:
        return [(rank,) for rank in range(len(shapes))]
    groups: dict[tuple[str, ...], list[int]] = {}
    for rank, program in enumerate(shapes):
        groups.setdefault(program, []).append(rank)
    return [tuple(ranks) for ranks in groups.values()]


def bodies(programs: list[list[tuple[dict, str]]], steps: list[int], *, share: bool, roll: bool) -> tuple[Body, ...]:
    """Every rank's program (a list of (block, marked text)) as bodies; see the module's text.

    ``share``: ranks of one shape share a body; ``roll``: runs of one shape become loops."""
    shapes = [tuple(shape(text)[0] for _, text in program) for program in programs]
    out = []
    for index, ranks in enumerate(_classes(shapes, share)):
        lead, blocks = shapes[ranks[0]], programs[ranks[0]]
        row: list[list[int]] = [[] for _ in ranks]
        items, j = [], 0
        while j < len(lead):
            end = j + 1
            while roll and end < len(lead) and lead[end] == lead[j]:
                end += 1
            texts = [[programs[r][k][1] for k in range(j, end)] for r in ranks]
            comments = tuple(c for block, _ in blocks[j:end] for c in block["comments"])
            items.append(_item(texts, comments, blocks[j][0], row))
            j = end
        out.append(Body(index=index, ranks=ranks, steps=steps[ranks[0]], items=tuple(items), rows=tuple(tuple(cells) for cells in row)))
    return tuple(out)
