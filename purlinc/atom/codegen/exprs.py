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

SLICE0 = "slice0"  # this block's first slice: blockIdx.x * slices per channel (body.cu.j2)
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


# Region kinds, numbered as purlin_region (prelude.cuh) takes them.  A kind is a number like
# any other, so ranks whose step reads its own input where another reads a peer's staging
# (a reduction's sources in rank order) still share code.
IN, OUT, IN_PEER, OUT_PEER, STAGE, STAGE_LL = range(6)


def region_expr(region: Region, rank: int) -> str:
    """The address of ``region`` for ``rank``'s kernel."""
    if region.space is Space.STAGE:
        kind = STAGE
    elif region.space is Space.IN:
        kind = IN if region.rank == rank else IN_PEER
    else:
        kind = OUT if region.rank == rank else OUT_PEER
    return _region(kind, region, num(region.unit))


def packets_expr(region: Region) -> str:
    """The packets of a packed message staged in ``region``."""
    return _region(STAGE_LL, region, num(region.unit))


def _region(kind: int, region: Region, unit: str) -> str:
    return f"purlin_region(args, rd, {num(kind)}, {num(region.rank)}, {unit}, {slice_expr(region.slice)})"


def one_line(text: str) -> str:
    return " ".join(str(text).split())
