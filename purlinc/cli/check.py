"""``purlinc check``: check the spec, and verify the schedules, for a range of world sizes."""

from __future__ import annotations

import sys
import time

from purlinc import settings
from purlinc.cli import common
from purlinc.errors import PurlinError
from purlinc.snac.hierarchy import plural


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "check", help="check the spec (and verify the schedules) for a range of world sizes",
        description="Check the spec for every world size in --ranks (default 1..64) and verify the SNAC "
        "schedule of every applicable algorithm; the first problem is reported with its world size.",
    )
    parser.add_argument("file", type=common.path, help=common.FILE_HELP)
    parser.add_argument(
        "--ranks", "-R", type=common.world_sizes, default=range(1, 65), metavar="N|LO..HI",
        help="world sizes to check: N, or LO..HI with both ends included (default 1..64); "
        "sizes a 'where' clause excludes are skipped",
    )
    common.add_params(parser)
    parser.add_argument(
        "--spec-only", action="store_true", help="check the spec only (parse and resolve), not the schedules"
    )
    parser.add_argument(
        "--jobs", "-j", type=common.positive, default=None, metavar="N",
        help="verify schedules in N processes (default: one per core; big world sizes only)",
    )
    common.add_lowering(parser)
    common.add_hierarchy(parser)


class Progress:
    """'checking R=17 (17/64)' on one line of a terminal; nothing when stderr is not one."""

    def __init__(self, name: str):
        self.name = name
        self.shown = False
        self.last = 0.0
        self.enabled = common.isatty(sys.stderr)

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


def run(args) -> int:
    from purlinc import pipeline
    from purlinc.frontend.check import check_all

    common.check_stage_copies(args)
    if args.algorithm is not None:  # without -a, --slots checks the algorithms that take it
        common.check_slots(args, args.algorithm)
    _refuse_schedule_options_with_spec_only(args)
    if args.gpus_per_node is not None and args.jobs is not None:
        raise PurlinError(f"--jobs {args.jobs} applies to flat schedules: the hierarchical plans of --gpus-per-node "
                          "are verified in one process", notes=("drop --jobs",))
    definition = pipeline.parse_stage(common.source(args))
    common.check_sized_copies(args, definition)
    params = dict(args.param)
    # No len(args.ranks): a range of 10**28 sizes has no length Python can hold (OverflowError);
    # check_all refuses it by its largest size.
    progress = Progress(definition.name)
    unverified: list[int] = []  # sizes -a's algorithm does not apply to (their specs were checked)
    try:
        sizes = check_all(definition, args.ranks, params,
                          progress=lambda R: progress(f"spec for R={R} (up to R={args.ranks[-1]})"))
        if args.gpus_per_node is not None and not args.spec_only:
            from purlinc.cli import hier

            verified, hier_text = hier.check(args, definition, sizes, params)
        else:
            from purlinc.snac.gcpause import gc_paused

            # No cycle collection in the loop: each schedule is dropped (freed by reference
            # counting) before the next, and a collection would only walk one about to die.
            with gc_paused():
                verified, hier_text = _verify_schedules(args, definition, sizes, params, progress, unverified), None
    finally:
        progress.done()
    sizes_text = f"R={sizes[0]}" if len(sizes) == 1 else f"R={sizes[0]}..{sizes[-1]} ({len(sizes)} sizes)"
    if definition.constraints and len(sizes) > 1:  # the sizes may have gaps: say which were skipped
        sizes_text += " where " + ", ".join(c.format() for c in definition.constraints)
    if not args.spec_only and not verified:  # whatever the cause, nothing proven is no pass
        raise PurlinError(f"no schedule was verified for {sizes_text}: there is nothing to report as ok",
                          notes=("check the spec alone with --spec-only",))
    what = "spec" if args.spec_only else hier_text or f"spec and {plural(verified, 'schedule')} verified"
    if unverified:
        what += f" ({args.algorithm} does not apply at {common.sizes_list(unverified)}: no schedule there)"
    common.emit(f"{definition.name}: ok for {sizes_text}: {what}\n")
    return 0


