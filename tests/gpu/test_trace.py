"""Device traces on two (or more) GPUs through a LocalGroup: a traced all-reduce gives correct
results, monotone stamps per channel, and every Wait ends after the Notify it waits for, within
the clock skew the ping-pong alignment measured.  Writes the trace (and its drawing) to
$PURLIN_RESULTS when set, for the README."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from _common import EXAMPLES  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
DEVICES = list(range(torch.cuda.device_count()))


@pytest.fixture(scope="module")
def group():
    import purlinc

    g = purlinc.LocalGroup(DEVICES)
    yield g
    g.close()


def _sync():
    for d in DEVICES:
        torch.cuda.synchronize(d)


def _events_by_step(data):
    out = {}
    for e in data["events"]:
        if e["round"] == 0:
            for s in e["steps"]:
                out[(e["rank"], e["channel"], s)] = e
    return out


@pytest.mark.parametrize("options", [
    {"channels": 2, "slices": 2},
    {"channels": 1, "packed": True},
    {"algorithm": "ring", "channels": 2},
], ids=["push-c2-s2", "push-ll", "ring-c2"])
def test_traced_allreduce(group, options):
    import purlinc
    from purlinc.draw.model import build

    world = len(DEVICES)
    coll = purlinc.load(EXAMPLES / "allreduce.pln", group, trace=True, **options)
    count = 8192
    try:
        for call in range(4):  # a few calls: the trace is the last one's
            xs = [torch.randn(world * count, device=f"cuda:{r}", dtype=torch.float32) for r in range(world)]
            outs = [torch.full_like(x, float("nan")) for x in xs]
            coll(xs, outs)
            _sync()
            want = sum(x.double().cpu() for x in xs)
            for r, out in enumerate(outs):
                got = out.double().cpu()
                assert torch.allclose(got, want, rtol=1e-4, atol=1e-3), f"call {call} rank {r} wrong"
        data = coll.trace()
    finally:
        coll.close()
    schedule = coll[0].compiled.schedule
    assert data["format"] == "purlin-trace" and data["world_size"] == world
    assert len(set(data["calls"])) == 1, f"ranks traced different calls: {data['calls']}"
    clock = {r["rank"]: r for r in data["clock"]["ranks"]}
    for r in range(1, world):
        assert clock[r]["min_rtt_ns"] > 0, f"no round trip measured with rank {r}"
    # Monotone stamps per (rank, channel, round), in raw timer values and in aligned times.
    rows = {}
    for e in data["events"]:
        rows.setdefault((e["rank"], e["channel"], e["round"]), []).append(e)
    assert {(r, c) for r, c, _ in rows} == {(r, c) for r in range(world) for c in range(schedule.channels)}
    for key, events in rows.items():
        events.sort(key=lambda e: e["block"])
        for a, b in zip(events, events[1:]):
            assert a["end_ns"] <= b["start_ns"] + 1e-6 and a["raw"][2] <= b["raw"][2], f"{key}: not monotone"
        assert all(e["start_ns"] <= e["end_ns"] and e["raw"][0] <= e["raw"][2] for e in events), key
    # Causality across GPUs: a wait cannot finish before its notify (or packed stage) started.
    drawing = build(schedule, collapse=False)
    steps = _events_by_step(data)
    worst = []
    for pair in drawing.pairs:
        notify, wait = steps[pair.notify], steps[pair.wait]
        skew = clock[notify["rank"]]["uncertainty_ns"] + clock[wait["rank"]]["uncertainty_ns"]
        slack = wait["end_ns"] - notify["start_ns"]
        worst.append(slack)
        assert slack >= -skew, (f"wait {pair.wait} ended {-slack:.0f} ns before notify {pair.notify} started "
                                f"(skew bound {skew:.0f} ns)")
    assert drawing.pairs and worst
    results = os.environ.get("PURLIN_RESULTS")
    if results:
        out = Path(results)
        out.mkdir(parents=True, exist_ok=True)
        name = "trace_allreduce_" + "_".join(f"{k}{v}" for k, v in options.items())
        (out / f"{name}.json").write_text(json.dumps(data, indent=1))
        from purlinc.draw import svg
        from purlinc.draw.trace import times

        drawn = build(schedule, collapse=False)
        t, measured = times(data, drawn)
        (out / f"{name}.svg").write_text(svg.render([svg.Panel(drawn, t, f"allreduce {name}", measured)]))
        print(f"{name}: min slack {min(worst):.0f} ns, clock {json.dumps(data['clock']['ranks'])}")
