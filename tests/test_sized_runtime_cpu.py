"""The run-time-sizes load and call path on the CPU, with the recording stand-in driver of
test_runtime_load_cpu: load takes capacity-sized staging from the heap, a call validates
its buffers and packs the kernel argument with the device pointers of the sizes (the host
never reads them), and a size error recorded by the device is raised as a SizeError naming
the rank and the pair."""

from __future__ import annotations

import ctypes
import re
import struct
from pathlib import Path

import pytest

from purlinc.atom.sized import SIZED_FIELDS, slot_bytes
from purlinc.errors import PurlinError
from purlinc.runtime.loader import load
from purlinc.runtime.errors import ArgumentError
from purlinc.runtime.sized import SizedCollective, SizeError
from test_runtime_load_cpu import FakeComm, fake  # noqa: F401 (fixture)

SIZED = Path(__file__).resolve().parent.parent / "examples" / "sized"
EXAMPLES = SIZED.parent


class Device:
    """Something with __cuda_array_interface__ at a made-up device address."""

    def __init__(self, ptr: int, shape: tuple, typestr: str):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": typestr, "version": 3}


@pytest.fixture
def on_device_zero(monkeypatch):
    from purlinc.runtime import driver

    monkeypatch.setattr(driver, "pointer_device", lambda ptr: 0)


def test_load_takes_capacity_sized_staging(fake):
    coll = load(SIZED / "alltoallv.pln", FakeComm(), capacity=1000, dtype="bfloat16", channels=2)
    assert isinstance(coll, SizedCollective) and coll.capacity == 1000 and coll.itemsize == 2
    schedule = coll.compiled.schedule
    # one peer, two copies; a slot: 16 header bytes, two channel regions of 1000 bytes rounded up to 16
    assert coll.layout.stage_bytes == schedule.staging_units * slot_bytes(2, 2000) == 2 * (16 + 2 * 1008)


def test_load_refuses_missing_or_misplaced_capacity(fake):
    with pytest.raises(PurlinError, match="load it with capacity=C"):
        load(SIZED / "alltoallv.pln", FakeComm(), channels=1)
    with pytest.raises(PurlinError, match="allgather has no run-time sizes"):
        load(EXAMPLES / "allgather.pln", FakeComm(), capacity=8)
    with pytest.raises(ArgumentError, match="capacity must be a positive number"):
        load(SIZED / "alltoallv.pln", FakeComm(), capacity=0)
    with pytest.raises(ArgumentError, match="capacity must be a positive number of elements per chunk, got True"):
        load(SIZED / "alltoallv.pln", FakeComm(), capacity=True)  # a bool is no count (it loaded with 1)


def test_call_packs_device_pointers_of_the_sizes(fake, on_device_zero, monkeypatch):
    from purlinc.runtime import driver

    launches = []
    monkeypatch.setattr(driver, "launch", lambda *args: launches.append(args))
    coll = load(SIZED / "alltoallv.pln", FakeComm(), capacity=64)
    x, out = Device(0x100000, (100,), "<f4"), Device(0x200000, (128,), "<f4")
    sizes, out_sizes = Device(0x300000, (2,), "<i8"), Device(0x400000, (2,), "<i8")
    assert coll(x, sizes, out, out_sizes, stream=7) == (out, out_sizes)
    function, grid, block, shared, stream, packed = launches[0]
    words = struct.unpack(f"<{len(SIZED_FIELDS) + 4}Q", packed.buffer.raw)
    fields = dict(zip(SIZED_FIELDS, words))
    assert (fields["capacity"], fields["in_len"], fields["out_len"], fields["unit_bytes"]) == (64, 100, 128, 4)
    assert (fields["in"], fields["out"], fields["sizes"], fields["out_sizes"]) == (0x100000, 0x200000, 0x300000, 0x400000)
    assert stream == 7 and grid == 1 and function == coll._variants[next(iter(coll._variants))][0]


