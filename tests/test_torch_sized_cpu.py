"""purlinc.torch.sized without a GPU: the uneven all_to_all_single (host split lists, as
torch has it) and all_to_all_vdev (splits on the device) through a CPU stand-in of the
all-to-all with run-time sizes (R threads, one per rank, meeting at a barrier; each takes its
output from the evaluator, ``evaluate_sized``), checked against plain NumPy concatenations;
the custom ops' fake implementations (output shape by capacity); and the host-side errors."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import purlinc.torch as pt  # noqa: E402
from purlinc.frontend.check import check  # noqa: E402
from purlinc.frontend.evaluate import evaluate_sized  # noqa: E402
from purlinc.frontend.parse import parse  # noqa: E402
from purlinc.runtime.errors import ArgumentError  # noqa: E402
from purlinc.torch import sized  # noqa: E402
from rank_threads import on_threads  # noqa: E402

CAPACITY = 64  # elements per pair
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Comm:
    def __init__(self, rank, world_size):
        self.rank, self.world_size, self.device = rank, world_size, "cpu"


class World:
    def __init__(self, source, R):
        self.spec = check(parse(source), R)
        self.barrier = threading.Barrier(R, timeout=30)
        self.slots = [None] * R
        self.loads = 0


class StandIn:
    """One rank of the sized all-to-all on CPU tensors: sizes in rows of ``row`` elements."""

    def __init__(self, world, rank, capacity):
        self.world, self.rank, self.capacity = world, rank, capacity
        self._variants = {}
        self.closed = False

    def close(self):
        self.closed = True

    def __call__(self, x, sizes, out, out_sizes, row=1, expected_sizes=None):
        w, r = self.world, self.rank
        bits = BITS[x.element_size()]  # the bits of any dtype (bfloat16 has no NumPy type)
        expected = None if expected_sizes is None else [int(v) * row for v in expected_sizes.tolist()]
        w.slots[r] = (x.reshape(-1).view(bits).numpy().copy(), [int(v) * row for v in sizes.tolist()],
                      out.reshape(-1).view(bits).numpy().copy(), expected)  # what the kernel does not write stays
        w.barrier.wait()
        outs, out_sizes_all, errors = evaluate_sized(w.spec, [s[0] for s in w.slots], [s[1] for s in w.slots],
                                                     self.capacity // row * row, [s[2] for s in w.slots],
                                                     [s[3] for s in w.slots])
        self.errors = errors[r]
        w.barrier.wait()
        out.reshape(-1).view(bits).copy_(torch.from_numpy(outs[r]))
        out_sizes.copy_(torch.tensor([v // row for v in out_sizes_all[r]], dtype=torch.int64))
        return out, out_sizes


def groups(R, capacity=CAPACITY):
    worlds, lock = {}, threading.Lock()

    def loader(rank):
        def load(source, comm, cap):
            with lock:
                world = worlds.setdefault(source, World(source, R))
                world.loads += 1
            return StandIn(world, rank, cap)
        return load
    made = [pt.Group(Comm(r, R), loader=lambda *a: pytest.fail("plain collective loaded")) for r in range(R)]
    for r, g in enumerate(made):
        sized.configure(g, capacity=capacity, loader=loader(r))
    return made


def on_ranks(gs, fn):
    """fn(rank, group) on one thread per rank; returns the results, re-raises the first error."""
    def wake():  # the others may wait at the stand-in's barrier for the rank that failed
        for g in gs:
            st = sized._BY_GROUP.get(g)
            if st is not None and st._collective is not None:
                st._collective.world.barrier.abort()
    return on_threads(len(gs), lambda rank: fn(rank, gs[rank]), wake)


def _splits(rng, R):
    return [[int(v) for v in rng.integers(0, 6, R)] for _ in range(R)]  # splits[src][dst] rows


def _inputs(splits, H, seed):
    return [torch.arange(sum(row) * H, dtype=torch.float32).reshape(sum(row), H) + 1000 * src + seed
            for src, row in enumerate(splits)]


def _expected(splits, inputs, dst):
    """Rank dst's rows, packed by source: plain slicing, independent of the evaluator."""
    parts = []
    for src, row in enumerate(splits):
        start = sum(row[:dst])
        parts.append(inputs[src][start:start + row[dst]])
    return torch.cat(parts)


