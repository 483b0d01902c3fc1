"""Multi-rank schedules on ONE GPU: a loopback LocalGroup (``share_devices=True``), every rank
on cuda:0 with a stream of its own, bit for bit against the spec's evaluator (copies) or the
SNAC simulator of the schedule that runs (reductions), outputs poisoned first.
``python3 tests/gpu/_common.py precompile loopback`` compiles the kernels first, in parallel.

This runs the generated kernels, their signals and their slice pipelining on any machine
with one GPU (their "remote" stores stay in that GPU's memory, so nothing here says anything
about link speed).  The two-GPU suite (test_local.py) runs the same paths over NVLink."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _common import (  # noqa: E402
    EXAMPLES, LOOPBACK_OTHER, LOOPBACK_OTHER_NAMES, LOOPBACK_SLICES, LOOPBACK_WORLDS, LOOPBACK_ZC_NAMES,
    LOOPBACK_ZC_SLICES, capture_per_rank, compare_outputs, examples, expected, inputs_for, on_rank_streams, poison,
    replay_per_rank, to_torch, torch_dtype,
)
from purlinc.dtypes import DType  # noqa: E402

pytestmark = [pytest.mark.gpu]
DEVICE = 0


@pytest.fixture(scope="module", params=LOOPBACK_WORLDS, ids=[f"R{w}" for w in LOOPBACK_WORLDS])
def group(request):
    import purlinc

    g = purlinc.LocalGroup([DEVICE] * request.param, share_devices=True)
    g.streams = [torch.cuda.Stream(device=DEVICE) for _ in range(request.param)]
    yield g
    g.close()


def _load(group, name, **options):
    """The collective, or a skip where the options do not apply to it (checked on the CPU
    first, so that a failure of the load itself fails the test)."""
    import purlinc
    from purlinc.errors import PurlinError
    from purlinc.runtime.collective import prepare

    if options:
        try:
            prepare(EXAMPLES / name, len(group), **options)
        except PurlinError as error:
            pytest.skip(str(error).splitlines()[0])
    return purlinc.load(EXAMPLES / name, group, **options)


def _call(coll, group, xs, outs, op="sum"):
    """One group call, each rank on its own stream, ordered after (and before) the current one."""
    on_rank_streams(group.streams, DEVICE, lambda: coll(xs, outs, op=op, streams=group.streams))
    coll.check()


def _buffers(spec, count, dtype, inputs, empty=None):
    """Inputs and poisoned outputs on cuda:0 (``empty(n, dtype)`` places them, e.g. in the heap)."""
    empty = empty or (lambda n, dt: [torch.empty(n, dtype=dt, device=f"cuda:{DEVICE}") for _ in range(spec.world_size)])
    xs, outs = [None] * spec.world_size, [None] * spec.world_size
    n_in = {len(layout) * count for layout in spec.inputs if len(layout)}
    n_out = {len(layout) * count for layout in spec.outputs if len(layout)}
    ins = {n: empty(n, torch_dtype(dtype)) for n in n_in}
    outs_by = {n: empty(n, torch_dtype(dtype)) for n in n_out}
    for r in range(spec.world_size):
        if len(spec.inputs[r]):
            xs[r] = ins[len(spec.inputs[r]) * count][r]
            xs[r].copy_(to_torch(inputs[r], dtype, DEVICE))
        if len(spec.outputs[r]):
            outs[r] = outs_by[len(spec.outputs[r]) * count][r]
            poison(outs[r])
    return xs, outs


def _want(schedule, spec, inputs, count, dtype, op):
    """What the outputs must hold, bit for bit.  A reduction's bits depend on the order the
    schedule combines the ranks' data in (a ring's partial sums are rounded to the dtype at
    every hop), which the SNAC simulator follows step by step; the spec's evaluator
    (one order for every schedule) matches it wherever the orders agree."""
    if not spec.is_reduce:
        return expected(spec, inputs, count, dtype, op)
    from purlinc.snac.simulate import simulate

    return simulate(schedule, spec, inputs, count, dtype, op, calls=1)


def _run(coll, group, count, dtype, rng, label, empty=None, op="sum", zero_copy=False):
    first = coll[0]._zc.twin if zero_copy else coll[0]  # the schedule that runs
    spec = first.compiled.spec
    inputs = inputs_for(spec, count, dtype, rng)
    xs, outs = _buffers(spec, count, dtype, inputs, empty)
    _call(coll, group, xs, outs, op)
    compare_outputs(spec, outs, _want(first.compiled.schedule, spec, inputs, count, dtype, op), dtype, label)


COUNTS = (1, 7, 1000, 4097, 100_003)

# Calls of different counts back to back: smaller counts after larger ones, pieces of the
# small staging region and of the large one, and several rounds where a unit of the 4 MiB
# staging the test loads with holds less than 300,000 float32 (every schedule with over 3 units).
ALTERNATING = (4096, 64, 2048, 8, 300_000, 16, 4096, 64, 100_003, 1)


@pytest.mark.parametrize("options", [dict(algorithm="direct-push"), dict(packed=True), dict(algorithm="ring"),
                                     dict(algorithm="ring", channels=2), dict(algorithm="direct-pull", channels=2)],
                         ids=["direct-push-x2", "packed", "ring", "ring-c2", "direct-pull-c2"])
@pytest.mark.parametrize("name", ["allgather.pln", "allreduce.pln", "alltoall.pln"])
def test_back_to_back_calls_of_alternating_counts(group, name, options, monkeypatch):
    """Every call of a run of different counts, issued with no synchronisation between calls and
    each rank delayed at random before each call (so that ranks run ahead of each other), is
    right bit for bit.  A unit's staging bytes, and a slice's within it, once depended on the
    call's count: a call with fewer elements than the one before wrote over units a slower peer,
    or slices a slower channel, was still reading (docs/SNAC.md, "Staging placement")."""
    monkeypatch.setenv("PURLIN_STAGE_MB", "4")
    coll = _load(group, name, **options)
    first = coll[0]
    spec, schedule, dtype = first.compiled.spec, first.compiled.schedule, DType.FLOAT32
    rng = np.random.default_rng(7)
    calls = []
    for count in ALTERNATING * 2:
        inputs = inputs_for(spec, count, dtype, rng)
        calls.append((count, inputs, *_buffers(spec, count, dtype, inputs)))
    delays = rng.integers(0, 20_000, (len(calls), len(group)))
    current = torch.cuda.current_stream(DEVICE)
    for s in group.streams:
        s.wait_stream(current)  # the buffers are ready; the calls below are not waited for
    for (count, _, xs, outs), delay in zip(calls, delays):
        for s, cycles in zip(group.streams, delay):
            with torch.cuda.stream(s):
                torch.cuda._sleep(int(cycles))
        coll(xs, outs, op="sum", streams=group.streams)
    for s in group.streams:
        current.wait_stream(s)
    torch.cuda.synchronize(DEVICE)
    coll.check()
    for i, (count, inputs, _, outs) in enumerate(calls):
        want = _want(schedule, spec, inputs, count, dtype, "sum")
        compare_outputs(spec, outs, want, dtype, f"{name} {options} call {i} (count {count}) of {len(calls)}")


@pytest.mark.parametrize("slices", LOOPBACK_SLICES)
@pytest.mark.parametrize("name", examples())
def test_direct_push_slices(group, name, slices):
    """direct-push with 1-4 slices per channel: with two or more, each rank's program pipelines
    them (slice s's stores, slice s's local copies, slice s-1's consumes, then s's notify)."""
    coll = _load(group, name, algorithm="direct-push", atom="ldst", channels=2, slices=slices)
    rng = np.random.default_rng(slices)
    try:
        for count in COUNTS:
            for dtype in (DType.FLOAT32, DType.BFLOAT16):
                _run(coll, group, count, dtype, rng, f"{name}/R{len(group)}/s{slices}/{dtype.value}/n={count}")
        if coll[0].compiled.spec.is_reduce:
            _run(coll, group, 1000, DType.FLOAT32, rng, f"{name}/s{slices}/max", op="max")
    finally:
        coll.close()


@pytest.mark.parametrize("algorithm,atom", LOOPBACK_OTHER)
@pytest.mark.parametrize("name", LOOPBACK_OTHER_NAMES)
def test_other_paths_with_slices(group, name, algorithm, atom):
    coll = _load(group, name, algorithm=algorithm, atom=atom, channels=2, slices=2)
    rng = np.random.default_rng(3)
    try:
        for count in (7, 4097, 100_003):
            _run(coll, group, count, DType.BFLOAT16, rng, f"{name}/{algorithm}/{atom}/R{len(group)}/n={count}")
    finally:
        coll.close()


@pytest.mark.parametrize("slices", LOOPBACK_ZC_SLICES)
@pytest.mark.parametrize("name", LOOPBACK_ZC_NAMES)
def test_zero_copy_slices(group, name, slices):
    """Buffers in the heap (group.empty) take the zero-copy schedules: producers store into
    the consumer's output (copies) or read its registered input, pipelined by slice."""
    coll = _load(group, name, algorithm="direct-push", atom="ldst", channels=2, slices=slices)
    rng = np.random.default_rng(9)
    made = []

    def heap_empty(n, dt):
        tensors = group.empty((n,), dt)
        made.extend(tensors)
        return tensors

    try:
        for count in (7, 4097, 100_003):
            _run(coll, group, count, DType.BFLOAT16, rng, f"{name}/zc/s{slices}/n={count}", empty=heap_empty,
                 zero_copy=True)
        assert any(c._zc is not None and c._zc.offsets for c in coll.ranks), "no call took the zero-copy path"
    finally:
        coll.close()
        del made[:]


