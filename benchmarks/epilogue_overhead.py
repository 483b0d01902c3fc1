"""How much the fused epilogue (residual add + RMSNorm) adds over the plain all-reduce, on one
GPU in loopback: R ranks on cuda:0 (``LocalGroup([0] * R, share_devices=True)``), [rows x 4096]
bf16, both collectives with the same schedule (algorithm, LL, channels), calls captured per
rank in CUDA graphs and replayed; every point's output checked against torch first.  The
loopback number is local work only (the "remote" stores stay in one GPU's memory): it says
what the epilogue costs in the kernel, not what NVLink does.

    python3 benchmarks/epilogue_overhead.py --ranks 2 --rows 16 [--out DIR]

Writes epilogue_overhead.json and .md to DIR (default $OUT, else the current directory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FUSED = ROOT / "examples" / "fused" / "allreduce_add_rmsnorm.pln"
PLAIN = "collective allreduce_one_chunk { in[r] = x  out[r] = x  reduce }"
HIDDEN = 4096


def _eager_us(torch, call, world, calls=200) -> float:
    streams = [torch.cuda.Stream(device=0) for _ in range(world)]
    for _ in range(5):
        call(streams)
    torch.cuda.synchronize(0)
    t = time.perf_counter()
    for _ in range(calls):
        call(streams)
    torch.cuda.synchronize(0)
    return (time.perf_counter() - t) * 1e6 / calls


def measure(world: int, rows: int, algorithm: str, packed: bool, channels: int) -> dict:
    import torch

    import purlinc

    group = purlinc.LocalGroup([0] * world, share_devices=True)
    try:
        opts = dict(algorithm=algorithm, packed=packed, channels=channels, slices=1)
        fused = purlinc.load(FUSED, group, **opts)
        plain = purlinc.load(PLAIN, group, **opts)
        n = rows * HIDDEN
        xs = [torch.randn(n, device="cuda:0").to(torch.bfloat16) for _ in range(world)]
        outs = [torch.empty(n, device="cuda:0", dtype=torch.bfloat16) for _ in range(world)]
        res = [torch.randn(n, device="cuda:0").to(torch.bfloat16) for _ in range(world)]
        weight = [torch.ones(HIDDEN, device="cuda:0", dtype=torch.bfloat16) for _ in range(world)]

        def run(coll, streams, **operands):
            current = torch.cuda.current_stream(0)
            for s in streams:
                s.wait_stream(current)
            coll(xs, outs, streams=streams, **operands)
            for s in streams:
                current.wait_stream(s)

        # correctness first: one fused call against torch
        before = res[0].clone()
        run(fused, [torch.cuda.Stream(device=0) for _ in range(world)], residual=res, weight=weight, eps=1e-6)
        torch.cuda.synchronize(0)
        h = (torch.stack([x.float() for x in xs]).sum(0).to(torch.bfloat16).float() + before.float()).view(-1, HIDDEN)
        y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16).view(-1)
        torch.testing.assert_close(outs[0].float(), y.float(), rtol=2**-6, atol=2**-5)
        # timing: the residual keeps changing from call to call; nothing reads it here
        fused_call = lambda streams: run(fused, streams, residual=res, weight=weight, eps=1e-6)  # noqa: E731
        plain_call = lambda streams: run(plain, streams)  # noqa: E731
        row = {"ranks": world, "rows": rows, "hidden": HIDDEN, "dtype": "bfloat16", "algorithm": algorithm,
               "packed": packed, "channels": channels}
        row["eager_plain_us"] = _eager_us(torch, plain_call, world)
        row["eager_fused_us"] = _eager_us(torch, fused_call, world)
        row["plain_us"] = _graph_per_rank(torch, group, plain, world, xs, outs, {})
        row["fused_us"] = _graph_per_rank(torch, group, fused, world, xs, outs,
                                          {"residual": res, "weight": weight, "eps": 1e-6})
        row["added_us"] = row["fused_us"] - row["plain_us"]
        return row
    finally:
        group.close()


def _graph_per_rank(torch, group, coll, world, xs, outs, operands, calls=50, repeats=7) -> float:
    """Per-rank graphs (each rank's calls captured on its own stream), replayed concurrently:
    the loopback group's ranks must run at once, as they wait for each other."""
    streams = [torch.cuda.Stream(device=0) for _ in range(world)]
    for _ in range(3):
        coll(xs, outs, streams=streams, **operands)
    torch.cuda.synchronize(0)
    graphs = []
    for rank in range(world):
        graph = torch.cuda.CUDAGraph()
        per_rank = {k: (v[rank] if isinstance(v, list) else v) for k, v in operands.items()}
        with torch.cuda.graph(graph, stream=streams[rank]):
            for _ in range(calls):
                coll[rank](xs[rank], outs[rank], **per_rank)
        graphs.append(graph)
    torch.cuda.synchronize(0)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        current = torch.cuda.current_stream(0)
        for s in streams:
            s.wait_stream(current)
        for rank in range(world):
            with torch.cuda.stream(streams[rank]):
                graphs[rank].replay()
        for s in streams:
            current.wait_stream(s)
        end.record()
        torch.cuda.synchronize(0)
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2])
    parser.add_argument("--rows", type=int, nargs="+", default=[16])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    rows = []
    for world in args.ranks:
        for n in args.rows:
            for algorithm, packed, channels in (("direct-push", True, 1), ("direct-push", False, 8),
                                                ("two-shot", False, 8)):
                row = measure(world, n, algorithm, packed, channels)
                print(json.dumps(row), flush=True)
                rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "mode": "loopback, one GPU"}
    (out / "epilogue_overhead.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Epilogue overhead ({meta['mode']}, {meta['date']})", "",
             "| R | rows | algorithm | LL | channels | plain us | fused us | added us | eager plain | eager fused |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['ranks']} | {r['rows']} | {r['algorithm']} | {r['packed']} | {r['channels']} | "
              f"{r['plain_us']:.2f} | {r['fused_us']:.2f} | {r['added_us']:+.2f} | {r['eager_plain_us']:.1f} | "
              f"{r['eager_fused_us']:.1f} |" for r in rows]
    (out / "epilogue_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
