"""The runtime's load path on the CPU, with a recording stand-in for the CUDA driver and a
one-rank view of a two-rank communicator: ``load()`` and a plain (tuned) ``load()`` take
their schedules and kernels from the pipeline's Compiled, lay out the heap, and hand a
host-driven atom (ce) its plan and the driver.  What runs on a GPU is the GPU suite's job."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from purlinc import pipeline
from purlinc.dtypes import DType, ReduceOp
from purlinc.runtime import collective, driver
from purlinc.runtime.collective import Collective, load

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


class FakeHeap:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self.used = 0

    def alloc(self, nbytes: int, what: str) -> int:
        offset = self.used
        self.used += -(-nbytes // 256) * 256
        return offset

    def ptr(self, rank: int, offset: int) -> int:
        return (rank + 1) << 40 | offset

    def ptrs(self, offset: int) -> list[int]:
        return [self.ptr(r, offset) for r in range(self.world_size)]


class FakeComm:
    """Rank 0 of two; every rank 'agrees' (allgather returns this rank's object twice)."""

    def __init__(self):
        self.rank, self.world_size, self.device, self.local_group = 0, 2, 0, None
        self.heap = FakeHeap(2)
        self.collectives = []

    def allgather(self, obj) -> list:
        return [obj, obj]

    def register(self, c) -> None:
        self.collectives.append(c)

    def unregister(self, c) -> None:
        self.collectives.remove(c)


@pytest.fixture
def fake(monkeypatch, tmp_path):
    from purlinc.runtime import communicator

    monkeypatch.setenv("PURLIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PURLIN_NO_CACHE", raising=False)
    pipeline.forget()
    calls = []
    buffers = []

    def record(name, result=None):
        def call(*args):
            calls.append((name, *args))
            return result() if callable(result) else result
        return call

    def host_alloc_mapped(nbytes):
        buffer = ctypes.create_string_buffer(nbytes)
        buffers.append(buffer)
        return ctypes.addressof(buffer), 0xD000
    for name in ("set_current", "memset_d8", "copy_htod", "synchronize", "set_max_dynamic_shared",
                 "stream_destroy", "event_destroy", "host_free", "module_unload"):
        monkeypatch.setattr(driver, name, record(name))
    monkeypatch.setattr(driver, "host_alloc_mapped", host_alloc_mapped)
    monkeypatch.setattr(driver, "supports_stream_mem_ops", record("supports_stream_mem_ops", True))
    monkeypatch.setattr(driver, "module_load", record("module_load", "module"))
    monkeypatch.setattr(driver, "get_function", lambda module, name: calls.append(("get_function", name)) or name)
    monkeypatch.setattr(driver, "stream_create", record("stream_create", object))
    monkeypatch.setattr(driver, "event_create", record("event_create", object))
    monkeypatch.setattr(driver, "arch_of", lambda device: "sm_90")
    # the fake communicator passes load()'s type check
    monkeypatch.setattr(communicator, "Communicator", FakeComm)
    yield calls
    pipeline.forget()


def test_load_uses_the_pipelines_compiled_and_kernels(fake):
    comm = FakeComm()
    coll = load(EXAMPLES / "allreduce.pln", comm, channels=2)
    assert isinstance(coll, Collective) and coll.compiled is collective.prepare(EXAMPLES / "allreduce.pln", 2,
                                                                                 channels=2)
    assert coll.compiled.options.channels == 2 and coll.layout.counters_bytes == 16
    variant = coll.variant(DType.FLOAT32, ReduceOp.SUM)
    assert variant.grid == 2 and ("get_function", variant.abi.entry(0)) in fake
    # the kernel is the Compiled's, made once per (dtype, op)
    kernel = coll.compiled.kernel(DType.FLOAT32, ReduceOp.SUM)
    assert kernel.cuda.abi == variant.abi and [c[0] for c in fake].count("module_load") == 1


def test_ce_load_gets_the_plan_and_the_driver(fake):
    comm = FakeComm()
    coll = load(EXAMPLES / "allgather.pln", comm, atom="ce", channels=2)
    plan = coll.compiled.plan
    assert coll._ce is not None and coll._ce.plan is plan and coll._ce._driver is driver
    assert len(coll._ce.streams) == 2
    assert coll.layout.pad_bytes == 8 * plan.pad_words
    images = [c for c in fake if c[0] == "copy_htod"]
    assert len(images) == 1 and len(images[0][2]) == 8 * plan.pad_words


def test_plain_load_prepares_every_bucket_once(fake):
    comm = FakeComm()
    before = pipeline.STATS.parses, pipeline.STATS.checks
    tuned = load(EXAMPLES / "allreduce.pln", comm)
    assert (pipeline.STATS.parses, pipeline.STATS.checks) == (before[0] + 1, before[1] + 1)
    assert len(tuned.variants) == len(tuned.buckets) >= 3
    for bucket, variant in zip(tuned.buckets, tuned.variants):
        assert variant.compiled.options.channels == bucket.channels
    small = tuned.variant_for(16, 2)
    assert small is tuned.variants[0] and tuned.sms_for(16, 2) == tuned.buckets[0].channels


def test_heap_space_is_zeroed_only_after_the_ranks_exchange(fake):
    """A collective's space may have belonged to one a peer is still finishing (its last
    notify lands in our pad until it has closed that collective too); every peer has closed
    once it reaches the load's exchange, so the zeroing must come after it.  Zeroing first let
    a late notify survive (seen on 2 x H200 as an intermittent wrong first call)."""

    class RecordingComm(FakeComm):
        def allgather(self, obj) -> list:
            fake.append(("allgather",))
            return super().allgather(obj)

    comm = RecordingComm()
    load(EXAMPLES / "allreduce.pln", comm, algorithm="two-shot", channels=2)
    names = [c[0] for c in fake]
    exchange = names.index("allgather")
    zeroes = [i for i, name in enumerate(names) if name == "memset_d8"]
    assert zeroes and min(zeroes) > exchange, names
    # and a barrier after the zeroing: no rank's first call may land in a peer's space before
    # that peer has zeroed it (the notify would be wiped, and the peer's wait time out)
    barriers = [i for i, name in enumerate(names) if name == "allgather" and i > max(zeroes)]
    assert barriers, names


def test_small_aligned_calls_take_the_lean_entry(fake):
    """A packed module's calls that fit the lean form (one round, aligned whole packets) launch
    the rank's lean entry; any other call the wide one, with the same arguments."""
    from purlinc.runtime.validate import CallShape, choose_piece

    coll = load(EXAMPLES / "allreduce.pln", FakeComm(), channels=1, packed=True)
    variant = coll.variant(DType.BFLOAT16, ReduceOp.SUM)
    assert variant.abi.lean and variant.lean == variant.abi.lean_entry(0) == variant.abi.entry(0) + "_lean"
    base = 1 << 32

    def launched(count, in_off=0, out_off=0):
        shape = CallShape(DType.BFLOAT16, ReduceOp.SUM, count, base + in_off, base + (1 << 24) + out_off)
        function, *_, packed = coll.target(shape)
        piece = choose_piece(count, coll.stage_units, 2, coll.layout.stage_bytes)
        assert packed.buffer.raw == variant.abi.pack_args(  # the same arguments, whichever entry
            count=count, piece=piece, timeout_ns=coll.timeout_ns, rank=coll.rank, in_ptr=shape.in_ptr, out_ptr=shape.out_ptr,
            counters_ptr=coll.counters_ptr, error_ptr=coll.error_dev, stage=coll.stage_ptrs, signals=coll.pad_ptrs)
        return function

    lean, wide = variant.abi.lean_entry(0), variant.abi.entry(0)
    assert launched(512) == lean  # 1 KiB per chunk, aligned
    assert launched(4) == lean  # 8 bytes: one packet per chunk
    assert launched(513) == wide  # 1026-byte chunks: the last packet is partial
    assert launched(512, in_off=2) == wide  # a bf16-aligned but not 8-byte aligned input
    assert launched(512, out_off=4) == wide
    many = coll.layout.stage_bytes  # more elements per chunk than one round stages
    assert launched(many) == wide


def test_lean_fits_names_every_condition():
    from purlinc.atom.abi import LEAN_LIMIT, KernelABI

    abi = KernelABI(kernel_base="k", world_size=2, channels=1, threads=256, shared_bytes=0, itemsize=2,
                    stage_units=8, slices=1, stage_copies=2, signal_pad=2, in_units=(2, 2), out_units=(2, 2),
                    needs_in_peers=False, needs_out_peers=False, stage_align=16, lean=True)
    assert abi.lean_fits(512, 512, (0x1000, 0x2000, 0))
    assert not abi.lean_fits(0, 512, (0x1000, 0x2000))  # nothing to launch
    assert not abi.lean_fits(1024, 512, (0x1000, 0x2000))  # two rounds
    assert not abi.lean_fits(511, 512, (0x1000, 0x2000))  # 1022-byte chunks
    assert not abi.lean_fits(512, 512, (0x1000, 0x2004))  # an output 4 bytes off
    assert not abi.lean_fits(512, 512, (0x1000, 0x2000, 0x3002))  # a registered peer 2 bytes off
    big = LEAN_LIMIT // 2 // 2  # elements per chunk: two chunks of 2-byte elements reach the limit
    assert not abi.lean_fits(big, big, (0x1000, 0x2000))
    assert abi.lean_fits(big // 8, big // 8, (0x1000, 0x2000))  # staging 8 units of 2^27 bytes: 2^30
    plain = KernelABI(**{**{f: getattr(abi, f) for f in abi.__dataclass_fields__}, "lean": False})
    assert not plain.lean_fits(512, 512, (0x1000, 0x2000))
    with pytest.raises(ValueError, match="no lean entries"):
        plain.lean_entry(0)


@pytest.mark.parametrize("arch, setting, dependent", [("sm_90", "1", True), ("sm_100", "1", True),
                                                      ("sm_80", "1", False), ("sm_90", "0", False)])
def test_dependent_launch_where_the_device_has_it(fake, monkeypatch, arch, setting, dependent):
    """sm_90+ launches are programmatic dependent launches (unless PURLIN_PDL=0), with the
    variant's own grid, block and shared bytes; the kernels wait for their predecessor either way."""
    from purlinc.runtime.validate import CallShape

    monkeypatch.setattr(driver, "arch_of", lambda device: arch)
    monkeypatch.setenv("PURLIN_PDL", setting)
    coll = load(EXAMPLES / "allreduce.pln", FakeComm(), channels=2, packed=True)
    variant = coll.variant(DType.BFLOAT16, ReduceOp.SUM)
    _, grid, block, shared, packed = coll.target(CallShape(DType.BFLOAT16, ReduceOp.SUM, 512, 1 << 32, 1 << 33))
    assert (packed.config is not None) == dependent
    if dependent:
        config = packed.config.config
        assert (config.gridDimX, config.blockDimX, config.sharedMemBytes) == (grid, block, shared) == (2, 256, 0)
        assert config.numAttrs == 1 and config.attrs[0].value.programmaticStreamSerializationAllowed == 1
    source = coll.compiled.kernel(DType.BFLOAT16, ReduceOp.SUM).cuda.source
    for rank in range(2):
        body = source.split(f"{variant.abi.entry(rank)}_body(const purlin_args& args)\n{{\n")[1]
        assert body.lstrip().startswith("purlin_launch_order();")
