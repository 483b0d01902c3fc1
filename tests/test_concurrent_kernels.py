"""Kernels of several Compiled objects compiled at once (purlinc/concurrent.py): the same
kernels and cache entries as compiling them one by one, each NVRTC'd once, errors raised.
Asserted with counters and contents, never with times."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from purlinc import pipeline
from purlinc.atom import nvrtc
from purlinc.concurrent import compile_kernels
from purlinc.dtypes import DType, ReduceOp
from purlinc.errors import PurlinError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _compileds():
    """Two reduce schedules and one copy schedule, R=2 (small modules), distinct keys."""
    allreduce = EXAMPLES / "allreduce.pln"
    return [
        pipeline.prepare(allreduce, world_size=2, arch="sm_90", overrides={"channels": 1}),
        pipeline.prepare(allreduce, world_size=2, arch="sm_90", overrides={"algorithm": "two-shot"}),
        pipeline.prepare(EXAMPLES / "allgather.pln", world_size=2, arch="sm_90"),
    ]


def test_same_kernels_as_one_by_one(cache_dir, tmp_path, monkeypatch):
    compileds = _compileds()
    threads: set[str] = set()
    compile_ = nvrtc._compile

    def recording(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return compile_(*args, **kwargs)

    monkeypatch.setattr(nvrtc, "_compile", recording)
    before = nvrtc.STATS.compiles
    kernels = compile_kernels([*compileds, compileds[0]], DType.BFLOAT16, ReduceOp.SUM, workers=3)
    assert nvrtc.STATS.compiles == before + 3  # each distinct kernel once, the repeat shares it
    assert kernels[3] is kernels[0]
    assert all(t.startswith("purlin-nvrtc") for t in threads) and threads  # in the pool's threads
    # The runtime's own calls now hit the memo: the copy collective's kernel under op None.
    hits = pipeline.STATS.memo_hits
    assert compileds[0].kernel(DType.BFLOAT16, ReduceOp.SUM) is kernels[0]
    assert compileds[1].kernel("bfloat16", "sum") is kernels[1]
    assert compileds[2].kernel(DType.BFLOAT16, None) is kernels[2]
    assert pipeline.STATS.memo_hits == hits + 3 and nvrtc.STATS.compiles == before + 3

    # One by one, in a fresh cache and process memo: byte-identical sources and CUBINs.
    monkeypatch.setenv("PURLIN_CACHE_DIR", str(tmp_path / "other"))
    pipeline.forget()
    for compiled, kernel in zip(_compileds(), kernels):
        alone = compiled.kernel(DType.BFLOAT16, ReduceOp.SUM if compiled.schedule.operation.value == "reduce" else None)
        assert alone.cuda.source == kernel.cuda.source
        assert alone.cubin == kernel.cubin and kernel.cubin[:4] == b"\x7fELF"


def test_first_error_in_order_after_all_finished(cache_dir, monkeypatch):
    compileds = _compileds()
    finished: list[str] = []
    kernel = pipeline.Compiled.kernel

    def failing(self, dtype, op=None, **kwargs):
        if self is compileds[1]:
            raise PurlinError("NVRTC compilation of the second bucket failed")
        result = kernel(self, dtype, op, **kwargs)
        finished.append(self.key)
        return result

    monkeypatch.setattr(pipeline.Compiled, "kernel", failing)
    with pytest.raises(PurlinError, match="second bucket"):
        compile_kernels(compileds, DType.BFLOAT16, ReduceOp.SUM, workers=2)
    assert sorted(finished) == sorted([compileds[0].key, compileds[2].key])  # the others still ran to the end


def test_tuned_warm_compiles_every_bucket_first(monkeypatch):
    """``Tuned.warm`` hands every kernel-atom bucket to compile_kernels before loading any;
    a host-driven (ce) bucket has no kernel and is left out."""
    import purlinc.concurrent
    from purlinc.runtime.tuned import Tuned

    events = []

    class Variant:
        def __init__(self, name, ce=None):
            self.name, self.comm, self.rank, self._ce = name, None, 0, ce
            self.compiled, self.closed = f"compiled {name}", False

        def warm(self, dtype, op):
            events.append(("warm", self.name, dtype, op))

    def compile_kernels(compileds, dtype, op=None, **kwargs):
        events.append(("compile", list(compileds), dtype, op))

    monkeypatch.setattr(purlinc.concurrent, "compile_kernels", compile_kernels)
    small, big, ce = Variant("small"), Variant("big"), Variant("ce", ce=object())
    Tuned(("b0", "b1", "b2", "b3"), [small, small, big, ce], units=1).warm("bfloat16", "sum")
    assert events == [
        ("compile", ["compiled small", "compiled big"], "bfloat16", "sum"),
        ("warm", "small", "bfloat16", "sum"), ("warm", "big", "bfloat16", "sum"), ("warm", "ce", "bfloat16", "sum"),
    ]
