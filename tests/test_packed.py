"""Packed (LL) stages: lowering, normalisation, verifier, simulator, dumps, CUDA generation.

A packed Stage is a Stage and a Notify in one (a flag in every 16-byte packet); the verifier
and the simulator run on the normalized schedule, so the existing proofs apply.  CPU only,
except the NVRTC/SASS checks at the end (NVRTC runs on CPU)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest

from purlinc import cli, pipeline
from purlinc.atom.abi import StagingPlacement
from purlinc.atom.codegen import generate
from purlinc.dtypes import DType, ReduceOp, random_values
from purlinc.errors import PurlinError
from purlinc.frontend.evaluate import evaluate
from purlinc.snac.format import format_schedule, schedule_from_json, schedule_to_json
from purlinc.snac.ir import PACKET_FLAG_PERIOD, Algorithm, Consume, LowerOptions, Notify, Role, Stage, Wait, packet_flag
from purlinc.snac.packing import PACKED_UNITS, normalized, packed_stages
from purlinc.snac.simulate import simulate_calls
from purlinc.snac.verify import VerificationError, verify
from test_snac_properties import EXAMPLES, NAMES, definition, spec_for, world_sizes
from test_simulate import same_bits
from test_nvrtc import cache_dir  # noqa: F401 - the session compile cache fixture

COUNTS = (1, 3, 8, 13)
COPY_TYPES = (DType.BFLOAT16, DType.FLOAT32, DType.FLOAT8_E4M3, DType.INT32)
REDUCE_TYPES = ((DType.BFLOAT16, "sum"), (DType.FLOAT32, "max"), (DType.FLOAT16, "sum"), (DType.INT32, "prod"))


def packed_schedule(name: str, world: int, channels: int = 1, slices: int = 1):
    spec = spec_for(name, world)
    return spec, pipeline.snac_stage(spec, LowerOptions(channels=channels, slices=slices, packed=True))


def _inputs(spec, count, dtype, seed):
    rng = np.random.default_rng(seed)
    return [random_values(rng, len(spec.inputs[r]) * count, dtype) for r in range(spec.world_size)]


# ---------------------------------------------------------------- lowering + verify + simulate


CASES = [
    (name, world, channels, slices)
    for name in NAMES
    for world in world_sizes(name, range(2, 9))
    for channels, slices in ((1, 1), (2, 1), (1, 2), (2, 2))
    if (channels, slices) == (1, 1) or world in (2, 3, 5, 8)
]


@pytest.mark.parametrize("name,world,channels,slices", CASES, ids=[f"{n}-R{w}-c{c}-s{s}" for n, w, c, s in CASES])
def test_packed_equals_the_evaluator(name, world, channels, slices):
    spec, schedule = packed_schedule(name, world, channels, slices)  # verified by snac_stage
    plain = pipeline.snac_stage(spec, LowerOptions(channels=channels, slices=slices))
    assert schedule.options.key() == plain.options.key() + "/ll"
    stages = [s for p in schedule.programs for s in p.steps if isinstance(s, Stage)]
    assert all(s.packed for s in stages)
    assert schedule.stage_units == PACKED_UNITS * plain.stage_units
    # No separate DATA notify is left: every notify is an ACK.
    roles = {d.signal: d.role for d in schedule.signals}
    assert all(roles[s.signal] is Role.ACK for p in schedule.programs for s in p.steps if isinstance(s, Notify))
    n = len(CASES)
    index = CASES.index((name, world, channels, slices))
    if spec.is_reduce:
        dtype, op = REDUCE_TYPES[index % len(REDUCE_TYPES)]
    else:
        dtype, op = COPY_TYPES[index % len(COPY_TYPES)], None
    for count in COUNTS[: 2 if world > 5 else 4]:
        sets = [_inputs(spec, count, dtype, seed) for seed in range(3)]
        got = simulate_calls(schedule, spec, sets, count, dtype, op, calls=3, seed=index + n * count)
        for inputs, outputs in zip(sets, got):
            want = evaluate(spec, inputs, count, dtype, op)
            assert all(same_bits(g, w) for g, w in zip(outputs, want))


def test_packed_runs_in_rounds():
    spec, schedule = packed_schedule("allreduce", 3, 2, 2)
    sets = [_inputs(spec, 37, DType.FLOAT32, seed) for seed in range(3)]
    got = simulate_calls(schedule, spec, sets, 37, DType.FLOAT32, "sum", calls=3, seed=4, piece=8)
    for inputs, outputs in zip(sets, got):
        want = evaluate(spec, inputs, 37, DType.FLOAT32, "sum")
        assert all(same_bits(g, w) for g, w in zip(outputs, want))


def test_normalized_is_stage_then_notify():
    _, schedule = packed_schedule("allgather", 2)
    flat, origins = normalized(schedule)
    program, original = flat.program(0, 0), schedule.program(0, 0)
    assert len(program.steps) == len(original.steps) + 1
    i = next(i for i, s in enumerate(original.steps) if isinstance(s, Stage))
    packed = original.steps[i]
    assert program.steps[i] == replace(packed, signal=None, k=0) and not program.steps[i].packed
    assert program.steps[i + 1] == Notify(packed.signal, packed.k)
    assert origins[0, 0][i] == origins[0, 0][i + 1] == i
    # A plain schedule is its own normal form.
    plain = pipeline.snac_stage(spec_for("allgather", 2), LowerOptions())
    assert normalized(plain)[0] is plain


def test_only_direct_push_and_no_registered_out():
    spec = spec_for("allgather", 4)
    for algorithm in (Algorithm.DIRECT_PULL, Algorithm.RING):
        with pytest.raises(PurlinError, match="direct-push only"):
            pipeline.snac_stage(spec, LowerOptions(algorithm=algorithm, packed=True))
    with pytest.raises(PurlinError, match="registered"):
        pipeline.snac_stage(spec, LowerOptions(packed=True, registered=frozenset({"out"})))


# ---------------------------------------------------------------- mutations


def _with_program(schedule, rank, steps):
    programs = list(schedule.programs)
    programs[rank * schedule.channels] = replace(programs[rank * schedule.channels], steps=tuple(steps))
    return replace(schedule, programs=tuple(programs))


@pytest.mark.parametrize("name", ["allgather", "allreduce", "alltoall", "broadcast"])
def test_deleting_the_packed_wait_is_reported(name):
    spec, schedule = packed_schedule(name, 3)
    packed_signals = {s.signal for s in packed_stages(schedule).values()}
    found = 0
    for rank in range(3):
        steps = schedule.program(rank, 0).steps
        for i, step in enumerate(steps):
            if isinstance(step, Wait) and step.signal in packed_signals:
                found += 1
                with pytest.raises(VerificationError):
                    verify(_with_program(schedule, rank, steps[:i] + steps[i + 1:]), spec)
    assert found


@pytest.mark.parametrize("name", ["allgather", "allreduce", "reduce_scatter"])
def test_unpacking_a_stage_without_notify_is_reported(name):
    spec, schedule = packed_schedule(name, 3)
    found = 0
    for rank in range(3):
        steps = schedule.program(rank, 0).steps
        for i, step in enumerate(steps):
            if isinstance(step, Stage) and step.packed:
                found += 1
                mutant = steps[:i] + (replace(step, signal=None, k=0),) + steps[i + 1:]
                with pytest.raises(VerificationError):
                    verify(_with_program(schedule, rank, mutant), spec)
    assert found


def test_packed_layout_problems_are_reported():
    spec, schedule = packed_schedule("allgather", 2)
    steps = schedule.program(0, 0).steps
    i = next(i for i, s in enumerate(steps) if isinstance(s, Stage))
    stage = steps[i]
    # Into the reserved second unit of a packed message: out of bounds here.
    bad = replace(stage, dst=replace(stage.dst, unit=stage.dst.unit + 1))
    with pytest.raises(VerificationError, match="packed"):
        verify(_with_program(schedule, 0, steps[:i] + (bad,) + steps[i + 1:]), spec)
    # The reserved unit touched by a plain step.
    grown = replace(schedule, stage_units=schedule.stage_units + 2)
    j = next(j for j, s in enumerate(grown.program(1, 0).steps) if isinstance(s, Consume) and s.srcs[0].space.value == "stage")
    consume = grown.program(1, 0).steps[j]
    # rank 1 reads its stage[0] (packed by rank 0); make a plain read of stage[1] instead.
    moved = replace(consume, srcs=(replace(consume.srcs[0], unit=consume.srcs[0].unit + 1),))
    with pytest.raises(VerificationError, match="second half of a packed"):
        verify(_with_program(grown, 1, grown.program(1, 0).steps[:j] + (moved,) + grown.program(1, 0).steps[j + 1:]), spec)
    # A plain Notify of a packed signal.
    extra = Notify(stage.signal, stage.k)
    with pytest.raises(VerificationError, match="only packed stages may notify"):
        verify(_with_program(schedule, 0, steps[:i + 1] + (extra,) + steps[i + 1:]), spec)


def test_unpacked_data_between_ranks_is_refused_in_a_packed_schedule():
    """Rank 1 stages x[1] plain into rank 0's spare staging unit before its packed stage, and
    rank 0 copies it out right after its packed wait.  The proof read the packed stage as
    Stage + Notify (a release) and accepted it; on the device the LL send is a plain store and
    the wait polls its own packets, so nothing orders the plain unit: a race."""
    from purlinc.frontend.ast import Operation
    from purlinc.snac.ir import Region, Space

    spec, schedule = packed_schedule("allgather", 2)
    spare = Region(Space.STAGE, 0, schedule.stage_units, 0)
    grown = replace(schedule, stage_units=schedule.stage_units + 1)
    rank1 = (Stage(Region(Space.IN, 1, 0, 0), spare, "plain x[1] for rank 0"),) + grown.program(1, 0).steps
    rank0 = list(grown.program(0, 0).steps)
    group_end = max(i for i, s in enumerate(rank0) if isinstance(s, Consume)) + 1
    rank0.insert(group_end, Consume(Operation.COPY, (spare,), Region(Space.OUT, 0, 1, 0), "x[1] from the plain unit"))
    bad = _with_program(_with_program(grown, 0, rank0), 1, rank1)
    with pytest.raises(VerificationError) as caught:
        verify(bad, spec)
    assert caught.value.message.endswith(
        f"stages {spare.format()} of rank 0 unpacked: in a packed schedule data crosses ranks in packets only "
        "(an LL send orders no other data)")
    assert (caught.value.rank, caught.value.step) == (1, 0)


def test_packed_wait_must_guard_what_its_consumes_read():
    # allgather R=3 with two slices: move slice 1's consume before slice 1's wait, into slice 0's group.
    spec, schedule = packed_schedule("allgather", 3, 1, 2)
    steps = list(schedule.program(0, 0).steps)
    waits = [i for i, s in enumerate(steps) if isinstance(s, Wait) and s.k > 0]
    consumes = [i for i, s in enumerate(steps) if isinstance(s, Consume) and s.srcs[0].space.value == "stage"]
    late = next(c for c in consumes if c > waits[-1])
    step = steps.pop(late)
    steps.insert(waits[0] + 1 + sum(1 for w in waits if w <= waits[0] + 1), step)
    with pytest.raises(VerificationError):
        verify(_with_program(schedule, 0, steps), spec)


# ---------------------------------------------------------------- dumps


def test_dump_shows_packed_stages(capsys):
    assert cli.main(["dump", "examples/allgather.pln", "-R", "2", "--stage", "snac", "--packed"]) == 0
    text = capsys.readouterr().out
    assert "stage+notify r0.in[0].s0 -> r1.stage[0].s0, r1.sig[0] = e*1+1 (LL)" in text
    assert "packed (LL" in text and "/ll" in text
    assert "stage: 2 per rank" in text


@pytest.mark.parametrize("name", ["allgather", "allreduce"])
def test_json_round_trips(name):
    _, schedule = packed_schedule(name, 3, 2, 2)
    data = json.loads(json.dumps(schedule_to_json(schedule)))
    assert data["options"]["packed"] is True
    back = schedule_from_json(data)
    assert back == schedule and format_schedule(back) == format_schedule(schedule)


def test_cli_flag_reaches_the_options(capsys):
    assert cli.main(["check", "examples/allreduce.pln", "-R", "2..4", "--packed"]) == 0
    assert "3 schedules verified" in capsys.readouterr().out
    assert cli.main(["check", "examples/allreduce.pln", "-R", "2", "--packed", "-a", "ring"]) == 2


# ---------------------------------------------------------------- CUDA


def _body(source: str, rank: int) -> str:
    """The text of the body ``rank`` runs (from its banner to the next one)."""
    for part in re.split(r"(?m)^// ==== ", source)[1:]:
        ranks = re.match(r"ranks? ([0-9, ]+):", part)
        if ranks and rank in [int(r) for r in ranks.group(1).split(",")]:
            return part
    raise AssertionError(f"no body runs rank {rank}")


def _kernel(name, world=2, atom="ldst", arch="sm_90", channels=1, dtype=None, packed=True):
    spec = spec_for(name, world)
    schedule = pipeline.snac_stage(spec, LowerOptions(channels=channels, packed=packed))
    op = ReduceOp.SUM if spec.is_reduce else None
    dtype = dtype or DType.BFLOAT16
    return schedule, generate(schedule, spec, atom=atom, arch=arch, dtype=dtype, op=op)


def test_generated_ll_structure():
    schedule, kernel = _kernel("allreduce", 2)
    source = kernel.source
    assert "PURLIN_STAGE_ALIGN = 16" in source and kernel.abi.stage_align == 16
    # Two staging copies by epoch parity: the runtime allocates both.
    assert schedule.stage_copies == 2 and "PURLIN_STAGE_COPIES = 2" in source
    # 3 bf16 = 6 bytes: a slice of 16, at a 16-byte step of a 16-byte-aligned unit
    staging = StagingPlacement.for_space(1 << 20, kernel.abi.stage_units, kernel.abi.slices)
    assert kernel.abi.step(3) == 16 and all(v % 16 == 0 for v in kernel.abi.staged_at(3, staging))
    body = _body(source, 0)
    # The two packed stages of a rank are one loop: both chunks' loads, then both stores (the
    # first packets' loads peeled ahead of the loop, the rest at the end of each trip).
    assert body.count("purlin_ll_put<Geo>(") == 2 and body.count("purlin_ll_take<Geo>(") == 2 * 2
    assert body.count("while (8 * i0 < most)") == 1
    assert body.index("purlin_ll_take<Geo>(src1") < body.index("purlin_ll_put<Geo>(dst0")
    # The round's epoch (it needs the call counter's load) is set after the first loads are
    # issued and before anything uses it: the two loads overlap.
    assert body.count("purlin_round_epoch(") == 1
    assert body.index("purlin_ll_take<Geo>(src1") < body.index("purlin_round_epoch(") < body.index("flag0 =")
    assert body.index("purlin_round_epoch(") < body.index("purlin_ll_consume<")
    # The two reduces are one receive loop over both chunks; which source is packets (the
    # peer's, after this rank's own input in rank order) is a number of the rank's row.
    assert re.findall(r"purlin_ll_consume<Geo, 2, 2, true>\(batch, site, (tab\[\d+\])\)", body)
    assert "__device__ __forceinline__ int purlin_ll_consume(" in source  # a small module: inlined
    # No DATA notify, no separate packed wait, and no ACK: each rank's next call waits for the
    # other's data, sent only after that rank finished reading this call's copy.
    assert body.count("purlin_wait(") == 0 and body.count("purlin_notify_relaxed(") == 0
    assert "purlin_notify(" not in body and kernel.abi.threads == 256
    assert "st.volatile.global.v4.u32" in source and "ld.volatile.global.v4.u32" in source
    _, copy = _kernel("allgather", 2)
    assert "purlin_ll_consume<Geo, 1, 1, false>(batch, site, 1)" in copy.source
    assert "purlin_ll_consume<Geo, 1, 1, true" not in copy.source


def test_ll_receive_loops_split_by_shape_size_and_hazard():
    # R=8 all-reduce: 8 reduces of 8 sources each, at most 8 sources per loop -> 8 loops of one,
    # which have one shape: one call site, in a loop over the 8 rows of the ranks' table.
    _, kernel = _kernel("allreduce", 8)
    body = _body(kernel.source, 0)
    assert len(re.findall(r"purlin_ll_consume<Geo, 1, 8, true>\(batch, site, tab\[\d+\]\)", body)) == 1
    assert "for (int t = 0; t < 8; ++t)" in body
    # One receive loop in the module (all ranks share the body): inlined.
    assert "__device__ __forceinline__ int purlin_ll_consume(" in kernel.source
    # ... and its 56 packed stages are send loops of at most 16 messages (limits.LL_SEND_MESSAGES:
    # one loop of 56 held 255 registers and spilled), each over the 8 inputs; the two middle
    # loops have one shape, so they are one loop over the table's rows.
    loops = re.findall(r"// steps above: one loop, (\d+) messages from 8 source\(s\)", body)
    assert list(map(int, loops)) == [16, 16, 16, 8]
    assert body.count("purlin_ll_put<Geo>(") == 16 + 16 + 8 and body.count("while (8 * i0 < most)") == 3
    # R=4 all-gather: 3 copies of one source -> one loop.
    _, gather = _kernel("allgather", 4)
    body = _body(gather.source, 0)
    assert body.count("purlin_ll_consume<Geo, 3, 1, false>(batch, site, 1)") == 1


def test_ll_batches_never_fuse_a_read_after_a_write():
    from purlinc.atom.codegen.ll import ll_batches as _ll_batches
    from purlinc.snac.ir import Region, Space

    def region(unit, space=Space.OUT):
        return Region(space, 0, unit, 0)

    def consume(dst, *srcs):
        return {"kind": "reduce", "dst_region": dst,
                "srcs": [{"region": r, "packed": i == 0} for i, r in enumerate(srcs)]}

    a = consume(region(0), region(5, Space.STAGE), region(1))
    b = consume(region(2), region(6, Space.STAGE), region(0))  # reads what a writes
    c = consume(region(3), region(7, Space.STAGE), region(4))
    d = consume(region(4), region(8, Space.STAGE), region(9))  # writes what c reads
    batches = _ll_batches([a, b, c, d])
    assert [[x is y for x, y in zip(batch["consumes"], group)] for batch, group in
            zip(batches, ([a], [b, c], [d]))] == [[True], [True, True], [True]]


def test_local_copy_of_a_sent_source_is_written_by_the_send_loop():
    # R=2 all-gather: a rank sends its chunk and copies it to its own output; the copy is
    # written from the registers the send loop loaded (no second load, no copy step).
    _, kernel = _kernel("allgather", 2)
    body = _body(kernel.source, 0)
    assert body.count("purlin_ll_copy_out<Geo>(out0, len0,") == 1 and "purlin_copy(" not in body
    assert "1 message and 1 local copy from 1 source(s)" in body
    # The receive loop waits for all of a thread's missing packets at once.
    assert "purlin_ll_wait<Geo, U, C, N>(q, b, i0, pending, site)" in kernel.source


def test_fused_copy_rules():
    from purlinc.atom.codegen.ll import fuse_sends as _fuse_sends
    from purlinc.snac.ir import Region, Space

    a, b = Region(Space.IN, 0, 0, 0), Region(Space.IN, 0, 1, 0)
    staged, out = Region(Space.STAGE, 1, 0, 0), Region(Space.OUT, 0, 0, 0)

    def send(src, dst):
        return {"kind": "ll_send", "comments": [], "dst": "d", "srcs": [f"s{src.unit}"], "slice": "0",
                "per_call": 1, "k": 1, "reads": frozenset({src}), "writes": frozenset({dst})}

    def copy(src, dst):
        return {"kind": "copy", "comments": [], "dst": "o", "srcs": ["s"], "slice": "0",
                "regions": (dst, src), "reads": frozenset({src}), "writes": frozenset({dst})}

    fused = _fuse_sends([send(a, staged), copy(a, out)])
    assert [blk["kind"] for blk in fused] == ["ll_send"] and fused[0]["copies"] == [{"dst": "o", "source": 0}]
    # Not a source of the loop, or a destination the loop reads: left alone.
    for other in (copy(b, out), copy(a, a)):
        assert [blk["kind"] for blk in _fuse_sends([send(a, staged), other])] == ["ll_send", "copy"]
    # A send after a fused copy that reads its destination starts a new loop.
    fused = _fuse_sends([send(a, staged), copy(a, out), send(out, Region(Space.STAGE, 1, 2, 0))])
    assert [blk["kind"] for blk in fused] == ["ll_send", "ll_send"]


def test_plain_kernels_use_relaxed_ack_and_release_data():
    _, kernel = _kernel("allgather", 4, packed=False)
    body = _body(kernel.source, 0)
    assert "purlin_notify_relaxed(" in body and "purlin_notify(" in body
    assert "purlin_ll_" not in kernel.source and "PURLIN_STAGE_ALIGN = 1;" in kernel.source
    assert kernel.abi.stage_align == 1


@pytest.mark.parametrize("name", ["allgather", "allreduce"])
def test_atoms_render_identical_orchestration(name):
    _, ldst = _kernel(name, 2, atom="ldst")
    _, tma = _kernel(name, 2, atom="tma")
    assert ldst.orchestration_source == tma.orchestration_source


# Packed kernels compile for every target: tests/test_nvrtc.py's matrix ("direct-push+ll", R=2).


def test_packed_stage_uses_128_bit_volatile_stores(tmp_path, cache_dir):
    from purlinc.atom import nvrtc
    from test_nvrtc import _sass

    _, kernel = _kernel("allgather", 2, arch="sm_90")
    sass = _sass(nvrtc.compile_cubin(kernel.source, kernel.filename, "sm_90"), tmp_path)
    assert "STG.E.128.STRONG.SYS" in sass  # st.volatile.global.v4.u32: one packet per store
    assert "LDG.E.128.STRONG.SYS" in sass  # ld.volatile.global.v4.u32: one packet per poll
    _, plain = _kernel("allgather", 2, arch="sm_90", packed=False)
    assert "STG.E.128.STRONG.SYS" not in _sass(nvrtc.compile_cubin(plain.source, plain.filename, "sm_90"), tmp_path)


# ---------------------------------------------------------------- staging copies (epoch parity)


def _without(schedule, rank: int, index: int):
    """``schedule`` with step ``index`` of ``rank``'s program deleted."""
    programs = list(schedule.programs)
    steps = programs[rank].steps
    programs[rank] = replace(programs[rank], steps=steps[:index] + steps[index + 1:])
    return replace(schedule, programs=tuple(programs))


