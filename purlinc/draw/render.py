"""File and options in, SVG or HTML text out: the one path ``purlinc draw`` takes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from purlinc.draw import html, svg
from purlinc.draw.defaults import DEFAULT_DTYPE, DEFAULT_WORLD_SIZE, MAX_BOXES, MAX_TIMELINE_BYTES, MAX_WIDTH, MIN_WIDTH
from purlinc.draw.model import build, refuse_large
from purlinc.draw.timeline import CostModel, buffer_units, chunk_bytes_for, schedule_times
from purlinc.errors import PurlinError
from purlinc.pipeline.source import SourceText

FORMATS = ("svg", "html")


@dataclass(frozen=True, slots=True)
class Request:
    file: str | Path | SourceText  # as pipeline.load_source takes it (the CLI passes the text it read once)
    world_size: int | None = None  # None: not given (DEFAULT_WORLD_SIZE, or the trace's)
    params: tuple[tuple[str, int], ...] = ()
    overrides: tuple[tuple[str, object], ...] = ()  # LowerOptions fields
    timeline: bool = False
    compare: tuple[str, ...] = ()  # algorithms, one panel each (implies the timeline)
    nbytes: int | None = None
    count: int | None = None
    dtype: str | None = None  # None: not given (DEFAULT_DTYPE, or the trace's)
    collapse: bool = True
    trace: str | None = None
    width: int | None = None


def _suffix_format(path: str) -> str:
    fmt = Path(path).suffix.lstrip(".").lower()
    return "html" if fmt == "htm" else fmt


def output_format(path: str | None, requested: str | None) -> str:
    """``--format`` if given, else the output file's extension.  Both given must agree where
    the extension names a format (``-o x.svg --format html`` wrote a page into x.svg)."""
    if requested is not None:
        fmt, where = requested.strip().lower(), f"--format {requested!r}"
        named = _suffix_format(path) if path else ""
        if fmt in FORMATS and named in FORMATS and named != fmt:
            raise PurlinError(f"--format {fmt} does not agree with -o {path}, a .{Path(path).suffix.lstrip('.')} "
                              "file", notes=("give one of them, or name the file for the format",))
    elif path:
        fmt = _suffix_format(path)
        where = f"-o {path}" if fmt else f"-o {path}, a name without an extension"
    else:
        fmt = "svg"
    if fmt not in FORMATS:
        raise PurlinError(
            f"unknown drawing format {fmt!r} (from {where}): expected svg or html",
            notes=("name the output file .svg or .html, or pass --format svg|html",),
        )
    return fmt


def schedule_for(file: str | Path | SourceText, world_size: int, params, overrides: dict, *, verify: bool = True):
    from purlinc import pipeline
    from purlinc.snac.algorithms import get_algorithm

    source = pipeline.load_source(file)
    spec = pipeline.spec_stage(pipeline.parse_stage(source), world_size, dict(params))
    if spec.sizes is not None and overrides.get("stage_copies") == 1:  # as compile refuses it
        from purlinc.snac.sized import ONE_COPY_NOTE, ONE_COPY_REFUSED

        raise PurlinError(f"{_shown('stage_copies', 1)} {ONE_COPY_REFUSED}", notes=(ONE_COPY_NOTE,))
    # What `purlinc compile` would build with the default atom (its staging copies).  Slots go on
    # only where the algorithm stages through them: the caller refuses them elsewhere, in the
    # command line's words (_refuse_unused_slots), after seeing every schedule drawn.
    changes = pipeline.with_atom_defaults(overrides)
    slots = changes.pop("slots", None)
    options = pipeline.resolve_options(spec, overrides=changes)
    if slots is not None and get_algorithm(options.algorithm).uses_slots:
        options = pipeline.resolve_options(spec, options=options, overrides={"slots": slots})
    return spec, pipeline.snac_stage(spec, options, verify=verify)


def bare_chunks(spec) -> frozenset[str]:
    """The spec's chunk names used without an index (``in[r] = x``): the drawing finds chunks
    in step notes, where an unindexed name is only told from the notes' words by this list."""
    return frozenset(c.name for buffers in (spec.inputs, spec.outputs) for layout in buffers for c in layout
                     if not c.index)


