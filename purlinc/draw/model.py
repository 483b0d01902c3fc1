"""A SNAC schedule as something to draw: lanes, step boxes and Notify -> Wait arrows.

Programs are read only through ``Schedule.program(rank, channel)`` (the concrete program of
one channel), ``Schedule.channels`` and ``Schedule.world_size``, so the drawing does not care
whether the IR stores channels concretely or symbolically.

Pairs: within one call, ``Wait(s, k)`` with ``k >= 1`` is released by the step that raises
``s`` to ``k``: a ``Notify(s, k)``, or a packed (LL) ``Stage`` carrying ``(s, k)``.  A wait
with ``k <= 0`` waits for a notify of an *earlier* call (flow control): it gets no arrow,
only a "previous call" mark.

Identical channels: channel ``c`` is drawn once with channel 0 when its program equals
channel 0's after shifting slices back by ``c * options.slices`` and renaming signals in
order of first use (the lowering instantiates one template channel; this checks it rather
than assuming it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from purlinc.frontend.ast import Operation
from purlinc.snac.ir import Consume, Epilogue, Notify, Region, Role, Schedule, Signal, Stage, Wait

_INDEXED = r"(?<![\w.])[A-Za-z_]\w*(?:\[[^\]\s]+\])+"  # x[3], not r0.stage[3]
_CHUNK = re.compile(_INDEXED)


@dataclass(frozen=True, slots=True)
class StepBox:
    """One step of one drawn lane."""

    rank: int
    channel: int
    index: int  # position in the program's steps
    verb: str  # stage | stage+notify | notify | wait | copy | reduce | epilogue
    chunk: str  # the chunk the step moves or announces ("" when none, e.g. an ack)
    chunks: tuple[str, ...]  # every chunk its note names
    line: int | None  # .pln line of the chunk's output, when known
    operands: str  # the dump's operand text, e.g. "r0.in[0].s0 -> r1.stage[0].s0"
    note: str
    signal: Signal | None = None  # notify / wait / packed stage
    k: int = 0
    previous_call: bool = False  # a wait for an earlier call's notify
    peer: int | None = None  # the other rank a stage writes to / a notify raises (None: local)
    # The slice of its unit a data step moves, where a chunk has several slices per channel
    # (None otherwise): without it the S boxes of one chunk read as the same data moved S times.
    slice_index: int | None = None
    # A notify / wait of an acknowledgement ("done with x[1]": the slot is free again).  Its
    # note names the chunk, so 'notify x[1]>r0' read as x[1] sent to r0; the label says 'ack'.
    ack: bool = False

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.rank, self.channel, self.index)

    def label(self) -> str:
        return self.verb

    def detail(self) -> str:
        where = f"rank {self.rank} channel {self.channel} step {self.index}"
        line = f", line {self.line}" if self.line is not None else ""
        text = f"{where}: {self.verb} {self.operands}"
        if self.note:  # a note already in parentheses ("(x[0] from r3)") is not put in more
            text += f"  {self.note}" if _parenthesized(self.note) else f"  ({self.note})"
        return text + line


def _parenthesized(text: str) -> bool:
    """``text`` is one parenthesized group: "(x from r3)", not "(a) and (b)"."""
    if not (text.startswith("(") and text.endswith(")")):
        return False
    depth = 0
    for position, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return position == len(text) - 1
    return False


@dataclass(frozen=True, slots=True)
class Pair:
    """An arrow: the step raising ``signal`` to ``k`` releases the wait for it."""

    notify: tuple[int, int, int]  # (rank, channel, index)
    wait: tuple[int, int, int]
    signal: Signal
    k: int


@dataclass(frozen=True, slots=True)
class Lane:
    rank: int
    channel: int
    label: str
    steps: tuple[StepBox, ...]


@dataclass(frozen=True, slots=True)
class Drawing:
    title: str
    subtitle: str
    world_size: int
    channels: int  # channels of the schedule
    collapsed: bool  # True: only channel 0 is drawn, the others are identical up to shift
    lanes: tuple[Lane, ...]
    pairs: tuple[Pair, ...]  # only pairs whose both ends are drawn
    chunks: tuple[str, ...]  # every chunk name, in a stable order (the colour key)
    notes: tuple[str, ...] = field(default=())


# ---- steps ------------------------------------------------------------------------------

def _operands(step) -> str:
    if isinstance(step, Stage):
        text = f"{step.src.format()} -> {step.dst.format()}"
        if step.packed:
            text += f", {step.signal.format()} = +{step.k} (LL)"
        return text
    if isinstance(step, Notify):
        return f"{step.signal.format()} = call*P+{step.k}"
    if isinstance(step, Wait):
        return f"{step.signal.format()} >= call*P{step.k:+d}"
    if isinstance(step, Epilogue):
        return step.region.format()
    srcs = ", ".join(s.format() for s in step.srcs)
    return f"({srcs}) -> {step.dst.format()}"


def chunk_pattern(bare: frozenset[str] = frozenset()) -> re.Pattern:
    """What names a chunk in a step's note: an indexed name (``x[3]``), or one of ``bare``, the
    spec's chunks that have no index (``in[r] = x``), as a whole word -- a note's other words
    ("for", "from", "r0.stage[3]") cannot be told from a bare chunk name without the spec."""
    if not bare:
        return _CHUNK
    names = "|".join(re.escape(n) for n in sorted(bare, key=lambda n: (-len(n), n)))
    return re.compile(f"{_INDEXED}|(?<![\\w.])(?:{names})(?![\\w.\\[])")


def chunks_of(note: str, pattern: re.Pattern = _CHUNK) -> tuple[str, ...]:
    return tuple(pattern.findall(note or ""))


def _verb(step) -> str:
    if isinstance(step, Stage):
        return "stage+notify" if step.packed else "stage"
    if isinstance(step, Notify):
        return "notify"
    if isinstance(step, Wait):
        return "wait"
    if isinstance(step, Consume):
        if step.operation is Operation.COPY and len(step.srcs) == 1:
            return "copy"
        return "reduce"
    if isinstance(step, Epilogue):
        return "epilogue"
    raise TypeError(f"not a SNAC step: {step!r}")


def _slice_of(step) -> int | None:
    if isinstance(step, (Stage, Consume)):
        return step.dst.slice
    if isinstance(step, Epilogue):
        return step.region.slice
    return None


def _box(rank: int, channel: int, index: int, step, lines: dict[str, int], pattern: re.Pattern,
         slices: bool = False, acks: frozenset[Signal] = frozenset()) -> StepBox:
    note = " ".join(str(getattr(step, "note", "") or "").split())
    chunks = chunks_of(note, pattern)
    chunk = chunks[0] if len(set(chunks)) == 1 else ""
    line = getattr(step, "line", None)
    if line is None and chunk:
        line = lines.get(chunk)
    signal = getattr(step, "signal", None)
    k = getattr(step, "k", 0)
    peer = None
    if isinstance(step, Stage):
        peer = step.dst.rank if step.dst.rank != rank else (step.src.rank if step.src.rank != rank else None)
    elif isinstance(step, Notify) and step.signal.owner != rank:
        peer = step.signal.owner
    return StepBox(
        rank=rank, channel=channel, index=index, verb=_verb(step), chunk=chunk, chunks=chunks, line=line,
        operands=_operands(step), note=note, signal=signal, k=k,
        previous_call=isinstance(step, Wait) and step.k <= 0, peer=peer,
        slice_index=_slice_of(step) if slices else None,
        ack=isinstance(step, (Notify, Wait)) and step.signal in acks,
    )


# ---- channels ---------------------------------------------------------------------------

def _canonical(schedule: Schedule, rank: int, channel: int) -> tuple:
    """Channel ``channel``'s program with slices made channel-relative and signals renamed
    by first use: equal for two channels that run the same template."""
    shift = channel * schedule.options.slices
    names: dict[Signal, tuple[int, int]] = {}

    def sig(s: Signal | None):
        if s is None:
            return None
        if s not in names:
            names[s] = (s.owner, len(names))
        return names[s]

    def reg(r: Region):
        return (r.space.value, r.rank, r.unit, r.slice - shift)

    out = []
    for step in schedule.program(rank, channel).steps:
        if isinstance(step, Stage):
            out.append(("stage", reg(step.src), reg(step.dst), sig(step.signal), step.k))
        elif isinstance(step, (Notify, Wait)):
            out.append((type(step).__name__, sig(step.signal), step.k))
        elif isinstance(step, Epilogue):  # it has no operation: read as a consume, every fused spec failed
            out.append(("epilogue", reg(step.region)))
        else:
            out.append(("consume", step.operation.value, tuple(reg(s) for s in step.srcs), reg(step.dst)))
    return tuple(out)


def channels_identical(schedule: Schedule) -> bool:
    """Every channel of every rank equals channel 0 up to the slice shift and signal names."""
    if schedule.channels == 1:
        return True
    for rank in range(schedule.world_size):
        first = _canonical(schedule, rank, 0)
        if any(_canonical(schedule, rank, c) != first for c in range(1, schedule.channels)):
            return False
    return True


# ---- the drawing ------------------------------------------------------------------------

def _chunk_lines(schedule: Schedule, channels: range, pattern: re.Pattern) -> dict[str, int]:
    """chunk name -> the .pln line of its output (from the consumes that write it)."""
    lines: dict[str, int] = {}
    for rank in range(schedule.world_size):
        for channel in channels:
            for step in schedule.program(rank, channel).steps:
                if isinstance(step, Consume) and step.line is not None:
                    for chunk in chunks_of(step.note, pattern):
                        lines.setdefault(chunk, step.line)
    return lines


def _chunk_order(name: str) -> tuple:
    """x[10] after x[9]: compare indices as numbers."""
    base = name.split("[", 1)[0]
    idx = tuple(int(i) if i.lstrip("-").isdigit() else 0 for i in re.findall(r"\[([^\]]+)\]", name))
    return (base, idx, name)


# Steps a drawing reads: every channel's (to tell identical ones), each at ~15 us, and each lane
# drawn a box (~500 bytes of SVG).  A quarter million is ~4 s and, drawn whole, ~100 MB; a few
# million (R=8 with --channels 64 --slices 256) take minutes and gigabytes, for no picture anyone
# could read.
MAX_DRAWN_STEPS = 1 << 18


def refuse_large(schedule: Schedule) -> None:
    """Refuse, before any work, a schedule whose programs hold more steps than a drawing takes."""
    per_channel = sum(len(schedule.program(rank, 0).steps) for rank in range(schedule.world_size))
    steps = per_channel * schedule.channels
    if steps > MAX_DRAWN_STEPS:
        from purlinc.errors import PurlinError

        raise PurlinError(
            f"{schedule.collective} at R={schedule.world_size} has {steps:,} steps ({per_channel:,} per channel x "
            f"{schedule.channels} channel{'s' if schedule.channels != 1 else ''}), more than a drawing takes "
            f"({MAX_DRAWN_STEPS:,})",
            notes=("draw fewer ranks, channels or slices; purlinc dump --stage snac prints a schedule of any size",),
        )


def _subtitle_extras(schedule: Schedule) -> str:
    """The rest of what makes this schedule the one drawn, each only where it applies: slots,
    registered buffers, run-time sizes and an epilogue.  Without them a drawing of ring
    ``--registered both`` (other steps) and one of alltoallv (packed buffers, size headers)
    read exactly like the plain schedule's."""
    o = schedule.options
    extras = ""
    if o.slots is not None:
        extras += f", {o.slots} staging slot{'s' if o.slots != 1 else ''} per edge"
    if o.registered:
        extras += f", registered {'+'.join(sorted(o.registered))}"
    if schedule.sizes is not None:
        extras += f", run-time {schedule.sizes.format()}"
    if schedule.epilogue is not None:
        extras += f", epilogue rows({schedule.epilogue.row})"
    return extras


