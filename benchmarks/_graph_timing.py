"""What benchmarks/ll_sweep.py and benchmarks/ll_probe.py share: one checked call of a
LocalGroup collective on fresh data, and its per-call time in CUDA-graph replays.

Both run in one process that drives every visible GPU (``purlinc.LocalGroup``); the reference
and the data helpers are the GPU tests' (tests/gpu/_common.py, on sys.path).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import torch

from _common import expected, inputs_for, poison, to_numpy, to_torch


def checked_call(coll, nbytes: int, dtype, rng, devices) -> tuple[list, list, bool]:
    """(inputs, outputs, whether every rank's output is bitwise the reference) of one call
    moving about ``nbytes`` per rank (the larger of input and output), outputs poisoned first."""
    spec = coll[0].compiled.spec
    units = max(max(len(spec.inputs[r]), len(spec.outputs[r])) for r in range(spec.world_size))
    count = max(1, nbytes // (units * dtype.itemsize))
    inputs = inputs_for(spec, count, dtype, rng)
    xs = [to_torch(inputs[r], dtype, r) if len(spec.inputs[r]) else None for r in devices]
    outs = [torch.empty(len(spec.outputs[r]) * count, dtype=torch.bfloat16, device=f"cuda:{r}")
            if len(spec.outputs[r]) else None for r in devices]
    for o in outs:
        if o is not None:
            poison(o)
    coll(xs, outs)
    for r in devices:
        torch.cuda.synchronize(r)
    want = expected(spec, inputs, count, dtype, "sum" if spec.is_reduce else None)
    ok = all(o is None or np.array_equal(to_numpy(o, dtype).view(np.uint16), w.view(np.uint16))
             for o, w in zip(outs, want))
    return xs, outs, ok


def capture(coll, xs, outs, devices, calls: int) -> list:
    """One CUDA graph per device of ``calls`` calls, replayed once untimed."""
    graphs = []
    for r in devices:
        with torch.cuda.device(r):
            stream = torch.cuda.Stream(device=r)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(calls):
                    coll[r](xs[r], outs[r])
            graphs.append(graph)
    for graph in graphs:
        graph.replay()
    for r in devices:
        torch.cuda.synchronize(r)
    return graphs


def replay_us(graphs, devices, calls: int) -> float:
    """One replay of every device's graph: the slowest device's time per call, in us."""
    events = []
    for r, graph in zip(devices, graphs):
        with torch.cuda.device(r):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            events.append((start, end))
    for r in devices:
        torch.cuda.synchronize(r)
    return max(s.elapsed_time(e) for s, e in events) * 1e3 / calls


def spread(times: list[float]) -> dict:
    """A row's timing fields: the median and the range of the per-call times, in us."""
    return {"median_us": round(statistics.median(times), 3), "min_us": round(min(times), 3),
            "max_us": round(max(times), 3)}


def write_results(out: str | Path, stem: str, meta: dict, rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """``<stem>.json`` (meta and rows) and ``<stem>.md`` (one table row per row) into ``out``.
    ``columns``: (header, row key) in table order; the key ``range`` stands for min-max."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}))

    def cell(row, key):
        return f"{row['min_us']}-{row['max_us']}" if key == "range" else f"{row[key]}"

    lines = ["| " + " | ".join(header for header, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row, key) for _, key in columns) + " |" for row in rows]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
