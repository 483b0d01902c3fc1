"""Captured calls on ordinary torch buffers run without staging (purlinc/runtime/graphbuffers.py),
on ONE GPU: a loopback LocalGroup, every rank's call on its own stream forked from the capturing
one, so the whole group call is one CUDA graph.

Each test fills the staged schedule's staging space with a pattern, captures and replays, and
checks (1) every replay's outputs bit for bit against the SNAC simulator of the schedule that
ran, on fresh inputs each time, (2) that the captured calls took the registered schedule
(``graph_registered``), and (3) that the staging space still holds the pattern: no staging copy
ran.  The same capture with ``PURLIN_GRAPH_BUFFERS=stage`` overwrites the pattern, which shows
the check can fail."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _common import EXAMPLES, compare_outputs, inputs_for, poison, to_torch, torch_dtype  # noqa: E402
from purlinc.dtypes import DType  # noqa: E402

pytestmark = [pytest.mark.gpu]
DEVICE = 0
PATTERN = 0x5A
CHECKED_BYTES = 1 << 20  # the start of each staging region: any staged call writes there


@pytest.fixture(scope="module", params=(2, 4), ids=("R2", "R4"))
def group(request):
    import purlinc

    g = purlinc.LocalGroup([DEVICE] * request.param, share_devices=True)
    g.streams = [torch.cuda.Stream(device=DEVICE) for _ in range(request.param)]
    yield g
    g.close()


def _collectives(coll):
    """Every rank's staged Collective of a loaded group collective (every bucket of a tuned one)."""
    groups = getattr(coll, "variants", None) or [coll]
    return [rank for g in groups for rank in g.ranks]


def _fill_staging(coll) -> list[tuple[int, int]]:
    from purlinc.runtime import driver

    regions = []
    for c in _collectives(coll):
        n = min(c.layout.stage_bytes, CHECKED_BYTES)
        if n:
            ptr = c.comm.heap.ptr(c.rank, c.layout.stage)
            driver.memset_d8(ptr, PATTERN, n)
            regions.append((ptr, n))
    torch.cuda.synchronize(DEVICE)
    return regions


def _staging_untouched(regions) -> bool:
    from purlinc.runtime import driver

    torch.cuda.synchronize(DEVICE)
    return all(set(driver.copy_dtoh(ptr, n)) == {PATTERN} for ptr, n in regions)


def _group_call(coll, group, xs, outs, calls=1):
    """``calls`` group calls, each rank on its own stream forked from (and joined back into)
    the current stream, so a capture on the current stream records them all."""
    current = torch.cuda.current_stream(DEVICE)
    for _ in range(calls):
        for s in group.streams:
            s.wait_stream(current)
        coll(xs, outs, streams=group.streams)
        for s in group.streams:
            current.wait_stream(s)


def _buffers(spec, count, dtype):
    dt = torch_dtype(dtype)
    xs = [torch.empty(len(spec.inputs[r]) * count, dtype=dt, device=f"cuda:{DEVICE}") if len(spec.inputs[r]) else None
          for r in range(spec.world_size)]
    outs = [torch.empty(len(spec.outputs[r]) * count, dtype=dt, device=f"cuda:{DEVICE}")
            if len(spec.outputs[r]) else None for r in range(spec.world_size)]
    return xs, outs


def _fill(xs, outs, inputs, dtype):
    for x, values in zip(xs, inputs):
        if x is not None:
            x.copy_(to_torch(values, dtype, DEVICE))
    for out in outs:
        if out is not None:
            poison(out)
    torch.cuda.synchronize(DEVICE)


def _want(collective, spec, inputs, count, dtype):
    from purlinc.snac.simulate import simulate
    from _common import expected

    if not spec.is_reduce:
        return expected(spec, inputs, count, dtype, None)
    return simulate(collective.compiled.schedule, spec, inputs, count, dtype, "sum", calls=1)


def _capture_and_replay(coll, group, name, count, dtype, rng, replays=3, calls=3):
    """Capture ``calls`` group calls on ordinary buffers into one graph, replay it on fresh
    inputs; returns (the staged Collective of rank 0 that served the size, staging untouched)."""
    first = coll[0]
    staged = first.variant_for(count, dtype.itemsize) if hasattr(first, "variant_for") else first
    spec = staged.compiled.spec
    xs, outs = _buffers(spec, count, dtype)
    _fill(xs, outs, inputs_for(spec, count, dtype, rng), dtype)
    _group_call(coll, group, xs, outs)  # eager: stages, compiles and loads; records the pointers
    torch.cuda.synchronize(DEVICE)
    coll.check()
    registered_before = staged._zc.graph_registered
    regions = _fill_staging(coll)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(device=DEVICE)
    with torch.cuda.graph(graph, stream=side):
        _group_call(coll, group, xs, outs, calls)
    ran = staged._zc.twin if staged._zc.graph_registered > registered_before else staged
    for it in range(replays):
        inputs = inputs_for(spec, count, dtype, rng)
        _fill(xs, outs, inputs, dtype)
        graph.replay()
        torch.cuda.synchronize(DEVICE)
        coll.check()
        compare_outputs(spec, outs, _want(ran, spec, inputs, count, dtype), dtype, f"{name} replay {it}")
    return staged, ran, _staging_untouched(regions)


