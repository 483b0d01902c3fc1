"""Every entry point the runtime looks up (``KernelABI.entry`` / ``lean_entry``, one per rank) is
defined in the generated module, for every example: the plain, fused-epilogue and run-time-sized
code generators alike.  (The runtime finds its kernel by that name with cuModuleGetFunction; a
generator that names its entries another way fails only on a GPU, at the first call.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from purlinc.pipeline import prepare

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SPECS = sorted(EXAMPLES.glob("*.pln")) + sorted(EXAMPLES.glob("*/*.pln"))


def _defined(source: str) -> set[str]:
    return set(re.findall(r'extern "C" __global__ void(?: __launch_bounds__\([^)]*\))?\s+(\w+)\s*\(', source))


@pytest.mark.parametrize("path", SPECS, ids=[str(p.relative_to(EXAMPLES)) for p in SPECS])
def test_every_entry_the_runtime_looks_up_is_defined(path):
    compiled = prepare(path, world_size=4, arch="sm_90")
    dtype = "bfloat16" if compiled.spec.is_reduce else "float32"
    kernel = compiled.kernel(dtype, "sum" if compiled.spec.is_reduce else None, emit_cubin=False)
    abi, defined = kernel.abi, _defined(kernel.cuda.source)
    wanted = {abi.entry(r) for r in range(abi.world_size)}
    if abi.lean:
        wanted |= {abi.lean_entry(r) for r in range(abi.world_size)}
    assert wanted <= defined, f"looked up but not defined: {sorted(wanted - defined)}; defined: {sorted(defined)}"
