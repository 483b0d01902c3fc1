"""Command-line conventions: --version, ``python -m purlinc``, ``-`` for standard input, a
quiet exit on a closed pipe, 0644 artifacts, the output place checked before compiling, the
defaulted world size said aloud, progress only on a terminal.  Error texts are exact."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import purlinc
from purlinc.cli import check as check_command
from purlinc.cli import main

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


def run(*argv: str, stdin: bytes | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "purlinc", *map(str, argv)], input=stdin, capture_output=True,
                          env=env, cwd=cwd, timeout=120)


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PURLIN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "conventions-cache"))


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"purlinc {purlinc.__version__}\n"


def test_python_dash_m():
    done = run("--version")
    assert (done.returncode, done.stdout.decode(), done.stderr) == (0, f"purlinc {purlinc.__version__}\n", b"")


def test_standard_input():
    text = (EXAMPLES / "allgather.pln").read_bytes()
    done = run("dump", "-", "--ranks", "2", stdin=text)
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().startswith("collective allgather (R=2, copy)\nrank 0:\n")


def test_standard_input_errors_are_located():
    done = run("check", "-", "--spec-only", stdin=b"collective a {\n  in[r] = x[r]\n  out[r] = y[r]\n  copy\n}\n")
    assert done.returncode == 2
    assert done.stderr.decode().splitlines() == [
        "<stdin>:3:12: error: output chunk y[0] of rank 0 has no producer: no input names it",
        "      out[r] = y[r]",
        "               ^^^^",
        "note: no input names any chunk called 'y'",
        "note: while checking a for R=1",
    ]


def test_standard_input_that_is_not_utf8():
    done = run("dump", "-", stdin=b"collective a {\n  in[r] = x\xe9[r]\n")
    assert done.returncode == 2
    assert done.stderr.decode().splitlines() == [
        "<stdin>:2:12: error: not UTF-8 text: byte 0xe9 (at byte offset 26)",
        "      in[r] = x\ufffd[r]",
        "               ^",
    ]


@pytest.mark.parametrize("command, start", [("dump", "collective allgather (R=2"), ("draw", "<svg ")])
def test_a_path_is_never_read_as_text(tmp_path, capsys, command, start):
    # A file name with a brace in it is still a file name (draw read it as .pln text).
    path = tmp_path / "odd{name}.pln"
    path.write_bytes((EXAMPLES / "allgather.pln").read_bytes())
    code, out, err = cli(capsys, command, path, "--ranks", "2")
    assert (code, err) == (0, "") and out.startswith(start)


def test_draw_reads_standard_input():
    # Its help says "or - for standard input", as every subcommand's does; it said "no such file: -".
    done = run("draw", "-", "--ranks", "2", "--compare", "ring,direct-push", stdin=(EXAMPLES / "allgather.pln").read_bytes())
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().startswith("<svg ") and done.stdout.decode().count("allgather ring") == 1


@pytest.mark.parametrize("args, start", [
    ("--json", b'{\n  "colle'),
    # text dumps of several MB were one write, and ended with status 0: Python wrote what the
    # pipe took, then an empty write, and never raised BrokenPipeError
    ("--stage snac", b"schedule a"), ("--stage spec", b"collective"),
])
def test_closed_pipe_exits_quietly(args, start):
    command = f"{sys.executable} -m purlinc dump {EXAMPLES / 'alltoall.pln'} --ranks 64 {args} | head -c 10"
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.stdout == start[:10] and len(done.stdout) == 10
    assert done.stderr == b""  # no BrokenPipeError, no traceback
    assert done.returncode == 141  # 128 + SIGPIPE, as for cat or grep


def test_an_error_into_a_closed_pipe_keeps_its_status(tmp_path):
    """``purlinc check bad.pln 2>&1 | head -1``: the print of the error met a closed stderr and
    its BrokenPipeError escaped main (status 1, which names nothing).  Now status 2 still says
    the input was wrong."""
    bad = tmp_path / "bad.pln"
    bad.write_text("collective bad {\n    in[r] = x[r]\n    out[r] = y[0..R]\n    copy\n}\n")
    child = subprocess.Popen([sys.executable, "-m", "purlinc", "dump", str(bad), "--ranks", "4"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    child.stderr.close()  # the reader is gone before the error is written
    assert child.wait(timeout=120) == 2


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_an_error_into_a_full_stderr_keeps_its_status(tmp_path):
    """``purlinc compile missing.pln 2>/dev/full``: the print of the error failed with ENOSPC,
    which escaped main, and the status was 1 (names nothing) where it should be 2."""
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "purlinc", "dump", str(tmp_path / "missing.pln")],
                              stdout=subprocess.DEVNULL, stderr=full, env={**os.environ, "PYTHONPATH": str(REPO)},
                              timeout=120)
    assert done.returncode == 2


def _child_env(buffered: bool) -> dict:
    """The environment of a ``python -m purlinc`` child, with Python's usual buffered standard
    output or with PYTHONUNBUFFERED: a failed write shows up at another place in each."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return {**env, "PYTHONPATH": str(REPO), **({} if buffered else {"PYTHONUNBUFFERED": "1"})}


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("args", [["--help"], ["--version"], ["compile", "--help"], ["dump", "EXAMPLE"]],
                         ids=["help", "version", "compile-help", "dump"])
