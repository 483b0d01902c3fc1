"""Epilogues: the checked form of ``epilogue rows(E) { ... }`` and its meaning on NumPy rows.

An epilogue is elementwise float32 work on each row of a rank's reduced output, with per-call
operands (docs/LANGUAGE.md, "Epilogues").  ``check_epilogue`` turns the AST into an
``Epilogue`` (or raises a located ``PurlinError``); ``apply_rows`` is its meaning, used by the
reference evaluator and the SNAC simulator alike; the code generator
(``purlinc.atom.epilogue``) renders the same statements as CUDA.
"""

from __future__ import annotations

import math
import numbers
import reprlib
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

from purlinc.dtypes import FLOAT32_MAX, FLOAT32_TINY, DType
from purlinc.errors import PurlinError, Span
from purlinc.frontend import ast
from purlinc.frontend.ast import OperandKind
from purlinc.registry import UnknownNameError

OUT = "out"  # the reduced output, in every epilogue
# Functions an epilogue may call: name -> number of arguments.  rmsnorm(V, W, EPS) is
# V * rsqrt(mean(V * V over the row) + EPS) * W, in float32.
FUNCTIONS = {"rmsnorm": 3}
# dtypes a ``rows`` operand may have (read, or written with rounding; fp8 saturates).
ROWS_DTYPES = (DType.BFLOAT16, DType.FLOAT16, DType.FLOAT32, DType.FLOAT8_E4M3)
MAX_STATEMENTS = 64  # keeps generated code and checking small for any input
# Operators and calls nested in one expression (a sum of n terms is n - 1 deep).  Epilogues are
# short formulas; every later stage (printing, the evaluator, the CUDA emitter) walks an
# expression recursively, so a deeper one (a flat sum of 1000 terms) is refused here, where it
# gets a location, instead of overflowing Python's stack there.
MAX_DEPTH = 64
# Operators and calls in all the statements together: the generated row loop holds every one
# once per kernel entry it is fused into, and NVRTC's time grows with them (measured, R=8 packed,
# 8 channels, 4 slices, rows of 16,384: 1,024 operations 17 s, 2,048 30 s, 8,000 over 5 minutes).
# A fused epilogue is a few dozen.
MAX_OPERATIONS = 1024
# What the kernels need of a row (docs/LANGUAGE.md, "Rows"): whole 16-byte vectors, at most
# MAX_ROW_VECTORS of them (a row's vectors are held in registers).  The language states the rule,
# so it lives here: the checker refuses a length no dtype meets, code generation
# (``purlinc.atom.epilogue.check_rows``) the length the call's dtype does not meet.
VECTOR_BYTES = 16
MAX_ROW_VECTORS = 2048  # rows up to 32 KiB (16,384 bf16 elements): at most 8 vectors per thread of 256


@dataclass(frozen=True, slots=True)
class Operand:
    """A checked epilogue operand: its kind, its dtype (None: the call's, or float32 for a
    scalar) and whether the epilogue writes it."""

    name: str
    kind: OperandKind
    dtype: DType | None
    written: bool
    span: Span | None = field(default=None, compare=False, hash=False, repr=False)

    def format(self) -> str:
        dtype = f": {self.dtype.value}" if self.dtype is not None else ""
        return f"{self.kind.value} {self.name}{dtype}" + (" (written)" if self.written else "")


@dataclass(frozen=True, slots=True)
class Epilogue:
    """What each rank does to every row of ``row`` elements of its reduced output."""

    row: int  # elements per row
    operands: tuple[Operand, ...]  # in declaration order (the kernel's operand slots)
    statements: tuple[ast.EpilogueAssign, ...]
    span: Span | None = field(default=None, compare=False, hash=False, repr=False)
    row_span: Span | None = field(default=None, compare=False, hash=False, repr=False)

    def operand(self, name: str) -> Operand:
        return next(o for o in self.operands if o.name == name)

    @property
    def writes(self) -> tuple[str, ...]:
        """Buffers written (``out`` and rows operands), in statement order."""
        names = {o.name for o in self.operands}
        return tuple(s.target for s in self.statements if s.target == OUT or s.target in names)

    @property
    def norm(self) -> ast.FCall | None:
        """The epilogue's one ``rmsnorm`` call, if any."""
        calls = [c for s in self.statements for c in _calls(s.value)]
        return calls[0] if calls else None

    def format(self) -> str:
        lines = [f"epilogue rows({self.row})"]
        lines += [f"  with {o.format()}" for o in self.operands]
        lines += [f"  {s.format()}" for s in self.statements]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict:
        return {
            "row": self.row,
            "operands": [{"name": o.name, "kind": o.kind.value, "dtype": o.dtype.value if o.dtype else None,
                          "written": o.written} for o in self.operands],
            "statements": [s.format() for s in self.statements],
        }


