"""Runtime pieces that need no GPU and no torch: validation, heap bookkeeping, argument
packing, the ce plan, error rendering."""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path

import pytest
from cuda.bindings import driver as cu

from purlinc.dtypes import DType, ReduceOp
from purlinc.runtime import driver
from purlinc.atom.ce import CeError, expand, Buffers, init_image, plan
from purlinc.runtime.collective import layout_sizes, prepare
from purlinc.runtime.errors import ArgumentError, CudaError
from purlinc.runtime.heap import ALIGN, FirstFit
from purlinc.runtime.interop import ArrayInfo, describe
from purlinc.runtime.validate import choose_piece, rounds, validate_call

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def info(ptr=0x10000, numel=8, dtype=DType.FLOAT32, device=0, contiguous=True):
    return ArrayInfo(ptr, numel, dtype, dtype.value if dtype else "complex64", device, contiguous, "torch")


def check(x, out, **kw):
    args = dict(name="allgather", rank=0, device=0, in_units=1, out_units=2, is_reduce=False)
    args.update(kw)
    return validate_call(x, out, **args)


def test_valid_call_derives_count():
    shape = check(info(numel=7), info(ptr=0x20000, numel=14))
    assert (shape.count, shape.dtype, shape.op) == (7, DType.FLOAT32, None)


def test_count_from_output_on_ranks_without_input():
    shape = check(None, info(numel=5), in_units=0, out_units=1)
    assert shape.count == 5 and shape.in_ptr == 0


@pytest.mark.parametrize(
    "x, out, kw, words",
    [
        (info(numel=7), info(ptr=0x20000, numel=13), {}, ["out has 13 elements, expected 14"]),
        (info(numel=7), info(ptr=0x20000, numel=14, dtype=DType.FLOAT16), {}, ["out has dtype float16", "float32"]),
        (info(numel=7, device=1), info(ptr=0x20000, numel=14), {}, ["x is on cuda:1", "expected cuda:0"]),
        (info(numel=7, contiguous=False), info(ptr=0x20000, numel=14), {}, ["x is not contiguous"]),
        (info(ptr=0x10002, numel=7), info(ptr=0x20000, numel=14), {}, ["not aligned", "4 bytes"]),
        (info(numel=8), info(ptr=0x10010, numel=16), {}, ["overlap"]),
        (info(numel=7, dtype=None), info(ptr=0x20000, numel=14), {}, ["complex64", "does not support"]),
        (info(numel=7), info(ptr=0x20000, numel=7), {"in_units": 2, "out_units": 1}, ["multiple of 2"]),
        (None, info(numel=7), {}, ["x is required"]),
        (info(numel=4, dtype=DType.FLOAT8_E4M3), info(ptr=0x20000, numel=8, dtype=DType.FLOAT8_E4M3),
         {"is_reduce": True}, ["cannot be reduced"]),
        (info(numel=7), info(ptr=0x20000, numel=14), {"is_reduce": True, "op": "avg"}, ["unknown reduce op"]),
        (info(numel=7), info(ptr=0x20000, numel=14), {"count": 3}, ["count=3", "7"]),
        (info(numel=7), None, {}, ["out is required"]),
        (info(numel=7), info(ptr=0x20000, numel=14, device=-1), {}, ["the host"]),
    ],
)
def test_validation_errors_name_tensor_expected_and_actual(x, out, kw, words):
    with pytest.raises(ArgumentError) as caught:
        check(x, out, **kw)
    text = str(caught.value)
    for word in words:
        assert word in text, text
    assert "allgather on rank 0" in text or "reduce op" in text


def test_an_unknown_op_is_one_error_naming_the_call():
    """The op's refusal was the rendered text of another error: 'error: error: unknown reduce op'."""
    with pytest.raises(ArgumentError) as caught:
        check(info(numel=7), info(ptr=0x20000, numel=14), is_reduce=True, op="avg")
    assert caught.value.message == "allgather on rank 0: unknown reduce op 'avg'; expected one of sum, prod, max, min"
    assert str(caught.value).count("error:") == 1


@pytest.mark.parametrize("count", ["7", 7.0, 7.5, True, [7]])
def test_count_is_an_integer(count):
    """count='7' said "count=7, but the buffers say 7 elements per chunk"; 7.0 passed as 7."""
    with pytest.raises(ArgumentError) as caught:
        check(info(numel=7), info(ptr=0x20000, numel=14), count=count)
    assert caught.value.message == f"allgather on rank 0: count={count!r}, expected an int (elements per chunk) or None"


def test_count_of_any_integer_type():
    import numpy as np

    assert check(info(numel=7), info(ptr=0x20000, numel=14), count=np.int64(7)).count == 7


class _Stream:
    cuda_stream = 0x5000