def test_packed_schedules_use_two_copies_and_ack_only_one_way_edges():
    # All-pairs exchanges need no ACK at all; a broadcast's root waits two calls back.
    for name, acks in (("allreduce", 0), ("allgather", 0), ("alltoall", 0), ("broadcast", 2)):
        _, schedule = packed_schedule(name, 3)
        assert schedule.stage_copies == 2 and schedule.staging_units == 2 * schedule.stage_units
        waits = [s for p in schedule.programs for s in p.steps if isinstance(s, Wait)]
        ack_waits = [s for s in waits if s.k <= 0]
        assert len(ack_waits) == acks, name
        assert all(s.k == -1 for s in ack_waits)  # per_call 1: the ACK of two calls back


def test_parity_ack_removed_is_a_race():
    spec, schedule = packed_schedule("broadcast", 2)
    root = schedule.programs[0].steps
    index = next(i for i, s in enumerate(root) if isinstance(s, Wait) and s.k <= 0)
    with pytest.raises(VerificationError, match="reused too early") as caught:
        verify(_without(schedule, 0, index), spec)
    assert caught.value.call == 2  # the rewrite of copy 0 in call 2 (calls 0..3 are proved)


def test_one_copy_without_acks_is_a_race():
    """The ACKs of an all-pairs exchange are implied only with two copies."""
    spec, schedule = packed_schedule("allreduce", 2)
    with pytest.raises(VerificationError, match="reused too early"):
        verify(replace(schedule, stage_copies=1), spec)


