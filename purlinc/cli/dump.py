"""``purlinc dump``: print one stage of the pipeline (ast, spec, snac, cuda)."""

from __future__ import annotations

from purlinc import jsontext
from purlinc.cli import common
from purlinc.errors import PurlinError

STAGES = ("ast", "spec", "snac", "cuda")


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "dump", help="print one stage's IR",
        description="Print a stage of the pipeline: ast (the parsed file), spec (resolved layouts and where "
        "each output chunk comes from), snac (the per-rank schedule) or cuda (the generated source).",
    )
    common.add_common(parser, DEFAULT_RANKS)
    parser.set_defaults(ranks=None)  # None until run(): an error then says R was the default
    parser.add_argument("--stage", "-s", choices=STAGES, default="spec", help="which stage to print (default spec)")
    parser.add_argument("--json", action="store_true", help="JSON instead of text (spec and snac stages)")
    common.add_lowering(parser)
    common.add_hierarchy(parser)
    common.add_codegen(parser)


def _print(args, text, to_json) -> None:
    """One stage's dump: its text, or with ``--json`` its JSON (both made only when asked for)."""
    if args.json:
        common.emit(jsontext.dumps(to_json()) + "\n")
    else:
        common.emit(text())


def check_stage_options(args) -> None:
    """Options that apply to some stages only are refused at the others rather than ignored."""
    if args.json and args.stage not in ("spec", "snac"):
        raise PurlinError(f"--json applies to --stage spec and snac, not --stage {args.stage}")
    if args.gpus_per_node is not None and args.stage != "snac":
        raise PurlinError(f"--gpus-per-node applies to --stage snac, not --stage {args.stage}")
    if args.stage in ("ast", "spec"):  # no schedule is made: lowering options would go unread
        lowering = {"--algorithm": args.algorithm, "--channels": args.channels, "--slices": args.slices,
                    "--slots": args.slots, "--registered": None if args.registered == "none" else args.registered,
                    "--packed": args.packed or None, "--stage-copies": args.stage_copies}
        given = [flag for flag, value in lowering.items() if value is not None]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise PurlinError(f"{', '.join(given)} {verb} to --stage snac and cuda, not --stage {args.stage}")
    if args.stage == "ast" and args.param:  # the file as parsed: nothing is bound
        raise PurlinError("--param applies to --stage spec, snac and cuda, not --stage ast")
    if args.stage == "ast" and args.ranks is not None:  # nor checked for any world size
        raise PurlinError(f"--ranks {args.ranks} applies to --stage spec, snac and cuda, not --stage ast")
    if args.stage != "cuda" and args.op is not None:  # only the kernel has a reduction operator
        raise PurlinError(f"--op applies to --stage cuda, not --stage {args.stage}")


DEFAULT_RANKS = 8  # the world size of a dump without --ranks

# Producer slots the spec stage lists at most (every output chunk's sources, a word or so each:
# about 60 MB of text).  The spec holds each chunk's sources once, whatever its fan-in, but the
# listing repeats them per output chunk: a one-chunk all-reduce at R = 65,536 lists 4 x 10^9.
MAX_LISTED_SOURCES = 1 << 22


def _refuse_too_long_a_listing(spec) -> None:
    if spec.reads > MAX_LISTED_SOURCES:
        raise PurlinError(f"the spec of {spec.name} at R={spec.world_size} lists {spec.reads:,} producer slots over its "
                          f"output chunks, more than {MAX_LISTED_SOURCES:,} to print",
                          notes=("dump a smaller world size (--ranks), or check it without printing "
                                 "(purlinc check --spec-only)",))


def run(args) -> int:
    from purlinc import pipeline

    check_stage_options(args)
    common.check_codegen(args)
    common.check_stage_copies(args)
    definition = pipeline.parse_stage(common.source(args))
    if args.stage == "ast":
        common.emit(definition.format())
        return 0
    with common.default_ranks_noted(DEFAULT_RANKS, args.ranks is None):
        args.ranks = DEFAULT_RANKS if args.ranks is None else args.ranks
        spec = pipeline.spec_stage(definition, args.ranks, dict(args.param))
    common.check_spec(args, spec, kernel=args.stage == "cuda")  # what compile would refuse, whichever stage is printed
    if args.stage == "spec":
        _refuse_too_long_a_listing(spec)
        _print(args, spec.format, spec.to_json)
        return 0
    if args.gpus_per_node is not None:  # hierarchical: SNAC inside nodes, NCCL between them
        from purlinc.cli import hier

        return hier.dump(args, spec, common.options(args, spec))
    schedule = pipeline.snac_stage(spec, common.options(args, spec))
    if args.stage == "snac":
        from purlinc.snac.format import format_schedule, schedule_to_json

        _print(args, lambda: format_schedule(schedule), lambda: schedule_to_json(schedule))
        return 0
    from purlinc.atom.codegen import generate
    from purlinc.dtypes import DType, ReduceOp

    kernel = generate(schedule, spec, atom=args.atom, arch=args.arch, dtype=DType.parse(common.dtype_name(args)),
                      op=ReduceOp.parse(common.reduce_op(args)) if spec.is_reduce else None)
    common.emit(kernel.source)
    return 0
