"""``purlinc``: compile | dump | check | draw, one module per subcommand.  User errors go to
stderr with exit status 2, never a traceback (``PURLIN_DEBUG=1`` re-raises); internal bugs say
so and how to reproduce them."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from purlinc import __version__, settings
from purlinc.cli import check, common, compile, draw, dump
from purlinc.errors import PurlinError

# Subcommands in the order ``purlinc --help`` lists them: each module adds its parser and runs it.
SUBCOMMANDS = {"compile": compile, "dump": dump, "check": check, "draw": draw}


class _Parser(argparse.ArgumentParser):
    """argparse's parser, except that help and ``--version`` that cannot be written say so.
    argparse drops a write that fails (``purlinc --help > /dev/full`` exited 0 with nothing
    written), and a buffered one failed at interpreter exit instead ("Exception ignored",
    status 120, for ``purlinc --help | head -1`` too).  Subcommand parsers are of this class too
    (``add_subparsers`` makes its parsers of the class of the parser it is called on)."""

    def _print_message(self, message, file=None):
        if not message:
            return
        file = file or sys.stderr
        try:
            file.write(message)
            file.flush()
        except BrokenPipeError:
            raise  # a reader that has gone: main ends quietly, as for any output
        except OSError as error:
            if file is sys.stdout:
                raise common.stdout_error(error) from None
            # a usage error into a stderr that cannot take it: its exit status still says it


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="purlinc",
        description="Purlin: compile collective specs (.pln) into verified SNAC schedules and CUDA kernels.",
        epilog="Examples:\n  purlinc compile examples/allgather.pln --arch sm_90\n"
        "  purlinc dump examples/allreduce.pln --ranks 8 --stage snac\n"
        "  purlinc check examples/alltoall.pln --ranks 1..64\n\n"
        "The .pln language is described in docs/LANGUAGE.md. Errors in the input exit with status 2.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"purlinc {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    for module in SUBCOMMANDS.values():
        module.add_parser(commands)
    return parser


def _silence(stream=None) -> None:
    """Point ``stream`` (stdout) at /dev/null so the interpreter's final flush does not fail again."""
    stream = stream or sys.stdout
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _report(text: str) -> None:
    """``text`` on stderr; a reader that has gone (``purlinc check ... 2>&1 | head -1``) or a
    full disk ends it quietly: the status still says what happened (the OSError here escaped
    main, and a user error exited 1)."""
    try:
        print(text, file=sys.stderr)
        sys.stderr.flush()
    except OSError:  # a closed pipe, or a full disk (2>/dev/full): the status must still say what happened
        _silence(sys.stderr)


def _user_error(error: Exception, text: str) -> int:
    """An error in the input or the environment: one line (or a rendered error) on stderr;
    with PURLIN_DEBUG the exception itself, for its traceback."""
    if settings.debug():
        raise error
    _report(text)
    return 2


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)  # --help and --version end here (SystemExit, status 0)
        settings.log_level()  # a PURLIN_DEBUG the runtime's log would refuse is refused here too
        if sys.stdout is None:  # `purlinc ... >&-`: every subcommand prints what it did there
            raise PurlinError("standard output is closed: purlinc prints its results (or the paths it wrote) "
                              "there", notes=("redirect it to a file or /dev/null instead of closing it",))
        status = SUBCOMMANDS[args.command].run(args)
        try:
            sys.stdout.flush()  # inside the try: a closed pipe shows up here
        except BrokenPipeError:
            raise
        except OSError as error:
            raise common.stdout_error(error) from None
        return status
    except BrokenPipeError:
        # `purlinc dump ... | head`: the reader has gone; stop quietly, as cat and grep do.
        _silence()
        return 141  # 128 + SIGPIPE, what a shell reports for a process the signal ended
    except common.StdoutError as error:
        _silence()  # its buffered text would fail again at exit (status 120 and "Exception ignored")
        return _user_error(error, error.render())
    except PurlinError as error:
        return _user_error(error, error.render())
    except ValueError as error:  # bad dtype / op names and similar option mistakes
        return _user_error(error, f"error: {error}")
    except OSError as error:  # an unreadable cache, a full disk: the environment, not a bug
        where = f"{error.filename}: " if error.filename else ""
        return _user_error(error, f"error: {where}{error.strerror or error}")
    except KeyboardInterrupt:
        return 130
    except Exception as error:  # noqa: BLE001 - the last line of defence: name it a bug
        if settings.debug():
            raise
        argv_text = " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
        _report(f"internal error (a bug in purlinc, not in your input): {type(error).__name__}: {error}\n"
                f"reproduce with: PURLIN_DEBUG=1 purlinc {argv_text}")
        return 3