@pytest.mark.parametrize("args, words", [
    (((100,), "<f4", (3,), "<i8"), "sizes has 3 entries, expected 2 (one per chunk of this rank's input)"),
    (((100,), "<f4", (2,), "<i4"), "sizes has dtype int32, expected int64"),
    (((100,), "<c8", (2,), "<i8"), "x has dtype"),
])
def test_call_validates_before_launching(fake, on_device_zero, monkeypatch, args, words):
    from purlinc.runtime import driver

    monkeypatch.setattr(driver, "launch", lambda *a: pytest.fail("launched"))
    coll = load(SIZED / "alltoallv.pln", FakeComm(), capacity=64)
    shape, typestr, sizes_shape, sizes_type = args
    with pytest.raises(ArgumentError, match=words.replace("(", r"\(").replace(")", r"\)")):
        coll(Device(0x100000, shape, typestr), Device(0x300000, sizes_shape, sizes_type),
             Device(0x200000, (128,), "<f4"), Device(0x400000, (2,), "<i8"), stream=1)


@pytest.mark.parametrize("x, sizes, out, out_sizes, words", [
    # (address, shape, typestr) of each; the flat path refused these, the sized one launched them
    ((0x100000, (128,), "<f4"), (0x300000, (2,), "<i8"), (0x100000, (128,), "<f4"), (0x400000, (2,), "<i8"),
     "out overlaps x in memory"),
    ((0x100000, (128,), "<f4"), (0x300000, (2,), "<i8"), (0x100100, (64,), "<f4"), (0x400000, (2,), "<i8"),
     "out overlaps x in memory"),
    ((0x100000, (128,), "<f4"), (0x300000, (2,), "<i8"), (0x200000, (128,), "<f4"), (0x300000, (2,), "<i8"),
     "out_sizes overlaps sizes in memory"),
    ((0x100000, (128,), "<f4"), (0x300000, (2,), "<i8"), (0x200000, (128,), "<f4"), (0x100008, (2,), "<i8"),
     "out_sizes overlaps x in memory"),
    ((0x100000, (128,), "<f4"), (0x300000, (2,), "<i8"), (0x200000, (128,), "<f4"), (0x200000, (2,), "<i8"),
     "out_sizes overlaps out in memory"),
    ((0x100000, (128,), "<f4"), (0x300000, (2,), "<i8"), (0x200001, (128,), "<f4"), (0x400000, (2,), "<i8"),
     "out at 0x200001 is not aligned to its element size (4 bytes)"),
    ((0x100002, (128,), "<f4"), (0x300000, (2,), "<i8"), (0x200000, (128,), "<f4"), (0x400000, (2,), "<i8"),
     "x at 0x100002 is not aligned to its element size (4 bytes)"),
])
def test_call_refuses_overlapping_or_misaligned_buffers(fake, on_device_zero, monkeypatch, x, sizes, out, out_sizes,
                                                        words):
    """The kernel reads x and sizes while it writes out and out_sizes, and moves whole elements:
    a call whose outputs share bytes with another buffer, or whose data is not aligned to its
    element, is refused before the launch, as the flat collectives' calls are."""
    from purlinc.runtime import driver

    monkeypatch.setattr(driver, "launch", lambda *a: pytest.fail("launched"))
    coll = load(SIZED / "alltoallv.pln", FakeComm(), capacity=64)
    with pytest.raises(ArgumentError, match="alltoallv on rank 0: " + re.escape(words)):
        coll(Device(*x), Device(*sizes), Device(*out), Device(*out_sizes), stream=1)


def test_wider_dtype_than_the_staging_is_refused(fake, on_device_zero):
    coll = load(SIZED / "alltoallv.pln", FakeComm(), capacity=64, dtype="bfloat16")
    with pytest.raises(ArgumentError, match="float32 .4 bytes. is wider than this load's staging"):
        coll(Device(0x100000, (8,), "<f4"), Device(0x300000, (2,), "<i8"), Device(0x200000, (8,), "<f4"),
             Device(0x400000, (2,), "<i8"), stream=1)


