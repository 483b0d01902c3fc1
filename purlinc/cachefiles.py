"""Reading and writing the cache directory's files by the rules of docs/RELIABILITY.md: a file is
read only if it is a regular file (a named pipe at its path would block the read forever), and
written whole or not at all (a temporary file renamed into place, so a concurrent reader sees the
old file or the new one).  Shared by the compile cache (``purlinc.atom.cache``) and the parser's
tables (``purlinc.frontend.lalr``); checksums and keys are theirs."""

from __future__ import annotations

import os
import re
import stat
import tempfile
import time
from pathlib import Path
from typing import Callable


TEMP_PREFIX = ".tmp-"
# A temporary file older than this was left by a writer that was killed before its rename (a
# write takes milliseconds to seconds): the next write into its folder removes it.
STALE_TEMP_S = 3600


def read_regular(path: Path, most: int | None = None, starts: bytes = b"") -> bytes | None:
    """A regular file's bytes, or None: missing, unreadable, something else at the path, not
    starting with ``starts`` (checked before the rest is read: a file of zeros or another kind
    of entry costs a few bytes, not its length in memory), or (with ``most``) longer than
    ``most`` bytes, which is then not read whole."""
    if most is not None and len(starts) > most:
        return None  # nothing that long can start so
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once, then fails the check
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as handle:
            head = handle.read(len(starts))
            if head != starts:
                return None
            rest = handle.read() if most is None else handle.read(most + 1 - len(head))
        data = head + rest
        return data if most is None or len(data) <= most else None
    except OSError:
        return None
    finally:
        os.close(fd)


def write_atomically(path: Path, chunks: tuple[bytes, ...]) -> None:
    """``chunks`` written to a temporary file beside ``path``, then renamed onto it; OSError where
    the directory cannot be written (the caller decides whether that matters), or where
    something other than a file is in the entry's way (a directory: the error names ``path``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=TEMP_PREFIX, suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as handle:
            for chunk in chunks:
                handle.write(chunk)
        try:
            os.replace(temp, path)
        except OSError as error:  # its filename was the temporary file's, not the entry in the way
            raise OSError(error.errno, error.strerror, str(path)) from None
    except BaseException:
        os.unlink(temp)
        raise
    remove_stale_temps(path.parent, temp_names((TEMP_PREFIX,), path.suffix))


_UNWRITABLE_LOGGED = False


def store_quietly(path: Path, chunks: tuple[bytes, ...]) -> None:
    """``write_atomically`` for a cache: one that cannot be written is no error (just slower),
    but it is said once per process at INFO (``PURLIN_DEBUG=INFO``), naming the path."""
    global _UNWRITABLE_LOGGED
    try:
        write_atomically(path, chunks)
    except OSError as error:
        if not _UNWRITABLE_LOGGED:
            _UNWRITABLE_LOGGED = True
            from purlinc.log import get

            get("cache").info("a compile cache entry could not be stored (%s: %s): entries the cache holds "
                              "are still used (this is said once per process)", error.filename or path,
                              error.strerror or error)


# What mkstemp puts between prefix and suffix (its names' alphabet, eight of them)
TEMP_RANDOM = r"[a-z0-9_]{8}"


def temp_names(prefixes, suffix: str = "") -> Callable[[str], object]:
    """Whether a file name is one mkstemp gave with one of ``prefixes`` and ``suffix``."""
    alternatives = "|".join(re.escape(prefix) for prefix in prefixes)
    return re.compile(f"(?:{alternatives}){TEMP_RANDOM}{re.escape(suffix)}").fullmatch


def remove_stale_temps(folder: Path, ours: Callable[[str], object]) -> None:
    """Temporary files of killed writers in ``folder`` (nothing else reads or removes them):
    those older than STALE_TEMP_S whose name ``ours`` accepts.  Only names our mkstemp calls
    give: the folder may be one the user named (PURLIN_CACHE_DIR=~, compile -o), holding a file
    of their own that starts like ours."""
    cutoff = time.time() - STALE_TEMP_S
    try:
        with os.scandir(folder) as entries:
            stale = [entry.path for entry in entries if ours(entry.name)
                     and entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_mtime < cutoff]
    except OSError:  # the folder cannot be listed, or an entry went while it was read: next time
        return
    for path in stale:
        try:
            os.unlink(path)
        except OSError:  # another writer removed it first, or it is not ours to remove: the others still go
            pass
