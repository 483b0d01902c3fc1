"""lark's exceptions -> ``PurlinError`` in a user's words, at the place a human would point.

lark (LALR) stops at the first token it cannot take, which is often past the mistake: a line
cut short is reported at the next line's first token, a missing operator after the operand
that follows it.  ``translate`` names the tokens in words instead of lark's terminal names,
and for the slips it recognises moves the location back to where the text is wrong
(``_misplaced``) and adds a note (``_*_hints``).
"""

from __future__ import annotations

import re

import lark
from lark import Token

from purlinc.errors import PurlinError, Source, Span
from purlinc.frontend.lalr import parser as lark_parser
from purlinc.frontend.source import located

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
    "FLOAT": "a decimal number",
    "COLON": "':'",
    "$END": "the end of the file",
}

# Chosen at call time, so a user who writes one where the operation goes gets a hint.
_REDUCE_OPS = ("sum", "prod", "max", "min")


def _describe(terminal: str) -> str:
    if terminal in _TOKEN_WORDS:
        return _TOKEN_WORDS[terminal]
    parser = lark_parser()
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


def point(source: Source, line: int, column: int, width: int = 1) -> Span:
    return Span(source, line, column, line, column + max(width, 1))


def _end_of_text(source: Source) -> Span:
    r"""Just past the last character that is not white space.  Lines end at '\n' only, as the
    lexer and ``Source.line`` count them (str.splitlines would also end one at a form feed,
    '\x1c'-'\x1e', '\x85' or U+2028, and a lone '\r')."""
    lines = source.text.rstrip().split("\n")
    return point(source, len(lines), len(lines[-1]) + 1)


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


def translate(error: lark.exceptions.LarkError, source: Source) -> PurlinError:
    translated = _translate(error, source)
    if isinstance(error, lark.exceptions.UnexpectedToken):
        at = len(source.text) if error.token.type == "$END" else error.token.start_pos
        for note in _floor_division_hints(source, at):
            translated = translated.with_note(note)
    return translated


def _translate(error: lark.exceptions.LarkError, source: Source) -> PurlinError:
    if isinstance(error, lark.exceptions.UnexpectedCharacters):
        char = source.text[error.pos_in_stream] if error.pos_in_stream < len(source.text) else ""
        return PurlinError(f"unexpected character {char!r}", point(source, error.line, error.column),
                           _character_hints(source, error.pos_in_stream))
    if isinstance(error, lark.exceptions.UnexpectedEOF):
        return PurlinError(f"unexpected end of file; expected {_expected_words(set(error.expected))}",
                           _end_of_text(source))
    if isinstance(error, lark.exceptions.UnexpectedToken):
        token = error.token
        expected = _expected(error)
        if token.type == "$END":
            if expected == {"COLLECTIVE"}:
                return PurlinError("the file holds no collective, only comments", point(source, 1, 1))
            # lark gives $END the position of the last token: point just past it, where the
            # missing text belongs (not past trailing comments and blank lines).
            end = point(source, token.end_line, token.end_column) if token.end_line else _end_of_text(source)
            unclosed = _unclosed_brace(_tokens_before(source, len(source.text)), expected)
            if unclosed is not None:
                return PurlinError(f"the '{{' at {unclosed.line}:{unclosed.column} is not closed at the end of the file; "
                                   f"expected {_expected_words(expected)}", end,
                                   ("a '}' goes here",) + _hidden_by_a_comment(source, token.end_pos or 0))
            return PurlinError(f"unexpected end of file; expected {_expected_words(expected)}", end,
                               _hidden_by_a_comment(source, token.end_pos or 0))
        span = point(source, token.line, token.column, len(str(token)))
        if token.type == "RBRACE" and {"COPY", "REDUCE"} <= expected:
            return PurlinError("missing the operation: a collective ends with 'copy' or 'reduce'", span)
        if token.type == "SLASH" and source.text.startswith("/*", token.start_pos):
            return PurlinError("unterminated comment: '/*' has no matching '*/'", point(source, token.line, token.column, 2))
        if str(token) == "*" and token.start_pos and source.text.startswith("/*", token.start_pos - 1):
            # the '/' was taken as a division (after an operand); '/*' reaches the parser as
            # two tokens only when its comment never closes
            return PurlinError("unterminated comment: '/*' has no matching '*/'",
                               point(source, token.line, token.column - 1, 2))
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


