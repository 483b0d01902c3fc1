// ---- prelude: launch arguments, rounds and slices, signals (shared by every atom) ----
// Needs PURLIN_WORLD and PURLIN_STAGE_COPIES defined before it.

typedef unsigned long long purlin_u64;
typedef long long purlin_i64;

// The kernel argument, passed by value; layout fixed by purlinc/atom/abi.py.  The host
// derives the round geometry from the call's count and piece (abi.KernelABI.geometry), so
// the kernel's first instructions are its loads, not 64-bit divisions and products.
struct purlin_args {
    purlin_u64 rounds;       // ceil(count / piece): rounds of this call (0 when count == 0)
    purlin_u64 io_unit;      // bytes between IN/OUT units: count * itemsize
    purlin_u64 piece_bytes;  // bytes of a unit moved per full round: piece * itemsize
    purlin_u64 last_bytes;   // bytes of a unit moved by the last round
    purlin_u64 stage_unit;   // bytes between staging units: the same for every call of a load (abi.StagingPlacement)
    purlin_u64 step;         // slice stride in bytes: round_up(ceil(piece bytes / SLICES), 16)
    purlin_u64 copy_bytes;   // bytes between the two staging copies (0 with one copy)
    purlin_u64 stage_step;   // bytes between a staging unit's slices: the same for every call of a load
    purlin_u64 timeout_ns;   // bound on every wait
    purlin_u64 rank;         // the rank this launch runs: its row of the body's table
    char* in;                // this rank's input
    char* out;               // this rank's output
    purlin_u64* counters;    // call counters, one per channel
    purlin_u64* error;       // error record (host-mapped), see abi.ERROR_RECORD
    char* stage[PURLIN_WORLD];          // every rank's staging buffer, as mapped here
    purlin_u64* signals[PURLIN_WORLD];  // every rank's signal pad, as mapped here
    char* in_peer[PURLIN_WORLD];        // registered inputs (null when not registered)
    char* out_peer[PURLIN_WORLD];       // registered outputs (null when not registered)
#if defined(PURLIN_EPILOGUE_SLOTS) && PURLIN_EPILOGUE_SLOTS > 0  // an epilogue without operands has none
    purlin_u64 epi[PURLIN_EPILOGUE_SLOTS];  // epilogue operands: pointers, or a float's bits
#endif
};

// Two forms of every body (body.cu.j2), which differ only in how they compute
// addresses.  purlin_wide runs any call.  purlin_lean runs the calls abi.KernelABI.lean_fits
// admits: one round, every byte offset below 2^31 (abi.LEAN_LIMIT), caller buffers and chunks
// 8-byte aligned.  There offsets are 32-bit and every packet's 8 data bytes are one aligned word, so a small
// call's first load and first store come a few instructions into the kernel instead of
// after 64-bit slice arithmetic and the byte-wise branches of the general case (measured
// 2026-11-30: ~90 instructions before the first load, ~270 before the first packet store).
struct purlin_wide {
    typedef purlin_u64 off;
    static constexpr bool lean = false;
};
struct purlin_lean {
    typedef unsigned off;
    static constexpr bool lean = true;
};

// What one round needs: its epoch, where it starts in an IN/OUT unit and its slicing.
template <typename Geo>
struct purlin_round {
    typedef typename Geo::off off;
    purlin_u64 epoch;  // counters[channel] + round
    off io_offset;     // byte offset of this round inside an IN/OUT unit: round * piece bytes
    off io_unit;       // bytes between IN/OUT units
    off stage_unit;    // bytes between staging units
    off bytes;         // bytes of one unit moved this round
    off step;          // slice stride in bytes
    off stage_copy;    // byte offset of this round's staging copy (epoch parity; 0 with one copy)
};

