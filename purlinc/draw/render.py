"""File and options in, SVG or HTML text out: the one path ``purlinc draw`` takes."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from purlinc.draw import html, svg
from purlinc.draw.model import build
from purlinc.draw.timeline import CostModel, chunk_bytes_for, schedule_times
from purlinc.errors import PurlinError

FORMATS = ("svg", "html")


@dataclass(frozen=True, slots=True)
class Request:
    file: str
    world_size: int
    params: tuple[tuple[str, int], ...] = ()
    overrides: tuple[tuple[str, object], ...] = ()  # LowerOptions fields
    timeline: bool = False
    compare: tuple[str, ...] = ()  # algorithms, one panel each (implies the timeline)
    nbytes: int | None = None
    count: int | None = None
    dtype: str = "bfloat16"
    collapse: bool = True
    trace: str | None = None
    width: int | None = None


def output_format(path: str | None, requested: str | None) -> str:
    """``--format`` if given, else the output file's extension."""
    if requested is not None:
        fmt = requested.lower()
    elif path:
        fmt = Path(path).suffix.lstrip(".").lower()
        if fmt in ("htm",):
            fmt = "html"
    else:
        fmt = "svg"
    if fmt not in FORMATS:
        raise PurlinError(
            f"unknown drawing format {fmt!r} (from {'--format' if requested else path}): expected svg or html",
            notes=("name the output file .svg or .html, or pass --format svg|html",),
        )
    return fmt


def schedule_for(file: str, world_size: int, params, overrides: dict):
    from purlinc import pipeline

    source = pipeline.load_source(file)
    spec = pipeline.spec_stage(pipeline.parse_stage(source), world_size, dict(params))
    # What `purlinc compile` would build with the default atom (its staging copies).
    options = replace(pipeline.default_options(spec), **pipeline.with_atom_defaults(overrides))
    return spec, pipeline.snac_stage(spec, options)


def bare_chunks(spec) -> frozenset[str]:
    """The spec's chunk names used without an index (``in[r] = x``): the drawing finds chunks
    in step notes, where an unindexed name is only told from the notes' words by this list."""
    return frozenset(c.name for buffers in (spec.inputs, spec.outputs) for layout in buffers for c in layout
                     if not c.index)


def panels_for(request: Request) -> list[svg.Panel]:
    from purlinc.dtypes import DType
    from purlinc.snac.algorithms import get_algorithm
    from purlinc.snac.ir import Algorithm

    overrides = dict(request.overrides)
    if request.trace is not None:
        from purlinc.draw import trace as tracing

        data = tracing.load(request.trace)
        overrides.update(tracing.options_of(data))
        spec, schedule = schedule_for(request.file, data["world_size"], request.params or tuple(data["params"].items()),
                                      overrides)
        tracing.check_matches(data, schedule, request.trace)
        drawing = build(schedule, collapse=False, channels=tracing.channels_of(data), bare_chunks=bare_chunks(spec))
        times, measured = tracing.times(data, drawing)
        heading = f"{schedule.collective}: measured on the GPU ({data.get('device', 'device')})"
        return [svg.Panel(drawing, times, heading, measured)]
    try:
        itemsize = DType.parse(request.dtype).itemsize
    except ValueError as error:
        raise PurlinError(str(error)) from None
    variants = [None] if not request.compare else list(request.compare)
    panels = []
    for algorithm in variants:
        changes = dict(overrides)
        if algorithm is not None:
            try:
                changes["algorithm"] = Algorithm(algorithm)
            except ValueError:
                names = ", ".join(a.value for a in Algorithm)
                raise PurlinError(f"unknown algorithm {algorithm!r} in --compare: expected {names}") from None
            if not get_algorithm(algorithm).packed:  # packing applies where the record says
                changes.pop("packed", None)
        spec, schedule = schedule_for(request.file, request.world_size, request.params, changes)
        drawing = build(schedule, collapse=request.collapse, bare_chunks=bare_chunks(spec))
        timed = request.timeline or bool(request.compare)
        if timed:
            nbytes = request.nbytes if request.nbytes is not None or request.count is not None else 65536
            chunk = chunk_bytes_for(schedule, nbytes=nbytes, count=request.count, itemsize=itemsize)
            times = schedule_times(schedule, drawing, CostModel(), chunk_bytes=chunk)
            heading = f"{schedule.collective} {schedule.options.algorithm.value}: modelled, {chunk} B per chunk ({request.dtype})"
        else:
            times = schedule_times(schedule, drawing)
            heading = f"{schedule.collective} {schedule.options.algorithm.value}"
        panels.append(svg.Panel(drawing, times, heading))
    return panels


def render(request: Request, fmt: str) -> str:
    panels = panels_for(request)
    text = svg.render(panels, width=request.width)
    if fmt == "html":
        title = " vs ".join(p.heading for p in panels)
        return html.render(text, title=title)
    return text
