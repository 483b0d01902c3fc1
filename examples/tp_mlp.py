"""A tensor-parallel MLP block (Megatron style) with Purlin's all-reduce, beside NCCL's.

    torchrun --nproc_per_node=2 examples/tp_mlp.py --out /tmp/out

Each rank holds a column slice of W1 (hidden -> ffn / R) and a row slice of W2 (ffn / R ->
hidden); a step is ``y = all_reduce(silu(x @ W1) @ W2)``: two matmuls and one all-reduce of
``tokens x hidden`` elements.  The same block runs with ``purlinc.torch.functional.all_reduce``
and with NCCL (``torch.distributed._functional_collectives.all_reduce``, the traceable form),
eagerly, under ``torch.compile(fullgraph=True)`` and under ``mode="reduce-overhead"`` (CUDA
graphs).  Every mode's output is checked against NCCL's on the same inputs; the Purlin graph
must have no graph break.  Times are per step (CUDA events, median of repeats, slowest rank).
Rank 0 writes ``tp_mlp.json`` (and prints a Markdown table); the exit status is 1 if a check
failed: an output (Purlin's or NCCL's, any rank) that is not finite, ranks whose all-reduce
outputs differ (the sum is replicated: every rank must hold the same bits), Purlin more than
``TOLERANCE`` from NCCL, a graph break, or a time that is not a finite positive number.  Without
torch, torchrun or CUDA GPUs it says so in one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("eager", "compile", "reduce-overhead")
TOLERANCE = 1e-2  # largest |Purlin - NCCL| accepted (bf16: partial sums rounded in another order)
CHECKS = 3  # fresh activations per mode the outputs are compared on
USAGE = "torchrun --nproc_per_node=2 examples/tp_mlp.py"
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

# Imported by main() once the machine is checked (needs()): the checks below and --help run
# without torch.
torch = dist = funcol = purlinc = pt = None


# --------------------------------------------------------------------------- what the run needs


def _count(name: str) -> int | None:
    text = os.environ.get(name, "")
    return int(text) if text.isascii() and text.isdigit() else None


def needs() -> str | None:
    """What this process lacks to run (None: nothing): torch with NCCL, torchrun's
    environment, and a CUDA GPU for LOCAL_RANK.  Looks only; no CUDA call beyond counting."""
    try:
        import torch as _torch
        import torch.distributed as _dist
    except ImportError:
        return "torch is not installed in this Python"
    unset = [v for v in TORCHRUN_VARIABLES if v not in os.environ]
    if unset:
        return f"not started by torchrun ({', '.join(unset)} not set)"
    local, world = _count("LOCAL_RANK"), _count("WORLD_SIZE")
    if local is None or not world:
        return f"LOCAL_RANK {os.environ['LOCAL_RANK']!r} / WORLD_SIZE {os.environ['WORLD_SIZE']!r} are not rank counts"
    if not (_dist.is_available() and _dist.is_nccl_available()):
        return f"torch {_torch.__version__} has no NCCL (a CPU-only build?)"
    if not _torch.cuda.is_available():
        return "no CUDA GPU is visible" + ("" if _torch.version.cuda else f" (torch {_torch.__version__} is built without CUDA)")
    if _torch.cuda.device_count() <= local:
        return f"LOCAL_RANK {local} needs cuda:{local}, {_torch.cuda.device_count()} GPUs visible"
    return None


def _import_torch() -> None:
    global torch, dist, funcol, purlinc, pt
    # Ranks compile their graphs (inductor) at slightly different times, and a Purlin kernel on the
    # faster rank waits on the device for the slower one: give that wait room (before purlinc loads).
    os.environ.setdefault("PURLIN_WAIT_TIMEOUT_S", "120")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import torch as _torch
    import torch.distributed as _dist
    import torch.distributed._functional_collectives as _funcol

    import purlinc as _purlinc
    import purlinc.torch as _pt

    torch, dist, funcol, purlinc, pt = _torch, _dist, _funcol, _purlinc, _pt


# --------------------------------------------------------------------------- checks (no GPU)


def _nan_max(values) -> float:
    """The largest of ``values``, NaN if any is NaN (max() keeps or drops a NaN by its position)."""
    values = [float(v) for v in values]
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def compare(a, b) -> dict:
    """One check on one rank: Purlin's output ``a`` against NCCL's ``b`` (same inputs)."""
    fa, fb = a.float(), b.float()
    bad_a, bad_b = int((~fa.isfinite()).sum()), int((~fb.isfinite()).sum())
    diff = math.nan if bad_a or bad_b else float((fa - fb).abs().max()) if fa.numel() else 0.0
    return {"equal": bool(torch.equal(a, b)), "nonfinite": {"purlin": bad_a, "nccl": bad_b}, "max_abs_diff": diff,
            "fingerprint": {"purlin": fingerprint(a), "nccl": fingerprint(b)}}


def fingerprint(t) -> str:
    """The exact bits of ``t`` (dtype, shape and bytes) as a short hash: ranks compare these."""
    raw = t.detach().contiguous().cpu().flatten().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + raw).hexdigest()[:16]


def merge_checks(per_rank: list[list[dict]]) -> dict:
    """Every rank's checks (``per_rank[r]``: that rank's ``compare`` results, one per check)
    -> the row's check fields.  ``ranks_agree``: each system's output bitwise the same on every
    rank, check by check (an all-reduce replicates the sum)."""
    checks = [c for rank in per_rank for c in rank]
    out = {"outputs_equal_all_ranks": all(c["equal"] for c in checks),
           "max_abs_diff": _nan_max(c["max_abs_diff"] for c in checks) if checks else math.nan,
           "nonfinite": {s: sum(c["nonfinite"][s] for c in checks) for s in ("purlin", "nccl")},
           "ranks_agree": {}}
    for system in ("purlin", "nccl"):
        seen = [[c["fingerprint"][system] for c in rank] for rank in per_rank]
        out["ranks_agree"][system] = all(s == seen[0] for s in seen)
    return out


def _time(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def problems(row: dict) -> list[str]:
    """Why ``row`` fails (empty: it passed).  A NaN anywhere fails: it is never 'within
    tolerance', and a time that is not a finite positive number is no time."""
    if "error" in row:
        return [row["error"]]
    out = []
    for system, n in row["nonfinite"].items():
        if n:
            out.append(f"{n} non-finite values in {system}'s outputs")
    for system, agree in row["ranks_agree"].items():
        if not agree:
            out.append(f"{system}'s all-reduce outputs differ between ranks")
    diff = row["max_abs_diff"]
    if not any(row["nonfinite"].values()) and not (isinstance(diff, float) and diff <= TOLERANCE):
        out.append(f"max |Purlin - NCCL| {_show(diff)} is not within {TOLERANCE}")
    if (row.get("graph_breaks") or 0) != 0:
        out.append(f"{row['graph_breaks']} graph breaks")
    for key in ("purlin_us", "nccl_us"):
        if not _time(row.get(key)):
            out.append(f"{key} {_show(row.get(key))} is not a finite positive time")
    return out


