"""The symmetric heap's growth and block tracking, the zero-copy choice and agreement, and the
registered twins, all without a GPU (the heap's ``grow`` is a fake that hands out addresses)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from purlinc import pipeline
from purlinc.atom.abi import StagingPlacement
from purlinc.dtypes import DType, ReduceOp
from purlinc.runtime import symmetric, zerocopy
from purlinc.runtime.collective import layout_sizes, prepare
from purlinc.runtime.errors import ArgumentError, FreedBufferError, HeapExhaustedError, MismatchError
from purlinc.runtime.heap import SEGMENT_ALIGN, SymmetricHeap
from purlinc.runtime.validate import CallShape

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MiB = 1 << 20


class FakeGrow:
    """Segments at made-up, far-apart addresses for two ranks; records every growth."""

    def __init__(self):
        self.calls = []

    def __call__(self, index, size):
        self.calls.append((index, size))
        return [(1 << 40) * (rank + 1) + (index << 36) for rank in range(2)]


def heap(rank=0, size=4 * MiB, limit=0, grow=True):
    g = FakeGrow() if grow else None
    bases = [(1 << 40) * (r + 1) for r in range(2)]
    return SymmetricHeap(rank, size, bases, grow=g, segment_bytes=size, limit_bytes=limit), g


def test_heap_grows_by_segments_and_pointers_follow_the_segment():
    h, g = heap()
    a = h.alloc(3 * MiB, "a")
    b = h.alloc(3 * MiB, "b")  # does not fit in segment 0 any more
    assert g.calls == [(1, 4 * MiB)]
    assert len(h.segments) == 2 and h.size == 8 * MiB
    assert a == 0 and b == 4 * MiB  # heap offsets continue across segments
    assert h.ptr(0, b) == (1 << 40) + (1 << 36)
    assert h.ptrs(b) == [(1 << 40) + (1 << 36), (2 << 40) + (1 << 36)]
    big = h.alloc(9 * MiB, "big")  # larger than a growth step: a segment of its own size
    assert g.calls[-1] == (2, 10 * MiB) and h.segment_of(big).size == 10 * MiB
    h.free(a)
    assert h.alloc(1 * MiB, "c") == 0  # freed space is reused before growing again
    assert len(g.calls) == 2


def test_growth_rounds_segments_to_whole_pages():
    h, g = heap(size=SEGMENT_ALIGN)
    h.alloc(SEGMENT_ALIGN, "fill")
    h.alloc(SEGMENT_ALIGN + 1, "odd")
    assert g.calls == [(1, 2 * SEGMENT_ALIGN)]


def test_exhaustion_names_requested_and_available():
    h, _ = heap(size=4 * MiB, limit=8 * MiB)
    h.alloc(3 * MiB, "a")
    h.alloc(3 * MiB, "b")  # grows to the limit
    with pytest.raises(HeapExhaustedError) as caught:
        h.alloc(5 * MiB, "comm.empty([5 MiB])")
    e = caught.value
    assert e.requested == 5 * MiB and e.available == h.largest_free == 1 * MiB
    assert "comm.empty([5 MiB]) needs 5242880 bytes" in str(e) and "limit 8388608" in str(e)
    assert "PURLIN_HEAP_MAX_MB" in " ".join(e.notes)


def test_a_heap_without_grow_is_exhausted_at_once():
    h, _ = heap(grow=False)
    with pytest.raises(HeapExhaustedError, match="needs 8388608 bytes"):
        h.alloc(8 * MiB, "x")


def test_locate_live_freed_and_outside():
    h, _ = heap()
    staging = h.alloc(4096, "staging")  # Purlin's own space, not a user block
    off = h.alloc_user(1000, "user")
    ptr = h.ptr(0, off)
    hit = h.locate(ptr + 8, 512)
    assert hit.offset == off + 8 and hit.block == (off, 1024)
    assert h.locate(0x1234, 8) is None  # not in the heap: an ordinary buffer
    with pytest.raises(ArgumentError, match="runs .* past the end"):
        h.locate(ptr, 2048)
    with pytest.raises(FreedBufferError, match="not in a live block"):
        h.locate(h.ptr(0, staging), 16)
    gen = h.generation
    h.free_user(off)
    assert h.generation == gen + 1
    with pytest.raises(FreedBufferError, match="freed"):
        h.locate(ptr, 16)
    with pytest.raises(KeyError):
        h.free_user(off)


def test_same_sequence_same_offsets_on_every_rank():
    h0, _ = heap(rank=0)
    h1, _ = heap(rank=1)
    for h in (h0, h1):
        h.alloc_user(100, "a")
        b = h.alloc_user(5 * MiB, "b")  # grows
        h.free_user(b)
        h.alloc_user(300, "c")
    assert sorted(h0.user) == sorted(h1.user)
    assert [s.start for s in h0.segments] == [s.start for s in h1.segments]


# --------------------------------------------------------------------------- blocks


class FakeComm:
    def __init__(self, rank=0, exchange=None):
        self.rank, self.device, self.closed = rank, 0, False
        self.heap, _ = heap(rank=rank)
        self._exchange = exchange

    def allgather(self, obj):
        return self._exchange(obj)


def test_heap_block_free_and_array_interface():
    comm = FakeComm()
    block = symmetric.alloc(comm, 1000)
    assert block.ptr == comm.heap.ptr(0, block.offset)
    assert block.peer_ptr(1) == comm.heap.ptr(1, block.offset)
    cai = block.__cuda_array_interface__
    assert cai["shape"] == (1000,) and cai["data"][0] == block.ptr and cai["typestr"] == "|u1"
    assert comm.heap.locate(block.ptr, 1000) is not None
    block.free()
    block.free()  # idempotent
    with pytest.raises(FreedBufferError):
        comm.heap.locate(block.ptr, 1000)
    with pytest.raises(ArgumentError, match="was freed"):
        block.__cuda_array_interface__


def test_heap_block_freed_when_dropped():
    comm = FakeComm()
    block = symmetric.alloc(comm, 64)
    offset = block.offset
    del block
    assert offset not in comm.heap.user


def test_blocks_checked_across_ranks():
    comm = FakeComm(exchange=lambda obj: [obj, ("heap-block", obj[1] + 256, obj[2])])
    with pytest.raises(MismatchError, match="ranks got different heap blocks: rank 0: offset 0, 64 bytes, rank 1: offset 256"):
        symmetric.alloc(comm, 64)
    assert not comm.heap.user  # the failed block was given back


def test_pool_region_suballocates_and_reports():
    comm = FakeComm()
    region = symmetric.PoolRegion(symmetric.alloc(comm, 4 * MiB))
    p = region.malloc(2 * MiB, 0, None)
    q = region.malloc(2 * MiB, 0, None)
    assert p == region.block.ptr and q == p + 2 * MiB
    assert region.malloc(1, 0, None) == 0 and "largest free block is 0" in region.failed[-1]
    assert region.malloc(16, 1, None) == 0 and "cuda:1" in region.failed[-1]
    region.free(p, 2 * MiB, 0, None)
    assert region.malloc(1024, 0, None) == p


# --------------------------------------------------------------------------- twins and choice


@pytest.mark.parametrize("name", ["allgather", "alltoall", "broadcast", "gather", "scatter"])
def test_copy_collectives_get_a_registered_twin(name):
    compiled = prepare(EXAMPLES / f"{name}.pln", 2, algorithm="direct-push", channels=1)
    assert not compiled.options.registered
    twin = zerocopy.twin_compiled(compiled)
    assert twin is not None and twin.options.registered
    assert zerocopy.peer_spaces(twin.schedule) == twin.options.registered
    assert zerocopy.peer_spaces(compiled.schedule) == frozenset()
    # pushing straight into the peer's output needs no staging at all
    assert layout_sizes(twin)[0] == 0 and twin is not compiled and twin.key != compiled.key


def test_pull_twin_reads_registered_inputs():
    compiled = prepare(EXAMPLES / "allreduce.pln", 2, algorithm="direct-pull", channels=1)
    twin = zerocopy.twin_compiled(compiled)
    assert twin is not None and "in" in twin.options.registered


def test_no_twin_for_ce():
    assert zerocopy.twin_compiled(prepare(EXAMPLES / "allgather.pln", 2, atom="ce")) is None


def test_packed_push_twin_drops_packing():
    packed = prepare(EXAMPLES / "allgather.pln", 2, algorithm="direct-push", channels=8, packed=True)
    twin = zerocopy.twin_compiled(packed)  # registered out refuses packed stages
    assert twin.options.registered == {"out"} and not twin.options.packed and twin.options.channels == 8


@pytest.mark.parametrize("name", ["allreduce", "reduce_scatter", "reduce"])
def test_push_reductions_fall_back_to_pull_twins(name):
    compiled = prepare(EXAMPLES / f"{name}.pln", 2, algorithm="direct-push", channels=4)
    twin = zerocopy.twin_compiled(compiled)
    assert twin.options.algorithm.value == "direct-pull" and twin.options.registered == {"in"}
    assert twin.options.channels == 4 and layout_sizes(twin)[0] == 0


@pytest.mark.parametrize("name", ["reduce", "reduce_scatter", "fused/allreduce_add_rmsnorm"])
def test_a_ring_with_slots_falls_back_to_a_pull_twin_without_them(name):
    """The direct-pull fallback kept the ring's slots, which direct-pull refuses: the twin's
    prepare raised instead of returning the pull twin."""
    compiled = pipeline.prepare(EXAMPLES / f"{name}.pln", world_size=2, overrides={"algorithm": "ring", "slots": 2})
    twin = zerocopy.twin_compiled(compiled)
    assert twin.options.algorithm.value == "direct-pull" and twin.options.slots is None


@pytest.mark.parametrize("algorithm", ["two-shot", "ring"])
def test_allreduce_twins_keep_their_algorithm(algorithm):
    twin = zerocopy.twin_compiled(prepare(EXAMPLES / "allreduce.pln", 2, algorithm=algorithm, channels=2))
    assert twin.options.algorithm.value == algorithm and "out" in twin.options.registered


class FakeCollective(SimpleNamespace):
    pass


TWIN = SimpleNamespace(name="twin")


def staged_for(comm, in_units=1, out_units=2, packed=False):
    compiled = SimpleNamespace(options=SimpleNamespace(packed=packed))
    return FakeCollective(name="allgather", rank=comm.rank, comm=comm, in_units=in_units, out_units=out_units,
                          compiled=compiled)


def zc_for(comm, in_units=1, out_units=2):
    return zerocopy.ZeroCopy(staged_for(comm, in_units, out_units), TWIN)


def shape(in_ptr, out_ptr, count=64, dtype=DType.BFLOAT16, op=None):
    return CallShape(dtype, op, count, in_ptr, out_ptr)


def test_choice_needs_every_buffer_in_the_heap():
    comm = FakeComm()
    zc = zc_for(comm)
    x, out = symmetric.alloc(comm, 128), symmetric.alloc(comm, 256)
    ordinary = 0x7000_0000
    checked = []
    comm._check_exchange = lambda obj: checked.append(obj) or [obj, obj]
    assert zc.pick(shape(x.ptr, out.ptr)) is TWIN
    assert zc.pick(shape(x.ptr, out.ptr)) is TWIN
    assert len(checked) == 1  # ranks are asked once per (buffers, count, dtype, op)
    assert TWIN._zc_offsets[zerocopy.call_key(shape(x.ptr, out.ptr))] == (x.offset, out.offset)
    assert zc.pick(shape(x.ptr, ordinary)) is None
    assert zc.pick(shape(ordinary, out.ptr)) is None
    assert len(checked) == 1  # ordinary buffers never exchange (their addresses differ by rank)
    with pytest.raises(ArgumentError, match="runs .* past the end"):
        zc.pick(shape(x.ptr, out.ptr, count=65))
    out.free()
    with pytest.raises(FreedBufferError, match="allgather on rank 0: out .* not in a live block"):
        zc.pick(shape(x.ptr, out.ptr))  # refused even though the call was agreed before


def test_agree():
    a = (0, 512, 64, "bfloat16", None)
    assert zerocopy.agree("ag", [None, None]) is None
    assert zerocopy.agree("ag", [a, a]) == (0, 512)
    # a broadcast's non-root passes no input: it takes the root's input offset
    assert zerocopy.agree("bc", [(0, 512, 64, "bfloat16", None), (None, 512, 64, "bfloat16", None)]) == (0, 512)
    with pytest.raises(MismatchError, match="rank 0: zero-copy, x at heap offset 0, out at 512; rank 1: staged"):
        zerocopy.agree("ag", [a, None])
    with pytest.raises(MismatchError, match="ranks disagree on the zero-copy path"):
        zerocopy.agree("ag", [a, (256, 512, 64, "bfloat16", None)])
    with pytest.raises(MismatchError, match=r"different \(count, dtype, op\)"):
        zerocopy.agree("ag", [a, (0, 512, 32, "bfloat16", None)])


def test_peer_pointers_follow_the_agreed_offsets():
    """A rank without input still reaches the root's input (broadcast through a pull)."""
    comm = FakeComm(rank=1)
    out = symmetric.alloc(comm, 256)
    root_x = 1 << 20  # the root's input offset, as the exchange reported it
    comm._check_exchange = lambda obj: [("zero-copy", obj[1], (root_x, out.offset, 64, "bfloat16", None)), obj]
    twin = SimpleNamespace(comm=comm, compiled=SimpleNamespace(world_size=2))
    zc = zerocopy.ZeroCopy(staged_for(comm, in_units=0, out_units=1), twin)
    s = shape(0, out.ptr)
    assert zc.pick(s) is twin
    peers = zerocopy.peer_args(twin, s)
    assert peers["in_peer"] == comm.heap.ptrs(root_x) and peers["out_peer"] == [out.peer_ptr(0), out.peer_ptr(1)]


