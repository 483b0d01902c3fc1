"""``purlinc compile``: write CUDA source, CUBIN, schedule and manifest (no GPU needed)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from purlinc.cli import common
from purlinc.errors import PurlinError


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "compile", help="write CUDA source, CUBIN, schedule and manifest",
        description="Compile a collective for one world size and target: writes <kernel>.<arch>.cu, .cubin, "
        ".schedule.json and .manifest.json into the output directory (<kernel> is purlin_<name>_<hash8>, "
        "the prefix of the CUBIN's entry points; the arch keeps compiles for several targets apart). "
        "Needs no GPU.",
    )
    common.add_common(parser, DEFAULT_RANKS)
    parser.set_defaults(ranks=None)  # None until run(): the compile then notes that R was the default
    common.add_lowering(parser)
    common.add_codegen(parser)
    parser.add_argument("-o", "--output-dir", type=common.path, default=None,
                        help="output directory (default ./purlin-out/<name>, <name> the collective's)")
    # Taken only to be refused in words: argparse's "unrecognized arguments" came under the
    # top-level usage, which does not say where hierarchical plans are made.
    parser.add_argument("--gpus-per-node", default=None, help=argparse.SUPPRESS)


DEFAULT_RANKS = 8  # the world size of a compile without --ranks (the API's default too: pipeline.DEFAULT_WORLD_SIZE)


def nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (a dangling symbolic link counts)."""
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def output_dir_problem(path: Path) -> str | None:
    """Why ``path`` cannot be (or be created as) a directory to write into, or None.
    Checked before compiling: a bad -o should not cost a whole compile."""
    try:
        return _output_dir_problem(path)
    except OSError as error:  # a path through a folder this user cannot search: exists() and is_dir() raise
        return f"{error.filename or path} cannot be reached: {error.strerror or error}"


def _output_dir_problem(path: Path) -> str | None:
    existing = nearest_existing(path)
    if existing.exists() and not existing.is_dir():
        what = "a file" if existing.is_file() else "not a directory"  # /dev/null, a named pipe
        if existing == path:
            return f"{path} is {what}{', not a directory' if existing.is_file() else ''}"
        return f"{existing} is {what}, so {path} cannot be created under it"
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


def cache_problem() -> str | None:
    """Why the compile cache cannot be written, or None.  The cache skips itself quietly (it
    only saves time), but a PURLIN_CACHE_DIR that names a file is a mistake to be told of.
    The folders are made and a file written in the front cache's, as the compile will: a
    permission check says yes to root where the kernel says no (/proc, read-only mounts), and
    says nothing of a name too long or a file where a folder goes."""
    from purlinc import settings

    if settings.cache_switched_off():
        return None
    unplaced = settings.unplaced_cache()
    if unplaced is not None:
        return unplaced
    where = settings.cache_dir()
    front = where / "front"
    try:
        existing = nearest_existing(where)
        if not existing.is_dir():
            return f"{_relative(existing, where)} is not a directory"
    except OSError as error:  # a path through a folder this user cannot search
        return f"{_relative(error.filename or where, where)} cannot be reached ({error.strerror or error})"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{_relative(existing, where)} is not writable"
    try:
        front.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=front):
            pass
    except OSError as error:  # too long a name, a file where a folder goes, a read-only mount
        return f"{_relative(error.filename or front, where)}: {error.strerror or error}"
    return None


def _relative(path, cache: Path) -> str:
    """``path`` as cache_warning's words name it after the cache: "it", "its folder front",
    or the whole path of a folder above it (a 300-character cache path was said twice)."""
    path = Path(path)
    if path == cache:
        return "it"
    if path.is_relative_to(cache):
        return f"its folder {path.relative_to(cache)}"
    return str(path)


def cache_warning(problem: str) -> str:
    """The warning for ``cache_problem``: a cache that cannot be written still serves the
    entries it holds (reads need no write access), so "without it" is said only where it
    cannot be read either."""
    from purlinc import settings

    if settings.unplaced_cache() is not None:
        return (f"warning: the compile cache cannot be used ({problem}): compiling without it "
                f"(set {settings.CACHE_DIR.name}, or {settings.NO_CACHE.name}=1)")
    where = settings.cache_dir()
    readable = os.path.isdir(where) and os.access(where, os.R_OK | os.X_OK)
    what = ("entries it holds are used, new ones are not stored" if readable
            else "compiling without it")
    return (f"warning: the compile cache {where} cannot be written ({problem}): {what} "
            f"(set {settings.CACHE_DIR.name}, or {settings.NO_CACHE.name}=1)")


