"""Do two ranks sharing one GPU run at the same time?  One loopback all-gather (R=2, two
channels, one slice) per process, under a variant given on the command line:

    python3 scripts/loopback_probe.py torch|raw [--calls N]

``torch``: the ranks launch on two torch streams (from torch's pool); ``raw``: on two
non-blocking streams made by the driver.  Environment variables (PURLIN_PDL,
CUDA_DEVICE_MAX_CONNECTIONS) are the caller's.  Prints one JSON line: the variant, the
environment, and "ok" or the error.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    import torch

    import purlinc
    from purlinc.runtime import driver

    variant = sys.argv[1]
    calls = int(sys.argv[sys.argv.index("--calls") + 1]) if "--calls" in sys.argv else 3
    env = {k: v for k, v in os.environ.items() if k.startswith(("CUDA", "PURLIN_PDL", "NVIDIA"))}
    row = {"variant": variant, "env": env}
    group = purlinc.LocalGroup([0, 0], share_devices=True)
    try:
        coll = purlinc.load(ROOT / "examples" / "allgather.pln", group, algorithm="direct-push", atom="ldst",
                            channels=2, slices=1)
        if variant == "torch":
            streams = [torch.cuda.Stream(device=0) for _ in range(2)]
            handles = streams
        else:
            driver.set_current(0)
            streams = [driver.stream_create() for _ in range(2)]
            handles = [int(s) for s in streams]
        x = [torch.arange(1000, dtype=torch.float32, device="cuda:0") + 1000 * r for r in range(2)]
        out = [torch.full((2000,), -1.0, device="cuda:0") for _ in range(2)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            coll(x, out, streams=handles)
        torch.cuda.synchronize()
        coll.check()
        want = torch.cat(x)
        row["ok"] = all(bool(torch.equal(o, want)) for o in out)
        row["seconds"] = round(time.perf_counter() - start, 4)
    except Exception as error:  # the probe reports whatever happens
        row["error"] = f"{type(error).__name__}: {str(error)[:400]}"
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