def _units(args, sizes, specs) -> list:
    """(world size, algorithm) to verify, in the order they are verified and reported: every
    applicable algorithm (or the one asked for); with --packed, those that lower packed; with
    --slots, those that stage through slots; with --stage-copies 2, those that lower to two; with
    --registered out and an epilogue, those whose peers leave the output to its rank (the
    others would refuse the option)."""
    from purlinc.snac.algorithms import applicable, get_algorithm

    units = []
    for world_size in sizes:
        for algorithm in applicable(specs[world_size]):
            if args.algorithm and algorithm.value != args.algorithm:
                continue
            if args.packed and not args.algorithm and not get_algorithm(algorithm).packed:
                continue
            if args.slots is not None and not args.algorithm and not get_algorithm(algorithm).uses_slots:
                continue
            if args.stage_copies and not args.algorithm and args.stage_copies > get_algorithm(algorithm).stage_copies:
                continue  # lowered with fewer copies: verifying it would not check the option
            if _registered_out(args) and specs[world_size].epilogue is not None and not args.algorithm \
                    and get_algorithm(algorithm).writes_peers_registered_out(specs[world_size]):
                continue  # its peers would write the rows the epilogue computes: the lowering refuses it
            units.append((world_size, algorithm))
    if not units:
        _refuse_nothing_to_verify(args, sizes, specs)
    return units


def _registered_out(args) -> bool:
    return args.registered in ("out", "both")


def _why_none(args, sizes) -> str:
    """What left no algorithm to verify, in the options' words: -a one that applies to none of
    the sizes, or --packed and --slots, which no algorithm takes together."""
    where = f"R={sizes[0]}" if len(sizes) == 1 else f"R={sizes[0]}..{sizes[-1]}"
    if args.algorithm:
        return f"-a {args.algorithm} applies to none of the sizes checked ({where})"
    given = [text for text, value in (("--packed", args.packed), (f"--slots {args.slots}", args.slots is not None),
                                      (f"--stage-copies {args.stage_copies}", (args.stage_copies or 0) > 1),
                                      (f"--registered {args.registered}", _registered_out(args))) if value]
    if not given:
        return f"no algorithm applies to {where}"
    return f"{' and '.join(given)} leave{'' if len(given) > 1 else 's'} no algorithm to verify at {where}"


def _refuse_nothing_to_verify(args, sizes, specs) -> None:
    """No (size, algorithm) left to verify: "ok, 0 schedules verified" would read as a pass,
    while compile and dump refuse the same options.  Lowering for the first size as dump does
    gives the reason they give; the registry's word stands if the lowering takes it."""
    from purlinc import pipeline

    world_size = sizes[0]
    why = _why_none(args, sizes)
    try:
        pipeline.snac_stage(specs[world_size], common.options(args, specs[world_size]))
    except PurlinError as error:
        raise error.with_note(why) from None
    raise PurlinError(f"{why}: there is no schedule to verify")


def _refuse_schedule_options_with_spec_only(args) -> None:
    """--spec-only checks no schedule: an option for them would be ignored without a word."""
    if not args.spec_only:
        return
    given = [flag for flag, value in (
        ("--algorithm", args.algorithm), ("--channels", args.channels), ("--slices", args.slices),
        ("--slots", args.slots), ("--registered", None if args.registered == "none" else args.registered),
        ("--packed", args.packed or None), ("--stage-copies", args.stage_copies),
        ("--gpus-per-node", args.gpus_per_node), ("--jobs", args.jobs)) if value is not None]
    if given:
        raise PurlinError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to the schedules, which "
                          "--spec-only does not check",
                          notes=(f"drop --spec-only to verify the schedules too, or drop {', '.join(given)}",))


def _verify_schedules(args, definition, sizes, params, progress, unverified: list) -> int:
    from purlinc import checkjobs, pipeline

    if args.spec_only:
        return 0
    specs = {world_size: pipeline.spec_stage(definition, world_size, params) for world_size in sizes}
    units = _units(args, sizes, specs)
    if args.algorithm:  # sizes the asked algorithm does not apply to: said, or "ok for R=1..3" hid them
        covered = {world_size for world_size, _ in units}
        unverified.extend(world_size for world_size in sizes if world_size not in covered)
    jobs = args.jobs or checkjobs.cores()
    if checkjobs.worth_it(jobs, units) and not settings.debug():  # PURLIN_DEBUG: tracebacks from one process
        return checkjobs.verify_parallel(
            definition, params, [(r, a.value) for r, a in units],
            lambda spec, a: common.options(args, spec, algorithm=a),
            jobs, lambda r, done: progress(f"schedules verified up to R={r} ({done}/{len(sizes)} sizes)"))
    shown = None
    for world_size, algorithm in units:
        if shown != world_size:
            progress(f"schedules for R={world_size} ({sizes.index(world_size) + 1}/{len(sizes)} sizes)")
            shown = world_size
        options = common.options(args, specs[world_size], algorithm=algorithm)
        try:
            pipeline.snac_stage(specs[world_size], options)
        except PurlinError as error:
            raise error.with_note(f"while verifying {algorithm.value} for R={world_size}") from None
    return len(units)