def test_graph_replay_one_stream_per_rank(group):
    """Per-rank CUDA graphs (three calls each) replayed on the ranks' own streams."""
    coll = _load(group, "allreduce.pln", algorithm="direct-push", atom="ldst", channels=2, slices=2)
    spec = coll[0].compiled.spec
    rng = np.random.default_rng(4)
    count, dtype = 4097, DType.FLOAT32
    try:
        xs, outs = _buffers(spec, count, dtype, inputs_for(spec, count, dtype, rng))
        _call(coll, group, xs, outs)  # compile and load outside the capture
        def calls(r):
            for _ in range(3):
                coll[r](xs[r], outs[r])
        graphs = capture_per_rank(group.streams, calls)
        for it in range(3):
            inputs = inputs_for(spec, count, dtype, rng)
            for r in range(spec.world_size):
                xs[r].copy_(to_torch(inputs[r], dtype, DEVICE))
                poison(outs[r])
            replay_per_rank(graphs, group.streams, DEVICE)
            coll.check()
            # The captured calls ran the zero-copy twin on these buffers where PURLIN_GRAPH_BUFFERS
            # registers them (test_graph_buffers.py), the staged schedule otherwise.
            zc = coll[0]._zc
            ran = zc.twin if zc is not None and zc.graph_registered else coll[0]
            compare_outputs(spec, outs, _want(ran.compiled.schedule, spec, inputs, count, dtype, "sum"), dtype,
                   f"loopback graph {it}")
    finally:
        coll.close()


