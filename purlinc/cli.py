"""``purlinc``: compile | dump | check.  User errors go to stderr with exit status 2, never a
traceback (``PURLIN_DEBUG=1`` re-raises); internal bugs say so and how to reproduce them."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from purlinc import __version__, settings
from purlinc.atom.atoms import DEFAULT_ATOM, kernel_atoms
from purlinc.dtypes import DTYPES
from purlinc.errors import PurlinError
from purlinc.snac.algorithms import ALGORITHMS as ALGORITHM_REGISTRY

STAGES = ("ast", "spec", "snac", "cuda")
ATOMS = kernel_atoms()  # the atom registry's atoms with kernels (compile and dump write CUDA)
ALGORITHMS = ALGORITHM_REGISTRY.names()


def _param(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=INTEGER, got {text!r}")
    try:
        return name, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"parameter {name}: {value!r} is not an integer") from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _world_sizes(text: str) -> range:
    lo, sep, hi = text.partition("..")
    try:
        sizes = range(int(lo), int(hi) + 1) if sep else range(int(text), int(text) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO..HI (inclusive), got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"expected world sizes of at least 1 with LO <= HI, got {text!r}")
    return sizes


FILE_HELP = "the .pln collective (see docs/LANGUAGE.md), or - for standard input"


def _add_common(parser: argparse.ArgumentParser, ranks_default: int | None) -> None:
    parser.add_argument("file", help=FILE_HELP)
    parser.add_argument(
        "--ranks", "-R", type=_positive, default=ranks_default, metavar="N",
        help=f"world size (number of ranks){'' if ranks_default is None else f'; default {ranks_default}'}",
    )
    parser.add_argument(
        "--param", "-p", type=_param, action="append", default=[], metavar="NAME=N",
        help="bind a collective parameter, e.g. --param root=1 (repeatable)",
    )


def _add_lowering(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--algorithm", "-a", choices=ALGORITHMS, help="orchestration algorithm (default: chosen per spec)")
    parser.add_argument("--channels", type=_positive, help="independent channels (thread blocks) per rank")
    parser.add_argument("--slices", type=_positive, help="pipeline slices per chunk and channel")
    parser.add_argument("--slots", type=_positive, help="staging slots per edge (flow control); default: one per message")
    parser.add_argument(
        "--registered", choices=("none", "in", "out", "both"), default="none",
        help="which caller buffers are peer-registered (symmetric): lets stages skip the staging buffer",
    )
    parser.add_argument(
        "--packed", action="store_true",
        help="LL packing (direct-push): data notifies ride in the staged data, a flag in every 16-byte packet",
    )
    parser.add_argument(
        "--stage-copies", type=int, choices=(1, 2), default=None,
        help="staging copies by call parity (direct-push): 2 takes the consumers' acknowledgements off the "
             "critical path; default: what the atom can address (2 for kernels, 1 for ce)",
    )


def _add_codegen(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", default="sm_90", help="target: sm_80, sm_90, sm_100 (or sm_90a, sm_100a); default sm_90")
    parser.add_argument("--atom", choices=ATOMS, default=DEFAULT_ATOM, help=f"datapath mechanism (default {DEFAULT_ATOM})")
    parser.add_argument("--dtype", default="bfloat16", help=f"element type: {', '.join(DTYPES)}")
    parser.add_argument("--op", default="sum", help="reduction operator for reduce collectives: sum, prod, max, min")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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

    compile_parser = commands.add_parser(
        "compile", help="write CUDA source, CUBIN, schedule and manifest",
        description="Compile a collective for one world size and target: writes <name>.cu, <name>.cubin, "
        "<name>.schedule.json and <name>.manifest.json into the output directory. Needs no GPU.",
    )
    _add_common(compile_parser, None)
    _add_lowering(compile_parser)
    _add_codegen(compile_parser)
    compile_parser.add_argument("-o", "--output-dir", default=None, help="output directory (default ./purlin-out/<name>)")

    dump = commands.add_parser(
        "dump", help="print one stage's IR",
        description="Print a stage of the pipeline: ast (the parsed file), spec (resolved layouts and where "
        "each output chunk comes from), snac (the per-rank schedule) or cuda (the generated source).",
    )
    _add_common(dump, 8)
    dump.add_argument("--stage", "-s", choices=STAGES, default="spec", help="which stage to print (default spec)")
    dump.add_argument("--json", action="store_true", help="JSON instead of text (spec and snac stages)")
    _add_lowering(dump)
    _add_hierarchy(dump)
    _add_codegen(dump)

    check_parser = commands.add_parser(
        "check", help="check the spec (and verify the schedules) for a range of world sizes",
        description="Check the spec for every world size in --ranks (default 1..64) and verify the SNAC "
        "schedule of every applicable algorithm; the first problem is reported with its world size.",
    )
    check_parser.add_argument("file", help=FILE_HELP)
    check_parser.add_argument(
        "--ranks", "-R", type=_world_sizes, default=range(1, 65), metavar="N|LO..HI",
        help="world sizes to check: N, or LO..HI with both ends included (default 1..64); "
        "sizes a 'where' clause excludes are skipped",
    )
    check_parser.add_argument(
        "--param", "-p", type=_param, action="append", default=[], metavar="NAME=N",
        help="bind a collective parameter, e.g. --param root=1 (repeatable)",
    )
    check_parser.add_argument(
        "--spec-only", action="store_true", help="check the spec only (parse and resolve), not the schedules"
    )
    check_parser.add_argument(
        "--jobs", "-j", type=_positive, default=None, metavar="N",
        help="verify schedules in N processes (default: one per core; big world sizes only)",
    )
    _add_lowering(check_parser)
    _add_hierarchy(check_parser)
    _add_draw(commands)
    return parser


def _add_hierarchy(parser: argparse.ArgumentParser) -> None:
    from purlinc.snac.hiercli import add_argument

    add_argument(parser)


def _overrides(args) -> dict:
    """The LowerOptions fields the command line sets (applied over the spec's defaults)."""
    from purlinc.snac.ir import Algorithm

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


def _options(args, spec, **more):
    """The options of a dump or check: those ``compile`` would use (the atom's staging copies
    included, as pipeline.prepare picks them)."""
    from purlinc.pipeline import resolve_options, with_atom_defaults

    changes = with_atom_defaults({**_overrides(args), **more}, getattr(args, "atom", None))
    return resolve_options(spec, overrides=changes)


def _source(args):
    """The input named on the command line: a path (never read as .pln text, whatever it
    contains), or standard input for ``-``."""
    from purlinc import pipeline

    if args.file == "-":
        from purlinc.frontend.source import read_bounded

        return pipeline.SourceText(read_bounded(sys.stdin.buffer, "<stdin>"), "<stdin>")
    return pipeline.load_source(Path(args.file))


def _output_dir_problem(path: Path) -> str | None:
    """Why ``path`` cannot be (or be created as) a directory to write into, or None.
    Checked before compiling: a bad -o should not cost a whole compile."""
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        if existing == path:
            return f"{path} is a file, not a directory"
        return f"{existing} is a file, so {path} cannot be created under it"
    if not existing.exists():  # a dangling symbolic link
        return f"{existing} is a broken symbolic link"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable" if existing == path else f"cannot create {path}: {existing} is not writable"
    try:  # access() says yes to root even where the kernel will say no (/proc, read-only mounts)
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"cannot create {path}: {error.strerror or error}"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path} is not writable"
    return None


