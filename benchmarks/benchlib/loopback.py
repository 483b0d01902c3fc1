"""One point of insitu_loopback.py: a Purlin variant on a loopback LocalGroup (every rank on
one GPU, each on its own stream), timed in situ (producer -> call -> consumer per rank, plain
launches) and back to back, in CUDA graphs that hold every rank's work, then checked.

A graph is captured on a side stream; every step forks the ranks' streams from it and joins
them back, so one replay runs every rank (the ranks wait for each other on the device, as
separate processes would).  The in-situ pair (with / without the collective) is timed
alternately repeat by repeat, as benchlib/insitu.py does across processes.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

import purlin_api
import report
from benchlib.check import compare, expected_output
from benchlib.timing import environment, graph_replays, replays_us

DEVICE = 0


@dataclass(frozen=True)
class Point:
    lay: report.Layout
    variant: purlin_api.Variant
    calls: int
    reps: int
    target_rep_us: float
    seed: int
    profile: bool = False  # also list the kernels one in-situ step runs (torch.profiler: CUPTI)


def _loaded(group, loads: dict, coll: str, variant):
    """The variant's load (``zerocopy`` and ``graph-staged`` share the default's)."""
    key = purlin_api.load_key(variant)
    if key not in loads:
        loads[key] = purlin_api.load(group, coll, variant.options)
    return loads[key]


def _buffers(group, lay, heap: bool):
    """Every rank's full input and output (heap tensors for a heap variant), with the
    conventions of purlin_api: a rank that passes no input or output gets None there."""
    R = len(group)
    if heap:
        xs, outs = group.empty((lay.in_elems,), torch.bfloat16), group.empty((lay.out_elems,), torch.bfloat16)
    else:
        xs = [torch.empty(lay.in_elems, dtype=torch.bfloat16, device=DEVICE) for _ in range(R)]
        outs = [torch.empty(lay.out_elems, dtype=torch.bfloat16, device=DEVICE) for _ in range(R)]
    coll, root = lay.collective, 0
    passed_x = [None if coll in ("broadcast", "scatter") and r != root else xs[r] for r in range(R)]
    passed_out = [None if coll in ("reduce", "gather") and r != root else outs[r] for r in range(R)]
    return xs, outs, passed_x, passed_out


class Steps:
    """Every rank's producer and consumer around one group call."""

    def __init__(self, coll, lay, xs, outs, passed_x, passed_out, streams):
        self.coll, self.lay, self.streams = coll, lay, streams
        self.passed_x, self.passed_out = passed_x, passed_out
        self.sources = [torch.empty(lay.in_elems, dtype=torch.bfloat16, device=DEVICE) for _ in streams]
        self.targets = xs
        self.reads = outs
        self.sinks = [torch.empty_like(o) for o in outs]
        self.reduce = lay.collective in report.REDUCE_COLLECTIVES

    def call(self) -> None:
        kwargs = {"op": "sum"} if self.reduce else {}
        self.coll(self.passed_x, self.passed_out, streams=self.streams, **kwargs)

    def step(self, with_call: bool, produce: bool = True) -> None:
        """One step of every rank, forked from the current stream and joined back into it."""
        current = torch.cuda.current_stream(DEVICE)
        for s in self.streams:
            s.wait_stream(current)
        if produce:
            for s, src, dst in zip(self.streams, self.sources, self.targets):
                with torch.cuda.stream(s):
                    torch.mul(src, 1, out=dst)
        if with_call:
            self.call()
        if produce:
            for s, out, sink in zip(self.streams, self.reads, self.sinks):
                with torch.cuda.stream(s):
                    torch.add(out, 1, out=sink)
        for s in self.streams:
            current.wait_stream(s)


def _capture(work, calls: int, env: dict):
    side = torch.cuda.Stream(device=DEVICE)
    side.wait_stream(torch.cuda.current_stream(DEVICE))
    graph = torch.cuda.CUDAGraph()
    with environment(env):
        with torch.cuda.graph(graph, stream=side):
            for _ in range(calls):
                work()
    return graph


def _fresh(steps: Steps, point: Point, salt: int) -> list:
    g = torch.Generator(device=DEVICE)
    out = []
    for r, src in enumerate(steps.sources):
        g.manual_seed(point.seed * 1_000_003 + salt * 7919 + r * 104_729)
        src.copy_(torch.randn(src.numel(), generator=g, device=DEVICE).to(torch.bfloat16))
        out.append(src.clone())
    return out


def _check(steps: Steps, graph, point: Point, salt: int, *, produces: bool = True) -> tuple[bool, str]:
    """One replay on fresh sources: every rank's output against the float32 reference.  A graph
    that ``produces`` writes the inputs from the sources itself; the back-to-back graph does
    not, so the sources are copied into the inputs first (its calls are out of place: every
    call of the replay computes the same output)."""
    inputs = _fresh(steps, point, salt)
    if not produces:
        for src, dst in zip(steps.sources, steps.targets):
            dst.copy_(src)
    for out in steps.reads:
        out.view(torch.uint8).fill_(0xFF)
    graph.replay()
    torch.cuda.synchronize(DEVICE)
    steps.coll.check()
    allx = torch.cat(inputs)
    notes = []
    R = len(steps.streams)
    for r in range(R):
        want = expected_output(point.lay, allx, r, R)
        got = steps.passed_out[r]
        good, note = compare(got, want)
        if not good:
            return False, f"rank {r}: {note}"
        notes.append(note)
    return True, notes[0]


