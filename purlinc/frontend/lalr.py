"""The lark parser of the .pln grammar (``grammar/purlin.lark``), built once per process: the
parser of ``parse`` and the one ``syntax_errors`` asks what the grammar would accept where a
parse stopped."""

from __future__ import annotations

import functools

import lark
from lark import Lark

from purlinc import settings
from purlinc.resources import grammar_dir


@functools.cache
def parser() -> Lark:
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
