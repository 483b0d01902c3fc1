"""One exception type for every user error, rendered like a compiler diagnostic.

    allgather.pln:3:14: error: output chunk y[0] of rank 0 has no producer: no input names it
            out[r] = y[0..R]
                     ^^^^^^^
    note: no input names any chunk called 'y'
    note: while checking allgather for R=3

Spans ride along on the AST but never take part in equality (see ``Span``).
"""

from __future__ import annotations

import copy
import unicodedata
from dataclasses import dataclass, field

_TAB = 4
_WINDOW = 160  # characters of a long source line shown around the caret


@dataclass(frozen=True, slots=True)
class Source:
    """The text a span points into: a file name (or ``<string>``) and its contents."""

    name: str
    text: str = field(repr=False)

    def line(self, number: int) -> str:
        # Split on '\n' only, as the lexer counts lines (str.splitlines also splits on
        # form feeds and other separators, which would shift every later line).
        lines = self.text.split("\n")
        if 1 <= number <= len(lines):
            return lines[number - 1].rstrip("\r")
        return ""


@dataclass(frozen=True, slots=True)
class Span:
    """A half-open region of a source, 1-based line and column like every compiler."""

    source: Source = field(repr=False)
    line: int
    column: int
    end_line: int
    end_column: int

    def where(self) -> str:
        return f"{self.source.name}:{self.line}:{self.column}"


def span_field():
    """A dataclass field for spans: present, but ignored by ==, hash and repr."""
    return field(default=None, compare=False, hash=False, repr=False)


class PurlinError(Exception):
    """A user-facing error: a message, an optional source span and optional notes."""

    def __init__(self, message: str, span: Span | None = None, notes: tuple[str, ...] | list[str] = ()):
        super().__init__(message)
        self.message = message
        self.span = span
        self.notes = tuple(notes)

    def with_note(self, note: str) -> "PurlinError":
        """A copy with one more note; a subclass's own fields (a timeout's record, a heap
        error's sizes, a verifier's step) come along, as pickling carries them."""
        copied = copy.copy(self)
        copied.notes = (*self.notes, note)
        return copied

    def render(self) -> str:
        lines = []
        if self.span is None:
            lines.append(f"error: {self.message}")
        else:
            span = self.span
            lines.append(f"{span.where()}: error: {self.message}")
            text = span.source.line(span.line)
            if text:
                lines.extend(_excerpt(text, span))
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


def _excerpt(text: str, span: Span) -> list[str]:
    """The source line and a caret underline, cut to about ``_WINDOW`` characters around the
    caret: a 20 KB line (generated input, a minified file) is not echoed whole."""
    start = max(span.column - 1, 0)
    width = 1
    if span.end_line == span.line and span.end_column > span.column:
        width = span.end_column - span.column
    width = max(1, min(width, _WINDOW // 2, max(len(text) - start, 1)))
    if len(text) > _WINDOW:
        # Keep the caret visible with some context on both sides; mark cuts with '...'.
        lo = max(0, min(start - _WINDOW // 2, len(text) - _WINDOW))
        hi = min(len(text), lo + _WINDOW)
        head = "..." if lo > 0 else ""
        tail = "..." if hi < len(text) else ""
        text, start = head + text[lo:hi] + tail, start - lo + len(head)
        width = max(1, min(width, hi - lo - (start - len(head))))
    # Control characters (escape sequences in a binary file) are not echoed to a terminal.
    text = "".join(c if c.isprintable() or c == "\t" else "\ufffd" for c in text)
    shown, cells = _layout(text)
    start = min(start, len(text))  # a span past the end of its line gets a caret just after it
    indent = cells[start]
    width = max(1, cells[min(start + width, len(text))] - indent)
    return [f"    {shown}", "    " + " " * indent + "^" * width]


def _layout(text: str) -> tuple[str, list[int]]:
    """``text`` with tabs expanded, and the terminal cell each character starts at (one more
    entry: the cell after the last).  A column counts characters, but a terminal shows an
    emoji or a CJK character in two cells and a combining accent in none, so the caret is
    placed by cells; tab stops count cells too."""
    shown: list[str] = []
    cells: list[int] = []
    cell = 0
    for char in text:
        cells.append(cell)
        if char == "\t":
            step = _TAB - cell % _TAB
            shown.append(" " * step)
        else:
            step = _cell_width(char)
            shown.append(char)
        cell += step
    cells.append(cell)
    return "".join(shown), cells


def _cell_width(char: str) -> int:
    if unicodedata.combining(char):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


class InternalError(RuntimeError):
    """A bug in Purlin itself, not in the user's input."""