def test_ack_reaching_back_past_the_copies_is_refused():
    spec, schedule = packed_schedule("broadcast", 2)
    root = list(schedule.programs[0].steps)
    index = next(i for i, s in enumerate(root) if isinstance(s, Wait) and s.k <= 0)
    root[index] = replace(root[index], k=-2)
    programs = (replace(schedule.programs[0], steps=tuple(root)),) + schedule.programs[1:]
    with pytest.raises(VerificationError, match="reaches back more than 2 calls"):
        verify(replace(schedule, programs=programs), spec)


@pytest.mark.parametrize("name", ["allreduce", "broadcast", "gather", "reduce_scatter"])
def test_every_deleted_wait_or_notify_of_a_packed_schedule_is_caught(name):
    """Mutation test for two-copy schedules: each deletion is rejected by the verifier, or
    (a wait another wait implies) runs correctly in the simulator over four calls."""
    spec, schedule = packed_schedule(name, 3)
    dtype, op = (DType.INT32, "sum") if spec.is_reduce else (DType.INT32, None)
    rejected = 0
    for rank, program in enumerate(schedule.programs):
        for index, step in enumerate(program.steps):
            if not isinstance(step, (Wait, Notify)):
                continue
            mutant = _without(schedule, rank, index)
            try:
                verify(mutant, spec)
            except VerificationError:
                rejected += 1
                continue
            sets = [_inputs(spec, 5, dtype, seed) for seed in range(4)]
            for seed in range(10):
                got = simulate_calls(mutant, spec, sets, 5, dtype, op, calls=4, seed=seed)
                for inputs, outputs in zip(sets, got):
                    assert all(same_bits(g, w) for g, w in zip(outputs, evaluate(spec, inputs, 5, dtype, op)))
    assert rejected > 0