class _Progress:
    """'checking R=17 (17/64)' on one line of a terminal; nothing when stderr is not one."""

    def __init__(self, name: str, total: int):
        self.name = name
        self.total = total
        self.shown = False
        self.last = 0.0
        self.enabled = _isatty(sys.stderr)

    def __call__(self, text: str) -> None:
        now = time.monotonic()
        if not self.enabled or now - self.last < 0.1:
            return
        self.last = now
        sys.stderr.write(f"\r\x1b[Kchecking {self.name}: {text}")
        sys.stderr.flush()
        self.shown = True

    def done(self) -> None:
        if self.shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self.shown = False


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _cmd_dump(args) -> int:
    from purlinc import pipeline

    source = _source(args)
    definition = pipeline.parse_stage(source)
    if args.stage == "ast":
        print(definition.format(), end="")
        return 0
    spec = pipeline.spec_stage(definition, args.ranks, dict(args.param))
    if args.stage == "spec":
        print(json.dumps(spec.to_json(), indent=2) if args.json else spec.format(), end="" if not args.json else "\n")
        return 0
    if args.gpus_per_node is not None:  # hierarchical: SNAC inside nodes, NCCL between them
        from purlinc.snac import hiercli

        return hiercli.dump(args, spec, _options(args, spec))
    schedule = pipeline.snac_stage(spec, _options(args, spec))
    if args.stage == "snac":
        from purlinc.snac.format import format_schedule, schedule_to_json

        print(json.dumps(schedule_to_json(schedule), indent=2) if args.json else format_schedule(schedule), end="" if not args.json else "\n")
        return 0
    from purlinc.atom.codegen import generate
    from purlinc.dtypes import DType, ReduceOp

    kernel = generate(schedule, spec, atom=args.atom, arch=args.arch, dtype=DType.parse(args.dtype),
                      op=ReduceOp.parse(args.op) if spec.is_reduce else None)
    print(kernel.source, end="")
    return 0


