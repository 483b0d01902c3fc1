"""The Python entry points refuse arguments a user can get wrong with a PurlinError that names
the value, before any GPU work: a list for params, an empty or non-text source, MASTER_PORT=0 in
a world of several ranks, a trace of a collective with run-time sizes, capacity with a
hierarchical load.  CPU only."""

from __future__ import annotations

from pathlib import Path

import pytest

from purlinc import pipeline
from purlinc.errors import PurlinError
from purlinc.runtime.options import LoadOptions

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("params, message", [
    ([("root", 1)], "params must map parameter names to integers, e.g. {'root': 1}; got list"),
    ({1: 1}, "parameter names are strings, got 1"),
    ({"root": 1.5}, "parameter root must be an integer, got 1.5 (float)"),
])
def test_params_are_a_mapping_of_names_to_integers(params, message):
    for call in (lambda: LoadOptions.of(params=params),
                 lambda: pipeline.prepare(EXAMPLES / "broadcast.pln", world_size=2, params=params)):
        with pytest.raises(PurlinError) as info:
            call()
        assert info.value.message == message


@pytest.mark.parametrize("trace", ["no", "0", 0, 1, "False"])
def test_trace_is_true_or_false(trace):
    """bool("no") is True: trace="no" (or "0") loaded traced kernels, and pinned the schedule."""
    with pytest.raises(PurlinError) as info:
        LoadOptions.of(trace=trace)
    assert info.value.message == f"trace must be True or False, got {trace!r}"
    assert not LoadOptions.of(trace=False).pinned and LoadOptions.of(trace=True).pinned


@pytest.mark.parametrize("source, message", [
    (None, "expected a .pln path or .pln text, got NoneType"),
    (b"collective a { }", "expected a .pln path or .pln text, got bytes"),
    ("", "expected a .pln path or .pln text, got an empty string"),
])
def test_a_source_is_a_path_or_text(source, message):
    with pytest.raises(PurlinError) as info:
        pipeline.load_source(source)
    assert info.value.message == message


def test_master_port_zero_serves_only_a_world_of_one():
    from purlinc.runtime.rendezvous import RendezvousError, env_info

    base = {"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    assert env_info({**base, "WORLD_SIZE": "1"}).master_port == 0
    with pytest.raises(RendezvousError, match="MASTER_PORT=0 lets the system pick rank 0's port"):
        env_info({**base, "WORLD_SIZE": "2"})


def test_a_trace_of_a_sized_collective_is_refused_not_dropped():
    from purlinc.runtime.loader import load_sized

    with pytest.raises(PurlinError, match="tracing is not available for collectives with run-time sizes"):
        load_sized(EXAMPLES / "sized" / "alltoallv.pln", None, LoadOptions.of(trace=True, capacity=16))


@pytest.mark.parametrize("extra", [{"capacity": 16}, {"dtype": "bfloat16"}, {"packed": False}])
def test_a_hierarchical_load_refuses_what_it_would_ignore(extra):
    import purlinc

    with pytest.raises(PurlinError, match="gpus_per_node=G\\) takes comm=None"):
        purlinc.load(EXAMPLES / "allreduce.pln", None, gpus_per_node=2, **extra)


def test_a_machine_without_a_driver_gets_a_cuda_error(monkeypatch):
    """cuda-python raises its own DynamicLibNotFoundError where no driver library exists."""
    from purlinc.runtime import driver
    from purlinc.runtime.errors import CudaError

    def missing(*args):
        raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found via system search')

    monkeypatch.setattr(driver, "_initialised", False)
    monkeypatch.setattr(driver.cu, "cuInit", missing)
    with pytest.raises(CudaError, match="no CUDA driver could be loaded"):
        driver.init()


def test_spec_of_takes_a_path_and_checks_the_world_size():
    assert pipeline.spec_of(str(EXAMPLES / "allgather.pln"), 2, None).world_size == 2
    for bad, shown in (("4", "'4' (str)"), (2.5, "2.5 (float)")):
        with pytest.raises(PurlinError, match=f"the world size must be an integer, got {shown}".replace("(", r"\(")
                           .replace(")", r"\)")):
            pipeline.spec_of(EXAMPLES / "allgather.pln", bad, None)


@pytest.mark.parametrize("pins, message", [
    ({"arch": "sm_75"}, "unknown target architecture 'sm_75'"),
    ({"arch": 90}, "arch must be a target name such as 'sm_90', got 90"),
    ({"capacity": -1}, "capacity must be a positive number of elements per chunk, got -1"),
    ({"capacity": 1.5}, "capacity must be a positive number of elements per chunk, got 1.5"),
    ({"capacity": True}, "capacity must be a positive number of elements per chunk, got True"),
    ({"dtype": "floaty"}, "unknown dtype 'floaty'"),
])
def test_target_and_sizing_are_checked_where_given(pins, message):
    """arch, capacity and dtype were stored as given: refused only later (an arch at the compile,
    a capacity by a sized load alone) or never, where the load did not read them."""
    with pytest.raises(PurlinError) as info:
        LoadOptions.of(**pins)
    assert info.value.message == message
    assert LoadOptions.of(arch="sm_90", capacity=8, dtype="bf16").capacity == 8


@pytest.mark.parametrize("value, shown", [(True, "'True'"), (None, "'None'"), ("Floaty", "'Floaty'")])
def test_an_unknown_dtype_is_named_as_given(value, shown):
    """The name was lower-cased before the lookup and shown so: True read 'true', None 'none'."""
    from purlinc.dtypes import DType

    with pytest.raises(PurlinError) as info:
        DType.parse(value)
    assert info.value.message == f"unknown dtype {shown}"
