"""Pause Python's cyclic garbage collector while a big schedule is built or proved.

Lowering and verifying allocate millions of small objects (regions, steps, nodes) that
never form reference cycles.  CPython's cycle collector is triggered by allocation counts
and its full collections walk every live object, so on schedules of 10^5..10^6 steps it
ran again and again over an ever larger heap: lowering allreduce for R=72 took 39.6 s of
CPU with it on and 9.8 s with it off.  Reference counting still frees everything at once;
the collector is switched back on (if it was on) when the work is done.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def gc_paused():
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