@pytest.mark.parametrize("name", ["allreduce.pln", "allgather.pln", "reduce_scatter.pln", "broadcast.pln"])
@pytest.mark.parametrize("count", [4097, 100_003])
def test_captured_calls_read_and_write_callers_buffers(group, name, count, monkeypatch):
    import purlinc

    monkeypatch.setenv("PURLIN_GRAPH_BUFFERS", "auto")
    coll = purlinc.load(EXAMPLES / name, group, algorithm="direct-push", atom="ldst", channels=2)
    rng = np.random.default_rng(count)
    try:
        staged, ran, untouched = _capture_and_replay(coll, group, name, count, DType.BFLOAT16, rng)
        assert ran is staged._zc.twin, "the captured calls staged"
        assert all(c._zc.graph_registered >= 3 for c in coll.ranks)  # every rank, every captured call
        assert untouched, "a staging copy ran during the replays"
    finally:
        coll.close()


def test_stage_setting_keeps_staging_and_the_check_sees_it(group, monkeypatch):
    import purlinc

    monkeypatch.setenv("PURLIN_GRAPH_BUFFERS", "stage")
    coll = purlinc.load(EXAMPLES / "allreduce.pln", group, algorithm="direct-push", atom="ldst", channels=2)
    try:
        staged, ran, untouched = _capture_and_replay(coll, group, "allreduce staged", 4097, DType.BFLOAT16,
                                                     np.random.default_rng(1))
        assert ran is staged and staged._zc.graph_registered == 0
        assert not untouched, "staged calls left the staging space untouched: the check cannot see copies"
    finally:
        coll.close()


@pytest.mark.parametrize("count", [256, 65536, 1 << 20])
def test_default_load_registers_where_the_setting_says(group, count, monkeypatch):
    """A plain load (size buckets): with PURLIN_GRAPH_BUFFERS=register every size's captured calls
    run on the caller's buffers, LL-packed buckets included."""
    import purlinc

    monkeypatch.setenv("PURLIN_GRAPH_BUFFERS", "register")
    coll = purlinc.load(EXAMPLES / "allreduce.pln", group)
    try:
        staged, ran, untouched = _capture_and_replay(coll, group, f"allreduce default n={count}", count,
                                                     DType.BFLOAT16, np.random.default_rng(count))
        assert ran is staged._zc.twin and untouched
    finally:
        coll.close()


def test_per_rank_graphs_reuse_the_group_calls_pointers(group, monkeypatch):
    """Per-rank graphs (each rank captured on its own stream) after one eager group call."""
    import purlinc

    monkeypatch.setenv("PURLIN_GRAPH_BUFFERS", "auto")
    coll = purlinc.load(EXAMPLES / "allgather.pln", group, algorithm="direct-push", atom="ldst", channels=2)
    spec = coll[0].compiled.spec
    count, dtype, rng = 4097, DType.FLOAT32, np.random.default_rng(7)
    try:
        xs, outs = _buffers(spec, count, dtype)
        _fill(xs, outs, inputs_for(spec, count, dtype, rng), dtype)
        _group_call(coll, group, xs, outs)
        torch.cuda.synchronize(DEVICE)
        regions = _fill_staging(coll)
        graphs = []
        for r, s in enumerate(group.streams):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                coll[r](xs[r], outs[r])
            graphs.append(g)
        assert all(c._zc.graph_registered == 1 for c in coll.ranks)
        inputs = inputs_for(spec, count, dtype, rng)
        _fill(xs, outs, inputs, dtype)
        for g, s in zip(graphs, group.streams):
            s.wait_stream(torch.cuda.current_stream(DEVICE))
            with torch.cuda.stream(s):
                g.replay()
        torch.cuda.synchronize(DEVICE)
        coll.check()
        compare_outputs(spec, outs, _want(coll[0]._zc.twin, spec, inputs, count, dtype), dtype, "per-rank graphs")
        assert _staging_untouched(regions)
    finally:
        coll.close()
