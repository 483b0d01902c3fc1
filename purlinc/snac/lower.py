"""Lowering: a resolved ``Spec`` plus ``LowerOptions`` -> a SNAC ``Schedule``.

Every algorithm is generic over the spec: it looks only at which input slots each output
chunk is made from, never at the collective's name.

How the pieces fit
------------------
A *message* is one chunk (all its slices) moved from one rank to another.  Messages are
grouped by *edge* ``(producer, consumer)``.  Each edge gets at most two signals per channel:

- ``DATA``: owned by the consumer, notified only by the producer ("staged, go ahead");
- ``ACK``:  owned by the producer, notified only by the consumer ("done with it": the
  staging unit may be rewritten; or "ready": my registered OUT may be written this call).

Each signal has exactly one notifier, and that notifier raises it in program order, so its
value only grows; ``per_call`` is the number of notifies the builder emitted for it.  A
notify's ``k`` is its 1-based position in that sequence.  A wait for something done in the
previous call uses ``k - per_call`` (<= 0).  Waits name the notify they need (by a key), and
are resolved once every program is built, so the two sides never have to agree on counts by
convention.

``options.packed`` (direct-push only): every staged message slice carries its data notify
in its packets (a packed ``Stage`` with its own ``k``), occupying two STAGE units; the
consumer's wait for a slice names the last k of that slice, and the consumes after it
read the packets (``purlinc.snac.packing``).

``options.slots`` shapes the ring only (the one algorithm that forwards through staging);
direct-push, direct-pull and two-shot give every message its own unit, reused across calls.
Ring reductions add in ring order and round at each hop: not bitwise equal to the spec's
evaluator, usually in the last bits, but a rounded partial can overflow or cancel where the
evaluator's float32 sum does not (docs/LANGUAGE.md, "Operations"); direct-push, direct-pull
and two-shot are bitwise equal.

Channels: the lowering builds one *template* channel over local slices ``0..S-1`` and
symbolic signals, then instantiates it per channel by shifting slices by ``c * S`` and
signal indices by ``c * (signals per channel of that rank)``: channels are independent.
"""

from __future__ import annotations

import operator
from dataclasses import replace

from purlinc.errors import PurlinError
from purlinc.frontend.spec import Spec
from purlinc.snac.algorithms import ALGORITHMS, DEFAULT_ALGORITHM, applicable, get_algorithm
from purlinc.snac.epilogue import place_epilogues
from purlinc.snac.gcpause import gc_paused
from purlinc.snac.ir import HIERARCHICAL_NOTE, Algorithm, LowerOptions, Schedule
from purlinc.snac.packing import MAX_PACKED_SOURCES


# Bounds on what a schedule may ask for, so that a mistyped option is an error, not minutes of
# lowering: a channel is a resident 512-thread block per rank (no GPU holds 1,024 of them
# with their peers'), and a program grows with slices per channel (the template channel
# holds every slice's steps; the measured tuning table never uses more than 4).
MAX_CHANNELS = 1024
MAX_SLICES = 256
# Chunk reads (every output chunk's sources, over every rank, times slices per channel) a
# schedule may hold: its steps grow with them (direct-push all-reduce: R^2 stages), and
# lowering costs about 2 KB and 20-50 us of CPU per step in Python.  2^20 keeps a lowering
# under about a minute and a gigabyte (measured: all-reduce R=64, 262k reads, 6.7 s and 544 MB;
# R=128, 2.1M reads, 60 s and 4.1 GB; R=300 ran out of memory).
MAX_READS = 1 << 20


def check_integer(name: str, value) -> None:
    """True and 2.0 lowered and verified, then keyed the cache as "cTrue" / "c2.0" and failed
    in the simulator: counts are ints (a NumPy integer too, as world sizes and params take)."""
    if not isinstance(value, bool):
        try:
            operator.index(value)
            return
        except TypeError:
            pass
    raise PurlinError(f"{name} must be an integer, got {value!r}")


def check_option_types(options: LowerOptions) -> None:
    """Each field of ``options`` of its type, before anything keys on them: a list of registered
    buffers keyed as the frozenset did (one memo entry for a refused and an accepted value), and
    packed="no" is truthy (an LL schedule)."""
    if not isinstance(options.algorithm, Algorithm):  # its key (and every note naming it) needs one
        raise PurlinError(f"algorithm must be an Algorithm (purlinc.snac.ir), got {options.algorithm!r}",
                          notes=("the pipeline's resolve_options also takes names: algorithm='ring'",))
    registered = options.registered
    if isinstance(registered, str) or not isinstance(registered, (set, frozenset)):
        raise PurlinError(f"registered must be a set of 'in' and/or 'out', got {registered!r}")
    unknown = set(registered) - {"in", "out"}
    if unknown:
        raise PurlinError(f"registered buffers must be 'in' and/or 'out', got {sorted(unknown)}")
    if not isinstance(options.packed, bool):
        raise PurlinError(f"packed must be True or False, got {options.packed!r}")
    if options.slots is not None:
        check_integer("slots", options.slots)
    check_counts(options.channels, options.slices)


def check_counts(channels, slices) -> None:
    """Channels and slices per channel: integers in 1..MAX_CHANNELS and 1..MAX_SLICES (None:
    not given, for a load's pins checked before any spec is read)."""
    given = [(name, value) for name, value in (("channels", channels), ("slices", slices)) if value is not None]
    for name, value in given:
        check_integer(name, value)
    got = ", ".join(f"{name}={value}" for name, value in given)
    if any(value < 1 for _, value in given):
        raise PurlinError(f"channels and slices must be >= 1 (got {got})")
    if (channels or 0) > MAX_CHANNELS or (slices or 0) > MAX_SLICES:
        raise PurlinError(f"channels must be at most {MAX_CHANNELS} and slices per channel at most {MAX_SLICES} "
                          f"(got {got})",
                          notes=("a channel is a thread block per rank that stays resident for the whole call",))


