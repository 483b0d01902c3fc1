"""benchmarks/ll_edits.py (the LL probe's source edits) against the source the code generator
emits today: each edit still finds what it edits, and the edited module compiles (NVRTC, no
GPU), so the probe cannot rot silently when the templates change."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from purlinc import pipeline
from purlinc.atom.codegen import generate
from purlinc.atom.nvrtc import compile_cubin
from purlinc.dtypes import DType, ReduceOp
from purlinc.snac.ir import LowerOptions
from test_nvrtc import cache_dir  # noqa: F401 - a fresh compile cache: these compiles are real
from test_snac_properties import spec_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from ll_edits import PROBES  # noqa: E402


def _module(name: str):
    spec = spec_for(name, 2)
    schedule = pipeline.snac_stage(spec, LowerOptions(channels=1, packed=True))
    return generate(schedule, spec, atom="ldst", arch="sm_90", dtype=DType.BFLOAT16,
                    op=ReduceOp.SUM if spec.is_reduce else None)


@pytest.mark.parametrize("name", ["allreduce", "allgather"])
def test_every_probe_edits_and_compiles(name, cache_dir):  # noqa: F811
    kernel = _module(name)
    count = 256  # a 1 KiB call: one round, every chunk a whole number of packets
    call = {"geometry": kernel.abi.geometry(count, count), "collective": name, "world": 2, "channels": 1}
    for probe, edit in PROBES.items():
        edited = edit(kernel.source, call)
        assert edited is not None, probe
        if probe != "base":
            assert edited != kernel.source, f"{probe}: found nothing to edit"
        assert compile_cubin(edited, f"{probe}.cu", "sm_90")[:4] == b"\x7fELF", probe


def test_minimal_has_no_form_where_it_does_not_apply():
    kernel = _module("allreduce")
    call = {"geometry": kernel.abi.geometry(256, 256), "collective": "allreduce", "world": 2, "channels": 16}
    assert PROBES["minimal"](kernel.source, call) is None  # one channel only
    call = {**call, "channels": 1, "geometry": kernel.abi.geometry(1 << 16, 1 << 16)}
    assert PROBES["minimal"](kernel.source, call) is None  # more packets than two per thread
