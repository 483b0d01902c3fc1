"""purlinc.atom.cubin reads the per-thread stack ptxas records for each entry point: what a
launch needs the CUDA context's stack to hold (runtime.driver.reserve_stack)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from purlinc.atom import nvrtc
from purlinc.atom.cubin import stack_bytes

# Entries whose stacks differ: a by-value struct handed to an out-of-line function lives in the
# caller's frame (as in the large packed modules' consume loops), and so does an array indexed
# at run time.
SOURCE = r"""
struct batch { const float* src[N]; float scale[N]; };
__device__ __noinline__ float consume(const batch b, int i) { return b.src[i & (N - 1)][i] * b.scale[i % N]; }
extern "C" __global__ void small(const float* x, float* y) {
    batch b; for (int j = 0; j < N; ++j) { b.src[j] = x + j; b.scale[j] = j; }
    y[threadIdx.x] = consume(b, threadIdx.x);
}
extern "C" __global__ void large(const float* x, float* y) {  // and an array indexed at run time
    batch b; float t[8 * N]; for (int j = 0; j < N; ++j) { b.src[j] = x + j; b.scale[j] = j; }
    for (int j = 0; j < 8 * N; ++j) t[j] = x[j];
    y[threadIdx.x] = consume(b, threadIdx.x) + t[threadIdx.x % (8 * N)];
}
extern "C" __global__ void none(float* y) { y[threadIdx.x] = 1.0f; }
"""


@pytest.fixture(scope="module")
def cubin(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PURLIN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return nvrtc.compile_cubin("#define N 32\n" + SOURCE, "stacks.cu", "sm_90")


def test_entries_with_frames_and_without(cubin):
    stacks = stack_bytes(cubin)
    assert stacks["none"] == 0
    assert 0 < stacks["small"] < stacks["large"]


def test_the_same_numbers_as_cuobjdump(cubin, tmp_path):
    tool = shutil.which("cuobjdump") or next(
        (str(p) for p in Path(sys.prefix).glob("lib/python*/site-packages/nvidia/cu*/bin/cuobjdump")), None)
    if tool is None:
        pytest.skip("cuobjdump is not installed (pip install nvidia-cuda-cuobjdump)")
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    text = subprocess.run([tool, "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
    theirs = dict(re.findall(r"Function (\w+):\s*\n\s*REG:\d+ STACK:(\d+)", text))
    assert theirs and {name: int(v) for name, v in theirs.items()} == {n: stack_bytes(cubin)[n] for n in theirs}


@pytest.mark.parametrize("data", [b"", b"junk", b"\x7fELF\x01" + bytes(60), b"\x7fELF\x02" + bytes(200)])
def test_anything_else_reads_as_nothing(data):
    assert stack_bytes(data) == {}