def test_device_size_error_is_raised_once_by_check(fake):
    coll = load(SIZED / "alltoallv.pln", FakeComm(), capacity=64)
    record = (ctypes.c_uint64 * 8).from_address(coll.size_host)
    record[:] = [1, 0, 0, 1, 65, 64, 3, 0]  # what purlin_size_error writes: kind 1 (capacity)
    with pytest.raises(SizeError, match=r"rank 0, call 3: chunk x\[0\]\[1\] from rank 0 to rank 1: "
                                        r"size n\[0\]\[1\] = 65 outside 0..64") as caught:
        coll.check()
    assert caught.value.record["size"] == 65
    coll.check()  # cleared once raised: the collective stays usable


def test_sizes_by_the_operands_name(fake, on_device_zero, monkeypatch):
    from purlinc.runtime import driver

    launches = []
    monkeypatch.setattr(driver, "launch", lambda *args: launches.append(args))
    coll = load(SIZED / "alltoallv.pln", FakeComm(), capacity=64)
    x, out = Device(0x100000, (100,), "<f4"), Device(0x200000, (128,), "<f4")
    sizes, out_sizes = Device(0x300000, (2,), "<i8"), Device(0x400000, (2,), "<i8")
    coll(x, n=sizes, out=out, out_sizes=out_sizes, stream=3)
    assert len(launches) == 1
    with pytest.raises(ArgumentError, match="unknown operand.s. m; this collective takes 'n'"):
        coll(x, m=sizes, out=out, out_sizes=out_sizes, stream=3)
    with pytest.raises(ArgumentError, match="n .the sizes of this rank's input chunks. is required"):
        coll(x, out=out, out_sizes=out_sizes, stream=3)


@pytest.mark.parametrize("devices,refused", [((0, 0), True), ((0, 1), False)])
def test_torchrun_ranks_on_one_gpu_that_cannot_be_resident_are_refused(fake, monkeypatch, devices, refused):
    """Two ranks on cuda:0 with two channels each need 4 resident blocks where 3 fit: the first
    use of a dtype raises before anything is launched (as a plain collective's does)."""
    from purlinc.dtypes import DType
    from purlinc.runtime import driver
    from purlinc.runtime.errors import ResidencyError

    monkeypatch.setattr(driver, "blocks_per_sm", lambda function, threads, shared: 1)
    monkeypatch.setattr(driver, "sm_count", lambda device: 3)
    comm = FakeComm()
    comm.peer_devices = devices
    coll = load(SIZED / "alltoallv.pln", comm, capacity=64, channels=2)
    if refused:
        with pytest.raises(ResidencyError, match=r"needs 4 blocks resident at once on cuda:0 .* ranks 0, 1 sharing"):
            coll.variant(DType.FLOAT32)
    else:
        assert coll.blocks(DType.FLOAT32).per_sm == 1


def _loopback_sized(monkeypatch, channels: int):
    """A LocalGroup's sized collective of two ranks on cuda:0 (the group built as load_sized does)."""
    from purlinc.runtime.collective import Layout
    from purlinc.runtime.loader import _prepare_sized
    from purlinc.runtime.options import LoadOptions
    from purlinc.runtime.sized import GroupSized
    from test_runtime_load_cpu import FakeHeap, _LoopbackComm

    compiled = _prepare_sized(SIZED / "alltoallv.pln", 2, LoadOptions(channels=channels, capacity=64))
    ranks = []
    for r in range(2):
        comm = _LoopbackComm(r)
        comm.heap = FakeHeap(2)
        pad = 8 * max(compiled.schedule.signal_pad_size(), 1)
        layout = Layout(comm.heap.alloc(4096, "staging"), 4096, comm.heap.alloc(pad, "pad"), pad,
                        comm.heap.alloc(8 * channels, "counters"), 8 * channels)
        ranks.append(SizedCollective(compiled, comm, layout, capacity=64, itemsize=4, agree=False))
    return GroupSized(ranks)


