"""Every environment setting Purlin reads, in one place.

Each setting says whether it affects generated code (and is then part of the compile
cache key).  Elsewhere the package reads only the launcher's variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, ...: torchrun's contract, not Purlin's settings), in
``purlinc.runtime.rendezvous`` and ``purlinc.runtime.hierarchical``.
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    default: str
    affects_codegen: bool
    help: str

    def raw(self) -> str:
        """The value as set, or the default where the variable is unset or empty (``export
        PURLIN_PDL=`` reads as unset: an empty value meant off for some settings and was refused
        by others)."""
        value = os.environ.get(self.name, "")
        return value if value.strip() else self.default


DEBUG = Setting(
    "PURLIN_DEBUG", "0", False,
    "run-time log on stderr through Python's logging (logger 'purlin'), like NCCL_DEBUG: INFO (communicator "
    "set-up, each load's buckets, the schedule each new call signature picks, heap growth, timeouts, what a "
    "torch backend hands to its fallback), DEBUG (finer), TRACE (finest); 1 means DEBUG and also makes the CLI "
    "re-raise errors with a traceback (DEBUG and TRACE do too); 0 or unset: no log, no cost",
)
CACHE_DIR = Setting(
    "PURLIN_CACHE_DIR", "", False,
    "where compiled CUBINs are cached (default $XDG_CACHE_HOME/purlin, or ~/.cache/purlin without it)"
)
NO_CACHE = Setting("PURLIN_NO_CACHE", "0", False, "1: bypass the compile cache (neither read nor write)")
WAIT_TIMEOUT_S = Setting(
    "PURLIN_WAIT_TIMEOUT_S", "10", False,
    "bound on every device-side wait, in seconds; a peer that never arrives is reported, not waited for",
)

HEAP_MB = Setting(
    "PURLIN_HEAP_MB", "256", False,
    "first segment of each rank's symmetric heap, and the least it grows by, MiB; the heap (staging, "
    "signal pads, comm.empty blocks) grows on demand by further segments",
)
HEAP_MAX_MB = Setting(
    "PURLIN_HEAP_MAX_MB", "0", False,
    "upper bound on each rank's symmetric heap, MiB (0: none but the device's memory)",
)
STAGE_MB = Setting(
    "PURLIN_STAGE_MB", "64", False,
    "staging space per loaded collective and rank, MiB; larger messages run in several rounds "
    "(never less than a slice per epilogue row: a load above it says so in a warning)",
)

TRACE = Setting(
    "PURLIN_TRACE", "0", False,
    "1: load() builds traced kernels (a timestamp after every block; coll.trace() returns them). "
    "Not a codegen key: a traced kernel is asked for explicitly by generate(trace=True)",
)

PDL = Setting(
    "PURLIN_PDL", "1", False,
    "1: on sm_90 and newer, launch kernels with programmatic dependent launch (a kernel is scheduled "
    "while the one before it in the stream finishes, and waits for it on the device); 0: plain launches. "
    "Not a codegen key: every kernel waits either way",
)

PRECOMPILE = Setting(
    "PURLIN_PRECOMPILE", "float32,bfloat16,float16", False,
    "element types whose kernels a tuned load() compiles for every size bucket before it returns "
    "(op sum for reductions; comma-separated dtype names), so a first call of one of them does not "
    "wait for NVRTC; 0, none, off, false or no: compile each kernel at its first call instead",
)

GRAPH_BUFFERS = Setting(
    "PURLIN_GRAPH_BUFFERS", "auto", False,
    "calls captured in a CUDA graph on ordinary (non-heap) buffers: auto = peers reach the caller's "
    "buffers directly (the registered schedule) where the size's schedule is not LL-packed, stage where "
    "it is (packets beat the registered schedule's signal round trip at small sizes); register = every "
    "captured call with a registered schedule; stage = never (eager calls always stage). Read per capture",
)
GRAPH_BUFFER_MODES = ("auto", "register", "stage")

ALL = (DEBUG, CACHE_DIR, NO_CACHE, WAIT_TIMEOUT_S, HEAP_MB, HEAP_MAX_MB, STAGE_MB, TRACE, PDL, PRECOMPILE,
       GRAPH_BUFFERS)


_LOG_LEVELS = {"1": "DEBUG", "INFO": "INFO", "DEBUG": "DEBUG", "TRACE": "TRACE", "WARN": "WARNING",
               "WARNING": "WARNING"}


def _refuse(setting: Setting, expected: str):
    from purlinc.errors import PurlinError

    return PurlinError(f"{setting.name}={setting.raw()!r}: expected {expected}",
                       notes=(f"{setting.name}: {setting.help}",))


def log_level() -> str | None:
    """The level PURLIN_DEBUG asks for (``INFO``, ``DEBUG``, ``TRACE``, ``WARNING``), or None: no log."""
    raw = DEBUG.raw().strip().upper()
    if raw == "0":
        return None
    level = _LOG_LEVELS.get(raw)
    if level is None:
        raise _refuse(DEBUG, "0, 1, INFO, DEBUG, TRACE, WARN or WARNING")
    return level


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(setting: Setting) -> bool:
    """A switch: 1, true, yes or on; 0, false, no or off (any case, spaces ignored; empty is the default).
    Anything else is refused, not read as on: PURLIN_NO_CACHE=false turned the cache off."""
    raw = setting.raw().strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise _refuse(setting, "1, true, yes or on; or 0, false, no or off")


def _number(setting: Setting, low: float, high: float, *, zero: bool = False) -> float:
    """A finite number in [low, high] (or 0 where ``zero`` says 0 means none)."""
    raw = setting.raw().strip()
    try:
        # float() reads 1_000 and other scripts' digits ('١٠' as 10); a shell user means neither,
        # and the launcher's variables (RANK, ...) refuse both
        value = float(raw) if "_" not in raw and raw.isascii() else float("nan")
    except ValueError:
        value = float("nan")
    if value == value and ((zero and value == 0) or low <= value <= high):
        return value
    span = f"a number from {_shown(low)} to {_shown(high)}" + (", or 0 for none" if zero else "")
    raise _refuse(setting, span)


def _shown(x: float) -> str:
    return f"{int(x):,}" if x == int(x) else f"{x:g}"


_MOST_MB = float(1 << 24)  # 16 TiB: more than any device holds
MOST_WAIT_S = 1e6  # about 11 days: the longest wait any timeout may name (time_t and sockets refuse far more)


def debug() -> bool:
    """Whether the CLI re-raises errors with a traceback (developers): PURLIN_DEBUG=1, DEBUG or TRACE."""
    return DEBUG.raw().strip().upper() in ("1", "DEBUG", "TRACE")


def cache_enabled() -> bool:
    """Whether the compile caches are used: not switched off, and there is a place for them."""
    return not cache_switched_off() and unplaced_cache() is None


def cache_switched_off() -> bool:
    return _flag(NO_CACHE)


def unplaced_cache() -> str | None:
    """Why the cache has no place (then it is skipped), or None.  A container run as a user
    with no passwd entry and no HOME has no home directory to put it under."""
    if CACHE_DIR.raw() or _default_cache_base() is not None:
        return None
    return ("no home directory is known (HOME is unset or not an absolute path, and the user has no "
            "passwd entry), so the cache has no default place")


def cache_dir() -> Path:
    """Where the caches are; only asked where ``cache_enabled()``."""
    raw = CACHE_DIR.raw()
    if raw:
        try:
            return Path(raw).expanduser()  # ~ as a shell would (a Dockerfile's ENV does not)
        except RuntimeError:  # ~someone of no known home: a user error, not an internal one
            raise _refuse(CACHE_DIR, "a directory (a leading ~ names the home directory of a known user)") from None
    base = _default_cache_base()
    if base is None:
        from purlinc.errors import PurlinError

        raise PurlinError(f"the compile cache has no place: {unplaced_cache()} (set {CACHE_DIR.name})")
    return base / "purlin"


def _default_cache_base() -> Path | None:
    """$XDG_CACHE_HOME, else ~/.cache; None where neither is an absolute path.  The XDG base
    directory rules ignore an unset, empty or relative XDG_CACHE_HOME (a relative one, or a
    quoted '~/.cache', made a folder under the working directory); an empty or relative HOME
    is passed over the same way, for the passwd entry's home."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg)
    home = os.environ.get("HOME", "")
    if not os.path.isabs(home):
        try:
            home = pwd.getpwuid(os.getuid()).pw_dir
        except KeyError:  # no passwd entry (a container's --user 12345)
            return None
    return Path(home) / ".cache" if os.path.isabs(home) else None


