"""The run-time-sizes load and call path on the CPU, with the recording stand-in driver of
test_runtime_load_cpu: load takes capacity-sized staging from the heap, a call validates
its buffers and packs the kernel argument with the device pointers of the sizes (the host
never reads them), and a size error recorded by the device is raised as a SizeError naming
the rank and the pair."""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path

import pytest

from purlinc.atom.sized import SIZED_FIELDS, slot_bytes
from purlinc.errors import PurlinError
from purlinc.runtime.collective import load
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