def test_a_group_call_that_cannot_be_resident_is_refused_before_any_launch(fake, on_device_zero, monkeypatch):
    """Ranks of a loopback group wait for each other's blocks: where the GPU holds 3 and two
    ranks need 2 each, the call raises and nothing is launched; 1 each runs."""
    from purlinc.runtime import driver
    from purlinc.runtime.errors import ResidencyError

    monkeypatch.setattr(driver, "blocks_per_sm", lambda function, threads, shared: 1)
    monkeypatch.setattr(driver, "sm_count", lambda device: 3)
    launches = []
    monkeypatch.setattr(driver, "launch", lambda *args: launches.append(args))
    xs = [Device(0x100000 * (r + 1), (100,), "<f4") for r in range(2)]
    outs = [Device(0x800000 * (r + 1), (128,), "<f4") for r in range(2)]
    sizes = [Device(0x3000000 + 0x1000 * r, (2,), "<i8") for r in range(2)]
    out_sizes = [Device(0x4000000 + 0x1000 * r, (2,), "<i8") for r in range(2)]
    _loopback_sized(monkeypatch, 1)(xs, sizes, outs, out_sizes, streams=[1, 2])
    assert len(launches) == 2
    group = _loopback_sized(monkeypatch, 2)
    with pytest.raises(ResidencyError, match=r"needs 4 blocks resident at once on cuda:0 .* at most 3 of them"):
        group(xs, sizes, outs, out_sizes, streams=[1, 2])
    assert len(launches) == 2  # nothing more was launched


@pytest.mark.parametrize("case, message", [
    ("one out", r"rank 0's out overlaps rank 1's out in memory, expected a buffer of its own"),
    ("one out_sizes", r"rank 0's out_sizes overlaps rank 1's out_sizes in memory"),
    ("out on a peer's x", r"rank 1's out overlaps rank 0's x in memory"),
])
def test_a_group_call_refuses_a_buffer_one_rank_writes_and_another_uses(fake, on_device_zero, monkeypatch, case,
                                                                         message):
    """Each rank's buffers were checked against its own only: two ranks writing one out (or one
    rank writing what another reads) launched and raced on the shared GPU."""
    from purlinc.runtime import driver
    from purlinc.runtime.errors import ArgumentError

    launches = []
    monkeypatch.setattr(driver, "blocks_per_sm", lambda function, threads, shared: 8)
    monkeypatch.setattr(driver, "sm_count", lambda device: 132)
    monkeypatch.setattr(driver, "launch", lambda *args: launches.append(args))
    xs = [Device(0x100000 * (r + 1), (128,), "<f4") for r in range(2)]
    outs = [Device(0x800000 * (r + 1), (128,), "<f4") for r in range(2)]
    sizes = [Device(0x3000000 + 0x1000 * r, (2,), "<i8") for r in range(2)]
    out_sizes = [Device(0x4000000 + 0x1000 * r, (2,), "<i8") for r in range(2)]
    if case == "one out":
        outs[1] = outs[0]
    elif case == "one out_sizes":
        out_sizes[1] = out_sizes[0]
    else:
        outs[1] = xs[0]
    group = _loopback_sized(monkeypatch, 1)
    with pytest.raises(ArgumentError, match=message):
        group(xs, sizes, outs, out_sizes, streams=[1, 2])
    assert not launches
    group([Device(0x100000, (128,), "<f4")] * 2, sizes, [Device(0x800000 * (r + 1), (128,), "<f4") for r in range(2)],
          [Device(0x4000000 + 0x1000 * r, (2,), "<i8") for r in range(2)], streams=[1, 2])  # one x, read by both
    assert len(launches) == 2