@pytest.mark.parametrize("R", [2, 3, 4])
def test_all_to_all_single_with_host_lists(R):
    rng = np.random.default_rng(R)
    gs = groups(R)
    for trial in range(3):
        splits = _splits(rng, R)
        if trial == 0:
            splits[0] = [0] * R  # a rank that sends nothing
            splits[1] = [2] * R  # and one whose lists are even
        inputs = _inputs(splits, 4, trial)

        def call(rank, g):
            out_rows = [splits[src][rank] for src in range(R)]
            out = torch.full((sum(out_rows), 4), -1.0)
            pt.all_to_all_single(out, inputs[rank], out_rows, splits[rank], group=g)
            return out
        for rank, out in enumerate(on_ranks(gs, call)):
            assert torch.equal(out, _expected(splits, inputs, rank))
    assert all(sized.state_of(g)._collective.world.loads == R for g in gs[:1])  # loaded once per rank


def test_output_split_sizes_that_disagree_with_the_senders_are_not_written():
    """Rank 1 expects 3 rows from rank 0, which sends 2: the output is laid out by
    output_split_sizes (rank 2's rows where the caller looks for them), rank 0's rows are not
    written, and the call records an "expected" size error for the pair."""
    R, H = 3, 4
    splits = [[1, 2, 1], [2, 2, 2], [0, 3, 1]]  # splits[src][dst] rows
    inputs = _inputs(splits, H, 0)
    gs = groups(R)

    def call(rank, g):
        out_rows = [splits[src][rank] for src in range(R)]
        if rank == 1:
            out_rows[0], out_rows[2] = 3, 2  # expects 3 from rank 0 (sent: 2), 2 from rank 2 (sent: 3)
        out = torch.full((sum(out_rows), H), -1.0)
        pt.all_to_all_single(out, inputs[rank], out_rows, splits[rank], group=g)
        return out, sized.state_of(g)._collective.errors
    results = on_ranks(gs, call)
    for rank in (0, 2):
        out, errors = results[rank]
        assert torch.equal(out, _expected(splits, inputs, rank)) and not errors
    out, errors = results[1]
    assert errors == [("out", 0, "expected", 2 * H, 3 * H), ("out", 2, "expected", 3 * H, 2 * H)]
    assert (out[:3] == -1).all() and (out[5:] == -1).all()  # rank 0's and rank 2's rows: not written
    assert torch.equal(out[3:5], inputs[1][2:4])  # rank 1's own rows, at the offset its lists give them


def test_host_lists_count_each_tensors_own_rows():
    """As torch's: output_split_sizes count rows of output's dim 0, input_split_sizes of input's.
    An output of 8 rows of 1 from inputs of 4 rows of 2 ([4, 4] and [2, 2]) was read in input's
    rows: nothing written, an "expected" error per pair.  And rows of one length but another
    shape ((4, 2, 3) against (4, 6)) were refused, where torch takes them."""
    R = 2
    gs = groups(R)

    def flat(rank, g):
        x = (torch.arange(8.0) + 100 * rank).view(4, 2)
        out = torch.full((8,), -1.0)
        pt.all_to_all_single(out, x, [4, 4], [2, 2], group=g)
        return out.tolist(), sized.state_of(g)._collective.errors
    got = on_ranks(gs, flat)
    assert got[0] == ([0.0, 1.0, 2.0, 3.0, 100.0, 101.0, 102.0, 103.0], [])
    assert got[1] == ([4.0, 5.0, 6.0, 7.0, 104.0, 105.0, 106.0, 107.0], [])

    def reshaped(rank, g):
        x = (torch.arange(24.0) + 100 * rank).view(4, 2, 3)
        out = torch.full((4, 6), -1.0)
        splits = [1, 3] if rank == 0 else [3, 1]  # received from 0 and 1 (out), sent to 0 and 1 (in): alike here
        pt.all_to_all_single(out, x, splits, splits, group=g)
        return out
    outs = on_ranks(gs, reshaped)
    xs = [(torch.arange(24.0) + 100 * r).view(4, 6) for r in range(R)]
    assert torch.equal(outs[0], torch.cat([xs[0][:1], xs[1][:3]]))
    assert torch.equal(outs[1], torch.cat([xs[0][1:], xs[1][3:]]))
    with pytest.raises(ArgumentError, match=r"all_to_all_single: output has rows of 0 elements \(shape \(4, 0\)\)"):
        pt.all_to_all_single(torch.empty(4, 0), torch.ones(4, 2), [2, 2], [2, 2], group=gs[0])


def test_split_lists_choose_the_sized_all_to_all():
    """On every rank alike: a rank whose lists happen to be equal cannot know the others' are."""
    g = pt.Group(Comm(0, 2), loader=lambda *a: pytest.fail("nothing should load"))
    x = torch.zeros(4, 3)
    assert g._splits("t", x, x, [2, 2], [2, 2]) == ([2, 2], [2, 2])
    assert g._splits("t", x, x, None, [1, 3]) == ([2, 2], [1, 3])
    assert g._splits("t", x, x, None, None) is None and g._splits("t", x, x, [], []) is None
    # any iterable of ints, read once: a generator was spent by the read, then len() of it failed
    assert g._splits("t", x, x, (n for n in (1, 3)), iter([3, 1])) == ([1, 3], [3, 1])
    assert g._splits("t", x, x, iter([]), None) is None
    g.close()