def _cmd_check(args) -> int:
    from purlinc import pipeline
    from purlinc.frontend.check import check_all

    source = _source(args)
    definition = pipeline.parse_stage(source)
    params = dict(args.param)
    progress = _Progress(definition.name, len(args.ranks))
    try:
        sizes = check_all(definition, args.ranks, params,
                          progress=lambda R: progress(f"spec for R={R} (up to R={args.ranks[-1]})"))
        if args.gpus_per_node is not None and not args.spec_only:
            from purlinc.snac import hiercli

            verified, hier_text = hiercli.check(args, definition, sizes, params,
                                                lambda spec: _options(args, spec))
        else:
            from purlinc.snac.gcpause import gc_paused

            # No cycle collection in the loop: each schedule is dropped (freed by reference
            # counting) before the next, and a collection would only walk one about to die.
            with gc_paused():
                verified, hier_text = _verify_schedules(args, definition, sizes, params, progress), None
    finally:
        progress.done()
    sizes_text = f"R={sizes[0]}" if len(sizes) == 1 else f"R={sizes[0]}..{sizes[-1]} ({len(sizes)} sizes)"
    if definition.constraints and len(sizes) > 1:  # the sizes may have gaps: say which were skipped
        sizes_text += " where " + ", ".join(c.format() for c in definition.constraints)
    what = "spec" if args.spec_only else hier_text or f"spec and {verified} schedules verified"
    print(f"{definition.name}: ok for {sizes_text}: {what}")
    return 0


def _verify_schedules(args, definition, sizes, params, progress) -> int:
    from purlinc import checkjobs, pipeline

    if args.spec_only:
        return 0
    from purlinc.snac.ir import Algorithm
    from purlinc.snac.lower import applicable_algorithms

    units = []  # (world size, algorithm), in the order they are verified and reported
    specs = {}
    for world_size in sizes:
        spec = specs[world_size] = pipeline.spec_stage(definition, world_size, params)
        for algorithm in applicable_algorithms(spec):
            if args.algorithm and algorithm.value != args.algorithm:
                continue
            if args.packed and not args.algorithm and algorithm is not Algorithm.DIRECT_PUSH:
                continue  # packing applies to direct-push only
            units.append((world_size, algorithm))
    jobs = args.jobs or checkjobs.cores()
    if checkjobs.worth_it(jobs, units) and not settings.debug():  # PURLIN_DEBUG: tracebacks from one process
        return checkjobs.verify_parallel(
            definition, params, [(r, a.value) for r, a in units], lambda spec, a: _options(args, spec, algorithm=a),
            jobs, lambda r, done: progress(f"schedules verified up to R={r} ({done}/{len(sizes)} sizes)"))
    shown = None
    for world_size, algorithm in units:
        if shown != world_size:
            progress(f"schedules for R={world_size} ({sizes.index(world_size) + 1}/{len(sizes)} sizes)")
            shown = world_size
        spec = specs[world_size]
        options = _options(args, spec, algorithm=algorithm)
        try:
            pipeline.snac_stage(spec, options)
        except PurlinError as error:
            raise error.with_note(f"while verifying {algorithm.value} for R={world_size}") from None
    return len(units)


def _cmd_compile(args) -> int:
    from purlinc import pipeline
    from purlinc.atom.emit import write_artifacts

    # Options go in as overrides, not as options computed from a checked spec: on a compile
    # cache hit nothing is parsed, lowered or generated (see pipeline.compile).
    ranks_defaulted = args.ranks is None
    world_size = pipeline.DEFAULT_WORLD_SIZE if ranks_defaulted else args.ranks
    # The output place is checked before any compile work (the default's parent here, the
    # collective's own folder under it once the name is known).
    chosen = Path(args.output_dir) if args.output_dir else Path("purlin-out")
    problem = _output_dir_problem(chosen)
    if problem is not None:
        flag = f"-o {args.output_dir}" if args.output_dir else "the default output directory purlin-out"
        raise PurlinError(f"{flag}: {problem}", None, ("choose another place with -o DIR",))
    source = _source(args)
    if ranks_defaulted:
        print(f"note: --ranks not given: compiling for R={world_size} ranks (the default)", file=sys.stderr)
    artifact = pipeline.compile(
        source, world_size=world_size, params=dict(args.param), arch=args.arch,
        overrides=_overrides(args), atom=args.atom, dtype=args.dtype, op=args.op,
    )
    out_dir = Path(args.output_dir) if args.output_dir else Path("purlin-out") / artifact.collective
    try:
        written = write_artifacts(artifact, out_dir, ranks_defaulted=ranks_defaulted)
    except OSError as error:
        where = error.filename or out_dir
        raise PurlinError(f"cannot write the artifacts into {out_dir}: {where}: {error.strerror or error}") from None
    for path in written:
        print(path)
    return 0


