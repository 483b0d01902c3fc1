"""Faults under torchrun (two processes, one GPU each); run by tests/gpu/test_faults.py:

    timeout 120 torchrun --nproc_per_node=2 tests/gpu/fault_check.py exit|mismatch [MARKER]

exit:      a loop of allgather calls on fresh data, checked; rank 1 leaves the loop (and the
           process, status 0) after call 50; rank 0 must raise PurlinTimeoutError within the
           bound (PURLIN_WAIT_TIMEOUT_S) and exits with status 3.  torchrun then fails.
mismatch:  the ranks disagree at first use on dtype, count, op and collective: both ranks
           must raise MismatchError, before any launch; a correct call right after works,
           and repeating a known call exchanges nothing.  Exits 0 when all that held.

Lines starting with "FAULT rank R:" are what the test reads.  MARKER (ignored) lets the
test find any process left behind.  The default process group is gloo: the test is about
Purlin's own exchanges and kernels, and NCCL's watchdog threads would only add noise.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import EXAMPLES  # noqa: E402

import purlinc  # noqa: E402
from purlinc import MismatchError, PurlinTimeoutError  # noqa: E402


def say(rank: int, text: str) -> None:
    print(f"FAULT rank {rank}: {text}", flush=True)


def fresh(rank: int, step: int, n: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, generator=g).to(dtype).to(f"cuda:{rank}")


def exit_mode(rank: int, world: int, comm) -> int:
    coll = purlinc.load(EXAMPLES / "allgather.pln", comm)
    n = 4096
    out = torch.empty(world * n, device=f"cuda:{rank}")
    bound = float(os.environ.get("PURLIN_WAIT_TIMEOUT_S", "10"))
    last_ok = time.monotonic()
    for step in range(100_000):
        if rank == 1 and step == 50:
            torch.cuda.synchronize()
            say(rank, f"left the loop after {step} calls")
            os._exit(0)  # a clean exit in the middle of the loop: no error on this side
        x = fresh(rank, step, n)
        out.fill_(float("nan"))
        try:
            coll(x, out)
            torch.cuda.synchronize()
            coll.check()
        except PurlinTimeoutError as error:
            waited = time.monotonic() - last_ok
            say(rank, f"PurlinTimeoutError after {waited:.1f} s (bound {bound:g} s) at call {step}: "
                      f"{str(error).splitlines()[0]}")
            if waited > bound + 30:
                say(rank, "too slow")
                os._exit(5)
            os._exit(3)  # not dist.destroy_process_group(): the peer is gone
        except Exception as error:  # noqa: BLE001 - reported: the test wants the timeout, nothing else
            say(rank, f"unexpected {type(error).__name__}: {error}")
            os._exit(4)
        want = torch.cat([fresh(r, step, n).cpu() for r in range(world)])
        if not torch.equal(out.cpu(), want):
            say(rank, f"wrong result at call {step}")
            os._exit(6)
        last_ok = time.monotonic()
    say(rank, "the loop ended without a timeout")
    return 7


def mismatch_mode(rank: int, world: int, comm) -> int:
    gather = purlinc.load(EXAMPLES / "allgather.pln", comm)
    reduce = purlinc.load(EXAMPLES / "allreduce.pln", comm)
    n = 1000
    failures = 0
    cases = [
        ("dtype", lambda: gather(fresh(rank, 0, n, torch.bfloat16 if rank == 0 else torch.float32))),
        ("count", lambda: gather(fresh(rank, 1, n if rank == 0 else n - 1))),
        ("op", lambda: reduce(fresh(rank, 2, n), op="sum" if rank == 0 else "max")),
        ("collective", lambda: (gather if rank == 0 else reduce)(fresh(rank, 3, n))),
    ]
    for case, call in cases:
        try:
            call()
            torch.cuda.synchronize()
            say(rank, f"{case}: no error")
            failures += 1
        except MismatchError as error:
            say(rank, f"{case}: MismatchError: {str(error).splitlines()[0]}")
        except Exception as error:  # noqa: BLE001
            say(rank, f"{case}: unexpected {type(error).__name__}: {error}")
            failures += 1

    # A correct call after all that: nothing was launched, so nothing is out of step.
    x = fresh(rank, 4, n)
    out = gather(x)
    torch.cuda.synchronize()
    gather.check()
    want = torch.cat([fresh(r, 4, n).cpu() for r in range(world)])
    ok = torch.equal(out.cpu(), want)
    say(rank, f"correct call after the mismatches: {'ok' if ok else 'WRONG'}")
    failures += not ok

    # Repeating a known signature costs no exchange (new tensors, same dtype, op and count).
    exchanges = 0
    original = comm._exchange

    def counting(obj):
        nonlocal exchanges
        exchanges += 1
        return original(obj)

    comm._exchange = counting
    for step in range(50):
        out = gather(fresh(rank, 10 + step, n))
    torch.cuda.synchronize()
    gather.check()
    comm._exchange = original
    say(rank, f"exchanges per repeated call: {exchanges}")
    failures += exchanges != 0
    ok = torch.equal(out.cpu(), torch.cat([fresh(r, 59, n).cpu() for r in range(world)]))
    failures += not ok
    gather.close()
    reduce.close()
    return 1 if failures else 0


def main() -> int:
    mode = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    comm = purlinc.Communicator.from_torch()
    status = exit_mode(rank, world, comm) if mode == "exit" else mismatch_mode(rank, world, comm)
    if status == 0:
        dist.barrier()
        comm.close()
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
