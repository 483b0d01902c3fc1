"""Check: AST + world size R + parameter values -> resolved ``Spec``, or a ``PurlinError``.

Every way a spec can be ill-formed for some R is reported here, pointing at the source:
unknown names, unbound parameters, rank indices outside 0..R-1, empty or negative ranges,
chunk names used with different numbers of indices, output chunks with no producer, and
conflicting producers under ``copy``.  ``check_all`` runs the check for a range of world
sizes so a spec that only breaks at some R says which.
"""

from __future__ import annotations

import itertools
import keyword
import operator
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Iterator

from purlinc.errors import PurlinError, Span
from purlinc.frontend import ast
from purlinc.frontend.epilogue import FUNCTIONS, Epilogue, check_epilogue, check_name
from purlinc.frontend.spec import Chunk, Sizes, Slot, Spec

RANK_VARIABLE = "r"
WORLD_VARIABLE = "R"
DEFAULT_WORLD_SIZES = range(1, 65)

# Bounds that keep the checker's work and memory small for any input.  Chunks are counted
# (arithmetic on range lengths) before any is made, so x[0..1000000000000] is refused at once.
MAX_WORLD_SIZE = 1 << 16
MAX_CHUNKS = 1 << 19  # chunks named by all layouts of one world size together (~100 MB at most)
# Work for one check or one check_all (all its world sizes together): a chunk costs
# _CHUNK_COST units, an expression step one.  About 10 s of the slowest machine here.
WORK_LIMIT = 1 << 23
_ITEM_COST = 8  # a chunk reference evaluated (arity, bookkeeping), and one more per index
_CHUNK_COST = 2  # each chunk it names


class _SpecWideError(PurlinError):
    """An error about the spec as a whole (its work, a name), not about the values an
    expression took: no rank or loop values are noted for it (``_at_bindings``)."""


class Meter:
    """The work left to a check (shared by every world size of a check_all)."""

    def __init__(self, limit: int = WORK_LIMIT):
        self.left = limit
        self.limit = limit

    def charge(self, units: int, span: Span | None) -> None:
        self.left -= units
        if self.left < 0:
            raise _SpecWideError(
                f"this spec takes too much work to check: more than {self.limit:,} steps "
                f"(expression steps, {_ITEM_COST} per chunk reference evaluated and one per index, {_CHUNK_COST} per "
                "chunk named)",
                span,
                ("check fewer world sizes (purlinc check --ranks LO..HI), or write shorter layouts and expressions",),
            )
MAX_VALUE = 2**63 - 1  # index arithmetic beyond this is refused, not computed
# The Python call passes operands by name (``coll(x, out, residual=h)``, ``coll(x, n=sizes)``),
# beside its own arguments: an operand named like one of these could not be passed.
# tests/test_operand_names.py holds every runtime call's signature to this list.
CALL_KEYWORDS = ("x", "xs", "out", "outs", "op", "stream", "streams", "count", "dtype", "sizes", "out_sizes",
                 "expected_sizes", "row", "self")
_SHOWN = 60  # characters of an expression quoted in a message


class _Scope:
    """Names visible to an expression, with a word for each for error messages."""

    def __init__(self, values: dict[str, int], kinds: dict[str, str], meter: "Meter | None" = None):
        self.values = values
        self.kinds = kinds
        self.meter = meter

    def bind(self, name: str, value: int, kind: str) -> "_Scope":
        return _Scope({**self.values, name: value}, {**self.kinds, name: kind}, self.meter)


def _short(expr) -> str:
    """An expression as written, cut short for a message (a generated one can be 200 KB).
    Taken from the source where the span allows: formatting a deep tree costs more."""
    span = getattr(expr, "span", None)
    if span is not None and span.end_line == span.line:
        text = span.source.line(span.line)[span.column - 1 : min(span.end_column - 1, span.column - 1 + _SHOWN)]
        if span.end_column - span.column > _SHOWN:
            text = text[: _SHOWN - 3] + "..."
    else:
        text = expr.format()
    text = " ".join(text.split())
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _number(value: int) -> str:
    """An integer for a message: in full up to 24 digits, else its ends and how many digits (a
    parameter given as 10**400 is no number to print in full, twice)."""
    text = str(value)
    digits = len(text.lstrip("-"))
    return text if digits <= 24 else f"{text[:-digits + 6]}...{text[-6:]} ({digits} digits)"


class _NameError(_SpecWideError):
    """A name with no value where it is used: wrong at every rank and loop value alike."""


def _lookup(expr: ast.Name, scope: _Scope) -> int:
    if expr.name in scope.values:
        return scope.values[expr.name]
    if expr.name == RANK_VARIABLE:
        raise _NameError(
            "'r' (the rank) is only defined on the right-hand side of a statement for every rank, "
            "such as 'out[r] = ...'",
            expr.span,
        )
    known = ", ".join(f"{name} ({scope.kinds[name]})" for name in sorted(scope.values))
    raise _NameError(f"unknown name '{expr.name}'", expr.span, (f"names defined here: {known}",))