def _children(node: ast.FExpr) -> tuple[ast.FExpr, ...]:
    """A node's operands in source order: the one place the walks below know the node kinds."""
    if isinstance(node, ast.FCall):
        return tuple(node.args)
    if isinstance(node, ast.FBinary):
        return (node.left, node.right)
    if isinstance(node, ast.FNeg):
        return (node.operand,)
    return ()


_OPERATIONS = (ast.FCall, ast.FBinary, ast.FNeg)  # what the depth and size bounds count


def _calls(expr: ast.FExpr):
    """Every function call in ``expr`` (pre-order)."""
    stack = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FCall):
            yield node
        stack.extend(reversed(_children(node)))


def _depth(expr: ast.FExpr) -> int:
    """Operators and calls on the longest path from ``expr`` to a leaf.  Iterative: the
    parser builds trees of any depth, and this is what keeps them from later stages."""
    deepest = 0
    stack = [(expr, 0)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in _children(node))
    return deepest


def _operations(expr: ast.FExpr) -> int:
    """Operators and calls in ``expr`` (iterative, as ``_depth``)."""
    count, stack = 0, [expr]
    while stack:
        node = stack.pop()
        count += isinstance(node, _OPERATIONS)
        stack.extend(_children(node))
    return count


def _names(expr: ast.FExpr):
    """Every name read in ``expr`` (function names excluded)."""
    stack = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FName):
            yield node
        stack.extend(_children(node))


# --- rows --------------------------------------------------------------------------------------


def row_problem(row: int, dtype: DType) -> str | None:
    """Why rows of ``row`` elements of ``dtype`` cannot run an epilogue, or None."""
    if dtype.info.c_acc != "float":
        return f"an epilogue computes in float32; {dtype.value} outputs are not supported"
    row_bytes = row * dtype.itemsize
    # the length first: of a row of 2**63 - 1 elements, "not a multiple of 16 bytes" is true but
    # suggests one element more would do
    if row_bytes > MAX_ROW_VECTORS * VECTOR_BYTES:
        return (f"a row of {row:,} {dtype.value} elements is longer than the epilogue supports "
                f"({MAX_ROW_VECTORS * VECTOR_BYTES // dtype.itemsize:,} elements)")
    if row_bytes % VECTOR_BYTES:
        return (f"a row of {row} {dtype.value} elements is {row_bytes} bytes, not a multiple of {VECTOR_BYTES} "
                "(the kernels move 16-byte vectors)")
    return None


def _row_dtypes() -> tuple[DType, ...]:
    """The dtypes an epilogue computes on (those ``row_problem`` can accept)."""
    return tuple(d for d in DType if d.info.c_acc == "float")


def _check_row_length(row: int, span: Span | None) -> None:
    """Refuse a row length that no dtype can run, so ``check`` does not pass a spec every
    compile refuses.  A length some dtypes run is valid: the kernel's dtype is checked when
    one is generated (``row_problem``), and that error names it."""
    dtypes = _row_dtypes()
    if any(row_problem(row, d) is None for d in dtypes):
        return
    limit = MAX_ROW_VECTORS * VECTOR_BYTES
    elements = f"{row:,} element{'' if row == 1 else 's'}"
    raise PurlinError(f"a row of {elements} runs in no dtype: a row is a whole number of {VECTOR_BYTES}-byte "
                      f"vectors, at most {limit // 1024} KiB (the kernels move rows as vectors held in registers)", span,
                      (_row_rule(dtypes), _nearest_rows(row, dtypes)))


