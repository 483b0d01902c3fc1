"""purlinc.moe on ONE GPU: every rank of a loopback LocalGroup (cuda:0, a stream each) at
R = 2..8 runs Dispatcher.dispatch, its local experts and combine, against the plain torch
exchange of tests/moe_reference.py (one row per (token, expert), all_to_all_single with host
split lists, here Purlin's uneven all-to-all of each rank run in the same loopback), bit for
bit, for random routings, a hot rank, a rank with no tokens, and per-rank CUDA graphs of the
whole step replayed with new routings written into the same input tensors.

    python3 -m pytest -q tests/gpu/test_moe.py          # ~2-3 min on one H200 (NVRTC first)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import each_on_own_stream  # noqa: E402
from moe_reference import loopback_reference, routing, scale_expert  # noqa: E402

pytestmark = [pytest.mark.gpu]
DEVICE = 0
WORLDS = (2, 3, 4, 8)
H, K, T = 256, 4, 64


def _setup(R, E, channels=2):
    import purlinc
    from purlinc import moe

    group = purlinc.LocalGroup([DEVICE] * R, share_devices=True)
    streams = [torch.cuda.Stream(device=DEVICE) for _ in range(R)]
    # warmed with the expert: every kernel of the step loaded before one thread issues the ranks
    disps = moe.dispatchers(group, num_experts=E, hidden=H, top_k=K, max_tokens=T, channels=channels,
                            expert=scale_expert)
    # the reference's uneven all-to-all: Purlin's, loaded on the same group (sizes from host lists)
    a2a = purlinc.load(moe.SOURCE, group, capacity=T * K * H, channels=1)
    for r in range(R):
        a2a[r].warm("bfloat16")
        a2a[r].warm("int32")
    return group, streams, disps, a2a


def _on_streams(streams, fns):
    return each_on_own_stream(streams, DEVICE, fns)


def _reference(a2a, streams, R, E, inputs):
    """Each rank's reference, the ranks' host-list all-to-alls issued in lock step."""
    return loopback_reference(a2a, streams, R, E, inputs, DEVICE, scale_expert)


def _step(d, x, ids, w):
    from purlinc import moe

    got = d.dispatch(x, ids, w)
    return d.combine(moe.expert_weighted_sum(got, scale_expert, d.local_experts))


@pytest.mark.parametrize("R", WORLDS, ids=[f"R{w}" for w in WORLDS])
def test_dispatch_combine_against_the_plain_exchange(R):
    E = 2 * R
    group, streams, disps, a2a = _setup(R, E)
    try:
        for trial, skew in enumerate(("random", "one", "random", "empty")):
            inputs = []
            for r in range(R):
                gen = torch.Generator().manual_seed(1000 * trial + r)
                tokens = 0 if skew == "empty" and r == 1 else T - 3 * r
                inputs.append(routing(gen, tokens, H, E, K, torch.bfloat16, f"cuda:{DEVICE}",
                                      "one" if skew == "one" else "random"))
            ys = _on_streams(streams, [lambda r=r: _step(disps[r], *inputs[r]) for r in range(R)])
            group.check()
            for r in range(R):
                disps[r].coll.check()
            want = _reference(a2a, streams, R, E, inputs)
            for r in range(R):
                assert torch.equal(ys[r], want[r]), f"R={R} trial {trial} ({skew}) rank {r}"
                assert inputs[r][0].numel() == 0 or ys[r].abs().sum() > 0
    finally:
        a2a.close()
        group.close()


@pytest.mark.parametrize("R", (2, 4))
def test_graph_replays_the_whole_step_with_new_routings(R):
    """dispatch + experts + combine captured once per rank; replays read the routing the
    input tensors hold then (no host synchronisation anywhere in the step)."""
    E = 2 * R
    group, streams, disps, a2a = _setup(R, E)
    try:
        static = []
        for r in range(R):
            gen = torch.Generator().manual_seed(r)
            static.append(routing(gen, T, H, E, K, torch.bfloat16, f"cuda:{DEVICE}"))
        _on_streams(streams, [lambda r=r: _step(disps[r], *static[r]) for r in range(R)])  # warm-up
        graphs, outs = [], []
        for r in range(R):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=streams[r]):
                outs.append(_step(disps[r], *static[r]))
            graphs.append(g)
        for it in range(4):
            fresh = []
            for r in range(R):
                gen = torch.Generator().manual_seed(500 + 10 * it + r)
                x, ids, w = routing(gen, T, H, E, K, torch.bfloat16, f"cuda:{DEVICE}", "one" if it == 2 else "random")
                for dst, src in zip(static[r], (x, ids, w)):
                    dst.copy_(src)
                fresh.append((x, ids, w))
            torch.cuda.synchronize(DEVICE)
            _on_streams(streams, [lambda r=r: graphs[r].replay() for r in range(R)])
            want = _reference(a2a, streams, R, E, fresh)
            for r in range(R):
                assert torch.equal(outs[r], want[r]), f"graph R={R} replay {it} rank {r}"
    finally:
        a2a.close()
        group.close()