def test_a_full_standard_output_is_said_once_with_status_2(args, buffered):
    """`purlinc --help > /dev/full` exited 0 with nothing written (argparse drops a write that
    fails) or, buffered, 120 with "Exception ignored" from the interpreter's flush at exit; `purlinc
    dump x.pln > /dev/full` said the error, then failed that flush too (120, not 2)."""
    args = [str(EXAMPLES / "allgather.pln") if a == "EXAMPLE" else a for a in args]
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "purlinc", *args], stdout=full, stderr=subprocess.PIPE,
                              env=_child_env(buffered), timeout=120)
    assert done.stderr.decode() == "error: cannot write to standard output: No space left on device\n"
    assert done.returncode == 2


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_help_into_a_closed_pipe_exits_quietly(buffered):
    """`purlinc compile --help | head -1`, the reader gone first: "Exception ignored ...
    BrokenPipeError" and status 120, where a dump ends quietly with 141."""
    child = subprocess.Popen([sys.executable, "-m", "purlinc", "compile", "--help"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=_child_env(buffered))
    child.stdout.close()  # the reader is gone before the help is written
    assert child.wait(timeout=120) == 141
    assert child.stderr.read() == b""
    child.stderr.close()


def test_the_console_script_takes_a_ctrl_c_during_its_imports_as_status_130(monkeypatch):
    """A Ctrl-C in the first few tenths of a second (the imports) printed a traceback and exited 1."""
    import builtins

    from purlinc import __main__ as entry

    real_import = builtins.__import__

    def interrupted(name, *args, **kwargs):
        if name == "purlinc.cli":
            raise KeyboardInterrupt
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", interrupted)
    assert entry.run() == 130


def test_compile_writes_0644_and_says_the_default_world_size(tmp_path, capsys):
    old = os.umask(0o022)
    try:
        code, out, err = cli(capsys, "compile", EXAMPLES / "allgather.pln", "--arch", "sm_90", "-o", tmp_path / "out")
    finally:
        os.umask(old)
    assert code == 0, err
    assert err == "note: --ranks not given: compiling for R=8 ranks (the default)\n"
    written = [Path(line) for line in out.splitlines()]
    assert len(written) == 4
    assert {stat.S_IMODE(p.stat().st_mode) for p in written} == {0o644}


def test_compile_with_ranks_says_nothing(tmp_path, capsys):
    code, out, err = cli(capsys, "compile", EXAMPLES / "allgather.pln", "-R", "2", "-o", tmp_path)
    assert (code, err) == (0, "")


def _no_compile(monkeypatch):
    """Any compile work from here on fails the test: the output check must come first."""
    from purlinc import pipeline

    def refuse(*args, **kwargs):
        raise AssertionError("compiled before checking the output directory")

    monkeypatch.setattr(pipeline, "compile", refuse)
    monkeypatch.setattr(pipeline, "parse_stage", refuse)


def test_output_is_a_file(tmp_path, capsys, monkeypatch):
    _no_compile(monkeypatch)
    target = tmp_path / "f"
    target.write_text("")
    code, out, err = cli(capsys, "compile", EXAMPLES / "allgather.pln", "-o", target)
    assert (code, out) == (2, "")
    assert err == f"error: -o {target}: {target} is a file, not a directory\nnote: choose another place with -o DIR\n"


def test_output_under_a_file(tmp_path, capsys, monkeypatch):
    _no_compile(monkeypatch)
    (tmp_path / "f").write_text("")
    target = tmp_path / "f" / "a" / "b"
    code, out, err = cli(capsys, "compile", EXAMPLES / "allgather.pln", "-o", target)
    assert (code, out) == (2, "")
    assert err == (f"error: -o {target}: {tmp_path / 'f'} is a file, so {target} cannot be created under it\n"
                   "note: choose another place with -o DIR\n")


def test_output_in_an_unwritable_place(tmp_path, capsys, monkeypatch):
    _no_compile(monkeypatch)
    target = Path("/proc/purlin-out")  # the kernel refuses mkdir here, even to root
    code, out, err = cli(capsys, "compile", EXAMPLES / "allgather.pln", "-o", target)
    assert (code, out) == (2, "")
    assert err.startswith(f"error: -o {target}: cannot create {target}: ")
    assert err.endswith("\nnote: choose another place with -o DIR\n")


def test_default_output_under_a_file(tmp_path, capsys, monkeypatch):
    _no_compile(monkeypatch)
    (tmp_path / "purlin-out").write_text("")
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, "compile", EXAMPLES / "allgather.pln")
    assert (code, out) == (2, "")
    assert err == ("error: the default output directory purlin-out/<collective>: purlin-out is a file, not a directory\n"
                   "note: choose another place with -o DIR\n")


