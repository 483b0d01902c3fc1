"""purlinc.runtime.trace without a GPU: the driver is replaced by a small simulation (memory as
bytes, the ping-pong kernel answered from a known clock offset), so the host side of
``coll.trace()`` -- heap flags, launches, reading the module's trace buffer, decoding it
against the traced kernel's blocks, aligning and building the JSON -- runs for real."""

from __future__ import annotations

import struct
import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("cuda.bindings")

from purlinc import pipeline  # noqa: E402
from purlinc.atom import trace as atom_trace  # noqa: E402
from purlinc.atom.codegen import generate  # noqa: E402
from purlinc.dtypes import DType, ReduceOp  # noqa: E402
from purlinc.runtime import trace as rt  # noqa: E402
from purlinc.runtime.heap import SymmetricHeap  # noqa: E402
from purlinc.snac.ir import LowerOptions  # noqa: E402

OFFSET = {0: 0, 1: 9_000}  # each GPU's timer minus rank 0's, ns
LATENCY = 1_300


class FakeDriver:
    """The driver calls runtime/trace.py makes, over a dict of buffers."""

    def __init__(self, trace_words: dict[int, bytes]):
        self.buffers: dict[int, bytearray] = {}
        self.next = 1 << 20
        self.current = None
        self.launches = []
        self.trace_words = trace_words  # device -> the module global's bytes

    # memory
    def mem_alloc(self, n):
        ptr, self.next = self.next, self.next + n + 4096
        self.buffers[ptr] = bytearray(n)
        return ptr

    def mem_free(self, ptr):
        del self.buffers[ptr]

    def memset_d8(self, ptr, value, n, stream=0):
        pass

    def copy_dtoh(self, src, n):
        if src in self.buffers:
            return bytes(self.buffers[src][:n])
        return self.trace_words[src - 0xABC000][:n]

    def set_current(self, device):
        self.current = device

    def synchronize(self, device):
        pass

    def stream_create(self):
        return SimpleNamespace(device=self.current, pending=[])

    def stream_destroy(self, stream):
        pass

    def module_load(self, cubin):
        return SimpleNamespace(device=self.current)

    def get_function(self, module, name):
        return name

    def device_name(self, device):
        return "Fake GPU"

    def launch(self, function, grid, block, shared, stream, args):
        mine, peer, seq0, iters, out, timeout, role = struct.unpack("<7Q", bytes(args.buffer.raw))
        assert function == "purlin_clock_align" and iters == rt.ITERATIONS
        stream.pending.append((stream.device, out, role, iters))
        self.launches.append((stream.device, role, mine, peer, seq0))

    def stream_synchronize(self, stream):
        for device, out, role, iters in stream.pending:
            words = [0, 32, 1000, 2000, 501000, 1002000] + [0] * (3 * iters)
            if role == 0:
                for i in range(iters):
                    t0 = 10_000 * (i + 1)
                    slow = 4_000 if i % 7 == 0 else 0  # some round trips are slow
                    words[6 + 3 * i: 9 + 3 * i] = [t0, t0 + LATENCY + OFFSET[1], t0 + 2 * LATENCY + slow]
            self.buffers[out][:] = struct.pack(f"<{len(words)}Q", *words)
        stream.pending.clear()

    def call(self, fn, *args):
        assert fn.__name__ == "cuModuleGetGlobal" and args[1] == b"purlin_trace_buf"
        device = args[0].device
        return 0xABC000 + device, len(self.trace_words[device])


def _traced(schedule, spec):
    return generate(schedule, spec, atom="ldst", arch="sm_90", dtype=DType.BFLOAT16, op=ReduceOp.SUM, trace=True)


def _stamps(kernel, rank: int, channels: int) -> bytes:
    """The trace buffer a traced kernel would leave: 200 ns per block, in rank-local time."""
    blocks = kernel.trace_blocks[rank]
    marks = 1 + max(len(b) for b in blocks)
    words = [0] * atom_trace.buffer_words(channels, marks)
    for c in range(channels):
        words[2 * c], words[2 * c + 1] = 5, 1  # call 5, one round
        gt = 2_000_000 + OFFSET[rank] + 10 * c
        for m in range(len(blocks[c]) + 1):
            at = 2 * channels + 2 * ((c * atom_trace.TRACE_ROUNDS) * marks + m)
            words[at], words[at + 1] = gt + 200 * m, 2 * (gt + 200 * m)
    return struct.pack(f"<{len(words)}Q", *words)


