"""What every subcommand shares: argument types, the option groups, and turning parsed
arguments into a source and LowerOptions (the same ones ``compile`` would use)."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import secrets
import stat
import sys
from pathlib import Path

from purlinc.atom.atoms import DEFAULT_ATOM, kernel_atoms
from purlinc.dtypes import DTYPES
from purlinc.errors import PurlinError
from purlinc.snac.algorithms import ALGORITHMS as ALGORITHM_REGISTRY, slotted_names

ATOMS = kernel_atoms()  # the atom registry's atoms with kernels (compile and dump write CUDA)
ALGORITHMS = ALGORITHM_REGISTRY.names()
PACKING = ", ".join(r.name for r in ALGORITHM_REGISTRY.records() if r.packed)  # algorithms that lower packed
SLOTTED = slotted_names()  # algorithms that honour --slots
TWO_COPIES = ", ".join(r.name for r in ALGORITHM_REGISTRY.records() if r.stage_copies > 1)
FILE_HELP = "the .pln collective (see docs/LANGUAGE.md), or - for standard input"
DEFAULT_DTYPE = "bfloat16"  # compile's and dump's without --dtype (pipeline.compile's default)


_INTEGER = re.compile(r"-?[0-9]+")  # ASCII digits only: int() also takes "1_000", " 3" and "٣"


def integer(text: str) -> int:
    """A command-line integer as it is written in a .pln file, or ValueError."""
    if not _INTEGER.fullmatch(text):
        raise ValueError(text)
    return int(text)


def param(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=INTEGER, got {text!r}")
    try:
        return name, integer(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"parameter {name}: {value!r} is not an integer") from None


class ParamAction(argparse.Action):
    """``--param NAME=N``, repeatable, each name once: a second value for a name is far more
    likely a slip (an edited command line) than a wish for the last one to win."""

    def __call__(self, parser, namespace, values, option_string=None):
        name, value = values
        given = list(getattr(namespace, self.dest, None) or [])  # never the shared default list
        earlier = dict(given)
        if name in earlier:
            raise argparse.ArgumentError(self, f"{name} given twice ({name}={earlier[name]}, {name}={value}): give it once")
        setattr(namespace, self.dest, given + [(name, value)])


def path(text: str) -> str:
    """A file or directory name: an empty one (``-o ''``, an unset shell variable) is refused
    rather than read as "not given", which would write to the default place."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return text


def positive(text: str) -> int:
    try:
        value = integer(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def world_sizes(text: str) -> range:
    lo, sep, hi = text.partition("..")
    try:
        sizes = range(integer(lo), integer(hi) + 1) if sep else range(integer(text), integer(text) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO..HI (inclusive), got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"expected world sizes of at least 1 with LO <= HI, got {text!r}")
    return sizes


def byte_size(text: str) -> int:
    units = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
             "t": 1 << 40, "tib": 1 << 40}
    number = text.rstrip("kKmMgGtTiIbB")
    try:
        value = integer(number) * units[text[len(number):].lower()]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"expected a size like 4096, 64KiB or 1MiB, got {text!r}") from None
    if value < 1:  # a timeline of empty messages would be drawn with one element per chunk: a lie
        raise argparse.ArgumentTypeError(f"expected a size of at least 1 byte, got {text!r}")
    return value


def sizes_list(sizes: list[int]) -> str:
    """``R=1``, ``R=1, 3``, or the first few and how many (a range of 64 sizes stays one line)."""
    shown = ", ".join(map(str, sizes[:8])) + (f", ... ({len(sizes)} sizes)" if len(sizes) > 8 else "")
    return f"R={shown}"


def add_common(parser: argparse.ArgumentParser, ranks_default: int | None) -> None:
    parser.add_argument("file", help=FILE_HELP)
    parser.add_argument(
        "--ranks", "-R", type=positive, default=ranks_default, metavar="N",
        help=f"world size (number of ranks){'' if ranks_default is None else f'; default {ranks_default}'}",
    )
    add_params(parser)


@contextlib.contextmanager
def default_ranks_noted(world_size: int, defaulted: bool):
    """An error inside says R was the default: "small is not defined for R=8" alone reads as if
    8 had been asked for."""
    try:
        yield
    except PurlinError as error:
        if not defaulted:
            raise
        raise error.with_note(f"--ranks not given: R={world_size} is the default (choose one with --ranks N)") from None


def add_params(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--param", "-p", type=param, action=ParamAction, default=[], metavar="NAME=N",
        help="bind a collective parameter, e.g. --param root=1 (repeatable, each name once)",
    )


