"""Timing one case: back-to-back eager calls between CUDA events, and CUDA graphs of a fixed
number of calls replayed back to back."""

from __future__ import annotations

import contextlib
import os
from typing import Callable

import torch

from benchlib.cases import Case
from benchlib.context import sync


def _events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def replays_us(graph, replays: int, label: str | None = None) -> float:
    """Microseconds for ``replays`` back-to-back replays of ``graph`` (events on the current
    stream; an NVTX range named ``label`` around them when given, for Nsight)."""
    start, end = _events()
    if label is not None:
        torch.cuda.nvtx.range_push(label)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    if label is not None:
        torch.cuda.nvtx.range_pop()
    return start.elapsed_time(end) * 1e3


def calls_us(call: Callable[[], object], calls: int, warm: int = 0) -> float:
    """Device time per call of ``calls`` calls of ``call`` back to back, between CUDA events
    (after ``warm`` untimed calls and a device sync, when asked)."""
    if warm:
        for _ in range(warm):
            call()
        sync()
    start, end = _events()
    start.record()
    for _ in range(calls):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def probe_us(case: Case) -> float:
    value = calls_us(case.call, 1, warm=2)
    if case.after:
        case.after()
    return value


def eager_iters(call_us: float, target_rep_us: float) -> int:
    """Eager calls per timed repeat: enough that a repeat lasts about ``target_rep_us`` by
    ``call_us``, the slowest rank's measured time per back-to-back call (every rank must make the
    same number of calls), 2 to 1,000.

    Lining the ranks up before a repeat (a barrier, then a device sync) still releases them a
    few tens of microseconds apart, and that lag lands in the repeat.  Sized from the one-call
    probe (an event pair around a single call: 30-150 us where a call issues in 6), a repeat
    held only 19-100 calls of a 1 KiB collective (run 19); sized from a measured loop it holds
    about 300-500 (runs 20-21), over which that lag spreads thin.  What remains between rows is
    the host's own drift (benchmarks/results/2026-12-01-h200x2-affinity-ab.md)."""
    return max(2, min(1000, int(target_rep_us / max(call_us, 0.5))))


def time_eager(case: Case, iters: int, reps: int, line_up: Callable[[], None]) -> list[float]:
    """Device time per call of ``iters`` calls issued back to back.  The ranks line up
    (``line_up``: a barrier, then a device sync) before each timed loop, for every system
    alike: a rank that enters its loop late would otherwise put its lag -- Python's, not the
    library's -- into the other rank's first call (measured 2026-11-30 with
    benchmarks/host_path.py: lined up, a Purlin 1 KiB all-reduce issues at 5.3-5.6 us per
    call, its host time).  ``eager_iters`` says how many calls make a repeat long enough."""
    for _ in range(min(iters, 100)):
        case.call()
    sync()
    out = []
    for _ in range(reps):
        line_up()
        out.append(calls_us(case.call, iters))
    if case.after:
        case.after()
    return out


def capture(case: Case, iters: int):
    return capture_steps(case.call, iters, case.capture_env)


@contextlib.contextmanager
def environment(env: dict):
    """``env`` set in os.environ for the block (what a variant's captures read), then restored."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def capture_steps(step: Callable[[], object], iters: int, env: dict | None = None):
    """A CUDA graph of ``iters`` calls of ``step`` (after two warm-up calls on a side stream, as
    torch recommends before a capture), captured with ``env`` set."""
    graph, _ = capture_with_result(step, iters, env)
    return graph


def capture_with_result(step: Callable[[], object], iters: int, env: dict | None = None) -> tuple[object, object]:
    """(graph, what the last captured call of ``step`` returned): ``capture_steps`` for a step
    whose result is read after each replay (the tensors the graph writes, e.g. a decode step's)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with environment(env or {}):
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        sync()
        graph = torch.cuda.CUDAGraph()
        result = None
        # thread_local: NCCL's watchdog thread keeps querying events while we capture.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(iters):
                # Drop the previous call's result first: its memory is free for the next call
                # to reuse, as when the results are not kept (the graph's pool stays as small).
                result = None
                result = step()
    return graph, result


def graph_replays(replay_us: float, target_rep_us: float) -> int:
    """Replays of one graph per timed repeat: enough that a repeat lasts about
    ``target_rep_us`` by ``replay_us``, one replay's time (the slowest rank's: every rank must
    replay the same number of times, or one would wait for a peer that has stopped), 1 to 100.

    The ranks' host loops are not lined up between repeats, so a rank's first call waits for
    the other rank to reach its replay: that lag lands in the repeat's time.  One replay of 20
    small calls lasts about 40 us, and a few microseconds of host lag then moved the per-call
    figure by 0.3-1.3 us from one row to the next (run 15: the same kernel as the default and as
    an explicit variant).  Replaying the graph back to back spreads the lag over every replay;
    each replay is still the same graph of ``calls`` calls, for every system alike.  (Runs 16-17
    sized this from the eager probe's one-call time, which the host's launch and the events
    dominate: 1-7 replays where 50 were meant, and the same kernel still differed by up to
    0.9 us between rows.)"""
    return max(1, min(100, int(target_rep_us / max(replay_us, 1.0))))


def capture_graph(case: Case, iters: int) -> tuple[object, float]:
    """The captured graph, replayed once untimed, and one more replay's time in us."""
    graph = capture(case, iters)
    graph.replay()
    sync()
    start, end = _events()
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return graph, start.elapsed_time(end) * 1e3


def time_graph(case: Case, graph, iters: int, reps: int, replays: int) -> list[float]:
    """Per-call time of ``reps`` repeats, each ``replays`` replays of ``graph`` back to back."""
    out = []
    for _ in range(reps):
        start, end = _events()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / (iters * replays))
    if case.after:
        case.after()
    return out