def missing_dirs(path: Path) -> list[Path]:
    """The directories ``path`` needs that do not exist yet, outermost first (what a
    ``mkdir(parents=True)`` of it would create)."""
    missing = []
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing[::-1]


def remove_created(created: list[Path]) -> None:
    """Take back the directories a failed compile created (innermost first), where they are
    still empty: a compile that wrote nothing leaves nothing behind, not even ./purlin-out."""
    for folder in reversed(created):
        try:
            folder.rmdir()
        except OSError:  # not empty (another compile wrote into it), or gone already
            pass


def _check_output_dir(args, path: Path, created: list[Path], default: str | None = None) -> None:
    """Refuse an output place that cannot be a directory, before any compile work; the folders
    it creates go in ``created`` (taken back if the compile fails).  ``default``: the default
    output directory as the error names it (``path`` where not given)."""
    created.extend(missing_dirs(path))
    problem = output_dir_problem(path)
    if problem is not None:
        flag = f"-o {args.output_dir}" if args.output_dir else f"the default output directory {default or path}"
        raise PurlinError(f"{flag}: {problem}", None, ("choose another place with -o DIR",))


def run(args) -> int:
    created: list[Path] = []
    try:
        return _run(args, created)
    except BaseException:
        remove_created(created)
        raise


def _run(args, created: list[Path]) -> int:
    from purlinc import pipeline
    from purlinc.atom.emit import write_artifacts

    # Option mistakes first: before the output place is created and before any compile work.
    if args.gpus_per_node is not None:
        raise PurlinError(f"--gpus-per-node {args.gpus_per_node}: compile writes one flat collective's kernels; a "
                          "hierarchical plan is made when it is loaded",
                          notes=("purlinc.load(path, None, gpus_per_node=G) under torchrun (docs/HIERARCHY.md); "
                                 "purlinc dump -s snac, check or draw --gpus-per-node G show and verify its plan",))
    common.check_codegen(args)
    # Options go in as overrides, not as options computed from a checked spec: on a compile
    # cache hit nothing is parsed, lowered or generated (see pipeline.compile).
    changes = common.overrides(args)
    ranks_defaulted = args.ranks is None
    world_size = DEFAULT_RANKS if ranks_defaulted else args.ranks
    # The output place is checked before any compile work (the default's parent here, the
    # collective's own folder under it once the name is known).
    chosen = Path(args.output_dir) if args.output_dir else Path("purlin-out")
    _check_output_dir(args, chosen, created, default=f"{chosen}/<collective>")  # the name is not known yet
    source = common.source(args)
    with common.default_ranks_noted(world_size, ranks_defaulted):
        spec = pipeline.spec_of(source, world_size, dict(args.param))
    if not args.output_dir:
        _check_output_dir(args, chosen / spec.name, created)
    common.check_spec(args, spec)
    if args.slots is not None:  # refused for an algorithm without slots (the spec's default one too)
        common.options(args, spec)
    problem = cache_problem()
    if problem is not None:
        print(cache_warning(problem), file=sys.stderr)
        from purlinc.pipeline.compiled import cache_placelessness_told

        cache_placelessness_told()  # the pipeline's log would say it again
    if ranks_defaulted:
        print(f"note: --ranks not given: compiling for R={world_size} ranks (the default)", file=sys.stderr)
    artifact = pipeline.compile(
        source, world_size=world_size, params=dict(args.param), arch=args.arch,
        overrides=changes, atom=args.atom, dtype=common.dtype_name(args), op=common.reduce_op(args),
    )
    out_dir = Path(args.output_dir) if args.output_dir else Path("purlin-out") / artifact.collective
    created.extend(missing_dirs(out_dir))
    try:
        written = write_artifacts(artifact, out_dir, ranks_defaulted=ranks_defaulted)
    except OSError as error:
        where = error.filename or out_dir
        raise PurlinError(f"cannot write the artifacts into {out_dir}: {where}: {error.strerror or error}") from None
    common.emit("".join(f"{path}\n" for path in written))
    return 0
