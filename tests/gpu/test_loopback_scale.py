"""Node scale on one GPU (issue 25): every example and many-unit user spec at R = 2, 3, 4, 5, 8
(16 for two), in loopback groups, every rank bit for bit against the SNAC simulator of the
schedule that ran, outputs poisoned first.  The matrix and its precompile: tests/gpu/scale.py.

Cases whose kernels the precompile step did not finish within its budget
($OUT/loopback_scale_compiled.json), and cases past PURLIN_SCALE_RUN_S, are skipped with that
reason; $OUT/loopback_scale.json and .md count every case by outcome, so what did not run is
visible.  Also here: the fresh-process first call of the 16-unit all-reduce at R=8 (the hang),
the refusal of a group call that cannot be resident, and million-element calls at R=8."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import scale  # noqa: E402
from _common import (  # noqa: E402
    LoopbackGroups, capture_per_rank, check_group_call, compare_outputs, inputs_for, on_rank_streams, poison, rank_runs,
    replay_per_rank, simulated, to_torch, torch_dtype,
)
from purlinc.dtypes import DType, ReduceOp  # noqa: E402

pytestmark = [pytest.mark.gpu]
DEVICE = 0
OUT = Path(os.environ.get("OUT", "/tmp/purlin_gpu_suite"))
RUN_BUDGET_S = float(os.environ.get("PURLIN_SCALE_RUN_S", "330"))
RESULTS: list[dict] = []
_START = time.time()
_GROUPS = LoopbackGroups(DEVICE)


_COMPILED: dict = {}


def _compiled_manifest() -> dict | None:
    """The precompile step's report (read once), or None when it did not run."""
    if "manifest" not in _COMPILED:
        path = OUT / "loopback_scale_compiled.json"
        _COMPILED["manifest"] = json.loads(path.read_text()) if path.exists() else None
    return _COMPILED["manifest"]


def _compiled_ids(manifest: dict) -> set:
    if "ids" not in _COMPILED:
        _COMPILED["ids"] = set(manifest["checks"]["compiled"])
    return _COMPILED["ids"]


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield
    _GROUPS.close()
    write_summary(RESULTS, _compiled_manifest(), OUT)


def _load(case):
    import purlinc
    from purlinc.errors import PurlinError
    from purlinc.runtime.collective import prepare

    source, params = scale.source_of(case.spec), scale.params_for(case.spec, case.world)
    options = dict(case.options)
    if options:
        try:
            prepare(source, case.world, params=params, **options)
        except PurlinError as error:
            _record(case, "n/a")
            pytest.skip(f"n/a: {str(error).splitlines()[0]}")
    return purlinc.load(source, _GROUPS.get(case.world), params=params, **options)


def _gate(case):
    """Skip (and record why) a case past the run budget or not precompiled within the compile
    budget; issue 25's own cases (priority -1: the R=8 first call, the refusal, the million-element
    calls at R=8) always run, compiling if need be."""
    if case.priority < 0:
        return
    if time.time() - _START > RUN_BUDGET_S:
        _record(case, "not run: past the step's run budget")
        pytest.skip("past PURLIN_SCALE_RUN_S")
    manifest = _compiled_manifest()
    if manifest is not None:
        lists = manifest["checks"]
        if case.id in lists["not_applicable"]:
            _record(case, "n/a")
            pytest.skip(f"n/a: {lists['not_applicable'][case.id]}")
        if case.id not in _compiled_ids(manifest) and case.id not in manifest["errors"]:
            _record(case, "not run: not precompiled within the compile budget")
            pytest.skip("not precompiled within PURLIN_SCALE_COMPILE_S")


def _record(case, outcome, **extra):
    RESULTS.append({"id": case.id, "kind": case.kind, "world": case.world, "spec": case.spec, "outcome": outcome,
                    **extra})


def _first_call_case(case):
    """Issue 25's hang: the 16-unit all-reduce at R=8, first group call of a fresh process
    (count 1; float32 and bfloat16 in two cases), by a plain load and with its bucket pinned.  Every rank's
    kernel stack is reserved when the kernels are loaded, so no launch grows it (a launch
    that did would wait for the ranks already running, which wait for it)."""
    options = dict(case.options)
    (_, dtype, _), = case.calls
    command = [sys.executable, str(Path(scale.__file__)), "first-call", case.spec, str(case.world), json.dumps(options),
               dtype]
    env = {k: v for k, v in os.environ.items() if k != "PURLIN_PRECOMPILE"}  # a user's plain load, defaults
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    name = f"loopback_first_call_{'pinned' if options else 'plain'}_{dtype}.json"
    (OUT / name).write_text(json.dumps(report, indent=1))
    for call in report["calls"]:
        assert call["stack_after_launch"] == call["stack_after_load"], report
    return [[1, call["dtype"], "sum", f"stack {call['stack_after_load']} bytes"] for call in report["calls"]]


def _refuse_case(case):
    """264 channels (the tuned table's large all-reduce on an H200) x 8 ranks cannot be
    resident on one GPU's SMs (blocks of 256 threads or more: at most 8 per SM): the call is
    refused before anything runs, and the group goes on working with a load that fits."""
    from purlinc.runtime.errors import ResidencyError

    import purlinc

    (count, dtype, op), = case.calls
    dtype = DType.parse(dtype)
    group = _GROUPS.get(case.world)
    coll = _load(case)
    try:
        spec = coll[0].compiled.spec
        inputs = inputs_for(spec, count, dtype, np.random.default_rng(case.seed))
        xs = [to_torch(inputs[r], dtype, DEVICE) for r in range(case.world)]
        with pytest.raises(ResidencyError, match=r"needs 2,112 blocks resident at once on cuda:0") as caught:
            coll(xs, streams=group.streams)
        assert coll[0].variant(dtype, ReduceOp.parse(op)).block >= 256
        assert caught.value.needed == 2112 and caught.value.limit < 2112
        assert all(getattr(c, "failed", None) is None for c in group.comms)
    finally:
        coll.close()
    fits = purlinc.load(scale.source_of(case.spec), group, **dict(scale.FITS_AFTER_REFUSAL))
    try:
        key = check_group_call(fits, group.streams, DEVICE, count, dtype, op, np.random.default_rng(2),
                               f"{case.id} after refusal").compiled.options.key()
    finally:
        fits.close()
    refused = f"refused: {caught.value.needed} > {caught.value.limit}"
    return [[count, dtype.value, op, refused], [count, dtype.value, op, key]]


@pytest.mark.parametrize("case", scale.cases(), ids=lambda c: c.id)
def test_case(case):
    """One case of the matrix (scale.cases(), in its priority order, so a budget cuts the tail)."""
    _gate(case)
    special = {"graph": _graph_case, "first": _first_call_case, "refuse": _refuse_case}.get(case.kind)
    if special is not None:
        try:
            calls = special(case)
        except BaseException as error:
            if not isinstance(error, pytest.skip.Exception):
                _record(case, "failed", error=f"{type(error).__name__}: {str(error)[:400]}")
            raise
        _record(case, "passed", calls=calls)
        return
    start = time.time()
    calls = []
    try:
        coll = _load(case)
    except BaseException as error:
        if not isinstance(error, pytest.skip.Exception):
            _record(case, "failed", error=f"load: {type(error).__name__}: {str(error)[:400]}")
        raise
    try:
        units = getattr(coll[0], "units", 1)
        buckets = getattr(coll, "buckets", None)
        rng = np.random.default_rng(case.seed)
        for count, dtype, op in scale.case_calls(case, buckets, units):
            dtype = DType.parse(dtype)
            label = f"{case.id}/n={count}/{dtype.value}/{op}"
            schedule = check_group_call(coll, _GROUPS.get(case.world).streams, DEVICE, count, dtype, op, rng,
                                        label).compiled.options.key()
            calls.append([count, dtype.value, op, schedule])
    except BaseException as error:
        _record(case, "failed", calls=calls, error=f"{type(error).__name__}: {str(error)[:400]}",
                seconds=round(time.time() - start, 2))
        raise
    finally:
        coll.close()
    _record(case, "passed", calls=calls, seconds=round(time.time() - start, 2))