def test_expected_sizes_are_packed_checked_and_kept_apart(fake, on_device_zero, monkeypatch):
    """``expected_sizes=`` (int64, one per output chunk) reaches the kernel as a device pointer,
    0 where not given; a wrong length, dtype, or a tensor the kernel writes over is refused
    before the launch."""
    from purlinc.runtime import driver

    launches = []
    monkeypatch.setattr(driver, "launch", lambda *args: launches.append(args))
    coll = load(SIZED / "alltoallv.pln", FakeComm(), capacity=64)
    x, out = Device(0x100000, (100,), "<f4"), Device(0x200000, (128,), "<f4")
    sizes, out_sizes = Device(0x300000, (2,), "<i8"), Device(0x400000, (2,), "<i8")

    def expected_word():
        words = struct.unpack(f"<{len(SIZED_FIELDS) + 4}Q", launches[-1][-1].buffer.raw)
        return dict(zip(SIZED_FIELDS, words))["expected"]

    coll(x, sizes, out, out_sizes, stream=7)
    assert expected_word() == 0
    coll(x, sizes, out, out_sizes, stream=7, expected_sizes=Device(0x500000, (2,), "<i8"))
    assert expected_word() == 0x500000
    for bad, words in ((Device(0x500000, (3,), "<i8"), "expected_sizes has 3 entries, expected 2 (one per chunk of "
                                                       "this rank's output)"),
                       (Device(0x500000, (2,), "<i4"), "expected_sizes has dtype int32, expected int64"),
                       (Device(0x400008, (2,), "<i8"), "out_sizes overlaps expected_sizes in memory"),
                       (Device(0x200010, (2,), "<i8"), "out overlaps expected_sizes in memory")):
        with pytest.raises(ArgumentError, match=re.escape(words)):
            coll(x, sizes, out, out_sizes, stream=7, expected_sizes=bad)
    assert len(launches) == 2


def test_a_chunk_that_differs_from_the_expected_size_is_a_size_error(fake):
    coll = load(SIZED / "alltoallv.pln", FakeComm(), capacity=64)
    record = (ctypes.c_uint64 * 8).from_address(coll.size_host)
    record[:] = [4, 0, 1, 1, 7, 5, 2, 0]  # kind 4: OUT unit 1 of rank 0 arrived with 7, 5 expected
    with pytest.raises(SizeError, match=r"rank 0, call 2: chunk x\[1\]\[0\] from rank 1 to rank 0: size 7 differs "
                                        r"from the 5 rank 0 expects \(its expected sizes\); it was not written"):
        coll.check()
    coll.check()


