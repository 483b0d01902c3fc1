"""Where a call's staging units and slices lie (``abi.StagingPlacement``), and why they must
not depend on the call's count.

A schedule guards the reuse of a staging slice, per channel: a producer overwrites slice s of
unit u of copy c only after the consumer's channel has read what the last call put there (a
wait, or one implied by the calls between).  The kernels address it at ``region + copy *
copy_bytes + u * stage_unit + s * stage_step``.  When ``stage_unit`` was the call's piece and
a slice sat at the call's own step, a call with a smaller count than the call before it laid
its units and slices over others of that call, which no guard covers: a rank or a channel
that ran ahead overwrote data a slower one had not read yet.  Two checks: every (copy, unit,
slice) keeps its bytes for every piece a load can move, and a model of the kernels'
addressing (the simulator, its staging placed as the runtime places it) gets every call of
alternating counts right in every interleaving tried, where the old placement did not."""

from __future__ import annotations

import numpy as np
import pytest

from purlinc.atom.abi import SMALL_STAGE_UNIT, KernelABI, StagingPlacement, slice_step
from purlinc.dtypes import DType, ReduceOp
from purlinc.frontend.check import check
from purlinc.frontend.evaluate import evaluate
from purlinc.frontend.parse import parse
from purlinc.runtime.validate import choose_piece
from purlinc.snac.ir import Algorithm, LowerOptions, Space
from purlinc.snac.lower import lower
from purlinc.snac.packing import normalized
from purlinc.snac.simulate import POISON_OUT, POISON_STAGE, _Machine, _Run, slice_bounds
from purlinc.snac.verify import verify


def _abi(itemsize: int, units: int, copies: int, align: int, slices: int = 1) -> KernelABI:
    return KernelABI(kernel_base="k", world_size=2, channels=1, threads=256, shared_bytes=0, itemsize=itemsize,
                     stage_units=units, slices=slices, stage_copies=copies, signal_pad=1, in_units=(1, 1),
                     out_units=(1, 1), needs_in_peers=False, needs_out_peers=False, stage_align=align)


def _slice_bytes(abi: KernelABI, staging: StagingPlacement, count: int, itemsize: int) -> dict:
    """(copy, unit, slice) -> the bytes of the staging space a call of ``count`` elements per
    chunk writes there: the slice's length at its fixed place (a packed slice's packets take
    twice its bytes at twice its offset, into the next unit)."""
    piece = choose_piece(count, staging, itemsize)
    region, stride, step = abi.staged_at(piece, staging)
    rounds, _, piece_bytes, _, unit, io_step, copy_bytes, stage_step = abi.geometry(count, piece, staging)
    assert (unit, stage_step) == (stride, step) and io_step <= stage_step
    per_copy = abi.stage_units // abi.stage_copies
    placed = {}
    for c in range(abi.stage_copies):
        for u in range(per_copy):
            for s in range(abi.slices):
                length = max(0, min(io_step, piece_bytes - s * io_step))
                start = region + c * copy_bytes + u * stride + s * stage_step
                placed[c, u, s] = (start, start + length)
    return placed


