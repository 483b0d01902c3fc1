"""Run-time sizes in SNAC: the lowering of a collective with a ``sizes`` operand and the
proof obligations its schedules add (docs/SNAC.md, "Run-time sizes").

The schedule is an ordinary direct-push schedule through staging, in the ordinary IR; only
the measure of a Region changes (IN/OUT units packed by per-call sizes, a STAGE unit a slot
of a size header plus ``capacity`` elements).  The checks here are symbolic: a unit's size is
the name of the chunk it holds, never a number, so one proof covers every size vector.
"""

from __future__ import annotations

from dataclasses import replace

from purlinc.errors import PurlinError
from purlinc.frontend.ast import Operation
from purlinc.frontend.spec import Chunk, Spec
from purlinc.snac.ir import Algorithm, Consume, LowerOptions, Notify, Program, Region, Schedule, Space, Stage, Wait

def slot_layout(channels: int, capacity_bytes: int) -> tuple[int, int, int]:
    """(header bytes, region bytes, slot bytes) of a STAGE slot for chunks of up to
    ``capacity_bytes``: the size header, then one fixed region per channel.  Channel c moves
    bytes [c*t, c*t + t) of a chunk (t = round_up(ceil(b / G), 16), which depends on the
    chunk's size b) through region c, at the same offset whatever b is.  Placing them at
    their offset in the chunk instead would move channel c's bytes into what channel c'
    used in an earlier call of another size, while channel c' may still read that call
    (channels run calls apart; the simulator found it)."""
    region = -(-(-(-capacity_bytes // channels)) // 16) * 16
    head = header_bytes(channels)
    return head, region, head + channels * region


def header_bytes(channels: int) -> int:
    """Bytes before a STAGE slot's data: the chunk's size (int64) once per channel, padded so
    the data stays 16-byte aligned.  Channel c writes and reads word c only: channels run
    calls apart (channel 1 of a producer may stage call e + 2 while channel 0 of its consumer
    still reads call e), and a word's reuse is ordered only by its own channel's signals."""
    return -(-8 * channels // 16) * 16


# Why --stage-copies 1 is refused for run-time sizes (the command line and draw name the flag):
# their lowering always takes two copies, a size header and data per slot written while the
# consumer may still read the last call's.
ONE_COPY_REFUSED = ("does not apply to a collective with run-time sizes: its schedules always run two staging "
                    "copies")
ONE_COPY_NOTE = 'docs/SNAC.md, "Run-time sizes"'


def check_sized_options(options: LowerOptions) -> None:
    """Sized schedules are direct-push through staging, one slice per channel (any channels)."""
    problems = []
    if options.algorithm is not Algorithm.DIRECT_PUSH:
        problems.append(f"algorithm {options.algorithm.value} (only direct-push)")
    if options.registered:
        problems.append(f"registered {' and '.join(sorted(options.registered))} buffers (sizes travel through "
                        "staging)")
    if options.packed:
        problems.append("packed (LL) stages")
    if options.slices != 1:
        problems.append(f"{options.slices} slices per channel (one: a channel's share of a chunk depends on its size)")
    if options.slots is not None:
        problems.append("slots (one staging slot per message)")
    if problems:
        raise PurlinError("a collective with run-time sizes cannot be lowered with " + "; ".join(problems),
                          notes=("it lowers to direct-push through staging; choose the channels only",))


def lower_sized(spec: Spec, options: LowerOptions) -> Schedule:
    """The direct-push schedule of ``spec`` with two staging copies by call parity, and every
    Consume moved after the waits that make its output offset known (``_defer``)."""
    from purlinc.snac.direct import direct_push

    check_sized_options(options)
    options = replace(options, stage_copies=2)
    schedule = direct_push(spec, options)
    programs = tuple(_defer(_from_roots(program), spec) for program in schedule.programs)
    return replace(schedule, programs=programs, sizes=spec.sizes)


def _from_roots(program: Program) -> Program:
    """A chunk an output holds twice is copied the second time from the first OUT unit; with
    run-time sizes that unit's place in OUT is another size-dependent offset and its size
    symbol is not the source's, so copy from where the first copy read (own IN or a STAGE
    slot) instead.  Every STAGE slot is released (ACK) only after the program's last Consume,
    so the slot still holds the data; the verifier checks the result like any schedule."""
    origin: dict[Region, Region] = {}  # OUT region -> the IN or STAGE region it was copied from
    steps = []
    for step in program.steps:
        if isinstance(step, Consume) and step.dst.space is Space.OUT:
            src = step.srcs[0]
            while src.space is Space.OUT and src in origin:
                src = origin[src]
            origin[step.dst] = src
            if src != step.srcs[0]:
                step = replace(step, srcs=(src,))
        steps.append(step)
    return replace(program, steps=tuple(steps))


def _out_sources(program: Program) -> dict[int, Region]:
    """OUT unit -> the region its Consume copies from."""
    return {step.dst.unit: step.srcs[0] for step in program.steps if isinstance(step, Consume)}


def header_reads(program: Program) -> list[tuple[Region, ...]]:
    """Per step of ``program``: the STAGE regions whose size headers the step reads besides its
    sources.  A Consume into OUT unit m places it after the units before it, so it reads their
    sizes, from the headers of the slots they are copied from (``_incoming`` in sized.cu.j2).
    The race check counts these as reads of those slots: a slot released (ACK) before such a
    Consume could be restaged, its header rewritten, before the offset is read."""
    sources = _out_sources(program)
    reads = []
    for step in program.steps:
        if isinstance(step, Consume) and step.dst.space is Space.OUT:
            reads.append(tuple(dict.fromkeys(sources[b] for b in range(step.dst.unit)
                                             if b in sources and sources[b].space is Space.STAGE)))
        else:
            reads.append(())
    return reads


def _defer(program: Program, spec: Spec) -> Program:
    """Consumes whose offset needs a size not yet known at their place go after the last Wait
    of the program (the one after which every size is known).  Reading own IN and writing own
    OUT later is always allowed: nothing waits for a Consume except an ACK notify, and those
    follow every Consume already."""
    steps = list(program.steps)
    waits = [i for i, s in enumerate(steps) if isinstance(s, Wait)]
    if not waits:
        return program
    sources = _out_sources(program)
    early = [i for i, s in enumerate(steps)
             if isinstance(s, Consume) and i < waits[-1]
             and any(sources[m].space is Space.STAGE for m in range(s.dst.unit + 1))]
    if not early:
        return program
    moved = [steps[i] for i in early]
    kept = [s for i, s in enumerate(steps) if i not in set(early)]
    last_wait = max(i for i, s in enumerate(kept) if isinstance(s, Wait))
    return replace(program, steps=tuple(kept[: last_wait + 1] + moved + kept[last_wait + 1:]))


# ---- proof obligations -------------------------------------------------------------------

def _fail(schedule: Schedule, rank: int, index: int | None, message: str) -> PurlinError:
    from purlinc.snac.verify.common import VerificationError

    where = f"rank {rank}" + (f", step {index}" if index is not None else "")
    return VerificationError(f"sized schedule {schedule.collective} (R={schedule.world_size}), {where}: {message}")


def verify_sized(schedule: Schedule, spec: Spec) -> None:
    """The obligations of docs/SNAC.md, "Run-time sizes", points 1-4, on well-formed steps
    (the verifier calls it after its step 1; ordering, races -- size-header reads included --
    and values at unit level it proves after)."""
    if schedule.sizes != spec.sizes:
        raise _fail(schedule, 0, None, f"its sizes ({schedule.sizes}) are not the spec's ({spec.sizes})")
    options = schedule.options
    try:
        check_sized_options(options)
    except PurlinError as error:
        raise _fail(schedule, 0, None, error.message) from None
    symbol_of = _stage_symbols(schedule, spec)
    for program in schedule.programs:
        _check_program(schedule, spec, program, symbol_of)


def _stage_symbols(schedule: Schedule, spec: Spec) -> dict[tuple[int, int], Chunk]:
    """(rank, STAGE unit) -> the chunk (size symbol) the one Stage writing it puts there."""
    symbols: dict[tuple[int, int], Chunk] = {}
    for program in schedule.programs:
        for index, step in enumerate(program.steps):
            if isinstance(step, Consume) and any(r.space is Space.STAGE and r.rank != program.rank for r in step.srcs):
                raise _fail(schedule, program.rank, index, "reads a peer's staging buffer (sizes need push)")
            if not isinstance(step, Stage):
                continue
            if step.src.space is not Space.IN or step.src.rank != program.rank or step.dst.space is not Space.STAGE:
                raise _fail(schedule, program.rank, index,
                            f"stages {step.src.format()} -> {step.dst.format()}: a sized Stage moves own IN to a STAGE slot")
            key = (step.dst.rank, step.dst.unit)
            chunk = spec.inputs[program.rank][step.src.unit]
            if symbols.setdefault(key, chunk) != chunk:
                raise _fail(schedule, program.rank, index,
                            f"STAGE unit {step.dst.unit} of rank {step.dst.rank} holds {symbols[key]} and {chunk}: "
                            "its size header would be ambiguous")
    return symbols


def _check_program(schedule: Schedule, spec: Spec, program: Program, symbol_of) -> None:
    """Points 1 and 3 for one rank: every OUT unit written once, by a copy whose size symbol
    is the output chunk's; every size a Consume's offset needs is known at that step."""
    rank = program.rank
    visible = _visibility(schedule, program)
    written: set[int] = set()
    sources = _out_sources(program)
    for index, step in enumerate(program.steps):
        if not isinstance(step, Consume):
            continue
        if step.operation is not Operation.COPY or step.dst.space is not Space.OUT:
            raise _fail(schedule, rank, index, "a sized Consume copies into OUT")
        m, src = step.dst.unit, step.srcs[0]
        if m in written:
            raise _fail(schedule, rank, index, f"writes OUT unit {m} twice: its packed interval would move")
        written.add(m)
        symbol = spec.inputs[rank][src.unit] if src.space is Space.IN else symbol_of.get((rank, src.unit))
        if symbol != spec.outputs[rank][m]:
            raise _fail(schedule, rank, index, f"copies size {symbol} into OUT unit {m}, which holds "
                                               f"{spec.outputs[rank][m]}")
        for before in range(m + 1):
            region = sources.get(before)
            if region is None:
                raise _fail(schedule, rank, index, f"OUT unit {before} is never written: the offset of unit {m} "
                                                   "sums its size")
            if region.space is Space.STAGE and region.unit not in visible[index]:
                raise _fail(schedule, rank, index,
                            f"needs the size of OUT unit {before} (in STAGE unit {region.unit}) for the offset of "
                            f"OUT unit {m}, but no Wait before this step covers the Stage that writes it")
    if written != set(range(schedule.out_units[rank])):
        raise _fail(schedule, rank, None, f"OUT units {sorted(set(range(schedule.out_units[rank])) - written)} "
                                          "are never written")


def _visibility(schedule: Schedule, program: Program) -> list[frozenset[int]]:
    """Per step of ``program``: the own STAGE units whose size header is visible before it,
    i.e. written by a Stage that precedes, in its producer's program, a Notify this program
    has waited for (k at most the wait's k) by then.  Two staging copies by call parity
    keep an earlier call's header out of the picture: waits of this call name this call's k."""
    rank = program.rank
    covered: dict[tuple, set[int]] = {}  # (signal, k) -> STAGE units of this rank staged before it
    for producer in schedule.programs:
        staged: set[int] = set()
        for step in producer.steps:
            if isinstance(step, Stage) and step.dst.rank == rank:
                staged.add(step.dst.unit)
            elif isinstance(step, Notify) and step.signal.owner == rank:
                covered[step.signal, step.k] = set(staged)
    seen: set[int] = set()
    result = []
    for step in program.steps:
        result.append(frozenset(seen))
        if isinstance(step, Wait) and step.k > 0:
            for (signal, k), units in covered.items():
                if signal == step.signal and k <= step.k:
                    seen |= units
    return result
