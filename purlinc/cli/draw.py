"""``purlinc draw``: the schedule as SVG, or HTML with hover details (purlinc/draw)."""

from __future__ import annotations

import argparse

from purlinc.cli import common
from purlinc.draw.defaults import DEFAULT_DTYPE, DEFAULT_WORLD_SIZE, MAX_TIMELINE_BYTES, MAX_WIDTH, MIN_WIDTH
from purlinc.errors import PurlinError


def width(text: str) -> int:
    """--width: a timeline narrower than MIN_WIDTH has no room for its time axis; one wider
    than MAX_WIDTH is a blank page in a browser."""
    value = common.positive(text)
    if not MIN_WIDTH <= value <= MAX_WIDTH:
        raise argparse.ArgumentTypeError(f"expected a width of {MIN_WIDTH} to {MAX_WIDTH:,} pixels, got {value}")
    return value


def timeline_bytes(text: str) -> int:
    """--bytes: at most MAX_TIMELINE_BYTES."""
    value = common.byte_size(text)
    if value > MAX_TIMELINE_BYTES:
        raise argparse.ArgumentTypeError(f"expected a size of at most 1TiB, got {text!r}")
    return value


def timeline_count(text: str) -> int:
    """--count: elements per chunk, at most MAX_TIMELINE_BYTES of them."""
    value = common.positive(text)
    if value > MAX_TIMELINE_BYTES:
        shown = text if len(text) <= 24 else f"{text[:20]}... ({len(text)} digits)"
        raise argparse.ArgumentTypeError(f"expected at most {MAX_TIMELINE_BYTES:,} elements per chunk, got {shown}")
    return value


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "draw", help="draw the schedule (SVG, or HTML with hover details)",
        description="Draw a collective's SNAC schedule: one lane per rank (channels as sub-lanes, identical "
        "channels drawn once), steps as boxes, an arrow from each notify to the wait it releases. "
        "--timeline lays it out in time by a cost model; --compare draws several algorithms on one time "
        "axis; --trace draws the times measured on the GPU (coll.trace()). See docs/DRAW.md.",
    )
    common.add_common(parser, DEFAULT_WORLD_SIZE)
    # None until run(): an explicit --ranks must agree with a --trace, which fixes the world size.
    parser.set_defaults(ranks=None)
    common.add_lowering(parser)
    common.add_hierarchy(parser)
    parser.add_argument("-o", "--output", type=common.path, default=None,
                        help="output file, .svg or .html, or - for standard output (default: SVG on stdout)")
    parser.add_argument("--format", "-f", default=None, help="svg or html (default: from the output file's extension)")
    parser.add_argument("--timeline", action="store_true", help="lay the steps out in time by the cost model")
    parser.add_argument("--compare", default=None, metavar="A,B",
                        help="algorithms to draw one above the other on one time axis, e.g. ring,direct-push")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--bytes", dest="nbytes", type=timeline_bytes, default=None, metavar="SIZE",
                      help="message size for the timeline: the larger of one rank's input and output (default 64KiB)")
    size.add_argument("--count", type=timeline_count, default=None,
                      help="elements per chunk for the timeline (instead of --bytes)")
    parser.add_argument("--dtype", default=None, help=f"element type for the timeline (default {DEFAULT_DTYPE})")
    parser.add_argument("--all-channels", action="store_true", help="draw every channel even when they are identical")
    parser.add_argument("--trace", default=None, metavar="TRACE.json", help="draw the times of a device trace (coll.trace())")
    parser.add_argument("--width", type=width, default=None,
                        help=f"width of a timeline in pixels ({MIN_WIDTH} to {MAX_WIDTH:,})")


def compare_list(text: str | None) -> tuple[str, ...]:
    """--compare A,B,...: names (checked against the registry when drawn); an empty list or
    an empty name (``,``, ``ring,,two-shot``) is refused rather than drawn as one panel."""
    if text is None:
        return ()
    names = tuple(name.strip() for name in text.split(","))
    if not all(names):
        raise PurlinError(f"--compare {text!r}: expected algorithms separated by commas, e.g. ring,direct-push")
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:  # two panels of one schedule compare nothing
        raise PurlinError(f"--compare {text!r}: {', '.join(twice)} named twice; name each algorithm once")
    return names


def _refuse_unused(args, compare: tuple[str, ...]) -> None:
    """Options that would be silently ignored in this drawing are refused instead."""
    if compare and args.algorithm:
        raise PurlinError(f"--compare draws {', '.join(compare)}; -a {args.algorithm} would be ignored: give one of them")
    if args.gpus_per_node is not None:
        return  # hier.draw refuses what does not apply to a plan
    timed = args.timeline or compare or args.trace
    given = [flag for flag, value in (("--bytes", args.nbytes), ("--count", args.count), ("--dtype", args.dtype),
                                      ("--width", args.width)) if value is not None]
    if given and not timed:
        raise PurlinError(f"{' and '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to a timeline: "
                          "add --timeline (or --compare), or leave them out")


def run(args) -> int:
    from purlinc.draw.render import Request, output_format, render

    if args.output == "-":  # standard output, as '-' is standard input for the spec (it wrote a file named '-')
        args.output = None
    fmt = output_format(args.output, args.format)
    common.check_output_file(args.output, args.file)  # before the drawing, which may take seconds
    compare = compare_list(args.compare)
    _refuse_unused(args, compare)
    if args.gpus_per_node is not None:  # a hierarchical plan: phases, NCCL lines (purlinc/draw/hier.py)
        from purlinc.cli import hier

        return hier.draw(args, fmt, common.source(args))
    # Read once, here: a path is never taken for .pln text (a brace in its name), '-' is
    # standard input, and --compare builds one schedule per algorithm from the same text.
    request = Request(
        file=common.source(args), world_size=args.ranks, params=tuple(args.param),
        overrides=tuple(common.overrides(args).items()),
        timeline=args.timeline, compare=compare, nbytes=args.nbytes, count=args.count, dtype=args.dtype,
        collapse=not args.all_channels, trace=args.trace, width=args.width,
    )
    return common.write_drawing(render(request, fmt), args.output)
