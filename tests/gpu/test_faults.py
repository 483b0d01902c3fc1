"""Faults: disagreements between ranks end in MismatchError before anything is launched
(group calls, on two GPUs and in loopback on one; torchrun at first use), a timeout stops the
communicator with a clear error (two GPUs and loopback), the ce watchdog bounds a stuck
copy-engine wait (two GPUs: the ce atom needs a GPU per rank), and under torchrun a rank that
exits in the middle of a loop makes the other raise PurlinTimeoutError and exit, with no hang
and no process left behind (tests/gpu/fault_check.py, run by torchrun under `timeout`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _launch import torchrun_command  # noqa: E402
from _common import EXAMPLES, expected, inputs_for, on_rank_streams, poison, to_numpy, to_torch  # noqa: E402
from purlinc.dtypes import DType  # noqa: E402

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent
DEVICES = [0, 1]
# Group faults on two GPUs, and in loopback (two ranks sharing GPU 0: the same kernels,
# signals and host checks, so they run where one GPU is all there is).
GROUPS = [pytest.param([0, 1], id="two-gpus", marks=pytest.mark.multigpu), pytest.param([0, 0], id="loopback")]


def _sync(devices=DEVICES):
    for d in set(devices):
        torch.cuda.synchronize(d)


def _allgather(group, **options):
    import purlinc

    return purlinc.load(EXAMPLES / "allgather.pln", group, **options)


def _poisoned(n, dtype, device):
    out = torch.empty(n, dtype=dtype, device=f"cuda:{device}")
    poison(out)
    return out


def _record(key, value):
    out = os.environ.get("PURLIN_RESULTS")
    if out:
        path = os.path.join(out, "fault_results.json")
        data = json.load(open(path)) if os.path.exists(path) else {}
        data[key] = value
        json.dump(data, open(path, "w"), indent=1)


def _group_call(group, coll, xs, outs) -> None:
    """A group call, then the devices synchronized: in loopback each rank on its own stream
    (ranks that share a GPU run at the same time), ordered after the current stream."""
    if len(set(group.devices)) == len(group.devices):
        coll(xs, outs)
        _sync(group.devices)
        return
    streams = [torch.cuda.Stream(device=d) for d in group.devices]
    on_rank_streams(streams, group.devices[0], lambda: coll(xs, outs, streams=streams))


def _kind(group) -> str:
    return "loopback" if len(set(group.devices)) == 1 else "two_gpus"


@pytest.fixture(params=GROUPS)
def group(request):
    import purlinc

    devices = request.param
    g = purlinc.LocalGroup(devices, share_devices=devices[0] == devices[1])
    yield g
    g.close()


@pytest.mark.parametrize("case", ["dtype", "count"])
def test_group_call_mismatch_is_refused_before_launch(group, case):
    from purlinc import MismatchError

    coll = _allgather(group, algorithm="direct-push")
    d0, d1 = group.devices
    try:
        x0 = torch.randn(1000, device=f"cuda:{d0}", dtype=torch.bfloat16)
        if case == "dtype":
            x1 = torch.randn(1000, device=f"cuda:{d1}", dtype=torch.float32)
            outs = [_poisoned(2000, torch.bfloat16, d0), _poisoned(2000, torch.float32, d1)]
        else:
            x1 = torch.randn(999, device=f"cuda:{d1}", dtype=torch.bfloat16)
            outs = [_poisoned(2000, torch.bfloat16, d0), _poisoned(1998, torch.bfloat16, d1)]
        start = time.perf_counter()
        with pytest.raises(MismatchError) as caught:
            _group_call(group, coll, [x0, x1], outs)
        elapsed = time.perf_counter() - start
        text = str(caught.value)
        want = ("expected bfloat16 (as rank 0), but rank 1 passed float32" if case == "dtype"
                else "expected 1000 elements per chunk (as rank 0), but rank 1 passed 999 elements per chunk")
        assert want in text, text
        assert elapsed < 1.0, elapsed  # no 5 s timeout: refused on the host
        _sync(group.devices)
        for out in outs:  # nothing was launched: the outputs are still poisoned
            assert bool((out.view(torch.uint8) == 0xFF).all())
        # ... and nothing is out of step: a correct call right after works, on fresh data.
        rng = np.random.default_rng(1)
        spec = coll[0].compiled.spec
        inputs = inputs_for(spec, 1000, DType.BFLOAT16, rng)
        xs = [to_torch(a, DType.BFLOAT16, d) for d, a in zip(group.devices, inputs)]
        outs = [_poisoned(2000, torch.bfloat16, d) for d in group.devices]
        _group_call(group, coll, xs, outs)
        coll.check()
        want = expected(spec, inputs, 1000, DType.BFLOAT16, None)
        for r in range(2):
            assert np.array_equal(to_numpy(outs[r], DType.BFLOAT16).view(np.uint16), want[r].view(np.uint16))
        _record(f"group_mismatch_{case}_{_kind(group)}", {"message": text.splitlines()[0], "seconds": round(elapsed, 4)})
    finally:
        coll.close()


def test_timeout_stops_the_communicator(group, monkeypatch):
    from purlinc import PurlinTimeoutError

    monkeypatch.setenv("PURLIN_WAIT_TIMEOUT_S", "0.5")
    coll = _allgather(group, algorithm="direct-push")
    other = _allgather(group, algorithm="direct-pull")
    d0, d1 = group.devices
    try:
        x0, o0 = torch.randn(1000, device=f"cuda:{d0}"), torch.empty(2000, device=f"cuda:{d0}")
        start = time.perf_counter()
        coll[0](x0, o0)  # rank 1 never calls
        torch.cuda.synchronize(d0)
        assert time.perf_counter() - start < 10  # released by the 0.5 s bound, not a hang
        with pytest.raises(PurlinTimeoutError) as first:
            coll.check()
        # Every later use of the group refuses with a clear error: this collective, another
        # one (also on its fast path), and a new load.
        with pytest.raises(PurlinTimeoutError, match="timed out"):
            coll[0](x0, o0)
        with pytest.raises(PurlinTimeoutError, match="communicator stopped after an earlier timeout"):
            other([x0, torch.randn(1000, device=f"cuda:{d1}")])
        with pytest.raises(PurlinTimeoutError, match="communicator stopped after an earlier timeout"):
            _allgather(group, algorithm="direct-push")
        _record(f"timeout_then_refused_{_kind(group)}", {"first": str(first.value).splitlines()[0]})
    finally:
        coll.close()
        other.close()


@pytest.mark.parametrize("options", [dict(packed=True), dict(algorithm="ring"), dict(algorithm="two-shot"),
                                     dict(algorithm="direct-pull", channels=2)],
                         ids=["ll", "ring", "two-shot", "direct-pull-c2"])
def test_loopback_missing_rank_times_out_every_caller(options, monkeypatch):
    """Four ranks on one GPU, the last never calls: each other rank's kernel gives up within
    the bound (an LL receive loop, a ring's chain, a two-shot's second shot, a pull), every
    caller's check names the timeout, and the group closes without a hang."""
    import purlinc
    from purlinc import PurlinTimeoutError

    monkeypatch.setenv("PURLIN_WAIT_TIMEOUT_S", "0.5")
    ranks = 4
    group = purlinc.LocalGroup([0] * ranks, share_devices=True)
    try:
        coll = purlinc.load(EXAMPLES / "allreduce.pln", group, **options)
        streams = [torch.cuda.Stream(device=0) for _ in range(ranks)]
        for r in range(ranks):  # compiled and loaded first: the time below is the waits'
            coll[r].warm("float32")
        start = time.perf_counter()
        for r in range(ranks - 1):  # rank 3 never calls
            with torch.cuda.stream(streams[r]):
                coll[r](torch.randn(4096, device="cuda:0"), torch.empty(4096, device="cuda:0"))
        torch.cuda.synchronize(0)
        elapsed = time.perf_counter() - start
        assert elapsed < 10, elapsed  # three bounded waits at most, one after another
        for r in range(ranks - 1):
            with pytest.raises(PurlinTimeoutError, match=f"rank {r}") as caught:
                coll[r].check()
            assert "timed out" in str(caught.value), caught.value
        _record(f"loopback_missing_rank_{'-'.join(f'{k}={v}' for k, v in options.items())}",
                {"seconds_until_kernels_returned": round(elapsed, 3)})
    finally:
        group.close()