def params_text(params) -> str:
    """The spec's bound parameters as the line under a heading names them (``root=5``): the
    schedule of broadcast at root 5 is another than at root 0, and nothing else says which."""
    return ", ".join(f"{name}={value}" for name, value in params)


def build(schedule: Schedule, *, collapse: bool = True, channels: tuple[int, ...] | None = None,
          title: str | None = None, bare_chunks: frozenset[str] = frozenset(), params=()) -> Drawing:
    """The drawing of ``schedule``.  ``collapse``: draw channel 0 alone when every channel is
    identical up to the slice shift; ``channels``: draw exactly these channels instead.
    ``bare_chunks``: the spec's chunk names that carry no index (``render.bare_chunks``),
    so that steps moving them get their colour and label too.  ``params``: the spec's bound
    parameters (``Spec.params``), named in the subtitle."""
    world, nchan = schedule.world_size, schedule.channels
    refuse_large(schedule)
    identical = channels_identical(schedule)
    if channels is not None:
        bad = [c for c in channels if not 0 <= c < nchan]
        if bad:
            from purlinc.errors import PurlinError

            raise PurlinError(f"channel {bad[0]} does not exist: the schedule has channels 0..{nchan - 1}")
        drawn = tuple(channels)
        collapsed = False
    elif collapse and identical:
        drawn, collapsed = (0,), nchan > 1
    else:
        drawn, collapsed = tuple(range(nchan)), False
    pattern = chunk_pattern(bare_chunks)
    lines = _chunk_lines(schedule, range(nchan) if not collapsed else range(1), pattern)
    lanes = []
    all_chunks: set[str] = set()
    acks = frozenset(d.signal for d in schedule.signal_decls() if d.role is Role.ACK)
    for rank in range(world):
        for channel in drawn:
            program = schedule.program(rank, channel)
            boxes = tuple(_box(rank, channel, i, step, lines, pattern, slices=schedule.options.slices > 1, acks=acks)
                          for i, step in enumerate(program.steps))
            for box in boxes:
                all_chunks.update(box.chunks)
            if collapsed:
                label = f"rank {rank}  (x{nchan} channels)"
            elif nchan > 1:
                label = f"rank {rank} ch {channel}"
            else:
                label = f"rank {rank}"
            lanes.append(Lane(rank, channel, label, boxes))
    pairs, unmatched = match_pairs(lanes)
    o = schedule.options
    bound = f"{params_text(params)}, " if params else ""
    subtitle = (f"R={world}, {bound}{schedule.operation.value}, {o.algorithm.value}, channels {nchan}, "
                f"slices {o.slices} per channel" + (", packed (LL)" if o.packed else "")
                # a schedule that stages nothing (R=1) has no copies to alternate
                + (", 2 staging copies by call parity" if schedule.stage_copies == 2 and schedule.stage_units else "")
                + _subtitle_extras(schedule))
    notes = []
    if collapsed:
        notes.append(f"channels 0..{nchan - 1} identical up to slice offset: channel 0 drawn for all {nchan}")
    if unmatched:
        notes.append(f"{unmatched} wait(s) released by a notify outside the drawn lanes (no arrow)")
    return Drawing(
        title=title or f"{schedule.collective}", subtitle=subtitle, world_size=world, channels=nchan,
        collapsed=collapsed, lanes=tuple(lanes), pairs=pairs, chunks=tuple(sorted(all_chunks, key=_chunk_order)),
        notes=tuple(notes),
    )


def match_pairs(lanes) -> tuple[tuple[Pair, ...], int]:
    """Every (notify, wait) pair of one call among ``lanes``; and the number of waits (k >= 1)
    whose notify is not among them."""
    raisers: dict[tuple[Signal, int], tuple[int, int, int]] = {}
    for lane in lanes:
        for box in lane.steps:
            if box.signal is not None and box.verb in ("notify", "stage+notify"):
                raisers[(box.signal, box.k)] = box.key
    pairs, unmatched = [], 0
    for lane in lanes:
        for box in lane.steps:
            if box.verb != "wait" or box.previous_call:
                continue
            source = raisers.get((box.signal, box.k))
            if source is None:
                unmatched += 1
                continue
            pairs.append(Pair(source, box.key, box.signal, box.k))
    return tuple(pairs), unmatched
