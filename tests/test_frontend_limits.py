"""The frontend at its edges: epilogue expressions too deep for any later stage, line breaks
other than '\\n', a byte-order mark, wide characters before a caret, and the messages of
mistakes in ``with`` clauses and literals.  Every case is a located ``PurlinError`` (or, from
the CLI, exit status 2 and no traceback)."""

from __future__ import annotations

import pytest

from purlinc.errors import PurlinError, Source, Span
from purlinc.frontend.check import check
from purlinc.frontend.parse import parse, parse_file
from purlinc.frontend.source import decode_source


def diagnose(source: str, world_size: int = 2, filename: str = "spec.pln") -> PurlinError:
    with pytest.raises(PurlinError) as info:
        check(parse(source, filename), world_size)
    return info.value


def lines(error: PurlinError) -> list[str]:
    return error.render().splitlines()


# --- 2. line breaks: only '\n' ends a line, as the lexer and Source count ------------------

@pytest.mark.parametrize("separator", ["\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\x0b"])
def test_end_of_file_after_other_line_separators(separator):
    source = f"// a{separator} b\ncollective a {{\n    in[r] = x[r]\n    out[r] = x[0..R]\n    copy\n"
    error = diagnose(source)
    assert lines(error) == [
        "spec.pln:5:9: error: unexpected end of file; expected ';', 'epilogue', 'replicated', '}'",
        "        copy",
        "            ^",
    ]


def test_end_of_file_points_after_the_last_token_not_a_comment():
    source = "collective a {\n    in[r] = x[r]\n    out[r] = x[0..R]\n    copy  // done\n\n\n"
    assert lines(diagnose(source))[:3] == [
        "spec.pln:4:9: error: unexpected end of file; expected ';', 'epilogue', 'replicated', '}'",
        "        copy  // done",
        "            ^",
    ]


def test_carriage_returns_alone_do_not_end_lines():
    """A file of '\\r' line ends is one line to the lexer and to every message (not 3:9 for
    one error and 1:N for the next)."""
    eof = diagnose("collective a {\r    in[r] = x[r]\r    out[r] = x[0..R]\r    copy\r")
    assert lines(eof)[0] == ("spec.pln:1:62: error: unexpected end of file; "
                             "expected ';', 'epilogue', 'replicated', '}'")
    other = diagnose("collective a {\r    in[r] = x[r]\r    out[r] = y[0..R]\r    copy\r}\r")
    assert lines(other)[0].startswith("spec.pln:1:46: error: output chunk y[0]")


# --- 3. a UTF-8 byte-order mark ----------------------------------------------------------

ALLGATHER = "collective a {\n    in[r] = x[r]\n    out[r] = x[0..R]\n    copy\n}\n"


def test_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.pln"
    path.write_bytes(b"\xef\xbb\xbf" + ALLGATHER.encode())
    assert parse_file(path) == parse(ALLGATHER)
    assert decode_source(b"\xef\xbb\xbf" + ALLGATHER.encode(), "bom.pln") == ALLGATHER


def test_byte_order_mark_keeps_columns(tmp_path):
    path = tmp_path / "bom.pln"
    path.write_bytes(b"\xef\xbb\xbfcollective a { in[r] = x[r] out[r] = y copy }\n")
    with pytest.raises(PurlinError) as info:
        check(parse_file(path), 2)
    assert lines(info.value)[:3] == [
        f"{path}:1:38: error: output chunk y of rank 0 has no producer: no input names it",
        "    collective a { in[r] = x[r] out[r] = y copy }",
        "    " + " " * 37 + "^",
    ]


def test_byte_order_mark_then_bad_byte_keeps_column_and_offset():
    with pytest.raises(PurlinError) as info:
        decode_source(b"\xef\xbb\xbfcollective \xff", "f.pln")
    assert lines(info.value) == [
        "f.pln:1:12: error: not UTF-8 text: byte 0xff (at byte offset 14)",
        "    collective \ufffd",
        "               ^",
    ]


# --- 4. the caret under wide characters ----------------------------------------------------

@pytest.mark.parametrize("prefix", ["\U0001f680\U0001f680", "\u65e5\u672c\u8a9e", "\uff21\uff22"])
def test_caret_lines_up_after_wide_characters(prefix):
    source = f"collective a {{ /* {prefix} */ in[r] = x[r] out[r] = z copy }}\n"
    error = diagnose(source)
    column = source.index("z") + 1  # the reported column counts characters
    assert error.span.column == column
    text, caret = lines(error)[1:3]
    width = 2 * len(prefix)  # every character of the prefix takes two cells
    assert caret == "    " + " " * (column - 1 - len(prefix) + width) + "^"
    assert text == "    " + source.rstrip("\n")


def test_caret_under_a_wide_character_is_two_cells_wide():
    error = PurlinError("m", Span(Source("f.pln", "a\u65e5b\n"), 1, 2, 1, 3))
    assert lines(error)[1:] == ["    a\u65e5b", "     ^^"]


def test_tab_stops_count_display_cells():
    error = PurlinError("m", Span(Source("f.pln", "\u65e5\tz\n"), 1, 3, 1, 4))
    assert lines(error)[1:] == ["    \u65e5  z", "        ^"]
