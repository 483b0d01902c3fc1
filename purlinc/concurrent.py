"""Several ``Compiled`` objects' kernels of one (dtype, op) at once, in threads.

A tuned ``load()`` has one schedule per size bucket (four at R=8), and each bucket's kernel
is its own NVRTC compile, seconds of CPU each when cold.  NVRTC releases the GIL while it
compiles (measured: a thread ticking every millisecond keeps ticking through
``nvrtcCompileProgram``), so the compiles of different buckets run on different cores;
generating the CUDA source is Python and stays serialised by the GIL, but it is a small part.

Exactly what each ``Compiled.kernel(dtype, op)`` would compile on its own is compiled and
cached (the same source, options and cache entries); only the order in time changes.  Each
``Compiled`` guards its own kernels with its lock, so a thread here and a later plain call
never compile one kernel twice.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from purlinc.dtypes import DType, ReduceOp
    from purlinc.pipeline import Compiled, Kernel


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def compile_jobs(jobs: Iterable[tuple[Compiled, DType | str, ReduceOp | str | None]], *,
                 workers: int | None = None) -> list[Kernel]:
    """``[c.kernel(dtype, op) for c, dtype, op in jobs]``, the distinct ones compiled
    concurrently (``workers`` threads; default: one per core this process may run on, at most
    one per kernel).  Host-driven atoms (``Compiled.plan`` not None) have no kernel: pass kernel
    atoms only.  A copy collective's op is ignored.  The first error, in ``jobs`` order, is
    raised after every compile ended."""
    jobs = [(c, dtype, op if c.schedule.operation.value == "reduce" else None) for c, dtype, op in jobs]

    def key(job) -> tuple:
        compiled, dtype, op = job
        return (id(compiled), str(getattr(dtype, "value", dtype)), str(getattr(op, "value", op)))

    distinct = list({key(job): job for job in jobs}.items())
    workers = min(len(distinct), workers or _cores())

    def kernel(job) -> Kernel:
        compiled, dtype, op = job
        # A copy collective's kernel is memoised under op None, as the runtime asks for it.
        return compiled.kernel(dtype, op)

    if workers <= 1:
        done = {k: kernel(job) for k, job in distinct}
        return [done[key(job)] for job in jobs]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="purlin-nvrtc") as pool:
        futures = {k: pool.submit(kernel, job) for k, job in distinct}
    # Leaving the ``with`` waited for every compile; result() raises a compile's error.
    return [futures[key(job)].result() for job in jobs]


def compile_kernels(compileds: Iterable[Compiled], dtype: DType | str, op: ReduceOp | str | None = None, *,
                    workers: int | None = None) -> list[Kernel]:
    """``[c.kernel(dtype, op) for c in compileds]``, concurrently (``compile_jobs``)."""
    return compile_jobs([(c, dtype, op) for c in compileds], workers=workers)