def run_point(group, streams, loads: dict, point: Point) -> list[dict]:
    """The point's rows: ``graph`` (calls back to back) and ``insitu`` (what a call adds)."""
    lay, variant = point.lay, point.variant
    base = {"system": "purlin", "variant": f"{variant.name}@loopback", "collective": lay.collective,
            "dtype": "bfloat16", "bytes": lay.bytes, "count": lay.count, "world_size": len(group),
            "calls_per_graph": point.calls, "loopback": True, "options": dict(variant.options) or None,
            "algbw_gbps": None, "busbw_gbps": None, "pct_of_limit": None}
    env = {"PURLIN_GRAPH_BUFFERS": variant.graph_buffers} if variant.graph_buffers else {}
    try:
        coll = _loaded(group, loads, lay.collective, variant)
        steps = Steps(coll, lay, *_buffers(group, lay, variant.heap), streams)
        _fresh(steps, point, 0)
        steps.step(True)  # eager: compiles, loads, records the buffers' pointers
        torch.cuda.synchronize(DEVICE)
        coll.check()
        staged = _staged(coll, lay)
        before = staged._zc.graph_registered if staged._zc is not None else 0
        graphs = {"back": _capture(lambda: steps.step(True, produce=False), point.calls, env),
                  "with": _capture(lambda: steps.step(True), point.calls, env),
                  "without": _capture(lambda: steps.step(False), point.calls, {})}
        registered = staged._zc is not None and (staged._zc.graph_registered > before or (
            variant.heap and not staged._zc.prefer_staged))  # heap buffers: the twin by heap choice
        base.update(_kernel_of(staged, lay, registered))
        return _timed(steps, graphs, point, base)
    except Exception as error:  # one point's failure is a row; the group may still be usable
        msg = f"{type(error).__name__}: {str(error)[:400]}"
        return [{**base, "mode": m, "time_us": None, "checked": None, "error": msg} for m in ("graph", "insitu")]


def _staged(coll, lay):
    """Rank 0's staged Collective serving this size (a plain load's bucket, or the pinned one)."""
    first = coll[0]
    return first.variant_for(lay.count, 2) if hasattr(first, "variant_for") else first


def _kernel_of(staged, lay, registered: bool) -> dict:
    """Which kernel rank 0's captured calls run (the name Nsight Systems shows) and whether it
    is the registered twin (no staging) or the staged schedule."""
    from purlinc.dtypes import DType, ReduceOp

    ran = staged._zc.twin if registered else staged
    op = ReduceOp.SUM if lay.collective in report.REDUCE_COLLECTIVES else None
    name = ran.variant(DType.BFLOAT16, op).abi.entry(0) if getattr(ran, "_ce", None) is None else "(copy engines)"
    return {"kernel": name, "registered": registered, "staging_writes": staging_writes(ran.compiled.schedule)}


def staging_writes(schedule) -> int:
    """Slices rank 0's kernel writes into a staging buffer per call (every channel): the copies
    a registered twin no longer makes."""
    from purlinc.snac.ir import Space, Stage

    return sum(1 for program in schedule.concrete_programs() if program.rank == 0
               for step in program.steps if isinstance(step, Stage) and step.dst.space is Space.STAGE)


def profile_step(graph, steps_per_replay: int) -> list[dict]:
    """The device activities (kernels, copies) of one replay of ``graph``, by name: how many
    per step and their mean duration, longest total first (CUPTI through torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(DEVICE)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize(DEVICE)
    seen: dict[str, list] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        entry = seen.setdefault(event.name, [0, 0.0])
        entry[0] += 1
        entry[1] += event.time_range.elapsed_us()
    ranked = sorted(seen.items(), key=lambda kv: -kv[1][1])
    return [{"name": name, "per_step": round(count / steps_per_replay, 2), "mean_us": round(total / count, 2)}
            for name, (count, total) in ranked]


def _timed(steps: Steps, graphs: dict, point: Point, base: dict) -> list[dict]:
    label = f"{base['variant']} {point.lay.collective} {report.fmt_bytes(point.lay.bytes)}"
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize(DEVICE)
    one = replays_us(graphs["with"], 1, f"{label} warm")
    replays = graph_replays(one, point.target_rep_us)
    per_step = point.calls * replays
    back, with_us, without_us = [], [], []
    for _ in range(point.reps):
        back.append(replays_us(graphs["back"], replays, f"{label} back to back") / per_step)
        without_us.append(replays_us(graphs["without"], replays, f"{label} in situ, without") / per_step)
        with_us.append(replays_us(graphs["with"], replays, f"{label} in situ, with") / per_step)
    steps.coll.check()
    back_good, back_note = _check(steps, graphs["back"], point, 2, produces=False)  # each graph its own check
    good, note = _check(steps, graphs["with"], point, 1)
    added = [w - b for w, b in zip(with_us, without_us)]
    common = {"iters": point.calls, "reps": point.reps, "replays": replays, "error": None}
    if point.profile:
        common["trace"] = profile_step(graphs["with"], point.calls)
    return [
        {**base, **common, "mode": "graph", "time_us": statistics.median(back), "time_us_min": min(back),
         "time_us_max": max(back), "checked": back_good, "check_note": back_note},
        {**base, **common, "checked": good, "check_note": note,
         "mode": report.INSITU, "time_us": statistics.median(added), "time_us_min": min(added),
         "time_us_max": max(added), "step_us": statistics.median(with_us), "base_us": statistics.median(without_us)},
    ]