def _show(x, digits: int = 2) -> str:
    """A number as printed: NaN and infinities spelled out, never hidden behind a default."""
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def strict(value):
    """``value`` with NaN and infinities as None: tp_mlp.json is strict JSON (the row's
    ``problems`` say what was not finite)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def table(rows: list[dict]) -> list[str]:
    """The Markdown table rank 0 prints: every number as measured (NaN shows as NaN)."""
    out = ["| tokens | mode | all-reduce bytes | Purlin us/step | NCCL us/step | speedup | max abs diff | "
           "equal | ranks agree | graph breaks | check |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['tokens']} | {r['mode']} | error: {r['error'][:200]} |")
            continue
        bad = ", ".join(f"{s} {n} non-finite" for s, n in r["nonfinite"].items() if n)
        agree = "yes" if all(r["ranks_agree"].values()) else \
            "NO (" + ", ".join(s for s, a in r["ranks_agree"].items() if not a) + ")"
        why = problems(r)
        out.append(f"| {r['tokens']} | {r['mode']} | {r['allreduce_bytes']} | {_show(r['purlin_us'])} | "
                   f"{_show(r['nccl_us'])} | {'-' if r['speedup'] is None else _show(r['speedup'], 3) + 'x'} | "
                   f"{_show(r['max_abs_diff'], 4)}"
                   f"{f' ({bad})' if bad else ''} | {r['outputs_equal_all_ranks']} | {agree} | "
                   f"{_show(r['graph_breaks'])} | {'FAIL: ' + '; '.join(why) if why else 'ok'} |")
    return out


def finish_row(row: dict, times: list[tuple]) -> dict:
    """The row from every rank's (purlin_us, nccl_us, checks): the slowest rank's times (NaN if
    any rank's is), the merged checks, the speed-up where both times are real, the problems."""
    row = {**row, "purlin_us": _nan_max(t[0] for t in times), "nccl_us": _nan_max(t[1] for t in times),
           **merge_checks([t[2] for t in times])}
    row["purlin_us"], row["nccl_us"] = (round(x, 2) if math.isfinite(x) else x for x in (row["purlin_us"], row["nccl_us"]))
    both = _time(row["purlin_us"]) and _time(row["nccl_us"])
    row["speedup"] = round(row["nccl_us"] / row["purlin_us"], 3) if both else None
    row["problems"] = problems(row)
    return row


# --------------------------------------------------------------------------- the run


def block(all_reduce):
    def step(x, w1, w2):
        h = torch.nn.functional.silu(x @ w1)
        return all_reduce(h @ w2)
    return step


def timed(fn, args, steps: int, repeats: int, graphs: bool) -> float:
    """Median over ``repeats`` of the mean per-step time (us) of ``steps`` back-to-back steps."""
    samples = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            fn(*args)
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / steps)
    return statistics.median(samples)


