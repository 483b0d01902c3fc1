"""Zero-copy through a LocalGroup (one process, every visible GPU a rank): buffers from the
symmetric heap (group.empty, comm.mem_pool, comm.alloc) take the registered schedules; every
standard example, fresh random data, poisoned outputs, every rank checked against the
evaluator, eager and CUDA-graph replay; heap growth, exhaustion and freed-buffer errors."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _common import (  # noqa: E402
    EXAMPLES, compare_outputs, examples, expected, inputs_for, poison, to_torch, torch_dtype,
)
from purlinc.dtypes import DType  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
DEVICES = list(range(torch.cuda.device_count()))
ALGORITHMS = (None, "direct-push", "direct-pull", "two-shot", "ring")  # None: the tuned default


@pytest.fixture(scope="module")
def group():
    import purlinc

    g = purlinc.LocalGroup(DEVICES, heap_bytes=8 << 20)  # small first segment: the tests make it grow
    yield g
    g.close()


def _sync():
    for d in DEVICES:
        torch.cuda.synchronize(d)


def _rank_collective(coll, r, count, itemsize):
    """Rank r's Collective that runs a call of ``count`` (the size bucket's, for a tuned load)."""
    c = coll[r]
    return c.variant_for(count, itemsize) if hasattr(c, "variant_for") else c


def _heap_buffers(group, spec, count, dtype):
    """Heap buffers allocated alike on every rank (the largest any rank needs: the heaps stay in
    step, so one offset names the same buffer everywhere); each rank passes its own part."""
    tdtype = torch_dtype(dtype)
    n_in = max(len(i) for i in spec.inputs) * count
    n_out = max(len(o) for o in spec.outputs) * count
    xs, outs = [], []
    for r, comm in enumerate(group):
        x, out = comm.empty((max(n_in, 1),), tdtype), comm.empty((max(n_out, 1),), tdtype)
        xs.append(x[: len(spec.inputs[r]) * count] if len(spec.inputs[r]) else None)
        outs.append(out[: len(spec.outputs[r]) * count] if len(spec.outputs[r]) else None)
    return xs, outs


def _fill(spec, xs, outs, count, dtype, rng):
    inputs = inputs_for(spec, count, dtype, rng)
    for r, x in enumerate(xs):
        if x is not None:
            x.copy_(to_torch(inputs[r], dtype, r))
    for out in outs:
        if out is not None:
            poison(out)
    _sync()
    return inputs


def _zero_copy_ran(coll, count, itemsize) -> bool:
    """Every rank's call went through its registered twin (whose kernel is then loaded)."""
    used = []
    for r in range(len(DEVICES)):
        c = _rank_collective(coll, r, count, itemsize)
        used.append(c._zc is not None and bool(c._zc.twin._variants))
    return all(used)


CASES = [(n, a) for n in examples() for a in ALGORITHMS]


@pytest.mark.parametrize("name,algorithm", CASES)
def test_zero_copy_every_example(group, name, algorithm):
    import purlinc
    from purlinc.errors import PurlinError

    try:
        coll = purlinc.load(EXAMPLES / name, group, algorithm=algorithm) if algorithm else purlinc.load(EXAMPLES / name, group)
    except PurlinError as error:
        pytest.skip(str(error).splitlines()[0])
    rng = np.random.default_rng(abs(hash((name, algorithm))) % 2**32)
    spec = (coll.variants[0][0] if hasattr(coll, "variants") else coll[0]).compiled.spec
    try:
        for count, dtype in ((1, DType.FLOAT32), (1000, DType.BFLOAT16), (4097, DType.FLOAT32), (300_000, DType.BFLOAT16)):
            xs, outs = _heap_buffers(group, spec, count, dtype)
            label = f"{name}/{algorithm or 'default'}/{dtype.value}/n={count}"
            for it in range(2):  # eager, twice with fresh data
                inputs = _fill(spec, xs, outs, count, dtype, rng)
                coll(xs, outs, op="sum")
                _sync()
                coll.check()
                compare_outputs(spec, outs, expected(spec, inputs, count, dtype, "sum"), dtype, f"{label} eager {it}")
            staged = _rank_collective(coll, 0, count, dtype.itemsize)
            if staged._zc is not None and not staged._zc.prefer_staged:  # packed (LL) buckets stage
                assert _zero_copy_ran(coll, count, dtype.itemsize), f"{label}: the staged path ran on heap buffers"
            # CUDA-graph replay: several calls per graph, fresh data before each replay
            graphs = []
            for r in range(len(DEVICES)):
                with torch.cuda.device(r):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, stream=torch.cuda.Stream(device=r)):
                        for _ in range(3):
                            coll[r](xs[r], outs[r], op="sum")
                    graphs.append(g)
            _sync()
            for it in range(2):
                inputs = _fill(spec, xs, outs, count, dtype, rng)
                for g in graphs:
                    g.replay()
                _sync()
                coll.check()
                compare_outputs(spec, outs, expected(spec, inputs, count, dtype, "sum"), dtype, f"{label} graph {it}")
            del graphs, xs, outs
    finally:
        coll.close()


