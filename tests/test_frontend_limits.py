"""The frontend at its edges: epilogue expressions too deep for any later stage, line breaks
other than '\\n', a byte-order mark, wide characters before a caret, and the messages of
mistakes in ``with`` clauses and literals.  Every case is a located ``PurlinError`` (or, from
the CLI, exit status 2 and no traceback).  And the parser's tables in the cache directory: a
damaged file, or something other than a file, is rebuilt, never a crash or a hang."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from purlinc.cli import main
from purlinc.errors import PurlinError, Source, Span
from purlinc.frontend.check import check
from purlinc.frontend.epilogue import MAX_DEPTH, MAX_OPERATIONS
from purlinc.frontend.parse import parse, parse_file
from purlinc.frontend.source import decode_source

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def diagnose(source: str, world_size: int = 2, filename: str = "spec.pln") -> PurlinError:
    with pytest.raises(PurlinError) as info:
        check(parse(source, filename), world_size)
    return info.value


def lines(error: PurlinError) -> list[str]:
    return error.render().splitlines()


def fused(body: str, header: str = "") -> str:
    """A reducing collective whose epilogue's only statement is ``body`` (on line 6)."""
    return (f"collective e(hidden = 8){header} {{\n    in[r] = x\n    out[r] = x\n    reduce\n"
            f"    epilogue rows(hidden) {{\n        {body}\n    }}\n}}\n")


# --- 1. epilogue expressions nest at most MAX_DEPTH levels --------------------------------

LONG_SUM = fused("out = " + " + ".join(["out"] * 1000))
MANY_MINUSES = fused("out = " + "-" * 3000 + "out")


@pytest.mark.parametrize("source, depth", [(LONG_SUM, 999), (MANY_MINUSES, 3000)], ids=["sum", "minuses"])
def test_deep_epilogue_expression_is_refused_at_check(source, depth):
    error = diagnose(source)
    assert lines(error)[0] == (f"spec.pln:6:15: error: this expression nests {depth} operations deep; "
                               f"an epilogue expression nests at most {MAX_DEPTH}")
    assert lines(error)[2].startswith(" " * 18 + "^")
    assert any("split it with locals" in note for note in error.notes)


@pytest.mark.parametrize("source", [LONG_SUM, MANY_MINUSES], ids=["sum", "minuses"])
@pytest.mark.parametrize("argv", [["check", "--spec-only", "-R", "1..4"], ["dump", "--stage", "cuda", "-R", "2"],
                                  ["dump", "--stage", "spec", "-R", "2"]], ids=["check", "cuda", "spec"])
def test_deep_epilogue_expression_from_the_cli(tmp_path, capsys, source, argv):
    path = tmp_path / "deep.pln"
    path.write_text(source)
    code = main([argv[0], str(path), *argv[1:]])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"{path}:6:15: error: this expression nests ") and "Traceback" not in err


@pytest.mark.parametrize("source", [LONG_SUM, MANY_MINUSES], ids=["sum", "minuses"])
def test_deep_epilogue_expression_prints_as_ast(tmp_path, capsys, source):
    """The parse stage prints what was written, however deep (printing is not recursive)."""
    path = tmp_path / "deep.pln"
    path.write_text(source)
    assert main(["dump", str(path), "--stage", "ast"]) == 0
    out = capsys.readouterr().out
    assert source.splitlines()[5].strip() in out


def test_epilogue_expression_at_the_limit_is_accepted():
    terms = " + ".join(["out"] * (MAX_DEPTH + 1))  # MAX_DEPTH additions
    spec = check(parse(fused(f"out = {terms}")), 2)
    assert spec.epilogue.statements[0].format() == f"out = {terms}"
    nested = fused("out = " + "-" * (MAX_DEPTH - 1) + "(out * out)")
    assert check(parse(nested), 2).epilogue is not None