@pytest.mark.parametrize("stream, handle", [(None, 0), (7, 7), (_Stream(), 0x5000), (cu.CUstream(0), 0)])
def test_stream_handles(stream, handle):
    from purlinc.runtime.interop import stream_handle

    assert stream_handle(stream) == handle


@pytest.mark.parametrize("stream", ["abc", "7", 1.5, -1, True, object()])
def test_a_stream_that_is_no_stream_is_refused_by_name(stream):
    """int(stream) raised ValueError for "abc", cut 1.5 to 1 (the legacy stream, silently) and
    passed -1 to the driver (an OverflowError there)."""
    from purlinc.runtime.interop import stream_handle

    with pytest.raises(ArgumentError) as caught:
        stream_handle(stream)
    assert caught.value.message.startswith(f"stream={stream!r}: expected a CUDA stream (torch.cuda.Stream, a CuPy "
                                           "stream, a CUstream, or a handle as an int >= 0)")


def test_reduce_op_is_parsed_and_fp8_copies_are_fine():
    assert check(info(numel=4), info(ptr=0x20000, numel=8), is_reduce=True, op="max").op is ReduceOp.MAX
    fp8 = DType.FLOAT8_E5M2
    assert check(info(numel=4, dtype=fp8), info(ptr=0x20000, numel=8, dtype=fp8)).dtype is fp8