def run_mode(mode, tokens, x, w1, w2, purlin_ar, nccl_ar, nccl_traced, args, world) -> dict:
    """One (tokens, mode) row: correctness against NCCL and across ranks, then the time per
    step of both."""
    torch._dynamo.reset()
    if mode == "eager":
        fp, fn = purlin_ar, nccl_ar
    else:
        kw = {"fullgraph": True, "mode": None if mode == "compile" else mode}
        fp, fn = torch.compile(purlin_ar, **kw), torch.compile(nccl_traced, **kw)
    graphs = mode == "reduce-overhead"
    breaks = None
    if mode == "compile":
        breaks = torch._dynamo.explain(purlin_ar)(x, w1, w2).graph_break_count
        torch._dynamo.reset()
        fp = torch.compile(purlin_ar, fullgraph=True)
    # correctness: fresh activations each time (the same on every rank), Purlin vs NCCL on the same inputs
    checks = []
    for it in range(CHECKS):
        xi = torch.randn(tokens, args.hidden, device="cuda", generator=torch.Generator(device="cuda")
                         .manual_seed(99 + it)).bfloat16()
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        a = fp(xi, w1, w2).clone()
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        b = fn(xi, w1, w2).clone()
        torch.cuda.synchronize()
        checks.append(compare(a, b))
    purlin_us = timed(fp, (x, w1, w2), args.steps, args.repeats, graphs)
    nccl_us = timed(fn, (x, w1, w2), args.steps, args.repeats, graphs)
    times = [None] * world
    dist.all_gather_object(times, (purlin_us, nccl_us, checks))
    return finish_row({"tokens": tokens, "mode": mode, "allreduce_bytes": tokens * args.hidden * 2,
                       "graph_breaks": breaks}, times)


