"""A tuned load() compiles its size buckets' kernels for the common dtypes before it returns
(PURLIN_PRECOMPILE; purlinc.runtime.tuned.precompile), in threads, so no first call of those
dtypes waits for NVRTC.  On the CPU, with the fake driver of test_runtime_load_cpu: the NVRTC
compiles are real."""

from __future__ import annotations

import pytest

from purlinc import pipeline
from purlinc.atom import nvrtc
from purlinc.dtypes import DType, ReduceOp
from purlinc.errors import PurlinError
from purlinc.runtime import tuned as tuned_module
from purlinc.runtime.loader import load
import test_runtime_load_cpu
from test_runtime_load_cpu import EXAMPLES, FakeComm

fake = test_runtime_load_cpu.fake  # the fake driver fixture (an assignment, not an unused import)


def _first_calls(coll, dtypes) -> int:
    """NVRTC compiles the first call of each dtype on every bucket makes (Collective.variant,
    what a call does before it launches)."""
    before = nvrtc.STATS.compiles
    for variant in {id(v): v for v in coll.variants}.values():
        for dtype in dtypes:
            variant.variant(dtype, ReduceOp.SUM)
    return nvrtc.STATS.compiles - before


def test_load_compiles_the_common_dtypes_first_calls_compile_nothing(fake, monkeypatch):
    monkeypatch.setenv("PURLIN_PRECOMPILE", "float32,bfloat16,float16")
    before = nvrtc.STATS.compiles
    coll = load(EXAMPLES / "allreduce.pln", FakeComm())
    distinct = len({v.compiled.key for v in coll.variants if v.compiled.plan is None})
    assert distinct >= 2 and nvrtc.STATS.compiles - before == 3 * distinct
    assert _first_calls(coll, (DType.FLOAT32, DType.BFLOAT16, DType.FLOAT16)) == 0


def test_precompile_off_and_chosen_dtypes(fake, monkeypatch):
    monkeypatch.setenv("PURLIN_PRECOMPILE", "0")
    before = nvrtc.STATS.compiles
    coll = load(EXAMPLES / "allgather.pln", FakeComm())
    assert nvrtc.STATS.compiles == before
    distinct = len({v.compiled.key for v in coll.variants if v.compiled.plan is None})
    assert _first_calls(coll, (DType.BFLOAT16,)) == distinct

    pipeline.forget()
    monkeypatch.setenv("PURLIN_PRECOMPILE", "bfloat16")
    coll = load(EXAMPLES / "allgather.pln", FakeComm())
    assert _first_calls(coll, (DType.BFLOAT16,)) == 0 and _first_calls(coll, (DType.FLOAT32,)) == distinct


def test_a_reduction_skips_dtypes_it_cannot_reduce_and_bad_names_are_refused(monkeypatch):
    prepared, _ = tuned_module.prepare_tuned(EXAMPLES / "allreduce.pln", 2)
    monkeypatch.setenv("PURLIN_PRECOMPILE", "float8_e4m3, float32")
    jobs = tuned_module._precompile_jobs(prepared)
    assert jobs and {dtype for _, dtype, _ in jobs} == {DType.FLOAT32}
    monkeypatch.setenv("PURLIN_PRECOMPILE", "float32,bf17")
    with pytest.raises(PurlinError, match="PURLIN_PRECOMPILE='float32,bf17': not a list of element types"):
        tuned_module._precompile_jobs(prepared)


def test_dtype_aliases_are_read_as_everywhere_else(monkeypatch):
    """DType(name) refused bf16, BFLOAT16 and torch.float16, which DType.parse (every other
    dtype argument) accepts; a dtype named twice is compiled once."""
    prepared, _ = tuned_module.prepare_tuned(EXAMPLES / "allgather.pln", 2)
    monkeypatch.setenv("PURLIN_PRECOMPILE", "bf16, BFLOAT16,torch.float16")
    jobs = tuned_module._precompile_jobs(prepared)
    distinct = len({c.key for c, _, _ in jobs})
    assert [dtype for _, dtype, _ in jobs] == [DType.BFLOAT16, DType.FLOAT16] * distinct
    monkeypatch.setenv("PURLIN_PRECOMPILE", "float32;bfloat16")
    with pytest.raises(PurlinError) as info:
        tuned_module._precompile_jobs(prepared)
    assert info.value.message == ("PURLIN_PRECOMPILE='float32;bfloat16': not a list of element types: "
                                  "'float32;bfloat16' is not one")
    assert "(or aliases such as bf16), separated by commas" in info.value.notes[0]


def test_ranks_in_processes_split_the_compiles_then_meet(monkeypatch):
    """Rank 1 of 2 compiles every second job into the disk cache, meets the other rank, then
    takes the whole list (cache hits for the other rank's share on one machine)."""
    prepared, _ = tuned_module.prepare_tuned(EXAMPLES / "allreduce.pln", 2)
    monkeypatch.setenv("PURLIN_PRECOMPILE", "float32,bfloat16,float16")
    monkeypatch.delenv("PURLIN_NO_CACHE", raising=False)
    events = []
    monkeypatch.setattr("purlinc.concurrent.compile_jobs", lambda jobs: events.append(("compile", list(jobs))))

    class Rank1(FakeComm):
        def __init__(self):
            super().__init__()
            self.rank = 1

        def allgather(self, obj):
            events.append(("allgather", obj))
            return [obj, obj]

    jobs = tuned_module._precompile_jobs(prepared)
    assert tuned_module.precompile(prepared, Rank1()) == len(jobs)
    assert events == [("compile", jobs[1::2]), ("allgather", ("precompiled", len(jobs))), ("compile", jobs)]
