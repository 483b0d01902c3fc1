"""Parse: .pln text -> AST (``CollectiveDef``) with source spans.

lark does the parsing (LALR, so errors are reported at the first bad token); this module
turns its tree into frozen AST nodes and its exceptions into ``PurlinError`` with words a
user knows instead of lark's terminal names.
"""

from __future__ import annotations

import functools
import math
import re
import struct
from pathlib import Path

import lark
from lark import Lark, Token, Transformer_NonRecursive, v_args

from purlinc import settings
from purlinc.errors import PurlinError, Source, Span
from purlinc.resources import grammar_dir
from purlinc.frontend import ast
from purlinc.frontend.source import MAX_SOURCE_BYTES, located, read_source, too_large  # noqa: F401 (read_source: API)

# lark's terminal names, in words (anonymous terminals are named after their text).
_TOKEN_WORDS = {
    "NAME": "a name",
    "INT": "a number",
    "COMPARE": "a comparison (==, !=, <, <=, >, >=)",
    "REPLICATED": "'replicated'",
    "LBRACE": "'{'",
    "RBRACE": "'}'",
    "LSQB": "'['",
    "RSQB": "']'",
    "LPAR": "'('",
    "RPAR": "')'",
    "EQUAL": "'='",
    "COMMA": "','",
    "SEMICOLON": "';'",
    "PLUS": "'+'",
    "MINUS": "'-'",
    "STAR": "'*'",
    "SLASH": "'/'",
    "PERCENT": "'%'",
    "__ANON_0": "'..'",
    "FLOAT": "a decimal number",
    "COLON": "':'",
    "$END": "the end of the file",
}

# Chosen at call time, so a user who writes one where the operation goes gets a hint.
_REDUCE_OPS = ("sum", "prod", "max", "min")


@functools.cache
def _parser() -> Lark:
    grammar = grammar_dir().joinpath("purlin.lark").read_text(encoding="utf-8")
    # The basic lexer reserves keywords ('copy', 'in', ...) everywhere, so a misplaced keyword
    # is reported as such instead of being read as a chunk name.
    options = dict(parser="lalr", lexer="basic", propagate_positions=True, maybe_placeholders=True)
    # lark's analysis of the grammar takes ~0.2 s per process; its cache file records a hash of
    # the grammar and options and is only used when they match.
    if settings.cache_enabled():
        try:
            folder = settings.cache_dir()
            folder.mkdir(parents=True, exist_ok=True)
            return Lark(grammar, cache=str(folder / f"lark-{lark.__version__}.grammar"), **options)
        except OSError:
            pass
    return Lark(grammar, **options)


def _describe(terminal: str) -> str:
    if terminal in _TOKEN_WORDS:
        return _TOKEN_WORDS[terminal]
    parser = _parser()
    for definition in parser.terminals:
        if definition.name == terminal:
            pattern = definition.pattern
            if pattern.type == "str":
                return f"'{pattern.value}'"
    return terminal.lower()


def _expected_words(expected: set[str]) -> str:
    words = sorted({_describe(t) for t in expected})
    if len(words) > 8:
        words = words[:8] + ["..."]
    return ", ".join(words)


def _point(source: Source, line: int, column: int, width: int = 1) -> Span:
    return Span(source, line, column, line, column + max(width, 1))


def _end_of_text(source: Source) -> Span:
    r"""Just past the last character that is not white space.  Lines end at '\n' only, as the
    lexer and ``Source.line`` count them (str.splitlines would also end one at a form feed,
    '\x1c'-'\x1e', '\x85' or U+2028, and a lone '\r')."""
    lines = source.text.rstrip().split("\n")
    return _point(source, len(lines), len(lines[-1]) + 1)


def _expected(error: lark.exceptions.UnexpectedToken) -> set[str]:
    """The tokens that could stand where ``error``'s token does.

    lark's ``expected`` is the LALR state's lookahead set, which merges every context the
    state serves: after ``where R`` it offered ')', ',' and '..' (an index's followers), none
    of which can follow there.  Feeding each candidate to a copy of the parser keeps only the
    ones it would take."""
    parser = getattr(error, "interactive_parser", None)
    try:
        accepted = parser.accepts() if parser is not None else set()
    except lark.exceptions.LarkError:  # a message is still owed; lark's set is a superset
        accepted = set()
    return set(accepted) or set(error.expected)


