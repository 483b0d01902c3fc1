"""Callers' buffers in captured calls (purlinc/runtime/graphbuffers.py), with a fake driver:
which calls register, the peers' pointers a LocalGroup records and a torchrun exchange opens,
and the fallbacks (a rank that cannot export, a peer that does not join)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from purlinc import settings
from purlinc.dtypes import DType
from purlinc.errors import PurlinError
from purlinc.runtime import graphbuffers, symmetric, zerocopy
from purlinc.runtime.errors import ArgumentError, CudaError, MismatchError
from purlinc.runtime.validate import CallShape

STREAM, CAPTURING = 0x100, 0x200


class FakeDriver:
    """Streams CAPTURING is captured, others not; IPC handles name allocations of 1 MiB."""

    CAPTURE_MODE_RELAXED = "relaxed"

    def __init__(self, unexportable=()):
        self.mode = "global"
        self.modes = []  # the mode each IPC call ran under
        self.opened = []
        self.unexportable = set(unexportable)
        self.loaded = []

    def stream_capturing(self, stream):
        return stream == CAPTURING

    def exchange_capture_mode(self, mode):
        previous, self.mode = self.mode, mode
        return previous

    def ipc_handle(self, ptr):
        self.modes.append(self.mode)
        base = ptr & ~((1 << 20) - 1)
        if base in self.unexportable:
            raise CudaError("cuIpcGetMemHandle failed: CUDA_ERROR_INVALID_VALUE")
        return base.to_bytes(64, "little"), ptr - base

    def ipc_open(self, handle, offset=0):
        self.modes.append(self.mode)
        self.opened.append(handle)
        return 0x7F00_0000_0000 + int.from_bytes(handle, "little") + offset  # "mapped here"


class FakeComm:
    def __init__(self, rank, exchange=None, group=None):
        self.rank, self.device, self.closed = rank, 0, False
        self._check_exchange = exchange
        self._opened = []
        self.local_group = group
        self.heap = SimpleNamespace(generation=0)


def collective(comm, driver, *, packed=False, registered=frozenset({"in"}), units=(1, 1), world=2):
    schedule = SimpleNamespace(in_units=[units[0]] * world, out_units=[units[1]] * world)
    compiled = SimpleNamespace(options=SimpleNamespace(packed=packed, registered=registered), schedule=schedule)
    staged = SimpleNamespace(name="allreduce", rank=comm.rank, comm=comm, in_units=units[0], out_units=units[1],
                             compiled=compiled, _driver=driver)
    twin = SimpleNamespace(name="allreduce", compiled=compiled, loaded=[],
                           variant=lambda dtype, op: driver.loaded.append((dtype, op)))
    staged._zc = zerocopy.ZeroCopy(staged, twin)
    return staged


def shape(in_ptr, out_ptr, count=256):
    return CallShape(DType.BFLOAT16, None, count, in_ptr, out_ptr)


@pytest.fixture(autouse=True)
def no_heap_blocks(monkeypatch):
    monkeypatch.setattr(symmetric, "any_blocks", lambda: False)


def test_setting_modes(monkeypatch):
    assert settings.graph_buffers() == "auto"
    monkeypatch.setenv("PURLIN_GRAPH_BUFFERS", "Stage")
    assert settings.graph_buffers() == "stage"
    monkeypatch.setenv("PURLIN_GRAPH_BUFFERS", "always")
    with pytest.raises(PurlinError, match="PURLIN_GRAPH_BUFFERS='always': expected one of auto, register, stage"):
        settings.graph_buffers()
    assert settings.GRAPH_BUFFERS in settings.ALL and not settings.GRAPH_BUFFERS.affects_codegen


# --------------------------------------------------------------------------- one process


def local_group(driver, world=2, **kw):
    group = SimpleNamespace()
    return [collective(FakeComm(r, group=group), driver, world=world, **kw) for r in range(world)]


def test_group_call_records_pointers_and_a_captured_call_takes_the_twin():
    driver = FakeDriver()
    ranks = local_group(driver)
    shapes = [shape(0x1000 + r * 0x10_0000, 0x2000 + r * 0x10_0000) for r in range(2)]
    zerocopy.agree_group(ranks, [(s, None, None) for s in shapes])
    for rank, s in zip(ranks, shapes):
        zc = rank._zc
        assert zc.pick(s, stream=STREAM) is None  # eager: staged
        assert zc.pick(s) is None  # no stream known (the fast-path decision): staged
        assert zc.pick(s, record=False, stream=CAPTURING) is zc.twin  # prime: the twin's kernel
        assert zc.pick(s, stream=CAPTURING) is zc.twin
        peers = zerocopy.peer_args(zc.twin, s)
        assert peers == {"in_peer": [0x1000, 0x10_1000], "out_peer": [0x2000, 0x10_2000]}
        assert zc.graph_registered == 1
    assert driver.loaded == [(DType.BFLOAT16, None)] * 2 and not driver.opened  # one address space


def test_per_rank_capture_needs_a_group_call_first():
    ranks = local_group(FakeDriver())
    with pytest.raises(ArgumentError, match="a captured per-rank call on buffers that no group call has seen"):
        ranks[1]._zc.pick(shape(0x1000, 0x2000), stream=CAPTURING)


@pytest.mark.parametrize("mode,packed,registers", [
    ("auto", False, True), ("auto", True, False),  # LL-packed sizes stage (measured rule)
    ("register", True, True), ("stage", False, False),
])
def test_the_setting_decides(monkeypatch, mode, packed, registers):
    monkeypatch.setenv("PURLIN_GRAPH_BUFFERS", mode)
    ranks = local_group(FakeDriver(), packed=packed)
    shapes = [shape(0x1000 + r, 0x2000 + r) for r in range(2)]
    zerocopy.agree_group(ranks, [(s, None, None) for s in shapes])
    picked = ranks[0]._zc.pick(shapes[0], stream=CAPTURING)
    assert (picked is ranks[0]._zc.twin) == registers


# --------------------------------------------------------------------------- torchrun


def exchange_with(peer_entry):
    """rank 0's view of an exchange whose rank 1 answered ``peer_entry(mine)``."""
    seen = []

    def exchange(obj):
        seen.append(obj)
        return [obj, peer_entry(obj)]

    return exchange, seen


