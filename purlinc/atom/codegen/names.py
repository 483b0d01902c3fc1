"""Deterministic kernel names: ``purlin_<collective>_<hash8>``."""

from __future__ import annotations

import hashlib

from purlinc.dtypes import DType, ReduceOp
from purlinc.snac.ir import Schedule


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
