"""Random collectives (tests/gpu/fuzz_specs.py) through the real kernels in loopback groups on
one GPU: every rank's output, poisoned first, equals the SNAC simulator's bit for bit, for two
calls per case (random counts, dtypes and ops).  Cases whose kernels the precompile step did not
finish in its budget, and cases past PURLIN_FUZZ_RUN_S, are skipped with that reason;
$OUT/fuzz_specs.json counts every case by outcome and gives each failure's seed and spec."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fuzz_specs  # noqa: E402
from _common import LoopbackGroups, check_group_call  # noqa: E402
from purlinc.dtypes import DType  # noqa: E402

pytestmark = [pytest.mark.gpu]
DEVICE = 0
OUT = Path(os.environ.get("OUT", "/tmp/purlin_gpu_suite"))
N_CASES = int(os.environ.get("PURLIN_FUZZ_CASES", "1000"))
RUN_BUDGET_S = float(os.environ.get("PURLIN_FUZZ_RUN_S", "240"))
CASES = fuzz_specs.cases(N_CASES)
RESULTS: list[dict] = []
_START = time.time()
_GROUPS = LoopbackGroups(DEVICE)


def _manifest() -> dict | None:
    path = OUT / "fuzz_specs_compiled.json"
    return json.loads(path.read_text()) if path.exists() else None


MANIFEST = _manifest()


def _record(case, outcome: str, note: str = "") -> None:
    RESULTS.append({"seed": case.seed, "id": case.id, "outcome": outcome, "note": note[:2000],
                    **({"text": case.text} if outcome == "failed" else {})})


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield
    _GROUPS.close()
    counts: dict[str, int] = {}
    for r in RESULTS:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "fuzz_specs.json").write_text(json.dumps(
        {"cases": len(CASES), "counts": counts, "calls_checked": sum(r.get("calls", 0) for r in RESULTS),
         "failures": [r for r in RESULTS if r["outcome"] == "failed"]}, indent=1))


def _gate(case) -> None:
    if time.time() - _START > RUN_BUDGET_S:
        _record(case, "not run: past the run budget")
        pytest.skip("past PURLIN_FUZZ_RUN_S")
    if MANIFEST is None:
        return  # compiled on first use
    checks = MANIFEST["checks"]
    if case.id in checks["n/a"]:
        _record(case, "n/a", MANIFEST["notes"].get(case.id, ""))
        pytest.skip(f"n/a: {MANIFEST['notes'].get(case.id, '')}")
    if case.id not in checks["ok"] and case.id not in checks["error"]:
        _record(case, "not run: not precompiled within the compile budget")
        pytest.skip("not precompiled within PURLIN_FUZZ_COMPILE_S")


def _call(coll, group, case, count: int, dtype: DType, op, rng, pass_count: bool = True) -> None:
    check_group_call(coll, group.streams, DEVICE, count, dtype, op, rng,
                     f"{case.id} count={count} {dtype.value} {op or ''}", pass_count=pass_count)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_random_collective_matches_the_simulator(case):
    import purlinc
    from purlinc.errors import PurlinError

    _gate(case)
    group = _GROUPS.get(case.world)
    try:
        coll = purlinc.load(case.text, group, **dict(case.options))
    except PurlinError as error:
        _record(case, "n/a", str(error).splitlines()[0])
        pytest.skip(f"n/a: {str(error).splitlines()[0]}")
    rng = np.random.default_rng(case.seed)
    try:
        for count, dtype, op in case.calls:
            _call(coll, group, case, count, DType.parse(dtype), op, rng)
    except BaseException as error:
        _record(case, "failed", f"{type(error).__name__}: {error}")
        raise
    finally:
        coll.close()
    _record(case, "passed")
    RESULTS[-1]["calls"] = len(case.calls)


@pytest.mark.parametrize("algorithm", ["ring", "direct-push", "direct-pull"])
def test_ranks_without_chunks(algorithm):
    import purlinc

    group = _GROUPS.get(4)
    coll = purlinc.load(fuzz_specs.CHUNKLESS, group, algorithm=algorithm, channels=2)
    rng = np.random.default_rng(7)
    case = fuzz_specs.FuzzCase(0, 4, fuzz_specs.CHUNKLESS, False)
    try:
        for count, dtype in ((4097, "bfloat16"), (3, "int64")):
            _call(coll, group, case, count, DType.parse(dtype), None, rng, pass_count=False)
    finally:
        coll.close()


# Cases that ran wrong before packet flags were made unique across signals (Schedule.packet_flags):
# each one's second call, at another count, took packets its first call had left in staging.
RAN_WRONG = (5572, 5596, 5859, 5902)


@pytest.mark.parametrize("seed", RAN_WRONG)
def test_cases_that_took_stale_packets(seed):
    import purlinc

    case = fuzz_specs.case(seed)
    group = _GROUPS.get(case.world)
    coll = purlinc.load(case.text, group, **dict(case.options))
    rng = np.random.default_rng(seed)
    try:
        for _ in range(2):
            for count, dtype, op in case.calls:
                _call(coll, group, case, count, DType.parse(dtype), op, rng)
    finally:
        coll.close()


def test_packed_calls_whose_count_changes():
    """One packed schedule whose signals carry 1, 2 and 4 notifies a round, called at counts
    that move its slots around in staging, each call checked."""
    import purlinc

    case = fuzz_specs.case(5902)
    group = _GROUPS.get(case.world)
    coll = purlinc.load(case.text, group, algorithm="direct-push", packed=True, channels=1)
    rng = np.random.default_rng(3)
    try:
        for count in (129, 3, 129, 1, 4097, 2, 65, 3):
            _call(coll, group, case, count, DType.FLOAT16, "sum", rng)
    finally:
        coll.close()


def test_most_random_collectives_ran():
    """Cases are skipped past the budgets (and where options do not apply): a run that
    compiled or reached too few of them checked too little to pass.  Runs after the cases
    (pytest keeps a module's order)."""
    ran = sum(1 for r in RESULTS if r["outcome"] == "passed")
    assert ran >= len(CASES) // 2, f"{ran} of {len(CASES)} random collectives ran: raise PURLIN_FUZZ_COMPILE_S/RUN_S"