def _refuse_with_trace(request: Request) -> None:
    """Options of a modelled timeline, refused with a trace (checked before reading it)."""
    if request.compare:
        raise PurlinError("--compare draws modelled timelines; a --trace draws one measured schedule: give one of them")
    if request.nbytes is not None or request.count is not None:
        raise PurlinError("--bytes and --count size the modelled timeline; a --trace has measured times: leave them out")
    if request.timeline:
        raise PurlinError("--timeline lays the steps out by the cost model; a --trace lays them out by measured "
                          "times: leave --timeline out")


def _shown(name: str, value) -> str:
    """An option as its command-line flag (``--packed``, ``--channels 2``)."""
    flag = f"--{name.replace('_', '-')}"
    if isinstance(value, bool) or value is None:  # None: --slots not given (a unit per message)
        return flag if value else f"no {flag}"
    if name == "registered":  # a set of buffers, as --registered in|out|both|none names it
        return f"{flag} {'both' if value == {'in', 'out'} else next(iter(value), 'none')}"
    return f"{flag} {getattr(value, 'value', value)}"  # an Algorithm by its name


def _refuse_against_trace(request: Request, data: dict) -> None:
    """A trace fixes the schedule it was recorded with: an option given on the command line
    that says otherwise is refused (silently drawing the trace's would hide the mix-up).
    Options given that agree with the trace are accepted."""
    from purlinc.draw import trace as tracing

    conflicts = []
    if request.world_size is not None and request.world_size != data["world_size"]:
        conflicts.append(f"--ranks {request.world_size} (the trace ran R={data['world_size']})")
    for name, value in request.params:
        if data["params"].get(name) != value:
            recorded = f"{name}={data['params'][name]}" if name in data["params"] else f"no {name}"
            conflicts.append(f"--param {name}={value} (the trace has {recorded})")
    fixed = tracing.options_of(data)
    for name, value in request.overrides:
        if name in fixed and fixed[name] != value:
            conflicts.append(f"{_shown(name, value)} (the trace ran {_shown(name, fixed[name])})")
    if request.dtype is not None and data.get("dtype") not in (None, request.dtype):
        conflicts.append(f"--dtype {request.dtype} (the trace ran {data['dtype']})")
    if conflicts:
        raise PurlinError(f"trace {request.trace} fixes the schedule it was recorded with, but the command line "
                          "gives " + "; ".join(conflicts),
                          notes=("leave these options out: draw --trace takes them from the trace",))


def _trace_panel(request: Request) -> svg.Panel:
    """The schedule the trace was recorded with (rebuilt from the .pln), with measured times."""
    from purlinc.draw import trace as tracing

    _refuse_with_trace(request)
    data = tracing.load(request.trace)
    _refuse_against_trace(request, data)
    overrides = {**dict(request.overrides), **tracing.options_of(data)}
    try:
        spec, schedule = schedule_for(request.file, data["world_size"], tuple(data["params"].items()), overrides)
    except PurlinError as error:  # R, parameters and options came from the trace, not the command line
        raise error.with_note(f"the world size, parameters and options come from the trace {request.trace}") from None
    tracing.check_matches(data, schedule, request.trace)
    drawing = build(schedule, collapse=False, channels=tracing.channels_of(data), bare_chunks=bare_chunks(spec),
                    params=spec.params)
    times, measured = tracing.times(data, drawing)
    heading = f"{schedule.collective}: measured on the GPU ({data.get('device', 'device')})"
    return svg.Panel(drawing, times, heading, measured)


