"""Run under ``torchrun --nproc_per_node=N``: zero-copy through Communicator.from_torch.

Every standard example (tuned default, direct-push, direct-pull), buffers from comm.empty,
fresh random data (the same seed on every rank, so every rank knows every input), poisoned
outputs, every rank checked against the reference evaluator, eager and CUDA-graph replay;
heap growth (a small first segment), exhaustion (a bounded heap) and a freed block.  Rank 0
writes ``$PURLIN_RESULTS/zerocopy_torchrun.json``; the exit status is 1 on any failure."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import (  # noqa: E402
    EXAMPLES, CheckLog, examples, expected, fill_rank, poison, to_numpy, torch_dtype,
)
from purlinc.dtypes import DType  # noqa: E402

LOG = CheckLog()
note = LOG.note


def rank_collective(coll, count, itemsize):
    return coll.variant_for(count, itemsize) if hasattr(coll, "variant_for") else coll


def check_example(comm, name, algorithm, seed):
    import purlinc
    from purlinc.errors import PurlinError

    rank = comm.rank
    try:
        coll = purlinc.load(EXAMPLES / name, comm, algorithm=algorithm) if algorithm else purlinc.load(EXAMPLES / name, comm)
    except PurlinError as error:
        note(True, f"{name}/{algorithm}: not applicable ({str(error).splitlines()[0][:80]})")
        return
    label0 = f"{name}/{algorithm or 'default'}"
    spec = (coll.variants[0] if hasattr(coll, "variants") else coll).compiled.spec
    rng = np.random.default_rng(seed)
    try:
        for count, dtype in ((1, DType.FLOAT32), (1000, DType.BFLOAT16), (4097, DType.FLOAT32), (300_000, DType.BFLOAT16)):
            tdtype = torch_dtype(dtype)
            # comm.empty is a collective: every rank allocates the largest buffer any rank needs
            # (the same offsets everywhere) and passes its own part, or None where it has none.
            n_in = max(len(i) for i in spec.inputs) * count
            n_out = max(len(o) for o in spec.outputs) * count
            x_full, out_full = comm.empty((max(n_in, 1),), tdtype), comm.empty((max(n_out, 1),), tdtype)
            x = x_full[: len(spec.inputs[rank]) * count] if len(spec.inputs[rank]) else None
            out = out_full[: len(spec.outputs[rank]) * count] if len(spec.outputs[rank]) else None
            label = f"{label0}/{dtype.value}/n={count}"

            def fill():
                return fill_rank(spec, rank, count, dtype, rng, x, out, comm.device)

            def compare(inputs, what):
                if out is None:
                    return
                want = expected(spec, inputs, count, dtype, "sum")[rank]
                got = to_numpy(out, dtype)
                note(np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"{label} {what}",
                     f"{np.sum(got.view(dtype.storage) != want)} of {got.size} elements differ")

            for it in range(2):
                inputs = fill()
                coll(x, out, op="sum")
                torch.cuda.synchronize()
                coll.check()
                compare(inputs, f"eager {it}")
            c = rank_collective(coll, count, dtype.itemsize)
            if c._zc is not None and not c._zc.prefer_staged:  # packed (LL) buckets stage heap buffers too
                note(bool(c._zc.twin._variants), f"{label} took the zero-copy path")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                for _ in range(3):
                    coll(x, out, op="sum")
            for it in range(2):
                inputs = fill()
                dist.barrier()
                graph.replay()
                torch.cuda.synchronize()
                coll.check()
                compare(inputs, f"graph {it}")
            del graph
    finally:
        coll.close()


def check_growth_and_errors(comm):
    import purlinc
    from purlinc.runtime import symmetric
    from purlinc.runtime.errors import FreedBufferError, HeapExhaustedError

    rank = comm.rank
    segments = len(comm.heap.segments)
    # More than any free block (earlier checks may have left grown segments behind): must grow.
    big = comm.empty((comm.heap.largest_free + (8 << 20),), torch.uint8)
    note(len(comm.heap.segments) > segments, "heap grew by a segment", f"{comm.heap.segments}")
    coll = purlinc.load(EXAMPLES / "allgather.pln", comm, algorithm="direct-push")
    try:
        world, count = comm.world_size, 1 << 20
        x = comm.empty((count,), torch.bfloat16)
        out = comm.empty((world * count,), torch.bfloat16)
        gen = torch.Generator(device=f"cuda:{comm.device}").manual_seed(100 + rank)
        x.copy_(torch.randn(count, generator=gen, device=f"cuda:{comm.device}").to(torch.bfloat16))
        poison(out)
        coll(x, out)
        want = torch.empty_like(out)
        dist.all_gather_into_tensor(want, x)
        torch.cuda.synchronize()
        note(torch.equal(out.view(torch.int16), want.view(torch.int16)), "allgather in a grown segment vs NCCL")

        block = comm.alloc(count * 2)
        stale = symmetric.tensor_of(block, (count,), torch.bfloat16)
        stale.copy_(x)
        poison(out)
        coll(stale, out)
        coll(stale, out)  # the same tensors again: the eager fast path replays the zero-copy launch
        torch.cuda.synchronize()
        note(torch.equal(out.view(torch.int16), want.view(torch.int16)), "a repeated zero-copy call (fast path)")
        block.free()
        try:
            coll(stale, out)  # the very tensor the fast path was made for: the free must still be seen
            note(False, "a freed block is refused", "the call went through")
        except FreedBufferError as error:
            note("not in a live block" in str(error), "a freed block is refused", str(error))
        coll(x, out)  # still fine afterwards
        torch.cuda.synchronize()
        coll.check()
        note(torch.equal(out.view(torch.int16), want.view(torch.int16)), "the collective still works after a refusal")
    finally:
        coll.close()
    del big

    os.environ["PURLIN_HEAP_MAX_MB"] = "32"
    try:
        bounded = purlinc.Communicator.from_torch(heap_bytes=16 << 20)
    finally:
        del os.environ["PURLIN_HEAP_MAX_MB"]
    try:
        bounded.empty((64 << 20,), torch.uint8)
        note(False, "heap exhaustion is an error", "64 MiB fit in a 32 MiB heap")
    except HeapExhaustedError as error:
        note(error.requested == 64 << 20 and "needs 67108864 bytes" in str(error), "heap exhaustion is an error",
             str(error))
    small = bounded.empty((1 << 20,), torch.uint8)
    note(small.numel() == 1 << 20, "the bounded heap still allocates after a refusal")
    del small
    bounded.close()


def main() -> int:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    import purlinc

    comm = purlinc.Communicator.from_torch(heap_bytes=16 << 20)
    start = time.time()
    seed = 0
    for name in examples():
        for algorithm in (None, "direct-push", "direct-pull"):
            seed += 1
            try:
                check_example(comm, name, algorithm, seed)
            except Exception as error:  # noqa: BLE001 - recorded, the run goes on
                LOG.raised(f"{name}/{algorithm}", error)
    try:
        check_growth_and_errors(comm)
    except Exception as error:  # noqa: BLE001
        LOG.raised("growth and errors", error)
    failed = LOG.finish("zerocopy_torchrun.json", "zero-copy torchrun", time.time() - start)
    comm.close()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
