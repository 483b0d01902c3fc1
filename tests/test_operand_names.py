"""Operands are passed by name beside the Python call's own arguments (``coll(x, out,
residual=h)``, ``coll(x, n=sizes)``): an operand named like one of those arguments could not be
passed (``count=`` bound the call's count; ``x=`` was given twice).  The checker refuses such
names at the declaration, and every runtime call's arguments are in its list.  Also what
``check()`` is given for a parameter: an integer, or a located refusal."""

from __future__ import annotations

import inspect
import keyword

import pytest

from purlinc.errors import PurlinError
from purlinc.frontend.check import CALL_KEYWORDS, check
from purlinc.frontend.parse import parse

EPILOGUE = """collective f(hidden = 64) with rows residual, row weight, scalar {name} {{
    in[r]  = x
    out[r] = x
    reduce
    epilogue rows(hidden) {{
        h = out + residual
        residual = h
        out = rmsnorm(h, weight, {name})
    }}
}}
"""
SIZES = "collective v with sizes {name}[R] of y {{ in[r] = y[r]  out[r] = y[0..R]  copy }}\n"


def _language_keywords() -> set[str]:
    """Words the grammar reserves ('out', 'row', 'sizes', ...): the parser refuses them as names."""
    from purlinc.frontend.lalr import parser as _parser

    return {t.pattern.value for t in _parser().terminals if t.pattern.type == "str" and t.pattern.value.isidentifier()}


# The call's arguments the checker itself must refuse (the others are keywords of the language).
CHECKED = [k for k in CALL_KEYWORDS if k not in _language_keywords()]


def _refusal(source: str) -> PurlinError:
    with pytest.raises(PurlinError) as caught:
        check(parse(source, "f.pln"), 2)
    return caught.value


def test_the_call_arguments_are_names_or_keywords():
    assert {"x", "count", "stream", "dtype"} <= set(CHECKED)
    for name in set(CALL_KEYWORDS) - set(CHECKED):
        assert _refusal(SIZES.format(name=name)).message == f"unexpected keyword '{name}'; expected a name"


@pytest.mark.parametrize("name", [k for k in CHECKED if k != "x"])  # x: the epilogue's chunk, refused as one
def test_an_epilogue_operand_named_like_a_call_argument_is_refused(name):
    error = _refusal(EPILOGUE.format(name=name))
    assert error.message == f"operand '{name}' has the name of an argument of the Python call"
    assert (error.span.line, error.span.column) == (1, 59)


@pytest.mark.parametrize("name", [k for k in CHECKED if k != "y"])
def test_a_sizes_operand_named_like_a_call_argument_is_refused(name):
    error = _refusal(SIZES.format(name=name))
    assert error.message == f"operand '{name}' has the name of an argument of the Python call"
    assert (error.span.line, error.span.column) == (1, 19)


def test_other_names_are_operands():
    assert check(parse(EPILOGUE.format(name="eps"), "f.pln"), 2).epilogue is not None
    assert check(parse(SIZES.format(name="n"), "v.pln"), 2).sizes is not None


def test_every_runtime_call_argument_is_reserved():
    from purlinc.runtime.collective import Collective, GroupCollective
    from purlinc.runtime.sized import GroupSized, SizedCollective

    for call in (Collective.__call__, GroupCollective.__call__, SizedCollective.__call__, GroupSized.__call__):
        named = [p.name for p in inspect.signature(call).parameters.values() if p.kind is not p.VAR_KEYWORD]
        assert set(named) <= set(CALL_KEYWORDS), f"{call.__qualname__}: {sorted(set(named) - set(CALL_KEYWORDS))}"


@pytest.mark.parametrize("value", [1.9, True, "1", None, "abc"])
def test_check_refuses_a_parameter_that_is_not_an_integer(value):
    """check() bound int(value): 1.9 and True became 1, '1' became 1 without a word, and None
    or 'abc' raised a bare TypeError / ValueError; the pipeline's own refusal now lives here."""
    from pathlib import Path

    definition = parse((Path(__file__).resolve().parents[1] / "examples" / "broadcast.pln").read_text(), "b.pln")
    with pytest.raises(PurlinError) as caught:
        check(definition, 3, {"root": value})
    assert caught.value.message == f"parameter root must be an integer, got {value!r} ({type(value).__name__})"


def test_an_operand_named_debug_is_refused():
    """``coll(x, __debug__=w)`` is a SyntaxError ("cannot assign to __debug__") though
    ``__debug__`` is no keyword: the operand was accepted and no call could pass it by name."""
    with pytest.raises(SyntaxError):
        compile("coll(x, __debug__=w)", "<call>", "eval")
    for source, column in ((EPILOGUE, 59), (SIZES, 19)):
        error = _refusal(source.format(name="__debug__"))
        assert error.message == "operand '__debug__' has the name of a constant of Python's (no call could pass it by name)"
        assert (error.span.line, error.span.column) == (1, column)


@pytest.mark.parametrize("name", sorted(set(keyword.kwlist) - _language_keywords()))
def test_an_operand_named_like_a_python_keyword_is_refused(name):
    """``coll(x, out, lambda=s)`` is a syntax error: no call could pass such an operand by name
    (only through ``**{...}``), so the checker refuses the name where it is declared."""
    for source, column in ((EPILOGUE, 59), (SIZES, 19)):
        error = _refusal(source.format(name=name))
        assert error.message == f"operand '{name}' has the name of a Python keyword (no call could pass it by name)"
        assert (error.span.line, error.span.column) == (1, column)