def panels_for(request: Request) -> list[svg.Panel]:
    from purlinc.dtypes import DType
    from purlinc.snac.algorithms import get_algorithm
    from purlinc.snac.ir import Algorithm
    from purlinc.snac.verify import verify as verify_schedule

    if request.trace is not None:
        return [_trace_panel(request)]
    overrides = dict(request.overrides)
    world_size = request.world_size if request.world_size is not None else DEFAULT_WORLD_SIZE
    dtype = request.dtype or DEFAULT_DTYPE
    itemsize = DType.parse(dtype).itemsize  # an unknown name: a PurlinError listing the known ones
    variants = [None] if not request.compare else list(request.compare)
    for algorithm in request.compare:
        try:
            Algorithm(algorithm)
        except ValueError:
            names = ", ".join(a.value for a in Algorithm)
            raise PurlinError(f"unknown algorithm {algorithm!r} in --compare: expected {names}") from None
    if request.compare:
        _refuse_unused_in_compare(overrides, request.compare)
    lowered = []
    for algorithm in variants:
        changes = dict(overrides)
        if algorithm is not None:
            changes["algorithm"] = Algorithm(algorithm)
            if not get_algorithm(algorithm).packed:  # packing applies where the record says
                changes.pop("packed", None)
        lowered.append(schedule_for(request.file, world_size, request.params, changes, verify=False))
    _refuse_unused_slots(overrides.get("slots"), [schedule for _, schedule in lowered], bool(request.compare))
    _refuse_too_big_to_lower([schedule for _, schedule in lowered])
    panels = []
    for spec, schedule in lowered:
        verify_schedule(schedule, spec)
        drawing = build(schedule, collapse=request.collapse, bare_chunks=bare_chunks(spec), params=spec.params)
        timed = request.timeline or bool(request.compare)
        if timed:
            nbytes = request.nbytes if request.nbytes is not None or request.count is not None else 65536
            _refuse_what_a_call_would(schedule, dtype, _dtype_flag(request), request.count)
            chunk = chunk_bytes_for(schedule, nbytes=nbytes, count=request.count, itemsize=itemsize)
            _refuse_too_long_a_message(schedule, chunk, request.count)
            times = schedule_times(schedule, drawing, CostModel(), chunk_bytes=chunk)
            heading = f"{schedule.collective} {schedule.options.algorithm.value}: modelled, {chunk} B per chunk ({dtype})"
        else:
            times = schedule_times(schedule, drawing)
            heading = f"{schedule.collective} {schedule.options.algorithm.value}"
        panels.append(svg.Panel(drawing, times, heading))
    return panels


def _refuse_unused_in_compare(overrides: dict, compare: tuple[str, ...]) -> None:
    """--packed or --stage-copies 2 where no compared algorithm takes them: each panel would
    drop the option, and the drawing would equal the one without it.  Refused in the words of
    the refusals of ``-a ring --packed`` and ``-a ring --stage-copies 2`` (lower.check_packed,
    cli.common.check_stage_copies); where one compared algorithm takes it, it applies there."""
    from purlinc.snac.algorithms import ALGORITHMS, get_algorithm

    names = ", ".join(compare)
    if overrides.get("packed") and not any(get_algorithm(a).packed for a in compare):
        packing = " or ".join(r.name for r in ALGORITHMS.records() if r.packed)
        raise PurlinError(f"--packed does not apply to {names}: packed (LL) stages are supported for {packing} only",
                          notes=(f"LL packing is for small messages, where one-shot {packing} is the algorithm to "
                                 "use: add it to --compare, or leave --packed out",))
    copies = overrides.get("stage_copies")
    most = max(get_algorithm(a).stage_copies for a in compare)
    if copies is not None and copies > most:
        two = ", ".join(r.name for r in ALGORITHMS.records() if r.stage_copies > 1)
        raise PurlinError(f"--stage-copies {copies} does not apply to {names}: they lower to {most} staging "
                          f"cop{'y' if most == 1 else 'ies'}",
                          notes=(f"two staging copies apply to {two} only: add one to --compare, or leave "
                                 "--stage-copies out",))


def _refuse_unused_slots(slots, schedules, compare: bool) -> None:
    """--slots where no drawn schedule stages through slots: the lowering would take the number
    into the options' key and draw every message in its own unit, as if it were not given."""
    from purlinc.snac.algorithms import get_algorithm, slotted_names

    if slots is None or any(get_algorithm(s.options.algorithm).uses_slots for s in schedules):
        return
    names = ", ".join(s.options.algorithm.value for s in schedules)
    users = slotted_names()
    raise PurlinError(f"--slots {slots} does not apply to {names}: {'they give' if compare else 'it gives'} every "
                      "message its own staging unit",
                      notes=(f"--slots applies to {users} (pick one with -a{' or --compare' if compare else ''}), "
                             "or leave --slots out",))


_DRAW_LESS = ("draw fewer ranks (--ranks), one channel (leave out --all-channels) or fewer slices, or an algorithm "
              "with fewer steps per rank (-a ring); purlinc dump --stage snac prints any schedule")