def test_epilogue_at_the_limit_generates_cuda(tmp_path, capsys):
    """Every later stage (the spec and schedule printers, the CUDA emitter) takes what the
    checker lets through."""
    terms = " + ".join(["out"] * (MAX_DEPTH + 1))
    source = ("collective e(hidden = 8) with row w {\n    in[r] = x\n    out[r] = x\n    reduce\n"
              f"    epilogue rows(hidden) {{\n        a = {terms}\n        b = {'-' * (MAX_DEPTH - 1)}(a / out)\n"
              f"        out = b * {'-' * (MAX_DEPTH - 2)}rmsnorm(out, w, 1e-6)\n    }}\n}}\n")
    path = tmp_path / "limit.pln"
    path.write_text(source)
    for stage in ("spec", "snac", "cuda"):
        assert main(["dump", str(path), "--stage", stage, "-R", "2"]) == 0, capsys.readouterr().err
    assert "rsqrt" in capsys.readouterr().out


def test_depth_counts_calls_and_parentheses_add_nothing():
    header = " with row w"
    deep = "-" * (MAX_DEPTH - 1) + "rmsnorm(out, w, 1e-6)"
    assert check(parse(fused(f"out = {deep}", header)), 2).epilogue is not None
    error = diagnose(fused(f"out = -{deep}", header))
    assert f"nests {MAX_DEPTH + 1} operations deep" in error.message
    parenthesized = fused("out = " + "(" * 200 + "out" + ")" * 200)
    assert check(parse(parenthesized), 2).epilogue is not None


def test_an_epilogue_holds_a_bounded_number_of_operations():
    """Each statement within the depth and statement bounds, yet 8,000 operations in all: NVRTC
    took over five minutes on such an epilogue's kernels."""
    def body(locals_: int) -> str:  # a0 = 1 operation, each later local 63 (32 products summed)
        chain = [f"a{i} = " + " + ".join([f"a{i - 1} * out"] * 32) for i in range(1, locals_)]
        return "\n        ".join(["a0 = out * 2", *chain, f"out = a{locals_ - 1}"])

    assert 1 + 16 * 63 <= MAX_OPERATIONS < 1 + 17 * 63
    assert check(parse(fused(body(17))), 2).epilogue is not None  # 1,009 operations
    error = diagnose(fused(body(18)))
    assert error.message == f"the epilogue holds more than {MAX_OPERATIONS:,} operations (1,072 up to this statement)"
    assert (error.span.line, error.span.column) == (6 + 17, 15)  # the statement that crosses it, a17's value


# --- 2. line breaks: only '\n' ends a line, as the lexer and Source count ------------------

@pytest.mark.parametrize("separator", ["\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\x0b"])
def test_end_of_file_after_other_line_separators(separator):
    source = f"// a{separator} b\ncollective a {{\n    in[r] = x[r]\n    out[r] = x[0..R]\n    copy\n"
    error = diagnose(source)
    assert lines(error) == [
        "spec.pln:5:9: error: the '{' at 2:14 is not closed at the end of the file; expected ';', 'epilogue', 'replicated', '}'",
        "        copy",
        "            ^",
        "note: a '}' goes here",
    ]


def test_end_of_file_points_after_the_last_token_not_a_comment():
    source = "collective a {\n    in[r] = x[r]\n    out[r] = x[0..R]\n    copy  // done\n\n\n"
    assert lines(diagnose(source)) == [
        "spec.pln:4:9: error: the '{' at 1:14 is not closed at the end of the file; expected ';', 'epilogue', "
        "'replicated', '}'",
        "        copy  // done",
        "            ^",
        "note: a '}' goes here",
    ]


def test_carriage_returns_alone_do_not_end_lines():
    """A file of '\\r' line ends is one line to the lexer and to every message (not 3:9 for
    one error and 1:N for the next)."""
    eof = diagnose("collective a {\r    in[r] = x[r]\r    out[r] = x[0..R]\r    copy\r")
    assert lines(eof)[0] == ("spec.pln:1:62: error: the '{' at 1:14 is not closed at the end of the file; "
                             "expected ';', 'epilogue', 'replicated', '}'")
    other = diagnose("collective a {\r    in[r] = x[r]\r    out[r] = y[0..R]\r    copy\r}\r")
    assert lines(other)[0].startswith("spec.pln:1:46: error: output chunk y[0]")