def test_choice_peer_disagreement_is_a_mismatch():
    comm = FakeComm()
    zc = zc_for(comm)
    x, out = symmetric.alloc(comm, 128), symmetric.alloc(comm, 256)
    comm._check_exchange = lambda obj: [obj, ("zero-copy", obj[1], (0, 768, 64, "bfloat16", None))]
    with pytest.raises(MismatchError, match="ranks disagree on the zero-copy path"):
        zc.pick(shape(x.ptr, out.ptr))

    def timeout(obj):
        raise RuntimeError("gloo timed out")

    comm._check_exchange = timeout
    with pytest.raises(MismatchError, match="a peer did not join the check"):
        zc.pick(shape(x.ptr, out.ptr, count=32))


def test_buffer_of_another_communicator_is_named():
    mine, other = FakeComm(), FakeComm()
    other.heap.segments[0].bases = [(5 << 40), (6 << 40)]
    theirs = symmetric.alloc(other, 128)
    symmetric.alloc(mine, 64)
    zc = zc_for(mine)
    with pytest.raises(ArgumentError, match="lives in the symmetric heap of another communicator"):
        zc.pick(shape(theirs.ptr, 0x7000_0000))


def test_local_group_agrees_before_launch_and_per_rank_calls_reuse_it():
    group = SimpleNamespace()
    comms = [FakeComm(rank=r) for r in range(2)]
    for c in comms:
        c.local_group = group
    ranks = []
    for c in comms:
        staged = staged_for(c)
        staged._zc = zerocopy.ZeroCopy(staged, SimpleNamespace())
        ranks.append(staged)
    xs = [symmetric.alloc(c, 128) for c in comms]
    outs = [symmetric.alloc(c, 256) for c in comms]
    shapes = [shape(x.ptr, o.ptr) for x, o in zip(xs, outs)]
    # per-rank call on heap buffers before any group call: refused, with the way out
    with pytest.raises(ArgumentError, match="no group call has agreed on yet"):
        ranks[0]._zc.pick(shapes[0])
    zerocopy.agree_group(ranks, [(s, None, None) for s in shapes])
    assert all(r._zc.pick(s) is r._zc.twin for r, s in zip(ranks, shapes))
    # one rank with an ordinary output: refused before any rank launches
    mixed = [shapes[0], shape(xs[1].ptr, 0x7000_0000)]
    with pytest.raises(MismatchError, match="rank 1: staged"):
        zerocopy.agree_group(ranks, [(s, None, None) for s in mixed])


