"""Lowering options: the one place they are assembled (``resolve_options``) from a spec's
defaults, a full ``LowerOptions`` and overrides, and the atom's defaults under all three."""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from dataclasses import fields, replace
from typing import TYPE_CHECKING

from purlinc.errors import PurlinError
from purlinc.pipeline.stages import whole_number

if TYPE_CHECKING:
    from purlinc.frontend.spec import Spec
    from purlinc.snac.ir import LowerOptions


def with_atom_defaults(changes: Mapping[str, object], atom: str | None = None) -> dict[str, object]:
    """``changes`` (LowerOptions overrides) plus what the atom decides where they say nothing:
    as many staging copies as it can address (kernels: 2; the copy engines: 1, see
    ``Atom.stage_copies``).  The one place compile, the runtime, dump, check and draw get it."""
    from purlinc.atom.atoms import DEFAULT_ATOM, lookup_atom

    return {"stage_copies": lookup_atom(atom or DEFAULT_ATOM).stage_copies, **changes}


def default_options(spec: Spec) -> LowerOptions:
    """The options a plain call uses when none are given (the runtime may tune per size)."""
    from purlinc.snac.lower import default_options as choose

    return choose(spec)


def normalize_overrides(overrides: Mapping[str, object] | None) -> dict[str, object]:
    """Overrides as LowerOptions values: ``None`` means "not given" and is dropped, algorithm
    names go through the algorithm registry, ``registered`` becomes a frozenset; an unknown
    field is a PurlinError naming the known ones."""
    from purlinc.snac.algorithms import get_algorithm
    from purlinc.snac.ir import LowerOptions

    known = [f.name for f in fields(LowerOptions)]
    changes = given_overrides(overrides)
    unknown = sorted(set(changes) - set(known))
    if unknown:
        raise PurlinError(f"unknown lowering option(s): {', '.join(unknown)}",
                          notes=(f"expected one of: {', '.join(known)}",))
    if "algorithm" in changes:
        changes["algorithm"] = get_algorithm(changes["algorithm"]).algorithm
    for name in ("channels", "slices", "slots", "stage_copies"):
        if name in changes:  # 2.7 or "2" would be truncated or parsed into another schedule
            changes[name] = whole_number(name, changes[name])
    if "packed" in changes:
        check_bool("packed", changes["packed"])
    if "registered" in changes:
        changes["registered"] = _registered(changes["registered"])
    return changes


def given_overrides(overrides: Mapping[str, object] | None) -> dict[str, object]:
    """The overrides that are set (``None`` means "not given"), their names checked to be
    strings: a str or a list would fail deep in dict() and a number key in sorting the key."""
    if overrides is None:
        return {}
    if not isinstance(overrides, Mapping):
        raise PurlinError(f"overrides must map lowering option names to values, e.g. {{'channels': 2}}; "
                          f"got {_shown(overrides)}")
    for name in overrides:
        if not isinstance(name, str):
            raise PurlinError(f"overrides must map lowering option names (strings) to values, e.g. "
                              f"{{'channels': 2}}; got the name {_shown(name)}")
    return {k: v for k, v in overrides.items() if v is not None}


def checked_options(options: LowerOptions | None) -> LowerOptions | None:
    """``options`` as a full LowerOptions, or None; an algorithm given by name is looked up in
    the registry (``LowerOptions(algorithm="ring")`` is built without complaint, but its key
    needs an Algorithm)."""
    if options is None:
        return None
    from purlinc.snac.ir import Algorithm, LowerOptions

    if not isinstance(options, LowerOptions):
        raise PurlinError(f"options must be a LowerOptions (purlinc.snac.ir), got {_shown(options)}",
                          notes=("to change a few fields of the default, pass overrides={'channels': 2}",))
    from purlinc.snac.lower import check_option_types

    if not isinstance(options.algorithm, Algorithm):
        from purlinc.snac.algorithms import get_algorithm

        try:
            algorithm = get_algorithm(options.algorithm).algorithm
        except PurlinError as error:  # "unknown algorithm 'rign'": say it came from options
            raise error.with_note(f"in options=LowerOptions(algorithm={options.algorithm!r}, ...)") from None
        options = replace(options, algorithm=algorithm)
    try:  # before the options key anything: the memo and the cache key them
        check_option_types(options)
    except PurlinError as error:
        raise error.with_note("in options=LowerOptions(...)") from None
    return options