@pytest.mark.multigpu
def test_ce_watchdog_bounds_a_stuck_wait(monkeypatch):
    import purlinc
    from purlinc import PurlinTimeoutError

    monkeypatch.setenv("PURLIN_WAIT_TIMEOUT_S", "1")
    group = purlinc.LocalGroup(DEVICES)
    try:
        coll = _allgather(group, atom="ce", algorithm="direct-push")
        x0, o0 = torch.randn(1000, device="cuda:0"), torch.empty(2000, device="cuda:0")
        start = time.perf_counter()
        coll[0](x0, o0)  # rank 1 never calls: rank 0's copy-engine wait would block for ever
        done = threading.Event()

        def drain():
            torch.cuda.synchronize(0)
            done.set()

        threading.Thread(target=drain, daemon=True).start()
        assert done.wait(20), "the ce stream was not released within 20 s"
        elapsed = time.perf_counter() - start
        with pytest.raises(PurlinTimeoutError) as caught:
            coll.check()
        text = str(caught.value)
        assert "ce atom" in text and "within 1 s" in text and "rank 0" in text, text
        assert 0.9 < elapsed < 10, elapsed
        with pytest.raises(PurlinTimeoutError):
            coll[0](x0, o0)
        _record("ce_watchdog", {"seconds_until_released": round(elapsed, 3), "message": text.splitlines()[0]})
        coll.close()
    finally:
        group.close()