def wait_timeout_ns() -> int:
    return int(_number(WAIT_TIMEOUT_S, 0.001, MOST_WAIT_S) * 1e9)  # a millisecond to about 11 days


def heap_bytes() -> int:
    return int(_number(HEAP_MB, 1, _MOST_MB) * (1 << 20))


def trace() -> bool:
    return _flag(TRACE)


def pdl() -> bool:
    return _flag(PDL)


def graph_buffers() -> str:
    raw = GRAPH_BUFFERS.raw().strip().lower()
    if raw not in GRAPH_BUFFER_MODES:
        raise _refuse(GRAPH_BUFFERS, f"one of {', '.join(GRAPH_BUFFER_MODES)}")
    return raw


def heap_max_bytes() -> int:
    return int(_number(HEAP_MAX_MB, 1, _MOST_MB, zero=True) * (1 << 20))


def stage_bytes() -> int:
    return int(_number(STAGE_MB, 1 / 16, _MOST_MB) * (1 << 20)) // 16 * 16  # at least 64 KiB, in 16-byte vectors


def codegen_settings() -> dict[str, str]:
    """The settings that change generated code: part of every cache key."""
    return {s.name: s.raw() for s in ALL if s.affects_codegen}


def precompile_dtypes() -> tuple[str, ...]:
    """The dtype names of PURLIN_PRECOMPILE, as written (the runtime parses them); () when off.
    An empty name is refused, not skipped: "," read as no names at all turned precompiling off."""
    raw = PRECOMPILE.raw().strip()
    if raw.lower() in ("none", *_FALSE):  # off as every switch spells it
        return ()
    names = tuple(name.strip() for name in raw.split(","))
    if not all(names):
        raise _refuse(PRECOMPILE, "dtype names separated by commas, none of them empty (e.g. float32,bf16), "
                                  "or 0, none or off")
    return tuple(dict.fromkeys(names))