def test_heap_grows_on_demand(group):
    import purlinc

    before = [len(comm.heap.segments) for comm in group]
    # More than any free block (earlier tests may have left grown segments behind): must grow.
    need = max(comm.heap.largest_free for comm in group) + (8 << 20)
    big = [comm.empty((need,), torch.uint8) for comm in group]
    assert all(len(comm.heap.segments) > b for comm, b in zip(group, before)), [c.heap.segments for c in group]
    assert len({comm.heap.offset_of(t.data_ptr())[0] for comm, t in zip(group, big)}) == 1
    # a collective on buffers in the new segment: zero-copy, correct
    coll = purlinc.load(EXAMPLES / "allgather.pln", group, algorithm="direct-push")
    try:
        spec, count, dtype = coll[0].compiled.spec, 1 << 20, DType.BFLOAT16
        xs, outs = _heap_buffers(group, spec, count, dtype)
        inputs = _fill(spec, xs, outs, count, dtype, np.random.default_rng(3))
        coll(xs, outs)
        _sync()
        compare_outputs(spec, outs, expected(spec, inputs, count, dtype, None), dtype, "allgather in a grown segment")
        assert _zero_copy_ran(coll, count, 2)
    finally:
        coll.close()
    del big


def test_heap_exhaustion_is_a_clear_error(monkeypatch):
    import purlinc
    from purlinc.runtime.errors import HeapExhaustedError

    monkeypatch.setenv("PURLIN_HEAP_MAX_MB", "16")
    g = purlinc.LocalGroup(DEVICES, heap_bytes=8 << 20)
    try:
        with pytest.raises(HeapExhaustedError) as caught:
            g.empty((32 << 20,), torch.uint8)
        assert caught.value.requested == 32 << 20 and caught.value.available <= 16 << 20
        assert "needs 33554432 bytes" in str(caught.value)
        g.empty((1 << 20,), torch.uint8)  # the heap still works after the refusal
    finally:
        g.close()


def test_freed_buffer_is_refused_before_launch(group):
    import purlinc
    from purlinc.runtime import symmetric
    from purlinc.runtime.errors import FreedBufferError

    coll = purlinc.load(EXAMPLES / "allgather.pln", group, algorithm="direct-push")
    try:
        count = 4096
        blocks = [comm.alloc(count * 4) for comm in group]
        xs = [symmetric.tensor_of(b, (count,), torch.float32) for b in blocks]
        outs = [comm.empty((len(DEVICES) * count,), torch.float32) for comm in group]
        for b in blocks:
            b.free()
        with pytest.raises(FreedBufferError, match="not in a live block"):
            coll(xs, outs)
        # nothing was launched: the collective still runs correctly on live buffers
        spec = coll[0].compiled.spec
        xs, outs = _heap_buffers(group, spec, count, DType.FLOAT32)
        inputs = _fill(spec, xs, outs, count, DType.FLOAT32, np.random.default_rng(9))
        coll(xs, outs)
        _sync()
        coll.check()
        compare_outputs(spec, outs, expected(spec, inputs, count, DType.FLOAT32, None), DType.FLOAT32, "after refusal")
    finally:
        coll.close()


