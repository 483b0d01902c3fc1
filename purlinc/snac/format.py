"""Text and JSON dumps of a SNAC schedule (``purlinc dump --stage snac``, golden files).

The text is meant for a collective-library engineer: a header with the algorithm, the
buffers and every signal (owner, role, notifies per call), then per rank and channel the
numbered steps.  Programs are channel-relative (``purlinc.snac.ir``): one per rank, written
for channel 0; channel ``c`` runs the same steps with ``c * S`` added to every slice and
``c * W`` to every signal index, as the header says.  ``e`` in a notify or wait is the epoch (call number); a signal notified
``P`` times per call is at ``e*P + k`` after its k-th notify of call ``e``.
"""

from __future__ import annotations

from purlinc.frontend.ast import Operation
from purlinc.frontend.epilogue import epilogue_from_json
from purlinc.snac.ir import (
    Algorithm,
    Consume,
    Epilogue,
    LowerOptions,
    Notify,
    Program,
    Region,
    Role,
    Schedule,
    Signal,
    SignalDecl,
    Space,
    Stage,
    Wait,
)

SCHEMA = 2  # 2: channel-relative programs, one per rank, and channel_signals
NOTE_COLUMN = 44


def _epoch(per_call: int, k: int) -> str:
    return f"e*{per_call}{k:+d}"


def _step_text(step, per_call: dict[Signal, int]) -> tuple[str, str, str]:
    """(verb, operands, note) of one step."""
    if isinstance(step, Stage):
        if step.packed:  # the notify rides in the packets (LL): one step, both meanings
            operands = f"{step.src.format()} -> {step.dst.format()}, {step.signal.format()} = {_epoch(per_call[step.signal], step.k)} (LL)"
            return "stage+notify", operands, step.note
        return "stage", f"{step.src.format()} -> {step.dst.format()}", step.note
    if isinstance(step, Notify):
        return "notify", f"{step.signal.format()} = {_epoch(per_call[step.signal], step.k)}", step.note
    if isinstance(step, Wait):
        return "wait", f"{step.signal.format()} >= {_epoch(per_call[step.signal], step.k)}", step.note
    if isinstance(step, Consume):
        if step.operation is Operation.COPY and len(step.srcs) == 1:
            operands = f"{step.srcs[0].format()} -> {step.dst.format()}"
            verb = "copy"
        else:
            operands = "(" + ", ".join(s.format() for s in step.srcs) + f") -> {step.dst.format()}"
            verb = "reduce"
        note = step.note + (f"  [line {step.line}]" if step.line is not None else "")
        return verb, operands, note
    if isinstance(step, Epilogue):
        note = step.note + (f"  [line {step.line}]" if step.line is not None else "")
        return "epilogue", step.region.format(), note
    raise TypeError(f"not a SNAC step: {step!r}")


def format_program(program: Program, per_call: dict[Signal, int]) -> list[str]:
    rows = [_step_text(step, per_call) for step in program.steps]
    # Notes line up in one column; operands longer than NOTE_COLUMN just push theirs right.
    width = min(max((len(operands) for _, operands, _ in rows), default=0), NOTE_COLUMN)
    digits = len(str(max(len(rows) - 1, 0)))
    verbs = max((len(verb) for verb, _, _ in rows), default=7)
    verbs = max(verbs, 7)  # plain schedules keep their layout; packed ones widen the column
    lines = []
    for i, (verb, operands, note) in enumerate(rows):
        text = f"  {i:>{digits}}  {verb:<{verbs}} {operands}"
        if note:
            text = f"{text:<{digits + verbs + 5 + width}}   {note}"
        lines.append(text.rstrip())
    return lines


