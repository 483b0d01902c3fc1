"""In-situ timing: each collective call between a producer kernel that writes its input and a
consumer kernel that reads its output, all launched plainly on one stream as a framework does
(a GEMM, the collective, an RMSNorm), many steps per CUDA graph.

Back to back (``graph`` rows), programmatic dependent launch lets a call's blocks start while
the previous call runs; here the producer is an ordinary kernel, so the collective starts only
when it ends, and the consumer only when the collective ends.  Two graphs of ``calls`` steps
are timed alternately: producer -> collective -> consumer, and producer -> consumer.  A row's
``time_us`` is what the collective *adds* per step (with minus without, repeat by repeat; the
max over ranks of each rank's median of those differences; ``time_us_min``/``_max``: the max
over ranks of each rank's smallest / largest, taken separately); ``step_us`` and ``base_us`` are
the max over ranks of each rank's median step with and without the call, so ``time_us`` need not
equal their difference.

The producer rewrites the input from a source tensor on every step, so every system's step is
repeatable (in-place all-reduces included) and the graph is checked: one replay on fresh
source data, the output against the float32 reference of every rank's input.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

import torch

import report
from benchlib.cases import Case, poison
from benchlib.check import _agree_check, compare, fresh_input, reference
from benchlib.context import Ctx, allreduce_max, barrier, guarded, sync
from benchlib.timing import capture_steps, graph_replays, replays_us

INSITU = report.INSITU


@dataclass
class Around:
    """The kernels around one case on this rank: ``produce`` writes the input from ``source``
    (a rank without input writes a scratch tensor, so every rank does the same work), and
    ``consume`` reads the output (or a scratch tensor where the rank has none)."""

    source: object
    produce: Callable[[], object]
    consume: Callable[[], object]


def around(case: Case, lay: report.Layout, device) -> Around:
    source = torch.empty(lay.in_elems, dtype=torch.bfloat16, device=device)
    target = case.input() if case.input is not None else None
    if target is None:
        target = torch.empty_like(source)
    out = case.output()
    read = out if out is not None else torch.zeros(max(lay.out_elems, 1), dtype=torch.bfloat16, device=device)
    sink = torch.empty_like(read)
    # An elementwise kernel each (mul by 1 is exact in bf16): what matters is that they are
    # ordinary kernels writing the input and reading the output.
    return Around(source, lambda: torch.mul(source, 1, out=target), lambda: torch.add(read, 1, out=sink))


def capture_pair(case: Case, kernels: Around, calls: int):
    """(graph with the collective, graph without), ``calls`` steps each."""

    def step():
        kernels.produce()
        case.call()
        kernels.consume()

    def bare():
        kernels.produce()
        kernels.consume()

    return capture_steps(step, calls, case.capture_env), capture_steps(bare, calls)


def time_pair(graphs, calls: int, reps: int, replays: int) -> tuple[list[float], list[float]]:
    """Per-step times (with, without) of ``reps`` repeats; the two graphs alternate within a
    repeat, so a drift of the clocks lands in both."""
    with_us, without_us = [], []
    for _ in range(reps):
        without_us.append(replays_us(graphs[1], replays) / (calls * replays))
        with_us.append(replays_us(graphs[0], replays) / (calls * replays))
    return with_us, without_us


def check_graph(ctx: Ctx, lay: report.Layout, case: Case, kernels: Around, graph, salt: int) -> tuple[bool, str]:
    """One replay on fresh source data: the output against every rank's reference."""
    x = fresh_input(ctx, lay.in_elems, salt)
    ref = reference(ctx, lay, salt)
    kernels.source.copy_(x)
    poison(case.output())
    graph.replay()
    sync()
    if case.after:
        case.after()
    return compare(case.output(), ref)


def insitu_row(ctx: Ctx, lay: report.Layout, case: Case, calls: int, salt: int, base: dict) -> dict:
    """The in-situ row of ``case`` at ``calls`` steps per graph (every rank takes part)."""
    row = {**base, "mode": INSITU, "calls_per_graph": calls, "time_us": None, "algbw_gbps": None,
           "busbw_gbps": None, "pct_of_limit": None, "checked": None}
    ran, made, err = guarded(ctx, lambda: _made(case, lay, ctx, calls))
    if not ran:
        return {**row, "error": f"{INSITU}: {err}"}
    kernels, graphs, one_us = made
    replays = graph_replays(allreduce_max(ctx, [one_us])[0], ctx.args.target_rep_us)
    barrier(ctx)
    ran, times, err = guarded(ctx, lambda: time_pair(graphs, calls, ctx.args.reps, replays))
    if not ran:
        return {**row, "error": f"{INSITU}: {err}"}
    with_us, without_us = times
    added = [w - b for w, b in zip(with_us, without_us)]
    med, lo, hi, step, bare = allreduce_max(ctx, [statistics.median(added), min(added), max(added),
                                                  statistics.median(with_us), statistics.median(without_us)])
    barrier(ctx)
    ran, checked, err = guarded(ctx, lambda: check_graph(ctx, lay, case, kernels, graphs[0], salt))
    good, note = _agree_check(ctx, ran, checked, err)
    return {**row, "time_us": med, "time_us_min": lo, "time_us_max": hi, "step_us": step, "base_us": bare,
            "iters": calls, "reps": ctx.args.reps, "replays": replays, "checked": good, "check_note": note,
            "error": None}


def _made(case: Case, lay: report.Layout, ctx: Ctx, calls: int):
    kernels = around(case, lay, ctx.device)
    kernels.source.copy_(fresh_input(ctx, lay.in_elems, 0))
    graphs = capture_pair(case, kernels, calls)
    graphs[0].replay()
    sync()
    return kernels, graphs, replays_us(graphs[0], 1)


