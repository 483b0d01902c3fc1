"""One rank of a CuPy job that never imports torch: ``python cupy_allgather.py`` per rank with
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set (no torchrun needed).

The ranks meet through Purlin's own TCP store (Communicator.from_env), load the standard
all-gather, and run it on CuPy arrays: fresh random data each iteration (every rank can
regenerate every rank's input from the seeds), poisoned outputs, several sizes and dtypes,
plus a CUDA-graph capture through CuPy.  Prints one JSON line; exits 1 on any failure.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import numpy as np  # noqa: E402

import purlinc  # noqa: E402
from purlinc.runtime import rendezvous  # noqa: E402

ALLGATHER = "collective allgather { in[r] = x[r]  out[r] = x[0..R]  copy }"


def main() -> int:
    info = rendezvous.env_info()
    cupy.cuda.Device(info.local_rank).use()
    comm = purlinc.Communicator.from_env(timeout=120)
    coll = purlinc.load(ALLGATHER, comm)
    checks, failures = 0, []
    for d, dtype in enumerate((np.float32, np.float16, np.int32)):
        for count in (1, 1000, 4097, 1 << 18):
            for it in range(3):
                # the same seeds in every process (str hashes would differ per process)
                seeds = [((d * 7 + it) * 1_000_003 + count) * 31 + r for r in range(info.world_size)]
                inputs = [np.random.default_rng(s).standard_normal(count).astype(dtype) if dtype != np.int32 else
                          np.random.default_rng(s).integers(-1 << 20, 1 << 20, count, dtype=np.int32) for s in seeds]
                x = cupy.asarray(inputs[info.rank])
                out = cupy.empty(info.world_size * count, dtype=dtype)
                out.view(cupy.uint8).fill(0xFF)
                coll(x, out)
                cupy.cuda.get_current_stream().synchronize()
                coll.check()
                checks += 1
                want = np.concatenate(inputs)
                if not np.array_equal(cupy.asnumpy(out).view(np.uint8), want.view(np.uint8)):
                    failures.append(f"{np.dtype(dtype).name} count={count} it={it}")
    # a CUDA graph captured through CuPy, replayed on new data
    count = 2048
    x = cupy.zeros(count, dtype=cupy.float32)
    out = cupy.empty(info.world_size * count, dtype=cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        coll(x, out)  # warm-up on the capture stream
        stream.synchronize()
        stream.begin_capture()
        coll(x, out)
        graph = stream.end_capture()
    for it in range(3):
        inputs = [np.random.default_rng(1000 + 10 * it + r).standard_normal(count).astype(np.float32)
                  for r in range(info.world_size)]
        x.set(inputs[info.rank])
        out.fill(np.nan)
        cupy.cuda.Device().synchronize()
        comm.allgather(("replay", it))  # every rank has its new input before anyone replays
        graph.launch(stream)
        stream.synchronize()
        checks += 1
        if not np.array_equal(cupy.asnumpy(out), np.concatenate(inputs)):
            failures.append(f"graph replay {it}")
    coll.check()
    torch_loaded = "torch" in sys.modules
    checks += 1
    if torch_loaded:
        failures.append("torch was imported")
    comm.allgather("done")
    coll.close()
    comm.close()
    print(json.dumps({"rank": info.rank, "checks": checks, "passed": checks - len(failures), "failures": failures,
                      "torch_imported": torch_loaded}), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
