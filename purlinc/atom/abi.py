"""The contract between generated kernels and the runtime that launches them.

Every generated module has one entry point per body, ``<kernel_base>_b<index>``: ranks whose
programs differ only in numbers (units, peers, signals) share a body, which reads those
numbers from its table's row ``rank`` (``purlinc.atom.codegen.tables``); ``KernelABI.bodies``
says which body each rank runs (``KernelABI.entry``).  An entry takes one argument: a
``purlin_args`` struct by value.  Its layout (all fields 8 bytes, no padding):

    offset  field
    0       u64   rounds       rounds of this call: ceil(count / piece), 0 when count == 0
    8       u64   io_unit      bytes between IN/OUT units: count * itemsize
    16      u64   piece_bytes  bytes of a unit moved per full round: piece * itemsize
    24      u64   last_bytes   bytes of a unit moved by the last round
    32      u64   stage_unit   bytes between staging units (``StagingPlacement``)
    40      u64   step         slice stride in bytes (below)
    48      u64   copy_bytes   bytes between the two staging copies (0 with one copy)
    56      u64   stage_step   bytes between the slices of a staging unit (``StagingPlacement``)
    64      u64   timeout_ns   bound on every device-side wait (%globaltimer nanoseconds)
    72      u64   rank         the rank this launch runs (its row of the body's table)
    80      ptr   in           this rank's input
    88      ptr   out          this rank's output
    96      ptr   counters     this rank's call counters: u64[channels], device memory, start at 0
    104     ptr   error        this rank's error record (``ERROR_RECORD``), host-mapped
    112     ptr   stage[R]     stage[p]: rank p's staging of this call (its region) as mapped here
    ..      ptr   signals[R]   signals[p]: rank p's signal pad (u64[signal_pad]) as mapped here
    ..      ptr   in_peer[R]   registered inputs of every rank (null when not registered)
    ..      ptr   out_peer[R]  registered outputs of every rank (null when not registered)
    ..      u64   epi[E]       modules with an epilogue only: its operands in declaration
                               order, a pointer or a float32's bits in the low word

Modules with run-time sizes (``purlinc.atom.sized``) take ``purlin_sized_args`` instead
(``SIZED_FIELDS``; ``KernelABI.args`` says which struct, ``args_fields`` its fields).

``count`` is the call's elements per chunk (unit) of the caller's IN/OUT buffers and
``piece`` the elements per chunk one round moves (the staging capacity).  The host derives
the round geometry from them once per call shape (``KernelABI.pack_args``), so no kernel
spends its first instructions on 64-bit divisions and products before its first load.

Lean entries: a module with packed (LL) stages also has ``<kernel_base>_b<index>_lean``
(``KernelABI.lean_entry``), the same program compiled for the calls ``KernelABI.lean_fits``
admits: one round, every byte offset the kernel forms below ``LEAN_LIMIT``, and every packet's
8 data bytes one aligned word (caller buffers 8-byte aligned, chunks a multiple of 8 bytes).
It takes the same arguments and computes its addresses in 32 bits, with no byte-wise path;
the runtime picks it per call (a small call's critical path is mostly those instructions).

Launch: grid = (channels, 1, 1), block = (threads, 1, 1), no dynamic shared memory
unless ``KernelABI.shared_bytes`` says otherwise.

Staging: slice ``s`` of unit ``u`` of the staging a call addresses (``stage[p]``) starts at
byte ``u * stage_unit + s * stage_step``.  Where a unit and its slices lie is the same for
every call of a loaded collective, whatever its count (``StagingPlacement``): a schedule
guards the reuse of a (unit, slice), each channel its own, not of bytes, so a call whose
units or slices lay over others of the call before it (a smaller count after a larger one)
would overwrite data a slower peer, or a slower channel, has not read yet.  A call's slices
must fit: ``step <= stage_step`` (and so ``piece * itemsize <= slices * stage_step <=
stage_unit``).  Every unit and slice starts 16-byte aligned, as packed (LL) stages' packets
must (``stage_align``: 16 for modules with packed stages, which the placement's 16-byte
strides and steps give every module); a packed message takes two consecutive units (already
counted in ``stage_units``).  Packed modules need the staging buffer zeroed once
before the first call (a packet whose flag words hold a stale value equal to an expected
flag would be taken as arrived; zero never is), and its staging buffer, signal pad and call
counters must not be shared with a schedule that has a different ``per_call`` (flags are
``epoch * per_call + k`` in 32 bits, unique only within one schedule's epochs).  With two
staging copies (``stage_copies``), round epoch ``e`` uses the units ``copy_bytes * (e % 2)``
bytes into the buffer: ``copy_bytes`` spans one copy's ``stage_units / 2`` units.

Slices: with ``S`` slices per unit, slice ``s`` of a round moving ``n`` elements covers the
bytes ``[min(nb, s*step), min(nb, s*step + step))`` of the unit, ``nb = n * itemsize`` and
``step = round_up(ceil(piece * itemsize / S), 16)``: the stride of a full round, so a slice
covers the same staging bytes in every round (``purlinc.snac.simulate.round_slice_bounds``).
Modules with an epilogue round ``step`` up to a row's bytes (``row_bytes``, a multiple of 16)
instead, and take a ``piece`` of whole rows, so every slice of every round holds whole rows.

Channels: block ``c`` (``blockIdx.x``) runs its rank's channel-relative program on slices
``c * S + s`` (``S`` slices per channel) and on the signals ``c * W + i`` of every pad
(``W`` signals per channel, the same on every rank), so ``signal_pad = channels * W``; the
error record's signal index is that concrete ``c * W + i``.

The epoch of round ``i`` of a call is ``counters[channel] + i``; each channel adds
``rounds`` to its counter when it finishes.  Signal pads and counters start zeroed.

Error record (``ERROR_RECORD``), written once by the first wait that times out (or finds
another's timeout), in this order of u64 words: flag (0 = ok, 1 = timeout), rank,
channel, step (index into the Program's steps), signal owner, signal index, expected,
observed.  The kernel returns early after an error, so nothing hangs.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

HEADER_FIELDS = ("rounds", "io_unit", "piece_bytes", "last_bytes", "stage_unit", "step", "copy_bytes", "stage_step",
                 "timeout_ns", "rank", "in", "out", "counters", "error")
PEER_FIELDS = ("stage", "signals", "in_peer", "out_peer")  # R pointers each, after the header
ARGS = "purlin_args"  # the entries' argument struct (the layout above)
# A module with run-time sizes (purlinc.atom.sized) takes a struct of its own, purlin_sized_args:
# this header, then stage[R] and signals[R] (no registered peers, no epilogue).
SIZED_ARGS = "purlin_sized_args"
SIZED_FIELDS = ("capacity", "in_len", "out_len", "unit_bytes", "slot_bytes", "region_bytes", "copy_bytes",
                "timeout_ns", "in", "out", "sizes", "out_sizes", "expected", "counters", "error", "size_error")
SIZED_PEER_FIELDS = ("stage", "signals")
ERROR_RECORD = ("flag", "rank", "channel", "step", "signal_owner", "signal_index", "expected", "observed")
ERROR_RECORD_BYTES = 8 * len(ERROR_RECORD)
LEAN_LIMIT = 1 << 31  # bytes: every offset a lean entry forms (packet offsets are twice a slice's) stays 32-bit


# Pieces up to this many bytes (a latency-bound call's: an LL all-reduce of a few KiB has
# chunks of a few hundred bytes) are staged in a region of their own, units this far apart:
# every call places a unit at the same bytes, and a small call's units stay close together
# instead of one large piece's stride apart.  16 KiB: at 64 KiB an LL all-reduce of 1 KiB at
# R=8 (48 units a rank) took 2 us more per call in loopback than units a piece apart did; at
# 16 KiB it is within the old placement's run-to-run range
# (benchmarks/results/2026-12-03-h200x1-loopback-staging-placement.md).
SMALL_STAGE_UNIT = 16 << 10
_STAGE_STRIDE_ALIGN = 16  # every unit starts 16-byte aligned (packets; vector loads)


def slice_step(nbytes: int, slices: int, align: int = 16) -> int:
    """Bytes between the slices of ``nbytes`` cut into ``slices``: ceil(nbytes / slices) rounded
    up to ``align`` (16, or an epilogue's row), as the kernels and the simulator cut them."""
    return -(-(-(-nbytes // slices)) // align) * align


@dataclass(frozen=True, slots=True)
class StagingPlacement:
    """Where each staging unit of a loaded collective, and each slice of it, lies: the same
    for every call.

    The staging space holds two regions, each with every unit at a fixed stride and every
    slice at a fixed step within its unit: the small region (``small`` bytes per unit, at the
    start) takes the calls whose slices fit its step, the large one (``large`` bytes per unit,
    after it) every other call.  A (unit, slice)'s bytes therefore never change with the
    count: consecutive calls of different counts touch the same (unit, slice)'s bytes or
    disjoint ones, which is what a schedule's guards (per unit and channel) assume.  A space
    too small for both holds the large region only (``small == 0``)."""

    units: int  # staging units per rank, every copy
    slices: int  # slices per unit, every channel
    small: int  # bytes per unit of the small region (0: no small region)
    large: int  # bytes per unit of the large region

    @classmethod
    def for_space(cls, space: int, units: int, slices: int = 1) -> "StagingPlacement":
        """The placement of ``units`` units of ``slices`` slices whose large region is at most
        ``space`` bytes; the small region comes on top of it (``total_bytes``)."""
        if units <= 0:
            return cls(0, max(slices, 1), 0, 0)
        large = space // units // _STAGE_STRIDE_ALIGN * _STAGE_STRIDE_ALIGN
        small = SMALL_STAGE_UNIT if large > 2 * SMALL_STAGE_UNIT else 0
        return cls(units, max(slices, 1), small, large)

    @property
    def total_bytes(self) -> int:
        """Staging bytes per rank: both regions."""
        return self.units * (self.small + self.large)

    def step_of(self, stride: int) -> int:
        """Bytes between a unit's slices in the region of units ``stride`` apart."""
        return stride // self.slices // _STAGE_STRIDE_ALIGN * _STAGE_STRIDE_ALIGN

    @property
    def largest_step(self) -> int:
        """The largest slice a call may stage (in the large region)."""
        return self.step_of(self.large)

    def place(self, step: int) -> tuple[int, int, int]:
        """(offset of the region, bytes between its units, bytes between a unit's slices) for a
        call whose slices are ``step`` bytes apart (``KernelABI.geometry``)."""
        if step <= self.step_of(self.small):
            return 0, self.small, self.step_of(self.small)
        if step <= self.largest_step:
            return self.units * self.small, self.large, self.largest_step
        raise ValueError(f"slices of {step} bytes do not fit a staging unit of {self.large} bytes in "
                         f"{self.slices} slice(s)")


@dataclass(frozen=True, slots=True)
class KernelABI:
    kernel_base: str  # entry points are f"{kernel_base}_b{body}" (``entry``)
    world_size: int
    channels: int  # grid size
    threads: int  # block size
    shared_bytes: int  # dynamic shared memory per block
    itemsize: int
    stage_units: int  # staging units per rank, every copy (each ``piece * itemsize`` bytes)
    slices: int  # slices per unit, all channels (the ``step`` of pack_args)
    stage_copies: int  # staging copies by epoch parity (1 or 2): stage_units / stage_copies per copy
    signal_pad: int  # u64 signals per rank
    in_units: tuple[int, ...]  # chunks in each rank's input
    out_units: tuple[int, ...]  # chunks in each rank's output
    needs_in_peers: bool  # the schedule reads or writes other ranks' IN (registered inputs)
    needs_out_peers: bool  # ... other ranks' OUT (registered outputs)
    stage_align: int = 1  # staging units are rounded up to this many bytes (16 with packed stages)
    lean: bool = False  # the module also has lean entries (``lean_entry``, ``lean_fits``)
    bodies: tuple[int, ...] = ()  # per rank, the body (entry) it runs; () = body r for rank r
    epilogue_slots: int = 0  # words of epilogue operands after out_peer (0: no epilogue)
    row_bytes: int = 0  # an epilogue's row in bytes: slices are cut on rows (0: on 16 bytes)
    args: str = ARGS  # the entries' argument struct: ARGS, or SIZED_ARGS (run-time sizes)

    def step(self, piece: int) -> int:
        """Bytes between the slices of a round moving ``piece`` elements per unit: the stride
        of a full round, a multiple of 16 bytes or of the epilogue's row."""
        return slice_step(piece * self.itemsize, self.slices, self.row_bytes or 16)

    def staged_at(self, piece: int, staging: StagingPlacement) -> tuple[int, int, int]:
        """(offset into every rank's staging, bytes between units, bytes between a unit's
        slices) of a call moving ``piece`` per round: where ``staging`` puts slices of its
        size (zeros with no staging)."""
        if not self.stage_units:
            return 0, 0, 0
        return staging.place(self.step(piece))

    def geometry(self, count: int, piece: int, staging: StagingPlacement) -> tuple[int, ...]:
        """The header's round geometry for a call of ``count`` elements per chunk moving
        ``piece`` per round, its units and slices where ``staging`` places them: (rounds,
        io_unit, piece_bytes, last_bytes, stage_unit, step, copy_bytes, stage_step), as the
        kernel reads them (the same bounds as ``purlinc.snac.simulate.round_slice_bounds``)."""
        if count < 0 or piece < 1:
            raise ValueError(f"count={count}, piece={piece}: expected count >= 0 and piece >= 1")
        itemsize = self.itemsize
        rounds = -(-count // piece) if count else 0
        piece_bytes = piece * itemsize
        last_bytes = (count - (rounds - 1) * piece) * itemsize if rounds else 0
        _, unit, stage_step = self.staged_at(piece, staging)
        copy_bytes = self.stage_units // self.stage_copies * unit if self.stage_copies > 1 else 0
        return rounds, count * itemsize, piece_bytes, last_bytes, unit, self.step(piece), copy_bytes, stage_step

    def body(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"{self.kernel_base}: rank {rank} is not in 0..{self.world_size - 1}")
        return self.bodies[rank] if self.bodies else rank

    def entry(self, rank: int) -> str:
        return f"{self.kernel_base}_b{self.body(rank)}"

    def lean_entry(self, rank: int) -> str:
        if not self.lean:
            raise ValueError(f"{self.kernel_base} has no lean entries (only modules with packed stages have them)")
        return f"{self.entry(rank)}_lean"

    def lean_fits(self, count: int, piece: int, pointers: tuple[int, ...], staging: StagingPlacement) -> bool:
        """Whether a call may take the lean entries: this module has them; the call is one
        round; every IN/OUT extent and the staging it addresses stay below ``LEAN_LIMIT``
        bytes; every chunk is a whole number of packets' data (8 bytes); and every caller
        buffer the kernel addresses (``pointers``: in, out and the registered peers; 0 = none)
        is 8-byte aligned."""
        if not self.lean or count < 1:
            return False
        rounds, io_unit, _, _, stage_unit, *_ = self.geometry(count, piece, staging)
        units = max((*self.in_units, *self.out_units, 1))
        return (rounds == 1 and io_unit % 8 == 0 and units * io_unit < LEAN_LIMIT
                and self.stage_units * stage_unit < LEAN_LIMIT and all(p % 8 == 0 for p in pointers))

    @property
    def args_fields(self) -> tuple[str, ...]:
        """The argument struct's fields in order, 8 bytes each, an array as ``name[n]``."""
        if self.args == SIZED_ARGS:
            return (*SIZED_FIELDS, *(f"{name}[{self.world_size}]" for name in SIZED_PEER_FIELDS))
        epilogue = (f"epi[{self.epilogue_slots}]",) if self.epilogue_slots else ()
        return (*HEADER_FIELDS, *(f"{name}[{self.world_size}]" for name in PEER_FIELDS), *epilogue)

    @property
    def args_bytes(self) -> int:
        return 8 * sum(int(field.partition("[")[2].rstrip("]") or 1) for field in self.args_fields)

    def pack_args(
        self,
        *,
        count: int,
        piece: int,
        timeout_ns: int,
        rank: int,
        in_ptr: int,
        out_ptr: int,
        counters_ptr: int,
        error_ptr: int,
        stage: list[int],
        staging: StagingPlacement,
        signals: list[int],
        in_peer: list[int] | None = None,
        out_peer: list[int] | None = None,
        epilogue: tuple[int, ...] = (),
    ) -> bytes:
        """The ``purlin_args`` struct as bytes, ready to be passed by value.  ``stage``: every
        rank's staging space, where ``staging`` places the units (the pointers passed are those
        of this call's region); ``epilogue``: the epilogue's operand words
        (``purlinc.runtime.operands``)."""
        if self.args != ARGS:
            raise ValueError(f"{self.kernel_base} takes {self.args}: pack its arguments with "
                             "purlinc.atom.sized.pack_sized_args")
        world = self.world_size
        self.body(rank)  # a rank of this module
        in_peer = in_peer or [0] * world
        out_peer = out_peer or [0] * world
        for name, values in (("stage", stage), ("signals", signals), ("in_peer", in_peer), ("out_peer", out_peer)):
            if len(values) != world:
                raise ValueError(f"{name}: expected {world} pointers (one per rank), got {len(values)}")
        if len(epilogue) != self.epilogue_slots:
            raise ValueError(f"epilogue: expected {self.epilogue_slots} operand words, got {len(epilogue)}")
        region = self.staged_at(piece, staging)[0]
        stage = [p + region if p else 0 for p in stage]
        return struct.pack(
            f"<{len(HEADER_FIELDS) + 4 * world + self.epilogue_slots}Q",
            *self.geometry(count, piece, staging), timeout_ns, rank, in_ptr, out_ptr, counters_ptr, error_ptr,
            *stage, *signals, *in_peer, *out_peer, *epilogue,
        )

    def to_json(self) -> dict:
        return {
            "kernel_base": self.kernel_base,
            "entries": [self.entry(r) for r in range(self.world_size)],
            "lean_entries": [self.lean_entry(r) for r in range(self.world_size)] if self.lean else [],
            "world_size": self.world_size,
            "grid": [self.channels, 1, 1],
            "block": [self.threads, 1, 1],
            "shared_bytes": self.shared_bytes,
            "itemsize": self.itemsize,
            "stage_units": self.stage_units,
            "slices": self.slices,
            "stage_copies": self.stage_copies,
            "signal_pad": self.signal_pad,
            "stage_align": self.stage_align,
            "in_units": list(self.in_units),
            "out_units": list(self.out_units),
            "needs_in_peers": self.needs_in_peers,
            "needs_out_peers": self.needs_out_peers,
            "args": self.args,
            "args_fields": list(self.args_fields),
            "args_bytes": self.args_bytes,
            **({"epilogue_slots": self.epilogue_slots, "row_bytes": self.row_bytes} if self.row_bytes else {}),
        }


def decode_error(words: tuple[int, ...]) -> dict[str, int]:
    return dict(zip(ERROR_RECORD, words))
