"""The on-disk compile caches, two levels (Triton-style), under ``settings.cache_dir()``.

* The front cache (``front/``), keyed on a compile's inputs before any work is done: a
  *schedule* entry per ``pipeline.Compiled`` (the .pln text, world size, params, options,
  atom, arch), and a *kernel* entry per (Compiled, dtype, op) with the CUDA source and
  CUBIN.  A hit skips parse, check, lower, verify (schedule) and generate, NVRTC (kernel).
* The NVRTC cache (``<xx>/<key>.cubin``): keyed on the generated CUDA source, so two
  front entries that generate the same module share NVRTC's work (and the runtime,
  which generates its own sources, uses it directly).

Both keys are sha256 of a stable JSON of the schema version, a hash of this package's own
code, grammar and templates, the inputs, the normalized options, the NVRTC version and the
settings that affect generated code.  Entries are written to a temporary file and renamed
into place, so concurrent compilers never see half a file; every entry also carries a
checksum, and one that does not read back cleanly (or is not a regular file) is a miss
(then rewritten), never an error.  A cache that cannot be written is not an error either
(the log says so once, at INFO).  ``PURLIN_NO_CACHE=1`` bypasses both levels,
``PURLIN_CACHE_DIR`` relocates both (purlinc/settings.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from purlinc import settings
from purlinc.cachefiles import read_regular, store_quietly

SCHEMA_VERSION = 3  # 2: a CUBIN entry ends with its sha256; 3: and starts with its key
_CUBIN_MAGIC = b"PURLIN-CUBIN\x00\x03"
FRONT_SCHEMA_VERSION = 1
_FRONT_MAGIC = b"PURLIN-FRONT\x00\x02"
_LENGTH = struct.Struct("<Q")  # header JSON bytes
_PACKAGE_SUFFIXES = (".py", ".j2", ".cuh", ".lark")

_PACKAGE_HASH: str | None = None


def _package_roots() -> list[tuple[str, Path]]:
    """purlinc's code, grammar and templates, as real folders (editable or installed)."""
    from purlinc.resources import grammar_dir, templates_dir

    code = Path(__file__).resolve().parents[1]
    return [("purlinc", code), ("grammar", Path(str(grammar_dir()))), ("templates", Path(str(templates_dir())))]


def _walk(root: Path, skip: frozenset[str], prefix: str = ""):
    with os.scandir(root) as entries:
        children = sorted(entries, key=lambda e: e.name)
    for child in children:
        name = f"{prefix}{child.name}"
        if child.is_dir():
            if child.name != "__pycache__" and os.path.realpath(child.path) not in skip:
                yield from _walk(Path(child.path), skip, name + "/")
        elif child.name.endswith(_PACKAGE_SUFFIXES):
            yield name, child.path


def package_hash() -> str:
    """Hash of purlinc's own code, grammar and templates (file contents, read once per
    process): a changed compiler never reuses an old entry.  A few ms; memoised."""
    global _PACKAGE_HASH
    if _PACKAGE_HASH is None:
        digest = hashlib.sha256()
        roots = _package_roots()
        real_roots = [os.path.realpath(root) for _, root in roots]
        for n, (package, root) in enumerate(roots):
            # an installed purlinc/templates is also under purlinc/: hash it once, as itself
            skip = frozenset(real_roots[:n] + real_roots[n + 1:])
            for name, path in _walk(root, skip):
                with open(path, "rb") as handle:
                    data = handle.read()
                digest.update(f"{package}/{name}\0{len(data)}\0".encode())
                digest.update(data)
        _PACKAGE_HASH = digest.hexdigest()
    return _PACKAGE_HASH


def _digest(picture: dict) -> str:
    return hashlib.sha256(json.dumps(picture, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ---- level 2: NVRTC, keyed on the generated source -------------------------------------

def cache_key(*, source: str, arch: str, options: tuple[str, ...], nvrtc: str) -> str:
    return _digest({
        "schema": SCHEMA_VERSION,
        "package": package_hash(),
        "source": hashlib.sha256(source.encode()).hexdigest(),
        "arch": arch,
        "options": list(options),
        "nvrtc": nvrtc,
        "settings": settings.codegen_settings(),
    })


def _path(key: str) -> Path:
    return settings.cache_dir() / key[:2] / f"{key}.cubin"


def _cubin_head(key: str) -> bytes:
    """What a CUBIN entry starts with: a magic and its own key, so that an entry copied or linked
    under another key is a miss (its checksum alone held: another module was launched)."""
    return _CUBIN_MAGIC + key.encode("ascii")


def load(key: str) -> bytes | None:
    """The CUBIN stored under ``key``, or None: missing, stored under another key, or not as
    stored (a truncated or damaged file was handed to the driver, and sealed into a front
    entry, before it had a checksum)."""
    if not settings.cache_enabled():
        return None
    head = _cubin_head(key)
    data = read_regular(_path(key), starts=head)
    if data is None or len(data) <= len(head) + 32 or hashlib.sha256(data[:-32]).digest() != data[-32:]:
        return None
    return data[len(head):-32]


def store(key: str, data: bytes) -> None:
    if settings.cache_enabled():
        head = _cubin_head(key)
        store_quietly(_path(key), (head, data, hashlib.sha256(head + data).digest()))


# ---- level 1: the front cache, keyed on compile()'s inputs -----------------------------

def front_key(inputs: dict) -> str:
    """``inputs``: JSON-able, already normalized by the caller (pipeline.compile)."""
    return _digest({
        "schema": FRONT_SCHEMA_VERSION,
        "package": package_hash(),
        "inputs": inputs,
        "settings": settings.codegen_settings(),
    })


def _front_path(key: str) -> Path:
    return settings.cache_dir() / "front" / key[:2] / f"{key}.entry"


def load_front(key: str) -> tuple[dict, dict[str, bytes]] | None:
    """(header, blobs) of a sound entry; None for a miss or an entry that does not read back.

    Layout: magic, u64 header length, header JSON (it lists the blobs' names and lengths),
    the blobs, sha256 of everything before.  Big values (CUDA source, schedule JSON, CUBIN)
    are blobs, not JSON strings, so a hit decodes only the small header."""
    if not settings.cache_enabled():
        return None
    data = read_regular(_front_path(key), starts=_FRONT_MAGIC)
    if data is None:
        return None
    try:
        fixed = len(_FRONT_MAGIC) + _LENGTH.size
        if len(data) < fixed + 32 or not data.startswith(_FRONT_MAGIC):
            return None
        view = memoryview(data)
        if hashlib.sha256(view[:-32]).digest() != data[-32:]:
            return None
        (header_len,) = _LENGTH.unpack_from(data, len(_FRONT_MAGIC))
        header = json.loads(data[fixed:fixed + header_len])
        if not isinstance(header, dict) or header.get("key") != key:
            return None
        blobs = {}
        offset = fixed + header_len
        for name, length in header["blobs"]:
            blobs[name] = data[offset:offset + length]
            offset += length
        if offset != len(data) - 32:
            return None
        return header, blobs
    except (ValueError, TypeError, KeyError, struct.error):  # JSON / layout damage: a miss
        return None


def store_front(key: str, header: dict, blobs: dict[str, bytes]) -> None:
    if not settings.cache_enabled():
        return
    header = {**header, "key": key, "blobs": [[name, len(blob)] for name, blob in blobs.items()]}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    body = b"".join((_FRONT_MAGIC, _LENGTH.pack(len(encoded)), encoded, *blobs.values()))
    store_quietly(_front_path(key), (body, hashlib.sha256(body).digest()))