def test_piece_fits_the_staging_space_and_stays_16_byte_aligned():
    from purlinc.atom.abi import StagingPlacement as Placement

    assert choose_piece(1000, Placement.for_space(1 << 20, 2), 4) == 1000
    piece = choose_piece(10_000_000, Placement.for_space(1 << 20, 3), 2)
    assert 3 * piece * 2 <= 1 << 20 and (piece * 2) % 16 == 0
    assert rounds(10_000_000, piece) == -(-10_000_000 // piece)
    assert choose_piece(0, Placement.for_space(1 << 20, 2), 4) == 1 and rounds(0, 1) == 0
    assert choose_piece(77, Placement.for_space(0, 0), 4) == 77
    with pytest.raises(ArgumentError, match=r"a staging slice holds 0 bytes \(4 unit\(s\) of 0 bytes, 1 slice\(s\) each\), less than one round.s least share of 16 bytes"):
        choose_piece(100, Placement.for_space(32, 4), 4)


def test_first_fit_is_deterministic_and_coalesces():
    a, b = FirstFit(1 << 20), FirstFit(1 << 20)
    for heap in (a, b):
        x = heap.alloc(100)
        y = heap.alloc(5000)
        heap.alloc(1)
        heap.free(x)
        heap.free(y)
        assert heap.alloc(300) == 0
    assert a.free_list == b.free_list and a.used == b.used
    assert all(offset % ALIGN == 0 for offset in a.used)
    c = FirstFit(4096)
    offsets = [c.alloc(1024) for _ in range(4)]
    assert c.alloc(1) is None
    for offset in reversed(offsets):
        c.free(offset)
    assert c.free_list == [(0, 4096)]


def test_packed_args_point_at_a_copy_of_the_struct():
    compiled = prepare(EXAMPLES / "allgather.pln", 2)
    data = struct.pack("<3Q", 1, 2, 3)
    packed = driver.PackedArgs(data)
    pointer = ctypes.c_void_p.from_address(packed.kernel_params).value
    assert ctypes.string_at(pointer, len(data)) == data
    stage, pad, counters = layout_sizes(compiled)
    assert pad >= 8 * compiled.schedule.signal_pad_size() and counters == 8 * compiled.schedule.channels


def test_checker_names_the_result():
    def failing():
        return (cu.CUresult.CUDA_ERROR_INVALID_VALUE,)

    def fine():
        return (cu.CUresult.CUDA_SUCCESS, 42)

    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_VALUE"):
        driver.call(failing)
    assert driver.call(fine) == 42


def test_ce_plan_handshake_and_initial_values():
    compiled = prepare(EXAMPLES / "allgather.pln", 2, atom="ce")
    p = compiled.plan
    assert p.pad_words == p.signals * 3
    for rank in range(2):
        image = init_image(p, rank)
        assert len(image) == 8 * p.pad_words
        kinds = [op[0] for ch in p.programs[rank] for op in ch]
        assert "copy" in kinds and kinds.count("wait") >= 1
    # every notify is gated, every wait re-opens the gate
    ops = [op for ch in p.programs[0] for op in ch]
    for i, op in enumerate(ops):
        if op[0] == "wait" and op[1] == 0 and op[2] >= p.signals:  # a gate wait precedes a remote flag write
            assert ops[i + 1][0] == "write" and ops[i + 2][0] == "write"
    buffers = Buffers(0x1000, 0x9000, (0x100000, 0x200000), (0x300000, 0x400000), 10, 4, 4, 64, 16)
    copies = [op for op in expand(p, 0, 0, buffers) if op[0] == "copy"]
    assert sum(op[3] for op in copies) > 0 and len({op[0] for op in expand(p, 0, 0, buffers)}) >= 2


def test_ce_rejects_reductions_with_a_reason():
    with pytest.raises(CeError, match="reduction"):
        prepare(EXAMPLES / "allreduce.pln", 2, atom="ce")


def test_ce_rejects_several_notifies_per_call():
    from purlinc import pipeline

    compiled = pipeline.prepare(EXAMPLES / "allgather.pln", world_size=2, overrides={"slices": 2, "stage_copies": 1})
    with pytest.raises(CeError, match="per_call"):
        plan(compiled.schedule)


def test_ce_rejects_two_staging_copies_and_gets_one_by_default():
    from purlinc import pipeline

    kernels = pipeline.prepare(EXAMPLES / "allgather.pln", world_size=2)
    assert kernels.schedule.stage_copies == 2 and kernels.options.key().endswith("/x2")
    with pytest.raises(CeError, match="2 staging copies"):
        plan(kernels.schedule)
    ce = prepare(EXAMPLES / "allgather.pln", 2, atom="ce")
    assert ce.schedule.stage_copies == 1 and plan(ce.schedule) is not None


def test_describe_cuda_array_interface_and_dlpack_without_a_gpu():
    class Fake:
        __cuda_array_interface__ = {"shape": (3, 4), "typestr": "<f2", "data": (0, False), "strides": None,
                                    "version": 3}

    described = describe(Fake())
    assert (described.numel, described.dtype, described.contiguous) == (12, DType.FLOAT16, True)
    with pytest.raises(TypeError, match="DLPack"):
        describe(object())
    np = pytest.importorskip("numpy")
    host = describe(np.arange(6, dtype=np.int32))  # NumPy speaks DLPack: a host array
    assert host.device == -1 and host.dtype is DType.INT32 and host.numel == 6


def test_importing_purlin_needs_no_gpu():
    import purlin
    import purlinc

    assert purlin.load is purlinc.load


class _FakeTensor:
    """Just what FastPath reads off a torch tensor."""

    def __init__(self, ptr, shape, dtype="bf16", contiguous=True):
        self.ptr, self.shape, self.dtype, self.contiguous = ptr, shape, dtype, contiguous

    def data_ptr(self):
        return self.ptr

    def is_contiguous(self):
        return self.contiguous


def test_fast_path_replays_only_identical_buffers(monkeypatch):
    """The eager fast path must never launch with stale arguments: any change of pointer,
    shape, dtype, contiguity, op or count takes the validating path."""
    import sys
    import types

    from purlinc.runtime.collective import FastPath

    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(Tensor=_FakeTensor))
    x, out = _FakeTensor(0x1000, (512,)), _FakeTensor(0x2000, (1024,))
    fast = FastPath.make(x, out, out, "sum", None, ("f", 1, 512, 0, "args"), out_units=2)
    assert fast.matches(x, out, "sum", None)
    assert fast.matches(_FakeTensor(0x1000, (512,)), _FakeTensor(0x2000, (1024,)), "sum", None)
    for other_x, other_out, op, count in [
        (_FakeTensor(0x1800, (512,)), out, "sum", None),
        (_FakeTensor(0x1000, (256,)), out, "sum", None),
        (_FakeTensor(0x1000, (512,), dtype="f32"), out, "sum", None),
        (_FakeTensor(0x1000, (512,), contiguous=False), out, "sum", None),
        (x, _FakeTensor(0x2000, (1000,)), "sum", None),
        (x, out, "max", None),
        (x, out, "sum", 256),
        (None, out, "sum", None),
        (x, None, "sum", None),
    ]:
        assert not fast.matches(other_x, other_out, op, count)
    # Not a plain tensor (e.g. CuPy): never cached.
    assert FastPath.make(object(), out, out, "sum", None, ("f", 1, 512, 0, "a"), out_units=2) is None
    # An output allocated by the call itself is never replayed.
    assert FastPath.make(x, None, out, "sum", None, ("f", 1, 512, 0, "a"), out_units=2) is None
    # No kernel (count 0, ce): nothing to replay.
    assert FastPath.make(x, out, out, "sum", None, None, out_units=2) is None


def test_fast_path_of_a_zero_copy_collective_lasts_while_the_heap_is_unchanged(monkeypatch):
    """A fast path made with the heap (a collective with a zero-copy twin) replays only while no
    heap block has been allocated or freed since: a freed block must reach the full path,
    which refuses it (FreedBufferError), and a buffer newly in the heap must be checked."""
    import sys
    import types

    from purlinc.runtime.collective import FastPath

    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(Tensor=_FakeTensor))
    heap = types.SimpleNamespace(generation=7)
    x, out = _FakeTensor(0x1000, (512,)), _FakeTensor(0x2000, (1024,))
    fast = FastPath.make(x, out, out, "sum", None, ("f", 1, 512, 0, "args"), 2, heap)
    assert fast.matches(x, out, "sum", None)
    heap.generation += 1  # any alloc or free
    assert not fast.matches(x, out, "sum", None)
    plain = FastPath.make(x, out, out, "sum", None, ("f", 1, 512, 0, "args"), 2)
    assert plain.matches(x, out, "sum", None)  # no twin: the heap does not matter