def _apply(expr: ast.Binary, left: int, right: int) -> int:
    if expr.op is ast.BinaryOp.ADD:
        value = left + right
    elif expr.op is ast.BinaryOp.SUB:
        value = left - right
    elif expr.op is ast.BinaryOp.MUL:
        value = left * right
    elif right == 0:
        raise PurlinError(f"division by zero in '{_short(expr)}'", expr.span)
    else:
        # Floor semantics (Python's): (-1) % R == R - 1, which is what a ring wants.
        value = left // right if expr.op is ast.BinaryOp.DIV else left % right
    if not -MAX_VALUE <= value <= MAX_VALUE:
        # Bounded integers keep every later step cheap (R*R*...*R would grow without end).
        raise PurlinError(f"'{_short(expr)}' is out of range: its value exceeds {MAX_VALUE} in magnitude", expr.span)
    return value


_CONST, _NAME, _NEG, _BINARY = range(4)
_PROGRAMS: dict[int, tuple[ast.Expr, tuple]] = {}


def _program(expr: ast.Expr) -> tuple:
    """``expr`` as a postfix program, built once per expression (cached by identity).

    Iterative, so an expression's depth is bounded by the size of the file, not by Python's
    stack; operands are evaluated left first.  Names are looked up at run time; pairs of
    negations cancel (500 nested minuses cost nothing per rank).
    """
    entry = _PROGRAMS.get(id(expr))
    if entry is not None and entry[0] is expr:
        return entry[1]
    program: list[tuple[int, object]] = []
    stack: list[tuple[ast.Expr, bool]] = [(expr, False)]
    while stack:
        node, ready = stack.pop()
        if isinstance(node, ast.Number):
            program.append((_CONST, node.value))
        elif isinstance(node, ast.Name):
            program.append((_NAME, node))
        elif not ready:
            stack.append((node, True))
            if isinstance(node, ast.Negate):
                stack.append((node.operand, False))
            else:
                stack.append((node.right, False))
                stack.append((node.left, False))
        elif isinstance(node, ast.Negate):
            if program and program[-1][0] == _NEG:
                program.pop()
            elif program and program[-1][0] == _CONST:
                program[-1] = (_CONST, -program[-1][1])
            else:
                program.append((_NEG, node))
        else:
            program.append((_BINARY, node))
    if len(_PROGRAMS) > 4096:
        _PROGRAMS.clear()
    _PROGRAMS[id(expr)] = (expr, tuple(program))
    return _PROGRAMS[id(expr)][1]


def _evaluate(expr: ast.Expr, scope: _Scope) -> int:
    """The expression's value in ``scope``, or a ``PurlinError`` at the offending part."""
    if isinstance(expr, ast.Number):
        return expr.value
    if isinstance(expr, ast.Name):
        return scope.values[expr.name] if expr.name in scope.values else _lookup(expr, scope)
    values: list[int] = []
    names = scope.values
    program = _program(expr)
    if scope.meter is not None:
        scope.meter.charge(len(program), expr.span)
    for kind, arg in program:
        if kind == _CONST:
            values.append(arg)
        elif kind == _NAME:
            values.append(names[arg.name] if arg.name in names else _lookup(arg, scope))
        elif kind == _NEG:
            values[-1] = -values[-1]
        else:
            right = values.pop()
            values[-1] = _apply(arg, values[-1], right)
    return values[0]


def _evaluate_range(rng: ast.Range, scope: _Scope, variable: str | None = None) -> range:
    """The range's values in ``scope``; ``variable``: the loop variable it binds, if a loop's."""
    lo = _evaluate(rng.lo, scope)
    hi = _evaluate(rng.hi, scope)
    if lo < 0 and variable is not None:
        raise PurlinError(f"loop range {_short(rng)} starts at {lo}: a loop range starts at 0 or above", rng.span,
                          _shifted_loop(rng, variable, lo, hi))
    if lo < 0:
        raise PurlinError(f"range {_short(rng)} starts at {lo}, below 0 (chunk indices start at 0)", rng.span)
    if hi <= lo:
        values = "" if _short(rng) == f"{lo}..{hi}" else f" ({lo}..{hi})"  # its values, where names hide them
        raise PurlinError(f"range {_short(rng)} is empty{values}", rng.span)
    return range(lo, hi)  # a range object holds two ints, whatever its length