# ---- draw: the schedule as SVG / HTML (purlinc/draw) -----------------------------------

def _byte_size(text: str) -> int:
    units = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}
    number = text.rstrip("kKmMgGiIbB")
    try:
        value = int(number) * units[text[len(number):].lower()]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"expected a size like 4096, 64KiB or 1MiB, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a size of at least 0, got {text!r}")
    return value


def _add_draw(commands) -> None:
    draw = commands.add_parser(
        "draw", help="draw the schedule (SVG, or HTML with hover details)",
        description="Draw a collective's SNAC schedule: one lane per rank (channels as sub-lanes, identical "
        "channels drawn once), steps as boxes, an arrow from each notify to the wait it releases. "
        "--timeline lays it out in time by a cost model; --compare draws several algorithms on one time "
        "axis; --trace draws the times measured on the GPU (coll.trace()). See docs/DRAW.md.",
    )
    _add_common(draw, 8)
    _add_lowering(draw)
    _add_hierarchy(draw)
    draw.add_argument("-o", "--output", default=None, help="output file, .svg or .html (default: SVG on stdout)")
    draw.add_argument("--format", "-f", default=None, help="svg or html (default: from the output file's extension)")
    draw.add_argument("--timeline", action="store_true", help="lay the steps out in time by the cost model")
    draw.add_argument("--compare", default=None, metavar="A,B",
                      help="algorithms to draw one above the other on one time axis, e.g. ring,direct-push")
    draw.add_argument("--bytes", dest="nbytes", type=_byte_size, default=None, metavar="SIZE",
                      help="message size for the timeline: the larger of one rank's input and output (default 64KiB)")
    draw.add_argument("--count", type=int, default=None, help="elements per chunk for the timeline (instead of --bytes)")
    draw.add_argument("--dtype", default="bfloat16", help="element type for the timeline (default bfloat16)")
    draw.add_argument("--all-channels", action="store_true", help="draw every channel even when they are identical")
    draw.add_argument("--trace", default=None, metavar="TRACE.json", help="draw the times of a device trace (coll.trace())")
    draw.add_argument("--width", type=_positive, default=None, help="width of a timeline in pixels")


def _cmd_draw(args) -> int:
    from purlinc.draw.render import Request, output_format, render

    fmt = output_format(args.output, args.format)
    if args.gpus_per_node is not None:  # a hierarchical plan: phases, NCCL lines (purlinc/draw/hier.py)
        from purlinc.snac import hiercli

        return hiercli.draw(args, fmt, _source(args), _options)
    compare = tuple(a.strip() for a in args.compare.split(",") if a.strip()) if args.compare else ()
    request = Request(
        file=args.file, world_size=args.ranks, params=tuple(args.param), overrides=tuple(_overrides(args).items()),
        timeline=args.timeline, compare=compare, nbytes=args.nbytes, count=args.count, dtype=args.dtype,
        collapse=not args.all_channels, trace=args.trace, width=args.width,
    )
    return write_drawing(render(request, fmt), args.output)


def write_drawing(text: str, output: str | None) -> int:
    """A drawing to ``output`` (its path is printed), or to standard output."""
    if output:
        Path(output).write_text(text, encoding="utf-8")
        print(output)
    else:
        sys.stdout.write(text)
    return 0


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


COMMANDS = {"compile": _cmd_compile, "dump": _cmd_dump, "check": _cmd_check}
COMMANDS["draw"] = _cmd_draw


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status = COMMANDS[args.command](args)
        sys.stdout.flush()  # inside the try: a closed pipe shows up here
        return status
    except BrokenPipeError:
        # `purlinc dump ... | head`: the reader has gone; stop quietly, as cat and grep do.
        _silence_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a process the signal ended
    except PurlinError as error:
        if settings.debug():
            raise
        print(error.render(), file=sys.stderr)
        return 2
    except ValueError as error:  # bad dtype / op names and similar option mistakes
        if settings.debug():
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # an unreadable cache, a full disk: the environment, not a bug
        if settings.debug():
            raise
        where = f"{error.filename}: " if error.filename else ""
        print(f"error: {where}{error.strerror or error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as error:  # noqa: BLE001 - the last line of defence: name it a bug
        if settings.debug():
            raise
        argv_text = " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
        print(
            f"internal error (a bug in purlinc, not in your input): {type(error).__name__}: {error}\n"
            f"reproduce with: PURLIN_DEBUG=1 purlinc {argv_text}",
            file=sys.stderr,
        )
        return 3


if __name__ == "__main__":
    sys.exit(main())