def test_a_comment_that_hides_the_rest_of_a_carriage_return_file_says_so():
    """With '\\r' line ends the first '//' comment takes the rest of the file; the end of the
    file then came "early" with nothing to say why the statements an editor shows are gone."""
    source = "collective a {\r    in[r] = x[r]  // gives x[r]\r    out[r] = x[0..R]\r    copy\r}\r"
    assert lines(diagnose(source)) == [
        "spec.pln:1:32: error: unexpected end of file; expected ',', ';', '[', 'copy', 'for', 'in', 'out', 'reduce'",
        "    collective a {\ufffd    in[r] = x[r]  // gives x[r]\ufffd    out[r] = x[0..R]\ufffd    copy\ufffd}",
        "                                   ^",
        "note: the '//' comment at 1:34 runs on past the carriage return at 1:47 to the next '\\n', hiding the text "
        "after it (only '\\n' or '\\r\\n' ends a line)",
    ]


@pytest.mark.parametrize("tail", ["  // done\r\n", "  // done\r\r\n", "  // done\r  \n"], ids=["crlf", "cr-crlf", "cr-blank"])
def test_a_comment_ending_in_carriage_returns_hides_nothing(tail):
    error = diagnose("collective a {\r\n    in[r] = x[r]\r\n    out[r] = x[0..R]\r\n    copy" + tail)
    assert error.message.startswith("the '{' at 1:14 is not closed at the end of the file")
    assert error.notes == ("a '}' goes here",)


# --- 3. a UTF-8 byte-order mark ----------------------------------------------------------

ALLGATHER = "collective a {\n    in[r] = x[r]\n    out[r] = x[0..R]\n    copy\n}\n"


def test_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.pln"
    path.write_bytes(b"\xef\xbb\xbf" + ALLGATHER.encode())
    assert parse_file(path) == parse(ALLGATHER)
    # the mark stays in the decoded text; parse() drops it, once
    assert decode_source(b"\xef\xbb\xbf" + ALLGATHER.encode(), "bom.pln") == "\ufeff" + ALLGATHER


def test_a_second_byte_order_mark_is_a_stray_character(tmp_path):
    """One mark at the start is ignored; the reader and the parser each dropped one, so two
    were accepted too."""
    path = tmp_path / "bom2.pln"
    path.write_bytes(b"\xef\xbb\xbf\xef\xbb\xbf" + ALLGATHER.encode())
    with pytest.raises(PurlinError) as info:
        parse_file(path)
    assert lines(info.value)[0] == f"{path}:1:1: error: unexpected character '\\ufeff'"


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


# --- 5. messages ---------------------------------------------------------------------------

def test_scalar_dtype_message_says_float32():
    error = diagnose(fused("out = out * s", " with scalar s: float32"))
    assert error.message == "a scalar operand is always float32 (only rows operands declare a dtype)"
    assert (error.span.line, error.span.column) == (1, 41)


def test_row_dtype_message_says_the_calls_dtype():
    error = diagnose(fused("out = out * w", " with row w: float32"))
    assert error.message == "a row operand has the call's dtype (only rows operands declare a dtype)"


@pytest.mark.parametrize("name, what", [("R", "the world size"), ("r", "the rank"), ("hidden", "a parameter"),
                                        ("x", "a chunk")])
def test_epilogue_operand_names_that_are_taken(name, what):
    error = diagnose(fused(f"{name} = out", f" with rows {name}"))
    assert lines(error)[0] == f"spec.pln:1:31: error: operand '{name}' has the name of {what}"
    assert lines(error)[2] == "    " + " " * 30 + "^" * len(f"rows {name}")