def _shifted_loop(rng: ast.Range, variable: str, lo: int, hi: int) -> tuple[str, ...]:
    """How to write a loop from ``lo`` < 0 (empty where the range is empty too): from 0, with
    the uses shifted; '%' is floor modulo, so a rank index below 0 still wraps.  In numbers
    only where the ends are numbers: 'for j in i-1..i' at i=0 is not 'for j in 0..1' with
    'j - 1' at any other i, nor '-R..0' at R=3 'for v in 0..3' at any other R."""
    if hi <= lo:
        return ()
    if _names_in((rng,)):
        if isinstance(rng.lo, ast.Negate):  # -R..0: 'for v in 0..R' with 'v - R', not '0 - (-R)', 'v + (-R)'
            below = _operand(rng.lo.operand)
            length = below if rng.hi == ast.Number(0) else f"{_operand(rng.hi)} + {below}"
            shift = f"{variable} - {below}"
        else:
            length, shift = f"{_operand(rng.hi)} - {_operand(rng.lo)}", f"{variable} + {_operand(rng.lo)}"
        return (f"count from 0 and shift the uses: 'for {variable} in 0..{length}' with '{shift}' in place of "
                f"'{variable}' ('%' wraps below 0)",)
    shift = f"{variable} - {-lo}"
    return (f"count from 0 and shift the uses: 'for {variable} in 0..{hi - lo}' with '{shift}' in place of "
            f"'{variable}' ('%' wraps below 0: (r + {shift}) % R)",)


def _operand(expr: ast.Expr) -> str:
    """``expr`` as written, in parentheses unless it is a name or a number (an operand of '-')."""
    text = _short(expr)
    return text if isinstance(expr, (ast.Name, ast.Number)) else f"({text})"


def _compare(condition: ast.Condition, scope: _Scope) -> bool:
    left = _evaluate(condition.left, scope)
    right = _evaluate(condition.right, scope)
    return {
        ast.Compare.EQ: left == right,
        ast.Compare.NE: left != right,
        ast.Compare.LT: left < right,
        ast.Compare.LE: left <= right,
        ast.Compare.GT: left > right,
        ast.Compare.GE: left >= right,
    }[condition.compare]


def _at_bindings(error: PurlinError, scope: _Scope, expr) -> PurlinError:
    """``error`` in ``expr`` with a note naming the rank and loop values it arose at ("at r=0,
    i=3"): the caret shows the expression, not which of its evaluations failed.  Unchanged
    where ``expr`` uses neither, or where the error is a name's: it fails at every value alike."""
    if isinstance(error, _SpecWideError):
        return error
    varying = [name for name, kind in scope.kinds.items() if kind in ("rank", "loop variable")]
    if not _names_in((expr,)) & set(varying):
        return error
    return error.with_note("at " + ", ".join(f"{name}={scope.values[name]}" for name in varying))


def _axes(ref: ast.ChunkRef, scope: _Scope) -> list[range]:
    """Each index of ``ref`` as the range of values it names (one value for a plain index)."""
    axes: list[range] = []
    for index in ref.indices:
        try:
            axes.append(_axis(index, scope))
        except PurlinError as error:
            raise _at_bindings(error, scope, index) from None
    return axes


def _axis(index, scope: _Scope) -> range:
    if isinstance(index, ast.Range):
        return _evaluate_range(index, scope)
    value = _evaluate(index, scope)
    if value < 0:
        raise PurlinError(f"index '{_short(index)}' is {value}, out of bounds (chunk indices start at 0)", index.span)
    return range(value, value + 1)


def _bound_scopes(scope: _Scope, variable: str, values: range) -> Iterator[_Scope]:
    for value in values:
        yield scope.bind(variable, value, "loop variable")


# What a parameter named like a bound variable was likely meant to set.
_RESERVED_NOTES = {
    WORLD_VARIABLE: (f"{WORLD_VARIABLE} is the world size: give it with --ranks (world_size= in Python)",),
    RANK_VARIABLE: (f"{RANK_VARIABLE} is each rank's own index: every rank's layout is written with it",),
}