# A rank's input names a chunk several times, so one peer's signal carries 2 or 4 packed
# notifies a round while another's carries 1 (a random collective that ran wrong on the GPU).
REPEATED = """collective repeated {
    in[0] = z[0], z[0]
    in[1] = z[0], z[0], z[1], z[1]
    in[2] = z[0], z[1], z[0], z[1]
    in[3] = z[1], z[0]
    in[4] = z[0], z[0]
    in[5] = z[0], z[1], z[0], z[0]
    out[1] = z[0], z[0], z[1]
    out[2] = z[0]
    out[3] = z[0]
    out[4] = z[1]
    out[5] = z[0], z[1]
    reduce
}
"""


def _packed_notifies(schedule) -> list:
    """(signal, k) of every packed stage of every rank's channel program."""
    return sorted({(stage.signal, stage.k) for stage in packed_stages(schedule).values()},
                  key=lambda sk: (sk[0].owner, sk[0].index, sk[1]))


def _repeated():
    return pipeline.prepare(REPEATED, world_size=6, overrides={"packed": True}).prepared()


def _packed_schedules():
    out = [("repeated", _repeated().schedule)]
    for name in ("allreduce", "allgather", "reduce_scatter", "alltoall"):
        for world in (2, 3, 8):
            out.append((f"{name}-R{world}", pipeline.snac_stage(spec_for(name, world), LowerOptions(packed=True))))
    return out