def format_schedule(schedule: Schedule) -> str:
    options = schedule.options
    per_call = schedule.per_call()
    registered = ", ".join(sorted(options.registered)) or "none"
    slots = "one per message" if options.slots is None else str(options.slots)
    lines = [
        f"schedule {schedule.collective} (R={schedule.world_size}, {schedule.operation.value})",
        f"  algorithm {options.algorithm.value}, channels {options.channels}, slices {options.slices} per channel "
        f"({schedule.slices} per unit), slots {slots}, registered {registered}"
        + (", packed (LL: data notifies ride in 16-byte packets, 2 staging units per message)" if options.packed else ""),
        f"  key {options.key()}",
        *([f"  {schedule.sizes.format()}: IN/OUT units packed by run-time sizes, "
            "a STAGE unit = size header + capacity elements"] if schedule.sizes is not None else []),
        "  buffers (units of one chunk):",
        "    in:    " + " ".join(f"r{r}:{n}" for r, n in enumerate(schedule.in_units)),
        "    out:   " + " ".join(f"r{r}:{n}" for r, n in enumerate(schedule.out_units)),
        f"    stage: {schedule.stage_units} per rank"
        + (f", {schedule.stage_copies} copies by call parity ({schedule.staging_units} allocated)"
           if schedule.stage_copies > 1 else ""),
        f"  channels: {options.channels}; channel c runs every program below with slices + c*{options.slices} "
        f"and signal indices + c*{schedule.channel_signals}",
        f"  signals: {len(schedule.signals)} per channel ({schedule.channel_signals} per rank and channel; "
        f"pad {schedule.signal_pad_size()} per rank)",
    ]
    if schedule.epilogue is not None:
        lines += ["  " + line for line in schedule.epilogue.format().splitlines()]
    for decl in schedule.signals:
        lines.append(f"    {decl.signal.format():<14} {decl.role.value:<4} per_call={decl.per_call:<3} {decl.note}".rstrip())
    for program in schedule.programs:
        lines.append("")
        lines.append(f"rank {program.rank} (every channel): {len(program.steps)} steps")
        lines.extend(format_program(program, per_call))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------
# JSON (round-trips through schedule_from_json)


def _region(r: Region) -> list:
    return [r.space.value, r.rank, r.unit, r.slice]


def _signal(s: Signal) -> list:
    return [s.owner, s.index]


def _step_json(step) -> dict:
    if isinstance(step, Stage):
        data = {"op": "stage", "src": _region(step.src), "dst": _region(step.dst), "note": step.note}
        if step.packed:
            data.update(signal=_signal(step.signal), k=step.k)
        return data
    if isinstance(step, Notify):
        return {"op": "notify", "signal": _signal(step.signal), "k": step.k, "note": step.note}
    if isinstance(step, Wait):
        return {"op": "wait", "signal": _signal(step.signal), "k": step.k, "note": step.note}
    if isinstance(step, Epilogue):
        return {"op": "epilogue", "region": _region(step.region), "note": step.note, "line": step.line}
    return {
        "op": "consume", "operation": step.operation.value, "srcs": [_region(s) for s in step.srcs],
        "dst": _region(step.dst), "note": step.note, "line": step.line,
    }


def schedule_to_json(schedule: Schedule) -> dict:
    options = schedule.options
    return {
        "schema": SCHEMA,
        "collective": schedule.collective,
        "world_size": schedule.world_size,
        "operation": schedule.operation.value,
        "options": {
            "algorithm": options.algorithm.value,
            "channels": options.channels,
            "slices": options.slices,
            "slots": options.slots,
            "registered": sorted(options.registered),
            "packed": options.packed,
            "stage_copies": options.stage_copies,
            "key": options.key(),
        },
        "slices": schedule.slices,
        "in_units": list(schedule.in_units),
        "out_units": list(schedule.out_units),
        "stage_units": schedule.stage_units,
        "stage_copies": schedule.stage_copies,
        "signal_pad": schedule.signal_pad_size(),
        "channel_signals": schedule.channel_signals,
        **({"sizes": {"operand": schedule.sizes.operand, "chunk": schedule.sizes.chunk,
                      "extents": list(schedule.sizes.extents)}} if schedule.sizes is not None else {}),
        "signals": [
            {"signal": _signal(d.signal), "per_call": d.per_call, "role": d.role.value, "note": d.note}
            for d in schedule.signals
        ],
        "programs": [
            {"rank": p.rank, "steps": [_step_json(s) for s in p.steps]}
            for p in schedule.programs
        ],
        **({"epilogue": schedule.epilogue.to_json()} if schedule.epilogue is not None else {}),
    }


def _region_from(data) -> Region:
    space, rank, unit, slice_ = data
    return Region(Space(space), rank, unit, slice_)


