"""The lark parser of the .pln grammar (``grammar/purlin.lark``), built once per process: the
parser of ``parse`` and the one ``syntax_errors`` asks what the grammar would accept where a
parse stopped.

lark's analysis of the grammar takes ~50 ms per process, so its tables are kept in the cache
directory (``PURLIN_CACHE_DIR``) by the rules of the compile cache (docs/RELIABILITY.md): the
file ends with a sha256 of its bytes and names the grammar it was built from; one that is not a
regular file (a named pipe would block the read), is larger than any tables, or does not read
back as written is a miss, rebuilt and replaced by a temporary file renamed into place.  lark's
own ``cache=`` does none of that (a FIFO there made every parse hang).  Reading and writing are
``purlinc.cachefiles``'s, as the compile cache's are.
"""

from __future__ import annotations

import functools
import hashlib
import io
import sys
from pathlib import Path

import lark
from lark import Lark

from purlinc import settings
from purlinc.cachefiles import read_regular, store_quietly
from purlinc.resources import grammar_dir

# The tables are ~70 KB; a file much larger is not one this module wrote, and is not read whole.
MAX_TABLES_BYTES = 4 << 20
_MAGIC = b"PURLIN-LARK\x00\x01"
_SHA = 32  # bytes of a sha256


@functools.cache
def parser() -> Lark:
    grammar = grammar_dir().joinpath("purlin.lark").read_text(encoding="utf-8")
    # The basic lexer reserves keywords ('copy', 'in', ...) everywhere, so a misplaced keyword
    # is reported as such instead of being read as a chunk name.
    options = dict(parser="lalr", lexer="basic", propagate_positions=True, maybe_placeholders=True)
    if not settings.cache_enabled():
        return _build(grammar, options)
    path, key = tables_path(), _tables_key(grammar, options)
    cached = _load_tables(path, key)
    if cached is not None:
        return cached
    built = _build(grammar, options)
    _store_tables(path, key, built)
    return built


def _build(grammar: str, options: dict) -> Lark:
    return Lark(grammar, **options)


def tables_path() -> Path:
    """Where the parser's tables are kept (lark's own cache file was lark-<version>.grammar)."""
    return settings.cache_dir() / f"lark-{lark.__version__}.tables"


def _tables_key(grammar: str, options: dict) -> bytes:
    """What the tables depend on: the grammar, lark's options and version, and Python's (the
    tables are a pickle)."""
    picture = (grammar, sorted(options.items()), lark.__version__, sys.version_info[:2])
    return hashlib.sha256(repr(picture).encode()).digest()


def _load_tables(path: Path, key: bytes) -> Lark | None:
    """The parser stored at ``path`` for ``key``, or None: missing, not a regular file, too
    large, damaged, or built from another grammar."""
    data = read_regular(path, MAX_TABLES_BYTES, starts=_MAGIC + key)
    head = len(_MAGIC) + len(key)
    if data is None or len(data) < head + _SHA:
        return None
    if hashlib.sha256(memoryview(data)[:-_SHA]).digest() != data[-_SHA:]:
        return None
    try:
        return Lark.load(io.BytesIO(data[head:-_SHA]))
    except Exception:  # checksummed tables that this lark cannot read back after all: rebuild
        return None


def _store_tables(path: Path, key: bytes, built: Lark) -> None:
    """Write the tables to a temporary file and rename it into place, so a concurrent parse
    (torchrun ranks sharing a cache) reads whole tables or none.  A cache that cannot be
    written is no error (the next process builds the tables again); PURLIN_DEBUG=INFO says so."""
    stream = io.BytesIO()
    built.save(stream)
    body = _MAGIC + key + stream.getvalue()
    store_quietly(path, (body, hashlib.sha256(body).digest()))