@pytest.mark.parametrize("name, schedule", _packed_schedules(), ids=lambda v: v if isinstance(v, str) else "")
def test_packet_flags_of_a_round_lie_above_every_earlier_rounds(name, schedule):
    """A slot's place in staging depends on the call's count, so a packet an earlier call left
    may lie where this call expects another signal's packet: its flag must differ from every
    flag this call expects (Schedule.packet_flags), whichever signals the two are."""
    flags = schedule.packet_flags()
    notifies = _packed_notifies(schedule)
    assert notifies
    rounds = [[e * flags[s][0] + flags[s][1] + k for s, k in notifies] for e in range(4)]
    for e, flags_e in enumerate(rounds):
        assert len(set(flags_e)) == len(flags_e) and min(flags_e) >= 1
        if e:
            assert min(flags_e) > max(rounds[e - 1]), f"{name}: round {e}'s flags reach round {e - 1}'s"


def test_the_repeated_chunk_schedule_is_one_where_per_signal_flags_collide():
    # Why flags are not e * per_call + k: there two rounds' flags coincide in this schedule.
    schedule = dict(_packed_schedules())["repeated"]
    per_call = schedule.per_call()
    notifies = _packed_notifies(schedule)
    old = [{e * per_call[s] + k for s, k in notifies} for e in range(2)]
    assert old[0] & old[1]


