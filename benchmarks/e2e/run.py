#!/usr/bin/env python3
"""End-to-end: the decode step of a Llama-3-8B-class model under tensor parallelism, the whole
step one CUDA graph, with each communication system; per-step time, the time communication
adds over a step without it, and whether every system's final hidden states agree.

    torchrun --nproc_per_node=2 benchmarks/e2e/run.py [--batches 1,16,128] [--layers 2] [--out DIR]
    python benchmarks/e2e/run.py --loopback 2 [...]      # every rank on cuda:0: Purlin only

Under torchrun, ``nccl-nomix`` and ``nccl-symm`` run in a child process group started by every
rank with NCCL_GRAPH_MIXING_SUPPORT=0 (NCCL reads it once per process), whose rows rank 0
merges.  In loopback there is one process and one GPU: NCCL and torch symmetric memory cannot
run ranks that share a GPU, so their rows are absent, and the times say nothing about links.
See benchmarks/e2e/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (str(HERE.parent), str(HERE.parents[1])):  # benchmarks/ (the e2e package), the repository
    if p not in sys.path:
        sys.path.insert(0, p)

from benchlib import argtypes, needs  # noqa: E402  (no torch: parsing and the checks run without it)

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}  # never multicast
SYSTEMS = ("none", "reference", "nccl", "nccl-nomix", "nccl-symm", "symm-one-shot", "symm-two-shot",
           "purlin", "purlin-heap", "purlin-fused")
LOOPBACK_SYSTEMS = ("none", "reference", "purlin", "purlin-heap", "purlin-fused")
CHILD_SYSTEMS = ("nccl-nomix", "nccl-symm")  # NCCL_GRAPH_MIXING_SUPPORT=0: a process of their own


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loopback", type=argtypes.positive_int, default=0, metavar="R",
                    help="R ranks on cuda:0 in one process")
    ap.add_argument("--batches", type=argtypes.positive_int_list, default="1,16,128",
                    help="comma-separated batch sizes (tokens per decode step)")
    ap.add_argument("--layers", type=argtypes.positive_int, default=2)
    ap.add_argument("--kv-len", type=argtypes.positive_int, default=1024, help="tokens in every KV cache (fixed)")
    ap.add_argument("--systems", default=None, help=f"comma-separated subset of {','.join(SYSTEMS)}")
    ap.add_argument("--replays", type=argtypes.positive_int, default=20, help="graph replays per timed repeat")
    ap.add_argument("--reps", type=argtypes.positive_int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results-dir", type=argtypes.output_dir, default=HERE.parent / "results")
    ap.add_argument("--out", type=argtypes.output_dir, default=None, help="also copy the files here")
    ap.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)  # internal: the NCCL child
    args = ap.parse_args(argv)
    args.batch_list = list(args.batches)  # positive integers (argtypes.positive_int_list)
    try:
        wanted = _systems(args.systems, LOOPBACK_SYSTEMS if args.loopback else SYSTEMS)
    except ValueError as error:
        ap.error(str(error))
    # the no-communication step is every comm_us's baseline; the reference every check's
    args.system_list = ["none", "reference"] + [s for s in wanted if s not in ("none", "reference")]
    try:
        _check_world(args)
    except ValueError as error:
        ap.error(str(error))
    return args


def _check_world(args) -> None:
    """The model's heads, KV heads and MLP blocks must split over the ranks (--loopback R, or
    torchrun's WORLD_SIZE where set): ValueError with the model's own message, before any GPU
    work.  Without torch the model cannot be imported; the run then stops at needs.require."""
    world = args.loopback
    if not world:
        text = os.environ.get("WORLD_SIZE", "")
        world = int(text) if text.isascii() and text.isdigit() and int(text) > 0 else 0
    if not world:
        return
    try:
        config = config_of(args)
    except ImportError:
        return
    config.shard(world)


def _systems(text: str | None, allowed: tuple[str, ...]) -> list[str]:
    """--systems (None: every system this launcher runs); ValueError for unknown names, an
    empty list, or systems that need a process per GPU asked for in loopback."""
    if text is None:
        return list(allowed)
    try:
        wanted = argtypes.names(text, SYSTEMS, "systems")
    except ValueError as error:
        raise ValueError(f"--systems: {error}") from None
    elsewhere = [s for s in wanted if s not in allowed]
    if elsewhere:
        raise ValueError(f"{', '.join(elsewhere)} needs one process per GPU (torchrun); loopback runs "
                         f"{', '.join(allowed)}")
    return wanted


def config_of(args):
    from e2e import model

    return model.Config(layers=args.layers, kv_len=args.kv_len)


def write(args, rows: list[dict], meta: dict) -> int:
    from e2e import results

    results.add_comm_time(rows)
    stem = f"{meta['date']}-e2e-{'loopback-' if meta['loopback'] else ''}r{meta['world_size']}"
    paths = results.write(rows, meta, args.results_dir, stem)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        for p in paths.values():
            (args.out / p.name).write_bytes(p.read_bytes())
    print(results.markdown(rows, meta))
    print("wrote: " + ", ".join(str(p) for p in paths.values()))
    missing = results.unchecked_batches(rows)
    if missing:
        print(f"e2e: NOT CHECKED: no reference at batch {', '.join(map(str, missing))}", file=sys.stderr)
    return 1 if missing or any(r.get("agrees") is False for r in rows) else 0


def meta_of(args, world: int, loopback: bool) -> dict:
    import torch

    return {"date": datetime.date.today().isoformat(), "world_size": world, "loopback": loopback,
            "layers": args.layers, "kv_len": args.kv_len, "batches": args.batch_list, "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())) if not loopback else None,
            "replays": args.replays, "reps": args.reps,
            "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "PURLIN_", "TORCH_SYMM"))}}


def main(argv=None) -> int:
    args = parse_args(argv)
    for k, v in SAFE_ENV.items():
        os.environ[k] = v
    # before the first CUDA call: one line, exit 2, where torch, the GPU or torchrun is missing
    if args.loopback:
        needs.require("e2e/run.py", "python benchmarks/e2e/run.py --loopback R", torchrun=False)
    else:
        needs.require("e2e/run.py", "torchrun --nproc_per_node=2 benchmarks/e2e/run.py, or --loopback R on one GPU",
                      torchrun=True)
    if args.loopback:
        from e2e import loopback

        rows = loopback.run(args, config_of(args))
        return write(args, rows, meta_of(args, args.loopback, True))
    from e2e import torchrun

    rows, world, rank = torchrun.run(args, config_of(args))
    if args.child_out is not None:  # the NCCL child: the parent writes
        if rank == 0:
            from e2e import results

            args.child_out.write_text(results.strict_json(rows))
        return 0
    if rank != 0:
        return 0
    return write(args, rows, meta_of(args, world, False))


def child_command(args, systems: list[str], out: Path) -> list[str]:
    """The command every rank runs for the NCCL child (the same options, only ``systems``)."""
    return [sys.executable, str(Path(__file__).resolve()), "--batches", ",".join(map(str, args.batch_list)),
            "--layers", str(args.layers),
            "--kv-len", str(args.kv_len), "--systems", ",".join(["reference", *systems]),
            "--replays", str(args.replays), "--reps", str(args.reps), "--seed", str(args.seed),
            "--child-out", str(out)]


def run_child(args, rank: int, world: int, systems: list[str], exchange) -> list[dict]:
    """Start the NCCL child group (every rank), wait, and return its rows (rank 0)."""
    info = None
    if rank == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        info = {"port": port, "out": str(Path(tempfile.mkdtemp(prefix="e2e-nccl-")) / "child.json")}
    info = exchange(info)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env.update(NCCL_GRAPH_MIXING_SUPPORT="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(info["port"]),
               RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=os.environ.get("LOCAL_RANK", str(rank)),
               LOCAL_WORLD_SIZE=os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    try:
        subprocess.run(child_command(args, systems, Path(info["out"])), env=env, timeout=900, check=False)
    except subprocess.TimeoutExpired:
        pass
    if rank != 0:
        return []
    try:
        rows = _child_rows(Path(info["out"]))
    except (OSError, ValueError) as error:
        return [{"system": s, "batch": b, "world_size": world, "step_us": None, "agrees": None,
                 "error": f"the NCCL child wrote no results ({type(error).__name__}: {str(error)[:200]})"}
                for s in systems for b in args.batch_list]
    return [r for r in rows if r["system"] in systems]


def _child_rows(path: Path) -> list[dict]:
    """The NCCL child's rows: a JSON list of row objects with a system and a batch; ValueError otherwise."""
    rows = json.loads(path.read_text())
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "system" in r and "batch" in r for r in rows):
        raise ValueError(f"{path}: expected a JSON list of rows, each with a system and a batch")
    return rows


if __name__ == "__main__":
    sys.exit(main())
