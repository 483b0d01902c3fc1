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
Ring reductions add in ring order and round at each hop: close to the spec's evaluator but
not bitwise equal to it (direct-push, direct-pull and two-shot are bitwise equal).

Channels: the lowering builds one *template* channel over local slices ``0..S-1`` and
symbolic signals, then instantiates it per channel by shifting slices by ``c * S`` and
signal indices by ``c * (signals per channel of that rank)``: channels are independent.
"""

from __future__ import annotations

from purlinc.errors import PurlinError
from purlinc.frontend.spec import Spec
from purlinc.snac.direct import _direct_pull, _direct_push
from purlinc.snac.epilogue import place_epilogues
from purlinc.snac.gcpause import gc_paused
from purlinc.snac.ir import Algorithm, LowerOptions, Schedule
from purlinc.snac.needs import _needs
from purlinc.snac.ring import _ring
from purlinc.snac.two_shot import _two_shot


_LOWERINGS = {
    Algorithm.DIRECT_PUSH: _direct_push,
    Algorithm.DIRECT_PULL: _direct_pull,
    Algorithm.TWO_SHOT: _two_shot,
    Algorithm.RING: _ring,
}


def _check_options(spec: Spec, options: LowerOptions) -> None:
    if options.channels < 1 or options.slices < 1:
        raise PurlinError(f"channels and slices must be >= 1 (got channels={options.channels}, slices={options.slices})")
    if options.slots is not None and options.slots < 1:
        raise PurlinError(f"slots must be >= 1 (got {options.slots})")
    if options.packed and options.algorithm is not Algorithm.DIRECT_PUSH:
        raise PurlinError(
            f"packed (LL) stages are supported for direct-push only, not {options.algorithm.value}",
            notes=("LL packing is for small messages, where one-shot direct-push is the algorithm to use",),
        )
    unknown = set(options.registered) - {"in", "out"}
    if unknown:
        raise PurlinError(f"registered buffers must be 'in' and/or 'out', got {sorted(unknown)}")


def lower(spec: Spec, options: LowerOptions) -> Schedule:
    """The SNAC schedule of ``spec`` under ``options``; PurlinError when the algorithm does not apply.

    ``stage_copies`` beyond what the algorithm lowers to is capped (a request for what the
    atom can address, not a demand), so the schedule's options say what it does."""
    from dataclasses import replace

    from purlinc.snac.algorithms import get_algorithm

    _check_options(spec, options)
    if spec.sizes is not None:  # run-time sizes: their own lowering, the same IR
        from purlinc.snac.sized import lower_sized

        try:
            with gc_paused():
                return lower_sized(spec, options)
        except PurlinError as error:
            raise error.with_note(f"while lowering {spec.name} for R={spec.world_size} with {options.key()}") from None
    most = get_algorithm(options.algorithm).stage_copies
    if options.stage_copies > most:
        options = replace(options, stage_copies=most)
    try:
        with gc_paused():
            return place_epilogues(_LOWERINGS[options.algorithm](spec, options), spec)
    except PurlinError as error:
        raise error.with_note(f"while lowering {spec.name} for R={spec.world_size} with {options.key()}") from None


def applicable_algorithms(spec: Spec) -> tuple[Algorithm, ...]:
    if spec.sizes is not None:
        return (Algorithm.DIRECT_PUSH,)
    algorithms = [Algorithm.DIRECT_PUSH, Algorithm.DIRECT_PULL]
    if spec.is_reduce and any(len(need.ranks) > 1 for need in _needs(spec)):
        algorithms.append(Algorithm.TWO_SHOT)
    algorithms.append(Algorithm.RING)
    return tuple(algorithms)


def default_options(spec: Spec) -> LowerOptions:
    """Small and medium messages: one-shot push, one channel, one slice (the runtime tunes later).
    Run-time sizes: direct-push with two staging copies (purlinc.snac.sized)."""
    if spec.sizes is not None:
        return LowerOptions(algorithm=Algorithm.DIRECT_PUSH, channels=1, slices=1, stage_copies=2)
    return LowerOptions(algorithm=Algorithm.DIRECT_PUSH, channels=1, slices=1)