@pytest.mark.parametrize("space, units", [(64 << 20, 16), (64 << 20, 6), (1 << 20, 4), (200 << 10, 3), (4096, 2)])
@pytest.mark.parametrize("itemsize, copies, align, slices", [(2, 2, 16, 1), (4, 1, 1, 3), (1, 2, 1, 2), (8, 2, 16, 4)])
def test_a_slice_keeps_its_bytes_whatever_the_count(space, units, itemsize, copies, align, slices):
    staging = StagingPlacement.for_space(space, units * copies, slices)
    abi = _abi(itemsize, units * copies, copies, align, slices)
    counts = sorted({1, 3, 8, 64, 1000, 4096, SMALL_STAGE_UNIT // itemsize, SMALL_STAGE_UNIT // itemsize + 1,
                     staging.large // itemsize, 10 * staging.large // itemsize})
    placed = {n: _slice_bytes(abi, staging, n, itemsize) for n in counts}
    for n, here in placed.items():
        for key, (lo, hi) in here.items():
            assert 0 <= lo <= hi <= staging.total_bytes and lo % 16 == 0, (n, key)
        for m, there in placed.items():
            for key, (lo, hi) in here.items():
                for other, (lo2, hi2) in there.items():
                    assert key == other or hi <= lo2 or hi2 <= lo or lo == hi or lo2 == hi2, (
                        f"count {n}'s (copy, unit, slice) {key} at [{lo}, {hi}) overlaps count {m}'s {other} "
                        f"at [{lo2}, {hi2})")


def test_the_large_region_keeps_the_space_asked_for():
    """The largest piece is what the space gives (no rounds lost to the small region, which
    comes on top); a space with no room for two regions has the large one only."""
    staging = StagingPlacement.for_space(64 << 20, 16)
    assert staging.large == (64 << 20) // 16 and staging.small == SMALL_STAGE_UNIT
    assert staging.total_bytes == 16 * (SMALL_STAGE_UNIT + (64 << 20) // 16)
    assert staging.place(100) == (0, SMALL_STAGE_UNIT, SMALL_STAGE_UNIT)
    assert staging.place(SMALL_STAGE_UNIT + 16) == (16 * SMALL_STAGE_UNIT, staging.large, staging.large)
    assert choose_piece(1 << 40, staging, 2) == staging.large // 2
    sliced = StagingPlacement.for_space(64 << 20, 16, slices=3)  # slices at a 16-byte multiple each
    assert sliced.place(100) == (0, SMALL_STAGE_UNIT, 5456) and sliced.largest_step == 1398096
    tight = StagingPlacement.for_space(16 * 2 * SMALL_STAGE_UNIT, 16)
    assert tight.small == 0 and tight.place(100) == (0, 2 * SMALL_STAGE_UNIT, 2 * SMALL_STAGE_UNIT)
    with pytest.raises(ValueError, match="do not fit a staging unit"):
        tight.place(2 * SMALL_STAGE_UNIT + 16)


FUSED = "examples/fused/allreduce_add_rmsnorm.pln"


def _fused_buckets(world: int, hidden: int, max_channels):
    """A plain load's buckets of the fused all-reduce + RMSNorm, each with the staging the
    runtime places for it (``prepared.staging_placement``), and U."""
    from pathlib import Path

    from purlinc.runtime.prepared import staging_placement
    from purlinc.runtime.tuned import prepare_tuned

    source = (Path(__file__).parent.parent / FUSED).read_text()
    prepared, units = prepare_tuned(source, world, params={"hidden": hidden}, max_channels=max_channels)
    return [(p, staging_placement(p.compiled, p.stage_bytes)) for p in prepared], units


def _itemsizes(row: int) -> list[int]:
    from purlinc.atom.rows import row_bytes_run

    return [size // row for size in row_bytes_run(row)]


@pytest.mark.parametrize("world", (2, 4, 8))
@pytest.mark.parametrize("hidden", (4096, 16384, 4104, 64))
@pytest.mark.parametrize("max_channels", (None, 8))
def test_a_plain_load_runs_every_call_of_a_bucket_in_one_round(world, hidden, max_channels):
    """A plain load sizes each bounded bucket's staging for the bucket's largest call; with an
    epilogue, its slices are cut in whole rows (a bucket of 4 rows on 8 slices takes a row per
    slice, not half of one), of each dtype the epilogue runs.  Every call the bucket takes must
    fit one round: a piece no larger than a row's share of the fixed slice step was refused
    outright."""
    from purlinc.runtime import tuning

    buckets, units = _fused_buckets(world, hidden, max_channels)
    table = tuple(p.bucket for p, _ in buckets)
    checked = 0
    for index, (bucket, staging) in enumerate(buckets):
        if bucket.stage_bytes is None or not staging.units:
            continue
        row = bucket.compiled.schedule.epilogue.row
        for itemsize in _itemsizes(row):
            most_rows = bucket.bucket.max_bytes // (row * itemsize * units)
            for rows in sorted({r for r in (1, 2, 3, most_rows // 2, most_rows - 1, most_rows) if 1 <= r <= most_rows}):
                if tuning.choose(table, rows * row * itemsize * units) != index:
                    continue
                count = rows * row
                assert choose_piece(count, staging, itemsize, row) == count, (
                    f"R={world} bucket {bucket.bucket}: {rows} row(s) of {row} x {itemsize} bytes take several rounds")
                checked += 1
    assert checked, "no bucket call checked"


@pytest.mark.parametrize("stage_mb", ("1", "0.0625"))
@pytest.mark.parametrize("world,hidden", ((2, 4096), (8, 16384), (8, 64)))
def test_a_small_stage_setting_costs_rounds_not_refusals(world, hidden, stage_mb, monkeypatch):
    """PURLIN_STAGE_MB caps staging, and larger messages take more rounds; but no load is
    given less than a row per slice in every dtype its epilogue runs (64 slices of 16,384-element
    rows refused every call of 33-64 rows at 16 MiB), so every call of every bucket runs, in
    whole rows."""
    monkeypatch.setenv("PURLIN_STAGE_MB", stage_mb)
    buckets, units = _fused_buckets(world, hidden, None)
    cap = int(float(stage_mb) * 2**20)
    for bucket, staging in buckets:
        if not staging.units:
            continue
        row = bucket.compiled.schedule.epilogue.row
        # ... and no more than that: the cap, or a row per slice of the widest dtype whose rows
        # the bucket's calls can hold (a small bucket never sees float32 rows it cannot fit)
        most = bucket.bucket.max_bytes // units if bucket.bucket.max_bytes is not None else None
        widest = max(size for size in (16, *(row * i for i in _itemsizes(row))) if most is None or size <= most)
        assert staging.units * staging.large <= max(cap, staging.units * staging.slices * widest) + 4096, (
            f"{bucket.bucket}: {staging.units * staging.large} bytes of staging")
        for itemsize in _itemsizes(row):
            for rows in (1, 2, 33, 64, 300):
                piece = choose_piece(rows * row, staging, itemsize, row)
                assert piece >= row and piece % row == 0, f"{bucket.bucket}: {rows} rows cut into pieces of {piece}"


# ---- the kernels' addressing, modelled: calls of different counts back to back ----------------

class _PlacedMachine(_Machine):
    """The simulator's machine with one count per call (one round each) and staging slices
    where ``place(step) -> (region, stride, stage_step)`` puts them, in bytes, as the kernels
    address them (slice s of unit u at region + copy + u * stride + s * stage_step)."""

    def __init__(self, schedule, counts, dtype, op, place, space_bytes):
        super().__init__(schedule, max(counts), dtype, op, None)
        self.counts, self.place = counts, place
        self.call_of = [-1] * schedule.world_size
        self.stages = [self._poisoned(space_bytes // dtype.itemsize, POISON_STAGE) for _ in range(schedule.world_size)]

    def start_call(self, rank, inputs):
        self.call_of[rank] += 1
        self.ins[rank] = inputs.copy()
        self.outs[rank] = self._poisoned(self.schedule.out_units[rank] * self.counts[self.call_of[rank]], POISON_OUT)

    def view(self, region, round_, epoch=0):
        n, size, slices = self.counts[epoch], self.dtype.itemsize, self.schedule.slices
        lo, hi = slice_bounds(n, size, slices, region.slice, self.align)
        if region.space is Space.STAGE:
            step = slice_step(n * size, slices, self.align)
            base, stride, stage_step = self.place(step)
            per_copy = self.schedule.stage_units
            start = (base + (epoch % self.schedule.stage_copies) * per_copy * stride + region.unit * stride
                     + region.slice * stage_step) // size
            return self.stages[region.rank][start:start + hi - lo]
        buffer = self.ins[region.rank] if region.space is Space.IN else self.outs[region.rank]
        return buffer[region.unit * n + lo:region.unit * n + hi]


def _wrong_call(spec, schedule, counts, place, space_bytes, seed):
    """The first call of ``counts`` whose output differs from the evaluator's, in words; None."""
    schedule, _ = normalized(schedule)
    dtype, op = DType.INT32, ReduceOp.SUM if spec.is_reduce else None
    rng = np.random.default_rng(seed)
    sets = [[rng.integers(-1000, 1000, len(spec.inputs[r]) * n).astype(np.int32) for r in range(spec.world_size)]
            for n in counts]
    machine = _PlacedMachine(schedule, counts, dtype, op, place, space_bytes)
    for call, (inputs, got) in enumerate(zip(sets, _Run(schedule, machine, sets, len(counts), seed).run())):
        for rank, (g, w) in enumerate(zip(got, evaluate(spec, inputs, counts[call], dtype, op))):
            if not np.array_equal(g.view(np.uint8), w.view(np.uint8)):
                return f"call {call} (count {counts[call]}), rank {rank}"
    return None


ALLGATHER = "collective allgather { in[r] = x[r] out[r] = x[0..R] copy }"
ALLREDUCE = "collective allreduce { in[r] = x[0..R] out[r] = x[0..R] reduce }"
BROADCAST = "collective broadcast { in[0] = x out[r] = x copy }"
SCHEDULES = [
    ("allgather", ALLGATHER, LowerOptions(stage_copies=2)),
    ("allreduce", ALLREDUCE, LowerOptions(packed=True)),
    ("allreduce", ALLREDUCE, LowerOptions(Algorithm.RING)),
    # one staging copy and two channels: each channel guards its own slices, so a slice that
    # moved with the count landed on the other channel's, unread
    ("allgather", ALLGATHER, LowerOptions(stage_copies=1, channels=2)),
    ("broadcast", BROADCAST, LowerOptions(Algorithm.RING, channels=2)),
    ("allreduce", ALLREDUCE, LowerOptions(Algorithm.DIRECT_PULL, channels=2)),
]


@pytest.mark.parametrize("name, source, options", SCHEDULES, ids=[f"{s[0]}-{s[2].key()}" for s in SCHEDULES])
def test_calls_of_alternating_counts_are_right_in_every_interleaving(name, source, options):
    R, counts = 3, [64, 8, 64, 8, 64, 8]
    spec = check(parse(source), R)
    schedule = lower(spec, options)
    verify(schedule, spec)
    staging = StagingPlacement.for_space(1 << 20, schedule.staging_units, schedule.slices)
    wrong = [w for seed in range(40) if (w := _wrong_call(spec, schedule, counts, staging.place,
                                                          staging.total_bytes, seed))]
    assert not wrong, f"{len(wrong)} of 40 interleavings wrong, first: {wrong[0]}"

    # The placement before, units a piece apart and slices a step apart: the same model finds
    # the race (so the check above can fail).
    def compact(step):
        return 0, step * schedule.slices, step
    old = [w for seed in range(40) if (w := _wrong_call(spec, schedule, counts, compact, 1 << 20, seed))]
    assert old, "the model no longer sees the race of a count-dependent placement"


def test_the_staging_floor_counts_the_rows_a_bucket_can_hold():
    """A row per slice of each dtype the epilogue runs (bf16 and f16 rows of 8 KiB, float32 of
    16 KiB at 4096 elements), but only of the rows that fit the bytes a unit moves at most: a
    bucket of one bf16 row never sees a float32 row, and must not pay for one."""
    from pathlib import Path

    from purlinc.runtime.collective import prepare
    from purlinc.runtime.prepared import least_stage_bytes

    source = (Path(__file__).parent.parent / FUSED).read_text()
    schedule = prepare(source, 2, params={"hidden": 4096}, channels=8).schedule
    per_unit_slices = schedule.staging_units * schedule.slices
    assert schedule.slices == 8
    assert least_stage_bytes(schedule) == per_unit_slices * 16384
    assert least_stage_bytes(schedule, 8192) == per_unit_slices * 8192
    assert least_stage_bytes(schedule, 100) == per_unit_slices * 16  # no row fits: 16 bytes a slice
    plain = prepare("collective a { in[r] = x[0..R] out[r] = x[0..R] reduce }", 2, channels=8).schedule
    assert least_stage_bytes(plain) == plain.staging_units * plain.slices * 16
