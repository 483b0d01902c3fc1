"""Device traces of loaded collectives: read the stamps, align the GPUs' clocks, make JSON.

``load(..., trace=True)`` (or ``PURLIN_TRACE=1``) generates the traced kernel
(``purlinc.atom.trace``); after a call, ``coll.trace()`` -- on every rank, it is a collective
under torchrun -- returns the last call's stamps of every rank as one JSON-able dict
(schema: ``purlinc.draw.trace``, docs/DRAW.md).

Clock alignment.  ``%globaltimer`` is a nanosecond clock per GPU; two GPUs' timers are not
guaranteed equal.  Rank 0 is the reference; for every other rank ``p``, one thread on rank 0
and one on rank ``p`` play ping-pong through a pair of words in each other's memory
(system-scope release stores, acquire polls):

    rank 0: t0 = timer; store seq into p's word;  poll own word until seq;  t3 = timer
    rank p: poll own word until seq;  t1 = timer;  store t1, then seq, into rank 0's words

For each round trip, ``t1 - (t0 + t3) / 2`` estimates rank p's timer minus rank 0's, assuming
the two one-way latencies are equal; the error is at most half the round trip (~1.3 us here).
The offset is the median over the round trips whose RTT is within 1.5x of the fastest, and
its uncertainty is half of that fastest RTT plus one timer tick.  The same kernel measures the
timer's tick (the smallest step it takes) and the SM clock in cycles per nanosecond, so a
trace can use ``clock64`` (cycle-exact within one block) between two global-timer stamps.
"""

from __future__ import annotations

import statistics
import struct

from purlinc.errors import PurlinError

ITERATIONS = 64
_WORDS_OUT = 6 + 3 * ITERATIONS

ALIGN_SOURCE = r"""
// purlin clock alignment: one thread per GPU, ping-pong over system-scope flags.
typedef unsigned long long u64;
__device__ __forceinline__ u64 purlin_gt() { u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ void purlin_st_release(u64* p, u64 v)
{ asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory"); }
__device__ __forceinline__ void purlin_st_relaxed(u64* p, u64 v)
{ asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory"); }
__device__ __forceinline__ u64 purlin_ld_acquire(const u64* p)
{ u64 v; asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v; }

struct purlin_align_args {
    u64* mine;        // my flag word (word 1: the peer's t1, on rank 0)
    u64* peer;        // the peer's flag word, as mapped here
    u64 seq0;         // flags of this run are seq0 + 1 .. seq0 + iters (grow across runs)
    u64 iters;
    u64* out;         // [0] status, [1] tick ns, [2..5] gt, clk at start and end, then (t0, t1, t3) per iteration
    u64 timeout_ns;
    u64 role;         // 0: ping (rank 0), 1: pong (the peer)
};

extern "C" __global__ void purlin_clock_align(const purlin_align_args a)
{
    if (threadIdx.x != 0) return;
    u64 tick = ~0ull, prev = purlin_gt();
    const u64 first = prev;
    for (int changes = 0; changes < 16 && purlin_gt() - first < 2000000ull;) {
        const u64 now = purlin_gt();
        if (now != prev) { if (now - prev < tick) tick = now - prev; prev = now; ++changes; }
    }
    a.out[1] = tick;
    a.out[2] = purlin_gt();
    a.out[3] = clock64();
    u64 status = 0;
    for (u64 i = 0; i < a.iters && status == 0; ++i) {
        const u64 seq = a.seq0 + i + 1;
        const u64 begin = purlin_gt();
        if (a.role == 0) {
            const u64 t0 = purlin_gt();
            purlin_st_release(a.peer, seq);
            while (purlin_ld_acquire(a.mine) < seq)
                if (purlin_gt() - begin > a.timeout_ns) { status = 1; break; }
            const u64 t3 = purlin_gt();
            const u64 t1 = *(volatile u64*)(a.mine + 1);
            a.out[6 + 3 * i] = t0; a.out[7 + 3 * i] = t1; a.out[8 + 3 * i] = t3;
        } else {
            while (purlin_ld_acquire(a.mine) < seq)
                if (purlin_gt() - begin > a.timeout_ns) { status = 1; break; }
            if (status) break;
            const u64 t1 = purlin_gt();
            purlin_st_relaxed(a.peer + 1, t1);
            purlin_st_release(a.peer, seq);
        }
    }
    a.out[4] = purlin_gt();
    a.out[5] = clock64();
    a.out[0] = status;
}
"""