def _translate(error: lark.exceptions.LarkError, source: Source) -> PurlinError:
    if isinstance(error, lark.exceptions.UnexpectedCharacters):
        char = source.text[error.pos_in_stream] if error.pos_in_stream < len(source.text) else ""
        return PurlinError(f"unexpected character {char!r}", _point(source, error.line, error.column),
                           _character_hints(source, error.pos_in_stream))
    if isinstance(error, lark.exceptions.UnexpectedEOF):
        return PurlinError(f"unexpected end of file; expected {_expected_words(set(error.expected))}",
                           _end_of_text(source))
    if isinstance(error, lark.exceptions.UnexpectedToken):
        token = error.token
        expected = _expected(error)
        if token.type == "$END":
            if expected == {"COLLECTIVE"}:
                return PurlinError("the file holds no collective, only comments", _point(source, 1, 1))
            # lark gives $END the position of the last token: point just past it, where the
            # missing text belongs (not past trailing comments and blank lines).
            end = _point(source, token.end_line, token.end_column) if token.end_line else _end_of_text(source)
            return PurlinError(f"unexpected end of file; expected {_expected_words(expected)}", end,
                               _hidden_by_a_comment(source, token.end_pos or 0))
        span = _point(source, token.line, token.column, len(str(token)))
        if token.type == "RBRACE" and {"COPY", "REDUCE"} <= expected:
            return PurlinError("missing the operation: a collective ends with 'copy' or 'reduce'", span)
        if token.type == "SLASH" and source.text.startswith("/*", token.start_pos):
            return PurlinError("unterminated comment: '/*' has no matching '*/'", _point(source, token.line, token.column, 2))
        if str(token) == "*" and token.start_pos and source.text.startswith("/*", token.start_pos - 1):
            # the '/' was taken as a division (after an operand); '/*' reaches the parser as
            # two tokens only when its comment never closes
            return PurlinError("unterminated comment: '/*' has no matching '*/'",
                               _point(source, token.line, token.column - 1, 2))
        if token.type == "NAME" and str(token) in _REDUCE_OPS and {"COPY", "REDUCE"} <= expected:
            return PurlinError(
                f"'{token}' is not an operation: a collective ends with 'copy' or 'reduce'",
                span,
                (f"the reduction operator ({', '.join(_REDUCE_OPS)}) is chosen at call time; write 'reduce'",),
            )
        located_better = _misplaced(token, source, expected)
        if located_better is not None:
            return located_better
        return PurlinError(f"unexpected {_found(token)}; expected {_expected_words(expected)}", span,
                           _case_hints(token, expected) + _header_hints(token, expected) + _order_hints(token, expected))
    return PurlinError(str(error))


def _found(token: Token) -> str:
    """A token as a message names it: `name 'x'`, `keyword 'copy'`, `'='`."""
    if token.type in ("NAME", "INT", "FLOAT"):
        word = {"NAME": "name", "INT": "number", "FLOAT": "decimal number"}[token.type]
        return f"{word} '{token}'"
    if str(token).isidentifier():
        return f"keyword '{token}'"  # reserved words cannot name chunks or variables
    return f"'{token}'"  # the text itself reads better than the terminal's description


# Characters an editor may show as a line break but the lexer does not (str.splitlines's, less
# '\n'): a '//' comment runs past them, to the next '\n'.
_LONE_BREAKS = re.compile(r"[\r\x0b\x0c\x1c-\x1e\x85\u2028\u2029](?!\n)[^\n]*?\S")
_BREAK_NAMES = {"\r": "carriage return", "\x0c": "form feed", "\x0b": "vertical tab"}


