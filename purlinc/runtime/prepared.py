"""What a load decides before it touches memory, with no GPU: the pipeline's Compiled it runs
(``prepare``), and the regions of the symmetric heap its schedule takes (``Layout``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from purlinc import settings
from purlinc.atom.abi import StagingPlacement
from purlinc.atom.atoms import DEFAULT_ATOM
from purlinc.atom.rows import row_bytes_run
from purlinc.errors import InternalError
from purlinc.pipeline import Compiled
from purlinc.runtime.options import LoadOptions
from purlinc.snac.ir import Algorithm


def prepare(
    path_or_source: str | Path,
    world_size: int,
    *,
    params: Mapping[str, int] | None = None,
    algorithm: Algorithm | str | None = None,
    atom: str | None = None,
    channels: int | None = None,
    slices: int | None = None,
    packed: bool | None = None,
    arch: str = "sm_90",
    trace: bool = False,
) -> Compiled:
    """Parse, check and lower (no GPU needed): everything a load decides before touching memory.
    ``prepare_options`` with these keywords as a LoadOptions."""
    return prepare_options(path_or_source, world_size, LoadOptions.of(
        params=params, algorithm=algorithm, atom=atom, channels=channels, slices=slices, packed=packed,
        arch=arch, trace=trace))


def prepare_options(path_or_source: str | Path, world_size: int, options: LoadOptions) -> Compiled:
    """The Compiled a load of ``options`` runs: the same path, and for the same inputs the same
    Compiled, as ``purlinc compile`` (``pipeline.prepare``).  The caller's buffers are never
    registered (no per-call pointers are exchanged), which the default options already say.
    Raises the PurlinError of an option, atom or algorithm that does not apply."""
    from purlinc import pipeline

    compiled = pipeline.prepare(path_or_source, world_size=world_size, params=options.param_map,
                                arch=options.arch or "sm_90", atom=options.atom or DEFAULT_ATOM,
                                overrides=options.overrides(), trace=bool(options.trace)).prepared()
    if compiled.options.registered:  # the defaults register nothing, and no override here does
        raise InternalError(f"{compiled.name}: a runtime schedule asks for registered buffers")
    return compiled


@dataclass(frozen=True)
class Layout:
    """Offsets of one collective's regions in the symmetric heap (equal on every rank)."""

    stage: int
    stage_bytes: int
    pad: int
    pad_bytes: int
    counters: int
    counters_bytes: int
    staging: StagingPlacement | None = None  # where every call's staging units lie (abi.py)


def staging_placement(compiled: Compiled, stage_bytes: int | None = None) -> StagingPlacement:
    """Where a load of ``compiled`` places its staging units.  ``stage_bytes``: the large
    region's size as its caller worked it out (a plain load's bucket: ``tuned._prepare_bucket``);
    None: PURLIN_STAGE_MB, larger messages running in several rounds, but never less than
    ``least_stage_bytes``, below which some call could not run at all."""
    schedule = compiled.schedule  # staging_units: every copy; slices: every channel's (snac/ir.py)
    space = stage_bytes if stage_bytes is not None else max(settings.stage_bytes(), least_stage_bytes(schedule))
    return StagingPlacement.for_space(space, schedule.staging_units, schedule.slices)


def slice_aligns(schedule, most: int | None = None) -> tuple[int, ...]:
    """What a staging slice holds whole, each a size a slice is cut in multiples of: 16 bytes,
    and with an epilogue a row of every dtype it runs in (a round never splits a row);
    ``most``: the bytes a unit moves at most (a bucket's calls), so wider rows never come."""
    rows = row_bytes_run(schedule.epilogue.row) if schedule.epilogue is not None else ()
    return (16, *(size for size in rows if most is None or size <= most))


def least_stage_bytes(schedule, most: int | None = None) -> int:
    """The large region that lets every call run, in as many rounds as it takes: a slice of
    every size ``slice_aligns`` names (64 slices of 32 KiB float32 rows take 2 MiB per unit).
    A smaller PURLIN_STAGE_MB costs rounds, never a refusal."""
    per_slice = max(-(-size // 16) * 16 for size in slice_aligns(schedule, most))
    return schedule.staging_units * schedule.slices * per_slice


def layout_sizes(compiled: Compiled, stage_bytes: int | None = None,
                 staging: StagingPlacement | None = None) -> tuple[int, int, int]:
    """(staging, signal pad, counters) bytes for one rank; ``staging`` when the caller has placed it."""
    schedule = compiled.schedule
    if staging is None:
        staging = staging_placement(compiled, stage_bytes)
    words = compiled.plan.pad_words if compiled.plan is not None else schedule.signal_pad_size()
    return staging.total_bytes, 8 * max(words, 1), 8 * schedule.channels
