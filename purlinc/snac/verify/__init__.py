"""The SNAC verifier: proves, for a schedule as written, that it is correct for every count.

``verify(schedule, spec)`` returns nothing or raises ``VerificationError`` naming the first
violation (in a fixed order: well-formedness, deadlock, signal monotonicity, races, result).

How the proof works
-------------------
0. *Channels*.  Programs are channel-relative (``purlinc.snac.ir``): one per rank, its
   slices in ``[0, S)`` and its signal indices in ``[0, W)``; channel ``c`` runs it shifted
   by ``c * S`` and ``c * W``.  Checking exactly that (every relative slice < S, every
   signal index < W, declarations included) proves that channels touch disjoint slices of
   every buffer (staging included) and disjoint signal words: they share no region and no
   signal, so each is a copy of channel 0 that cannot see the others.  The only thing they
   share is the call boundary (a rank's next call starts when all its channels finished),
   which orders call-0 steps before call-1 steps and adds no wait within a call: so a
   deadlock, a race or a wrong result in the C-channel schedule would be one in channel 0
   alone.  Steps 1-4 prove channel 0 (the schedule viewed with one channel); the simulator
   still runs every channel concretely.
1. *Well-formedness*, step by step: regions in bounds and in the channel's slices, remote
   ``IN``/``OUT`` only when registered, nothing writes an ``IN`` buffer, a step never moves
   one slice into another, waits only on the waiting rank's own signals, every signal
   declared and notified exactly ``per_call`` times per call with ``k`` = 1..per_call.
2. *Happens-before* over two back-to-back calls.  Nodes are the steps of call 0 and call 1
   of every program, plus one *caller* node per rank standing between its calls: the
   caller's next use of the buffers (it reads its output and may overwrite its input and
   output) and the next launch, which starts only after every channel of that rank finished
   the call.  Edges: program order; caller edges; and for ``Wait(s, k)`` in call ``e`` an
   edge from the notify that stores ``e * per_call + k`` (none when that is <= 0: the pad
   starts at zero).  The graph is built by running it (Kahn's algorithm, programs advanced in
   a fixed round-robin order), which yields a topological order and vector clocks (one entry
   per program and caller), so "a happens before b" is one array lookup.  A program left
   blocked means a cycle, reported with its ranks and steps.  Later calls repeat call 1's
   pattern (waits reach back at most one call, which step 1 enforces), so two calls cover
   every call.
   A notify *stores* its value, so a wait for value v is satisfied exactly by the notify of
   value v only if the signal's notifies are totally ordered by happens-before in increasing
   value (within a call and across the call boundary); otherwise the value could go
   backwards and a waiter miss it.  That is checked too.
   With two staging copies (``Schedule.stage_copies``; call ``e`` stages in copy ``e % 2``)
   a copy is reused two calls later and a producer's ACK wait reaches back two calls: the
   proof then runs on ``purlinc.snac.parity.unrolled``, whose call is two original calls
   (the odd one in the second copy), so its two calls cover four and every reuse.
3. *Races*: per region (one slice of one unit), accesses sorted in the topological order;
   each access must be ordered after the previous write, and each write after the reads
   since the previous write.  That makes every conflicting pair ordered (by transitivity),
   which covers "a staging slot overwritten before it is consumed", across calls and against
   the callers.
4. *Result*: symbolic execution of call 0 in the topological order.  Because every
   conflicting pair of accesses is ordered (3), every topological order gives every read
   the same write, so one order suffices.  A region holds a multiset of input slots (a copy
   is a multiset of one) or garbage; every output slice must hold exactly what the spec names.
   Steps 3 and 4 share one walk of the topological order (each region's accesses come up in
   that order, so no per-region sort is needed); a result error is reported only when no
   race was found, keeping the order of checks above.
   Each region also carries the order its value was formed in (``races.Orders``: a slot, or
   a Consume's sources in their listed order, each rounded where it is stored).
5. *Agreement* (reductions): every holder of a reduced chunk (each rank's output naming it,
   each slice) formed it in the same order, so they agree bit for bit: the multiset check of
   4 cannot tell (a + b) + c from a + (b + c), and a replicated all-reduce's ranks must not
   differ (a tensor-parallel model's ranks go on from the same values).

A schedule with run-time sizes (``Schedule.sizes``) adds its interval obligations
(``purlinc.snac.sized.verify_sized``) after step 1, and in step 3 a Consume also reads the size
headers of the staging slots that its output's offset sums (``sized.header_reads``): a slot
released before such a read could be restaged, its header rewritten, first.
"""

from __future__ import annotations

from dataclasses import replace

from purlinc.errors import PurlinError
from purlinc.frontend.spec import Spec
from purlinc.snac.epilogue import epilogue_problem
from purlinc.snac.gcpause import gc_paused
from purlinc.snac.ir import HIERARCHICAL_NOTE, Schedule, Stage
from purlinc.snac.packing import layout_problems, ll_groups, normalized, packed_stages
from purlinc.snac.parity import unrolled, unrolled_reads
from purlinc.snac.verify.common import CALLS, Failure, VerificationError, describe
from purlinc.snac.verify.order import Order, check_monotone
from purlinc.snac.verify.races import check_races_and_result
from purlinc.snac.verify.wellformed import (
    check_shape, check_signal_counts, check_signals_declared, check_step_types, check_steps,
)


__all__ = ["CALLS", "VerificationError", "describe", "verify"]