def test_peer_args_give_every_rank_the_same_offset():
    comm = FakeComm()
    x = symmetric.alloc(comm, 128)
    coll = FakeCollective(comm=comm, compiled=SimpleNamespace(world_size=2))
    args = zerocopy.peer_args(coll, shape(x.ptr, 0))
    assert args["in_peer"] == [x.peer_ptr(0), x.peer_ptr(1)] and args["out_peer"] == [0, 0]


def test_reduce_op_in_choice_key():
    comm = FakeComm()
    zc = zc_for(comm, in_units=2, out_units=2)
    x, out = symmetric.alloc(comm, 256), symmetric.alloc(comm, 256)
    seen = []
    comm._check_exchange = lambda obj: seen.append(obj) or [obj, obj]
    zc.pick(shape(x.ptr, out.ptr, count=64, op=ReduceOp.SUM))
    zc.pick(shape(x.ptr, out.ptr, count=64, op=ReduceOp.MAX))
    assert [s[2][4] for s in seen] == ["sum", "max"]


ALGORITHMS = ("direct-push", "direct-pull", "two-shot", "ring")


@pytest.mark.parametrize("name", sorted(p.stem for p in EXAMPLES.glob("*.pln")))
def test_every_example_twin_verifies_and_simulates_to_the_evaluator(name):
    """The registered schedules the zero-copy path runs: for every example and algorithm that
    lowers, the twin passes the verifier and two simulated calls equal the evaluator."""
    import numpy as np

    from purlinc.dtypes import random_values
    from purlinc.errors import PurlinError
    from purlinc.frontend.evaluate import evaluate
    from purlinc.snac.simulate import simulate_calls
    from purlinc.snac.verify import verify

    twins = 0
    for algorithm in ALGORITHMS:
        try:
            compiled = prepare(EXAMPLES / f"{name}.pln", 2, algorithm=algorithm, channels=2)
        except PurlinError:
            continue
        twin = zerocopy.twin_compiled(compiled)
        if twin is None:
            continue
        twins += 1
        verify(twin.schedule, twin.spec)
        spec, count, dtype = twin.spec, 37, DType.FLOAT32
        rng = np.random.default_rng(7)
        calls = [[random_values(rng, len(spec.inputs[r]) * count, dtype) for r in range(2)] for _ in range(2)]
        op = ReduceOp.SUM if spec.is_reduce else None
        results = simulate_calls(twin.schedule, spec, calls, count, dtype, op, calls=2)
        for inputs, got in zip(calls, results):
            want = evaluate(spec, inputs, count, dtype, op)
            for r in range(2):
                if len(spec.outputs[r]):
                    np.testing.assert_allclose(got[r], want[r], rtol=1e-6, err_msg=f"{name}/{algorithm} rank {r}")
    assert twins, f"{name}: no algorithm has a zero-copy twin"