def offset_from_samples(samples: list[tuple[int, int, int]]) -> tuple[float, float, float]:
    """(offset_ns, uncertainty_ns, min_rtt_ns) from (t0, t1, t3) round trips: the peer's timer
    minus the reference's.  Pure, so the CPU tests check it."""
    good = [(t0, t1, t3) for t0, t1, t3 in samples if t3 >= t0 and t1 > 0]
    if not good:
        raise PurlinError("clock alignment: no usable round trip (the peer never answered)")
    rtts = [t3 - t0 for t0, _, t3 in good]
    fastest = min(rtts)
    near = [s for s, rtt in zip(good, rtts) if rtt <= 1.5 * fastest + 64]
    offsets = [t1 - (t0 + t3) / 2 for t0, t1, t3 in near]
    return float(statistics.median(offsets)), fastest / 2, float(fastest)


def _module(device: int, arch: str):
    from purlinc.atom.nvrtc import compile_cubin
    from purlinc.runtime import driver

    key = (device, arch)
    hit = _MODULES.get(key)
    if hit is None:
        cubin = compile_cubin(ALIGN_SOURCE, "purlin_clock_align.cu", arch)
        driver.set_current(device)
        module = driver.module_load(cubin)
        hit = _MODULES[key] = (module, driver.get_function(module, "purlin_clock_align"))
    return hit


_MODULES: dict = {}


def _slots(collective) -> int:
    """The collective's two flag words per rank (symmetric heap offset), zeroed on first use."""
    from purlinc.runtime import driver

    offset = getattr(collective, "_trace_slots", None)
    if offset is None:
        world = collective.compiled.world_size
        offset = collective.comm.heap.alloc(16 * world, f"{collective.name} trace clock flags")
        driver.set_current(collective.device)
        driver.memset_d8(collective.comm.heap.ptr(collective.rank, offset), 0, 16 * world)
        driver.synchronize(collective.device)
        collective._trace_slots = offset
        collective._trace_seq = 0
    return offset


