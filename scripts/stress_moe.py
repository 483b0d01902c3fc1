"""Repeat purlinc.moe's loopback step many times and check each exchange on its own: the rows
and counts every rank receives from dispatch, what combine brings back, and the step's result,
against what the routing says (computed on the host from every rank's inputs), not against
another exchange.  For a wrong result that shows only now and then (the GPU shared with other
work): it says which exchange and which rows went wrong.

    python3 scripts/stress_moe.py --worlds 3 4 --seconds 60 --seed 7     # exit 1 on any mismatch
    python3 scripts/stress_moe.py --worlds 4 --reference   # also tests/gpu/test_moe.py's plain exchange
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # moe_reference, rank_threads
sys.path.insert(0, str(ROOT / "tests" / "gpu"))  # _common
sys.path.insert(0, str(ROOT / "benchmarks"))  # benchlib
from benchlib import argtypes, needs  # noqa: E402  (no torch: the arguments are checked without it)

try:  # the measuring half; main() says in one line what is missing (torch, a GPU) before using it
    import torch  # noqa: E402

    from _common import each_on_own_stream  # noqa: E402
    from moe_reference import exchange_problems, loopback_reference, routing, scale_expert  # noqa: E402

    from purlinc import moe  # noqa: E402
except ImportError as error:
    _IMPORT_ERROR: ImportError | None = error
else:
    _IMPORT_ERROR = None

DEVICE = 0
H, K, T = 256, 4, 64  # hidden, top-k, tokens of rank 0 (rank r sends T - 3 r); 2 R experts
WORLDS = (K // 2, (T // 3) + 1)  # the world sizes that fit: 2 R >= K experts, T - 3 (R - 1) >= 0 tokens


def world(text: str) -> int:
    """--worlds item: a world size in WORLDS."""
    R = argtypes.positive_int(text)
    if not WORLDS[0] <= R <= WORLDS[1]:
        raise argparse.ArgumentTypeError(
            f"world size {R} is outside {WORLDS[0]}..{WORLDS[1]}: each token picks {K} distinct experts of the 2 R, "
            f"and rank r sends {T} - 3 r tokens")
    return R


def expected_rows(inputs, L, rank):
    """The rows `rank` receives from each source, in the Dispatcher's order (tokens in order,
    each once per destination rank): (token rows [n, H], local ids [n, k] with -1 elsewhere)."""
    got = []
    for x, ids, _w in inputs:
        dest = ids // L
        take = (dest == rank).any(1)
        local = torch.where(dest == rank, ids % L, torch.full_like(ids, -1))
        got.append((x[take], local[take].to(torch.int32)))
    return got


def truth(x, ids, w, L):
    """y[t] = sum_j w[t, j] * expert(ids[t, j] % L, x[t]) in float32 (exact for the small
    integers): experts are numbered on their own rank, as expert_weighted_sum calls them."""
    y = torch.zeros(x.shape, dtype=torch.float32)
    for j in range(ids.shape[1]):
        for e in ids[:, j].unique().tolist():
            sel = ids[:, j] == e
            y[sel] += w[sel, j, None] * scale_expert(e % L, x[sel].to(torch.float32))
    return y.to(x.dtype)


def check_step(disps, streams, inputs, R, E, a2a=None):
    """What went wrong in one step of every rank (empty: nothing)."""
    L = E // R
    problems = []
    gpu = [tuple(t.to(f"cuda:{DEVICE}") for t in inp) for inp in inputs]

    def step(r):  # as a model issues it: the whole step on the rank's stream, then the next rank's
        got = disps[r].dispatch(*gpu[r])
        partial = moe.expert_weighted_sum(got, scale_expert, L)
        return got, disps[r].combine(partial)
    done = each_on_own_stream(streams, DEVICE, [lambda r=r: step(r) for r in range(R)])
    for r in range(R):
        disps[r].coll.check()
        want = expected_rows(inputs, L, r)
        counts = disps[r].recv_counts.cpu().tolist()
        if counts != [len(rows) for rows, _ in want]:
            problems.append(f"dispatch rank {r}: recv_counts {counts}, expected {[len(rows) for rows, _ in want]}")
            continue
        at = 0
        tokens, ids = done[r][0].tokens.cpu(), done[r][0].expert_ids.cpu()
        for s, (rows, local) in enumerate(want):
            n = len(rows)
            bad = ((tokens[at:at + n] != rows).any(1) | (ids[at:at + n] != local).any(1)).nonzero().flatten()
            if len(bad):
                problems.append(f"dispatch rank {r} from {s}: {len(bad)} of {n} rows wrong, first {bad[:8].tolist()}")
            at += n
    ys = [y for _got, y in done]
    for r in range(R):
        disps[r].coll.check()
        x, ids, w = inputs[r]
        # what combine must bring back: from each rank s, the partials s computed for r's rows, in order
        sent = disps[r].counts.cpu().tolist()
        back = disps[r].back_counts.cpu().tolist()
        if back != sent:
            problems.append(f"combine rank {r}: back_counts {back}, expected {sent}")
        want = truth(x, ids, w, L)
        y = ys[r].cpu()
        if not torch.equal(y, want):
            bad = (y != want).any(1).nonzero().flatten()
            problems.append(f"result rank {r}: {len(bad)} of {len(y)} tokens wrong, first {bad[:8].tolist()}")
    if a2a is not None:
        record = [[] for _ in range(R)]
        results = loopback_reference(a2a, streams, R, E, inputs, DEVICE, scale_expert, record)
        problems += exchange_problems(record)
        for r in range(R):
            want, got = truth(*inputs[r], L), results[r].cpu()
            if not torch.equal(got, want):
                bad = (got != want).any(1).nonzero().flatten()
                problems.append(f"plain reference rank {r}: {len(bad)} tokens wrong, first {bad[:8].tolist()}")
    return problems


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=world, nargs="+", default=[2, 3, 4, 8],
                   help=f"ranks on cuda:0, each {WORLDS[0]}..{WORLDS[1]}")
    p.add_argument("--steps", type=argtypes.positive_int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--channels", type=argtypes.positive_int, default=2)
    p.add_argument("--seconds", type=argtypes.positive_float, default=1e9,
                   help="per world size: start no new step after this long")
    p.add_argument("--json", help="write the findings here")
    p.add_argument("--reference", action="store_true",
                   help="also run tests/gpu/test_moe.py's plain exchange (a second sized all-to-all, R threads)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    # before the first CUDA call: one line, exit 2, where torch or the GPU is missing
    needs.require("stress_moe.py", "python scripts/stress_moe.py, every rank on cuda:0", torchrun=False,
                  devices=DEVICE + 1)
    if _IMPORT_ERROR is not None:  # torch is there, so this is something else: show it whole
        raise _IMPORT_ERROR
    import purlinc

    findings, ran, began = [], 0, time.monotonic()
    for R in a.worlds:
        start = time.monotonic()
        E = 2 * R
        group = purlinc.LocalGroup([DEVICE] * R, share_devices=True)
        streams = [torch.cuda.Stream(device=DEVICE) for _ in range(R)]
        disps = moe.dispatchers(group, num_experts=E, hidden=H, top_k=K, max_tokens=T, channels=a.channels,
                                expert=scale_expert)
        a2a = None
        if a.reference:  # loaded as test_moe.py loads it
            a2a = purlinc.load(moe.SOURCE, group, capacity=T * K * H, channels=1)
            for r in range(R):
                a2a[r].warm("bfloat16")
                a2a[r].warm("int32")
        try:
            for step in range(a.steps):
                if time.monotonic() - start > a.seconds:
                    break
                skew = ("random", "one", "random", "empty")[step % 4]
                inputs = []
                for r in range(R):
                    gen = torch.Generator().manual_seed(a.seed * 100003 + step * 97 + r)
                    tokens = 0 if skew == "empty" and r == 1 else T - 3 * r
                    inputs.append(routing(gen, tokens, H, E, K, torch.bfloat16, "cpu",
                                          "one" if skew == "one" else "random"))
                problems = check_step(disps, streams, inputs, R, E, a2a)
                ran += 1
                if problems:
                    findings.append({"R": R, "step": step, "skew": skew, "problems": problems})
                    print(f"R={R} step {step} ({skew}):", *problems, sep="\n  ", flush=True)
        finally:
            if a2a is not None:
                a2a.close()
            group.close()
    print(f"{ran} steps, {len(findings)} with a mismatch, {time.monotonic() - began:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps({"steps": ran, "findings": findings}, indent=1))
    if not ran:
        print("no step ran (--steps or --seconds too small)")
        return 1
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
