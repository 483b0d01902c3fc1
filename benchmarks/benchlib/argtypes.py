"""Argument types shared by the benchmark scripts' command lines.

Each is an argparse ``type=``: a bad value becomes argparse's own one-line error (``argument
--reps: expected a positive integer, got '0'``, exit status 2) instead of a traceback or a
value that silently means something else.  No GPU, no torch.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path

from benchlib.sizes import parse_bytes

MAX_BYTES = 1 << 40  # 1 TiB: more than any GPU holds, so a larger size is a typo (1e30, 1T for 1G)

_INTEGER = re.compile(r"[+-]?[0-9]+")  # ASCII digits only: int() also takes "1_000" and "٣"


def _integer(text: str, what: str) -> int:
    if not _INTEGER.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return int(text)


def positive_int(text: str) -> int:
    """An integer of at least 1 (ranks, repeats, replays, layers, tokens...)."""
    value = _integer(text, "a positive integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """An integer of at least 0 (a device index)."""
    value = _integer(text, "an integer >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number above 0 (seconds, microseconds)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number above 0, got {text!r}")
    return value


def _list(text: str, item, what: str) -> list:
    """Comma-separated ``item`` values, at least one (blank items between commas are skipped)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, got {text!r}")
    return [item(p) for p in parts]


def positive_int_list(text: str) -> list[int]:
    """'1,16,128' -> [1, 16, 128]: positive integers, at least one."""
    return _list(text, positive_int, "positive integers")


def nonnegative_int_list(text: str) -> list[int]:
    """'0,1,4' -> [0, 1, 4]: integers of at least 0, at least one."""
    return _list(text, nonnegative_int, "integers >= 0")


def _switch(text: str) -> bool:
    if text not in ("0", "1"):
        raise argparse.ArgumentTypeError(f"expected 0 or 1, got {text!r}")
    return text == "1"


def switch_list(text: str) -> list[bool]:
    """'1,0' -> [True, False]: each 0 (off) or 1 (on), at least one."""
    return _list(text, _switch, "0 (off) and/or 1 (on)")


def flag_names(text: str, known, what: str) -> list[str]:
    """``names``, its ValueError naming the option --WHAT (a script's --collectives, --variants)."""
    try:
        return names(text, known, what)
    except ValueError as error:
        raise ValueError(f"--{what}: {error}") from None


def device_list(text: str) -> list[int]:
    """'0,0' or '0,1' -> CUDA device indices, at least one."""
    return _list(text, nonnegative_int, "CUDA device indices (integers >= 0)")


def byte_size(text: str) -> int:
    """'0', '64K', '1MiB' -> bytes (0 allowed: a lower bound), at most ``MAX_BYTES``."""
    try:
        value = parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if value > MAX_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r} is more than 1 TiB, more than a GPU holds")
    return value


def positive_byte_size(text: str) -> int:
    """'64K', '1MiB' -> bytes, at least 1 (a size to measure, an upper bound)."""
    value = byte_size(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a size of at least 1 byte, got {text!r}")
    return value


def byte_size_list(text: str) -> list[int]:
    """'1K,64K,1M' -> sizes in bytes, each at least 1, at least one."""
    return _list(text, positive_byte_size, "sizes (e.g. 1K,64K,1M)")


_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def file_tag(text: str) -> str:
    """A word that goes into file names (``--machine h200x2``): letters, digits, '.', '_' and
    '-', starting with a letter or digit; no '/' (a tag that names a folder loses the results
    when they are written, after the run)."""
    if not _TAG.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"expected a name for files (letters, digits, '.', '_', '-'; no '/'), got {text!r}")
    return text


def output_dir(text: str) -> Path:
    """A folder results are written into (created when the run writes): an existing folder, or
    a path whose nearest existing parent is a folder this process may write.  Checked when the
    arguments are read, not after a GPU run whose results it would lose."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a folder, got ''")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder")
    parent = path if path.exists() else path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {str(parent)!r} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: cannot write into {str(parent)!r}")
    return path


def names(text: str, known, what: str) -> list[str]:
    """Comma-separated names, each one of ``known``, at least one; ValueError naming the
    unknown ones and the choices otherwise (callers turn it into parser.error)."""
    given = [n.strip() for n in text.split(",") if n.strip()]
    if not given:
        raise ValueError(f"no {what} given ({text!r}); choose from {', '.join(known)}")
    unknown = [n for n in given if n not in known]
    if unknown:
        raise ValueError(f"unknown {what} {', '.join(map(repr, unknown))}; choose from {', '.join(known)}")
    return given
