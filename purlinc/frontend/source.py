"""Reading .pln text: bounded in size, decoded as UTF-8, every failure a located ``PurlinError``.

Kept apart from ``parse`` so that reading a file (the compile cache's first step) does not
import lark.
"""

from __future__ import annotations

import codecs
import os
import stat
from pathlib import Path
from typing import BinaryIO

from purlinc.errors import PurlinError, Source, Span

# A collective is a few lines (the largest example is under 1 KB).  lark needs 15-60 us and
# about 1 KB per token (tree and spans), so this much text (up to ~45,000 tokens) parses in
# about a second and a larger input is refused before any of it is lexed (a 10 MB file would
# take minutes and gigabytes).
MAX_SOURCE_BYTES = 64 * 1024


def located(source: Source, offset: int) -> Span:
    """A one-character span at character ``offset`` of ``source``."""
    line = source.text.count("\n", 0, offset) + 1
    column = offset - (source.text.rfind("\n", 0, offset) + 1) + 1
    return Span(source, line, column, line, column + 1)


def too_large(size: int | None, filename: str) -> PurlinError:
    amount = f"{size:,} bytes" if size is not None else f"more than {MAX_SOURCE_BYTES:,} bytes"
    return PurlinError(
        f"{filename} is too large to be a collective: {amount}, the limit is {MAX_SOURCE_BYTES:,}",
        None, ("a collective is a few lines; is this the right file?",),
    )


def decode_source(data: bytes, filename: str) -> str:
    """Bytes -> text, or a ``PurlinError`` with line, column and caret at the first bad byte."""
    if len(data) > MAX_SOURCE_BYTES:
        raise too_large(len(data), filename)
    # Editors on Windows may start a UTF-8 file with a byte-order mark.  It is no character of
    # the text (an editor does not show it), so it is dropped before lexing and columns on
    # line 1 count from the first character after it; byte offsets still count it.
    skip = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    nul = data.find(b"\x00")
    bad = None
    try:
        text = data[skip:].decode("utf-8")
    except UnicodeDecodeError as error:
        bad = skip + error.start
    if bad is None and nul < 0:
        # The mark stays in the text: parse() drops one (as it does for a string), so a second
        # mark is a stray character there, located, not a second one dropped silently.
        return "\ufeff" * bool(skip) + text
    offset = min(o for o in (bad, nul) if o is not None and o >= 0)
    # Lines and columns count characters of the text decoded up to the bad byte.
    prefix = data[skip:offset].decode("utf-8", "replace")
    source = Source(filename, data[skip:].decode("utf-8", "replace").replace("\x00", "\ufffd"))
    span = located(source, len(prefix))
    if offset == nul:
        raise PurlinError("not a text file: it contains a NUL byte", span)
    raise PurlinError(f"not UTF-8 text: byte 0x{data[offset]:02x} (at byte offset {offset})", span)


def read_bounded(stream: BinaryIO, filename: str) -> str:
    """At most ``MAX_SOURCE_BYTES`` from ``stream`` (a FIFO, /dev/zero, standard input), decoded."""
    data = stream.read(MAX_SOURCE_BYTES + 1)
    if len(data) > MAX_SOURCE_BYTES:
        try:  # a regular file says how large it is; a pipe does not
            info = os.fstat(stream.fileno())
            size = info.st_size if stat.S_ISREG(info.st_mode) else None
        except (OSError, AttributeError, ValueError):
            size = None
        raise too_large(size, filename)
    return decode_source(data, filename)


def read_source(path: str | Path) -> str:
    """Read a .pln file, turning the usual ways a file can be unreadable into ``PurlinError``."""
    path = Path(path)
    try:
        with path.open("rb") as stream:
            return read_bounded(stream, str(path))
    except FileNotFoundError:
        shown = f"./{path}" if str(path) == "-" else path  # Path("./-") prints as "-", which reads as stdin
        # `purlinc --help`'s own examples name examples/...: they ship with the source, not the wheel
        notes = ("the examples are in Purlin's source repository (examples/), not in an installed package",) \
            if path.parts[:1] == ("examples",) else ()
        raise PurlinError(f"no such file: {shown}", notes=notes) from None
    except IsADirectoryError:
        raise PurlinError(f"{path} is a directory, not a .pln file") from None
    except NotADirectoryError:
        raise PurlinError(f"no such file: {path} (a part of the path is not a directory)") from None
    except PermissionError:
        raise PurlinError(f"cannot read {path}: permission denied") from None
    except OSError as error:
        raise PurlinError(f"cannot read {path}: {error.strerror or error}") from None