def test_mem_pool_places_torch_allocations_in_the_heap(group):
    import purlinc

    coll = purlinc.load(EXAMPLES / "allreduce.pln", group)
    try:
        spec, count, dtype = coll[0].variants[0].compiled.spec, 65536, DType.BFLOAT16
        pools = [comm.mem_pool(64 << 20) for comm in group]
        xs, outs = [], []
        for r, pool in enumerate(pools):
            with torch.cuda.device(r), torch.cuda.use_mem_pool(pool):
                xs.append(torch.empty(len(spec.inputs[r]) * count, dtype=torch.bfloat16, device=f"cuda:{r}"))
                outs.append(torch.empty(len(spec.outputs[r]) * count, dtype=torch.bfloat16, device=f"cuda:{r}"))
        for comm, x, pool in zip(group, xs, pools):
            region = getattr(pool, "purlin_region", None)
            assert comm.heap.locate(x.data_ptr(), x.numel() * 2) is not None, (
                f"cuda:{comm.device}: tensor at {x.data_ptr():#x} is outside the heap; pool region "
                f"{(region.block.ptr if region else 0):#x}+{region.block.nbytes if region else 0}, "
                f"allocator calls {getattr(region, 'calls', '?')}, failures {getattr(region, 'failed', '?')}")
        for it in range(2):
            inputs = _fill(spec, xs, outs, count, dtype, np.random.default_rng(it))
            coll(xs, outs)
            _sync()
            compare_outputs(spec, outs, expected(spec, inputs, count, dtype, "sum"), dtype, f"mem_pool allreduce {it}")
        assert _zero_copy_ran(coll, count, 2)
    finally:
        coll.close()


def test_ranks_disagreeing_on_zero_copy_is_refused_before_launch(group):
    import purlinc
    from purlinc.runtime.errors import ArgumentError, MismatchError

    coll = purlinc.load(EXAMPLES / "allgather.pln", group, algorithm="direct-push")
    try:
        count = 1024
        spec = coll[0].compiled.spec
        xs, outs = _heap_buffers(group, spec, count, DType.FLOAT32)
        ordinary = torch.empty(outs[-1].numel(), dtype=torch.float32, device=f"cuda:{DEVICES[-1]}")
        with pytest.raises(MismatchError, match="ranks disagree on the zero-copy path"):
            coll(xs, outs[:-1] + [ordinary])
        # The group call compares every rank's choice before any rank launches: nothing ran,
        # the collective's signals are in step, and a consistent call works.
        inputs = _fill(spec, xs, outs, count, DType.FLOAT32, np.random.default_rng(11))
        coll(xs, outs)
        _sync()
        coll.check()
        compare_outputs(spec, outs, expected(spec, inputs, count, DType.FLOAT32, None), DType.FLOAT32, "after a mismatch")
        # a per-rank call on heap buffers no group call has agreed on is refused too
        x2, out2 = _heap_buffers(group, spec, count, DType.FLOAT32)
        with pytest.raises(ArgumentError, match="no group call has agreed on yet"):
            coll[0](x2[0], out2[0])
    finally:
        coll.close()


def test_buffer_of_another_communicator_is_refused(group):
    import purlinc
    from purlinc.runtime.errors import ArgumentError

    other = purlinc.LocalGroup(DEVICES, heap_bytes=4 << 20)
    coll = purlinc.load(EXAMPLES / "allgather.pln", group, algorithm="direct-push")
    try:
        count = 256
        foreign = other.empty((count,), torch.float32)
        outs = [comm.empty((len(DEVICES) * count,), torch.float32) for comm in group]
        with pytest.raises(ArgumentError, match="another communicator"):
            coll(foreign, outs)
    finally:
        coll.close()
        other.close()


def test_cupy_views_of_heap_blocks(group):
    cupy = pytest.importorskip("cupy")
    import purlinc

    coll = purlinc.load(EXAMPLES / "allgather.pln", group, algorithm="direct-push")
    try:
        count, world = 1000, len(DEVICES)
        xs, outs, rng = [], [], np.random.default_rng(4)
        want = []
        for r, comm in enumerate(group):
            with cupy.cuda.Device(r):
                x = cupy.asarray(comm.alloc(count * 4)).view(cupy.float32)
                out = cupy.asarray(comm.alloc(world * count * 4)).view(cupy.float32)
                data = rng.standard_normal(count).astype(np.float32)
                x[...] = cupy.asarray(data)
                out.fill(np.nan)
            xs.append(x)
            outs.append(out)
            want.append(data)
        for r in range(world):
            cupy.cuda.Device(r).synchronize()
        coll(xs, outs)
        _sync()
        for r in range(world):
            with cupy.cuda.Device(r):
                np.testing.assert_array_equal(cupy.asnumpy(outs[r]), np.concatenate(want))
        assert _zero_copy_ran(coll, count, 4)
    finally:
        coll.close()