def test_all_to_all_vdev_writes_splits_and_offsets():
    R, H = 3, 2
    rng = np.random.default_rng(5)
    splits = _splits(rng, R)
    inputs = _inputs(splits, H, 0)
    gs = groups(R)

    def call(rank, g):
        cap_rows = CAPACITY // H
        out = torch.full((R * cap_rows, H), -1.0)
        out_splits = torch.full((R,), -5, dtype=torch.int64)
        out_offsets = torch.full((R,), -5, dtype=torch.int64)
        pt.all_to_all_vdev(inputs[rank], out, torch.tensor(splits[rank]), out_splits, out_offsets, group=g)
        return out, out_splits, out_offsets
    for rank, (out, out_splits, out_offsets) in enumerate(on_ranks(gs, call)):
        received = [splits[src][rank] for src in range(R)]
        assert out_splits.tolist() == received
        assert out_offsets.tolist() == [sum(received[:i]) for i in range(R)]
        n = sum(received)
        assert torch.equal(out[:n], _expected(splits, inputs, rank))
        assert (out[n:] == -1).all()  # nothing written past what was received


def test_host_list_errors_name_the_pair():
    g = groups(2, capacity=8)[0]
    x, out = torch.zeros(6, 4), torch.zeros(6, 4)
    with pytest.raises(ArgumentError, match=r"input_split_sizes\[1\] = 4 rows \(16 elements, rank 0 to rank 1\) "
                                            r"exceeds the capacity of 2 rows \(8 elements per pair\)"):
        pt.all_to_all_single(out, x, [2, 4], [2, 4], group=g)
    with pytest.raises(ArgumentError, match=r"output_split_sizes\[0\] = 5 rows \(20 elements, rank 0 to rank 0\)"):
        pt.all_to_all_single(out, torch.zeros(4, 4), [5, 1], [2, 2], group=g)
    with pytest.raises(ArgumentError, match=r"output_split_sizes=\[1, 1\], expected 2 sizes >= 0 summing to the 6 rows"):
        pt.all_to_all_single(out, torch.zeros(2, 4), [1, 1], [1, 1], group=g)
    with pytest.raises(ArgumentError, match="output has dtype int32, expected float32"):
        pt.all_to_all_single(torch.zeros(6, 4, dtype=torch.int32), x, [1, 5], [5, 1], group=g)
    with pytest.raises(ArgumentError, match="in_splits must be 1-D int64 with 2 entries"):
        pt.all_to_all_vdev(x, out, torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), group=g)


def test_custom_op_fake_shapes_by_capacity():
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = groups(4, capacity=96)[0]
    functional, out_form = sized.define()
    handle = sized.state_of(g).handle
    with FakeTensorMode():
        x = torch.empty(10, 8, dtype=torch.bfloat16)
        out, out_splits = functional(x, torch.empty(4, dtype=torch.int64), handle)
    assert tuple(out.shape) == (4 * 12, 8) and out.dtype == torch.bfloat16
    assert tuple(out_splits.shape) == (4,) and out_splits.dtype == torch.int64
    schema = str(torch.ops.purlin.alltoallv_out.default._schema)
    assert "Tensor(a!) out" in schema and "Tensor(b!) out_splits" in schema


def test_the_functional_form_is_a_value_rows_past_the_received_are_zeros():
    """A functional op's output is a value: rows past the received ones were uninitialised
    memory, so two equal calls differed and opcheck's AOT test failed."""
    g = groups(1, capacity=64)[0]
    handle = sized.state_of(g).handle
    x, splits = torch.randn(8, 2), torch.tensor([8])
    out, out_splits = torch.ops.purlin.alltoallv(x, splits, handle)
    assert tuple(out.shape) == (32, 2) and out_splits.tolist() == [8]
    assert torch.equal(out[:8], x) and not out[8:].any()
    torch.library.opcheck(torch.ops.purlin.alltoallv.default, (x, splits, handle))


