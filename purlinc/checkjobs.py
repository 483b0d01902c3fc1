"""``purlinc check``'s schedule work on several cores: one job per (world size, algorithm).

Each job lowers and verifies one schedule, exactly as the one-process loop does
(``pipeline.snac_stage``: the same lowering, the same proof); only where it runs changes.
Jobs are handed out in the loop's order (world sizes ascending, algorithms in registry
order) and their results read back in that order, so the first failure reported is the one
the one-process loop would have stopped at, with the same message and notes, and the
progress line still counts sizes as they finish.

Workers are forked (``fork`` start method, Linux): they inherit the parsed definition and
the command's options, nothing is pickled but a (world size, algorithm) pair and a verdict.
Where ``fork`` is not available, or one core, or little work (a big world size costs about
R^3), the caller keeps the one-process loop.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable, Sequence

# Below this much work (the sum of R^3 over the jobs; a second or so of CPU: an all-to-all's
# three schedules at R=24, or R=1..16) forking workers saves too little to be worth a pool.
MIN_WORK = 48**3

_STATE: dict = {}  # what forked workers read: set by verify_parallel before the pool forks


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def worth_it(jobs: int, units: Sequence[tuple[int, str]]) -> bool:
    """More than one worker, more than one job, enough work, and ``fork`` to start them."""
    return (jobs > 1 and len(units) > 1 and sum(r**3 for r, _ in units) >= MIN_WORK
            and "fork" in multiprocessing.get_all_start_methods())


def _spec(world_size: int):
    from purlinc import pipeline

    cached = _STATE.get("spec")
    if cached is None or cached[0] != world_size:
        cached = _STATE["spec"] = (world_size, pipeline.spec_stage(_STATE["definition"], world_size, _STATE["params"]))
    return cached[1]


def _start_worker(parent: int) -> None:
    """Ctrl-C is the parent's to handle (it stops the pool); workers would each print a
    traceback.  A worker also dies with its parent, however the parent ends: killed (SIGTERM
    from timeout or a CI runner, or SIGKILL), it left its workers computing, orphaned, until
    their jobs ended, then printing broken-pipe tracebacks."""
    import ctypes
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's raising handler: Pool.terminate() kills
    try:  # Linux: the kernel sends this signal when the parent exits
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (AttributeError, OSError):  # another system: the parent's SIGTERM handler still stops the pool
        pass
    if os.getppid() != parent:  # the parent died before the request was made
        os._exit(1)


_PR_SET_PDEATHSIG = 1


@contextlib.contextmanager
def _terminated_as_interrupted():
    """SIGTERM in the parent raises, as Ctrl-C does, so the pool is stopped on the way out.
    Only where SIGTERM would end the process anyway (its default action) and only in the main
    thread (the one that may set handlers): a program's own handler, or one installed outside
    Python, is left as it is, and the workers' request to die with the parent still stands."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _job(unit: tuple[int, str]):
    """Lower and verify one schedule; None, or the PurlinError the one-process loop would raise."""
    from purlinc import pipeline
    from purlinc.errors import PurlinError
    from purlinc.snac.ir import Algorithm

    world_size, algorithm = unit
    spec = _spec(world_size)
    try:
        pipeline.snac_stage(spec, _STATE["options"](spec, Algorithm(algorithm)))
    except PurlinError as error:
        return error
    return None


def verify_parallel(definition, params, units: Sequence[tuple[int, str]], options: Callable, jobs: int,
                    progress: Callable[[int, int], None]) -> int:
    """Verify every (world size, algorithm value) of ``units`` on ``jobs`` forked workers.
    ``options(spec, algorithm)`` gives a job's LowerOptions; ``progress(world_size, done)``
    is called as each size's last job finishes (``done`` sizes so far).  Returns how many
    schedules were verified, or raises the first failure in ``units`` order."""
    _STATE.clear()
    _STATE.update(definition=definition, params=params, options=options)
    last_of = {r: i for i, (r, _) in enumerate(units)}
    sizes_done = 0
    try:
        context = multiprocessing.get_context("fork")
        with _terminated_as_interrupted(), \
                context.Pool(min(jobs, len(units)), initializer=_start_worker, initargs=(os.getpid(),)) as pool:
            for i, ((world_size, algorithm), error) in enumerate(zip(units, pool.imap(_job, units))):
                if error is not None:
                    raise error.with_note(f"while verifying {algorithm} for R={world_size}") from None
                if last_of[world_size] == i:
                    sizes_done += 1
                    progress(world_size, sizes_done)
    finally:
        _STATE.clear()
    return len(units)