@pytest.mark.parametrize("kind", ["file", "broken link"])
def test_default_output_folder_of_the_collective_is_checked_before_compiling(tmp_path, capsys, monkeypatch, kind):
    """./purlin-out/<name>: known once the spec is read, and checked then, not after NVRTC."""
    from purlinc import pipeline

    monkeypatch.setattr(pipeline, "compile", lambda *args, **kwargs: pytest.fail("compiled before checking the "
                                                                                "output directory"))
    (tmp_path / "purlin-out").mkdir()
    if kind == "file":
        (tmp_path / "purlin-out" / "allgather").write_text("")
    else:
        (tmp_path / "purlin-out" / "allgather").symlink_to(tmp_path / "nowhere")
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, "compile", EXAMPLES / "allgather.pln", "--ranks", "2")
    problem = "is a file, not a directory" if kind == "file" else "is a broken symbolic link"
    assert (code, out) == (2, "")
    assert err == (f"error: the default output directory purlin-out/allgather: purlin-out/allgather {problem}\n"
                   "note: choose another place with -o DIR\n")


def test_an_output_its_encoding_cannot_write_says_so(monkeypatch):
    """A UnicodeEncodeError (a ValueError) reached the generic handler and read as a spec error."""
    import io

    from purlinc.cli import common
    from purlinc.errors import PurlinError

    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="ascii"))
    with pytest.raises(PurlinError) as info:
        common.emit("purlin-out/\u00fc/a.cu\n")
    assert info.value.message == "cannot write to standard output: its encoding, ascii, cannot write '\u00fc'"
    assert info.value.notes == ("set PYTHONIOENCODING=utf-8 (or a UTF-8 locale) and run again",)


def test_a_missing_file_named_dash_is_not_standard_input_in_the_message(tmp_path, capsys, monkeypatch):
    """./- is a file named "-": "no such file: -" read as if standard input were missing."""
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, "dump", "./-")
    assert (code, out, err) == (2, "", "error: no such file: ./-\n")


def test_too_large_input(tmp_path, capsys):
    path = tmp_path / "big.pln"
    path.write_bytes(b"// " + b"x" * (10 * 1024 * 1024) + b"\n")
    code, out, err = cli(capsys, "check", path)
    assert (code, out) == (2, "")
    assert err == (f"error: {path} is too large to be a collective: 10,485,764 bytes, the limit is 65,536\n"
                   "note: a collective is a few lines; is this the right file?\n")


def test_too_large_standard_input():
    done = run("dump", "-", stdin=b" " * (1 << 20))
    assert done.returncode == 2
    assert done.stderr.decode() == ("error: <stdin> is too large to be a collective: more than 65,536 bytes, "
                                    "the limit is 65,536\nnote: a collective is a few lines; is this the right file?\n")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_only_on_a_terminal(monkeypatch, capsys):
    code, out, err = cli(capsys, "check", EXAMPLES / "allgather.pln", "--ranks", "1..4")
    assert (code, err) == (0, "")  # not a terminal: silent
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(check_command.time, "monotonic", iter(range(0, 10_000)).__next__)  # every update shows
    code = main(["check", str(EXAMPLES / "allgather.pln"), "--ranks", "1..4"])
    assert code == 0
    shown = terminal.getvalue()
    assert "\r\x1b[Kchecking allgather: spec for R=3 (up to R=4)" in shown
    assert "\r\x1b[Kchecking allgather: schedules for R=4 (4/4 sizes)" in shown
    assert shown.endswith("\r\x1b[K")  # the line is cleared before the result is printed