def test_one_stream_for_ranks_that_share_a_gpu_is_refused(group):
    from purlinc.runtime.errors import ArgumentError

    coll = _load(group, "allgather.pln")
    spec = coll[0].compiled.spec
    try:
        xs, outs = _buffers(spec, 8, DType.FLOAT32, inputs_for(spec, 8, DType.FLOAT32, np.random.default_rng(0)))
        with pytest.raises(ArgumentError, match="share cuda:0 and would run on one stream"):
            coll(xs, outs)
    finally:
        coll.close()


def test_the_ce_atom_is_refused_where_ranks_share_a_gpu(group):
    """Its stream waits are invisible to CUDA's scheduler: on one GPU a wait could block the
    queue of the notify it waits for (a loopback broadcast at R=5 never finished).  Refused
    before anything is allocated; the group goes on with a kernel atom."""
    import purlinc
    from purlinc.errors import PurlinError

    with pytest.raises(PurlinError, match="the ce atom cannot run where ranks share a GPU"):
        purlinc.load(EXAMPLES / "allgather.pln", group, atom="ce", channels=2)
    coll = _load(group, "allgather.pln", atom="ldst", channels=2)
    spec = coll[0].compiled.spec
    try:
        inputs = inputs_for(spec, 64, DType.FLOAT32, np.random.default_rng(5))
        xs, outs = _buffers(spec, 64, DType.FLOAT32, inputs)
        _call(coll, group, xs, outs)
        compare_outputs(spec, outs, expected(spec, inputs, 64, DType.FLOAT32, None), DType.FLOAT32,
                        "ldst after the ce refusal")
    finally:
        coll.close()


