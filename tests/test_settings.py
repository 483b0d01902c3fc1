"""Environment settings (purlinc/settings.py): values are checked where they are read, and a
mistake names the variable and what it takes, instead of a bare Python exception or a
silent reading (an empty PURLIN_HEAP_MB raised "could not convert string to float: ''",
PURLIN_WAIT_TIMEOUT_S=-1 gave a negative bound, PURLIN_NO_CACHE=false turned the cache off)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from purlinc import settings
from purlinc.errors import PurlinError

NUMBERS = [
    ("PURLIN_WAIT_TIMEOUT_S", settings.wait_timeout_ns, "2.5", 2_500_000_000),
    ("PURLIN_HEAP_MB", settings.heap_bytes, "512", 512 << 20),
    ("PURLIN_HEAP_MAX_MB", settings.heap_max_bytes, "0", 0),
    ("PURLIN_HEAP_MAX_MB", settings.heap_max_bytes, "1024", 1 << 30),
    ("PURLIN_STAGE_MB", settings.stage_bytes, "0.25", 1 << 18),
]


@pytest.mark.parametrize("name, read, value, expected", NUMBERS)
def test_numbers_read(monkeypatch, name, read, value, expected):
    monkeypatch.setenv(name, value)
    assert read() == expected


BAD = ["abc", "nan", "inf", "1e400", "-1", "99999999999999999999", "0", "1_000", "\u0661\u0660"]  # the last: Arabic-Indic 10
REFUSED = [(name, read, value) for name, read in sorted({(n, r) for n, r, _, _ in NUMBERS}, key=lambda item: item[0])
           for value in BAD if (name, value) != ("PURLIN_HEAP_MAX_MB", "0")]  # 0 means no bound there


@pytest.mark.parametrize("name, read, value", REFUSED)
def test_numbers_refused(monkeypatch, name, read, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(PurlinError) as caught:
        read()
    assert caught.value.message.startswith(f"{name}={value!r}: expected a number from "), caught.value.message
    assert caught.value.notes and caught.value.notes[0].startswith(f"{name}: ")


def test_stage_mb_is_read_in_whole_vectors(monkeypatch):
    monkeypatch.setenv("PURLIN_STAGE_MB", "0.1")
    assert settings.stage_bytes() == 104_848  # 0.1 MiB is 104,857.6 bytes: rounded down to 16


@pytest.mark.parametrize("value", ["0", "none", "off", "False", "no"])
def test_precompile_is_turned_off_as_every_switch_is(monkeypatch, value):
    monkeypatch.setenv("PURLIN_PRECOMPILE", value)
    assert settings.precompile_dtypes() == ()


@pytest.mark.parametrize("value", [",", "float32,", " , bfloat16", "float32,,float16"])
def test_precompile_refuses_an_empty_name(monkeypatch, value):
    """"," was read as a list of no names: precompiling silently off."""
    monkeypatch.setenv("PURLIN_PRECOMPILE", value)
    with pytest.raises(PurlinError) as caught:
        settings.precompile_dtypes()
    assert caught.value.message == (f"PURLIN_PRECOMPILE={value!r}: expected dtype names separated by commas, none "
                                    "of them empty (e.g. float32,bf16), or 0, none or off")


@pytest.mark.parametrize("name, read, on", [
    ("PURLIN_NO_CACHE", settings.cache_enabled, False), ("PURLIN_TRACE", settings.trace, True),
    ("PURLIN_PDL", settings.pdl, True),
])
def test_switches(monkeypatch, name, read, on):
    for value in ("1", "true", "Yes", " on "):
        monkeypatch.setenv(name, value)
        assert read() is on, value
    for value in ("0", "false", "NO", "off "):
        monkeypatch.setenv(name, value)
        assert read() is not on, value
    for value in ("-1", "2", "enable", "0 0"):
        monkeypatch.setenv(name, value)
        with pytest.raises(PurlinError) as caught:
            read()
        assert caught.value.message == f"{name}={value!r}: expected 1, true, yes or on; or 0, false, no or off"


@pytest.mark.parametrize("setting", settings.ALL, ids=lambda s: s.name)
def test_an_empty_value_is_the_default(monkeypatch, setting):
    """``export PURLIN_PDL=`` turned PDL off (an empty switch read as off) while an empty
    PURLIN_HEAP_MB was refused: every setting now reads an empty value as unset."""
    for value in ("", "  "):
        monkeypatch.setenv(setting.name, value)
        assert setting.raw() == setting.default
    monkeypatch.setenv("PURLIN_PDL", "")
    assert settings.pdl() is True
    monkeypatch.setenv("PURLIN_HEAP_MB", " ")
    assert settings.heap_bytes() == int(settings.HEAP_MB.default) << 20


def test_cache_dir_expands_the_home_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("PURLIN_CACHE_DIR", "~/.cache/purlin-test")
    assert settings.cache_dir() == tmp_path / ".cache" / "purlin-test"


def test_xdg_cache_home_counts_only_when_absolute(monkeypatch, tmp_path):
    """A relative XDG_CACHE_HOME (or a quoted '~/.cache') made a cache folder under the working
    directory; the XDG rules say to ignore it, as an empty one."""
    monkeypatch.delenv("PURLIN_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert settings.cache_dir() == tmp_path / "xdg" / "purlin"
    for ignored in ("~/.cache", "rel", ""):
        monkeypatch.setenv("XDG_CACHE_HOME", ignored)
        assert settings.cache_dir() == tmp_path / ".cache" / "purlin"


def test_a_cache_dir_of_an_unknown_user_is_refused_by_name(monkeypatch, tmp_path):
    """~nosuchuser/... raised Path.expanduser's RuntimeError: the command line's internal error."""
    monkeypatch.setenv("PURLIN_CACHE_DIR", "~no-such-user-purlin/cache")
    with pytest.raises(PurlinError) as caught:
        settings.cache_dir()
    assert caught.value.message == ("PURLIN_CACHE_DIR='~no-such-user-purlin/cache': expected a directory (a leading "
                                    "~ names the home directory of a known user)")
    spec = Path(__file__).resolve().parents[1] / "examples" / "allgather.pln"
    done = subprocess.run([sys.executable, "-m", "purlinc", "compile", str(spec), "--ranks", "2", "-o",
                           str(tmp_path / "out")], capture_output=True, text=True,
                          env={**__import__("os").environ, "PURLIN_CACHE_DIR": "~no-such-user-purlin/cache"},
                          timeout=300)
    assert done.returncode == 2, done.stderr
    assert "PURLIN_CACHE_DIR='~no-such-user-purlin/cache': expected a directory" in done.stderr


def test_the_command_line_refuses_a_bad_debug_level(tmp_path):
    """The runtime's log refuses PURLIN_DEBUG=loud at import; the command line said nothing."""
    spec = Path(__file__).resolve().parents[1] / "examples" / "allgather.pln"
    done = subprocess.run([sys.executable, "-m", "purlinc", "check", str(spec), "-R", "2"], capture_output=True,
                          text=True, env={**__import__("os").environ, "PURLIN_DEBUG": "loud"}, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "PURLIN_DEBUG='loud': expected 0, 1, INFO, DEBUG, TRACE, WARN or WARNING" in done.stderr