def _hidden_by_a_comment(source: Source, after: int) -> tuple[str, ...]:
    """A note when the end of the file came early because a '//' comment after offset
    ``after`` swallowed text behind a lone carriage return (a file with '\r' line ends shows
    its statements, but the lexer reads one line: the first '//' comment takes the rest)."""
    for comment in re.finditer(r"//[^\n]*", source.text[after:]):
        hidden = _LONE_BREAKS.search(comment.group())
        if hidden is not None:
            comment_at = located(source, after + comment.start())
            break_at = located(source, after + comment.start() + hidden.start())
            return (f"the '//' comment at {comment_at.line}:{comment_at.column} runs on past the "
                    f"{_BREAK_NAMES.get(hidden.group()[0], 'line separator')} at {break_at.line}:{break_at.column} "
                    "to the next '\\n', hiding the text after it (only '\\n' or '\\r\\n' ends a line)",)
    return ()


def _header_hints(token: Token, expected: set[str]) -> tuple[str, ...]:
    """A note for two slips in a header that the token lists alone do not explain."""
    if token.type == "EQUAL" and "COMPARE" in expected:
        return ("a condition compares with '==' ('=' assigns, in statements)",)
    if token.type == "WITH" and "LBRACE" in expected:
        if "WHERE" in expected:  # right after a `with` clause
            return ("declare every operand in one 'with' clause, separated by commas",)
        return ("the header's clauses come in this order: collective NAME(PARAMS) with OPERANDS where CONDITIONS {",)
    return ()


def _case_hints(token: Token, expected: set[str]) -> tuple[str, ...]:
    """`Copy`, `IN`, `Rows`: a keyword in other letters' case is a name to the lexer, and the
    message listing 'copy' beside the name does not say that case is the difference."""
    if token.type != "NAME":
        return ()
    word = f"'{str(token).lower()}'"
    if word != f"'{token}'" and word in {_describe(t) for t in expected}:
        return (f"keywords are lower case: {word}",)
    return ()


def _order_hints(token: Token, expected: set[str]) -> tuple[str, ...]:
    """A note when the body's parts come in the wrong order (statements, operation, epilogue)."""
    if token.type == "EPILOGUE" and {"COPY", "REDUCE"} <= expected:
        return ("the epilogue comes after the operation: '... reduce  epilogue rows(E) { ... }'",)
    if token.type in ("IN", "OUT") and "EPILOGUE" in expected:
        return ("the operation ('copy' or 'reduce') comes after every 'in[...]' and 'out[...]' statement",)
    return ()


def _character_hints(source: Source, offset: int) -> tuple[str, ...]:
    """A note for a character that is part of a name or number to the eye but not to the lexer:
    a letter outside ASCII (`hé`), a point with no digit after it (`1.`)."""
    char = source.text[offset] if offset < len(source.text) else ""
    if char.isidentifier() and not char.isascii():
        return ("names are ASCII: a letter or '_', then letters, digits or '_'",)
    if char == "." and offset > 0 and source.text[offset - 1].isdigit():
        after = source.text[offset + 1:offset + 2]
        if after.isidentifier():  # `0.R`: a range short of a point
            return ("a range has two points, as in 0..R",)
        return ("a decimal number has digits after its point, as in 1.0",)
    return ()


def _tokens_before(source: Source, offset: int) -> list[Token]:
    """The tokens of ``source`` that start before character ``offset``, or as many as lex (the
    text before a parse error always does; a bad character later on ends the list)."""
    tokens: list[Token] = []
    try:
        for token in _parser().lex(source.text):
            if token.start_pos >= offset:
                break
            tokens.append(token)
    except lark.exceptions.LarkError:
        pass
    return tokens


