"""Parse: .pln text -> AST (``CollectiveDef``) with source spans.

lark does the parsing (``lalr.parser``: LALR, so errors are reported at the first bad token);
this module turns its tree into frozen AST nodes, and ``syntax_errors`` turns its exceptions
into ``PurlinError`` with words a user knows instead of lark's terminal names.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import lark
from lark import Token, Transformer_NonRecursive, v_args

from purlinc.dtypes import FLOAT32_MAX, FLOAT32_TINY
from purlinc.errors import PurlinError, Source, Span
from purlinc.frontend import ast
from purlinc.frontend.lalr import parser
from purlinc.frontend.source import MAX_SOURCE_BYTES, located, read_source, too_large  # noqa: F401 (read_source: API)
from purlinc.frontend.syntax_errors import point, translate

# Integer literals: 2**63 is far beyond any chunk index, and Python refuses to convert
# more than 4300 digits anyway (ValueError), so long literals are refused here with a location.
MAX_LITERAL_DIGITS = 19
MAX_LITERAL = 2**63 - 1
MAX_NAME_LENGTH = 64  # characters of a collective's name (it names kernels, files and torch ops)


def _shown(token: Token) -> str:
    """A literal for a message: a long one cut in the middle."""
    unit = "digits" if token.isdigit() else "characters"
    return str(token) if len(token) <= 24 else f"{token[:12]}...{token[-6:]} ({len(token)} {unit})"


# Non-recursive: an expression of 500 nested unary minuses or a flat sum of 10,000 terms
# is as deep as it is long, far beyond Python's recursion limit.
class _ToAst(Transformer_NonRecursive):
    def __init__(self, source: Source):
        super().__init__()
        self._source = source

    def _span(self, meta) -> Span | None:
        if getattr(meta, "empty", True):
            return None
        return Span(self._source, meta.line, meta.column, meta.end_line, meta.end_column)

    def _token_span(self, token: Token) -> Span:
        return Span(self._source, token.line, token.column, token.end_line, token.end_column)

    # expressions
    def _literal(self, token: Token) -> int:
        if len(token) > MAX_LITERAL_DIGITS or int(token) > MAX_LITERAL:
            raise PurlinError(f"number {_shown(token)} is too large (at most {MAX_LITERAL})",
                              self._token_span(token))
        return int(token)

    def _float_literal(self, token: Token) -> float:
        """An epilogue literal, as float32 will hold it: one that rounds to infinity (1e39, or
        1e999, which is infinite already as a Python float) is refused, not computed with as inf."""
        value = float(token)
        try:
            struct.pack("<f", value)  # OverflowError where float32 rounds a finite value to inf
            overflows = math.isinf(value)
        except OverflowError:
            overflows = True
        if overflows:
            raise PurlinError(f"number {_shown(token)} is too large for float32 (at most {FLOAT32_MAX:.8g} in "
                              "magnitude)", self._token_span(token))
        # 1e-50: a nonzero written, 0 used.  Whether it is nonzero comes from the digits written:
        # 1e-400 is 0.0 already as a Python float
        written_nonzero = any(digit in "123456789" for digit in str(token).lower().partition("e")[0])
        if written_nonzero and struct.unpack("<f", struct.pack("<f", value))[0] == 0:
            raise PurlinError(f"number {_shown(token)} is too small for float32: it would be 0 (the smallest is "
                              f"{FLOAT32_TINY:.8g})", self._token_span(token))
        return value

    def number(self, children):
        (token,) = children
        return ast.Number(self._literal(token), self._token_span(token))

    def name(self, children):
        (token,) = children
        return ast.Name(str(token), self._token_span(token))

    @v_args(meta=True)
    def neg(self, meta, children):
        return ast.Negate(children[0], self._span(meta))

    def _binary(op):
        @v_args(meta=True)
        def build(self, meta, children):
            left, right = children
            return ast.Binary(op, left, right, self._span(meta))

        return build

    add = _binary(ast.BinaryOp.ADD)
    sub = _binary(ast.BinaryOp.SUB)
    mul = _binary(ast.BinaryOp.MUL)
    div = _binary(ast.BinaryOp.DIV)
    mod = _binary(ast.BinaryOp.MOD)

    # layouts
    @v_args(meta=True)
    def range(self, meta, children):
        lo, hi = children
        return ast.Range(lo, hi, self._span(meta))

    def index(self, children):
        return children[0]

    @v_args(meta=True)
    def chunk(self, meta, children):
        name, *indices = children
        return ast.ChunkRef(str(name), tuple(indices), self._span(meta))

    @v_args(meta=True)
    def loop(self, meta, children):
        variable, rng = children
        return ast.Loop(str(variable), rng, self._span(meta))

    @v_args(meta=True)
    def item(self, meta, children):
        chunk, *loops = children
        return ast.Item(chunk, tuple(loops), self._span(meta))

    def layout(self, children):
        return tuple(children)

    def buffer(self, children):
        (token,) = children
        return ast.Buffer(str(token)), self._token_span(token)

    @v_args(meta=True)
    def statement(self, meta, children):
        (buffer, _), rank, layout = children
        return ast.Assignment(buffer, rank, layout, self._span(meta))

    # epilogues
    def fnumber(self, children):
        (token,) = children
        return ast.FNumber(self._float_literal(token), str(token), self._token_span(token))

    def fname(self, children):
        (token,) = children
        return ast.FName(str(token), self._token_span(token))

    @v_args(meta=True)
    def fout(self, meta, children):
        return ast.FName("out", self._span(meta))

    @v_args(meta=True)
    def fneg(self, meta, children):
        return ast.FNeg(children[0], self._span(meta))

    def _fbinary(op):
        @v_args(meta=True)
        def build(self, meta, children):
            left, right = children
            return ast.FBinary(op, left, right, self._span(meta))

        return build

    fadd = _fbinary(ast.FloatOp.ADD)
    fsub = _fbinary(ast.FloatOp.SUB)
    fmul = _fbinary(ast.FloatOp.MUL)
    fdiv = _fbinary(ast.FloatOp.DIV)

    @v_args(meta=True)
    def fcall(self, meta, children):
        function, *args = children
        return ast.FCall(str(function), tuple(args), self._span(meta))

    def epilogue_target(self, children):
        (token,) = children
        return str(token), self._token_span(token)

    @v_args(meta=True)
    def epilogue_statement(self, meta, children):
        (target, target_span), value = children
        return ast.EpilogueAssign(target, value, self._span(meta), target_span)

    @v_args(meta=True)
    def epilogue(self, meta, children):
        row, *statements = children
        keyword = Span(self._source, meta.line, meta.column, meta.line, meta.column + len("epilogue"))
        return ast.EpilogueDef(row, tuple(statements), self._span(meta), keyword)

    def operand_kind(self, children):
        return ast.OperandKind(str(children[0]))

    @v_args(meta=True)
    def epilogue_operand(self, meta, children):
        kind, name, dtype = (*children, None)[:3]
        dtype_span = self._token_span(dtype) if dtype is not None else None
        return ast.OperandDecl(kind, str(name), None if dtype is None else str(dtype), self._span(meta), dtype_span)

    # header
    def collective_name(self, children):
        token = children[0]
        if len(token) > MAX_NAME_LENGTH:
            raise PurlinError(f"the collective's name is {len(token)} characters long, more than {MAX_NAME_LENGTH}",
                              self._token_span(token),
                              ("the name becomes part of kernel, file and torch op names; a file name has at most "
                               "255 bytes",))
        return str(token)

    def neg_int(self, children):
        return -self._literal(children[0])

    def signed_int(self, children):
        return self._literal(children[0])

    @v_args(meta=True)
    def param(self, meta, children):
        # `("=" signed_int)?` leaves no placeholder, so a parameter without a default has one child.
        name, default = (*children, None)[:2]
        return ast.Param(str(name), default, self._span(meta))

    def params(self, children):
        return tuple(p for p in children if p is not None)

    @v_args(meta=True)
    def condition(self, meta, children):
        left, compare, right = children
        return ast.Condition(left, ast.Compare(str(compare)), right, self._span(meta))

    def constraints(self, children):
        return ("constraints", tuple(children))

    def extent(self, children):
        return children[0]

    @v_args(meta=True)
    def sizes_operand(self, meta, children):
        name, *extents, chunk = children
        return ast.SizesOperand(str(name), tuple(extents), str(chunk), self._span(meta))

    def operands(self, children):
        return ("operands", tuple(children))

    @v_args(meta=True)
    def copy(self, meta, children):
        return ("operation", ast.Operation.COPY, bool(children and children[0]), self._span(meta))

    @v_args(meta=True)
    def reduce(self, meta, children):
        return ("operation", ast.Operation.REDUCE, False, self._span(meta))

    @v_args(meta=True)
    def collective(self, meta, children):
        name, *rest = children
        params: tuple = ()
        constraints: tuple = ()
        operands: tuple = ()
        statements = []
        operation = None
        epilogue = None
        for child in rest:
            if child is None:
                continue
            if isinstance(child, ast.EpilogueDef):
                epilogue = child
            elif isinstance(child, tuple) and child and child[0] == "operands":
                operands = child[1]
            elif isinstance(child, tuple) and child and child[0] == "constraints":
                constraints = child[1]
            elif isinstance(child, tuple) and child and child[0] == "operation":
                operation = child
            elif isinstance(child, ast.Assignment):
                statements.append(child)
            elif isinstance(child, tuple):
                params = child
        _, op, replicated, op_span = operation
        return ast.CollectiveDef(
            str(name), params, constraints, tuple(statements), op, replicated, self._span(meta), op_span,
            operands, epilogue,
        )

    def start(self, children):
        return children[0]


def parse(text: str, filename: str = "<string>") -> ast.CollectiveDef:
    """Parse one collective from ``text``; raise ``PurlinError`` pointing at the first mistake."""
    if len(text) > MAX_SOURCE_BYTES:
        raise too_large(len(text.encode("utf-8", "surrogatepass")), filename)
    text = text.removeprefix("\ufeff")  # a byte-order mark, as decode_source drops it from files
    source = Source(filename, text)
    nul = text.find("\x00")
    if nul >= 0:
        raise PurlinError("not a text file: it contains a NUL byte", located(source, nul))
    if not text.strip():
        raise PurlinError(
            "the file is empty; expected a collective such as 'collective name { in[r] = ... out[r] = ... copy }'",
            point(source, 1, 1),
        )
    try:
        tree = parser().parse(text)
    except lark.exceptions.LarkError as error:
        raise translate(error, source) from None
    try:
        return _ToAst(source).transform(tree)
    except lark.exceptions.VisitError as error:  # a PurlinError raised inside the transformer
        if isinstance(error.orig_exc, PurlinError):
            raise error.orig_exc from None
        raise


def parse_file(path: str | Path) -> ast.CollectiveDef:
    return parse(read_source(path), str(path))