def test_generated_packets_carry_the_schedules_flags():
    compiled = _repeated()
    schedule = compiled.schedule
    source = generate(schedule, compiled.spec, atom="ldst", arch="sm_90", dtype=DType.FLOAT16, op=ReduceOp.SUM).source
    stride = sum(schedule.per_call().values())
    assert stride > max(schedule.per_call().values())
    sends = re.findall(r"flag\d+ = purlin_ll_flag\(\(purlin_i64\)rd\.epoch \* (\d+) \+", source)
    tables = re.findall(r"const purlin_ll_batch<Geo[^=]*= \{(.*?)\n\s*\};", source, re.S)  # receive loops' tables
    polls = [m for t in tables for m in re.findall(r"\(purlin_i64\)rd\.epoch \* (\d+) \+ \((\d+)\)", t)]
    folded = [m for t in tables for m in re.findall(r"purlin_ll_flag\(\(purlin_i64\)rd\.epoch \* (\d+) \+ \((\d+)\)\)", t)]
    assert sends and set(sends) == {str(stride)}
    assert polls and {p for p, _ in polls} <= {str(stride), "0"}  # 0: a plain source's unused numbers
    # every table holds the values (for a timeout's report) and their flags, which the polls compare
    assert folded and 2 * len(folded) == len(polls)
    assert "(unsigned)b.expected" not in source and "purlin_ll_ready(q[u][c][j], b.flag[c][j])" in source