class _Checker:
    def __init__(self, definition: ast.CollectiveDef, world_size: int, params: Mapping[str, int],
                 meter: Meter | None = None):
        self.meter = meter or Meter()
        self.definition = definition
        self.world_size = world_size
        self.params = self._bind_params(params)
        self.arity: dict[str, tuple[int, Span | None]] = {}
        self.chunks_left = MAX_CHUNKS

    def _bind_params(self, given: Mapping[str, int]) -> dict[str, int]:
        declared = {p.name: p for p in self.definition.params}
        for name in given:
            if name not in declared:
                names = ", ".join(declared) or "none"
                raise PurlinError(
                    f"{self.definition.name} has no parameter '{name}' (its parameters: {names})",
                    self.definition.span, _RESERVED_NOTES.get(name, ()),
                )
        seen = set()
        for param in self.definition.params:  # declaration mistakes first, before any binding
            if param.name in seen:
                raise PurlinError(f"parameter '{param.name}' is declared twice", param.span)
            seen.add(param.name)
            if param.name in (RANK_VARIABLE, WORLD_VARIABLE):
                raise PurlinError(f"'{param.name}' is reserved and cannot be a parameter name", param.span)
        bound = {}
        for param in self.definition.params:
            if param.name in given:
                bound[param.name] = whole_number(f"parameter {param.name}", given[param.name])
            elif param.default is not None:
                bound[param.name] = param.default
            else:
                raise PurlinError(
                    f"parameter '{param.name}' is not bound",
                    param.span,
                    (f"give it a value (purlinc --param {param.name}=N, or {param.name}=N in Python), "
                     f"or a default in the declaration: ({param.name} = 0)",),
                )
            if not -MAX_VALUE <= bound[param.name] <= MAX_VALUE:
                raise PurlinError(
                    f"parameter '{param.name}' = {_number(bound[param.name])} is out of range "
                    f"(at most {MAX_VALUE} in magnitude)",
                    param.span,
                )
        return bound

    def base_scope(self) -> _Scope:
        values = {WORLD_VARIABLE: self.world_size, **self.params}
        kinds = {WORLD_VARIABLE: "world size", **{name: "parameter" for name in self.params}}
        return _Scope(values, kinds, self.meter)

    # --- constraints -------------------------------------------------------------------
    def failed_constraint(self) -> ast.Condition | None:
        scope = self.base_scope()
        for condition in self.definition.constraints:
            if not _compare(condition, scope):
                return condition
        return None

    def failed_constraints(self) -> list[int]:
        """The positions of every condition this size fails (``failed_constraint`` stops at the
        first): which refuses the most sizes must not depend on the order they are written in.
        A condition after a failed one may be guarded by it (``where k > 0, R % k == 0``): one
        that cannot be evaluated there counts as neither."""
        scope = self.base_scope()
        failed = []
        for n, condition in enumerate(self.definition.constraints):
            try:
                if not _compare(condition, scope):
                    failed.append(n)
            except PurlinError:
                if not failed:
                    raise
        return failed

    # --- layouts -----------------------------------------------------------------------
    def _check_arity(self, ref: ast.ChunkRef) -> None:
        first = self.arity.setdefault(ref.name, (len(ref.indices), ref.span))
        if first[0] != len(ref.indices):
            where = _elsewhere(first[1], ref.span)
            where = f" ({where})" if where else ""
            raise PurlinError(
                f"chunk '{ref.name}' is used with {len(ref.indices)} "
                f"{'index' if len(ref.indices) == 1 else 'indices'} here but with {first[0]} elsewhere{where}",
                ref.span,
            )

    def _spend(self, count: int, span: Span | None, what: str) -> None:
        """Take ``count`` chunks from the budget, or refuse before making any of them.
        ``what`` completes "<what> <count> chunks", e.g. "'x[0..R]' names"."""
        if count > self.chunks_left:
            named = MAX_CHUNKS - self.chunks_left
            chunks = "1 chunk" if count == 1 else f"{count:,} chunks"
            if count > MAX_VALUE:  # a capped product (_expand_chunk)
                chunks = f"more than {MAX_VALUE:,} chunks"
            raise PurlinError(
                f"{what} {chunks}, more than this spec may name at R={self.world_size} "
                f"(at most {MAX_CHUNKS:,} chunks over all ranks' layouts; {named:,} named before it)",
                span,
            )
        self.chunks_left -= count

    def _expand_chunk(self, ref: ast.ChunkRef, scope: _Scope, into: list[Chunk]) -> int:
        """Append the chunks ``ref`` names in ``scope`` to ``into``; return how many."""
        self._check_arity(ref)
        # An index costs a step even where it is a plain number (which _evaluate does not
        # charge): x[r][i][0]...[0] with a thousand indices in a loop ran for minutes.
        self.meter.charge(len(ref.indices), ref.span)
        axes = _axes(ref, scope)
        # The whole product, for the message (stopping at the first factor past the budget
        # reported x[0..600000][0..2] as 600,000 chunks); capped just past MAX_VALUE, so a
        # thousand huge ranges stay a small number ("more than 9,223,372,036,854,775,807").
        count = 1
        for axis in axes:
            count = min(count * (axis.stop - axis.start), MAX_VALUE + 1)  # not len(): may pass sys.maxsize
        if count > self.chunks_left:
            self._spend(count, ref.span, f"'{_short(ref)}' names")
        self.chunks_left -= count
        self.meter.charge(_ITEM_COST + count * _CHUNK_COST, ref.span)
        if count == 1:
            into.append(Chunk(ref.name, tuple(axis.start for axis in axes)))
        else:
            name = ref.name
            into.extend(Chunk(name, index) for index in itertools.product(*axes))
        return count

    def _expand_item(self, item: ast.Item, scope: _Scope, into: list[Chunk]) -> int:
        """Append the chunks of one layout entry, loops expanded row-major (first loop outermost).

        Iterative (a stack of iterators, one per loop), so a thousand nested loops are no
        deeper for Python than one."""
        loops = item.loops
        if not loops:
            return self._expand_chunk(item.chunk, scope, into)
        count = 0
        stack: list[tuple[int, Iterator[_Scope]]] = [(0, iter((scope,)))]
        while stack:
            depth, scopes = stack[-1]
            inner = next(scopes, None)
            if inner is None:
                stack.pop()
                continue
            if depth == len(loops):
                count += self._expand_chunk(item.chunk, inner, into)
                continue
            loop = loops[depth]
            if loop.variable in inner.values or loop.variable == RANK_VARIABLE:
                raise PurlinError(
                    f"loop variable '{loop.variable}' hides the {inner.kinds.get(loop.variable, 'rank')} "
                    f"of the same name",
                    loop.span,
                )
            try:
                values = _evaluate_range(loop.range, inner, loop.variable)
            except PurlinError as error:
                raise _at_bindings(error, inner, loop.range) from None
            # Every iteration names at least one chunk (ranges are never empty): a loop longer
            # than the budget is refused before it runs.
            if values.stop - values.start > self.chunks_left:
                self._spend(values.stop - values.start, loop.span, f"'{_short(loop)}' names at least")
            stack.append((depth + 1, _bound_scopes(inner, loop.variable, values)))
        return count

    def expand_layout(self, layout: tuple[ast.Item, ...], scope: _Scope) -> tuple[list[Chunk], list[Span | None]]:
        chunks: list[Chunk] = []
        spans: list[Span | None] = []
        for item in layout:
            count = self._expand_item(item, scope, chunks)
            spans.extend(itertools.repeat(item.span, count))
        return chunks, spans

    # --- assignments -------------------------------------------------------------------
    def _ranks_of(self, assignment: ast.Assignment) -> list[int]:
        if assignment.every_rank:
            return list(range(self.world_size))
        rank = _evaluate(assignment.rank, self.base_scope())
        if not 0 <= rank < self.world_size:
            raise PurlinError(
                f"rank index '{_short(assignment.rank)}' is {rank}, outside 0..{self.world_size - 1}",
                assignment.rank.span,
            )
        return [rank]

    def layouts(self, buffer: ast.Buffer):
        chunks: list[list[Chunk]] = [[] for _ in range(self.world_size)]
        spans: list[list[Span | None]] = [[] for _ in range(self.world_size)]
        assigned_by: dict[int, ast.Assignment] = {}
        for assignment in self.definition.assignments:
            if assignment.buffer is not buffer:
                continue
            for rank in self._ranks_of(assignment):
                if rank in assigned_by:
                    where = _elsewhere(assigned_by[rank].span, assignment.span)
                    also = f" (also at {where})" if where else ""
                    raise PurlinError(f"{buffer.value}[{rank}] is assigned twice{also}", assignment.span)
                assigned_by[rank] = assignment
                scope = self.base_scope()
                if assignment.every_rank:
                    scope = scope.bind(RANK_VARIABLE, rank, "rank")
                chunks[rank], spans[rank] = self.expand_layout(assignment.layout, scope)
        return chunks, spans

    def epilogue(self) -> Epilogue | None:
        """The checked epilogue (its row length evaluated for this world size), or None."""
        epilogue = self.definition.epilogue
        row = _evaluate(epilogue.row, self.base_scope()) if epilogue is not None else 0
        return check_epilogue(self.definition, row, self.params, self.taken_names(), self.spec_names())

    # --- producers ---------------------------------------------------------------------
    def resolve(self) -> Spec:
        inputs, input_spans = self.layouts(ast.Buffer.IN)
        outputs, output_spans = self.layouts(ast.Buffer.OUT)
        self._check_chunk_names()
        if not any(outputs):
            raise PurlinError("the collective names no output chunk (add 'out[r] = ...')", self.definition.span)

        producers: dict[Chunk, list[Slot]] = defaultdict(list)
        for rank, layout in enumerate(inputs):
            for position, chunk in enumerate(layout):
                producers[chunk].append(Slot(rank, position))

        copy = self.definition.operation is ast.Operation.COPY
        if copy and not self.definition.replicated:
            for chunk, slots in producers.items():
                if len(slots) > 1:
                    first, second = slots[0], slots[1]
                    raise PurlinError(
                        f"conflicting producers under 'copy': {_chunk_text(chunk)} is given by rank {first.rank} "
                        f"(in[{first.position}]) and by rank {second.rank} (in[{second.position}])",
                        input_spans[second.rank][second.position],
                        ("under 'copy' a chunk has exactly one producer; write 'copy replicated' "
                         "if these inputs hold identical data",),
                    )

        # One tuple per chunk, shared by every output position that receives it: a copy per
        # position made a one-chunk all-reduce's sources R x R slots (34 GB at R = 65,536).
        frozen = {chunk: tuple(slots) for chunk, slots in producers.items()}
        sources: list[tuple[tuple[Slot, ...], ...]] = []
        for rank, layout in enumerate(outputs):
            rank_sources = []
            for position, chunk in enumerate(layout):
                slots = frozen.get(chunk)
                if not slots:
                    raise PurlinError(
                        f"output chunk {_chunk_text(chunk)} of rank {rank} has no producer: no input names it",
                        output_spans[rank][position],
                        (_namesakes(chunk, producers),),
                    )
                rank_sources.append(slots)
            sources.append(tuple(rank_sources))

        sizes = self.sizes(inputs, input_spans, outputs, output_spans)
        return Spec(
            epilogue=self.epilogue(),
            name=self.definition.name,
            world_size=self.world_size,
            params=tuple(sorted(self.params.items())),
            operation=self.definition.operation,
            replicated=self.definition.replicated,
            inputs=tuple(tuple(layout) for layout in inputs),
            outputs=tuple(tuple(layout) for layout in outputs),
            sources=tuple(sources),
            input_spans=tuple(tuple(s) for s in input_spans),
            output_spans=tuple(tuple(s) for s in output_spans),
            sizes=sizes,
        )

    # --- run-time sizes ----------------------------------------------------------------
    def _loop_variables(self) -> set[str]:
        return {loop.variable for a in self.definition.assignments for item in a.layout for loop in item.loops}

    def _check_chunk_names(self) -> None:
        """A chunk may not take the name of the rank, the world size, a parameter or a loop
        variable: in 'x[x]' with a parameter x, which x is which is a puzzle (the rule operands
        and locals follow too)."""
        taken = {RANK_VARIABLE: "the rank", WORLD_VARIABLE: "the world size",
                 **{p: "a parameter" for p in self.params}, **{v: "a loop variable" for v in self._loop_variables()}}
        for name, (_, span) in self.arity.items():
            check_name("chunk", name, span, taken)

    def spec_names(self) -> dict[str, str]:
        """Names that mean something in the spec (for the message: what each names), which no
        operand or epilogue local may take; known once the layouts are expanded (chunk names)."""
        return {RANK_VARIABLE: "the rank", WORLD_VARIABLE: "the world size",
                **{p: "a parameter" for p in self.params}, **{v: "a loop variable" for v in self._loop_variables()},
                **{name: "a chunk" for name in self.arity}, **{f: "a function" for f in FUNCTIONS}}

    def taken_names(self) -> dict[str, str]:
        """Names an operand cannot have: the spec's (``spec_names``), and those a Python call
        could not pass it by (operands are keyword arguments; a local is never passed)."""
        return {**{k: "a Python keyword (no call could pass it by name)" for k in keyword.kwlist},
                # no keyword, but 'coll(x, __debug__=w)' is a SyntaxError all the same ("cannot assign")
                "__debug__": "a constant of Python's (no call could pass it by name)",
                **{k: "an argument of the Python call" for k in CALL_KEYWORDS}, **self.spec_names()}

    def sizes(self, inputs, input_spans, outputs, output_spans) -> Sizes | None:
        """The ``with sizes`` operand resolved for this R, or None; every rule of
        docs/LANGUAGE.md ("Run-time sizes") is checked here, at the offending source."""
        operands = [o for o in self.definition.operands if isinstance(o, ast.SizesOperand)]
        if not operands:
            return None
        if len(operands) > 1:
            raise PurlinError("a collective has at most one 'sizes' operand", operands[1].span)
        operand = operands[0]
        check_name("operand", operand.name, operand.span, self.taken_names())
        self._check_operation(operand)
        if operand.chunk not in self.arity:
            raise PurlinError(f"'sizes {operand.name} ... of {operand.chunk}': no layout names a chunk "
                              f"'{operand.chunk}'", operand.span,
                              (f"chunks named here: {', '.join(sorted(self.arity)) or 'none'}",))
        extents = self._extents(operand)
        for buffer, layouts, spans in (("in", inputs, input_spans), ("out", outputs, output_spans)):
            for rank, layout in enumerate(layouts):
                for position, chunk in enumerate(layout):
                    self._check_sized_chunk(operand, extents, chunk, spans[rank][position], f"{buffer}[{rank}]")
        return Sizes(operand.name, operand.chunk, extents, operand.span)

    def _check_operation(self, operand: ast.SizesOperand) -> None:
        if self.definition.operation is ast.Operation.REDUCE:
            raise PurlinError("'reduce' cannot have run-time sizes: a reduction adds chunks of equal length",
                              self.definition.operation_span, (f"declared here: {operand.format()}",))
        if self.definition.replicated:
            raise PurlinError("'copy replicated' cannot have run-time sizes: replicated producers would have "
                              "to agree on sizes only the GPU knows", self.definition.operation_span)

    def _extents(self, operand: ast.SizesOperand) -> tuple[int, ...]:
        arity, first = self.arity[operand.chunk]
        if arity != len(operand.extents):
            raise PurlinError(
                f"'{operand.name}' has {len(operand.extents)} extent(s) but chunk '{operand.chunk}' is used "
                f"with {arity} ind{'ex' if arity == 1 else 'ices'}", operand.span,
                ((f"'{operand.chunk}' first used at line {first.line}",) if first is not None else ()))
        extents = []
        for expr in operand.extents:
            value = _evaluate(expr, self.base_scope())
            if value < 1:
                raise PurlinError(f"extent '{_short(expr)}' of '{operand.name}' is {value}; it must be at least 1",
                                  expr.span)
            extents.append(value)
        return tuple(extents)

    def _check_sized_chunk(self, operand, extents, chunk: Chunk, span, where: str) -> None:
        if chunk.name != operand.chunk:
            raise PurlinError(
                f"chunk '{chunk.name}' has no size: in a collective with run-time sizes every chunk is "
                f"sized by '{operand.name}' (of '{operand.chunk}')", span,
                ("a mix of fixed-count and sized chunks has no call-time meaning",))
        if any(i >= e for i, e in zip(chunk.index, extents)):
            shape = "".join(f"[{e}]" for e in extents)
            raise PurlinError(f"chunk {_chunk_text(chunk)} of {where} lies outside the extents of '{operand.name}{shape}'", span)