def test_epilogue_operand_named_like_a_loop_variable():
    source = ("collective e(hidden = 8) with rows i {\n    in[r] = x[i] for i in 0..R\n    out[r] = x[0..R]\n"
              "    reduce\n    epilogue rows(hidden) {\n        i = out\n    }\n}\n")
    assert lines(diagnose(source))[0] == "spec.pln:1:31: error: operand 'i' has the name of a loop variable"


def test_sizes_and_epilogue_operand_of_one_name_is_a_duplicate():
    source = "collective s(h = 8) with sizes n[R] of x, scalar n { in[r] = x[r] out[r] = x[0..R] copy }"
    error = diagnose(source)
    assert lines(error)[0] == "spec.pln:1:43: error: operand 'n' is declared twice"


@pytest.mark.parametrize("eps", ["-1e-6", "-eps", "eps * 2.0", "(-1.0)"])
def test_rmsnorm_eps_must_be_a_scalar_operand_or_a_non_negative_number(eps):
    error = diagnose(fused(f"out = rmsnorm(out, w, {eps})", " with row w, scalar eps"))
    assert error.message == f"rmsnorm's eps must be a scalar operand or a non-negative number, not '{eps.strip('()')}'"
    assert (error.span.line, error.span.column) == (6, 31 + eps.startswith("("))


@pytest.mark.parametrize("literal", ["1e999", "3.5e38", "1" * 400, "340282368000000000000000000000000000001"])
def test_float_literal_beyond_float32_is_refused(literal):
    with pytest.raises(PurlinError) as info:
        parse(fused(f"out = out * {literal}"), "spec.pln")
    message = lines(info.value)[0]
    assert message.startswith("spec.pln:6:21: error: number ") and "float32" in message
    assert "3.4028235e+38" in message
    assert lines(info.value)[2] == " " * 24 + "^" * min(len(literal), 80)


@pytest.mark.parametrize("literal", ["3.4028234e38", "340282346638528859811704183484516925440", "1e-45", "0.0"])
def test_float_literal_within_float32_is_accepted(literal):
    assert check(parse(fused(f"out = out * {literal}")), 2).epilogue is not None


def test_assigned_twice_on_one_line_names_the_column():
    error = diagnose("collective a { in[r] = x[r] in[r] = x[r] out[r] = x[0..R] copy }")
    assert error.message == "in[0] is assigned twice (also at line 1, column 16)"
    error = diagnose("collective a {\n  in[r] = x[r]\n  in[r] = x[r]\n  out[r] = x[0..R]\n  copy\n}\n")
    assert error.message == "in[0] is assigned twice (also at line 2)"
    error = diagnose("collective a { in[r] = x[r] out[r] = x[0..R][0] copy }")
    assert error.message == "chunk 'x' is used with 2 indices here but with 1 elsewhere (line 1, column 24)"


def test_a_collective_name_longer_than_64_characters_is_refused_where_it_is_written():
    """The name becomes part of kernel and file names: 300 characters passed check, then
    compile failed writing its files ("File name too long")."""
    name = "a" * 65
    error = diagnose(f"collective {name} {{ in[r] = x[r] out[r] = x[0..R] copy }}")
    assert error.message == "the collective's name is 65 characters long, more than 64"
    assert (error.span.line, error.span.column, error.span.end_column) == (1, 12, 77)
    assert parse(f"collective {'a' * 64} {{ in[r] = x[r] out[r] = x[0..R] copy }}").name == "a" * 64