def check_bool(name: str, value) -> bool:
    """``value``, refused unless it is True or False: bool("no") is True, so a string or a
    number would switch on what it meant to switch off."""
    if not isinstance(value, bool):
        raise PurlinError(f"{name} must be True or False, got {value!r}")
    return value


def _shown(value) -> str:
    """A value and its type, for a message (long values cut)."""
    return f"{reprlib.repr(value)} ({type(value).__name__})"


def _registered(value) -> frozenset:
    """Which caller buffers are peer-registered: a collection of "in" / "out" (a bare string
    would be read as its letters)."""
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
        raise PurlinError(f"registered must be a collection of 'in' and/or 'out', got {value!r}",
                          notes=('e.g. registered=("in", "out")',))
    return frozenset(value)


def resolve_options(spec: Spec, *, options: LowerOptions | None = None,
                    overrides: Mapping[str, object] | None = None) -> LowerOptions:
    """The LowerOptions a compile uses: ``options`` (default: chosen per spec) with
    ``overrides`` applied on top."""
    options = checked_options(options)
    base = options if options is not None else default_options(spec)
    changes = normalize_overrides(overrides)
    resolved = replace(base, **changes) if changes else base
    if resolved.slots is not None:  # from overrides, or from options= (it bypassed the check, and keyed
        # one schedule twice: slots2 and slotsall lowered to the same programs)
        check_slots(resolved.algorithm, resolved.slots, chosen=options is not None or "algorithm" in changes)
    return resolved


def check_stage_copies(algorithm, copies, sized: bool) -> None:
    """``stage_copies`` given explicitly where the lowering would lower fewer (an algorithm of
    one copy) or more (run-time sizes always take two): asked for by name, it is refused, as
    the command line's --stage-copies is.  ``algorithm``: None where the spec's default will
    decide (checked by the lowering's own cap only)."""
    if sized and copies == 1:
        from purlinc.snac.sized import ONE_COPY_NOTE, ONE_COPY_REFUSED

        raise PurlinError(f"stage_copies=1 {ONE_COPY_REFUSED}", notes=(ONE_COPY_NOTE,))
    if algorithm is None or isinstance(copies, bool) or not isinstance(copies, int):
        return  # a value that is not a count is LowerOptions' to refuse
    problem = stage_copies_problem(algorithm, copies)
    if problem is not None:
        raise PurlinError(f"stage_copies={copies} {problem}")


def stage_copies_problem(algorithm, copies: int) -> str | None:
    """Why ``copies`` staging copies do not apply to ``algorithm`` ("does not apply to ring: it
    lowers to 1 staging copy"), or None; each caller names the option its own way."""
    from purlinc.snac.algorithms import get_algorithm

    record = get_algorithm(algorithm)
    most = record.stage_copies
    if copies <= most:
        return None
    return f"does not apply to {record.name}: it lowers to {most} staging cop{'y' if most == 1 else 'ies'}"


def check_slots(algorithm, slots, *, chosen: bool) -> None:
    """``slots`` given for an algorithm that gives every message its own staging unit: the
    lowering would take the number into the schedule's key and ignore it, so it is refused."""
    from purlinc.snac.algorithms import get_algorithm, slotted_names

    if get_algorithm(algorithm).uses_slots:
        return
    default = "" if chosen else " (the spec's default algorithm)"
    raise PurlinError(f"slots={slots} does not apply to {get_algorithm(algorithm).name}{default}: it gives every "
                      "message its own staging unit",
                      notes=(f"slots applies to {slotted_names()} (choose one with algorithm=...), or leave slots out",))