// Round `round`'s geometry: everything but its epoch, which purlin_round_epoch adds once the
// call counter is needed.  The stride is that of a full round, not of this round's bytes: a
// slice then covers the same staging bytes in every round, so a channel that runs ahead into
// a shorter last round cannot overlap another channel's slice of the previous round
// (purlinc.snac.simulate.round_slice_bounds).
template <typename Geo>
__device__ __forceinline__ purlin_round<Geo> purlin_round_geometry(const purlin_args& args, purlin_u64 round)
{
    typedef typename Geo::off off;
    purlin_round<Geo> rd;
    rd.epoch = 0;
    rd.io_offset = Geo::lean ? 0 : (off)(round * args.piece_bytes);  // lean: round 0 of 1
    rd.io_unit = (off)args.io_unit;
    rd.stage_unit = (off)args.stage_unit;
    rd.bytes = (off)(Geo::lean || round + 1 == args.rounds ? args.last_bytes : args.piece_bytes);
    rd.step = (off)args.step;
    rd.stage_copy = 0;
    return rd;
}

// The round's epoch (counters[channel] + round) and with it its staging copy: round e writes
// and reads copy e % 2, so a producer may fill the next round's copy while its consumer still
// reads this one (purlinc.snac.ir, "Staging copies").  Set where the program first needs it:
// a program that starts with a packet send sets it after issuing the send's loads, so the
// counter's load and the data loads are in flight together (block_ll_send.cu.j2).
template <typename Geo>
__device__ __forceinline__ void purlin_round_epoch(purlin_round<Geo>& rd, const purlin_args& args, purlin_u64 epoch)
{
    typedef typename Geo::off off;
    rd.epoch = epoch;
    rd.stage_copy = PURLIN_STAGE_COPIES > 1 ? (off)(epoch & 1) * (off)args.copy_bytes : 0;
}

// Slice s of a unit: bytes [lo, hi) with lo = min(bytes, s * step), hi = min(bytes, lo + step)
// (the same function as purlinc.snac.simulate.slice_bounds).
template <typename Geo>
__device__ __forceinline__ typename Geo::off purlin_slice_lo(const purlin_round<Geo>& rd, unsigned s)
{
    const typename Geo::off lo = s * rd.step;
    return lo < rd.bytes ? lo : rd.bytes;
}

template <typename Geo>
__device__ __forceinline__ typename Geo::off purlin_slice_len(const purlin_round<Geo>& rd, unsigned s)
{
    const typename Geo::off lo = purlin_slice_lo(rd, s);
    const typename Geo::off hi = lo + rd.step;
    return (hi < rd.bytes ? hi : rd.bytes) - lo;
}

// Slice s of unit u of a caller buffer (IN/OUT): units are `count` elements apart.
template <typename Geo>
__device__ __forceinline__ char* purlin_io(char* base, unsigned unit, unsigned s, const purlin_round<Geo>& rd)
{
    return base + (unit * rd.io_unit + rd.io_offset + purlin_slice_lo(rd, s));
}

// Slice s of unit u of a staging buffer: units `stage_unit` and slices `stage_step` bytes apart,
// whatever the count (abi.StagingPlacement): each channel guards its own slices, so a slice must
// not move onto another channel's between calls.  `stage_step` is read from the arguments
// where it is used (a constant-bank operand), not kept in the round: one more live register
// across a call made the TMA copy spill.
template <typename Geo>
__device__ __forceinline__ char* purlin_stage(char* base, unsigned unit, unsigned s, const purlin_round<Geo>& rd,
                                              typename Geo::off stage_step)
{
    return base + (rd.stage_copy + unit * rd.stage_unit + s * stage_step);
}

// Packets of slice s of a packed message in unit u (and u + 1): data byte o of the slice is in
// the packet at byte 2 * o from the start of unit u plus twice the slice's fixed start.
template <typename Geo>
__device__ __forceinline__ char* purlin_stage_ll(char* base, unsigned unit, unsigned s, const purlin_round<Geo>& rd,
                                                 typename Geo::off stage_step)
{
    return base + (rd.stage_copy + unit * rd.stage_unit + 2 * (s * stage_step));
}

// Slice s of unit `unit` of a region of kind `kind` (codegen/exprs.py numbers them: 0 this
// rank's IN, 1 its OUT, 2 / 3 rank `rank`'s registered IN / OUT, 4 rank `rank`'s staging, 5 the
// packets of a packed message there).  Every block names its regions this way, so the code of
// ranks that differ only in these numbers is one; a literal kind folds to one case.
template <typename Geo>
__device__ __forceinline__ char* purlin_region(const purlin_args& args, const purlin_round<Geo>& rd, int kind, int rank,
                                               unsigned unit, unsigned s)
{
    switch (kind) {
    case 0: return purlin_io(args.in, unit, s, rd);
    case 1: return purlin_io(args.out, unit, s, rd);
    case 2: return purlin_io(args.in_peer[rank], unit, s, rd);
    case 3: return purlin_io(args.out_peer[rank], unit, s, rd);
    case 4: return purlin_stage(args.stage[rank], unit, s, rd, (typename Geo::off)args.stage_step);
    default: return purlin_stage_ll(args.stage[rank], unit, s, rd, (typename Geo::off)args.stage_step);
    }
}