def _special_inputs(spec, count, dtype, rng) -> list[np.ndarray]:
    """Random inputs with NaNs (either sign, other payloads), infinities, values whose sum
    overflows, subnormals and negative zeros at random places, in every rank's data."""
    from purlinc.dtypes import from_float32, to_float32

    inputs = inputs_for(spec, count, dtype, rng)
    big = float(np.finfo(np.float16).max) if dtype is DType.FLOAT16 else 3.0e38
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, big, -big, 1e-40, -0.0], dtype=np.float32)
    payload = np.array([0x7FA00001, 0xFF800003], dtype=np.uint32).view(np.float32)  # NaNs, not the canonical one
    for r, values in enumerate(inputs):
        f = to_float32(values, dtype)
        where = rng.random(f.size) < 0.1
        f[where] = rng.choice(np.concatenate([specials, payload]), size=int(where.sum()))
        inputs[r] = from_float32(f, dtype, canonical_nan=False)  # the payloads are the point
    return inputs


def _agree(got: np.ndarray, want: np.ndarray, dtype: DType, label: str) -> None:
    """Bit for bit, except that a float32 or float16 NaN need only be a NaN (the GPU's arithmetic
    makes its own; bfloat16's every NaN is 0x7fc0, on both sides)."""
    if dtype is not DType.BFLOAT16:
        from purlinc.dtypes import to_float32

        g, w = to_float32(got, dtype), to_float32(want, dtype)
        assert np.array_equal(np.isnan(g), np.isnan(w)), f"{label}: NaNs at other places"
        got, want = got[~np.isnan(w)], want[~np.isnan(w)]
    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32}[got.itemsize]
    got, want = np.ascontiguousarray(got).view(bits), np.ascontiguousarray(want).view(bits)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{label}: {bad.size} elements differ, first at {bad[:5].tolist()}: "
                           f"got bits {[hex(b) for b in got[bad[:5]]]}, want {[hex(b) for b in want[bad[:5]]]}")


@pytest.mark.parametrize("options", [dict(algorithm="direct-push", atom="ldst", channels=2),
                                     dict(algorithm="direct-push", packed=True, channels=2),
                                     dict(algorithm="two-shot", atom="ldst", channels=2)],
                         ids=["direct-push", "ll", "two-shot"])
def test_special_values_reduce_as_the_simulator(group, options):
    """NaN, infinities, overflow, subnormals and -0 through the reductions (a pair of values
    rounded per instruction, NaNs fixed up apart): the simulator's bits, NaNs aside for
    float32/float16."""
    from _common import to_numpy

    coll = _load(group, "allreduce.pln", **options)
    spec = coll[0].compiled.spec
    rng = np.random.default_rng(11)
    try:
        for dtype in (DType.BFLOAT16, DType.FLOAT16, DType.FLOAT32):
            for count in (7, 4097):
                inputs = _special_inputs(spec, count, dtype, rng)
                xs, outs = _buffers(spec, count, dtype, inputs)
                _call(coll, group, xs, outs)
                want = _want(coll[0].compiled.schedule, spec, inputs, count, dtype, "sum")
                label = f"{options}/R{len(group)}/{dtype.value}/n={count}"
                for r, out in enumerate(outs):
                    _agree(to_numpy(out, dtype), want[r], dtype, f"{label} rank {r}")
    finally:
        coll.close()


