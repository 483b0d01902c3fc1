"""CUDA source -> CUBIN through NVRTC (``cuda.bindings.nvrtc``), behind the disk cache.

Every NVRTC call goes through ``_check``, which names the status, attaches the NVRTC log
and writes the failing source to a file the error names.  Only calls present in both
cuda-bindings 13.3 and 13.5 are used.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache

from purlinc.atom import cache
from purlinc.atom.atoms import parse_arch
from purlinc.errors import PurlinError
from purlinc.log import log

BASE_OPTIONS = ("-std=c++17", "-default-device", "-lineinfo")


@dataclass(slots=True)
class Stats:
    """How much NVRTC work this process did (tests assert on it)."""

    compiles: int = 0
    cache_hits: int = 0


STATS = Stats()


_INSTALL = "install cuda-bindings and nvidia-cuda-nvrtc (pip install cuda-bindings nvidia-cuda-nvrtc)"
_LOADED = False


def _nvrtc():
    global _LOADED
    try:
        from cuda.bindings import nvrtc
    except ImportError as error:  # pragma: no cover - a broken install
        raise PurlinError(f"cannot import cuda.bindings.nvrtc: {error}", notes=(_INSTALL,)) from None
    if not _LOADED:
        # cuda.bindings loads the library at its first call: one it cannot find (no
        # nvidia-cuda-nvrtc) or cannot use (cuda-bindings 12.8 asks for libnvrtc.so.12 where
        # the wheel brings .so.13) raised from deep inside, reported as a bug in purlinc
        try:
            nvrtc.nvrtcVersion()
        except Exception as error:  # noqa: BLE001 - RuntimeError, OSError, the pathfinder's own
            raise PurlinError(f"cannot load NVRTC: {type(error).__name__}: {error}",
                              notes=(_INSTALL, "cuda-bindings 12.9.1 or newer loads the NVRTC of "
                                               "nvidia-cuda-nvrtc 13")) from None
        _LOADED = True
    return nvrtc


class CompilationError(PurlinError):
    """NVRTC refused the source itself (NVRTC_ERROR_COMPILATION), not an option, the
    installation or its memory: for a source purlinc generated, a bug in the generator
    (``pipeline.Compiled`` says so)."""


def _result_name(result) -> str:
    return getattr(result, "name", str(result))


def _check(result, what: str, *, log: str = "", source: str | None = None, filename: str | None = None):
    """Raise a PurlinError for any status but NVRTC_SUCCESS."""
    nvrtc = _nvrtc()
    if result == nvrtc.nvrtcResult.NVRTC_SUCCESS:
        return
    notes = []
    if source is not None:
        notes.append(f"generated source kept at {_keep_source(source, filename or 'purlin.cu')}")
    if log.strip():
        notes.append("NVRTC log:\n" + log.rstrip())
    kind = CompilationError if result == nvrtc.nvrtcResult.NVRTC_ERROR_COMPILATION else PurlinError
    raise kind(f"NVRTC {what} failed: {_result_name(result)}", notes=tuple(notes))


def _keep_source(source: str, filename: str) -> str:
    stem, _, ext = os.path.basename(filename).rpartition(".")
    fd, path = tempfile.mkstemp(prefix=f"{stem or filename}-", suffix=f".{ext or 'cu'}")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(source)
    return path


def _call(function, what: str, *args):
    """Call an NVRTC function returning (status, *values); check the status."""
    result, *values = function(*args)
    _check(result, what)
    return values[0] if len(values) == 1 else tuple(values)


_VERSION: str | None = None


def nvrtc_version() -> str:
    """NVRTC's own ``major.minor``; memoised.  Loading NVRTC to ask costs ~0.1-0.4 s, so a
    front-cache hit hands in the version recorded with the entry (``remember_version``)."""
    global _VERSION
    if _VERSION is None:
        nvrtc = _nvrtc()
        major, minor = _call(nvrtc.nvrtcVersion, "nvrtcVersion")
        _VERSION = f"{major}.{minor}"
    return _VERSION


def remember_version(version: str) -> None:
    """Set by a front-cache hit, whose key's ``nvrtc_fingerprint`` pins the installation
    that reported ``version`` when the entry was written."""
    global _VERSION
    if _VERSION is None:
        _VERSION = version


# Distributions that decide which NVRTC cuda-bindings loads and how it is driven.
_FINGERPRINT_DISTS = ("cuda_bindings", "cuda_pathfinder", "nvidia_cuda_nvrtc")


@lru_cache(maxsize=1)
def nvrtc_fingerprint() -> str:
    """The NVRTC identity for the front cache key, without loading NVRTC.

    The installed versions of cuda-bindings, cuda-pathfinder and the nvidia-cuda-nvrtc
    wheel, read from their ``.dist-info`` folder names on sys.path (a directory listing;
    ``importlib.metadata`` would cost more than the whole cache hit).  When no NVRTC wheel
    is installed, NVRTC comes from a system toolkit that no distribution names, so the
    fingerprint falls back to NVRTC's own version (loading it, ~0.1-0.4 s)."""
    found: dict[str, str] = {}
    for folder in sys.path:
        try:
            names = os.listdir(folder or ".")
        except OSError:
            continue
        for name in names:
            if not name.endswith(".dist-info"):
                continue
            dist, _, version = name[: -len(".dist-info")].partition("-")
            dist = dist.lower().replace("-", "_").replace(".", "_")
            for wanted in _FINGERPRINT_DISTS:
                # nvidia_cuda_nvrtc_cu12 and the like count as nvidia_cuda_nvrtc
                if (dist == wanted or dist.startswith(wanted + "_")) and dist not in found:
                    found[dist] = version
    parts = [f"{dist}={version}" for dist, version in sorted(found.items())]
    if not any(dist.startswith("nvidia_cuda_nvrtc") for dist in found):
        parts.append(f"nvrtc={nvrtc_version()}")
    return ";".join(parts)


