"""Deterministic kernel names: ``purlin_<collective>_<hash8>``."""

from __future__ import annotations

import hashlib
from dataclasses import fields, is_dataclass
from enum import Enum

from purlinc.dtypes import DType, ReduceOp
from purlinc.snac.ir import Schedule


def canonical(value):
    """A JSON-able, order-stable picture of IR values (frozensets sorted, enums by value)."""
    if is_dataclass(value):
        return {"@": type(value).__name__, **{f.name: canonical(getattr(value, f.name)) for f in fields(value)}}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (frozenset, set)):
        return sorted(canonical(v) for v in value)
    if isinstance(value, (tuple, list)):
        return [canonical(v) for v in value]
    return value


def kernel_base(schedule: Schedule, atom: str, dtype: DType, op: ReduceOp | None,
                params: tuple[tuple[str, int], ...] = ()) -> str:
    """``purlin_<collective>_<hash8>``, the hash over schedule, atom, dtype, op and the bound
    parameters (the source names them: two values that lower alike wrote one set of files,
    the second compile's manifest naming its value over the first's).

    Dataclass and enum reprs are deterministic; the options' frozenset is not (string
    hashing is salted per process), so the options enter through their stable ``key()``.
    """
    picture = repr((
        schedule.collective, schedule.world_size, schedule.operation, schedule.options.key(), schedule.slices,
        schedule.in_units, schedule.out_units, schedule.stage_units, schedule.signals, schedule.programs,
        schedule.channel_signals,
        atom, dtype.value, op.value if op else None,
        # only with an epilogue, so that every other kernel keeps its name
        *((schedule.epilogue.format(),) if schedule.epilogue is not None else ()),
        *((tuple(params),) if params else ()),  # likewise: a spec without parameters keeps its names
    ))
    digest = hashlib.sha256(picture.encode()).hexdigest()[:8]
    return f"purlin_{schedule.collective}_{digest}"