def _elsewhere(earlier: Span | None, here: Span | None) -> str:
    """Where ``earlier`` is, for a message located at ``here``: "line 2", or "line 1, column
    16" when both are on one line (a one-line spec), or "" when it is not known."""
    if earlier is None:
        return ""
    if here is not None and here.line == earlier.line:
        return f"line {earlier.line}, column {earlier.column}"
    return f"line {earlier.line}"


def _chunk_text(chunk: Chunk) -> str:
    """A chunk's name for a message, cut as an expression is (a chunk of 1,000 indices made a
    3,000-character first line)."""
    text = str(chunk)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _namesakes(chunk: Chunk, producers: Mapping[Chunk, list[Slot]]) -> str:
    """A note saying which chunks of the same name the inputs do hold (an index off by one?)."""
    same = sorted(c for c in producers if c.name == chunk.name)
    if not same:
        return f"no input names any chunk called '{chunk.name}'"
    shown = ", ".join(map(_chunk_text, same[:6])) + (", ..." if len(same) > 6 else "")
    return f"the inputs name {len(same)} chunk{'s' if len(same) > 1 else ''} called '{chunk.name}': {shown}"


def _parameters_named(conditions: Iterable[ast.Condition], bound: Mapping[str, int], given: Mapping[str, int],
                      *, defaults_only: bool = False) -> tuple[str, ...]:
    """A note giving the parameters ``conditions`` name and their values ("with k=1 (its
    default)"): a 'where' that fails because of a default is otherwise a puzzle.
    ``defaults_only``: leave out the given ones (a "while checking" note shows them)."""
    named = _names_in(side for condition in conditions for side in (condition.left, condition.right))
    values = [f"{name}={value}" + ("" if name in given else " (its default)")
              for name, value in bound.items() if name in named and not (defaults_only and name in given)]
    return (f"with {', '.join(values)}",) if values else ()