def test_a_timed_out_packet_wait_reports_the_signal_value_and_the_flags():
    from purlinc.runtime.timeouts import _awaited

    schedule = _repeated().schedule
    program = schedule.program(2, 0)
    index, wait = next((i, s) for i, s in enumerate(program.steps)
                       if isinstance(s, Wait) and schedule.per_call()[s.signal] == 2)
    stride, base = schedule.packet_flags()[wait.signal]
    record = {"signal_owner": wait.signal.owner, "signal_index": wait.signal.index,
              "expected": 3 * stride + base + 2, "observed": 7}
    assert _awaited(schedule, wait, record) == (
        f"the packets (LL) of signal r2.sig[{wait.signal.index}] >= {3 * 2 + 2}: packet flag {3 * stride + base + 3}, "
        "observed 7")
    # past 2^32 - 1 values the flag starts again at 1; the signal's value does not
    epoch = (2**32 - 1) // stride + 1
    late = {**record, "expected": epoch * stride + base + 2}
    assert _awaited(schedule, wait, late) == (
        f"the packets (LL) of signal r2.sig[{wait.signal.index}] >= {epoch * 2 + 2}: "
        f"packet flag {epoch * stride + base + 2 - (2**32 - 1) + 1}, observed 7")
    plain = {**record, "expected": 5}
    assert _awaited(schedule, None, plain) == f"signal r2.sig[{wait.signal.index}] >= 5, observed 7"


