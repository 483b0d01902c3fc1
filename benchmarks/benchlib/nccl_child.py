"""NCCL variants that need ``NCCL_GRAPH_MIXING_SUPPORT=0`` (read once per process) run in a
child process group; its rows are merged into the parent's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist

import report
from benchlib.cases import nccl_env
from benchlib.context import Ctx, barrier


BENCH = Path(__file__).resolve().parents[1] / "bench.py"  # the child runs the same command line

def run_nccl_child(ctx: Ctx) -> None:
    """Measure the nomix / symm NCCL variants in a child process group with
    NCCL_GRAPH_MIXING_SUPPORT=0 (read once per process by NCCL), then merge its rows."""
    wanted = [v for v in ctx.plan.nccl if v != "default"]
    if not wanted:
        return
    import socket
    import tempfile

    info = [None]
    if ctx.rank == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        info = [{"port": port, "out": str(Path(tempfile.mkdtemp(prefix="bench-nccl-")) / "child.json")}]
    dist.broadcast_object_list(info, src=0)
    port, out = info[0]["port"], Path(info[0]["out"])
    args = ctx.args
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env.update(NCCL_GRAPH_MIXING_SUPPORT="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world), LOCAL_RANK=str(ctx.local_rank),
               LOCAL_WORLD_SIZE=os.environ.get("LOCAL_WORLD_SIZE", str(ctx.world)))
    cmd = [sys.executable, str(BENCH), "--nccl-child", "--child-out", str(out),
           "--systems", "nccl", "--nccl-variants", ",".join(wanted), "--collectives", ",".join(ctx.plan.collectives),
           "--sizes", ",".join(str(b) for b in ctx.plan.sizes), "--modes", ",".join(ctx.plan.modes),
           "--calls-per-graph", ",".join(str(c) for c in ctx.plan.calls), "--reps", str(args.reps),
           "--many-calls-max-bytes", str(ctx.plan.many_calls_max_bytes),
           "--target-rep-us", str(args.target_rep_us), "--seed", str(args.seed), "--no-peak", "--no-plots",
           "--budget-s", str(max(10.0, args.child_timeout_s - 30)), "--timeout-s", str(args.child_timeout_s),
           "--pg-timeout-s", str(args.pg_timeout_s)]
    barrier(ctx)
    t = time.time()
    ctx.log(f"NCCL child ({', '.join(wanted)}; NCCL_GRAPH_MIXING_SUPPORT=0) started")
    status = "ok"
    try:
        done = subprocess.run(cmd, env=env, timeout=args.child_timeout_s + 90,
                              stdout=None if ctx.rank == 0 else subprocess.DEVNULL)
        status = f"exit {done.returncode}"
    except Exception as e:  # noqa: BLE001
        status = f"{type(e).__name__}: {e}"
    barrier(ctx)
    ctx.meta["nccl_variants"] = {"default": f"this process, env {nccl_env() or '(NCCL defaults)'}"}
    if ctx.rank == 0:
        try:
            child = report.load_results(out)  # its shape checked: a broken file is this run's error note
            for row in child.get("rows", []):
                ctx.add(row)
                if row.get("checked") is False:
                    ctx.failures.append(f"CHECK FAILED: nccl/{row.get('variant')} {row.get('collective')} "
                                        f"{report.fmt_bytes(row.get('bytes'))} {row.get('mode')}: {row.get('check_note')}")
            cmeta = child.get("meta", {})
            for v in wanted:
                ctx.meta["nccl_variants"][v] = ("child process group, NCCL_GRAPH_MIXING_SUPPORT=0"
                                                + (f"; buffers: {cmeta.get('nccl_symm')}" if v == "symm" else ""))
            ctx.meta["nccl_child"] = {"status": status, "seconds": round(time.time() - t, 1),
                                      "child_status": cmeta.get("status"), "nccl_symm": cmeta.get("nccl_symm")}
        except Exception as e:  # noqa: BLE001
            ctx.meta["nccl_child"] = {"status": status, "error": f"no child results: {type(e).__name__}: {e}"}
            for v in wanted:
                ctx.meta["nccl_variants"][v] = f"FAILED: {status}; {e}"
        shutil.rmtree(out.parent, ignore_errors=True)
    ctx.log(f"NCCL child: {status} in {time.time() - t:.0f} s")
