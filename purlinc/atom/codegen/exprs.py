"""How a block names what it touches: regions, slices and signals as C expressions.

Channels are indexed, not enumerated: a rank's program runs for channel ``blockIdx.x``, every
slice offset by ``slice0 = blockIdx.x * S`` and every signal index by ``sig0 = blockIdx.x * W``
(``SLICE0`` / ``SIG0``), so the source does not grow with the number of channels.

Every integer of the schedule that enters an expression (a unit, a peer, a slice, a signal
index, a signal's value) goes through ``num``, which marks it: ``purlinc.atom.codegen.tables``
later finds the blocks and ranks whose code differs only in those numbers and emits their code
once, the numbers read from a table (or computed) instead of written out.
"""

from __future__ import annotations

import re

from purlinc.snac.ir import Region, Space

SLICE0 = "slice0"  # this block's first slice: blockIdx.x * slices per channel (rank.cu.j2)
SIG0 = "sig0"  # this block's first signal in every pad: blockIdx.x * channel_signals

_OPEN, _CLOSE = "\x02", "\x03"  # never in C source or in a comment (comments carry no marks)
MARK = re.compile(f"{_OPEN}(-?[0-9]+){_CLOSE}")


def num(value: int) -> str:
    """``value`` as a marked number: its text, and where it sits for ``tables``."""
    return f"{_OPEN}{int(value)}{_CLOSE}"


def unmark(text: str) -> str:
    """Text with every mark replaced by its number (what the kernel says when nothing is shared)."""
    return MARK.sub(r"\1", text)


def slice_expr(s: int) -> str:
    """The concrete slice of channel-relative slice ``s``, as the kernel computes it."""
    return f"{SLICE0} + {num(s)}"


def signal_expr(index: int) -> str:
    return f"{SIG0} + {num(index)}"


def region_expr(region: Region, rank: int, unit: str | None = None) -> str:
    """The address of ``region`` for ``rank``'s kernel; ``unit`` overrides its unit with an
    expression (a loop over a run of steps, see ``fuse.runs``)."""
    unit, s = num(region.unit) if unit is None else unit, slice_expr(region.slice)
    if region.space is Space.STAGE:
        return f"purlin_stage(args.stage[{num(region.rank)}], {unit}, {s}, rd)"
    own, peers = ("args.in", "args.in_peer") if region.space is Space.IN else ("args.out", "args.out_peer")
    base = own if region.rank == rank else f"{peers}[{num(region.rank)}]"
    return f"purlin_io({base}, {unit}, {s}, rd)"


def packets_expr(region: Region) -> str:
    return f"purlin_stage_ll(args.stage[{num(region.rank)}], {num(region.unit)}, {slice_expr(region.slice)}, rd)"


def one_line(text: str) -> str:
    return " ".join(str(text).split())