def test_a_literal_float32_would_make_zero_is_refused_where_it_is_written():
    source = ("collective e(hidden = 64) with rows residual {\n    in[r] = x\n    out[r] = x\n    reduce\n"
              "    epilogue rows(hidden) {\n        out = out + residual * 1e-50\n    }\n}\n")
    error = diagnose(source)
    assert error.message.startswith("number 1e-50 is too small for float32: it would be 0")
    assert (error.span.line, error.span.column) == (6, 32)
    assert parse(source.replace("1e-50", "1e-45")).epilogue is not None  # the smallest subnormal stays
    # Nonzero as written, though 0.0 already as a Python float: refused the same way
    for tiny in ("1e-400", "0." + "0" * 5000 + "1", "0.00001e-400"):
        assert "is too small for float32: it would be 0" in diagnose(source.replace("1e-50", tiny)).message
    for zero in ("0e-400", "0.000e5", "0.0"):  # zeros written as zeros are zeros
        assert parse(source.replace("1e-50", zero)).epilogue is not None


def test_a_byte_order_mark_at_the_start_of_a_string_source_is_dropped():
    assert parse("\ufeffcollective a { in[r] = x[r] out[r] = x[0..R] copy }").name == "a"


# --- 4. the chunk budget's message counts every index -------------------------------------

def test_a_chunk_over_the_budget_is_counted_over_all_its_indices():
    """The count stopped at the first index past the budget: x[0..600000][0..2] was said to
    name 600,000 chunks, not 1,200,000."""
    error = diagnose("collective a { in[r] = x[0..600000][0..2] out[r] = x[0][0] copy }", 1)
    assert error.message.startswith("'x[0..600000][0..2]' names 1,200,000 chunks, more than this spec may name at R=1")
    assert (error.span.line, error.span.column) == (1, 24)


def test_a_chunk_count_beyond_any_integer_is_capped_in_the_message():
    huge = "[0..9223372036854775807]" * 40  # a product of 2,520 bits, not printed whole
    error = diagnose(f"collective a {{ in[r] = x{huge} out[r] = x{'[0]' * 40} copy }}", 1)
    assert error.message.startswith("'x[0..9223372036854775807][0..9223372036854775807]")
    assert "names more than 9,223,372,036,854,775,807 chunks, more than this spec may name at R=1" in error.message


# --- 6. a statement cut at the end of its line ----------------------------------------------

CUT = ("collective e(hidden = 8) with rows residual, row weight, scalar eps {\n    in[r] = x\n    out[r] = x\n"
       "    reduce\n    epilogue rows(hidden) {\n        h = \n        residual = h\n"
       "        out = rmsnorm(h, weight, eps)\n    }\n}\n")
CUT_MESSAGE = ("error: missing a value after '=' at the end of the line; "
               "expected '(', '-', 'out', a decimal number, a name, a number")


@pytest.mark.parametrize("argv", [["check", "--spec-only", "-R", "1..4"], ["dump", "--stage", "spec", "-R", "2"],
                                  ["dump", "--stage", "ast"]], ids=["check", "dump-spec", "dump-ast"])
def test_an_epilogue_value_missing_is_reported_on_its_own_line(tmp_path, capsys, argv):
    """`h = ` then `residual = h`: the parser took 'residual' as the value and stopped at the next
    line's '=' (7:18, "unexpected '='"); the value is missing just after the first '='."""
    path = tmp_path / "cut.pln"
    path.write_text(CUT)
    assert main([argv[0], str(path), *argv[1:]]) == 2
    assert capsys.readouterr().err.splitlines()[:3] == [f"{path}:6:12: {CUT_MESSAGE}", "            h = ",
                                                        "               ^"]


@pytest.mark.parametrize("variant", ["crlf", "tabs", "comment"])
def test_an_epilogue_value_missing_under_crlf_tabs_and_comments(variant):
    source = {"crlf": CUT.replace("\n", "\r\n"), "tabs": CUT.replace("        h = ", "\t\th = "),
              "comment": CUT.replace("h = \n", "h = // to do\n\n")}[variant]
    error = diagnose(source)
    column = {"crlf": 12, "tabs": 6, "comment": 12}[variant]
    assert lines(error)[0] == f"spec.pln:6:{column}: {CUT_MESSAGE}"
    assert lines(error)[2] == "               ^"  # just past the '=', a tab being 4 cells


# --- 7. the parser's tables in the cache directory follow the cache's rules ----------------