def test_torchrun_capture_exports_exchanges_and_opens_once():
    driver = FakeDriver()
    peer_in = (3 << 20).to_bytes(64, "little")
    exchange, seen = exchange_with(lambda obj: ("graph-buffers", obj[1], obj[2], ((peer_in, 0x40, 512), None)))
    staged = collective(FakeComm(0, exchange), driver)
    zc = staged._zc
    s = shape((5 << 20) + 0x80, (6 << 20))
    assert zc.pick(s, stream=CAPTURING) is zc.twin
    # registered={"in"}: only inputs are exported (a pull twin never reaches a peer's output)
    assert seen[0][0] == "graph-buffers" and seen[0][3] == (((5 << 20).to_bytes(64, "little"), 0x80, 512), None)
    peers = zerocopy.peer_args(zc.twin, s)
    assert peers["in_peer"] == [s.in_ptr, 0x7F00_0000_0000 + (3 << 20) + 0x40]
    assert peers["out_peer"] == [s.out_ptr, 0]
    assert staged.comm._opened == [0x7F00_0000_0000 + (3 << 20)]  # closed with the communicator
    assert zc.pick(s, stream=CAPTURING) is zc.twin  # captured again (a second graph): exchanged again...
    assert len(seen) == 2 and driver.opened == [peer_in]  # ...but the allocation is opened once
    assert set(driver.modes) == {"relaxed"} and driver.mode == "global"  # relaxed only around the IPC calls
    assert zc.pick(s, stream=STREAM) is None and len(seen) == 2  # eager calls stage, no exchange


