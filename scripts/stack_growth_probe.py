"""Does a launch that grows the CUDA context's stack wait for the kernels already running?

Issue 25's R=8 hang on one GPU, reduced to the driver: kernel ``waiter`` (no stack) spins on a
flag for at most BOUND seconds; kernel ``setter`` (a stack frame larger than the context's
stack, 1 KiB by default) sets the flag.  They are launched on two streams, waiter first.

  mode "grow":    the setter's launch has to grow the stack itself
  mode "reserve": the stack is raised first (cuCtxSetLimit), as Collective.variant now does

If growing waits for running kernels, "grow" shows the waiter timing out (flag seen: 0) and
the setter's launch call taking about BOUND seconds; "reserve" shows the flag seen at once.
Each mode runs in a fresh process (the stack never shrinks).  Writes $OUT/stack_growth_probe.json.

    OUT=/tmp/out python3 scripts/stack_growth_probe.py      # about 10 s on an H200
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOUND_S = 3.0
SOURCE = r"""
extern "C" __global__ void waiter(volatile unsigned* flag, unsigned long long bound_ns, unsigned* seen) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (*flag == 0 && now - start < bound_ns);
    *seen = *flag;
}
__device__ __noinline__ unsigned pick(const unsigned* t, int i) { return t[i]; }
extern "C" __global__ void setter(volatile unsigned* flag, int n) {
    unsigned t[4096];  // 16 KiB of frame, indexed at run time
    for (int i = 0; i < 4096; ++i) t[i] = i;
    if (pick(t, n & 4095) == (unsigned)(n & 4095)) *flag = 1;
}
"""


def run(mode: str) -> dict:
    import ctypes

    sys.path.insert(0, str(ROOT))
    from cuda.bindings import driver as cu

    from purlinc.atom import nvrtc
    from purlinc.atom.cubin import stack_bytes
    from purlinc.runtime import driver

    arch = driver.arch_of(0)
    cubin = nvrtc.compile_cubin(SOURCE, "stack_growth_probe.cu", arch)
    driver.set_current(0)
    module = driver.module_load(cubin)
    waiter, setter = driver.get_function(module, "waiter"), driver.get_function(module, "setter")
    need = stack_bytes(cubin)["setter"]
    before = driver.stack_limit()
    if mode == "reserve":
        driver.reserve_stack(need)
    words = driver.mem_alloc(8)
    driver.memset_d8(words, 0, 8)
    driver.synchronize(0)
    s1, s2 = driver.stream_create(), driver.stream_create()

    def launch(function, stream, *values):
        holders = [ctypes.c_uint64(v) for v in values]
        pointers = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
        driver.call(cu.cuLaunchKernel, function, 1, 1, 1, 32, 1, 1, 0, stream, ctypes.addressof(pointers), 0)
        return holders

    keep = launch(waiter, s1, words, int(BOUND_S * 1e9), words + 4)
    time.sleep(0.2)  # the waiter is spinning
    start = time.time()
    keep += launch(setter, s2, words, 7)
    launch_s = time.time() - start
    driver.synchronize(0)
    seen = int.from_bytes(driver.copy_dtoh(words + 4, 4), "little")
    return {"mode": mode, "device": driver.device_name(0), "setter_stack_bytes": need,
            "local_size_attribute": driver.local_bytes(setter), "stack_before": before,
            "stack_after": driver.stack_limit(), "setter_launch_s": round(launch_s, 3),
            "waiter_saw_flag": seen, "total_s": round(time.time() - start, 3)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("grow", "reserve"), help=argparse.SUPPRESS)  # internal: one mode's process
    args = ap.parse_args(argv)
    if args.mode:
        print(json.dumps(run(args.mode)))
        return
    results = []
    for mode in ("grow", "reserve"):
        done = subprocess.run([sys.executable, __file__, "--mode", mode], capture_output=True, text=True, timeout=120)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else
                       {"mode": mode, "error": done.stderr[-2000:]})
    grow, reserve = results
    verdict = ("growing the stack at a launch waited for the running kernel"
               if grow.get("waiter_saw_flag") == 0 and reserve.get("waiter_saw_flag") == 1 else
               "no wait seen" if grow.get("waiter_saw_flag") == 1 else "inconclusive")
    report = {"results": results, "verdict": verdict}
    out = Path(os.environ.get("OUT", "/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "stack_growth_probe.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