def _refuse_too_big_to_lower(schedules) -> None:
    """Refused as soon as the schedules are lowered, before they are verified and drawn (at
    R=48-64 those took 17-29 s before the refusal below): every drawing shows every rank's
    channel 0, so their steps alone already count boxes the drawing will have."""
    for schedule in schedules:
        refuse_large(schedule)
    boxes = sum(len(s.program(rank, 0).steps) for s in schedules for rank in range(s.world_size))
    if boxes > MAX_BOXES:
        raise PurlinError(f"this drawing would have at least {boxes:,} step boxes, more than {MAX_BOXES:,}: too many "
                          "to read", notes=(_DRAW_LESS,))


def _refuse_too_big(panels: list[svg.Panel]) -> None:
    """A drawing of more than MAX_BOXES steps cannot be read (nor opened with ease): say so,
    and what draws less, rather than write a page of hundreds of megabytes."""
    boxes = sum(len(lane.steps) for p in panels for lane in p.drawing.lanes)
    if boxes > MAX_BOXES:
        raise PurlinError(f"this drawing would have {boxes:,} step boxes, more than {MAX_BOXES:,}: too many to read",
                          notes=(_DRAW_LESS,))


def _check_sizes(request: Request) -> None:
    """The limits the command line's parser applies, for a Request made in Python too."""
    if request.width is not None and not MIN_WIDTH <= request.width <= MAX_WIDTH:
        raise PurlinError(f"width={request.width}: expected {MIN_WIDTH} to {MAX_WIDTH:,} pixels")
    for name, value in (("nbytes", request.nbytes), ("count", request.count)):
        if value is not None and not 1 <= value <= MAX_TIMELINE_BYTES:
            raise PurlinError(f"{name}={value}: expected 1 to {MAX_TIMELINE_BYTES:,} (a 1 TiB message at most)")


def _dtype_flag(request: Request) -> str:
    """The timeline's element type as an error names it: "--dtype int32" where given, "the
    default dtype bfloat16 (--dtype)" where not (blaming a flag the command line does not have
    misleads)."""
    if request.dtype is not None:
        return f"--dtype {request.dtype}"
    return f"the default dtype {DEFAULT_DTYPE} (--dtype)"


def _refuse_what_a_call_would(schedule, dtype: str, flag: str, count: int | None) -> None:
    """A timeline models a call: one the runtime would refuse (a reduction in a dtype that
    cannot be reduced, an epilogue's dtype or rows) is refused here too, with the same reason,
    rather than drawn.  ``flag``: the dtype as the error names it (_dtype_flag)."""
    from purlinc.atom.rows import row_problem
    from purlinc.dtypes import DType, reduction_problem
    from purlinc.frontend.ast import Operation

    epilogue, parsed = schedule.epilogue, DType.parse(dtype)
    problem = None if epilogue is None else row_problem(epilogue.row, parsed)
    if problem is not None:  # first, as the code generator checks it: the more precise reason
        raise PurlinError(f"{flag}: {problem}", notes=("a call of this collective would be refused",))
    unreducible = reduction_problem(parsed, schedule.collective) if schedule.operation is Operation.REDUCE else None
    if unreducible is not None:
        reason, note = unreducible
        raise PurlinError(f"{flag}: {reason}", notes=("a call of this collective would be refused", note))
    if epilogue is not None and count is not None and count % epilogue.row:
        raise PurlinError(f"count={count}: not a whole number of the epilogue's rows of {epilogue.row} elements",
                          notes=("a call's chunks hold whole rows; a call with this count would be refused",))


def _refuse_too_long_a_message(schedule, chunk: int, count: int | None) -> None:
    """--count gives elements per chunk: with the dtype's size and a rank's chunks it may
    still model more than the 1 TiB message that --bytes is held to."""
    units = buffer_units(schedule)
    if count is not None and chunk * units > MAX_TIMELINE_BYTES:
        raise PurlinError(f"count={count}: {units} chunk(s) of {chunk:,} B make a {chunk * units:,} B message, more "
                          f"than {MAX_TIMELINE_BYTES:,} (1 TiB)")


def render(request: Request, fmt: str) -> str:
    _check_sizes(request)
    panels = panels_for(request)
    _refuse_too_big(panels)
    text = svg.render(panels, width=request.width)
    if fmt == "html":
        title = " vs ".join(p.heading for p in panels)
        return html.render(text, title=title)
    return text