@pytest.mark.parametrize("name,algorithm,needs", [("allgather", "direct-push", "out"), ("allreduce", "direct-push", "in"),
                                                 ("allreduce", "two-shot", "out")])
def test_twin_kernels_compile_and_want_peer_pointers(name, algorithm, needs):
    """NVRTC needs no GPU: the twin's kernel compiles, and its ABI asks for exactly the peer
    pointers the runtime packs for a zero-copy call."""
    compiled = prepare(EXAMPLES / f"{name}.pln", 2, algorithm=algorithm, channels=2)
    twin = zerocopy.twin_compiled(compiled)
    dtype, op = DType.BFLOAT16, (ReduceOp.SUM if twin.spec.is_reduce else None)
    source, cubin = twin.kernel(dtype, op)
    assert cubin and len(cubin) > 1000
    abi = source.abi
    assert (abi.needs_in_peers, abi.needs_out_peers) == (needs == "in", needs == "out")
    comm = FakeComm()
    x, out = symmetric.alloc(comm, 4096), symmetric.alloc(comm, 4096)
    coll = FakeCollective(comm=comm, compiled=SimpleNamespace(world_size=2))
    peers = zerocopy.peer_args(coll, shape(x.ptr, out.ptr))
    packed = abi.pack_args(count=64, piece=64, timeout_ns=1, rank=0, in_ptr=x.ptr, out_ptr=out.ptr, counters_ptr=0,
                           error_ptr=0, stage=[0, 0], staging=StagingPlacement.for_space(1 << 20, abi.stage_units), signals=[0, 0],
                           **peers)
    words = __import__("struct").unpack(f"<{len(packed) // 8}Q", packed)
    assert list(words[-4:]) == [x.peer_ptr(0), x.peer_ptr(1), out.peer_ptr(0), out.peer_ptr(1)]


def test_available_counts_growth_room_under_the_limit():
    h, g = heap(size=4 * MiB, limit=16 * MiB)
    # a region never straddles segments: 12 MiB (a new segment under the limit) is the most
    with pytest.raises(HeapExhaustedError, match="needs 33554432 bytes, 12582912 are available") as caught:
        h.alloc(32 * MiB, "big")
    assert caught.value.available == 12 * MiB and not g.calls
    h.alloc(12 * MiB, "fits")  # exactly the growth room left
    assert g.calls == [(1, 12 * MiB)] and h.size == 16 * MiB


def test_packed_schedules_stage_heap_buffers_but_still_refuse_freed_ones():
    """Small calls (packed LL buckets) stage even on heap buffers: LL beats the registered
    twin there.  A freed heap block is still refused before anything launches."""
    comm = FakeComm()
    zc = zerocopy.ZeroCopy(staged_for(comm, packed=True), TWIN)
    x, out = symmetric.alloc(comm, 128), symmetric.alloc(comm, 256)
    assert zc.pick(shape(x.ptr, out.ptr)) is None and zc.pick(shape(x.ptr, out.ptr), record=False) is None
    x.free()
    with pytest.raises(FreedBufferError):
        zc.pick(shape(x.ptr, out.ptr))
