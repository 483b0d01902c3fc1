"""Reading and writing the cache directory's files by the rules of docs/RELIABILITY.md: a file is
read only if it is a regular file (a named pipe at its path would block the read forever), and
written whole or not at all (a temporary file renamed into place, so a concurrent reader sees the
old file or the new one).  Shared by the compile cache (``purlinc.atom.cache``) and the parser's
tables (``purlinc.frontend.lalr``); checksums and keys are theirs."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def read_regular(path: Path, most: int | None = None) -> bytes | None:
    """A regular file's bytes, or None: missing, unreadable, something else at the path, or (with
    ``most``) longer than ``most`` bytes, which is then not read whole."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once, then fails the check
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data = handle.read() if most is None else handle.read(most + 1)
        return data if most is None or len(data) <= most else None
    except OSError:
        return None
    finally:
        os.close(fd)


def write_atomically(path: Path, chunks: tuple[bytes, ...]) -> None:
    """``chunks`` written to a temporary file beside ``path``, then renamed onto it; OSError where
    the directory cannot be written (the caller decides whether that matters)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as handle:
            for chunk in chunks:
                handle.write(chunk)
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise
