"""One compile path: ``purlinc compile`` and the runtime go through ``pipeline.prepare`` and
get the same frozen Compiled for the same inputs; kernels are made once per (dtype, op); a
tuned load parses and checks its source once for all its size buckets; options are
assembled in one place (``pipeline.resolve_options``).  Counters, not times."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from purlinc import cli, pipeline
from purlinc.dtypes import DType, ReduceOp
from purlinc.errors import PurlinError
from purlinc.snac.ir import Algorithm, LowerOptions

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _stats() -> dict:
    return dataclasses.asdict(pipeline.STATS)


def _delta(before: dict) -> dict:
    return {k: v - before[k] for k, v in _stats().items() if v != before[k]}


def test_cli_and_runtime_share_one_compiled(cache_dir, tmp_path, capsys):
    from purlinc.runtime.collective import prepare

    path = EXAMPLES / "allreduce.pln"
    assert cli.main(["compile", str(path), "-R", "2", "--channels", "2", "-o", str(tmp_path / "out")]) == 0
    cli_artifact = pipeline.compile(path, world_size=2, overrides={"channels": 2})
    runtime = prepare(path, 2, channels=2)
    assert runtime is cli_artifact.compiled
    assert runtime.options.channels == 2 and runtime.options.registered == frozenset()
    again = prepare(path, 2, channels=2)
    assert again is runtime  # same inputs, same object
    with pytest.raises(dataclasses.FrozenInstanceError):
        runtime.key = "x"
    kernel = runtime.kernel(DType.BFLOAT16, ReduceOp.SUM)
    assert kernel.cuda.source == cli_artifact.cuda.source and kernel.cubin == cli_artifact.cubin


def test_same_inputs_same_compiled_object(cache_dir):
    a = pipeline.prepare(EXAMPLES / "allgather.pln", world_size=4, overrides={"channels": 2})
    b = pipeline.prepare(EXAMPLES / "allgather.pln", world_size=4, overrides={"channels": 2, "slices": None})
    c = pipeline.prepare(EXAMPLES / "allgather.pln", world_size=4, overrides={"channels": 3})
    assert a is b and a is not c and a.key != c.key


def test_a_kernel_request_is_checked_even_where_it_is_ignored(cache_dir):
    """A copy ignores op, but a misspelt one was taken (and keyed the cache); emit_cubin='no'
    made a CUBIN, as bool('no') is True."""
    compiled = pipeline.prepare(EXAMPLES / "allgather.pln", world_size=2)
    with pytest.raises(PurlinError, match=r"unknown reduce op 'bogus'; expected one of sum, prod, max, min"):
        compiled.kernel("float32", "bogus", emit_cubin=False)
    with pytest.raises(PurlinError, match=r"emit_cubin must be True or False, got 'no'"):
        compiled.kernel("float32", emit_cubin="no")
    assert compiled.kernel("float32", None, emit_cubin=False).cubin is None


def test_stage_copies_asked_for_where_the_lowering_would_not_take_them_is_refused(cache_dir):
    """The lowering caps a request (an atom's default asks every algorithm for two), so ring
    kept one copy and run-time sizes two, whatever was asked for by name; the command line
    refused both."""
    with pytest.raises(PurlinError, match=r"stage_copies=2 does not apply to ring: it lowers to 1 staging copy"):
        pipeline.prepare(EXAMPLES / "allreduce.pln", world_size=2, algorithm="ring", overrides={"stage_copies": 2})
    with pytest.raises(PurlinError, match=r"stage_copies=1 does not apply to a collective with run-time sizes"):
        pipeline.prepare(EXAMPLES / "sized" / "alltoallv.pln", world_size=2, overrides={"stage_copies": 1})
    two = pipeline.prepare(EXAMPLES / "allreduce.pln", world_size=2, algorithm="direct-push", overrides={"stage_copies": 2})
    assert two.options.stage_copies == 2



def test_stage_copies_in_options_is_capped_by_the_lowering(cache_dir):
    """docs/API.md: options= carries resolved options (the runtime passes a Compiled's own, whose
    stage_copies is the atom's request), so their stage_copies is capped, not refused."""
    from purlinc.snac.ir import Algorithm, LowerOptions

    ring = pipeline.prepare(EXAMPLES / "allreduce.pln", world_size=2,
                            options=LowerOptions(algorithm=Algorithm.RING, stage_copies=2))
    assert ring.schedule.stage_copies == 1

def test_kernels_are_made_once_per_dtype_and_op(cache_dir):
    compiled = pipeline.prepare(EXAMPLES / "allreduce.pln", world_size=2)
    before = _stats()
    first = compiled.kernel(DType.FLOAT32, ReduceOp.MAX, emit_cubin=False)
    assert compiled.kernel("float32", "max", emit_cubin=False) is first
    other = compiled.kernel(DType.FLOAT32, ReduceOp.SUM, emit_cubin=False)
    assert other is not first and other.cuda.source != first.cuda.source
    delta = _delta(before)
    assert delta["generations"] == 2 and delta["lowerings"] == 1 and delta["memo_hits"] == 1


def test_tuned_load_parses_and_checks_once(cache_dir):
    from purlinc.runtime.tuned import prepare_tuned

    before = _stats()
    prepared, units = prepare_tuned(EXAMPLES / "allreduce.pln", 4, arch="sm_90")
    delta = _delta(before)
    assert len(prepared) >= 3 and units == 4
    assert delta["parses"] == 1 and delta["checks"] == 1
    distinct = {p.compiled.key for p in prepared}
    assert delta["lowerings"] == delta["verifications"] == len(distinct)
    # the same load again in this process: nothing to do
    before = _stats()
    again, _ = prepare_tuned(EXAMPLES / "allreduce.pln", 4, arch="sm_90")
    assert [p.compiled for p in again] == [p.compiled for p in prepared]
    assert _delta(before) == {}
    # a fresh process (memos dropped): schedules come from the disk cache, one parse + check
    pipeline.forget()
    before = _stats()
    fresh, _ = prepare_tuned(EXAMPLES / "allreduce.pln", 4, arch="sm_90")
    delta = _delta(before)
    assert delta == {"parses": 1, "checks": 1, "schedule_hits": len(distinct)}
    assert [p.compiled.schedule for p in fresh] == [p.compiled.schedule for p in prepared]


def test_tuned_bucket_that_does_not_apply_falls_back(cache_dir):
    from purlinc.runtime import tuning
    from purlinc.runtime.tuned import _prepare_bucket

    source = pipeline.load_source(EXAMPLES / "allgather.pln")
    bucket = tuning.Bucket(1024, algorithm="two-shot", atom="ce", channels=4, slices=2)  # no two-shot for a copy
    prepared = _prepare_bucket(source, 2, bucket, None, "sm_90")
    options = prepared.compiled.options
    assert (options.algorithm, options.channels, options.slices, prepared.compiled.atom) == (
        Algorithm.DIRECT_PUSH, 4, 1, "ldst")
    assert prepared.stage_bytes == 64 << 10


def test_resolve_options_is_the_one_place(cache_dir):
    spec = pipeline.spec_of(pipeline.load_source(EXAMPLES / "allgather.pln"), 2, None)
    base = pipeline.default_options(spec)
    assert pipeline.resolve_options(spec) == base
    got = pipeline.resolve_options(spec, overrides={"algorithm": "ring", "channels": 3, "slots": None,
                                                    "registered": ["in"]})
    assert got == dataclasses.replace(base, algorithm=Algorithm.RING, channels=3, registered=frozenset({"in"}))
    full = LowerOptions(channels=5)
    assert pipeline.resolve_options(spec, options=full, overrides={"slices": 2}) == LowerOptions(channels=5, slices=2)


def test_slots_are_checked_however_they_come(cache_dir):
    """slots in options= (or kept there past an algorithm override) skipped the check that
    overrides get, and keyed one direct-push schedule as slots2 beside slotsall."""
    spec = pipeline.spec_of(pipeline.load_source(EXAMPLES / "allgather.pln"), 2, None)
    says = "slots=2 does not apply to direct-push: it gives every message its own staging unit"
    for options, overrides in ((LowerOptions(slots=2), None), (LowerOptions(slots=None), {"slots": 2}),
                               (LowerOptions(Algorithm.RING, slots=2), {"algorithm": "direct-push"})):
        with pytest.raises(PurlinError, match=says):
            pipeline.resolve_options(spec, options=options, overrides=overrides)
    assert pipeline.resolve_options(spec, options=LowerOptions(Algorithm.RING, slots=2)).slots == 2


def test_lower_refuses_options_of_the_wrong_type():
    """lower() called directly: an algorithm by name crashed in options.key(), a registered
    string was read as its letters, and stage_copies=True or 2.0 passed for 1 and 2."""
    from purlinc.snac.lower import lower

    spec = pipeline.spec_of(pipeline.load_source(EXAMPLES / "allgather.pln"), 2, None)
    with pytest.raises(PurlinError, match="algorithm must be an Algorithm .* got 'ring'"):
        lower(spec, LowerOptions(algorithm="ring"))
    with pytest.raises(PurlinError, match="registered must be a set of 'in' and/or 'out', got 'in'"):
        lower(spec, LowerOptions(registered="in"))
    for copies in (True, 2.0, 3):
        with pytest.raises(PurlinError, match=f"stage_copies={copies!r}: staging has 1 or 2 copies"):
            LowerOptions(stage_copies=copies)


def test_no_cache_means_no_memo_either(cache_dir, monkeypatch):
    monkeypatch.setenv("PURLIN_NO_CACHE", "1")
    a = pipeline.prepare(EXAMPLES / "allgather.pln", world_size=2)
    b = pipeline.prepare(EXAMPLES / "allgather.pln", world_size=2)
    assert a is not b and a.key == b.key
    before = _stats()
    assert a.schedule == b.schedule
    assert _delta(before)["lowerings"] == 2
    assert not cache_dir.exists()


def test_ce_plan_rides_on_the_compiled(cache_dir):
    from purlinc.runtime.collective import layout_sizes, prepare

    compiled = prepare(EXAMPLES / "allgather.pln", 2, atom="ce")
    plan = compiled.plan
    assert plan is not None and plan is compiled.plan
    stage, pad, counters = layout_sizes(compiled)
    assert pad == 8 * plan.pad_words and counters == 8 * compiled.schedule.channels
    assert prepare(EXAMPLES / "allgather.pln", 2).plan is None


@pytest.mark.parametrize("kw, message", [
    ({"world_size": 2, "params": {"root": 1.5}}, "parameter root must be an integer, got 1.5 (float)"),
    ({"world_size": 2, "params": {"root": True}}, "parameter root must be an integer, got True (bool)"),
    ({"world_size": 2, "params": {"root": "1"}}, "parameter root must be an integer, got '1' (str)"),
    ({"world_size": 2.5}, "the world size must be an integer, got 2.5 (float)"),
])
def test_sizes_and_parameters_are_integers_not_truncated(kw, message):
    """int(1.5) is 1: truncating would compile another collective than the one asked for."""
    with pytest.raises(PurlinError) as info:
        pipeline.prepare(EXAMPLES / "broadcast.pln", **kw)
    assert info.value.message == message


def test_numpy_integers_are_integers():
    import numpy as np

    compiled = pipeline.prepare(EXAMPLES / "broadcast.pln", world_size=np.int64(2), params={"root": np.int32(1)})
    assert compiled.params == (("root", 1),) and compiled.world_size == 2


@pytest.mark.parametrize("pins, named", [
    ({"packed": False}, ("packed",)), ({"trace": False}, ()),
    ({"algorithm": "ring", "trace": True}, ("algorithm", "trace")),
])
def test_a_pin_set_to_a_false_value_is_still_a_pin(pins, named):
    from purlinc.runtime.options import LoadOptions

    assert LoadOptions.of(**pins).orchestration() == named


def test_a_pin_of_no_channels_is_refused_when_given():
    """channels=0 counted as a pin and failed later, in the lowering; it is refused at once."""
    from purlinc.runtime.options import LoadOptions

    with pytest.raises(PurlinError, match=r"channels and slices must be >= 1 \(got channels=0\)"):
        LoadOptions.of(channels=0)


@pytest.mark.parametrize("overrides, message", [
    ({"channels": 2.7}, "channels must be an integer, got 2.7 (float)"),
    ({"slices": "2"}, "slices must be an integer, got '2' (str)"),
    ({"channels": True}, "channels must be an integer, got True (bool)"),
    ({"packed": "no"}, "packed must be True or False, got 'no'"),
    ({"registered": "in"}, "registered must be a collection of 'in' and/or 'out', got 'in'"),
])
def test_lowering_overrides_are_checked_not_coerced(overrides, message):
    """int(2.7) is 2 and bool('no') is True: another schedule than the one asked for."""
    with pytest.raises(PurlinError) as info:
        pipeline.prepare(EXAMPLES / "allreduce.pln", world_size=2, overrides=overrides).schedule
    assert info.value.message == message


@pytest.mark.parametrize("overrides, said", [
    ({"slots": 2}, "direct-push (the spec's default algorithm)"),
    ({"slots": 2, "algorithm": "two-shot"}, "two-shot"),
])
def test_slots_for_an_algorithm_without_slots_are_refused(overrides, said):
    """The lowering would put the number into the schedule's key and ignore it: the caller
    would get another schedule than the one asked for, silently."""
    with pytest.raises(PurlinError) as info:
        pipeline.prepare(EXAMPLES / "allreduce.pln", world_size=2, overrides=overrides).schedule
    assert info.value.message == f"slots=2 does not apply to {said}: it gives every message its own staging unit"
    assert "slots applies to ring" in info.value.notes[0]
    ring = pipeline.prepare(EXAMPLES / "allreduce.pln", world_size=2, overrides={**overrides, "algorithm": "ring"})
    assert ring.schedule.options.slots == 2
    if "algorithm" in overrides:  # known before the spec is read: refused before any cache lookup
        with pytest.raises(PurlinError, match="does not apply to two-shot"):
            pipeline.prepare(EXAMPLES / "allreduce.pln", world_size=2, overrides=overrides)


def test_an_unknown_reduce_op_is_a_purlin_error():
    with pytest.raises(PurlinError, match="unknown reduce op 'avg'; expected one of sum, prod, max, min"):
        pipeline.prepare(EXAMPLES / "allreduce.pln", world_size=2).kernel("float32", "avg")


def test_a_path_is_text_only_with_both_words_and_no_such_file(cache_dir, tmp_path):
    """A str path through a directory called run{1} was parsed as .pln text ("unexpected '/'"):
    text is what contains 'collective' and '{' and names no file; a NUL byte in a path raised
    a bare ValueError from open()."""
    braces = tmp_path / "run{1}" / "ag.pln"
    named = tmp_path / "collective{1}.pln"  # both words, but a file that exists: read it
    for path in (braces, named):
        path.parent.mkdir(exist_ok=True)
        path.write_text((EXAMPLES / "allgather.pln").read_text())
        source = pipeline.load_source(str(path))
        assert source.filename == str(path) and source.text == path.read_text()
    assert pipeline.prepare(str(braces), world_size=2).schedule.collective == "allgather"
    missing = str(tmp_path / "run{2}" / "ag.pln")
    with pytest.raises(PurlinError) as info:
        pipeline.load_source(missing)
    assert info.value.message == f"no such file: {missing}"
    with pytest.raises(PurlinError) as info:
        pipeline.compile("exa\x00mples.pln", world_size=2)
    assert info.value.message == "cannot read 'exa\\x00mples.pln': a path cannot contain a NUL byte"


@pytest.mark.parametrize("trace", ["no", "0", 1, None])
def test_prepare_refuses_a_trace_that_is_not_a_bool_as_a_load_does(trace):
    """bool("no") is True: prepare(trace="no") built traced kernels, where load() refuses it."""
    from purlinc.runtime.options import LoadOptions

    with pytest.raises(PurlinError) as info:
        pipeline.prepare(EXAMPLES / "allgather.pln", world_size=2, trace=trace)
    assert info.value.message == f"trace must be True or False, got {trace!r}"
    if trace is not None:  # None is the load's "not given" (PURLIN_TRACE decides)
        with pytest.raises(PurlinError) as info_load:
            LoadOptions.of(trace=trace)
        assert info_load.value.message == info.value.message


@pytest.mark.parametrize("kw, message", [
    ({"overrides": "abc"}, "overrides must map lowering option names to values, e.g. {'channels': 2}; got 'abc' (str)"),
    ({"overrides": 5}, "overrides must map lowering option names to values, e.g. {'channels': 2}; got 5 (int)"),
    ({"overrides": {1: 2}}, "overrides must map lowering option names (strings) to values, e.g. {'channels': 2}; "
                            "got the name 1 (int)"),
    ({"options": 5}, "options must be a LowerOptions (purlinc.snac.ir), got 5 (int)"),
    ({"options": {"channels": 2}}, "options must be a LowerOptions (purlinc.snac.ir), got {'channels': 2} (dict)"),
    ({"options": LowerOptions(algorithm="rign")}, "unknown algorithm 'rign'"),
])
def test_pipeline_arguments_of_the_wrong_type_are_named(kw, message):
    """A ValueError from dict(), a TypeError from sorting or an AttributeError from .key() said
    nothing of which argument was wrong."""
    with pytest.raises(PurlinError) as info:
        pipeline.prepare(EXAMPLES / "allgather.pln", world_size=2, **kw)
    assert info.value.message == message


def test_options_may_name_their_algorithm(cache_dir):
    """LowerOptions(algorithm="ring") is built without complaint: the pipeline looks the name up."""
    compiled = pipeline.prepare(EXAMPLES / "allgather.pln", world_size=2, options=LowerOptions(algorithm="ring"))
    assert compiled.schedule.options.algorithm is Algorithm.RING
    assert compiled.key == pipeline.prepare(EXAMPLES / "allgather.pln", world_size=2,
                                            options=LowerOptions(algorithm=Algorithm.RING)).key


def test_options_are_checked_before_they_key_the_memo(cache_dir):
    """LowerOptions(registered=["in"]) keyed as the frozenset did: whichever came first was kept
    for both (a valid call then raised the other's refusal, or the list passed).  packed="no"
    lowered an LL schedule.  A NumPy integer is an integer, as for world sizes and params."""
    import numpy as np

    from purlinc.snac.ir import LowerOptions

    for bad, message in ((LowerOptions(registered=["in"]), "registered must be a set of 'in' and/or 'out', got ['in']"),
                         (LowerOptions(packed="no"), "packed must be True or False, got 'no'")):
        with pytest.raises(PurlinError, match=re.escape(message)):
            pipeline.prepare(EXAMPLES / "allreduce.pln", world_size=4, options=bad)
    good = pipeline.prepare(EXAMPLES / "allreduce.pln", world_size=4, options=LowerOptions(registered=frozenset({"in"})))
    assert good.schedule.options.registered == frozenset({"in"})
    with pytest.raises(PurlinError, match=re.escape("got ['in']")):  # still refused after the good one
        pipeline.prepare(EXAMPLES / "allreduce.pln", world_size=4, options=LowerOptions(registered=["in"]))
    numpy = pipeline.prepare(EXAMPLES / "allreduce.pln", world_size=4, options=LowerOptions(channels=np.int64(2)))
    assert numpy is pipeline.prepare(EXAMPLES / "allreduce.pln", world_size=4, options=LowerOptions(channels=2))
    assert numpy.schedule.options.key().startswith("direct-push/c2/")


def test_a_schedule_json_that_is_not_one_says_what_is_wrong():
    """Bare KeyErrors and AttributeErrors came from deep inside; a registered 'in' was read as
    the set of its letters and verified; a schedule named for another collective verified."""
    import copy

    from purlinc.snac.format import schedule_from_json, schedule_to_json
    from purlinc.snac.verify import verify

    compiled = pipeline.prepare(EXAMPLES / "allreduce.pln", world_size=2)
    good = schedule_to_json(compiled.schedule)
    assert schedule_from_json(copy.deepcopy(good)) == compiled.schedule

    def broken(edit):
        data = copy.deepcopy(good)
        edit(data)
        with pytest.raises(ValueError) as caught:
            schedule_from_json(data)
        return str(caught.value)

    assert broken(lambda d: d.pop("options")) == "schedule JSON: 'options' is missing"
    assert broken(lambda d: d["options"].__setitem__("registered", "in")) == (
        "schedule JSON: options: registered must be a list of 'in' and/or 'out', got 'in'")
    assert broken(lambda d: d["options"].__setitem__("packed", "no")) == (
        "schedule JSON: options: packed must be True or False, got 'no'")
    assert broken(lambda d: d.__setitem__("world_size", "2")) == "schedule JSON: world_size must be an integer, got '2'"
    with pytest.raises(ValueError, match="expected an object, got str"):
        schedule_from_json("{}")
    renamed = schedule_from_json({**copy.deepcopy(good), "collective": "other"})
    with pytest.raises(PurlinError, match="it is 'other', the spec 'allreduce'"):
        verify(renamed, compiled.spec)


@pytest.mark.parametrize("call, message", [
    (lambda: pipeline.parse_stage(str(EXAMPLES / "allreduce.pln")), "parse_stage: source must be a SourceText, got str"),
    (lambda: pipeline.spec_stage("x", 4, None), "spec_stage: definition must be a CollectiveDef, got str"),
    (lambda: pipeline.snac_stage(pipeline.spec_of(pipeline.load_source(EXAMPLES / "allreduce.pln"), 2, {}), None),
     "snac_stage: options must be a LowerOptions, got NoneType"),
])
def test_a_stage_given_the_wrong_kind_of_argument_names_it(call, message):
    """Each went on to an AttributeError deep inside ('str' object has no attribute 'text')."""
    with pytest.raises(PurlinError) as caught:
        call()
    assert caught.value.message == message


def test_verify_with_its_arguments_swapped_says_so():
    from purlinc.snac.verify import verify

    compiled = pipeline.prepare(EXAMPLES / "allreduce.pln", world_size=2)
    with pytest.raises(PurlinError, match=r"verify\(schedule, spec\) takes a Schedule and a Spec, got Spec and Schedule"):
        verify(compiled.spec, compiled.schedule)


def test_a_numpy_integer_keys_as_the_int_it_equals(cache_dir):
    """params={'root': np.int64(1)} and overrides={'channels': np.int64(2)} keyed by repr
    ('np.int64(1)'): a second Compiled and compile for the same collective."""
    import numpy as np

    one = pipeline.prepare(EXAMPLES / "broadcast.pln", world_size=4, params={"root": 1}, overrides={"channels": 2})
    assert pipeline.prepare(EXAMPLES / "broadcast.pln", world_size=4, params={"root": np.int64(1)},
                            overrides={"channels": np.int64(2)}) is one