@pytest.mark.parametrize("around", [0, 2**32 - 1, 2**32, 2 * (2**32 - 1), 2**33, 2**63 - 2**20])
def test_packet_flags_are_never_zero_and_consecutive_ones_differ(around):
    """Staging starts zeroed, so no flag may be 0 (a slot no call has written would pass for a
    packet); a plain 32-bit cast of the value gave 0 at every multiple of 2^32."""
    values = range(max(0, around - 3000), around + 3000)
    flags = [packet_flag(v) for v in values]
    assert min(flags) >= 1 and max(flags) <= 2**32 - 1
    assert all(a != b for a, b in zip(flags, flags[1:]))
    assert len(set(flags)) == len(flags)  # no two values within 2^32 - 1 of each other share a flag
    assert packet_flag(around + PACKET_FLAG_PERIOD) == packet_flag(around)


# ---------------------------------------------------------------- many sources

def _signed(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def test_a_receive_loop_of_32_sources_takes_its_mask_through_the_signed_table():
    """At R=32 a reduce-scatter's consume reads its own input plain and 31 peers' packets: the
    loop's mask (bit j: source j is packets) sets 31 of 32 bits, past a C int.  The ranks share
    one body, so each rank's mask sits in its table row, as the int with the same 32 bits (the
    loop's unsigned parameter takes them back); it was refused as an internal error."""
    world = 32
    _, kernel = _kernel("reduce_scatter", world)
    rows = {int(m.group(2)): m.group(1) for m in re.finditer(r"\{ ([-0-9, ]+) \},  // rank (\d+)", kernel.source)}
    assert sorted(rows) == list(range(world)), "every rank shares the body"
    assert "purlin_ll_consume<Geo, 1, 32, true>" in kernel.source
    cells = {rank: [int(v) for v in row.split(", ")] for rank, row in rows.items()}
    column = cells[0].index(_signed(0xFFFFFFFE))  # rank 0's own input is source 0
    for rank, row in cells.items():
        mask = _signed(0xFFFFFFFF & ~(1 << rank))  # every source is packets but the rank's own
        assert row[column] == mask, f"rank {rank}'s mask column holds {row[column]}, not {mask}"


def test_packed_stages_past_32_sources_are_refused_and_a_plain_load_does_without():
    """A 33-source consume would need a 33rd mask bit: lowering refuses packed there (the
    verifier too, for a schedule made some other way), and a plain load's small-message
    buckets lower plain instead of failing."""
    from purlinc.errors import PurlinError
    from purlinc.runtime.tuned import prepare_tuned
    from purlinc.snac.direct import direct_push
    from purlinc.snac.verify import VerificationError, verify

    spec = spec_for("reduce_scatter", 33)
    with pytest.raises(PurlinError, match="packed .LL. stages combine at most 32 sources per output chunk; "
                                         "reduce_scatter for R=33 reduces 33"):
        pipeline.snac_stage(spec, LowerOptions(packed=True))
    made = direct_push(spec, LowerOptions(packed=True))  # the lowering itself, unchecked
    with pytest.raises(VerificationError, match="reads packets and 33 sources in all: a consume that reads "
                                                "packets has at most 32"):
        verify(made, spec)
    prepared, _ = prepare_tuned(EXAMPLES / "reduce_scatter.pln", 33)
    assert not any(p.bucket.packed or p.compiled.schedule.options.packed for p in prepared)


@pytest.mark.slow
def test_a_32_source_receive_loop_compiles(cache_dir):
    from purlinc.atom import nvrtc

    _, kernel = _kernel("reduce_scatter", 32)
    assert nvrtc.compile_cubin(kernel.source, kernel.filename, "sm_90")
