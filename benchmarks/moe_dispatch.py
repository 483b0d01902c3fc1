"""Expert-parallel dispatch and combine (purlinc.moe) timed in per-rank CUDA graphs.

    python3 benchmarks/moe_dispatch.py --out DIR [--devices 0,0] [--tokens 4096] [--hidden 7168]
        [--top-k 8] [--local-experts 8] [--channels 16,32] [--reps 5]

``--devices 0,0`` (default) is a loopback group: both ranks on cuda:0, a stream each; the
numbers then say how the kernels use one GPU, not NVLink.  ``--devices 0,1`` runs one rank per
GPU of a two-GPU machine (one process, peer access): the issue's target, dispatch and combine of
4096 tokens x 7168 bf16, top-8 over 8 local experts per rank, at >= 85% of the link, and one
token in <= 10 us.  Each point: the step is checked first (combine(experts(dispatch(x))) on fresh
random routings against the same sum computed directly on the token's rank), then dispatch and
combine are captured in separate graphs per rank and replayed ``--replays`` times per repeat;
per call: the slowest rank's device time, median / min / max over ``--reps`` repeats.
Bandwidth: the bytes of the rows that leave each rank (rows sent to other ranks x row bytes),
the slowest rank's, over the time.  Writes DIR/moe_dispatch.json and .md.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))  # _common: the GPU tests' helpers (via _graph_timing)

from benchlib import argtypes, needs  # noqa: E402  (no torch: the arguments are checked without it)
from benchlib.sizes import valid_time  # noqa: E402

try:  # the measuring half; main() says in one line what is missing (torch, a GPU) before using it
    import torch  # noqa: E402

    import purlinc  # noqa: E402
    from purlinc import moe  # noqa: E402
    from _graph_timing import replay_us, spread, write_results  # noqa: E402
except ImportError as error:
    _IMPORT_ERROR: ImportError | None = error
else:
    _IMPORT_ERROR = None


def routings(R, T, H, E, k, devices, seed):
    out = []
    for r, d in enumerate(devices):
        g = torch.Generator().manual_seed(seed * 100 + r)
        x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(f"cuda:{d}")
        ids = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k].to(f"cuda:{d}")
        w = torch.rand(T, k, generator=g).to(f"cuda:{d}")
        out.append((x, ids, w))
    return out


def scale(e, rows):
    return rows * ((e % 4) + 1)


def step(d, x, ids, w):
    got = d.dispatch(x, ids, w)
    return d.combine(moe.expert_weighted_sum(got, scale, d.local_experts))


def on_streams(devices, streams, fns):
    for d, s in zip(devices, streams):
        s.wait_stream(torch.cuda.current_stream(d))
    results = []
    for d, s, fn in zip(devices, streams, fns):
        with torch.cuda.device(d), torch.cuda.stream(s):
            results.append(fn())
    for d in set(devices):
        torch.cuda.synchronize(d)
    return results


def check(disps, devices, streams, T, H, E, k) -> float:
    """The largest relative error of the step against the direct sum (bf16 rounding only)."""
    L = disps[0].local_experts
    inputs = routings(len(devices), T, H, E, k, devices, seed=7)
    ys = on_streams(devices, streams, [lambda r=r: step(disps[r], *inputs[r]) for r in range(len(devices))])
    worst = 0.0
    for (x, ids, w), y in zip(inputs, ys):
        factor = ((ids % L) % 4 + 1).to(torch.float32) * w
        want = (factor.sum(1, keepdim=True) * x.to(torch.float32))
        err = ((y.to(torch.float32) - want).abs().max() / want.abs().max().clamp(min=1e-6)).item()
        worst = err if math.isnan(err) or err > worst else worst  # max() would drop a NaN: keep it
    return worst


def time_phase(disps, devices, streams, phase, args) -> list[float]:
    R = len(devices)
    inputs = routings(R, args.tokens, args.hidden, args.local_experts * R, args.top_k, devices, seed=11)
    got = on_streams(devices, streams, [lambda r=r: disps[r].dispatch(*inputs[r]) for r in range(R)])
    partial = [moe.expert_weighted_sum(g, scale, d.local_experts) for g, d in zip(got, disps)]
    graphs = []
    for r, d in enumerate(devices):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.device(d), torch.cuda.graph(g, stream=streams[r]):
            if phase == "dispatch":
                disps[r].dispatch(*inputs[r])
            else:
                disps[r].combine(partial[r])
        graphs.append(g)
    return [replay_us(graphs, devices, 1, streams, args.replays) for _ in range(args.reps)]


def sent_bytes(disps) -> int:
    """Bytes leaving the busiest rank in the last dispatch (rows to other ranks x row bytes)."""
    most = 0
    for r, d in enumerate(disps):
        counts = d.counts.tolist()
        most = max(most, (sum(counts) - counts[r]) * d.width * d.send.element_size())
    return most


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=argtypes.output_dir, required=True)
    parser.add_argument("--devices", type=argtypes.device_list, default="0,0",
                        help="rank r's CUDA device, comma-separated (0,0: both ranks on cuda:0)")
    parser.add_argument("--tokens", type=argtypes.positive_int, default=4096)
    parser.add_argument("--hidden", type=argtypes.positive_int, default=7168)
    parser.add_argument("--top-k", type=argtypes.positive_int, default=8)
    parser.add_argument("--local-experts", type=argtypes.positive_int, default=8)
    parser.add_argument("--channels", type=argtypes.positive_int_list, default="16,32")
    parser.add_argument("--reps", type=argtypes.positive_int, default=5)
    parser.add_argument("--replays", type=argtypes.positive_int, default=10)
    args = parser.parse_args(argv)
    experts = args.local_experts * len(args.devices)
    if args.top_k > experts:  # each token picks top_k distinct experts
        parser.error(f"--top-k {args.top_k} is more than the {experts} experts "
                     f"({args.local_experts} local x {len(args.devices)} ranks)")
    return args


def timing_row(row: dict, nbytes: float) -> dict:
    """``row`` with its bandwidth; a median that is not a finite positive time makes it an
    error row (no bandwidth): a NaN or zero time is no measurement."""
    if not valid_time(row.get("median_us")):
        return {**row, "GBps": None, "error": f"bad timing: median {row.get('median_us')!r} us is not a finite "
                                              "positive number"}
    return {**row, "GBps": round(nbytes / (row["median_us"] * 1e3), 1)}


def main(argv=None) -> int:
    args = parse_args(argv)
    devices = args.devices
    # before the first CUDA call: one line, exit 2, where torch or the GPUs are missing
    needs.require("moe_dispatch.py", "python benchmarks/moe_dispatch.py --out DIR [--devices 0,0]",
                  torchrun=False, devices=max(devices) + 1)
    if _IMPORT_ERROR is not None:  # torch is there, so this is something else: show it whole
        raise _IMPORT_ERROR
    R = len(devices)
    group = purlinc.LocalGroup(devices, share_devices=len(set(devices)) < R)
    streams = [torch.cuda.Stream(device=d) for d in devices]
    rows, meta = [], {"devices": devices, "tokens": args.tokens, "hidden": args.hidden, "top_k": args.top_k,
                      "local_experts": args.local_experts, "gpu": torch.cuda.get_device_name(devices[0]),
                      "torch": torch.__version__}
    for channels in args.channels:
        for tokens in (args.tokens, 1):
            disps = moe.dispatchers(group, num_experts=args.local_experts * R, hidden=args.hidden,
                                    top_k=args.top_k, max_tokens=tokens, channels=channels, expert=scale)
            error = check(disps, devices, streams, tokens, args.hidden, args.local_experts * R, args.top_k)
            for phase in ("dispatch", "combine"):
                args_t = argparse.Namespace(**{**vars(args), "tokens": tokens})
                times = time_phase(disps, devices, streams, phase, args_t)
                nbytes = sent_bytes(disps) * (1 if phase == "dispatch" else args.hidden / disps[0].width)
                row = timing_row({"phase": phase, "channels": channels, "tokens": tokens,
                                  "max_rel_error": round(error, 5), "bytes_sent": int(nbytes), **spread(times)},
                                 nbytes)
                rows.append(row)
                print(row, flush=True)
            for d in disps:
                d.coll.close()
    group.close()
    write_results(args.out, "moe_dispatch", meta, rows,
                  [("phase", "phase"), ("channels", "channels"), ("tokens", "tokens"), ("median us", "median_us"),
                   ("range", "range"), ("GB/s sent", "GBps"), ("max rel. error", "max_rel_error")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