def _names_in(exprs: Iterable) -> set[str]:
    """The names the expressions (or ranges) use."""
    named: set[str] = set()
    stack = list(exprs)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Name):
            named.add(node.name)
        elif isinstance(node, ast.Negate):
            stack.append(node.operand)
        elif isinstance(node, ast.Binary):
            stack += [node.left, node.right]
        elif isinstance(node, ast.Range):
            stack += [node.lo, node.hi]
    return named


def _while_checking(definition: ast.CollectiveDef, world_size: int, params: Mapping[str, int]) -> str:
    bound = "".join(f", {k}={_number(v)}" for k, v in sorted(params.items()))
    return f"while checking {definition.name} for R={world_size}{bound}"


def whole_number(what: str, value) -> int:
    """``value`` as an int: an int or a NumPy integer.  A bool, float or string is refused, not
    converted: ``int(1.5)`` is 1 and ``int(True)`` is 1, which would compile another collective
    than the one asked for without a word."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise PurlinError(f"{what} must be an integer, got {value!r} ({type(value).__name__})")


def check(definition: ast.CollectiveDef, world_size: int, params: Mapping[str, int] | None = None,
          *, meter: Meter | None = None) -> Spec:
    """Resolve ``definition`` for ``world_size`` ranks; raise ``PurlinError`` if ill-formed.
    ``meter`` bounds the work (a fresh one per call unless given: check_all shares one)."""
    params = dict(params or {})
    world_size = whole_number("the world size", world_size)
    if world_size < 1:
        raise PurlinError(f"the world size must be at least 1, not {world_size}")
    if world_size > MAX_WORLD_SIZE:
        raise PurlinError(f"the world size {world_size:,} is larger than Purlin supports ({MAX_WORLD_SIZE:,})")
    try:
        checker = _Checker(definition, world_size, params, meter)
        failed = checker.failed_constraint()
        if failed is not None:
            raise PurlinError(
                f"{definition.name} is not defined for R={world_size}: it requires {_short(failed)}",
                failed.span,
                _parameters_named((failed,), checker.params, params, defaults_only=True),
            )
        return checker.resolve()
    except PurlinError as error:
        for note in _defaults_named_at(definition, params, error):
            error = error.with_note(note)
        raise error.with_note(_while_checking(definition, world_size, params)) from None


_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
_NAME_READ = re.compile(r"\b([A-Za-z_][A-Za-z_0-9]*)\b(?!\s*\[)")


def _defaults_named_at(definition: ast.CollectiveDef, params: Mapping[str, int], error: PurlinError) -> tuple[str, ...]:
    """"with k=0 (its default)" for the defaulted parameters the erring source text names: a
    division by a default k=0, or a default root past R, otherwise named the value nowhere (the
    "while checking" note gives only the values bound)."""
    span = error.span
    if span is None or definition.span is None or span.source is not definition.span.source or span == definition.span:
        return ()  # an error at the whole collective (an unknown parameter) is about no value
    lines = [span.source.line(n) for n in range(span.line, span.end_line + 1)]
    lines[-1] = lines[-1][:span.end_column - 1]
    lines[0] = lines[0][span.column - 1:]
    text = _COMMENT.sub(" ", "\n".join(lines))
    named = {m.group(1) for m in _NAME_READ.finditer(text)}  # read as values: not a chunk's (a name before '[')
    if "parameter" in error.message:  # about a name ("loop variable 'k' hides the parameter"), not its value
        named -= set(re.findall(r"'([A-Za-z_]\w*)'", error.message))
    values = [f"{p.name}={p.default} (its default)" for p in definition.params
              if p.name in named and p.name not in params and p.default is not None
              and p.name not in (WORLD_VARIABLE, RANK_VARIABLE)]
    note = f"with {', '.join(values)}"
    return (note,) if values and note not in error.notes else ()


def supports(definition: ast.CollectiveDef, world_size: int, params: Mapping[str, int] | None = None,
             *, meter: Meter | None = None) -> bool:
    """Whether the collective's ``where`` constraints admit ``world_size``."""
    return _Checker(definition, world_size, dict(params or {}), meter).failed_constraint() is None


