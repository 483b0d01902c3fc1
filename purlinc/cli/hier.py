"""The command line's view of hierarchical plans: ``--gpus-per-node G`` on ``dump --stage snac``,
``check`` and ``draw`` (the subcommands route here when it is given)."""

from __future__ import annotations

from purlinc import jsontext
from purlinc.cli import common
from purlinc.errors import PurlinError
from purlinc.snac.hierarchy import Topology, plural


def _divides(what: str, G: int) -> None:
    """``what`` ("world size R=6 is not", or several sizes) in the command line's words: the
    plan's own message names the API's gpus_per_node=G."""
    raise PurlinError(f"{what} a multiple of --gpus-per-node {G}",
                      notes=("ranks are grouped into nodes of gpus_per_node ranks each: R = nodes x gpus_per_node",))


def _plan(spec, options, gpus_per_node: int):
    from purlinc.snac.hiercheck import verify_plan
    from purlinc.snac.hierplan import plan_hierarchical

    if spec.world_size % gpus_per_node:  # dump and draw as check words it
        _divides(f"world size R={spec.world_size} is not", gpus_per_node)
    plan = plan_hierarchical(spec, gpus_per_node, options)  # proves every intra-node schedule
    verify_plan(plan, schedules=False)  # and the composition
    return plan


def dump(args, spec, options) -> int:
    """``purlinc dump --stage snac --gpus-per-node G``: the phases, NCCL steps as text."""
    from purlinc.snac.format import schedule_to_json
    from purlinc.snac.hierarchy import IntraPhase, format_plan

    if args.stage != "snac":
        raise PurlinError(f"--gpus-per-node applies to --stage snac, not --stage {args.stage}")
    plan = _plan(spec, options, args.gpus_per_node)
    if not args.json:
        common.emit(format_plan(plan))
        return 0
    phases = []
    for phase in plan.phases:
        if isinstance(phase, IntraPhase):
            phases.append({"kind": "intra", "src": phase.src, "dst": phase.dst, "operation": phase.operation.value,
                           "schedules": list(phase.schedules)})
        else:
            phases.append({"kind": "nccl", "nccl": phase.nccl, "src": phase.src, "dst": phase.dst,
                           "operation": phase.operation.value,
                           "moves": [{"dst": [m.dst.rank, m.dst.unit], "srcs": [[s.rank, s.unit] for s in m.srcs],
                                      "chunk": str(m.chunk)} for m in phase.moves]})
    common.emit(jsontext.dumps({
        "collective": spec.name, "nodes": plan.topology.nodes, "gpus_per_node": plan.topology.gpus_per_node,
        "buffers": {layout.name: [[str(c) for c in units] for units in layout.units] for layout in plan.layouts},
        "phases": phases, "schedules": [schedule_to_json(s) for s in plan.schedules],
    }) + "\n")
    return 0


def check(args, definition, sizes, params) -> tuple[int, str]:
    """Plan and prove every size in ``sizes`` that G divides; (plans verified, text for the summary)."""
    from purlinc import pipeline

    G = args.gpus_per_node
    usable = [R for R in sizes if R % G == 0]
    if not usable:  # in dump's and draw's words where one size is checked
        _divides(f"world size R={sizes[0]} is not" if len(sizes) == 1 else
                 f"no world size in R={sizes[0]}..{sizes[-1]} is", G)
    for R in usable:
        spec = pipeline.spec_stage(definition, R, params)
        try:
            _plan(spec, common.options(args, spec), G)
        except PurlinError as error:
            raise error.with_note(f"while verifying the hierarchical plan for R={R} "
                                  f"({Topology.of(R, G).format()})") from None
    text = f"{plural(len(usable), 'hierarchical plan')} ({plural(G, 'GPU')} per node) verified"
    skipped = [R for R in sizes if R % G]
    if skipped:  # "ok for R=1..8" must not read as a plan proven for every size in it
        verb = "is not a multiple" if len(skipped) == 1 else "are not multiples"
        text += f" ({common.sizes_list(skipped)} {verb} of {G}: no plan there)"
    return len(usable), text


def _refuse_unused(args) -> None:
    """A plan is drawn as phases, not steps in time: the timeline's options and the lane
    options of a schedule drawing do not apply, and are refused rather than ignored."""
    given = [flag for flag, used in (
        ("--timeline", args.timeline), ("--compare", args.compare is not None), ("--trace", args.trace is not None),
        ("--bytes", args.nbytes is not None), ("--count", args.count is not None), ("--dtype", args.dtype is not None),
        ("--width", args.width is not None), ("--all-channels", args.all_channels)) if used]
    if given:
        raise PurlinError(f"--gpus-per-node draws the plan's phases, not steps: {', '.join(given)} given, but "
                          "--timeline, --compare and --trace do not apply, nor --bytes, --count, --dtype, --width "
                          "or --all-channels")


def draw(args, fmt: str, source) -> int:
    """``purlinc draw --gpus-per-node G``: the plan as SVG (or the SVG in a page for html)."""
    from xml.sax.saxutils import escape

    from purlinc import pipeline
    from purlinc.draw.defaults import DEFAULT_WORLD_SIZE
    from purlinc.draw.hier import plan_svg, plan_title

    _refuse_unused(args)
    world_size = args.ranks if args.ranks is not None else DEFAULT_WORLD_SIZE
    with common.default_ranks_noted(world_size, args.ranks is None):  # "R=8" alone reads as asked for
        spec = pipeline.spec_stage(pipeline.parse_stage(source), world_size, dict(args.param))
        plan = _plan(spec, common.options(args, spec), args.gpus_per_node)
    text = plan_svg(plan)
    if fmt == "html":
        title = escape(plan_title(plan))
        text = (f"<!DOCTYPE html>\n<html lang=\"en\">\n<head><meta charset=\"utf-8\"><title>{title}</title></head>\n"
                f"<body>\n{text}</body>\n</html>\n")
    return common.write_drawing(text, args.output)