def normalize_options(arch: str, options: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The full option list: target, base options, then the caller's (stripped, deduplicated)."""
    target = parse_arch(arch)
    result = [f"--gpu-architecture={target.name}", *BASE_OPTIONS]
    for option in options:
        option = option.strip()
        if option and option not in result:
            result.append(option)
    return tuple(result)


def _program_log(nvrtc, program) -> str:
    size = _call(nvrtc.nvrtcGetProgramLogSize, "nvrtcGetProgramLogSize", program)
    # A buffer of its own: b" " * 1 is the interpreter's shared one-byte object, and an empty
    # log (size 1, its NUL) written into it turned every b" " in the process into b"\x00".
    buffer = bytearray(size)
    _call(nvrtc.nvrtcGetProgramLog, "nvrtcGetProgramLog", program, buffer)
    return bytes(buffer).rstrip(b"\x00").decode("utf-8", "replace")


def _compile(source: str, filename: str, options: tuple[str, ...]) -> bytes:
    nvrtc = _nvrtc()
    STATS.compiles += 1
    program = _call(nvrtc.nvrtcCreateProgram, "nvrtcCreateProgram", source.encode(), filename.encode(), 0, [], [])
    try:
        encoded = [o.encode() for o in options]
        (result,) = nvrtc.nvrtcCompileProgram(program, len(encoded), encoded)
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _check(result, f"compilation of {filename} ({' '.join(options)})",
                   log=_program_log(nvrtc, program), source=source, filename=filename)
        if log.isEnabledFor(logging.DEBUG):  # a compile that succeeded may still have warned
            warnings = _program_log(nvrtc, program).strip()
            if warnings:
                log.debug("NVRTC's log for %s:\n%s", filename, warnings)
        size = _call(nvrtc.nvrtcGetCUBINSize, "nvrtcGetCUBINSize", program)
        cubin = bytearray(size)  # written by NVRTC: never a shared bytes object (see _program_log)
        _call(nvrtc.nvrtcGetCUBIN, "nvrtcGetCUBIN", program, cubin)
        return bytes(cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def compile_cubin(source: str, filename: str, arch: str, options: tuple[str, ...] = ()) -> bytes:
    """CUBIN for ``arch`` (sm_80, sm_90, sm_100, ...), from the disk cache when possible."""
    full = normalize_options(arch, tuple(options))
    key = cache.cache_key(source=source, arch=parse_arch(arch).name, options=full, nvrtc=nvrtc_version())
    cached = cache.load(key)
    if cached is not None:
        STATS.cache_hits += 1
        return cached
    cubin = _compile(source, filename, full)
    cache.store(key, cubin)
    return cubin