def test_a_rank_that_cannot_export_makes_every_rank_stage():
    driver = FakeDriver(unexportable={5 << 20})
    peer = (((3 << 20).to_bytes(64, "little"), 0, 512), None)
    exchange, seen = exchange_with(lambda obj: ("graph-buffers", obj[1], obj[2], peer))
    zc = collective(FakeComm(0, exchange), driver)._zc
    assert zc.pick(shape(5 << 20, 6 << 20), stream=CAPTURING) is None
    assert seen[0][3] == (None, None) and zc.graph_staged == 1 and zc.graph_registered == 0 and not driver.opened
    # ...and the peer, whose own export worked, sees this rank's None and stages alike
    driver = FakeDriver()
    exchange, _ = exchange_with(lambda obj: ("graph-buffers", obj[1], obj[2], (None, None)))
    zc = collective(FakeComm(0, exchange), driver)._zc
    assert zc.pick(shape(5 << 20, 6 << 20), stream=CAPTURING) is None and zc.graph_staged == 1


def test_a_peer_that_does_not_capture_the_same_call_is_a_mismatch():
    exchange, _ = exchange_with(lambda obj: ("graph-buffers", obj[1], (128, "bfloat16", None), (None, None)))
    zc = collective(FakeComm(0, exchange), FakeDriver())._zc
    with pytest.raises(MismatchError, match=r"ranks \[1\] did not capture the same call as rank 0"):
        zc.pick(shape(5 << 20, 6 << 20), stream=CAPTURING)

    def timeout(obj):
        raise RuntimeError("gloo timed out")

    zc = collective(FakeComm(0, timeout), FakeDriver())._zc
    with pytest.raises(MismatchError, match="a peer did not join the exchange"):
        zc.pick(shape(5 << 20, 6 << 20), stream=CAPTURING)


def test_rank_without_input_exports_nothing_for_it():
    """A broadcast-like rank with no input: nothing to export there, the root's is opened."""
    driver = FakeDriver()
    root_in = (3 << 20).to_bytes(64, "little")
    exchange, seen = exchange_with(lambda obj: ("graph-buffers", obj[1], obj[2], ((root_in, 0, 512), None)))
    staged = collective(FakeComm(0, exchange), driver, units=(0, 1))
    staged.compiled.schedule.in_units = [0, 1]
    zc = staged._zc
    s = shape(0, 6 << 20)
    assert zc.pick(s, stream=CAPTURING) is zc.twin
    assert seen[0][3] == (None, None)
    assert zerocopy.peer_args(zc.twin, s)["in_peer"] == [0, 0x7F00_0000_0000 + (3 << 20)]


def test_relaxed_capture_restores_the_mode_on_errors():
    driver = FakeDriver()
    with pytest.raises(RuntimeError):
        with graphbuffers.relaxed_capture(driver):
            assert driver.mode == "relaxed"
            raise RuntimeError("boom")
    assert driver.mode == "global"


def test_stream_capturing_reads_the_driver(monkeypatch):
    from cuda.bindings import driver as cu

    from purlinc.runtime import driver

    status = cu.CUstreamCaptureStatus
    answers = {1: (cu.CUresult.CUDA_SUCCESS, status.CU_STREAM_CAPTURE_STATUS_ACTIVE),
               2: (cu.CUresult.CUDA_SUCCESS, status.CU_STREAM_CAPTURE_STATUS_NONE),
               0: (cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, None),  # the legacy stream, mid-capture
               3: (cu.CUresult.CUDA_ERROR_INVALID_HANDLE, None)}
    monkeypatch.setattr(cu, "cuStreamIsCapturing", lambda stream: answers[stream])
    assert driver.stream_capturing(1) and not driver.stream_capturing(2) and not driver.stream_capturing(0)
    with pytest.raises(CudaError, match="cuStreamIsCapturing failed: CUDA_ERROR_INVALID_HANDLE"):
        driver.stream_capturing(3)