@pytest.fixture
def tables(tmp_path, monkeypatch):
    """The path of the parser's tables in an empty cache, and a parser built afresh on each
    ``lalr.parser()`` after ``lalr.parser.cache_clear()`` (cleared again afterwards, so later
    tests build theirs from their own cache)."""
    from purlinc.frontend import lalr

    monkeypatch.setenv("PURLIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PURLIN_NO_CACHE", raising=False)
    lalr.parser.cache_clear()
    yield lalr.tables_path()
    lalr.parser.cache_clear()


def _parser_builds(monkeypatch) -> list:
    """Each time lark builds the tables (a cache miss), one entry."""
    from purlinc.frontend import lalr

    builds, build = [], lalr._build
    monkeypatch.setattr(lalr, "_build", lambda *args: builds.append(1) or build(*args))
    return builds


@pytest.mark.parametrize("damage", ["truncated", "flipped", "empty", "garbage", "other_grammar", "too_large",
                                    "directory"])
def test_damaged_parser_tables_are_rebuilt_and_replaced(tables, monkeypatch, damage):
    """lark's own cache= loaded a pickle without a checksum and wrote it in place."""
    from purlinc.frontend import lalr

    lalr.parser()
    data = tables.read_bytes()
    if damage == "directory":
        tables.unlink()
        tables.mkdir()
    elif damage == "other_grammar":  # sound tables of another grammar (a checksum over another key)
        lalr._store_tables(tables, b"\x00" * 32, lalr.parser())
    else:
        tables.write_bytes({"truncated": data[: len(data) // 2], "flipped": data[:-40] + bytes([data[-40] ^ 1]) + data[-39:],
                            "empty": b"", "garbage": b"not tables" * 100,
                            "too_large": data + b"\x00" * lalr.MAX_TABLES_BYTES}[damage])
    builds = _parser_builds(monkeypatch)
    lalr.parser.cache_clear()
    assert parse("collective a { in[r] = x[r] out[r] = x[0..R] copy }").name == "a"
    assert len(builds) == 1
    assert not [p for p in tables.parent.iterdir() if p.name.startswith(".tmp-")]
    if damage != "directory":  # a directory in the way is left alone: the tables are then not kept
        assert tables.is_file() and len(tables.read_bytes()) < lalr.MAX_TABLES_BYTES
        lalr.parser.cache_clear()
        lalr.parser()
        assert len(builds) == 1  # read back: no second build


def test_parser_tables_that_cannot_be_stored_are_said_at_info(tables, monkeypatch, caplog):
    """RELIABILITY.md: a directory at an entry's path stays a miss and PURLIN_DEBUG=INFO names
    it; the parser's tables were dropped without a word (the CUBIN and front entries said it)."""
    import logging

    from purlinc import cachefiles
    from purlinc.frontend import lalr

    tables.mkdir(parents=True)
    monkeypatch.setattr(cachefiles, "_UNWRITABLE_LOGGED", False)
    monkeypatch.setattr(logging.getLogger("purlin"), "propagate", True)
    with caplog.at_level(logging.INFO, logger="purlin.cache"):
        lalr.parser()
    (record,) = [r for r in caplog.records if r.name == "purlin.cache"]
    assert f"could not be stored ({tables}: " in record.getMessage()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_named_pipe_at_the_parser_tables_is_a_miss_not_a_hang(tables):
    """lark opened it and waited for a writer: every parse hung.  In a child process, bounded."""
    tables.parent.mkdir(parents=True)
    os.mkfifo(tables)
    try:
        done = subprocess.run([sys.executable, "-m", "purlinc", "dump", str(EXAMPLES / "allgather.pln"), "-R", "2"],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PURLIN_CACHE_DIR": str(tables.parent)})
    except subprocess.TimeoutExpired:
        pytest.fail("a parse with a named pipe at the parser's tables hung")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("collective allgather (R=2, copy)")
    assert tables.is_file()  # replaced by the tables, renamed into place