# Tokens that something must follow: a line that ends with one was cut short, whatever the next
# line holds.  After an operator, '=', ',' or an opening bracket, what is missing is a value; after
# a keyword ('for', 'with', ...) or the ':' of a dtype, the message lists what may follow.
# Punctuation by its text: lark names the grammar's '..' an anonymous terminal (__ANON_<n>, by
# the order it meets literals), so its type is no name to rely on.
_BEFORE_A_VALUE_TEXT = {"=", ",", "+", "-", "*", "/", "%", "..", "(", "["}
_NEEDS_MORE = {"COLON", "COLLECTIVE", "WITH", "WHERE", "SIZES", "OF", "IN", "FOR", "EPILOGUE", "ROWS", "ROW", "SCALAR"}
_VALUE_STARTS = {"NAME", "INT", "FLOAT", "OUT", "LPAR", "MINUS"}  # what an expression or a layout starts with
_VALUE_ENDS = {"NAME", "INT", "FLOAT", "OUT", "RPAR"}  # and what an epilogue expression ends with


def _misplaced(token: Token, source: Source, expected: set[str]) -> PurlinError | None:
    """A better message and place than "unexpected TOKEN" for the slips where the parser stops
    after the mistake: a line cut short, an operator missing in an epilogue, a statement
    without its buffer, an empty epilogue.  None where the plain message stands."""
    before = _tokens_before(source, token.start_pos)
    for diagnose in (_cut_at_line_end, _unclosed_at_line_end, _missing_operator, _missing_buffer, _empty_epilogue):
        error = diagnose(token, before, source, expected)
        if error is not None:
            return error
    return None


def _cut_at_line_end(token: Token, before: list[Token], source: Source, expected: set[str]) -> PurlinError | None:
    """`h =` with its value missing, then `residual = h` on the next line.

    Statements need no separator, so the parser reads on into the next line and stops at its
    first token that cannot continue the value (the `out` of `out[r] = ...`) or, in an epilogue,
    only at the next statement's '=', having taken its target (`residual`) as the value.  The
    text is missing at the end of the earlier line, after its '=', operator or ','; point there."""
    if before and _cut_before(before[-1], token):
        return _missing_after(before[-1], source, expected)
    if token.type == "EQUAL" and len(before) >= 2 and before[-1].type in ("NAME", "OUT") \
            and _cut_before(before[-2], before[-1]):
        return _missing_after(before[-2], source, _accepts_after(source, before[-2]))
    return None


_CLOSING = {"LSQB": "RSQB", "LPAR": "RPAR", "LBRACE": "RBRACE"}


def _unclosed_at_line_end(token: Token, before: list[Token], source: Source, expected: set[str]) -> PurlinError | None:
    """`in[r] = x[0..R` with its ']' (or an epilogue's ')') missing: the next line's first token
    is where the parser stops, but the bracket was left open on the line above; point at the
    end of that line and name the bracket that is open."""
    if not before or token.line <= before[-1].end_line:
        return None
    opened: list[Token] = []
    for t in before:  # the brackets still open where the parser stopped, innermost last
        if t.type in _CLOSING:
            opened.append(t)
        elif opened and t.type == _CLOSING[opened[-1].type]:
            opened.pop()
    if not opened or opened[-1].type == "LBRACE" or _CLOSING[opened[-1].type] not in expected:
        return None
    bracket, last = opened[-1], before[-1]
    closing = "]" if bracket.type == "LSQB" else ")"
    return PurlinError(f"the '{bracket}' at {bracket.line}:{bracket.column} is not closed at the end of the line; "
                       f"expected {_expected_words(expected)}", _point(source, last.end_line, last.end_column),
                       (f"a '{closing}' goes here, or the line goes on",))


def _cut_before(last: Token, following: Token) -> bool:
    return (_before_a_value(last) or last.type in _NEEDS_MORE) and following.line > last.end_line


def _before_a_value(token: Token) -> bool:
    return str(token) in _BEFORE_A_VALUE_TEXT or token.type == "COMPARE"


def _accepts_after(source: Source, token: Token) -> set[str]:
    """The tokens the parser would take right after ``token``, the text before it being valid."""
    try:
        parser = _parser().parse_interactive(source.text[:token.end_pos])
        parser.exhaust_lexer()
        return set(parser.accepts()) - {"$END"}
    except lark.exceptions.LarkError:
        return set()


