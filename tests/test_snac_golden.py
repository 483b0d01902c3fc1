"""Golden text dumps of the SNAC schedule (default options) for the eight standard collectives.

PURLIN_UPDATE_GOLDEN=1 (or pytest --update-golden) rewrites them; review the diff."""

from __future__ import annotations

import pytest

from purlinc import pipeline
from purlinc.snac.format import format_schedule
from purlinc.snac.lower import default_options, lower

STANDARD = ("allgather", "reduce_scatter", "allreduce", "alltoall", "broadcast", "reduce", "gather", "scatter")


@pytest.mark.parametrize("world_size", (2, 4, 8))
@pytest.mark.parametrize("name", STANDARD)
def test_snac_golden(golden, examples_dir, name, world_size):
    source = pipeline.load_source(str(examples_dir / f"{name}.pln"))
    spec = pipeline.spec_stage(pipeline.parse_stage(source), world_size, {})
    schedule = lower(spec, default_options(spec))
    golden(f"snac/{name}_r{world_size}.txt", format_schedule(schedule))


@pytest.mark.parametrize("name", ("allgather", "allreduce"))
def test_snac_golden_channels(golden, examples_dir, name):
    """Four channels of two slices: the dump holds one channel-relative program per rank
    (slices s0..s1, signals 0..W-1) and says how channel c shifts it."""
    from dataclasses import replace

    source = pipeline.load_source(str(examples_dir / f"{name}.pln"))
    spec = pipeline.spec_stage(pipeline.parse_stage(source), 2, {})
    schedule = lower(spec, replace(default_options(spec), channels=4, slices=2))
    golden(f"snac/{name}_r2_c4_s2.txt", format_schedule(schedule))