// ---- launch order ----

// The runtime launches kernels on sm_90+ as programmatic dependent launches
// (runtime/driver.py: DependentLaunch): this grid may be scheduled while the kernel ahead of
// it in the stream is still running.  So before anything else every block waits for that
// kernel to finish and its memory to be visible (a no-op for a plain launch), then lets the
// kernel after it be scheduled (which waits the same way, for all of this grid): a call's
// launch latency overlaps the previous kernel's execution instead of following it.
__device__ __forceinline__ void purlin_launch_order()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---- signals ----

// Release store at system scope: every write this block made before the preceding
// __syncthreads() is visible to whoever acquires the new value.
__device__ __forceinline__ void purlin_notify(purlin_u64* signal, purlin_i64 value)
{
    asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(signal), "l"(value) : "memory");
}

// Relaxed store at system scope, no fence: for ACK signals only ("I finished reading the data
// you staged for me / you may write my OUT").  What such a notify orders before the peer's next
// writes are this block's *reads*, and every one of them has returned its value before the
// __syncthreads() that precedes the notify: each value was stored to OUT, combined into a
// stored result, or tested by a poll, so the thread waited for it before reaching the barrier.
// A read that has returned cannot see a write issued after it, so the peer, which writes only
// after it observes the new value, cannot overwrite data still being read: no release fence
// (which would also wait for this block's remote stores to complete) is needed.  DATA
// notifies keep purlin_notify's release: there the data written before must be visible.
__device__ __forceinline__ void purlin_notify_relaxed(purlin_u64* signal, purlin_i64 value)
{
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(signal), "l"(value) : "memory");
}

__device__ __forceinline__ purlin_i64 purlin_poll(const purlin_u64* signal)
{
    purlin_i64 value;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(signal) : "memory");
    return value;
}

__device__ __forceinline__ purlin_u64 purlin_clock_ns()
{
    purlin_u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// The first failing wait of this rank fills the error record (abi.ERROR_RECORD order).
__device__ __noinline__ void purlin_record_error(purlin_u64* error, unsigned rank, unsigned step,
                                                 unsigned index, purlin_i64 expected, purlin_i64 observed)
{
    if (atomicCAS(error, 0ull, 1ull) != 0ull) return;  // another wait was first
    volatile purlin_u64* record = error;
    record[1] = rank;
    record[2] = blockIdx.x;
    record[3] = step;
    record[4] = rank;  // the signal's owner: only the owner waits on a signal
    record[5] = index;
    record[6] = (purlin_u64)expected;
    record[7] = (purlin_u64)observed;
    __threadfence_system();
}

// Wait until *signal >= target (signed: the target may be negative at epoch 0), bounded by
// timeout_ns.  Returns 1 on timeout or when another wait of this rank already failed; the
// kernel must then return.  Not inlined: called by one lane per signal, and a call per wait
// keeps long schedules quick to compile.  The host-mapped error flag and the clock are read
// only every 1024 polls.
__device__ __noinline__ int purlin_wait(const purlin_u64* signal, purlin_i64 target, purlin_u64 timeout_ns,
                                        purlin_u64* error, unsigned rank, unsigned step, unsigned index)
{
    purlin_i64 seen = purlin_poll(signal);
    if (seen >= target) return 0;
    const purlin_u64 start = purlin_clock_ns();
    for (unsigned polls = 1;; ++polls) {
        seen = purlin_poll(signal);
        if (seen >= target) return 0;
        if ((polls & 1023u) == 0) {
            if (*(volatile purlin_u64*)error != 0) return 1;  // another wait of this rank failed
            if (purlin_clock_ns() - start > timeout_ns) {
                purlin_record_error(error, rank, step, index, target, seen);
                return 1;
            }
        }
    }
}