def _floor_division_hints(source: Source, at: int) -> tuple[str, ...]:
    """A note when the parser stopped (at offset ``at``) right after a '//' comment that follows
    an operand, and the text parses with '/' in its place: `x[r // 2]` is Python's floor
    division to its writer, but here '//' starts a comment, so the rest of the line was never
    read and the message names a place ("unexpected end of file") the writer cannot see."""
    before = _tokens_before(source, at)
    if not before or before[-1].type not in _VALUE_ENDS:
        return ()
    last = before[-1]
    gap = source.text[last.end_pos:at]
    spaces = len(gap) - len(gap.lstrip(" \t"))
    if not gap.startswith("//", spaces):
        return ()
    slash = last.end_pos + spaces
    divided = source.text[:slash] + "/" + source.text[slash + 2:]
    try:
        lark_parser().parse(divided)
    except lark.exceptions.UnexpectedInput as error:
        if (getattr(error, "pos_in_stream", None) or 0) < at:  # no further with '/': not what went wrong
            return ()
    except lark.exceptions.LarkError:
        return ()
    comment = located(source, slash)
    return (f"the '//' at {comment.line}:{comment.column} starts a comment, to the end of the line, so the parser "
            "did not read what follows it; division is '/', and it already floors (as Python's '//' does)",)


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
    if char == "." and _number_before(source.text, offset):
        after = source.text[offset + 1:]
        if re.match(r"[eE][-+]?\d", after):  # `1.e-3`
            return ("a decimal number has digits after its point, as in 1.0e-3",)
        if after[:1].isidentifier():  # `0.R`: a range short of a point
            return ("a range has two points, as in 0..R",)
        return ("a decimal number has digits after its point, as in 1.0",)
    return ()


def _number_before(text: str, offset: int) -> bool:
    """Whether the word that ends at ``offset`` is a number (`12`), not a name ending in digits
    (`x1`): only a number's point has these readings."""
    word = re.search(r"\w*$", text[:offset]).group()
    return word != "" and word.isdigit()


def _tokens_before(source: Source, offset: int) -> list[Token]:
    """The tokens of ``source`` that start before character ``offset``, or as many as lex (the
    text before a parse error always does; a bad character later on ends the list)."""
    tokens: list[Token] = []
    try:
        for token in lark_parser().lex(source.text):
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
    for diagnose in (_cut_at_line_end, _unclosed_at_line_end, _unclosed_before_collective, _missing_operator, _missing_buffer, _empty_epilogue):
        error = diagnose(token, before, source, expected)
        if error is not None:
            return error
    return None


def _cut_at_line_end(token: Token, before: list[Token], source: Source, expected: set[str]) -> PurlinError | None:
    """`h =` with its value missing, then `residual = h` on the next line.

    Statements need no separator, so the parser reads on into the next line and stops at its
    first token that cannot continue the value (the `out` of `out[r] = ...`) or, in an epilogue,
    only at the next statement's '=', having taken its target (`residual`) as the value.  The
    text is missing at the end of the earlier line, after its '=', operator or ','; point there.
    Only where the next line starts something new: a continuation with a slip of its own
    (`x[0],` then `[1]`) keeps the plain message at that slip."""
    if before and token.type in _STARTS_SOMETHING and _cut_before(before[-1], token):
        return _missing_after(before[-1], source, expected)
    if token.type == "EQUAL" and len(before) >= 2 and before[-1].type in ("NAME", "OUT") \
            and _before_a_value(before[-2]) and _cut_before(before[-2], before[-1]):
        return _missing_after(before[-2], source, _accepts_after(source, before[-2]))
    return None


