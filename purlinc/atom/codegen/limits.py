"""The code generator's tunables, in one module so a benchmark can vary them (every reader
looks them up here at generation time)."""

THREADS = 512  # block size of every channel
# Packed (LL) schedules serve small messages, where a call is a few hundred packets per
# channel: fewer threads make every block barrier and the launch cheaper, and still give
# each thread only a few packets up to the sizes the tuner picks LL for.
THREADS_PACKED = 256
MAX_GROUP = 32  # merged Notify / Wait groups use the lanes of warp 0
MAX_COPY_DSTS = 8  # destinations of one multi-destination copy (a pointer each, by value)

LL_BATCH_SOURCES = 8  # sources per receive loop (C consumes x N sources): 4 registers each per packet in flight
LL_SEND_SOURCES = 8  # distinct sources per fused send loop: 2 registers each per packet in flight
# Messages per fused send loop: each keeps its destination and flag live across the loop (three
# registers).  The R=8 LL all-reduce put 56 in one loop: 255 registers and 220-304 bytes of
# spills on sm_90 (548 on sm_80), on the small-message path.
LL_SEND_MESSAGES = 16
LL_IN_FLIGHT = 4  # packets per thread a send or receive loop keeps in flight (its unroll: this / sources)
# A module with at most this many receive loops (call sites in its bodies, a loop over rows
# counted once) inlines purlin_ll_consume: the loop's arguments then stay in registers instead
# of going through the stack.  Beyond it the loops share one out-of-line body per shape, which
# keeps NVRTC time flat (when every rank had its own entry, an 8-GPU all-reduce had 64 loops:
# 12 s inlined, 4 s shared, measured 2026-11-30; as one body it has one).
LL_INLINE_LOOPS = 16

# The code one kernel body may hold, counted as its items (a block of code, rolled over the ranks'
# tables) plus their sources and destinations: NVRTC's time grows with the square of a function's
# size, and a body grows with slices per channel (each slice's steps are their own code).  An
# all-reduce at R=3 measured 513 -> 8 s, 1,025 -> 27 s, 2,049 -> 109 s (slices 64, 128, 256);
# at R=8, 833 -> 34 s (slices 64); a ring all-reduce at R=64 has 885.  Past the bound a compile
# is refused at once instead of running for minutes.
MAX_BODY_SIZE = 1024
