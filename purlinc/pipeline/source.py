"""The pipeline's input: a collective's .pln text and the name it is reported under."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from purlinc.errors import PurlinError


@dataclass(frozen=True)
class SourceText:
    text: str
    filename: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def load_source(path_or_source: str | Path | SourceText) -> SourceText:
    """A path to a .pln file, or .pln text itself: a str that contains both 'collective' and
    '{' and names no existing file is text; every other str, and every Path, is a path."""
    if isinstance(path_or_source, SourceText):
        return path_or_source
    if not isinstance(path_or_source, (str, Path)):
        raise PurlinError(f"expected a .pln path or .pln text, got {type(path_or_source).__name__}")
    if isinstance(path_or_source, str) and not path_or_source.strip():
        raise PurlinError("expected a .pln path or .pln text, got an empty string")
    if isinstance(path_or_source, str) and _is_text(path_or_source):
        return SourceText(path_or_source, "<string>")
    return SourceText(_read_source(path_or_source), str(path_or_source))


def _is_text(value: str) -> bool:
    """Whether a str is .pln text.  '{' alone is no sign of it (a directory may be called
    run{1}), and a file that exists is read whatever its name holds (collective{1}.pln)."""
    # os.path.exists answers False for what cannot be a path (a NUL byte, a name too long).
    return "collective" in value and "{" in value and not os.path.exists(value)


def _read_source(path: str | Path) -> str:
    """The file's text (bounded in size; the reader needs no lark, so a cache hit parses nothing)."""
    from purlinc.frontend.source import read_source

    if "\x00" in str(path):  # open() would raise a bare ValueError ("embedded null byte")
        raise PurlinError(f"cannot read {str(path)!r}: a path cannot contain a NUL byte")
    return read_source(path)