def _missing_after(last: Token, source: Source, expected: set[str]) -> PurlinError | None:
    if not expected:
        return None
    span = _point(source, last.end_line, last.end_column)  # just past the token, where the text is missing
    words = _expected_words(expected)
    if _before_a_value(last) and expected <= _VALUE_STARTS:
        return PurlinError(f"missing a value after '{last}' at the end of the line; expected {words}", span)
    return PurlinError(f"the line ends after '{last}'; expected {words}", span)


def _missing_operator(token: Token, before: list[Token], source: Source, expected: set[str]) -> PurlinError | None:
    """`out = out residual`: an epilogue's statements need no separator, so a name after a
    complete expression starts the next statement, and the parser stops only after it, where
    '=' does not follow (often on the next line).  The slip is between the two operands."""
    if expected != {"EQUAL"} or len(before) < 2:
        return None
    last, target = before[-2], before[-1]
    if target.type not in ("NAME", "OUT") or last.type not in _VALUE_ENDS or target.line != last.end_line:
        return None
    if last.type in ("INT", "FLOAT") and last.end_pos == target.start_pos:
        return _not_a_number(last, target, source)
    return PurlinError(f"missing an operator before '{target}'; expected '*', '+', '-', '/'",
                       _point(source, target.line, target.column, len(target)),
                       (f"or, if '{target}' starts a new statement, '=' after it",))


def _not_a_number(number: Token, name: Token, source: Source) -> PurlinError:
    """`1e` or `2x`: a number run into a name, which the lexer splits in two."""
    text = f"{number}{name}"
    notes = ("an exponent needs digits, as in 1e-6",) if name[0] in "eE" else ()
    return PurlinError(f"'{text}' is not a number", _point(source, number.line, number.column, len(text)), notes)


def _missing_buffer(token: Token, before: list[Token], source: Source, expected: set[str]) -> PurlinError | None:
    """`[r] = x` on a line of its own: without its 'in' or 'out', the index reads as one more
    index of the chunk that ends the line above, and the parser stops only at the '='."""
    if token.type != "EQUAL" or "COPY" not in expected:
        return None
    line = [t for t in before if t.line == token.line]
    if not line or line[0].type != "LSQB" or len(line) == len(before):
        return None
    return PurlinError("missing 'in' or 'out' before '['; a statement reads 'in[RANK] = LAYOUT' or "
                       "'out[RANK] = LAYOUT'", _point(source, line[0].line, line[0].column))


def _empty_epilogue(token: Token, before: list[Token], source: Source, expected: set[str]) -> PurlinError | None:
    """`epilogue rows(E) { }`: a '}' stands where the first statement's target does."""
    if token.type != "RBRACE" or expected != {"NAME", "OUT"}:
        return None
    keyword = next((t for t in reversed(before) if t.type == "EPILOGUE"), token)
    return PurlinError("the epilogue is empty: assign out or a rows operand, or remove the epilogue",
                       _point(source, keyword.line, keyword.column, len(keyword)))


# Integer literals: 2**63 is far beyond any chunk index, and Python refuses to convert
# more than 4300 digits anyway (ValueError), so long literals are refused here with a location.
MAX_LITERAL_DIGITS = 19
MAX_LITERAL = 2**63 - 1
MAX_NAME_LENGTH = 64  # characters of a collective's name (it names kernels, files and torch ops)
FLOAT32_TINY = 1.401298464324817e-45  # the smallest positive float32 (a subnormal)
FLOAT32_MAX = 3.4028234663852886e38  # epilogues compute in float32 (docs/LANGUAGE.md, "Epilogues")


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
            _point(source, 1, 1),
        )
    try:
        tree = _parser().parse(text)
    except lark.exceptions.LarkError as error:
        raise _translate(error, source) from None
    try:
        return _ToAst(source).transform(tree)
    except lark.exceptions.VisitError as error:  # a PurlinError raised inside the transformer
        if isinstance(error.orig_exc, PurlinError):
            raise error.orig_exc from None
        raise


def parse_file(path: str | Path) -> ast.CollectiveDef:
    return parse(read_source(path), str(path))