def _row_rule(dtypes: tuple[DType, ...]) -> str:
    """The rule in elements, per element size ("a multiple of 4 elements, at most 8,192, in
    float32; ...")."""
    sizes = sorted({d.itemsize for d in dtypes}, reverse=True)
    parts = []
    for size in sizes:
        names = " and ".join(d.value for d in dtypes if d.itemsize == size)
        parts.append(f"a multiple of {VECTOR_BYTES // size} elements, at most "
                     f"{MAX_ROW_VECTORS * VECTOR_BYTES // size:,}, in {names}")
    return "that is " + "; ".join(parts)


def _nearest_rows(row: int, dtypes: tuple[DType, ...]) -> str:
    """The valid lengths nearest ``row``, below and above, each with the dtypes that run it."""
    candidates = set()
    for d in dtypes:
        step, most = VECTOR_BYTES // d.itemsize, MAX_ROW_VECTORS * VECTOR_BYTES // d.itemsize
        candidates |= {min(row // step * step, most), -(-row // step) * step}
    valid = [n for n in candidates if n >= 1 and any(row_problem(n, d) is None for d in dtypes)]
    below, above = [n for n in valid if n < row], [n for n in valid if n > row]
    nearest = ([max(below)] if below else []) + ([min(above)] if above else [])
    shown = [f"{n:,} ({', '.join(d.value for d in dtypes if row_problem(n, d) is None)})" for n in nearest]
    return ("the nearest lengths that run: " if len(shown) > 1 else "the nearest length that runs: ") + " and ".join(shown)


# --- checking -----------------------------------------------------------------------------------


def check_name(what: str, name: str, span: Span | None, taken: Mapping[str, str]) -> None:
    """One naming rule for every name a spec declares beside its chunks, parameters and loop
    variables (operands of every kind, epilogue locals): none may take a name ``taken`` holds
    (name -> what it names, e.g. "a chunk"), so a name in a spec means one thing."""
    if name in taken:
        raise PurlinError(f"{what} '{name}' has the name of {taken[name]}", span)


def default_taken(params: Mapping[str, int]) -> dict[str, str]:
    """The names an operand or local cannot have where no checker gives the full table
    (``check.taken_names``, which adds chunks, loop variables and the Python call's names)."""
    return {"r": "the rank", "R": "the world size", **{p: "a parameter" for p in params},
            **{f: "a function" for f in FUNCTIONS}}


def check_operands(definition: ast.CollectiveDef, params: Mapping[str, int],
                   taken: Mapping[str, str] | None = None) -> dict[str, ast.OperandDecl]:
    """The ``with`` clause's epilogue operands by name: no two operands of one name (of any
    kind), none named like something else (``taken``: name -> what it is, e.g. "a chunk";
    by default ``default_taken``), dtypes only on ``rows`` and only the ones an epilogue can
    read and write."""
    if taken is None:
        taken = default_taken(params)
    seen: set[str] = set()
    declared: dict[str, ast.OperandDecl] = {}
    for decl in definition.operands:
        if decl.name in seen:
            raise PurlinError(f"operand '{decl.name}' is declared twice", decl.span)
        seen.add(decl.name)
        if not isinstance(decl, ast.OperandDecl):
            continue  # another section's operand kind (its own checker checks its name)
        check_name("operand", decl.name, decl.span, taken)
        if decl.dtype is not None:
            _operand_dtype(decl)
        declared[decl.name] = decl
    if declared and definition.epilogue is None:
        first = next(iter(declared.values()))
        raise PurlinError(f"operand '{first.name}' is an epilogue operand, but {definition.name} has no epilogue",
                          first.span, ("add 'epilogue rows(E) { ... }' after the operation, or remove the operand",))
    return declared


def _operand_dtype(decl: ast.OperandDecl) -> DType:
    if decl.kind is not OperandKind.ROWS:
        # What the operand is instead (docs/LANGUAGE.md, "Operands"): a scalar is passed by
        # value as float32 whatever the call's dtype; a row is read in the call's dtype.
        what = "is always float32" if decl.kind is OperandKind.SCALAR else "has the call's dtype"
        raise PurlinError(f"a {decl.kind.value} operand {what} (only rows operands declare a dtype)",
                          decl.dtype_span)
    takes = "rows operands take " + ", ".join(d.value for d in ROWS_DTYPES)
    try:
        dtype = DType.parse(decl.dtype)  # the names and aliases --dtype and the Python call take
    except UnknownNameError as error:  # its notes list the known names
        raise PurlinError(error.message, decl.dtype_span, (*error.notes, takes)) from None
    if dtype not in ROWS_DTYPES:
        raise PurlinError(f"an epilogue cannot write or read {dtype.value}: {takes}", decl.dtype_span)
    return dtype


def check_epilogue(definition: ast.CollectiveDef, row: int, params: Mapping[str, int],
                   taken: Mapping[str, str] | None = None,
                   local_taken: Mapping[str, str] | None = None) -> Epilogue | None:
    """The checked epilogue of ``definition`` (None without one); ``row`` is its row
    expression's value for the world size being checked; ``taken`` as for ``check_operands``;
    ``local_taken``: the names a local cannot have (the spec's names, not the Python call's: a
    local is never passed by name; default ``taken``)."""
    taken = taken if taken is not None else default_taken(params)
    local_taken = local_taken if local_taken is not None else taken
    declared = check_operands(definition, params, taken)
    epilogue = definition.epilogue
    if epilogue is None:
        return None
    if definition.operation is not ast.Operation.REDUCE:
        raise PurlinError(f"an epilogue applies to reduced data; {definition.name} is a copy collective",
                          epilogue.keyword_span)
    if row < 1:
        raise PurlinError(f"a row must hold at least one element, not {row}", epilogue.row.span)
    _check_row_length(row, epilogue.row.span)
    if definition.sizes is not None:
        raise PurlinError("an epilogue needs chunks of the call's count: run-time sizes cannot carry one yet",
                          epilogue.keyword_span)
    if len(epilogue.statements) > MAX_STATEMENTS:
        raise PurlinError(f"an epilogue has at most {MAX_STATEMENTS} statements", epilogue.keyword_span)
    written, locals_ = _check_statements(epilogue, declared, local_taken)
    read = {n.name for s in epilogue.statements for n in _names(s.value)}
    _check_locals_read(epilogue, locals_, read)
    operands = []
    for name, decl in declared.items():
        if name not in read and name not in written:
            raise PurlinError(f"operand '{name}' is declared but the epilogue never uses it", decl.span)
        dtype = _operand_dtype(decl) if decl.dtype is not None else None
        operands.append(Operand(name, decl.kind, dtype, name in written, decl.span))
    return Epilogue(row, tuple(operands), epilogue.statements, epilogue.span, epilogue.row.span)


def _check_statements(epilogue: ast.EpilogueDef, declared: Mapping[str, ast.OperandDecl],
                      taken: Mapping[str, str]) -> tuple[set[str], set[str]]:
    """Walk the statements in order: names defined before use, targets assignable once,
    locals named as operands may be (``taken``), function calls well formed.  Returns the
    buffers written and the locals."""
    locals_: set[str] = set()
    written: set[str] = set()
    norms: list[ast.FCall] = []
    operations = 0
    for statement in epilogue.statements:
        _check_depth(statement.value)
        operations += _operations(statement.value)
        if operations > MAX_OPERATIONS:
            raise PurlinError(f"the epilogue holds more than {MAX_OPERATIONS:,} operations ({operations:,} up to this "
                              "statement)", statement.value.span,
                              ("each operator and call counts; the kernels' compile time grows with them",))
        for name in _names(statement.value):
            if name.name != OUT and name.name not in declared and name.name not in locals_:
                known = ", ".join([OUT, *declared, *sorted(locals_)])
                if name.name in taken:  # r, R, a parameter: a name of the layouts, not of the data
                    raise PurlinError(f"'{name.name}' is {taken[name.name]}, which an epilogue's statements cannot read",
                                      name.span, ("they compute on the call's data in float32: write the number, or "
                                                  "pass the value as a scalar operand", f"names defined here: {known}"))
                raise PurlinError(f"unknown name '{name.name}' in the epilogue", name.span,
                                  (f"names defined here: {known}",))
        for call in _calls(statement.value):
            _check_call(call, declared)
            norms.append(call)
        if len(norms) > 1:
            raise PurlinError("an epilogue has at most one rmsnorm (one reduction over the row)", norms[1].span)
        _check_target(statement, declared, locals_, written, taken)
    if not written:
        raise PurlinError("the epilogue writes nothing: assign out or a rows operand", epilogue.keyword_span)
    return written, locals_


def _check_locals_read(epilogue: ast.EpilogueDef, locals_: set[str], read: set[str]) -> None:
    """A local no later statement reads computes nothing that is stored: a slip (a misspelt
    target, a statement left behind), refused as an operand the epilogue never uses is
    (``read``: every name the statements read; a local is read only after it is defined)."""
    for statement in epilogue.statements:
        if statement.target in locals_ and statement.target not in read:
            raise PurlinError(f"local '{statement.target}' is assigned but never used", statement.target_span,
                              ("use it in a later statement, assign out or a rows operand instead, or remove it",))


def _check_depth(expr: ast.FExpr) -> None:
    depth = _depth(expr)
    if depth > MAX_DEPTH:
        raise PurlinError(f"this expression nests {depth} operations deep; an epilogue expression nests at most "
                          f"{MAX_DEPTH}", expr.span,
                          ("each operator and call is one level (a sum of n terms is n - 1 deep); "
                           "split it with locals: 'a = ...', then 'out = a + ...'",))


def _check_target(statement: ast.EpilogueAssign, declared, locals_: set[str], written: set[str],
                  taken: Mapping[str, str]) -> None:
    target, span = statement.target, statement.target_span
    decl = declared.get(target)
    if target == OUT or (decl is not None and decl.kind is OperandKind.ROWS):
        if target in written:
            raise PurlinError(f"{target} is written twice in the epilogue (a buffer is written once, "
                              "after every read)", span)
        written.add(target)
    elif decl is not None:
        raise PurlinError(f"'{target}' is a {decl.kind.value} operand: only out and rows operands can be written",
                          span)
    elif target in locals_:
        raise PurlinError(f"local '{target}' is assigned twice (locals are defined once)", span)
    else:
        check_name("local", target, span, taken)
        locals_.add(target)


def _check_call(call: ast.FCall, declared: Mapping[str, ast.OperandDecl]) -> None:
    if call.function not in FUNCTIONS:
        raise PurlinError(f"unknown function '{call.function}'", call.span,
                          (f"an epilogue may call: {', '.join(FUNCTIONS)}",))
    arity = FUNCTIONS[call.function]
    if len(call.args) != arity:
        raise PurlinError(f"{call.function} takes {arity} arguments (value, weight, eps), not {len(call.args)}",
                          call.span)
    _, weight, eps = call.args
    decl = declared.get(weight.name) if isinstance(weight, ast.FName) else None
    if decl is None or decl.kind is not OperandKind.ROW:
        raise PurlinError("rmsnorm's weight must be a row operand (declared 'row NAME')", weight.span)
    decl = declared.get(eps.name) if isinstance(eps, ast.FName) else None
    # A literal is never negative (the grammar has no signed literals; '-1e-6' is a negation),
    # and a negative eps could make rsqrt's argument zero or negative: only a plain number or
    # the caller's scalar is an eps.
    if not isinstance(eps, ast.FNumber) and (decl is None or decl.kind is not OperandKind.SCALAR):
        text = eps.format()
        shown = f", not '{text}'" if len(text) <= 40 else ""
        raise PurlinError(f"rmsnorm's eps must be a scalar operand or a non-negative number{shown}", eps.span)


# --- meaning ------------------------------------------------------------------------------------


def eps_operand(epilogue: Epilogue) -> str | None:
    """The scalar operand the epilogue's rmsnorm takes as its eps, if one does."""
    norm = epilogue.norm
    eps = norm.args[2] if norm is not None else None
    return eps.name if isinstance(eps, ast.FName) else None


def scalar_problem(value, *, is_eps: bool) -> tuple[str, str | None] | None:
    """Why a scalar operand's value cannot run (what is wrong, and a note), or None: the one rule
    for the runtime and the oracle alike.  A finite float32 only (a value float32 cannot hold
    would be packed as infinity, and a NaN or infinity poisons every row silently); rmsnorm's
    eps also >= 0, as a literal eps must be (a negative one makes small rows' roots NaN)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"expected a number (float32), got {type(value).__name__}", None
    try:
        as_float32 = struct.unpack("<f", struct.pack("<f", float(value)))[0]
    except OverflowError:  # past float32's range (or, an int, past float64's)
        as_float32 = math.inf
    if not math.isfinite(as_float32):
        return (f"expected a finite float32 value, got {reprlib.repr(value)}",
                f"float32 holds magnitudes up to {FLOAT32_MAX:.6g}")
    if as_float32 == 0 and value != 0:  # eps=1e-50 ran as eps=0 (NaN rows), as a literal 1e-50 is refused
        return (f"expected a value float32 can hold, got {reprlib.repr(value)}: it would be 0",
                f"the smallest nonzero float32 magnitude is {FLOAT32_TINY:.8g}")
    if is_eps and value < 0:
        return (f"rmsnorm's eps must be >= 0, got {reprlib.repr(value)}",
                "a negative eps makes rows whose mean square is below it NaN")
    return None


def apply_rows(epilogue: Epilogue, out, operands: Mapping[str, object]) -> dict[str, object]:
    """Run the epilogue on float32 rows: ``out`` is ``[n, row]`` (the reduced output, already
    rounded to the call's dtype), ``operands`` maps each operand's name to ``[n, row]``
    (rows), ``[row]`` (row) or a number (scalar), as float32.  Returns the written buffers'
    float32 values by name (``out`` and rows operands), before rounding to their dtypes.
    Every read sees the values from before the epilogue."""
    import numpy as np

    env = {OUT: out, **{name: (np.float32(v) if np.isscalar(v) else v) for name, v in operands.items()}}
    results: dict[str, object] = {}
    # IEEE overflow, 1 / 0 = inf and 0 * inf = NaN are the kernels' semantics, not errors (as in
    # the reductions: evaluate.reduce_chunks); NumPy's warnings would be errors under -W error
    with np.errstate(all="ignore"):
        for statement in epilogue.statements:
            value = _evaluate(statement.value, env)
            # C order: a broadcast local (h = w) came out of astype in Fortran order, and NumPy
            # then summed a row's squares in another order by the number of rows evaluated together
            value = np.ascontiguousarray(np.broadcast_to(value, out.shape), dtype=np.float32)
            if statement.target == OUT or statement.target in operands:
                results[statement.target] = value
            else:
                env[statement.target] = value
    return results


def _evaluate(expr: ast.FExpr, env: Mapping[str, object]):
    import numpy as np

    if isinstance(expr, ast.FNumber):
        return np.float32(expr.value)
    if isinstance(expr, ast.FName):
        return env[expr.name]
    if isinstance(expr, ast.FNeg):
        return -_evaluate(expr.operand, env)
    if isinstance(expr, ast.FBinary):
        left, right = _evaluate(expr.left, env), _evaluate(expr.right, env)
        op = {ast.FloatOp.ADD: np.add, ast.FloatOp.SUB: np.subtract,
              ast.FloatOp.MUL: np.multiply, ast.FloatOp.DIV: np.divide}[expr.op]
        return op(left, right, dtype=np.float32)
    value, weight, eps = (_evaluate(arg, env) for arg in expr.args)
    # a value that does not vary along the row (a scalar, a literal) is still a row of them
    # C order, as above: each row's squares summed in one order however many rows there are
    value = np.ascontiguousarray(np.broadcast_to(np.asarray(value, dtype=np.float32), np.shape(env[OUT])))
    mean = np.mean(value * value, axis=-1, keepdims=True, dtype=np.float32)
    inv = np.float32(1.0) / np.sqrt(mean + np.float32(eps), dtype=np.float32)
    return (value * inv) * weight


def epilogue_from_json(data: Mapping) -> Epilogue:
    """The inverse of ``Epilogue.to_json`` (the statements are parsed back from their text)."""
    from purlinc.frontend.parse import parse

    decls = []
    for o in data["operands"]:
        decls.append(f"{o['kind']} {o['name']}" + (f": {o['dtype']}" if o["dtype"] else ""))
    body = "\n".join(data["statements"])
    text = f"collective e with {', '.join(decls)} {{ in[r] = x out[r] = x reduce epilogue rows(1) {{\n{body}\n}} }}"
    if not decls:
        text = text.replace(" with  ", " ")
    definition = parse(text, "<epilogue JSON>")
    epilogue = check_epilogue(definition, data["row"], {})
    return Epilogue(data["row"], epilogue.operands, epilogue.statements)