def test_rows_of_no_elements_are_refused_by_name():
    """Input rows of 0 elements (shape (5, 0)) raised a bare ZeroDivisionError in the real and
    the fake implementations alike."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = groups(2, capacity=96)[0]
    functional, _ = sized.define()
    handle = sized.state_of(g).handle
    with FakeTensorMode():
        with pytest.raises(ArgumentError, match=r"input has rows of 0 elements \(shape \(5, 0\)\); expected rows of "
                                                r"at least one element"):
            functional(torch.empty(5, 0), torch.empty(2, dtype=torch.int64), handle)


def test_outputs_that_share_memory_with_what_the_call_reads_are_refused():
    """out the same tensor as input, or out_splits as in_splits, was accepted by the real and the
    fake forms alike (the kernel reads one while it writes the other)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = groups(1)[0]
    _, out_form = sized.define()
    handle = sized.state_of(g).handle
    x, splits = torch.ones(32, 2), torch.tensor([2])
    cases = [(x, x, splits, torch.zeros(1, dtype=torch.int64), "out overlaps input"),
             (x, torch.zeros(32, 2), splits, splits, "out_splits overlaps in_splits"),
             (x, x[:16], splits, torch.zeros(1, dtype=torch.int64), "out overlaps input")]
    for inp, out, in_splits, out_splits, message in cases:
        with pytest.raises(ArgumentError, match=rf"all_to_all_vdev: {message} in memory, expected a tensor of its own"):
            pt.all_to_all_vdev(inp, out, in_splits, out_splits, group=g)
    with FakeTensorMode():
        x, splits = torch.ones(32, 2), torch.tensor([2])
        with pytest.raises(ArgumentError, match=r"purlin::alltoallv_out: out overlaps input in memory"):
            out_form(x, splits, x, torch.zeros(1, dtype=torch.int64), handle)
        with pytest.raises(ArgumentError, match=r"purlin::alltoallv_out: out_splits overlaps in_splits in memory"):
            out_form(x, splits, torch.zeros(32, 2), splits, handle)


def test_host_lists_in_place_read_from_a_copy():
    """all_to_all_single with split lists whose output is input (or overlaps it) runs as the
    equal form does in place: the kernel reads a copy of input, so no row is read after it was
    overwritten (it was refused while the equal form ran)."""
    R = 2
    made = groups(R)
    xs = [torch.arange(8 * r, 8 * r + 8, dtype=torch.float32).reshape(4, 2) for r in range(R)]
    expected = [torch.cat([xs[src][2 * dst:2 * dst + 2] for src in range(R)]) for dst in range(R)]
    on_ranks(made, lambda r, g: pt.all_to_all_single(xs[r], xs[r], [2, 2], [2, 2], group=g))
    for r in range(R):
        assert torch.equal(xs[r], expected[r])
    bools = [torch.tensor([[True, False]] * 2 + [[False, True]] * 2) for _ in range(R)]  # carried as bytes
    want = [torch.cat([bools[src][2 * dst:2 * dst + 2] for src in range(R)]) for dst in range(R)]
    on_ranks(made, lambda r, g: pt.all_to_all_single(bools[r], bools[r], [2, 2], [2, 2], group=g))
    assert all(torch.equal(bools[r], want[r]) for r in range(R))


@pytest.mark.parametrize("sizes, shown", [
    ([1.5, 2.5], r"\[1.5, 2.5\]"),  # int() made these [1, 2]: the rows of a 3-row input, silently
    ([1, "2"], r"\[1, '2'\]"),
    (3, "3"),
    (torch.tensor([1.0, 2.0]), r"tensor\(\[1., 2.\]\)"),
    ([True, 2], r"\[True, 2\]"),  # a bool is no size, as it is no count or rank
])
def test_split_sizes_must_be_integers(sizes, shown):
    g = groups(2)[0]
    x = torch.ones(3, 2)
    for output_split_sizes, input_split_sizes, label in (([1, 2], sizes, "input_split_sizes"),
                                                         (sizes, [1, 2], "output_split_sizes")):
        with pytest.raises(ArgumentError, match=rf"all_to_all_single: {label}={shown}, expected a list of 2 "
                                                r"integers \(rows of dim 0 per rank\)"):
            pt.all_to_all_single(torch.ones(3, 2), x, output_split_sizes, input_split_sizes, group=g)
        with pytest.raises(ArgumentError, match=rf"all_to_all_single: {label}={shown}, expected a list of 2 integers"):
            sized.all_to_all_single(g, torch.ones(3, 2), x, output_split_sizes, input_split_sizes)
    with pytest.raises(ArgumentError, match=rf"all_to_all_single: input_split_sizes={shown}, expected a list of 2 "
                                            r"integers"):
        pt.functional.all_to_all_single(x, None, sizes, group=g)
    assert sized.state_of(g)._collective is None


def test_split_sizes_take_integers_of_any_kind():
    """Integral values are sizes whatever their type: numpy ints, int tensors, 0-d int tensors."""
    R = 2
    gs = groups(R)

    def call(rank, g):
        x = torch.arange(6.0).view(3, 2) + 10 * rank
        out = torch.zeros(3, 2)
        if rank == 0:
            pt.all_to_all_single(out, x, torch.tensor([1, 2]), [np.int64(1), torch.tensor(2)], group=g)
        else:
            pt.all_to_all_single(out, x, [np.int32(2), 1], torch.tensor([2, 1]), group=g)
        return out.tolist()
    assert on_ranks(gs, call) == [[[0, 1], [10, 11], [12, 13]], [[2, 3], [4, 5], [14, 15]]]