def test_replay_target_of_zero_copy_calls():
    """replay_target: staged calls replay their own launch, zero-copy calls their twin's once
    the ranks agreed (before that: nothing, so the full path agrees first); with a twin the
    heap rides along as the guard."""
    from types import SimpleNamespace

    from purlinc.runtime.collective import Collective
    from purlinc.runtime.validate import CallShape
    from purlinc.dtypes import DType

    shape = CallShape(count=256, dtype=DType.BFLOAT16, op=None, in_ptr=0x1000, out_ptr=0x2000)
    heap = SimpleNamespace(generation=0)
    twin = SimpleNamespace(target=lambda s: ("twin", s.count))

    class _ZC:
        offsets: dict = {}

        def __init__(self, choice):
            self.choice, self.twin = choice, twin

        def pick(self, s, *, record=True):
            assert record is False  # looking only: no exchange with the peers here
            return self.twin if self.choice else None

    staged = SimpleNamespace(_zc=None, comm=SimpleNamespace(heap=heap), target=lambda s: ("staged", s.count))
    assert Collective.replay_target(staged, shape) == (("staged", 256), None)
    staged._zc = _ZC(choice=False)
    assert Collective.replay_target(staged, shape) == (("staged", 256), heap)
    staged._zc = _ZC(choice=True)
    assert Collective.replay_target(staged, shape) == (None, None)  # not agreed yet
    _ZC.offsets[(0x1000, 0x2000, 256, DType.BFLOAT16, None)] = (0, 4096)
    assert Collective.replay_target(staged, shape) == (("twin", 256), heap)

def test_ce_plan_runs_every_channel_on_its_own_slices_and_signals():
    """The ce atom walks the concrete (rank, channel) programs of a channel-relative schedule:
    channel c copies only slice c and touches only the signals c*W..(c+1)*W-1 of each pad."""
    compiled = prepare(EXAMPLES / "allgather.pln", 2, atom="ce", channels=3)
    p, schedule = compiled.plan, compiled.schedule
    W = schedule.channel_signals
    assert p.signals == schedule.signal_pad_size() == 3 * W
    for rank in range(2):
        for channel in range(3):
            ops = p.programs[rank][channel]
            assert {op[1].slice for op in ops if op[0] == "copy"} == {channel}
            flags = {op[2] for op in ops if op[0] != "copy" and op[2] < p.signals}
            assert flags and all(channel * W <= word < (channel + 1) * W for word in flags)


def test_byte_ranges_overlap_only_where_they_share_a_byte():
    from purlinc.runtime.validate import overlapping

    assert overlapping((0, 10), (9, 20)) and overlapping((5, 6), (0, 100)) and overlapping((0, 100), (5, 6))
    assert not overlapping((0, 10), (10, 20)) and not overlapping((10, 20), (0, 10))  # adjacent
    assert not overlapping((5, 5), (0, 10)) and not overlapping((0, 10), (3, 3))  # empty ranges share no byte


def test_the_swept_overlap_check_finds_what_a_scan_of_every_pair_finds():
    """refuse_shared_writes sweeps the extents in address order (every group call runs it); on
    random extents it refuses exactly where the pairwise scan does, naming the same pair."""
    import random

    from purlinc.runtime.errors import ArgumentError
    from purlinc.runtime.group import refuse_shared_writes

    def scanned(by_rank):
        for rank, extents in enumerate(by_rank):
            for label, start, end, written in extents:
                if not written:
                    continue
                for other, theirs in enumerate(by_rank):
                    for other_label, s, e, _ in theirs:
                        if other != rank and start < e and s < end and start < end and s < e:
                            return f"rank {rank}'s {label} overlaps rank {other}'s {other_label} in memory"
        return None

    rng = random.Random(5)
    for _ in range(4000):
        by_rank = [[(f"b{i}", start, start + rng.choice((0, 8, 64, 256)), rng.random() < 0.5)
                    for i, start in enumerate(rng.randrange(0, 2048, 8) for _ in range(rng.randint(1, 4)))]
                   for _ in range(rng.randint(2, 5))]
        expected = scanned(by_rank)
        try:
            refuse_shared_writes("c", by_rank)
            got = None
        except ArgumentError as error:
            got = error.message.removeprefix("c: ").removesuffix(", expected a buffer of its own")
        assert got == expected, by_rank
