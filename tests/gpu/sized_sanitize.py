"""Run-time sizes under compute-sanitizer (memcheck): one rank (R=1, so no kernel waits for
another, which a sanitizer's serialised launches would turn into a timeout), every dtype,
sizes 0..capacity, over the capacity, negative, past the input and past the output, and
expected sizes that agree or not (one more, one less, negative, far over the capacity), each
checked against the evaluator; the outputs sit between poisoned guard zones.

    compute-sanitizer --tool memcheck --error-exitcode 3 python3 tests/gpu/sized_sanitize.py

Passing: "sized sanitize: N calls ok" and exit status 0 (3 if memcheck found an error).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))


def main() -> int:
    import purlinc
    import torch

    from purlinc.runtime.sized import SizeError
    from test_sized import CAPACITY, DTYPES, SIZED, Buffers, _check_outputs

    group = purlinc.LocalGroup([0], share_devices=True)
    coll = purlinc.load(SIZED / "alltoallv.pln", group, capacity=CAPACITY, channels=2)
    spec = coll[0].compiled.spec
    rng = np.random.default_rng(0)
    cases = [(size, in_len, out_len, None) for size, in_len, out_len in (
        (0, CAPACITY, CAPACITY), (CAPACITY, CAPACITY, CAPACITY), (5, 7, 9), (CAPACITY + 1, CAPACITY, CAPACITY),
        (-3, CAPACITY, CAPACITY), (20, 10, CAPACITY), (20, CAPACITY, 10))]
    # expected sizes (what torch's output_split_sizes become): equal, one more or less, negative,
    # far over the capacity, and equal but past the output
    expected = [(5, 7, 9, 5), (5, 7, 9, 6), (5, 7, 9, 4), (0, 7, 9, -5), (5, 7, 9, 1 << 40), (20, CAPACITY, 10, 20)]
    calls = 0
    for dtype in DTYPES:
        for size, in_len, out_len, expect in cases + (expected if dtype.itemsize in (1, 8) else []):
            b = Buffers(1, dtype, in_len, out_len)
            data = b.fill(rng, [size])
            want = None if expect is None else [torch.tensor([expect], dtype=torch.int64, device="cuda:0")]
            coll([b.x], [b.sizes], [b.out], [b.out_sizes], expected_sizes=want)
            torch.cuda.synchronize(0)
            try:
                coll.check()
                raised = False
            except SizeError:
                raised = True
            label = f"{dtype.value} size {size} in {in_len} out {out_len} expected {expect}"
            errors = _check_outputs(spec, [data], [[size]], [b], label, None if expect is None else [[expect]])
            if raised != bool(errors[0]):
                raise AssertionError(f"{label}: SizeError raised={raised}, evaluator errors={errors}")
            calls += 1
    coll.close()
    group.close()
    print(f"sized sanitize: {calls} calls ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