def test_internal_errors_still_exit_3(monkeypatch, capsys):
    from purlinc import pipeline

    def broken(*args, **kwargs):
        raise KeyError("oops")

    monkeypatch.setattr(pipeline, "parse_stage", broken)
    code, out, err = cli(capsys, "dump", EXAMPLES / "allgather.pln")
    assert (code, out) == (3, "")
    assert err.startswith("internal error (a bug in purlinc, not in your input): KeyError: 'oops'\n")


# ---- a failed compile leaves no output place behind ----------------------------------------

@pytest.mark.parametrize("output", [None, "new/a/b"])
def test_a_failed_compile_creates_no_directory(tmp_path, capsys, monkeypatch, output):
    """The output place is checked (and made) before compiling; a compile that then fails --
    a missing file, an algorithm that does not apply -- took it back only now: before, it left
    an empty ./purlin-out (or every missing parent of -o)."""
    monkeypatch.chdir(tmp_path)
    flags = [] if output is None else ["-o", output]
    code, out, err = cli(capsys, "compile", tmp_path / "missing.pln", *flags)
    assert (code, out, err) == (2, "", f"error: no such file: {tmp_path / 'missing.pln'}\n")
    code, out, err = cli(capsys, "compile", EXAMPLES / "allgather.pln", "-R", "2", "-a", "two-shot", *flags)
    assert code == 2 and out == "" and "two-shot applies to reductions only" in err
    assert list(tmp_path.iterdir()) == []


def test_a_failed_compile_keeps_a_directory_that_was_there(tmp_path, capsys):
    (tmp_path / "kept").mkdir()
    code, _, _ = cli(capsys, "compile", tmp_path / "missing.pln", "-o", tmp_path / "kept" / "new")
    assert code == 2 and [p.name for p in tmp_path.iterdir()] == ["kept"] and not list((tmp_path / "kept").iterdir())


def test_output_is_a_device(capsys, monkeypatch):
    _no_compile(monkeypatch)
    code, out, err = cli(capsys, "compile", EXAMPLES / "allgather.pln", "-o", "/dev/null")
    assert (code, out) == (2, "")
    assert err == "error: -o /dev/null: /dev/null is not a directory\nnote: choose another place with -o DIR\n"


# ---- standard output that cannot be written --------------------------------------------------

@pytest.mark.parametrize("argv", [["dump", EXAMPLES / "allgather.pln"], ["check", EXAMPLES / "allgather.pln", "-R", "2"]])
def test_closed_standard_output_is_a_user_error(argv):
    """`purlinc dump x.pln >&-`: an internal error (exit 3, AttributeError on None) before."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "purlinc", *map(str, argv)], capture_output=False, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120,
                          preexec_fn=lambda: os.close(1))
    assert done.returncode == 2
    assert done.stderr.decode() == ("error: standard output is closed: purlinc prints its results (or the paths it "
                                    "wrote) there\nnote: redirect it to a file or /dev/null instead of closing it\n")


def test_full_standard_output_says_so(capsys, monkeypatch):
    """`purlinc dump x.pln > /dev/full`: 'error: No space left on device' named nothing."""
    class Full(io.StringIO):
        def flush(self):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(sys, "stdout", Full())
    code = main(["dump", str(EXAMPLES / "allgather.pln")])
    assert code == 2
    assert capsys.readouterr().err == "error: cannot write to standard output: No space left on device\n"


def test_a_missing_example_says_where_the_examples_are(tmp_path, capsys, monkeypatch):
    """From an installed package, `purlinc --help`'s own example (examples/allgather.pln) is no
    file: the error says the examples come with the source repository."""
    monkeypatch.chdir(tmp_path)
    code = main(["dump", "examples/allgather.pln"])
    assert code == 2
    assert capsys.readouterr().err == ("error: no such file: examples/allgather.pln\nnote: the examples are in "
                                       "Purlin's source repository (examples/), not in an installed package\n")