def _graph_case(case):
    """Per-rank CUDA graphs of two calls each, replayed on the ranks' own streams with fresh
    inputs (each replay checked).  A group call on the same buffers comes first, checked too:
    per-rank captures that run the registered twin (graphbuffers.py: sizes the tuned load
    serves unpacked) find the peers' buffers through it."""
    (count, dtype, op), = case.calls
    dtype = DType.parse(dtype)
    coll = _load(case)
    group = _GROUPS.get(case.world)
    try:
        runs = rank_runs(coll, 0, count, dtype.itemsize)
        spec = runs.compiled.spec
        rng = np.random.default_rng(case.seed)
        inputs = inputs_for(spec, count, dtype, rng)
        xs = [to_torch(inputs[r], dtype, DEVICE) for r in range(spec.world_size)]
        outs = [torch.empty(len(spec.outputs[r]) * count, dtype=torch_dtype(dtype), device=f"cuda:{DEVICE}")
                for r in range(spec.world_size)]
        for o in outs:
            poison(o)
        on_rank_streams(group.streams, DEVICE, lambda: coll(xs, outs, op=op, streams=group.streams, count=count))
        coll.check()
        want = simulated(runs, spec, inputs, count, dtype, ReduceOp.parse(op) if spec.is_reduce else None)
        compare_outputs(spec, outs, want, dtype, f"{case.id} group call")
        def calls(r):
            for _ in range(2):
                coll[r](xs[r], outs[r], op=op)
        graphs = capture_per_rank(group.streams, calls)
        for it in range(3):
            inputs = inputs_for(spec, count, dtype, rng)
            for r in range(spec.world_size):
                xs[r].copy_(to_torch(inputs[r], dtype, DEVICE))
                poison(outs[r])
            replay_per_rank(graphs, group.streams, DEVICE)
            coll.check()
            want = simulated(runs, spec, inputs, count, dtype, ReduceOp.parse(op) if spec.is_reduce else None)
            compare_outputs(spec, outs, want, dtype, f"{case.id} replay {it}")
    finally:
        coll.close()
    return [[count, dtype.value, op, f"graph x3: {runs.compiled.options.key()}"]]


# ------------------------------------------------------------------------------------------
# summary

def write_summary(results: list[dict], manifest: dict | None, out: Path) -> None:
    """$OUT/loopback_scale.json (every case) and .md (counts by kind, R and outcome)."""
    counts: dict = {}
    for row in results:
        key = (row["kind"], row["world"])
        counts.setdefault(key, {}).setdefault(row["outcome"], 0)
        counts[key][row["outcome"]] += 1
    calls = sum(len(r.get("calls", [])) for r in results if r["outcome"] == "passed")
    passed = sum(r["outcome"] == "passed" for r in results)
    ran = sum(r["outcome"] in ("passed", "failed") for r in results)
    body = {"passed": passed, "total": ran, "cases_in_matrix": len(scale.cases()), "recorded": len(results),
            "calls_checked": calls,
            "precompile": {k: v for k, v in (manifest or {}).items() if k != "checks"},
            "by_kind_and_world": {f"{k}/R{w}": v for (k, w), v in sorted(counts.items())},
            "failed": [r for r in results if r["outcome"] == "failed"],
            "checks": results}  # every case (gpu_summary.py leaves "checks" out of summary.json)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loopback_scale.json").write_text(json.dumps(body, indent=1))
    outcomes = sorted({o for v in counts.values() for o in v})
    lines = ["# Loopback scale (one GPU, ranks sharing it)", "",
             f"{len(results)} of {len(scale.cases())} cases recorded; {calls} calls checked bit for bit "
             "against the SNAC simulator of the schedule that ran.", "",
             "| kind | R | " + " | ".join(outcomes) + " |", "|---|---|" + "---|" * len(outcomes)]
    for (kind, world), by in sorted(counts.items()):
        lines.append(f"| {kind} | {world} | " + " | ".join(str(by.get(o, 0)) for o in outcomes) + " |")
    if body["failed"]:
        lines += ["", "## Failed", ""] + [f"- {r['id']}: {r.get('error', '')[:300]}" for r in body["failed"]]
    (out / "loopback_scale.md").write_text("\n".join(lines) + "\n")