def add_lowering(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--algorithm", "-a", choices=ALGORITHMS, help="orchestration algorithm (default: chosen per spec)")
    parser.add_argument("--channels", type=positive, help="independent channels (thread blocks) per rank")
    parser.add_argument("--slices", type=positive, help="pipeline slices per chunk and channel")
    parser.add_argument("--slots", type=positive, help="staging slots per edge (flow control); default: one per message")
    parser.add_argument(
        "--registered", choices=("none", "in", "out", "both"), default="none",
        help="which caller buffers are peer-registered (symmetric): lets stages skip the staging buffer",
    )
    parser.add_argument(
        "--packed", action="store_true",
        help=f"LL packing ({PACKING}): data notifies ride in the staged data, a flag in every 16-byte packet",
    )
    parser.add_argument(
        "--stage-copies", type=integer, choices=(1, 2), default=None,
        help=f"staging copies by call parity ({TWO_COPIES}): 2 takes the consumers' acknowledgements off the "
             "critical path; default: what the atom can address (2 for ldst and tma)",
    )


def add_codegen(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", default="sm_90", help="target: sm_80 or newer that NVRTC knows, e.g. sm_80, sm_86, "
                        "sm_89, sm_90, sm_100, sm_120 (arch-specific: sm_90a, sm_100a; family: sm_100f); default sm_90")
    parser.add_argument("--atom", choices=ATOMS, default=DEFAULT_ATOM, help=f"datapath mechanism (default {DEFAULT_ATOM})")
    # None until read (dtype_name): an error about the default must not blame a flag never given
    parser.add_argument("--dtype", default=None, help=f"element type: {', '.join(DTYPES)} (default {DEFAULT_DTYPE})")
    parser.add_argument("--op", default=None,
                        help="reduction operator of a reduce collective: sum (default), prod, max, min")


def add_hierarchy(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gpus-per-node", type=positive, default=None, metavar="G",
        help="plan hierarchically: nodes of G ranks (SNAC inside a node, NCCL between nodes); "
        "R must be a multiple of G",
    )


def check_codegen(args) -> None:
    """Refuse a bad --arch, --atom for it, --dtype or --op before any work, whatever is asked
    for: a dump of an early stage or a copy collective (which has no reduction) would
    otherwise accept them silently, and the same command would fail once it reached codegen."""
    from purlinc.atom.atoms import applicable_atoms, get_atom, lookup_atom, parse_arch
    from purlinc.dtypes import DType, ReduceOp

    try:
        target = parse_arch(args.arch)
    except PurlinError as error:  # the message names the value; the flag is named here
        raise PurlinError(f"--arch: {error.message}", notes=error.notes) from None
    atom = lookup_atom(args.atom)
    if not atom.supports(target):
        raise PurlinError(f"--atom {args.atom} needs sm_{atom.min_arch} or newer, not --arch {args.arch}",
                          notes=(f"atoms for {target.name}: {', '.join(applicable_atoms(target))}",))
    get_atom(args.atom, target)  # what else the code generator checks (PurlinError)
    DType.parse(dtype_name(args))  # ValueError naming the known ones
    if args.op is not None:
        ReduceOp.parse(args.op)


def check_op(args, spec) -> None:
    """--op names a reduction: on a copy collective it would be ignored, so it is refused."""
    if args.op is not None and not spec.is_reduce:
        raise PurlinError(f"--op applies to reduce collectives; {spec.name} is a copy")


def check_spec(args, spec, *, kernel: bool = True) -> None:
    """What the code generator would refuse of --op, --dtype and --atom for this spec, refused
    as soon as the spec is known: by compile before its work (one error, not the generator's
    with the pipeline's note on it), and by a dump of any stage past ast, which would otherwise
    print a schedule for options no kernel can be made with.  ``kernel``: a kernel is made (not
    only a spec or schedule printed); without one the default dtype is nobody's choice, and a
    spec whose rows only float32 meets (docs/LANGUAGE.md) prints as it is."""
    check_op(args, spec)
    if kernel or args.dtype is not None:
        check_dtype(args, spec)
    check_sized_atom(args, spec)
    check_sized_copies(args, spec)


def check_dtype(args, spec) -> None:
    """--dtype that a reduction cannot reduce (fp8, a storage format), or that the spec's
    epilogue rows cannot run in: the same reasons the code generator gives, naming the flag."""
    from purlinc.atom.rows import row_problem
    from purlinc.dtypes import DType, reduction_problem

    dtype = DType.parse(dtype_name(args))
    # The epilogue first, as the generator checks it (atom.epilogue.check_rows): its reason is
    # the more precise; located at the rows(E) expression as there.
    problem = None if spec.epilogue is None else row_problem(spec.epilogue.row, dtype)
    if problem is not None:
        raise PurlinError(f"{dtype_flag(args)}: {problem}", spec.epilogue.row_span)
    unreducible = reduction_problem(dtype, spec.name) if spec.is_reduce else None
    if unreducible is not None:
        reason, note = unreducible
        raise PurlinError(f"{dtype_flag(args)}: {reason}", notes=(note,))


def dtype_name(args) -> str:
    """The element type: --dtype as given, or the default."""
    return args.dtype if args.dtype is not None else DEFAULT_DTYPE


def dtype_flag(args) -> str:
    """The element type as an error names it: "--dtype int32" where given, "the default dtype
    bfloat16 (--dtype)" where not (blaming a flag the command line does not have misleads)."""
    return f"--dtype {args.dtype}" if args.dtype is not None else f"the default dtype {DEFAULT_DTYPE} (--dtype)"


def check_sized_atom(args, spec) -> None:
    """Run-time sizes (``with sizes``) run on the ldst atom only: --atom tma is refused in the
    sized code generator's words (its note names the flag)."""
    from purlinc.atom.sized import check_atom

    if spec.sizes is not None and getattr(args, "atom", None) is not None:
        check_atom(args.atom)


def check_sized_copies(args, spec) -> None:
    """--stage-copies 1 for run-time sizes: their lowering always takes two copies (a size
    header and data per slot, written while the consumer may read the last call's), so the
    flag was silently dropped; asked for explicitly, it is refused as --packed refuses it.
    ``spec``: a Spec or the parsed definition (``sizes`` is on both)."""
    if getattr(args, "stage_copies", None) == 1 and spec.sizes is not None:
        from purlinc.snac.sized import ONE_COPY_NOTE, ONE_COPY_REFUSED

        raise PurlinError(f"--stage-copies 1 {ONE_COPY_REFUSED}", notes=(ONE_COPY_NOTE,))


def reduce_op(args) -> str:
    return args.op or "sum"


def check_stage_copies(args) -> None:
    """--stage-copies 2 with an algorithm that lowers to one copy: the lowering would cap it
    (a request for what the atom can address, LowerOptions.stage_copies), but asked for
    explicitly it is a mistake; the algorithm registry says which algorithms take two."""
    from purlinc.pipeline.options import stage_copies_problem

    copies, algorithm = getattr(args, "stage_copies", None), getattr(args, "algorithm", None)
    if copies == 1 and getattr(args, "packed", False):  # the lowering would give it two anyway
        raise PurlinError("--stage-copies 1 does not apply to --packed: packed (LL) schedules always run two "
                          "staging copies", notes=('docs/SNAC.md, "Staging copies by epoch parity"',))
    if copies is None or algorithm is None:
        return
    problem = stage_copies_problem(algorithm, copies)
    if problem is not None:
        raise PurlinError(f"--stage-copies {copies} {problem}", notes=(f"two staging copies apply to {TWO_COPIES} only",))


def check_slots(args, algorithm) -> None:
    """--slots with an algorithm that gives every message its own staging unit: the lowering
    takes the number into the options' key and ignores it, so it is refused instead."""
    from purlinc.snac.algorithms import get_algorithm

    slots = getattr(args, "slots", None)
    if slots is None or get_algorithm(algorithm).uses_slots:
        return
    name = getattr(algorithm, "value", algorithm)
    chosen = "" if getattr(args, "algorithm", None) else " (the spec's default algorithm)"
    raise PurlinError(f"--slots {slots} does not apply to {name}{chosen}: it gives every message its own staging unit",
                      notes=(f"--slots applies to {SLOTTED} (pick one with -a), or leave --slots out",))


def overrides(args) -> dict:
    """The LowerOptions fields the command line sets (applied over the spec's defaults)."""
    from purlinc.snac.ir import Algorithm

    check_stage_copies(args)
    changes = {}
    if getattr(args, "algorithm", None):
        changes["algorithm"] = Algorithm(args.algorithm)
    for name in ("channels", "slices", "slots"):
        if getattr(args, name, None) is not None:
            changes[name] = getattr(args, name)
    registered = getattr(args, "registered", "none")
    if registered != "none":
        changes["registered"] = frozenset({"in", "out"} if registered == "both" else {registered})
    if getattr(args, "packed", False):
        changes["packed"] = True
    if getattr(args, "stage_copies", None) is not None:
        changes["stage_copies"] = args.stage_copies
    return changes


def options(args, spec, **more):
    """The options of a dump or check: those ``compile`` would use (the atom's staging copies
    included, as pipeline.prepare picks them)."""
    from purlinc.pipeline import resolve_options, with_atom_defaults

    changes = with_atom_defaults({**overrides(args), **more}, getattr(args, "atom", None))
    if "slots" not in changes:
        return resolve_options(spec, overrides=changes)
    # --slots refused in the command line's words before resolve_options would refuse it in the
    # API's: the options without it first, then slots on those (the spec's defaults chosen once)
    resolved = resolve_options(spec, overrides={k: v for k, v in changes.items() if k != "slots"})
    check_slots(args, resolved.algorithm)
    return resolve_options(spec, options=resolved, overrides={"slots": changes["slots"]})


def source(args):
    """The input named on the command line: a path (never read as .pln text, whatever it
    contains), or standard input for ``-``."""
    from purlinc import pipeline

    if args.file == "-":
        from purlinc.frontend.source import read_bounded

        return pipeline.SourceText(read_bounded(sys.stdin.buffer, "<stdin>"), "<stdin>")
    return pipeline.load_source(Path(args.file))


# Pieces of standard output written one at a time: a reader that has gone (`| head -1`)
# surfaces as BrokenPipeError (exit 141).  One write of several MB did not: Python wrote what
# the pipe took, then an empty write, and exited 0 as if all had been read.
_PIECE = 1 << 16


def emit(text: str) -> None:
    """``text`` on standard output as it is (no newline added), flushed piece by piece.  A
    standard output that cannot be written (a full disk, /dev/full) is said to be that."""
    try:
        for start in range(0, len(text), _PIECE):
            sys.stdout.write(text[start:start + _PIECE])
            sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as error:
        raise stdout_error(error) from None
    except UnicodeEncodeError as error:  # a path or name its encoding lacks (PYTHONIOENCODING=ascii, a C locale)
        raise PurlinError(f"cannot write to standard output: its encoding, {error.encoding}, cannot write "
                          f"{error.object[error.start:error.end]!r}",
                          notes=("set PYTHONIOENCODING=utf-8 (or a UTF-8 locale) and run again",)) from None


def stdout_error(error: OSError) -> PurlinError:
    return PurlinError(f"cannot write to standard output: {error.strerror or error}")


def output_file_problem(output: str, source: str | None = None) -> str | None:
    """Why the file ``output`` (``draw -o``) cannot be written, or None; checked before the
    drawing is made, which may take seconds.  ``source``: the input's path, never overwritten."""
    if os.path.isdir(output):
        return "is a directory; name a file in it, e.g. schedule.svg"
    if _device(output):  # /dev/null, /dev/stdout, a named pipe: written as they are
        return None if os.access(output, os.W_OK) else "is not writable"
    target = Path(os.path.realpath(output))  # a symbolic link: the file it names
    if source not in (None, "-") and os.path.exists(source) and target.exists() and os.path.samefile(source, target):
        return f"is the input file {source}; writing the drawing there would overwrite it"
    folder = target.parent
    if not folder.exists():
        return f"the directory {folder} does not exist"
    if not folder.is_dir():
        return f"{folder} is not a directory"
    if target.exists() and not os.access(target, os.W_OK):
        return "is not writable"
    if not os.access(folder, os.W_OK | os.X_OK):  # the drawing is written beside the file, then renamed
        return f"the directory {folder} is not writable"
    return None


def _device(path: str) -> bool:
    """Whether ``path`` names something other than a file or a directory (following links)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def check_output_file(output: str | None, source: str | None = None) -> None:
    problem = None if output is None else output_file_problem(output, source)
    if problem is not None:
        raise PurlinError(f"-o {output}: {problem}")


def write_file(output: str, text: str) -> bool:
    """``text`` into ``output``, whole or not at all: a regular file is written beside itself and
    renamed into place, so a failure (a full disk, a size limit, Ctrl-C) leaves the file as it was
    and no part-written drawing.  A device or a pipe (/dev/null, /dev/stdout) is written as it is.
    Returns whether ``output`` was a file (not a device)."""
    data = text.encode("utf-8")
    try:
        if _device(output):
            with open(output, "wb") as handle:
                handle.write(data)
            return False
        target = Path(os.path.realpath(output))  # a symbolic link: the file it names is replaced
        temp = target.parent / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to open()
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            if target.exists():  # keep the mode of the file replaced
                os.chmod(temp, target.stat().st_mode & 0o7777)
            os.replace(temp, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise
    except OSError as error:
        raise PurlinError(f"-o {output}: cannot write the drawing: {error.strerror or error}") from None
    return True


def write_drawing(text: str, output: str | None) -> int:
    """A drawing to ``output`` (its path is printed), or to standard output."""
    if output:
        if write_file(output, text):  # not for `-o /dev/stdout`: the path would end up inside the drawing
            emit(f"{output}\n")
    else:
        emit(text)
    return 0


def isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