def modes_list(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if not modes or unknown:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(MODES)}, got {text!r}")
    return modes


def positive_int(text: str) -> int:
    if not (text.strip().isascii() and text.strip().isdigit() and int(text) >= 1):
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def tokens_list(text: str) -> list[int]:
    parts = [t.strip() for t in text.split(",") if t.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}")
    return [positive_int(t) for t in parts]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="directory for tp_mlp.json")
    parser.add_argument("--hidden", type=positive_int, default=4096)
    parser.add_argument("--ffn", type=positive_int, default=14336)
    parser.add_argument("--tokens", type=tokens_list, default="8,128", help="comma-separated token counts (rows of x)")
    parser.add_argument("--steps", type=positive_int, default=50)
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument("--modes", type=modes_list, default=",".join(MODES))
    args = parser.parse_args(argv)
    missing = needs()
    if missing is not None:  # before any CUDA call: one line, exit 2
        print(f"tp_mlp.py: needs torchrun and CUDA GPUs (and torch), e.g. {USAGE}: {missing}", file=sys.stderr)
        raise SystemExit(2)
    world = _count("WORLD_SIZE")
    if args.ffn % world:
        parser.error(f"--ffn {args.ffn} must be a multiple of the world size {world}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    _import_torch()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = purlinc.Communicator.from_torch()
    group = pt.init(comm)
    dist.all_reduce(torch.ones(1, device="cuda"))

    def nccl_eager(y):
        dist.all_reduce(y)  # on the current stream, like a synchronous torch.distributed call
        return y

    purlin_ar = block(lambda y: pt.functional.all_reduce(y, group=group))
    nccl_ar = block(nccl_eager)  # eager
    nccl_traced = block(lambda y: funcol.all_reduce(y, "sum", dist.group.WORLD))  # what torch.compile takes
    gen = torch.Generator(device="cuda")
    gen.manual_seed(7 + rank)
    scale = args.hidden ** -0.5
    w1 = (torch.randn(args.hidden, args.ffn // world, device="cuda", generator=gen) * scale).bfloat16()
    w2 = (torch.randn(args.ffn // world, args.hidden, device="cuda", generator=gen) * scale).bfloat16()
    for w in (w1, w2):  # weights: static inputs, so CUDA graphs do not copy them in every replay
        torch._dynamo.mark_static_address(w)

    rows = []
    for tokens in args.tokens:
        torch.manual_seed(1234 + tokens)  # the same activations on every rank (replicated input)
        x = torch.randn(tokens, args.hidden, device="cuda").bfloat16()
        for mode in args.modes:
            try:
                rows.append(run_mode(mode, tokens, x, w1, w2, purlin_ar, nccl_ar, nccl_traced, args, world))
            except Exception as error:  # noqa: BLE001 - one mode failing is reported, the others still run
                rows.append({"tokens": tokens, "mode": mode, "error": f"{type(error).__name__}: {error}"[:500]})
    failures = [r for r in rows if problems(r)]
    comm.check()
    comm.check()
    if rank == 0:
        report = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "world_size": world, "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "NCCL_GRAPH_MIXING_SUPPORT": os.environ.get("NCCL_GRAPH_MIXING_SUPPORT", "(unset: NCCL default)"),
            "config": {"hidden": args.hidden, "ffn": args.ffn, "dtype": "bfloat16", "steps": args.steps,
                       "repeats": args.repeats, "tolerance": TOLERANCE},
            "rows": rows, "failures": len(failures),
        }
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "tp_mlp.json").write_text(json.dumps(strict(report), indent=1, allow_nan=False))
        print("\n".join(table(rows)), flush=True)
        for r in failures:
            print(f"tp_mlp.py: FAILED {r['tokens']} tokens, {r['mode']}: {'; '.join(problems(r))}", file=sys.stderr)
    group.close()
    comm.close()
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