def test_collect_over_a_simulated_pair(monkeypatch):
    from purlinc.runtime import driver

    source = pipeline.load_source("examples/allreduce.pln")
    spec = pipeline.spec_stage(pipeline.parse_stage(source), 2, {})
    schedule = pipeline.snac_stage(spec, LowerOptions(channels=2, slices=2))
    kernel = _traced(schedule, spec)
    fake = FakeDriver({d: _stamps(kernel, d, 2) for d in (0, 1)})
    for name in ("mem_alloc", "mem_free", "memset_d8", "copy_dtoh", "set_current", "synchronize", "stream_create",
                 "stream_destroy", "module_load", "get_function", "device_name", "launch", "stream_synchronize", "call"):
        monkeypatch.setattr(driver, name, getattr(fake, name))
    monkeypatch.setattr(rt, "_MODULES", {})
    monkeypatch.setattr("purlinc.atom.nvrtc.compile_cubin", lambda *a, **k: b"\x7fELF")
    bases = [0x10_0000_0000, 0x20_0000_0000]
    key = (DType.BFLOAT16, ReduceOp.SUM)
    compiled = SimpleNamespace(trace=True, world_size=2, arch="sm_90", schedule=schedule, params=(),
                               atom="ldst", kernel=lambda dtype, op: (kernel, b""))
    ranks = []
    for r in (0, 1):
        comm = SimpleNamespace(heap=SymmetricHeap(r, 1 << 20, bases))
        variant = SimpleNamespace(key=key, module=SimpleNamespace(device=r))
        ranks.append(SimpleNamespace(compiled=compiled, rank=r, device=r, name="allreduce", comm=comm,
                                     _variants={key: variant}, lock=threading.Lock()))
    data = rt.collect(ranks)
    # The ping-pong: rank 0 pings rank 1's flag, rank 1 answers into rank 0's words for peer 1.
    pings = [l for l in fake.launches if l[1] == 0]
    pongs = [l for l in fake.launches if l[1] == 1]
    assert len(pings) == len(pongs) == 1
    offset = ranks[0]._trace_slots
    assert pings[0][2:4] == (bases[0] + offset + 16, bases[1] + offset)
    assert pongs[0][2:4] == (bases[1] + offset, bases[0] + offset + 16)
    clock = {r["rank"]: r for r in data["clock"]["ranks"]}
    assert clock[1]["offset_ns"] == pytest.approx(OFFSET[1]) and clock[1]["min_rtt_ns"] == 2 * LATENCY
    assert clock[1]["uncertainty_ns"] == pytest.approx(LATENCY + 32)
    assert clock[0]["sm_cycles_per_ns"] == pytest.approx(2.0)
    # Aligned: both ranks' channel-0 rounds start together; blocks 200 ns each, every step covered.
    assert data["calls"] == [5, 5] and data["timebase"] == "globaltimer"
    for r in (0, 1):
        for c in (0, 1):
            events = sorted((e for e in data["events"] if (e["rank"], e["channel"]) == (r, c)), key=lambda e: e["block"])
            assert events[0]["start_ns"] == pytest.approx(10 * c)
            assert all(e["end_ns"] - e["start_ns"] == pytest.approx(200) for e in events)
            steps = [s for e in events for s in e["steps"]]
            assert steps == list(range(len(schedule.program(r, c).steps)))
    # A second trace() reuses the flags and moves the sequence numbers on.
    rt.collect(ranks)
    assert fake.launches[-1][4] == rt.ITERATIONS


def test_untraced_collective_says_so():
    compiled = SimpleNamespace(trace=False)
    with pytest.raises(Exception, match="trace=True"):
        rt.read_stamps(SimpleNamespace(compiled=compiled, name="allreduce"))
