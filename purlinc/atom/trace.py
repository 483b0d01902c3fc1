"""Traced kernels: where the stamps go, and how to read them back.

``generate(..., trace=True)`` adds, after every block of every channel program, a block-wide
barrier and one stamp by thread 0 (``templates/trace.cuh.j2``), plus one stamp when each
round starts.  A stamp is two u64 words: ``%globaltimer`` (the GPU's nanosecond clock) and
``clock64()`` (the SM's cycle counter, finer than the global timer on GPUs where that ticks
only every microsecond or so).  Untraced kernels are generated exactly as before.

The stamps live in a ``__device__`` array of the module, ``purlin_trace_buf`` (the kernel
argument ABI is unchanged), read back with cuModuleGetGlobal:

    word 0 + 2c, 1 + 2c          channel c: epoch0 (the call number of the last call), rounds
    2C + 2 * ((c * ROUNDS + i) * MARKS + m) + {0, 1}
                                 channel c, round i < ROUNDS, mark m: globaltimer, clock64

Mark 0 is the start of round i; mark b + 1 the end of block b (blocks are the generated
code's units: a data step, a merged group of notifies or waits, an LL receive that also
consumes, or a hazard barrier; ``KernelSource.trace_blocks`` says which steps each holds).
The start of block b is mark b.  Only the last call's stamps are kept (each call overwrites).
"""

from __future__ import annotations

import re
import struct

TRACE_ROUNDS = 4  # rounds recorded per call (messages larger than the staging space run in more)
BUFFER = "purlin_trace_buf"
_STEP = re.compile(r"^step (\d+):")


def block_steps(block: dict) -> tuple[int, ...]:
    """The SNAC step indices a generated block covers (from its ``step N:`` comments)."""
    found = []
    for line in block.get("comments", ()):
        m = _STEP.match(line)
        if m and int(m.group(1)) not in found:
            found.append(int(m.group(1)))
    return tuple(found)


def trace_template_values(kernels: list[dict], channels: int) -> dict:
    """What the templates need for a traced module, and the block -> steps map."""
    blocks = tuple(
        tuple(tuple(block_steps(b) for b in ch["blocks"]) for ch in kernel["channels"]) for kernel in kernels
    )
    marks = 1 + max((len(ch) for rank in blocks for ch in rank), default=0)
    return {"rounds": TRACE_ROUNDS, "marks": marks, "channels": channels,
            "words": 2 * channels + 2 * channels * TRACE_ROUNDS * marks, "blocks": blocks}


def buffer_words(channels: int, marks: int) -> int:
    return 2 * channels + 2 * channels * TRACE_ROUNDS * marks


def decode(data: bytes, channels: int, marks: int) -> list[dict]:
    """The raw buffer of one rank -> per channel {epoch, rounds, stamps: [round][mark] = (gt, clk)}."""
    words = struct.unpack(f"<{len(data) // 8}Q", data)
    if len(words) < buffer_words(channels, marks):
        raise ValueError(f"trace buffer has {len(words)} words, expected {buffer_words(channels, marks)}")
    out = []
    base = 2 * channels
    for c in range(channels):
        epoch, rounds = words[2 * c], words[2 * c + 1]
        stamps = []
        for i in range(min(rounds, TRACE_ROUNDS)):
            row = []
            for m in range(marks):
                at = base + 2 * ((c * TRACE_ROUNDS + i) * marks + m)
                row.append((words[at], words[at + 1]))
            stamps.append(row)
        out.append({"epoch": epoch, "rounds": rounds, "stamps": stamps})
    return out