@pytest.mark.multigpu
def test_ce_watchdog_stays_quiet_on_healthy_calls(monkeypatch):
    import purlinc

    monkeypatch.setenv("PURLIN_WAIT_TIMEOUT_S", "1")
    group = purlinc.LocalGroup(DEVICES)
    try:
        coll = _allgather(group, atom="ce", algorithm="direct-push")
        rng = np.random.default_rng(3)
        spec = coll[0].compiled.spec
        for _ in range(200):  # queued far ahead of the GPU, for longer than the bound in all
            inputs = inputs_for(spec, 4096, DType.FLOAT32, rng)
            xs = [to_torch(a, DType.FLOAT32, r) for r, a in enumerate(inputs)]
            outs = [torch.empty(8192, device=f"cuda:{r}") for r in DEVICES]
            coll(xs, outs)
        _sync()
        time.sleep(1.5)
        coll.check()
        want = expected(spec, inputs, 4096, DType.FLOAT32, None)
        for r in DEVICES:
            assert np.array_equal(to_numpy(outs[r], DType.FLOAT32), want[r])
        coll.close()
    finally:
        group.close()


# --- torchrun ------------------------------------------------------------------------------

def _torchrun(mode: str, limit: int, port: int) -> tuple[subprocess.CompletedProcess, float]:
    marker = f"purlin-fault-{mode}-{os.getpid()}"
    command = ["timeout", "--kill-after=10", str(limit), *torchrun_command(HERE / "fault_check.py", 2, port),
               mode, marker]
    env = {**os.environ, "PURLIN_WAIT_TIMEOUT_S": "3"}
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=limit + 30)
    elapsed = time.perf_counter() - start
    print(done.stdout[-4000:])
    print(done.stderr[-4000:], file=sys.stderr)
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes left behind: {left}"
    return done, elapsed


@pytest.mark.multigpu
def test_torchrun_rank_exits_mid_loop():
    done, elapsed = _torchrun("exit", 120, 29561)
    assert done.returncode not in (0, 124, 137), done.returncode  # failed, but not by the outer timeout
    assert "FAULT rank 0: PurlinTimeoutError" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert "FAULT rank 1: left the loop" in done.stdout
    assert elapsed < 90, elapsed
    _record("torchrun_exit", {"returncode": done.returncode, "seconds": round(elapsed, 1),
                              "lines": [l for l in done.stdout.splitlines() if l.startswith("FAULT")]})


@pytest.mark.multigpu
def test_torchrun_mismatch_at_first_use():
    done, elapsed = _torchrun("mismatch", 150, 29563)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        for case in ("dtype", "count", "op", "collective"):
            assert f"FAULT rank {rank}: {case}: MismatchError" in done.stdout, done.stdout[-3000:]
        assert f"FAULT rank {rank}: correct call after the mismatches: ok" in done.stdout
        assert f"FAULT rank {rank}: exchanges per repeated call: 0" in done.stdout
    _record("torchrun_mismatch", {"seconds": round(elapsed, 1),
                                  "lines": [l for l in done.stdout.splitlines() if l.startswith("FAULT")]})