def align(collectives: list, exchange=None) -> dict:
    """Measure every rank's timer offset to rank 0's.  ``collectives``: the ranks this process
    drives (all of a LocalGroup's, or one under torchrun, with ``exchange`` = its allgather)."""
    from purlinc.runtime import driver
    from purlinc.runtime.driver import PackedArgs

    world = collectives[0].compiled.world_size
    offsets = [_slots(c) for c in collectives]
    if exchange is not None:
        exchange("trace-flags-zeroed")  # every rank zeroed its flags before anyone pings
    local = {}
    for c, offset in zip(collectives, offsets):
        driver.set_current(c.device)
        out = driver.mem_alloc(8 * _WORDS_OUT)
        local[c.rank] = {"c": c, "offset": offset, "out": out, "stream": driver.stream_create(), "pairs": {},
                         "stats": None}
    timeout = 2_000_000_000
    for peer in range(1, world):
        launched = []
        for rank, st in local.items():
            c = st["c"]
            if rank not in (0, peer):
                continue
            heap = c.comm.heap
            if rank == 0:
                mine, other, role = heap.ptr(0, st["offset"]) + 16 * peer, heap.ptr(peer, st["offset"]), 0
            else:
                mine, other, role = heap.ptr(rank, st["offset"]), heap.ptr(0, st["offset"]) + 16 * rank, 1
            _, function = _module(c.device, c.compiled.arch)
            args = PackedArgs(struct.pack("<7Q", mine, other, c._trace_seq, ITERATIONS, st["out"], timeout, role))
            driver.set_current(c.device)
            driver.launch(function, 1, 32, 0, st["stream"], args)
            launched.append((st, args))
        for st, _ in launched:
            driver.set_current(st["c"].device)
            driver.stream_synchronize(st["stream"])
            words = struct.unpack(f"<{_WORDS_OUT}Q", driver.copy_dtoh(st["out"], 8 * _WORDS_OUT))
            if words[0] != 0:
                raise PurlinError(f"clock alignment between rank 0 and rank {peer} timed out (a rank did not call trace())")
            st["stats"] = words[1:6]
            if st["c"].rank == 0:
                st["pairs"][peer] = [words[6 + 3 * i: 9 + 3 * i] for i in range(ITERATIONS)]
    for st in local.values():
        st["c"]._trace_seq += ITERATIONS
        driver.set_current(st["c"].device)
        driver.stream_destroy(st["stream"])
        driver.mem_free(st["out"])
    mine = []
    for rank, st in sorted(local.items()):
        tick, gt0, clk0, gt1, clk1 = st["stats"] if st["stats"] is not None else (0, 0, 0, 0, 0)
        rate = (clk1 - clk0) / (gt1 - gt0) if gt1 > gt0 else 0.0
        entry = {"rank": rank, "globaltimer_tick_ns": int(tick) if tick != 2 ** 64 - 1 else None,
                 "sm_cycles_per_ns": rate, "pairs": {}}
        if rank == 0:
            for peer, samples in st["pairs"].items():
                off, unc, rtt = offset_from_samples(samples)
                entry["pairs"][peer] = {"offset_ns": off, "uncertainty_ns": unc, "min_rtt_ns": rtt}
        mine.append(entry)
    everyone = [e for part in (exchange(mine) if exchange is not None else [mine]) for e in part]
    by_rank = {e["rank"]: e for e in everyone}
    pairs = by_rank[0]["pairs"]
    ranks = []
    for rank in range(world):
        e = by_rank.get(rank, {"globaltimer_tick_ns": None, "sm_cycles_per_ns": 0.0})
        p = pairs.get(rank, pairs.get(str(rank), {"offset_ns": 0.0, "uncertainty_ns": 0.0, "min_rtt_ns": 0.0}))
        tick = e["globaltimer_tick_ns"] or 0
        ranks.append({"rank": rank, "offset_ns": p["offset_ns"], "uncertainty_ns": p["uncertainty_ns"] + tick,
                      "min_rtt_ns": p["min_rtt_ns"], "globaltimer_tick_ns": e["globaltimer_tick_ns"],
                      "sm_cycles_per_ns": e["sm_cycles_per_ns"]})
    return {"method": "ping-pong", "reference_rank": 0, "iterations": ITERATIONS, "ranks": ranks}


def read_stamps(collective) -> dict:
    """This rank's raw stamps of its last call: {"rank", "device", "kernel", "channels": [...]}."""
    from cuda.bindings import driver as cu

    from purlinc.atom.trace import BUFFER, decode
    from purlinc.runtime import driver

    if not collective.compiled.trace:
        raise PurlinError(f"{collective.name}: not loaded with trace=True (or {_setting_name()}=1): nothing recorded")
    variants = list(collective._variants.values())
    if not variants:
        raise PurlinError(f"{collective.name}: call it before asking for its trace")
    variant = variants[-1]  # the (dtype, op) loaded last: trace one dtype per traced collective
    source, _ = collective.compiled.kernel(*variant.key)  # memoized: the kernel this variant loaded
    blocks = source.trace_blocks[collective.rank]
    marks = 1 + max((len(ch) for ch in blocks), default=0)
    driver.synchronize(collective.device)
    driver.set_current(collective.device)
    ptr, size = driver.call(cu.cuModuleGetGlobal, variant.module, BUFFER.encode())
    raw = driver.copy_dtoh(int(ptr), int(size))
    channels = decode(raw, collective.compiled.schedule.channels, marks)
    for c, ch in enumerate(channels):
        ch["blocks"] = [list(b) for b in blocks[c]]
    dtype, op = variant.key
    return {"rank": collective.rank, "device": driver.device_name(collective.device), "kernel": source.kernel_base,
            "dtype": dtype.value, "op": op.value if op else None, "channels": channels}


def _setting_name() -> str:
    from purlinc import settings

    return settings.TRACE.name


def collect(collectives: list, exchange=None) -> dict:
    """The trace JSON of the last call, from every rank (see purlinc.draw.trace)."""
    from purlinc.draw.trace import from_stamps

    parts = [read_stamps(c) for c in collectives]
    clock = align(collectives, exchange)
    if exchange is not None:
        parts = [p for group in exchange(parts) for p in group]
    compiled = collectives[0].compiled
    return from_stamps(compiled.schedule, dict(compiled.params), compiled.atom, parts, clock)