# Tokens that begin a statement, the operation, the epilogue, the body or its end: the first
# token of a line that is not the continuation of the line above.
_STARTS_SOMETHING = {"IN", "OUT", "COPY", "REDUCE", "EPILOGUE", "LBRACE", "RBRACE"}


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
                       f"expected {_expected_words(expected)}", point(source, last.end_line, last.end_column),
                       (f"a '{closing}' goes here, or the line goes on",))


def _unclosed_brace(before: list[Token], expected: set[str]) -> Token | None:
    """The '{' still open after ``before`` (the innermost), where a '}' may come next; None if none is."""
    if "RBRACE" not in expected:
        return None
    opened = []
    for t in before:
        if t.type == "LBRACE":
            opened.append(t)
        elif t.type == "RBRACE" and opened:
            opened.pop()
    return opened[-1] if opened else None


def _unclosed_before_collective(token: Token, before: list[Token], source: Source,
                                expected: set[str]) -> PurlinError | None:
    """A body whose '}' is missing, then the next `collective`: the parser stops at that keyword,
    but the '}' belongs at the end of the text before it."""
    if token.type != "COLLECTIVE" or not before:
        return None
    brace = _unclosed_brace(before, expected)
    if brace is None:
        return None
    last = before[-1]
    return PurlinError(f"the '{{' at {brace.line}:{brace.column} is not closed before the next collective "
                       f"(at {token.line}:{token.column}); expected {_expected_words(expected)}",
                       point(source, last.end_line, last.end_column), ("a '}' goes here",))


def _cut_before(last: Token, following: Token) -> bool:
    return (_before_a_value(last) or last.type in _NEEDS_MORE) and following.line > last.end_line


def _before_a_value(token: Token) -> bool:
    return str(token) in _BEFORE_A_VALUE_TEXT or token.type == "COMPARE"


def _accepts_after(source: Source, token: Token) -> set[str]:
    """The tokens the parser would take right after ``token``, the text before it being valid."""
    try:
        parser = lark_parser().parse_interactive(source.text[:token.end_pos])
        parser.exhaust_lexer()
        return set(parser.accepts()) - {"$END"}
    except lark.exceptions.LarkError:
        return set()


def _missing_after(last: Token, source: Source, expected: set[str]) -> PurlinError | None:
    if not expected:
        return None
    span = point(source, last.end_line, last.end_column)  # just past the token, where the text is missing
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
                       point(source, target.line, target.column, len(target)),
                       (f"or, if '{target}' starts a new statement, '=' after it",))


def _not_a_number(number: Token, name: Token, source: Source) -> PurlinError:
    """`1e` or `2x`: a number run into a name, which the lexer splits in two."""
    text = f"{number}{name}"
    notes = ("an exponent needs digits, as in 1e-6",) if name[0] in "eE" else ()
    return PurlinError(f"'{text}' is not a number", point(source, number.line, number.column, len(text)), notes)


def _missing_buffer(token: Token, before: list[Token], source: Source, expected: set[str]) -> PurlinError | None:
    """`[r] = x` on a line of its own: without its 'in' or 'out', the index reads as one more
    index of the chunk that ends the line above, and the parser stops only at the '='."""
    if token.type != "EQUAL" or "COPY" not in expected:
        return None
    line = [t for t in before if t.line == token.line]
    if not line or line[0].type != "LSQB" or len(line) == len(before):
        return None
    return PurlinError("missing 'in' or 'out' before '['; a statement reads 'in[RANK] = LAYOUT' or "
                       "'out[RANK] = LAYOUT'", point(source, line[0].line, line[0].column))


def _empty_epilogue(token: Token, before: list[Token], source: Source, expected: set[str]) -> PurlinError | None:
    """`epilogue rows(E) { }`: a '}' stands where the first statement's target does."""
    if token.type != "RBRACE" or expected != {"NAME", "OUT"}:
        return None
    keyword = next((t for t in reversed(before) if t.type == "EPILOGUE"), token)
    return PurlinError("the epilogue is empty: assign out or a rows operand, or remove the epilogue",
                       point(source, keyword.line, keyword.column, len(keyword)))