def test_op_objects_refuse_a_collective_with_run_time_sizes():
    """pt.op(coll) over a sized collective called it as coll(x, out, op=...): out arrived as its
    sizes ("sizes has dtype float32, expected int64"), naming neither the mistake nor the way."""
    class Loaded:
        spec = check(parse(sized.SOURCE), 2)
        comm = Comm(0, 2)

    with pytest.raises(ArgumentError, match=r"purlin::alltoallv: alltoallv has run-time sizes \(sizes n\[2\]\[2\] of x\); "
                                            r"expected a collective of fixed sizes"):
        pt.op(Loaded())


def test_configure_after_load_is_refused_and_the_same_values_change_nothing():
    """configure(group, capacity=<the same>) after the first call closed the loaded collective and
    made a new state (a new handle: compiled graphs held the old one; the next call loaded again,
    a collective); loader= did the same.  Now the same values are a no-op, a change is refused."""
    gs = groups(1)
    x = torch.ones(2, 2)

    def call(rank, g):
        pt.all_to_all_vdev(x, torch.zeros(32, 2), torch.tensor([2]), torch.zeros(1, dtype=torch.int64), group=g)
    on_ranks(gs, call)
    state = sized.state_of(gs[0])
    loaded, handle = state._collective, state.handle
    assert sized.configure(gs[0], capacity=CAPACITY) is state
    assert sized.configure(gs[0], loader=state._loader) is state and sized.configure(gs[0]) is state
    assert state._collective is loaded and not loaded.closed and state.handle == handle
    with pytest.raises(ArgumentError, match=r"sized.configure: capacity=128 \(it has 64\) after the first uneven "
                                            r"all-to-all of .*, which loaded it with capacity 64; expected "
                                            r"configure\(...\) before that call"):
        sized.configure(gs[0], capacity=128)
    with pytest.raises(ArgumentError, match=r"sized.configure: loader=.* after the first uneven all-to-all"):
        sized.configure(gs[0], loader=lambda *a: None)
    assert sized.state_of(gs[0]) is state and not loaded.closed
    on_ranks(gs, call)  # still the same collective, loaded once
    assert loaded.world.loads == 1


def test_configure_before_the_first_call_keeps_what_it_is_not_given():
    """A loader= alone (before any call) reset the capacity to the default."""
    g = pt.Group(Comm(0, 1), loader=lambda *a: pytest.fail("plain collective loaded"))
    first = sized.configure(g, capacity=48)
    second = sized.configure(g, loader=lambda *a: None)
    assert second is not first and second.capacity == 48 and second.handle != first.handle
    g.close()