def _check_options(spec: Spec, options: LowerOptions) -> None:
    check_option_types(options)
    reads = spec.reads * options.slices
    if reads > MAX_READS:
        raise PurlinError(f"{spec.name} for R={spec.world_size} reads {reads:,} chunks across its ranks' outputs "
                          f"(x {options.slices} slice(s) per channel), more than one schedule holds ({MAX_READS:,})",
                          notes=_too_many_reads_notes(spec.reads, options.slices))
    if options.slots is not None and options.slots < 1:
        raise PurlinError(f"slots must be >= 1 (got {options.slots})")
    check_packed(options)
    if options.packed and spec.is_reduce and spec.most_sources > MAX_PACKED_SOURCES:
        raise PurlinError(f"packed (LL) stages combine at most {MAX_PACKED_SOURCES} sources per output chunk; "
                          f"{spec.name} for R={spec.world_size} reduces {spec.most_sources}",
                          notes=(_unpacked_note(spec),))


def _too_many_reads_notes(reads: int, slices: int) -> tuple[str, ...]:
    """What would bring a schedule of ``reads`` chunk reads per slice under MAX_READS: a
    hierarchical plan always; fewer slices only where some count fits (at one slice, or with
    more reads than fit even then, "fewer slices" named an option that cannot help)."""
    fitting = MAX_READS // reads
    if 1 <= fitting < slices:
        return (HIERARCHICAL_NOTE, f"or with at most {fitting} slice(s) per channel")
    return (HIERARCHICAL_NOTE,)


def _unpacked_note(spec: Spec) -> str:
    """The plain algorithms that reduce ``spec``'s many sources: two-shot only where it applies
    (a reduction to one rank, such as a rooted reduce, has no chunk for it to gather)."""
    plain = " (or two-shot)" if Algorithm.TWO_SHOT in applicable(spec) else ""
    return f"drop packed: plain direct-push{plain} reduces any number of sources"


def check_packed(options: LowerOptions) -> None:
    """Packed (LL) stages asked of an algorithm that has none (a hierarchical plan checks it
    too: its phases fall back to direct-push where the algorithm does not apply)."""
    if options.packed and not get_algorithm(options.algorithm).packed:
        packing = " or ".join(r.name for r in ALGORITHMS.records() if r.packed)
        raise PurlinError(
            f"packed (LL) stages are supported for {packing} only, not {options.algorithm.value}",
            notes=(f"LL packing is for small messages, where one-shot {packing} is the algorithm to use",),
        )


def _least_proof_steps(spec: Spec, options: LowerOptions) -> int:
    """The fewest steps any schedule of ``spec`` under ``options`` puts before the verifier:
    every slice of every output is written by a step of its own (a Stage or a Consume names
    one destination), and the proof runs each call as two where staging has two copies
    (packed stages and run-time sizes always have two; ``verify._check_proof_size``)."""
    record = get_algorithm(options.algorithm)
    two = spec.sizes is not None or options.packed or min(options.stage_copies, record.stage_copies) == 2
    return sum(len(layout) for layout in spec.outputs) * options.slices * (2 if two else 1)


def _check_least_proof(spec: Spec, options: LowerOptions) -> None:
    """Refuse, before lowering, a schedule whose proof is bound to exceed the verifier's bound:
    an all-gather on direct-push at R=700 took 14 s and 1.4 GB to lower before the verifier
    refused it (the ring counts its own hops first, and more exactly: ``ring._least_steps``)."""
    from purlinc.snac.verify import check_proof_steps

    check_proof_steps(spec.name, spec.world_size, _least_proof_steps(spec, options), spec.world_size, partial=True)


def lower(spec: Spec, options: LowerOptions) -> Schedule:
    """The SNAC schedule of ``spec`` under ``options``; PurlinError when the algorithm does not apply.
    The algorithm's record (``purlinc.snac.algorithms``) names its lowering function.

    ``stage_copies`` beyond what the algorithm lowers to is capped (a request for what the
    atom can address, not a demand), so the schedule's options say what it does."""
    _check_options(spec, options)
    _check_least_proof(spec, options)
    if spec.sizes is not None:  # run-time sizes: their own lowering, the same IR
        from purlinc.snac.sized import lower_sized

        try:
            with gc_paused():
                return lower_sized(spec, options)
        except PurlinError as error:
            raise error.with_note(f"while lowering {spec.name} for R={spec.world_size} with {options.key()}") from None
    record = get_algorithm(options.algorithm)
    if options.stage_copies > record.stage_copies:
        options = replace(options, stage_copies=record.stage_copies)
    try:
        with gc_paused():
            return place_epilogues(record.lower_function()(spec, options), spec)
    except PurlinError as error:
        raise error.with_note(f"while lowering {spec.name} for R={spec.world_size} with {options.key()}") from None


def applicable_algorithms(spec: Spec) -> tuple[Algorithm, ...]:
    """The algorithms that apply to ``spec``, in registry order (each record says when)."""
    return applicable(spec)


def default_options(spec: Spec) -> LowerOptions:
    """Small and medium messages: one-shot push, one channel, one slice (the runtime tunes later).
    Run-time sizes: direct-push with two staging copies (purlinc.snac.sized)."""
    if spec.sizes is not None:
        return LowerOptions(algorithm=DEFAULT_ALGORITHM, channels=1, slices=1, stage_copies=2)
    return LowerOptions(algorithm=DEFAULT_ALGORITHM, channels=1, slices=1)
