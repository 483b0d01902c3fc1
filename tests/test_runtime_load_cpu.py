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
from purlinc.runtime import collective, driver, placement
from purlinc.runtime.collective import Collective
from purlinc.runtime.errors import ArgumentError
from purlinc.runtime.loader import load

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


class FakeHeap:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self.used = 0
        self.generation = 0  # as Heap's: the zero-copy fast path keys on it

    def alloc(self, nbytes: int, what: str) -> int:
        offset = self.used
        self.used += -(-nbytes // 256) * 256
        return offset

    def ptr(self, rank: int, offset: int) -> int:
        return (rank + 1) << 40 | offset

    def free(self, offset: int) -> None:
        pass

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
    monkeypatch.setattr(driver, "local_bytes", lambda function: 0, raising=False)
    monkeypatch.setattr(driver, "stack_limit", lambda: 1024, raising=False)
    monkeypatch.setattr(driver, "set_stack_limit", record("set_stack_limit"), raising=False)
    monkeypatch.setattr(driver, "blocks_per_sm", lambda function, threads, shared: 8, raising=False)
    monkeypatch.setattr(driver, "sm_count", lambda device: 132, raising=False)
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


def test_a_rank_without_chunks_that_relays_needs_the_count(fake):
    from purlinc.runtime.errors import ArgumentError
    from test_fuzz_specs import fuzz_specs  # the GPU tests' directed case, tests/gpu/fuzz_specs.py

    compiled = collective.prepare(fuzz_specs.CHUNKLESS, 4, algorithm="ring")
    comm = FakeComm()
    comm.rank, comm.world_size, comm.heap = 2, 4, FakeHeap(4)
    relay = Collective(compiled, comm, placement._allocate(comm, compiled, None), agree=False)
    assert relay.relays
    with pytest.raises(ArgumentError) as caught:
        relay.prepare_call(None, None, "sum", 0, None)  # at count 0 it would pass nothing on: a timeout
    assert caught.value.message == ("chunkless on rank 2: this rank has no chunks, but its schedule (ring) carries "
                                    "other ranks' data through it, so it needs their count and dtype")
    shape, _, _ = relay.prepare_call(None, None, "sum", 0, 5, "bfloat16")
    assert (shape.count, shape.dtype) == (5, DType.BFLOAT16)
    # direct-push gives such a rank nothing to do: no count needed
    idle = collective.prepare(fuzz_specs.CHUNKLESS, 4, algorithm="direct-push")
    comm.heap = FakeHeap(4)
    small = Collective(idle, comm, placement._allocate(comm, idle, None), agree=False)
    assert not small.relays
    # a plain load whose larger bucket relays: the others' count could pick it, so a call
    # without count= is refused whichever bucket count 0 would pick
    from purlinc.runtime.tuned import Tuned
    from purlinc.runtime.tuning import Bucket

    tuned = Tuned((Bucket(1024, "direct-push"), Bucket(None, "ring")), [small, relay], 1)
    with pytest.raises(ArgumentError, match="on rank 2: this rank has no chunks, but its schedule \\(ring\\)"):
        tuned(None, None)


@pytest.mark.parametrize("path, extra", [("allreduce.pln", {"channels": 2}), ("allreduce.pln", {}),
                                         ("sized/alltoallv.pln", {"capacity": 64})])
def test_a_closed_communicator_is_refused_before_its_heap_is_touched(fake, path, extra):
    """close() frees the heap's memory; a load after it took offsets in the freed segments and
    zeroed them (a memset into memory the process no longer owns)."""
    comm = FakeComm()
    comm.closed = True
    comm.heap.alloc = lambda *args: pytest.fail("took heap space of a closed communicator")
    with pytest.raises(ArgumentError, match=r"load: the communicator of rank 0 is closed; expected an open one"):
        load(EXAMPLES / path, comm, **extra)
    assert not [c for c in fake if c[0] in ("memset_d8", "copy_htod", "module_load")]


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


def test_a_plain_load_closed_with_its_communicator_reads_no_freed_record(fake):
    """Closing a communicator closes its collectives and frees their host-mapped error
    records; a plain (tuned) load's call read its buckets' flags there first (a read of freed
    host memory; a garbage word reported a timeout that never was).  It now says it is closed,
    and check() has nothing to report."""
    comm = FakeComm()
    tuned = load(EXAMPLES / "allreduce.pln", comm)
    for variant in tuned._distinct:  # what Communicator.close does to each of its collectives
        variant.close()
        ctypes.memset(variant.error_host, 0xFF, 8)  # freed memory holds anything: here a raised flag
    with pytest.raises(ArgumentError, match="allreduce: this collective was closed"):
        tuned(None, None)
    tuned.check()  # no PurlinTimeoutError from the garbage word
    assert not any(v.timed_out() for v in tuned._distinct)


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
        piece = choose_piece(count, coll.layout.staging, 2)
        assert packed.buffer.raw == variant.abi.pack_args(  # the same arguments, whichever entry
            count=count, piece=piece, timeout_ns=coll.timeout_ns, rank=coll.rank, in_ptr=shape.in_ptr, out_ptr=shape.out_ptr,
            counters_ptr=coll.counters_ptr, error_ptr=coll.error_dev, stage=coll.stage_ptrs, staging=coll.layout.staging,
            signals=coll.pad_ptrs)
        return function

    lean, wide = variant.abi.lean_entry(0), variant.abi.entry(0)
    assert launched(512) == lean  # 1 KiB per chunk, aligned
    assert launched(4) == lean  # 8 bytes: one packet per chunk
    assert launched(513) == wide  # 1026-byte chunks: the last packet is partial
    assert launched(512, in_off=2) == wide  # a bf16-aligned but not 8-byte aligned input
    assert launched(512, out_off=4) == wide
    many = coll.layout.staging.large  # more elements per chunk than one round stages
    assert launched(many) == wide


def test_lean_fits_names_every_condition():
    from purlinc.atom.abi import LEAN_LIMIT, KernelABI, StagingPlacement

    abi = KernelABI(kernel_base="k", world_size=2, channels=1, threads=256, shared_bytes=0, itemsize=2,
                    stage_units=8, slices=1, stage_copies=2, signal_pad=2, in_units=(2, 2), out_units=(2, 2),
                    needs_in_peers=False, needs_out_peers=False, stage_align=16, lean=True)
    staging = StagingPlacement.for_space(64 << 20, 8)
    assert abi.lean_fits(512, 512, (0x1000, 0x2000, 0), staging)
    assert not abi.lean_fits(0, 512, (0x1000, 0x2000), staging)  # nothing to launch
    assert not abi.lean_fits(1024, 512, (0x1000, 0x2000), staging)  # two rounds
    assert not abi.lean_fits(511, 512, (0x1000, 0x2000), staging)  # 1022-byte chunks
    assert not abi.lean_fits(512, 512, (0x1000, 0x2004), staging)  # an output 4 bytes off
    assert not abi.lean_fits(512, 512, (0x1000, 0x2000, 0x3002), staging)  # a registered peer 2 bytes off
    big = LEAN_LIMIT // 2 // 2  # elements per chunk: two chunks of 2-byte elements reach the limit
    huge = StagingPlacement.for_space(LEAN_LIMIT, 8)  # 8 units of 2^28 bytes
    assert not abi.lean_fits(big, big, (0x1000, 0x2000), StagingPlacement.for_space(8 * 2 * big, 8))
    assert abi.lean_fits(big // 8, big // 8, (0x1000, 0x2000), StagingPlacement.for_space(LEAN_LIMIT // 2, 8))
    # the same call, its staging units 2^28 bytes apart: 8 of them reach the limit
    assert not abi.lean_fits(big // 8, big // 8, (0x1000, 0x2000), huge)
    plain = KernelABI(**{**{f: getattr(abi, f) for f in abi.__dataclass_fields__}, "lean": False})
    assert not plain.lean_fits(512, 512, (0x1000, 0x2000), staging)
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


class _LoopbackComm(FakeComm):
    """Rank ``rank`` of a loopback pair: both on cuda:0, one heap layout."""

    def __init__(self, rank):
        super().__init__()
        self.rank, self.local_group = rank, type("LoopbackGroup", (), {"devices": [0, 0]})()


def _loopback_pair(compiled, monkeypatch) -> list:
    """Every rank's Collective of ``compiled`` on one GPU, whose group calls are one float32
    call of count 1 (validation, which needs real buffers, is stood in for)."""
    from purlinc.runtime.validate import CallShape

    ranks = []
    world = compiled.world_size
    for r in range(world):
        comm = _LoopbackComm(r)
        comm.world_size, comm.heap = world, FakeHeap(world)
        ranks.append(Collective(compiled, comm, placement._allocate(comm, compiled, None), agree=False))
    shapes = [(CallShape(DType.FLOAT32, ReduceOp.SUM, 1, 1 << 32, 1 << 33), 100 + r, None) for r in range(world)]
    monkeypatch.setattr(collective, "prepare_group", lambda *args: shapes)
    return ranks


class _SharedGPU:
    """One device under CUDA's per-thread stack rule (cuCtxSetLimit): a launch whose kernel
    needs more stack than the context has grows it, and growing it waits until every kernel
    already running on the device has finished.  Kernels of a group call wait for each other,
    so such a wait in the middle of one is a deadlock until the first rank's waits time out."""

    def __init__(self, needs: dict[str, int]):
        self.limit = 1024  # the driver's default
        self.needs = needs
        self.running: list[str] = []
        self.stalls: list[tuple[str, list[str]]] = []

    def stack_limit(self) -> int:
        return self.limit

    def set_stack_limit(self, nbytes: int) -> None:
        assert not self.running, "the stack is grown while this call's kernels run"
        self.limit = max(self.limit, nbytes)

    def launch(self, function, grid, block, shared, stream, args) -> None:
        need = self.needs[function]
        if need > self.limit:
            if self.running:
                self.stalls.append((function, list(self.running)))
            self.limit = need
        self.running.append(function)


def test_a_group_call_grows_the_stack_before_any_rank_launches(fake, monkeypatch):
    """Issue 25's R=8 hang on one GPU: the ranks' entry points needed different stacks (ptxas, for
    the packed 16-unit all-reduce at R=8 as generated then: 3536 bytes for rank 0's entry, 3552
    for rank 1's, ...).  Rank 0 launched first and grew the stack; rank 1's launch had to grow it
    again, which waits for the running kernels, rank 0's among them, and rank 0 waited for rank
    1's signal until it timed out.  Every rank's kernel is loaded before any launches, and so
    must the stack be.  (Here a reduce, whose root and other rank run different entries, with
    those numbers standing in for its stacks.)"""
    coll = load(EXAMPLES / "reduce.pln", FakeComm(), channels=1, packed=True)
    abi = coll.variant(DType.FLOAT32, ReduceOp.SUM).abi
    assert abi.entry(0) != abi.entry(1)
    needs = {abi.entry(0): 3536, abi.entry(1): 3552, abi.lean_entry(0): 3336, abi.lean_entry(1): 3336}
    gpu = _SharedGPU(needs)
    monkeypatch.setattr(driver, "local_bytes", lambda function: needs[function], raising=False)
    monkeypatch.setattr(driver, "stack_limit", gpu.stack_limit, raising=False)
    monkeypatch.setattr(driver, "set_stack_limit", gpu.set_stack_limit, raising=False)
    monkeypatch.setattr(driver, "launch", gpu.launch)
    ranks = _loopback_pair(coll.compiled, monkeypatch)
    collective.GroupCollective(ranks)(None)  # count 1 of float32: the wide entries
    assert gpu.running == [abi.entry(0), abi.entry(1)]
    assert gpu.stalls == [], f"a launch grew the stack while other ranks ran: {gpu.stalls}"
    assert gpu.limit >= 3552


def test_a_group_call_that_cannot_be_resident_is_refused_before_any_launch(fake, monkeypatch):
    """Two ranks sharing a GPU whose SMs hold three of their blocks at once: two channels each
    would leave one block waiting to start while the others wait for it."""
    from purlinc.runtime.errors import ResidencyError

    monkeypatch.setattr(driver, "blocks_per_sm", lambda function, threads, shared: 1)
    monkeypatch.setattr(driver, "sm_count", lambda device: 3)
    launches = []
    monkeypatch.setattr(driver, "launch", lambda *args: launches.append(args))
    one = load(EXAMPLES / "allgather.pln", FakeComm(), channels=1)
    collective.GroupCollective(_loopback_pair(one.compiled, monkeypatch))(None)  # 2 of 3: runs
    assert len(launches) == 2
    two = load(EXAMPLES / "allgather.pln", FakeComm(), channels=2)
    group = collective.GroupCollective(_loopback_pair(two.compiled, monkeypatch))
    with pytest.raises(ResidencyError, match=r"needs 4 blocks resident at once on cuda:0 .* at most 3 of them"):
        group(None)
    assert len(launches) == 2  # nothing more was launched


@pytest.mark.parametrize("devices,refused", [((0, 0), True), ((0, 1), False), ((), False)])
def test_torchrun_ranks_on_one_gpu_that_cannot_be_resident_are_refused_at_first_use(fake, monkeypatch, devices,
                                                                                  refused):
    """Under torchrun the ranks' devices come from the bootstrap exchange (comm.peer_devices):
    two ranks on cuda:0 with two channels each need 4 resident blocks where 3 fit, so the first
    use of a (dtype, op) raises before anything is launched; ranks on their own GPUs never do."""
    from purlinc.runtime.errors import ResidencyError

    monkeypatch.setattr(driver, "blocks_per_sm", lambda function, threads, shared: 1)
    monkeypatch.setattr(driver, "sm_count", lambda device: 3)
    comm = FakeComm()
    comm.peer_devices = devices
    coll = load(EXAMPLES / "allgather.pln", comm, channels=2)
    if refused:
        with pytest.raises(ResidencyError, match=r"needs 4 blocks resident at once on cuda:0 .* ranks 0, 1 sharing"):
            coll.variant(DType.FLOAT32, None)
    else:
        assert coll.variant(DType.FLOAT32, None).per_sm == 1


def test_staging_above_the_setting_for_epilogue_rows_is_allocated_and_said(monkeypatch, caplog):
    """PURLIN_STAGE_MB=0.0625 (64 KiB) cannot give 8 slices a 16 KiB float32 row each: the load
    takes what a row per slice needs (rounds never split a row) and says so in a warning;
    a plain spec under the same setting takes the setting and says nothing."""
    import logging

    monkeypatch.setenv("PURLIN_STAGE_MB", "0.0625")
    comm = FakeComm()
    comm.heap = FakeHeap(2)
    fused = collective.prepare(EXAMPLES / "fused" / "allreduce_add_rmsnorm.pln", 2, channels=8)
    with caplog.at_level(logging.WARNING, logger="purlin"):
        layout = placement._allocate(comm, fused, None)
    staging = layout.staging
    assert staging.largest_step == 4096 * 4 and staging.units * staging.large > 64 << 10
    assert any("above PURLIN_STAGE_MB (0.1 MiB): each of its 8 slice(s) per unit holds 16384 bytes" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    caplog.clear()
    plain = collective.prepare(EXAMPLES / "allreduce.pln", 2, channels=8)
    with caplog.at_level(logging.WARNING, logger="purlin"):
        layout = placement._allocate(comm, plain, None)
    assert layout.staging.units * layout.staging.large <= 64 << 10 and not caplog.records


def test_a_group_call_refuses_epilogue_operands_two_ranks_write(fake, monkeypatch):
    """Each rank's operands were checked against its own buffers only: one residual for two
    ranks (both write it), or rank 1's residual on rank 0's out, launched and raced."""
    from purlinc.runtime.validate import CallShape
    from test_sized_runtime_cpu import Device

    launches = []
    monkeypatch.setattr(driver, "launch", lambda *a: launches.append(a))
    monkeypatch.setattr(driver, "pointer_device", lambda ptr: 0)
    coll = load(EXAMPLES / "fused" / "allreduce_add_rmsnorm.pln", FakeComm(), channels=1, params={"hidden": 8})
    ranks = _loopback_pair(coll.compiled, monkeypatch)
    outs = [(1 << 33) + r * 4096 for r in range(2)]
    shapes = [(CallShape(DType.FLOAT32, ReduceOp.SUM, 8, (1 << 32) + r * 4096, outs[r]), 100 + r, None) for r in range(2)]
    monkeypatch.setattr(collective, "prepare_group", lambda *args: shapes)
    group = collective.GroupCollective(ranks)
    residual, weight = Device(0x700000, (8,), "<f4"), Device(0x800000, (8,), "<f4")
    with pytest.raises(ArgumentError, match=r"rank 0's operand 'residual' overlaps rank 1's operand 'residual' in "
                                            r"memory, expected a buffer of its own"):
        group(None, residual=[residual, residual], weight=[weight, weight], eps=1e-6)
    with pytest.raises(ArgumentError, match=r"rank 0's out overlaps rank 1's operand 'residual' in memory"):
        group(None, residual=[residual, Device(outs[0], (8,), "<f4")], weight=[weight, weight], eps=1e-6)
    assert not launches
    # one weight for both ranks is only read: allowed
    group(None, residual=[residual, Device(0x900000, (8,), "<f4")], weight=[weight, weight], eps=1e-6)
    assert launches