class _DLPackOnDevice:
    """An int64 array exported by DLPack as if on cuda:0 (NumPy memory, the device faked)."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return (2, 0)


def test_sizes_are_int64_by_their_dtype_not_its_name(fake, on_device_zero, monkeypatch):
    """"uint64" contains "int64": such out_sizes were taken, and (no itemsize known) their
    overlap with out was not checked; a DLPack int64, named by its type code, was refused."""
    import numpy as np

    from purlinc.runtime import driver

    launches = []
    monkeypatch.setattr(driver, "launch", lambda *args: launches.append(args))
    coll = load(SIZED / "alltoallv.pln", FakeComm(), capacity=64)
    x, n, out = Device(0x100000, (100,), "<f4"), Device(0x300000, (2,), "<i8"), Device(0x200000, (128,), "<f4")
    with pytest.raises(ArgumentError, match="out_sizes has dtype uint64, expected int64"):
        coll(x, n, out, Device(0x200000, (2,), "<u8"), stream=1)
    coll(x, _DLPackOnDevice(np.array([1, 2], np.int64)), out, Device(0x400000, (2,), "<i8"), stream=1)
    assert len(launches) == 1


@pytest.mark.parametrize("sizes,says", [
    ((0x300000, (2,), "<i8", (16,)), "sizes is not contiguous"),
    ((0x300004, (2,), "<i8", None), "sizes at 0x300004 is not aligned to 8 bytes (int64 sizes)"),
])
def test_sizes_layout_refusals_say_which(fake, on_device_zero, sizes, says):
    """Both cases said "must be contiguous and 8-byte aligned", neither which nor where."""
    ptr, shape, typestr, strides = sizes
    n = Device(ptr, shape, typestr)
    n.__cuda_array_interface__["strides"] = strides
    coll = load(SIZED / "alltoallv.pln", FakeComm(), capacity=64)
    with pytest.raises(ArgumentError, match=re.escape(f"alltoallv on rank 0: {says}")):
        coll(Device(0x100000, (100,), "<f4"), n, Device(0x200000, (128,), "<f4"), Device(0x400000, (2,), "<i8"),
             stream=1)


SCATTERV = "collective sv(root = 1) with sizes n[R] of x { in[root] = x[0..R] out[r] = x[r] copy }"
GATHERV = "collective gv(root = 1) with sizes n[R] of x { in[r] = x[r] out[root] = x[0..R] copy }"


def test_a_rank_without_chunks_passes_none_or_empty_buffers(fake, on_device_zero, monkeypatch):
    """An empty CUDA-array-interface buffer reports no device and was refused as "on the host";
    a rank that gives (or receives) nothing could not pass None for it either."""
    from purlinc.runtime import driver

    launches = []
    monkeypatch.setattr(driver, "launch", lambda *args: launches.append(args))
    out, none = Device(0x200000, (64,), "<f4"), Device(0x300000, (0,), "<i8")
    scatter = load(SCATTERV, FakeComm(), capacity=64)  # rank 0 of 2: gives nothing, receives x[0]
    scatter(None, none, out, Device(0x400000, (1,), "<i8"), stream=1)
    scatter(Device(0x100000, (0,), "<f4"), none, out, Device(0x400000, (1,), "<i8"), stream=1)
    with pytest.raises(ArgumentError, match="this rank gives no chunks and x is None: pass out="):
        scatter(None, none, None, Device(0x400000, (1,), "<i8"), stream=1)
    with pytest.raises(ArgumentError, match="sv on rank 0: out_sizes is required: Purlin allocates it with torch or "
                                            "CuPy, like the call's buffers, and these are cuda_array_interface arrays"):
        scatter(None, none, out, stream=1)  # was a TypeError naming an "input" this rank did not pass
    with pytest.raises(ArgumentError, match="sv on rank 0: out is required: cannot allocate an output"):
        scatter(Device(0x100000, (0,), "<f4"), none, None, Device(0x400000, (1,), "<i8"), stream=1)
    gather = load(GATHERV, FakeComm(), capacity=64)  # rank 0 of 2: gives x[0], receives nothing
    x, n = Device(0x100000, (10,), "<f4"), Device(0x300000, (1,), "<i8")
    assert gather(x, n, stream=1) == (None, None)  # nothing to allocate, and no library to do it with
    gather(x, n, Device(0x200000, (0,), "<f4"), none, stream=1)
    assert len(launches) == 4


def test_numpy_integers_are_whole_numbers(fake, on_device_zero, monkeypatch):
    """np.int64(2) was refused as row=np.int64(2), "expected ... in 1..64" (and capacity alike)."""
    import numpy as np

    from purlinc.runtime import driver

    monkeypatch.setattr(driver, "launch", lambda *args: None)
    coll = load(SIZED / "alltoallv.pln", FakeComm(), capacity=np.int64(64))
    assert coll.capacity == 64 and type(coll.capacity) is int
    for row in (np.int64(2), 2):  # one launch-argument entry for both: the row is an int once checked
        coll(Device(0x100000, (100,), "<f4"), Device(0x300000, (2,), "<i8"), Device(0x200000, (128,), "<f4"),
             Device(0x400000, (2,), "<i8"), stream=1, row=row)
    assert len(coll._args) == 1
    with pytest.raises(ArgumentError, match="row=True, expected elements per size unit"):
        coll(Device(0x100000, (100,), "<f4"), Device(0x300000, (2,), "<i8"), stream=1, row=True)


def test_a_size_error_of_a_chunk_no_output_names_says_so():
    """"to ranks : size ..." with an empty list of destinations."""
    from purlinc import pipeline
    from purlinc.atom.sized import describe_size_error

    spec = pipeline.spec_of(pipeline.load_source(
        "collective u with sizes n[R][2] of x { in[r] = x[r][0], x[r][1]  out[r] = x[0..R][0]  copy }"), 2, None)
    assert describe_size_error((1, 1, 0, 1, 99, 8, 0, 0), spec).startswith(
        "rank 1, call 0: chunk x[1][1] of rank 1 (no output names it): size n[1][1] = 99 outside 0..8")
