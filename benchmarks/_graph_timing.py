"""What the one-process benchmarks share (ll_sweep.py, loopback_slices.py): one checked call
of a LocalGroup collective on fresh data, and its per-call time in CUDA-graph replays.

They run in one process that drives every rank (``purlinc.LocalGroup``): one GPU each, or all
on one GPU (a loopback group, with a stream per rank); the reference and the data helpers are
the GPU tests' (tests/gpu/_common.py, on sys.path).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import torch

from _common import expected, inputs_for, poison, to_numpy, to_torch
from benchlib.rows import finite_only


def issue(work, devices, streams) -> None:
    """``work()``, then every device synchronized.  With ``streams`` (one per rank: ranks that
    share a GPU must run at once), each rank's stream first waits for its device's current
    stream, and the current streams wait for them after."""
    if streams is not None:
        for d, s in zip(devices, streams):
            s.wait_stream(torch.cuda.current_stream(d))
    work()
    if streams is not None:
        for d, s in zip(devices, streams):
            torch.cuda.current_stream(d).wait_stream(s)
    for d in set(devices):
        torch.cuda.synchronize(d)


def checked_call(coll, nbytes: int, dtype, rng, devices, streams=None) -> tuple[list, list, bool]:
    """(inputs, outputs, whether every rank's output is bitwise the reference) of one call
    moving about ``nbytes`` per rank (the larger of input and output), outputs poisoned first.
    ``devices[r]``: rank r's GPU (a loopback group names one GPU for every rank, and then
    passes ``streams``, one per rank)."""
    spec = coll[0].compiled.spec
    units = max(max(len(spec.inputs[r]), len(spec.outputs[r])) for r in range(spec.world_size))
    count = max(1, nbytes // (units * dtype.itemsize))
    inputs = inputs_for(spec, count, dtype, rng)
    xs = [to_torch(inputs[r], dtype, d) if len(spec.inputs[r]) else None for r, d in enumerate(devices)]
    outs = [torch.empty(len(spec.outputs[r]) * count, dtype=torch.bfloat16, device=f"cuda:{d}")
            if len(spec.outputs[r]) else None for r, d in enumerate(devices)]
    for o in outs:
        if o is not None:
            poison(o)
    issue(lambda: coll(xs, outs, streams=streams), devices, streams)
    want = expected(spec, inputs, count, dtype, "sum" if spec.is_reduce else None)
    ok = all(o is None or np.array_equal(to_numpy(o, dtype).view(np.uint16), w.view(np.uint16))
             for o, w in zip(outs, want))
    return xs, outs, ok


def capture(coll, xs, outs, devices, calls: int, streams=None) -> list:
    """One CUDA graph per rank of ``calls`` calls (captured on the rank's stream, or a fresh
    one), replayed once untimed."""
    graphs = []
    for r, d in enumerate(devices):
        with torch.cuda.device(d):
            stream = streams[r] if streams is not None else torch.cuda.Stream(device=d)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(calls):
                    coll[r](xs[r], outs[r])
            graphs.append(graph)
    issue(lambda: _replay(graphs, devices, streams), devices, streams)
    return graphs


def _replay(graphs, devices, streams, events=None, replays: int = 1) -> None:
    """Every rank's graph ``replays`` times on its device (on its stream, with ``streams``),
    between the rank's (start, end) events when given."""
    for r, (d, graph) in enumerate(zip(devices, graphs)):
        stream = streams[r] if streams is not None else torch.cuda.current_stream(d)
        with torch.cuda.device(d), torch.cuda.stream(stream):
            if events is not None:
                events[r][0].record()
            for _ in range(replays):
                graph.replay()
            if events is not None:
                events[r][1].record()


def replay_us(graphs, devices, calls: int, streams=None, replays: int = 1) -> float:
    """``replays`` replays of every rank's graph back to back: the slowest rank's time per
    call, in us."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in devices]
    issue(lambda: _replay(graphs, devices, streams, events, replays), devices, streams)
    return max(s.elapsed_time(e) for s, e in events) * 1e3 / (calls * replays)


def spread(times: list[float]) -> dict:
    """A row's timing fields: the median and the range of the per-call times, in us."""
    return {"median_us": round(statistics.median(times), 3), "min_us": round(min(times), 3),
            "max_us": round(max(times), 3)}


def write_results(out: str | Path, stem: str, meta: dict, rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """``<stem>.json`` (meta and rows) and ``<stem>.md`` (one table row per row) into ``out``.
    ``columns``: (header, row key) in table order; the key ``range`` stands for min-max."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # strict JSON: a NaN or infinite number (a failed timing, a NaN error) is written as null
    (out / f"{stem}.json").write_text(json.dumps(finite_only({"meta": meta, "rows": rows}), allow_nan=False))

    def cell(row, key):
        return f"{row['min_us']}-{row['max_us']}" if key == "range" else f"{row[key]}"

    lines = ["| " + " | ".join(header for header, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row, key) for _, key in columns) + " |" for row in rows]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
