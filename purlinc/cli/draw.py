"""``purlinc draw``: the schedule as SVG, or HTML with hover details (purlinc/draw)."""

from __future__ import annotations

from purlinc.cli import common


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "draw", help="draw the schedule (SVG, or HTML with hover details)",
        description="Draw a collective's SNAC schedule: one lane per rank (channels as sub-lanes, identical "
        "channels drawn once), steps as boxes, an arrow from each notify to the wait it releases. "
        "--timeline lays it out in time by a cost model; --compare draws several algorithms on one time "
        "axis; --trace draws the times measured on the GPU (coll.trace()). See docs/DRAW.md.",
    )
    common.add_common(parser, 8)
    common.add_lowering(parser)
    common.add_hierarchy(parser)
    parser.add_argument("-o", "--output", default=None, help="output file, .svg or .html (default: SVG on stdout)")
    parser.add_argument("--format", "-f", default=None, help="svg or html (default: from the output file's extension)")
    parser.add_argument("--timeline", action="store_true", help="lay the steps out in time by the cost model")
    parser.add_argument("--compare", default=None, metavar="A,B",
                        help="algorithms to draw one above the other on one time axis, e.g. ring,direct-push")
    parser.add_argument("--bytes", dest="nbytes", type=common.byte_size, default=None, metavar="SIZE",
                        help="message size for the timeline: the larger of one rank's input and output (default 64KiB)")
    parser.add_argument("--count", type=int, default=None, help="elements per chunk for the timeline (instead of --bytes)")
    parser.add_argument("--dtype", default="bfloat16", help="element type for the timeline (default bfloat16)")
    parser.add_argument("--all-channels", action="store_true", help="draw every channel even when they are identical")
    parser.add_argument("--trace", default=None, metavar="TRACE.json", help="draw the times of a device trace (coll.trace())")
    parser.add_argument("--width", type=common.positive, default=None, help="width of a timeline in pixels")


def run(args) -> int:
    from purlinc.draw.render import Request, output_format, render

    fmt = output_format(args.output, args.format)
    if args.gpus_per_node is not None:  # a hierarchical plan: phases, NCCL lines (purlinc/draw/hier.py)
        from purlinc.cli import hier

        return hier.draw(args, fmt, common.source(args))
    compare = tuple(a.strip() for a in args.compare.split(",") if a.strip()) if args.compare else ()
    request = Request(
        file=args.file, world_size=args.ranks, params=tuple(args.param), overrides=tuple(common.overrides(args).items()),
        timeline=args.timeline, compare=compare, nbytes=args.nbytes, count=args.count, dtype=args.dtype,
        collapse=not args.all_channels, trace=args.trace, width=args.width,
    )
    return common.write_drawing(render(request, fmt), args.output)