def check_all(
    definition: ast.CollectiveDef,
    world_sizes: Iterable[int] = DEFAULT_WORLD_SIZES,
    params: Mapping[str, int] | None = None,
    *,
    progress: Callable[[int], None] | None = None,
) -> list[int]:
    """Check every world size the constraints admit; return them.  The first failure raises.
    One ``Meter`` bounds the work of all sizes together; ``progress(R)`` is called before each.

    Parameters that are rank indices (such as ``root``) are checked as given; a world size
    too small for the given value is reported like any other failure.
    """
    params = dict(params or {})
    world_sizes = list(world_sizes) if not isinstance(world_sizes, range) else world_sizes
    if not world_sizes:
        raise PurlinError("no world size to check")
    # Refused up front, not after 65,536 checks.  A range's largest size is at one of its ends:
    # max() would walk it, 10**28 steps for --ranks 1..10000000000000000000000000000.
    largest = max(world_sizes[0], world_sizes[-1]) if isinstance(world_sizes, range) else max(world_sizes)
    if largest > MAX_WORLD_SIZE:
        raise PurlinError(f"the world size {largest:,} is larger than Purlin supports ({MAX_WORLD_SIZE:,})")
    meter = Meter()
    admitted = []
    refused: Counter[int] = Counter()  # sizes each constraint (by position) refused, alone or with others
    for world_size in world_sizes:
        if progress is not None:
            progress(world_size)
        try:
            failed = _Checker(definition, world_size, params, meter).failed_constraints()
        except PurlinError as error:
            raise error.with_note(_while_checking(definition, world_size, params)) from None
        if failed:
            refused.update(failed)
            continue
        check(definition, world_size, params, meter=meter)
        admitted.append(world_size)
    if not admitted:
        _refuse_every_size(definition, world_sizes, params, refused)
    return admitted


def _refuse_every_size(definition: ast.CollectiveDef, world_sizes, params: Mapping[str, int],
                       refused: Counter[int]) -> None:
    """No size was admitted: point at the 'where' condition that refused the most of them (a
    condition every size meets is no answer), and name the others that refused some."""
    ranked = sorted(refused.items(), key=lambda item: (-item[1], item[0]))
    first = definition.constraints[ranked[0][0]]
    bound = _Checker(definition, world_sizes[0], params).params  # bound for every size before
    notes = _parameters_named((first,), bound, params)
    if len(ranked) > 1:
        counts = ", ".join(f"'{_short(definition.constraints[n])}' {count}" for n, count in ranked)
        notes += (f"world sizes each condition refused: {counts}",)
    raise PurlinError(
        f"{definition.name} is defined for no world size in {world_sizes[0]}..{world_sizes[-1]}",
        first.span, notes,
    )
