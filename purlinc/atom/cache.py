"""The on-disk CUBIN cache: only NVRTC's work is cached (it is the expensive stage).

Key: sha256 of a stable JSON of the schema version, a hash of this package's own code and
templates, the source, the target, the normalized options, the NVRTC version and the
settings that affect generated code.  Entries are written to a temporary file and renamed
into place, so concurrent compilers never see half a file.  ``PURLIN_NO_CACHE=1`` bypasses
the cache, ``PURLIN_CACHE_DIR`` relocates it (both in purlinc/settings.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from functools import lru_cache
from importlib import resources
from pathlib import Path

from purlinc import settings
from purlinc.atom.atoms import templates_root

SCHEMA_VERSION = 1


def _walk(node, prefix: str = ""):
    for child in sorted(node.iterdir(), key=lambda c: c.name):
        name = f"{prefix}{child.name}"
        if child.is_dir():
            if child.name != "__pycache__":
                yield from _walk(child, name + "/")
        elif child.name.endswith((".py", ".j2", ".cuh", ".lark")):
            yield name, child


@lru_cache(maxsize=1)
def package_hash() -> str:
    """Hash of purlinc's own code and templates: a new compiler never reuses old CUBINs."""
    digest = hashlib.sha256()
    for package, root in (("purlinc", resources.files("purlinc")), ("templates", templates_root())):
        for name, node in _walk(root):
            digest.update(f"{package}/{name}\0".encode())
            digest.update(node.read_bytes())
            digest.update(b"\0")
    return digest.hexdigest()


def cache_key(*, source: str, arch: str, options: tuple[str, ...], nvrtc: str) -> str:
    picture = {
        "schema": SCHEMA_VERSION,
        "package": package_hash(),
        "source": hashlib.sha256(source.encode()).hexdigest(),
        "arch": arch,
        "options": list(options),
        "nvrtc": nvrtc,
        "settings": settings.codegen_settings(),
    }
    return hashlib.sha256(json.dumps(picture, sort_keys=True).encode()).hexdigest()


def _path(key: str) -> Path:
    return settings.cache_dir() / key[:2] / f"{key}.cubin"


def load(key: str) -> bytes | None:
    if not settings.cache_enabled():
        return None
    try:
        return _path(key).read_bytes()
    except OSError:
        return None


def store(key: str, data: bytes) -> None:
    """Write atomically; a cache that cannot be written is not an error (just slower)."""
    if not settings.cache_enabled():
        return
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".cubin")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(temp, path)
        except BaseException:
            os.unlink(temp)
            raise
    except OSError:
        pass