def _check_packing(schedule: Schedule) -> None:
    """Packed stages fit the staging layout, and their packets are read as the datapath
    reads them: by the consumes right after the waits that guard exactly them."""
    fail = Failure(schedule)
    problems = layout_problems(schedule)
    if problems:
        rank, channel, index, message = problems[0]
        raise fail.at(rank, channel, index, message)
    packed = packed_stages(schedule)
    if not packed:
        return
    for program in schedule.programs:
        _, found = ll_groups(program, packed)
        if found:
            index, message = min(found)
            raise fail.at(program.rank, program.channel, index, message)


def _one_channel(schedule: Schedule) -> Schedule:
    """The schedule as if it had one channel: what steps 1-4 prove (see the docstring)."""
    if schedule.channels == 1:
        return schedule
    options = replace(schedule.options, channels=1)
    return replace(schedule, options=options, slices=options.slices)


def verify(schedule: Schedule, spec: Spec) -> None:
    """Prove ``schedule`` computes ``spec`` for every count and interleaving, or raise
    ``VerificationError`` naming the first violation."""
    if not isinstance(schedule, Schedule) or not isinstance(spec, Spec):  # swapped, or None: an AttributeError inside
        raise PurlinError(f"verify(schedule, spec) takes a Schedule and a Spec, got {type(schedule).__name__} and "
                          f"{type(spec).__name__}")
    with gc_paused():  # millions of acyclic nodes: see purlinc.snac.gcpause
        _verify(schedule, spec)


def _verify(schedule: Schedule, spec: Spec) -> None:
    check_step_types(schedule, Failure(schedule))
    _check_proof_size(schedule)
    check_shape(schedule, spec)
    problem = epilogue_problem(schedule, spec)
    if problem is not None:
        rank, index, message = problem
        if index is None:
            raise VerificationError(f"rank {rank}: {message}", rank=rank)
        raise Failure(schedule).at(rank, 0, index, message)
    check_signals_declared(schedule)
    written = schedule
    schedule = _one_channel(schedule)
    check_steps(schedule, Failure(schedule))
    if spec.sizes is not None or schedule.sizes is not None:
        # The interval obligations (docs/SNAC.md, "Run-time sizes") need well-formed steps
        # only, and name an offset read before its wait as such, where the race check below
        # (which counts size-header reads too) would name a read of the slot
        from purlinc.snac.sized import verify_sized

        verify_sized(written, spec)
    _check_packing(schedule)
    # A packed stage means its Stage followed by its Notify: the proof runs on that schedule.
    schedule, origins = normalized(schedule)
    # Two staging copies: the proof runs on two calls per call, so that each copy's reuse is
    # inside the unrolled calls (purlinc.snac.parity); errors still name the steps as written.
    fail = Failure(schedule, origins, schedule.stage_copies)
    extra = _header_reads(schedule)
    if extra is not None:
        extra = unrolled_reads(schedule, extra)
    schedule = unrolled(schedule)
    check_signal_counts(schedule, fail)
    order = Order(schedule, fail)
    check_monotone(schedule, order)
    check_races_and_result(schedule, spec, order, extra)


# Vector-clock entries the proof may hold: one per node (every step of two calls) and chain
# (every program and caller).  The lowering's read cap bounds its own cost, not this: an
# all-gather's schedule grows as R^2 steps over R programs, so its proof as R^3 (R=300: 0.65
# billion entries, 6 s and 1.5 GB; R=600: 5.2 billion, 140 s and 16 GB).  2^30 admits every
# schedule under the read cap measured (all-reduce R=101: 0.44 billion) and all-gathers to R=322
# (direct-push, two staging copies: each call proved as two) or R=355 (one copy, ring).
MAX_CLOCK_ENTRIES = 1 << 30


def _check_proof_size(schedule: Schedule) -> None:
    """Refuse a schedule whose proof would take minutes and gigabytes, before any of it: the
    steps as the proof runs them (a packed Stage is a Stage and a Notify there, and two
    staging copies make each call two: ``normalized``, ``unrolled``)."""
    written = sum(len(p.steps) for p in schedule.programs)
    packed = sum(1 for p in schedule.programs for step in p.steps if isinstance(step, Stage) and step.packed)
    check_proof_steps(schedule.collective, schedule.world_size, (written + packed) * schedule.stage_copies,
                      len(schedule.programs))


def check_proof_steps(collective: str, world_size: int, steps: int, programs: int, *, partial: bool = False) -> None:
    """Refuse ``steps`` (as the proof runs them) over ``programs`` past MAX_CLOCK_ENTRIES.
    ``partial``: ``steps`` is a lower bound, what a lowering still emitting has so far (ring's
    wavefronts) or will write at least (ring's hops, counted before they are routed), so a
    schedule bound to be refused stops there instead of first taking gigabytes to build."""
    entries = CALLS * steps * (programs + world_size)
    if entries > MAX_CLOCK_ENTRIES:
        lowers = "lowers to at least" if partial else "lowers to"
        raise PurlinError(
            f"{collective} for R={world_size} {lowers} {steps:,} steps over {programs} programs: its proof would "
            f"hold {'at least ' if partial else ''}{entries:,} clock entries, more than one verification holds "
            f"({MAX_CLOCK_ENTRIES:,})",
            notes=(HIERARCHICAL_NOTE,))


def _header_reads(schedule: Schedule):
    """A sized schedule's size-header reads per program and step (``sized.header_reads``),
    for the race check; None for other schedules."""
    if schedule.sizes is None:
        return None
    from purlinc.snac.sized import header_reads

    return [header_reads(program) for program in schedule.programs]