def test_all_to_all_vdev_compiles_whole():
    """Under torch.compile(fullgraph=True) the device form is one purlin::alltoallv_out node
    (no graph break: sizes never reach the host), and gives the eager result."""
    R, H = 2, 2
    splits = [[1, 3], [2, 0]]
    inputs = _inputs(splits, H, 0)
    gs = groups(R)

    def step(x, in_splits, out, out_splits, g):
        g.all_to_all_vdev(x, out, in_splits, out_splits)
        return out * 2

    def call(rank, g):
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        out = torch.full((R * (CAPACITY // H), H), -1.0)
        out_splits = torch.zeros(R, dtype=torch.int64)
        y = compiled(inputs[rank], torch.tensor(splits[rank]), out, out_splits, g)
        return y, out_splits
    for rank, (y, out_splits) in enumerate(on_ranks(gs, call)):
        received = [splits[src][rank] for src in range(R)]
        assert out_splits.tolist() == received
        assert torch.equal(y[:sum(received)], 2 * _expected(splits, inputs, rank))


def test_fakes_check_splits_and_dtypes_as_the_real_ops_do():
    """One check for the fake and the real implementations: splits int64 with R entries on
    x's device; data of a dtype Purlin has (the message lists what is accepted: int64 too)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = groups(2)[0]
    handle = sized.state_of(g).handle
    splits = "must be 1-D int64 with 2 entries on cpu, got"
    with FakeTensorMode():
        x = torch.empty(8, 4)
        out, out_splits = torch.ops.purlin.alltoallv(x, torch.zeros(2, dtype=torch.int64), handle)
        assert tuple(out_splits.shape) == (2,)
        with pytest.raises(ArgumentError, match=rf"purlin::alltoallv: in_splits {splits} int32 \(3,\) on cpu"):
            torch.ops.purlin.alltoallv(x, torch.zeros(3, dtype=torch.int32), handle)
        with pytest.raises(ArgumentError, match=rf"purlin::alltoallv_out: out_splits {splits} float16 \(7,\)"):
            torch.ops.purlin.alltoallv_out(x, torch.zeros(2, dtype=torch.int64), torch.empty(8, 4),
                                           torch.empty(7, dtype=torch.float16), handle)
        with pytest.raises(ArgumentError, match=rf"purlin::alltoallv_seq: in_splits {splits} float32"):
            torch.ops.purlin.alltoallv_seq(x, torch.zeros(2), torch.empty(8, 4), torch.zeros(2, dtype=torch.int64),
                                           torch.zeros(1, dtype=torch.int32), handle)
        with pytest.raises(ArgumentError, match=rf"purlin::alltoallv: in_splits {splits} int64 \(1, 2\)"):
            torch.ops.purlin.alltoallv(x, torch.zeros(1, 2, dtype=torch.int64), handle)  # R entries, but no list
        strided = torch.zeros(4, dtype=torch.int64)[::2]  # the runtime refused it; the fakes traced it
        with pytest.raises(ArgumentError, match=r"purlin::alltoallv: in_splits must be contiguous, got strides \(2,\)"):
            torch.ops.purlin.alltoallv(x, strided, handle)
        with pytest.raises(ArgumentError, match=r"purlin::alltoallv_out: out_splits must be contiguous"):
            torch.ops.purlin.alltoallv_out(x, torch.zeros(2, dtype=torch.int64), torch.empty(8, 4), strided, handle)
        torch.ops.purlin.alltoallv(torch.empty(8, 4, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), handle)
        with pytest.raises(ArgumentError, match="input has dtype float64, which Purlin does not support; expected "
                                                "one of float32, float16, bfloat16, int32, int64, float8"):
            torch.ops.purlin.alltoallv(torch.empty(8, 4, dtype=torch.float64), torch.zeros(2, dtype=torch.int64),
                                       handle)
    with pytest.raises(ArgumentError, match=rf"all_to_all_vdev: out_splits {splits} int64 \(1, 2\)"):  # the real one
        pt.all_to_all_vdev(torch.empty(8, 4), torch.empty(8, 4), torch.zeros(2, dtype=torch.int64),
                           torch.zeros(1, 2, dtype=torch.int64), group=g)
    with pytest.raises(ArgumentError, match=rf"all_to_all_vdev: in_splits {splits} int32 \(2,\)"):
        pt.all_to_all_vdev(torch.empty(8, 4), torch.empty(8, 4), torch.zeros(2, dtype=torch.int32),
                           torch.zeros(2, dtype=torch.int64), group=g)
    with pytest.raises(ArgumentError, match="output is on meta, expected cpu"):  # meta: the fakes' only
        pt.all_to_all_vdev(torch.empty(8, 4), torch.empty(8, 4, device="meta"), torch.zeros(2, dtype=torch.int64),
                           torch.zeros(2, dtype=torch.int64), group=g)
    assert sized.state_of(g)._collective is None  # refused before the load


def _calls(gm, name):
    """The nodes that call purlin::name (as functionalization wraps mutating ops, or bare)."""
    def target(n):
        return str(n.args[0]) if "auto_functionalized" in str(n.target) else str(n.target)
    return [n for n in gm.graph.nodes if n.op == "call_function" and f"purlin.{name}." in target(n)]


def ancestors(node) -> set:
    seen, todo = set(), list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def test_compiled_all_to_all_vdev_is_ordered_with_the_other_collectives():
    """Compiled, all_to_all_vdev is purlin::alltoallv_seq: it "writes" the communicator's
    sequence tensor, so it and the all-reduce after it are one chain a scheduler keeps in order."""
    from torch._dynamo.backends.common import aot_autograd
    from test_torch_cpu import StandInWorlds

    g = StandInWorlds(1).groups()[0]  # a world of one: its stand-in loads both collectives
    seen = []

    def forward(gm, example):
        seen.append(gm)
        return gm

    def step(x, in_splits):
        out, out_splits = torch.empty_like(x), torch.empty_like(in_splits)
        pt.all_to_all_vdev(x, out, in_splits, out_splits, group=g)
        return out, pt.functional.all_reduce(x, group=g)

    torch._dynamo.reset()
    x = torch.randn(4, 2)
    out, total = torch.compile(step, backend=aot_autograd(fw_compiler=forward), fullgraph=True)(x, torch.tensor([4]))
    assert torch.equal(out, x) and torch.equal(total, x)  # a world of one
    (gm,) = seen
    (first,) = _calls(gm, "alltoallv_seq")
    (second,) = _calls(gm, "allreduce_seq")
    assert first in ancestors(second), gm.graph  # only the sequence tensor links them
    assert not _calls(gm, "alltoallv_out")


def test_import_purlinc_torch_registers_the_sized_ops():
    """TORCH.md calls torch.ops.purlin.alltoallv after ``import purlinc.torch``; the ops were
    registered only by importing purlinc.torch.sized itself."""
    import subprocess
    import sys

    code = "import torch, purlinc.torch; print(torch.ops.purlin.alltoallv.default, torch.ops.purlin.alltoallv_out.default)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["purlin.alltoallv.default", "purlin.alltoallv_out.default"]


def test_a_collective_named_like_another_ops_form_is_refused_by_name():
    """``define(name)`` registers NAME, NAME_out, NAME_inplace and NAME_seq: a collective called
    ``<other>_out`` or ``alltoallv`` met torch.library's own RuntimeError at registration."""
    from purlinc.runtime.errors import ArgumentError
    from purlinc.torch.ops import define

    define("probe_ag")
    with pytest.raises(ArgumentError, match=r"define: name 'probe_ag_out': torch.ops.purlin.probe_ag_out is already "
                                            r"the out form of collective 'probe_ag'"):
        define("probe_ag_out")
    with pytest.raises(ArgumentError, match=r"define: name 'alltoallv': torch.ops.purlin.alltoallv is already "
                                            r"purlinc.torch.sized's uneven all-to-all"):
        define("alltoallv")
    assert define("probe_ag") is define("probe_ag")  # a name's own ops: defined once, found again


def test_a_compiled_all_to_all_vdev_checks_out_offsets_as_eager_does():
    """out_offsets is written beside the op, so its fake never saw it: compiled, an out_offsets
    over out_splits overwrote the received sizes, and a float32 one was cast without a word."""
    g = groups(1, capacity=64)[0]

    def step(x, ins, out, outs, offs):
        pt.all_to_all_vdev(x, out, ins, outs, offs, group=g)
        return out

    outs = torch.zeros(1, dtype=torch.int64)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for offsets, says in ((outs, "out_splits overlaps out_offsets in memory"),
                          (torch.zeros(3), "out_offsets must be 1-D int64 with 1 entries")):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=says):
            compiled(torch.ones(8, 2), torch.tensor([8]), torch.zeros(32, 2), outs, offsets)
        with pytest.raises(ArgumentError, match=says):
            step(torch.ones(8, 2), torch.tensor([8]), torch.zeros(32, 2), outs, offsets)


def test_rows_of_input_and_output_agree_when_one_is_flat():
    """A 1-D input into a 2-D out (or the reverse) passed the row check, which compared shapes
    only when both had rows of more than one dimension: rows were read back in the wrong place."""
    g = groups(1, capacity=64)[0]
    outs = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ArgumentError, match=r"output rows have shape \(2,\), expected \(\) \(those of input\)"):
        pt.all_to_all_vdev(torch.arange(1.0, 9.0), torch.zeros(8, 2), torch.tensor([8]), outs, group=g)
    with pytest.raises(ArgumentError, match=r"output rows have shape \(\), expected \(2,\)"):
        pt.all_to_all_vdev(torch.zeros(4, 2), torch.zeros(16), torch.tensor([4]), outs, group=g)


@pytest.mark.parametrize("sizes", [torch.tensor([True]), torch.tensor([[1]])])
def test_split_lists_of_bools_or_of_more_dimensions_are_refused(sizes):
    g = groups(1, capacity=64)[0]
    with pytest.raises(ArgumentError, match="expected a list of 1 integers"):
        pt.all_to_all_single(torch.zeros(1, 2), torch.ones(1, 2), sizes, sizes, group=g)


def test_configure_takes_a_numpy_capacity():
    import numpy as np

    g = pt.Group(Comm(0, 1), loader=lambda *a: pytest.fail("plain collective loaded"))
    assert sized.configure(g, capacity=np.int64(64)).capacity == 64


@pytest.mark.parametrize("group", [torch.distributed.ProcessGroup(0, 1), None, "tp"])
def test_configure_refuses_what_is_no_group_saying_how_to_get_one(group):
    """configure(dist.group.WORLD, capacity=...) read the process group's world_size: an
    AttributeError.  It names the argument and the way from a ProcessGroup to its Group."""
    with pytest.raises(ArgumentError) as caught:
        sized.configure(group, capacity=48)
    assert caught.value.message == f"sized.configure: group={group!r}, expected a purlinc.torch.Group"
    assert "sized.configure(purlinc.torch.group_of(pg), capacity=...)" in caught.value.notes[0]


def test_what_a_rank_sends_itself_must_match_what_it_expects_from_itself():
    """Known on the host, yet left to the next call's SizeError; the rows stayed unwritten."""
    g = groups(1, capacity=64)[0]
    with pytest.raises(ArgumentError, match=r"input_split_sizes\[0\] = 3 rows of 2 element\(s\) go to this rank "
                                            r"itself, but output_split_sizes\[0\] = 5 rows of 2 expect 10 elements"):
        pt.all_to_all_single(torch.zeros(5, 2), torch.ones(3, 2), [5], [3], group=g)


def test_the_fakes_show_sizes_not_symbols_under_dynamic_shapes():
    """Compiled with dynamic=True, the fake's refusal of a row over the capacity read "a row of
    input has s27 elements": sizes are shown as this call's numbers (ops.shown)."""
    gs = groups(3, capacity=60)
    handle = sized.state_of(gs[1]).handle
    splits = torch.empty(3, dtype=torch.int64, device="meta")
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, s: torch.ops.purlin.alltoallv(x, s, handle), backend="aot_eager",
                             fullgraph=True, dynamic=True)
    for columns in (2, 3):  # the second call compiles the dynamic graph
        assert compiled(torch.empty(5, columns, device="meta"), splits)[0].shape == (3 * (60 // columns), columns)
    with pytest.raises(Exception, match=r"a row of input has 61 elements, more than the capacity 60"):
        compiled(torch.empty(5, 61, device="meta"), splits)


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_traced_all_to_all_vdev_checks_its_tensors_by_the_calls_name(dynamic):
    """Traced, Group.all_to_all_vdev left in_splits, out_splits and out to the op's fake, whose
    messages name purlin::alltoallv_seq (inside torch's error): now checked before the op is
    recorded, as the eager call checks them."""
    g = groups(3)[1]
    M = lambda *shape, dtype=torch.float32: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    splits = M(3, dtype=torch.int64)
    for args, message in (((M(5, 3), splits, M(20, 4), splits), r"all_to_all_vdev: output rows have shape \(4,\), "
                                                                 r"expected \(3,\) \(those of input\)"),
                          ((M(5, 3), M(4, dtype=torch.int64), M(20, 3), splits),
                           r"all_to_all_vdev: in_splits must be 1-D int64 with 3 entries on meta, got int64 \(4,\)"),
                          ((M(5, 3), splits, M(20, 3), M(3, dtype=torch.int32)),
                           r"all_to_all_vdev: out_splits must be 1-D int64 with 3 entries on meta, got int32")):
        torch._dynamo.reset()
        compiled = torch.compile(lambda x, i, o, s: g.all_to_all_vdev(x, o, i, s), backend="aot_eager",
                                 fullgraph=True, dynamic=dynamic)
        with pytest.raises(Exception) as caught:
            compiled(*args)
        assert re.search(message, str(caught.value)) and "alltoallv_seq" not in str(caught.value), \
            str(caught.value)[:800]


def test_a_0_d_input_is_refused_by_name_as_the_equal_all_to_all_refuses_it():
    """Split sizes count rows of dim 0, which a 0-d tensor lacks: the fake and the vdev call
    took one (as one row) where the equal all-to-all refuses it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = groups(2)[0]
    handle, splits = sized.state_of(g).handle, torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ArgumentError, match=r"all_to_all_vdev: input is 0-d \(a scalar\); expected a tensor of at "
                                            r"least one dimension"):
        pt.all_to_all_vdev(torch.tensor(1.0), torch.empty(4), splits, torch.zeros(2, dtype=torch.int64), group=g)
    with pytest.raises(ArgumentError, match=r"all_to_all_vdev: output is 0-d"):
        pt.all_to_all_vdev(torch.empty(4), torch.tensor(1.0), splits, torch.zeros(2, dtype=torch.int64), group=g)
    with FakeTensorMode():
        with pytest.raises(ArgumentError, match=r"purlin::alltoallv: input is 0-d"):
            torch.ops.purlin.alltoallv(torch.tensor(1.0), torch.zeros(2, dtype=torch.int64), handle)


def test_the_out_forms_refuse_meta_beside_real_tensors_naming_both():
    """A meta x with a CPU out reached the fake alone (the dispatcher picks it for any meta
    argument), each passed its own device check there, and out stayed unwritten, silently."""
    g = groups(2)[0]
    handle = sized.state_of(g).handle
    out = torch.zeros(8, 4)
    with pytest.raises(ArgumentError, match=r"purlin::alltoallv_out: output is on cpu, expected meta \(the device "
                                            r"of input\)"):
        torch.ops.purlin.alltoallv_out(torch.empty(8, 4, device="meta"), torch.zeros(2, dtype=torch.int64,
                                                                                      device="meta"),
                                       out, torch.zeros(2, dtype=torch.int64, device="meta"), handle)
    assert torch.equal(out, torch.zeros(8, 4))