def _set_call_counters(coll, epoch: int) -> None:
    """Every rank's per-block call counters (the epoch of its next round) set to ``epoch``."""
    from purlinc.runtime import driver

    for r in range(len(coll)):
        rank = coll[r]
        driver.set_current(rank.device)
        driver.copy_htod(rank.counters_ptr, np.full(rank.layout.counters_bytes // 8, epoch, np.uint64).tobytes())


def _call_counters(coll) -> list[int]:
    from purlinc.runtime import driver

    return [int(v) for r in range(len(coll))
            for v in np.frombuffer(driver.copy_dtoh(coll[r].counters_ptr, coll[r].layout.counters_bytes), np.uint64)]


def _staged_flags(coll, r: int) -> set[int]:
    """The flags of every packet rank r's staging holds (a schedule whose stages are all packed:
    staging is packets of u32 words {d0, flag, d1, flag}); a packet with data but flag 0, or
    with two different flags, fails."""
    from purlinc.runtime import driver

    rank = coll[r]
    driver.set_current(rank.device)
    words = np.frombuffer(driver.copy_dtoh(rank.stage_ptrs[rank.rank], rank.layout.stage_bytes), np.uint32).reshape(-1, 4)
    written = words[(words != 0).any(axis=1)]
    assert np.array_equal(written[:, 1], written[:, 3]), f"rank {r}: a packet's two flags differ"
    zero = np.flatnonzero(written[:, 1] == 0)
    assert zero.size == 0, f"rank {r}: {zero.size} packets hold data under flag 0, which unwritten staging matches"
    return set(written[:, 1].tolist())


@pytest.mark.parametrize("before", [0, 1], ids=["first-call-at-the-wrap", "one-call-before"])
def test_packet_flags_cross_the_32_bit_wrap(group, before):
    """LL flags are 32 bits of a 64-bit count of notifies (Schedule.packet_flags, packet_flag).
    Calls whose values pass 2^32 - 1 and 2^32 give the simulator's bits, and no packet they
    write carries flag 0: a plain 32-bit cast gave one there, which a slot no call had written
    yet (staging starts zeroed) passes for.  A fresh load's call counters are set so that its
    first call (before=0) or its second (before=1) runs the round whose values reach 2^32;
    counts grow, so later calls use staging no earlier call wrote."""
    from purlinc.snac.ir import Stage, packet_flag
    from purlinc.snac.packing import packed_stages

    coll = _load(group, "allreduce.pln", algorithm="direct-push", packed=True, channels=2)
    try:
        schedule = coll[0].compiled.schedule
        stages = [s for p in schedule.programs for s in p.steps if isinstance(s, Stage)]
        assert len(packed_stages(schedule)) == len(stages), "every stage packed: staging is all packets"
        flags = schedule.packet_flags()
        stride = {s for s, _ in flags.values()}.pop()
        wrap = -(-2**32 // stride) - 1  # the round whose values e * stride + base + k reach 2^32
        assert wrap * stride < 2**32 <= wrap * stride + stride
        start = wrap - before
        _set_call_counters(coll, start)
        rng = np.random.default_rng(29 + before)
        seen = set()
        for count in (1000, 4097, 20_000, 100_003):
            _run(coll, group, count, DType.BFLOAT16, rng, f"R{len(group)} from epoch {start} n={count}")
            seen |= {f for r in range(len(group)) for f in _staged_flags(coll, r)}
        end = max(_call_counters(coll))
        assert min(_call_counters(coll)) > wrap, f"the calls did not run past round {wrap}"
        per_call = schedule.per_call()
        ran = {packet_flag(e * stride + base + k) for e in range(start, end) for signal, (_, base) in flags.items()
               for k in range(1, per_call[signal] + 1)}
        assert seen <= ran, f"flags no round ran: {sorted(seen - ran)[:5]}"
        boundary = {packet_flag(v) for v in range(2**32 - stride, 2**32 + stride + 1)}
        assert seen & boundary, "no packet of the rounds around 2^32 was seen in staging"
    finally:
        coll.close()


@pytest.mark.parametrize("name", ["reduce_scatter.pln", "allreduce.pln"])
def test_packed_receive_loops_of_32_sources(name):
    """R=32, the most sources a packed (LL) consume takes: each rank's receive loop reads its
    own input plain and 31 peers' packets, its mask's 32 bits passed through the kernel's
    signed table.  Three calls of new data, every rank bit for bit against the simulator."""
    import purlinc

    world = 32
    group = purlinc.LocalGroup([DEVICE] * world, share_devices=True)
    try:
        group.streams = [torch.cuda.Stream(device=DEVICE) for _ in range(world)]
        coll = _load(group, name, packed=True, channels=1)
        assert coll[0].compiled.schedule.options.packed
        rng = np.random.default_rng(32)
        for count in (1, 1000, 4097):
            _run(coll, group, count, DType.BFLOAT16, rng, f"{name}/packed/R32/n={count}")
    finally:
        group.close()
