"""The pipeline's input: a collective's .pln text and the name it is reported under."""

from __future__ import annotations

import hashlib
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
    """A path to a .pln file, or .pln text itself (anything containing 'collective' and '{')."""
    if isinstance(path_or_source, SourceText):
        return path_or_source
    if not isinstance(path_or_source, (str, Path)):
        raise PurlinError(f"expected a .pln path or .pln text, got {type(path_or_source).__name__}")
    if isinstance(path_or_source, str) and not path_or_source.strip():
        raise PurlinError("expected a .pln path or .pln text, got an empty string")
    if isinstance(path_or_source, Path) or (
        isinstance(path_or_source, str) and "{" not in path_or_source
    ):
        return SourceText(_read_source(path_or_source), str(path_or_source))
    return SourceText(path_or_source, "<string>")


def _read_source(path: str | Path) -> str:
    """The file's text (bounded in size; the reader needs no lark, so a cache hit parses nothing)."""
    from purlinc.frontend.source import read_source

    return read_source(path)