def _step_from(data: dict):
    op = data["op"]
    if op == "stage":
        signal = Signal(*data["signal"]) if data.get("signal") is not None else None
        return Stage(_region_from(data["src"]), _region_from(data["dst"]), data.get("note", ""), signal, data.get("k", 0))
    if op in ("notify", "wait"):
        cls = Notify if op == "notify" else Wait
        return cls(Signal(*data["signal"]), data["k"], data.get("note", ""))
    if op == "epilogue":
        return Epilogue(_region_from(data["region"]), data.get("note", ""), data.get("line"))
    if op == "consume":
        return Consume(
            Operation(data["operation"]), tuple(_region_from(s) for s in data["srcs"]),
            _region_from(data["dst"]), data.get("note", ""), data.get("line"),
        )
    raise ValueError(f"unknown step op {op!r}")


def schedule_from_json(data: dict) -> Schedule:
    """The inverse of ``schedule_to_json`` (notes and lines included).  A document that is not
    one is a ValueError saying what is missing or wrong (a bare KeyError or AttributeError came
    from deep inside), and the options are checked as a lowering checks them (a registered
    "in" read as the set of its letters, packed "no" as true)."""
    if not isinstance(data, dict):
        raise ValueError(f"schedule JSON: expected an object, got {type(data).__name__}")
    if data.get("schema") != SCHEMA:
        raise ValueError(f"schedule JSON schema {data.get('schema')!r}, expected {SCHEMA}")
    try:
        schedule = _schedule_from(data)
    except KeyError as error:
        raise ValueError(f"schedule JSON: {error.args[0]!r} is missing") from None
    except (TypeError, AttributeError, ValueError) as error:
        raise ValueError(f"schedule JSON: {error}") from None
    _check_numbers(schedule)
    return schedule


def _check_numbers(schedule: Schedule) -> None:
    """The schedule's options and counts of their types (the verifier compares them with ints)."""
    from purlinc.errors import PurlinError
    from purlinc.snac.lower import check_option_types

    try:
        check_option_types(schedule.options)
    except PurlinError as error:
        raise ValueError(f"schedule JSON: options: {error.message}") from None
    for name in ("world_size", "slices", "stage_units", "channel_signals"):
        value = getattr(schedule, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"schedule JSON: {name} must be an integer, got {value!r}")
    for name in ("in_units", "out_units"):
        if any(isinstance(v, bool) or not isinstance(v, int) for v in getattr(schedule, name)):
            raise ValueError(f"schedule JSON: {name} must be integers, got {list(getattr(schedule, name))!r}")
    if not isinstance(schedule.collective, str):
        raise ValueError(f"schedule JSON: collective must be a name, got {schedule.collective!r}")


def _schedule_from(data: dict) -> Schedule:
    o = data["options"]
    if not isinstance(o["registered"], list):  # frozenset("in") is {'i', 'n'}
        raise ValueError(f"options: registered must be a list of 'in' and/or 'out', got {o['registered']!r}")
    options = LowerOptions(
        algorithm=Algorithm(o["algorithm"]), channels=o["channels"], slices=o["slices"],
        slots=o["slots"], registered=frozenset(o["registered"]), packed=o.get("packed", False),
        stage_copies=o.get("stage_copies", 1),
    )
    return Schedule(
        collective=data["collective"],
        world_size=data["world_size"],
        operation=Operation(data["operation"]),
        options=options,
        slices=data["slices"],
        in_units=tuple(data["in_units"]),
        out_units=tuple(data["out_units"]),
        stage_units=data["stage_units"],
        signals=tuple(
            SignalDecl(Signal(*d["signal"]), d["per_call"], Role(d["role"]), d.get("note", ""))
            for d in data["signals"]
        ),
        programs=tuple(
            Program(p["rank"], 0, tuple(_step_from(s) for s in p["steps"]))
            for p in data["programs"]
        ),
        channel_signals=data["channel_signals"],
        stage_copies=data.get("stage_copies", 1),
        sizes=_sizes_from(data.get("sizes")),
        epilogue=epilogue_from_json(data["epilogue"]) if "epilogue" in data else None,
    )


def _sizes_from(data: dict | None):
    from purlinc.frontend.spec import Sizes

    return None if data is None else Sizes(data["operand"], data["chunk"], tuple(data["extents"]))
