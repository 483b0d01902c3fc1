"""The kernels the sanitizer runs (scripts/sanitize.sh): every example x algorithm x atom at
R=2, plus the LL (packed) and pipelined (slices, channels) paths, each called on fresh random
data and checked against the reference evaluator, outputs poisoned first.

    python3 tests/gpu/sanitize_cases.py --local --out DIR [--budget S]        # one process, two GPUs
    torchrun --nproc_per_node=2 --no-python compute-sanitizer ... python3 tests/gpu/sanitize_cases.py --out DIR
    python3 tests/gpu/sanitize_cases.py --list                               # the cases, no GPU needed

Registered buffers are not a runtime path (``load`` never registers the caller's buffers),
so they are compiled and verified by the CPU suite only; the list says so.

Writes DIR/cases_<tag>_rank<r>.json (updated after every case, so a run cut short by its
time limit still says what ran): per case "ok", "wrong: ...", "error: ..." or "n/a: ...".
The budget stops starting new cases after S seconds (recorded as "not run: budget").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import ALGORITHMS, EXAMPLES, examples  # noqa: E402

COUNT = 1000  # elements per chunk: small (sanitizers are slow), not a multiple of 16 bytes' worth of bf16 pieces


def cases() -> list[dict]:
    """Round-robin over the examples, so a run cut short still covers every collective."""
    rows = []
    names = examples()
    for atom in ("ldst", "tma"):
        for algorithm in ALGORITHMS:
            for name in names:
                rows.append({"example": name, "algorithm": algorithm, "atom": atom, "options": {}})
    for name in names:
        rows.append({"example": name, "algorithm": "direct-push", "atom": "ldst", "options": {"packed": True},
                     "path": "LL"})
    for name in ("allreduce.pln", "allgather.pln", "reduce_scatter.pln"):
        for algorithm in ("direct-push", "ring"):
            rows.append({"example": name, "algorithm": algorithm, "atom": "ldst",
                         "options": {"slices": 2, "channels": 2}, "path": "pipelined"})
    rows.append({"example": "allreduce.pln", "algorithm": "direct-push", "atom": "ldst", "options": {},
                 "path": "registered", "skip": "n/a: the runtime never registers caller buffers (CPU suite only)"})
    # Last: the ce atom launches no kernels (copies and stream memory operations only), so
    # only memcheck has anything to look at there.
    for algorithm in ALGORITHMS:
        for name in names:
            rows.append({"example": name, "algorithm": algorithm, "atom": "ce", "options": {}})
    return rows


def _compile(case):
    from purlinc.dtypes import DType, ReduceOp
    from purlinc.errors import PurlinError
    from purlinc.runtime.collective import prepare

    if "skip" in case or case["atom"] == "ce":
        return "skip"
    try:
        c = prepare(EXAMPLES / case["example"], 2, algorithm=case["algorithm"], atom=case["atom"], arch="sm_90",
                    **case["options"])
    except PurlinError:
        return "n/a"
    c.kernel(DType.FLOAT32, ReduceOp.SUM if c.spec.is_reduce else None)
    return "ok"


def precompile() -> None:
    """Fill the compile cache before the sanitizer runs (NVRTC is slow, and not what is checked)."""
    import multiprocessing as mp

    with mp.get_context("fork").Pool(min(16, os.cpu_count() or 1)) as pool:
        outcomes = pool.map(_compile, cases(), chunksize=1)
    print(json.dumps({k: outcomes.count(k) for k in sorted(set(outcomes))}))


def label(case: dict) -> str:
    extra = "".join(f",{k}={v}" for k, v in sorted(case["options"].items()))
    return f"{case['example']}/{case['algorithm']}/{case['atom']}{extra}"


def run_case(case, comm, local: bool, rank: int, rng):
    """One call on fresh data, checked on every rank this process drives."""
    import numpy as np
    import torch

    import purlinc
    from _common import expected, inputs_for, poison, to_numpy, to_torch
    from purlinc.dtypes import DType
    from purlinc.errors import PurlinError

    if "skip" in case:
        return case["skip"]
    try:
        coll = purlinc.load(EXAMPLES / case["example"], comm, algorithm=case["algorithm"], atom=case["atom"],
                            **case["options"])
    except PurlinError as error:
        return "n/a: " + str(error).splitlines()[0]
    try:
        spec = (coll[0] if local else coll).compiled.spec
        dtype = DType.FLOAT32
        inputs = inputs_for(spec, COUNT, dtype, rng)  # the same on every rank: the rng is seeded alike
        mine = range(spec.world_size) if local else [rank]
        xs = {r: to_torch(inputs[r], dtype, r) if len(spec.inputs[r]) else None for r in mine}
        outs = {r: torch.empty(len(spec.outputs[r]) * COUNT, device=f"cuda:{r}") if len(spec.outputs[r]) else None
                for r in mine}
        for out in outs.values():
            if out is not None:
                poison(out)
        if local:
            coll([xs[r] for r in mine], [outs[r] for r in mine])
        else:
            coll(xs[rank], outs[rank], count=COUNT if xs[rank] is None and outs[rank] is None else None)
        for r in mine:
            torch.cuda.synchronize(r)
        coll.check()
        want = expected(spec, inputs, COUNT, dtype, "sum")
        for r in mine:
            if outs[r] is not None and not np.array_equal(to_numpy(outs[r], dtype), want[r]):
                return f"wrong: rank {r} differs from the reference"
        return "ok"
    finally:
        coll.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local", action="store_true", help="one process drives both GPUs (LocalGroup)")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--tag", default="run")
    parser.add_argument("--budget", type=float, default=1e9, help="seconds after which no new case starts")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--precompile", action="store_true")
    args = parser.parse_args()
    if args.precompile:
        precompile()
        return 0
    if args.list:
        for case in cases():
            print(label(case), case.get("path", ""), case.get("skip", ""))
        return 0

    import numpy as np
    import torch

    import purlinc
    from purlinc.runtime.errors import PurlinTimeoutError

    start = time.monotonic()
    if args.local:
        comm, rank = purlinc.LocalGroup([0, 1]), 0
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        torch.cuda.set_device(rank)
        comm = purlinc.Communicator.from_torch()
    rng = np.random.default_rng(2026)
    results, stopped = [], None
    path = args.out / f"cases_{args.tag}_rank{rank}.json"
    for case in cases():
        if stopped is None and time.monotonic() - start > args.budget:
            stopped = "not run: budget"
        if stopped is not None:
            outcome = stopped
        else:
            began = time.monotonic()
            try:
                outcome = run_case(case, comm, args.local, rank, rng)
            except PurlinTimeoutError as error:  # the communicator refuses from here on
                outcome = "error: PurlinTimeoutError: " + str(error).splitlines()[0]
                stopped = "not run: an earlier case timed out"
            except Exception as error:  # noqa: BLE001 - recorded, the summary counts it
                outcome = f"error: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            case = {**case, "seconds": round(time.monotonic() - began, 2)}
        results.append({**case, "label": label(case), "outcome": outcome})
        path.write_text(json.dumps({"tag": args.tag, "rank": rank, "local": args.local, "results": results}, indent=1))
        print(f"{label(case)} {case.get('path', '')}: {outcome}", flush=True)
    counts: dict[str, int] = {}
    for row in results:
        key = row["outcome"].split(":")[0]
        counts[key] = counts.get(key, 0) + 1
    print(json.dumps({"rank": rank, "counts": counts, "seconds": round(time.monotonic() - start, 1)}), flush=True)
    bad = counts.get("wrong", 0) + counts.get("error", 0)
    if not args.local:
        import torch.distributed as dist

        if bad == 0:
            dist.barrier()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
