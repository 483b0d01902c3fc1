"""purlinc.moe on the CPU: Dispatcher.dispatch / combine on R threads through the stand-in
all-to-all with run-time sizes of test_torch_sized_cpu, against a plain torch exchange
(tests/moe_reference.py: one row per (token, expert), all_to_all_single with host split lists),
for random routings, a hot rank (every token's experts on rank 0 first), zero tokens, and
replays with new routings on the same buffers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from moe_reference import reference_moe, routing, scale_expert  # noqa: E402
from purlinc import moe  # noqa: E402
from purlinc.runtime.errors import ArgumentError  # noqa: E402
from test_torch_sized_cpu import StandIn, World, groups, on_ranks  # noqa: E402


class Coll(StandIn):
    def warm(self, dtype):
        pass


def _setup(R, E, H, k, T):
    world = World(moe.SOURCE, R)
    gs = groups(R, capacity=1 << 30)
    disps = [moe.Dispatcher(Coll(world, r, 1 << 40), rank=r, world_size=R, num_experts=E, hidden=H, top_k=k,
                            max_tokens=T) for r in range(R)]
    return gs, disps


@pytest.mark.parametrize("R, E, k, H, ids_dtype, weights_dtype", [
    (1, 4, 2, 8, torch.int64, torch.float32), (2, 8, 3, 8, torch.int64, torch.float32),
    (3, 6, 2, 8, torch.int32, torch.bfloat16), (4, 16, 4, 8, torch.int64, torch.float32),
    (2, 8, 2, 7, torch.int32, torch.float32),  # an odd hidden: the ids and weights are not 4-byte aligned
])
def test_dispatch_combine_equals_the_plain_exchange(R, E, k, H, ids_dtype, weights_dtype):
    T = 12
    gs, disps = _setup(R, E, H, k, T)
    for trial, skew in enumerate(("random", "one", "random", "zero")):
        def step(rank, g):
            gen = torch.Generator().manual_seed(100 * trial + rank)
            tokens = 0 if skew == "zero" and rank == 0 else T - rank
            x, ids, w = routing(gen, tokens, H, E, k, torch.bfloat16, "cpu", "one" if skew == "one" else "random")
            ids, w = ids.to(ids_dtype), w.to(weights_dtype)  # integer weights: exact in bfloat16
            d = disps[rank]
            got = d.dispatch(x, ids, w)
            partial = moe.expert_weighted_sum(got, scale_expert, d.local_experts)
            y = d.combine(partial)
            want = reference_moe(lambda o, i, os, is_: g.all_to_all_single(o, i, os, is_), R, x, ids, w,
                                 scale_expert, E)
            return y, want, got, x
        for rank, (y, want, got, x) in enumerate(on_ranks(gs, step)):
            assert torch.equal(y, want), f"R={R} trial {trial} ({skew}) rank {rank}"
            assert x.numel() == 0 or y.abs().sum() > 0  # a real result, not zeros on both sides
            n = int(got.rows)
            assert (got.expert_ids[n:] == -1).all() and (got.weights[n:] == 0).all()
            assert ((got.expert_ids[:n] >= 0).any(1)).all()  # every received row has an expert here


def test_dispatch_sends_a_token_once_per_rank():
    """A token whose top-k experts all live on one rank is one row there, not k."""
    R, E, k, H, T = 2, 8, 4, 4, 3
    gs, disps = _setup(R, E, H, k, T)

    def step(rank, g):
        x = torch.ones(T, H, dtype=torch.bfloat16) * (rank + 1)
        ids = torch.tensor([[0, 1, 2, 3]] * T)  # rank 0's experts only
        got = disps[rank].dispatch(x, ids, torch.ones(T, k))
        return got.counts.tolist(), int(got.rows)
    counts = on_ranks(gs, step)
    assert counts[0] == ([T, T], 2 * T) and counts[1] == ([0, 0], 0)


class Counting(Coll):
    exchanges = 0

    def __call__(self, *args, **kwargs):
        Counting.exchanges += 1
        return super().__call__(*args, **kwargs)


def test_warm_runs_the_step_without_an_exchange_and_leaves_no_routing_behind():
    """warm() runs the step's own kernels (and the expert's) once with no exchange: on a GPU,
    CUDA loads a kernel at its first launch and waits for running kernels, a deadlock where one
    thread issues every rank.  The steps after it equal the plain exchange."""
    R, E, k, H, T = 2, 4, 2, 8, 6
    world, gs = World(moe.SOURCE, R), groups(R, capacity=1 << 30)
    disps = [moe.Dispatcher(Counting(world, r, 1 << 40), rank=r, world_size=R, num_experts=E, hidden=H, top_k=k,
                            max_tokens=T) for r in range(R)]
    seen = []
    Counting.exchanges = 0
    for d in disps:
        d.warm(lambda e, rows: seen.append(e) or scale_expert(e, rows))
    assert Counting.exchanges == 0 and sorted(set(seen)) == [0, 1]
    assert all(int(d.counts.sum()) == 0 and d._tokens == 0 for d in disps)

    def step(rank, g):
        x, ids, w = routing(torch.Generator().manual_seed(rank), T - rank, H, E, k, torch.bfloat16, "cpu")
        d = disps[rank]
        y = d.combine(moe.expert_weighted_sum(d.dispatch(x, ids, w), scale_expert, d.local_experts))
        want = reference_moe(lambda o, i, os, is_: g.all_to_all_single(o, i, os, is_), R, x, ids, w,
                             scale_expert, E)
        return torch.equal(y, want)
    assert on_ranks(gs, step) == [True, True]
    assert Counting.exchanges == 2 * R


def test_bad_arguments():
    d = moe.Dispatcher(Coll(World(moe.SOURCE, 1), 0, 1 << 20), rank=0, world_size=1, num_experts=2, hidden=4,
                       top_k=2, max_tokens=3)
    with pytest.raises(ArgumentError, match=r"x is \(4, 4\) torch.bfloat16, expected \(T, 4\) torch.bfloat16 with T <= max_tokens = 3"):
        d.dispatch(torch.zeros(4, 4, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 2))
    with pytest.raises(ArgumentError, match=r"topk_ids is \(2, 3\)"):
        d.dispatch(torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 2))
    with pytest.raises(ArgumentError, match="Dispatcher: num_experts=4 does not split over world_size=3 ranks"):
        moe.Dispatcher(None, rank=0, world_size=3, num_experts=4, hidden=4, top_k=1, max_tokens=1)
    assert moe.row_elements(7168, 8, torch.bfloat16) == 7168 + 32
    assert moe.capacity_for(7168, 8, 4096) == 4096 * 7200


def test_arguments_of_another_kind_or_device_are_refused_by_name():
    """Non-tensors raised AttributeError; a tensor off the Dispatcher's device raised torch's
    error from inside the routing (on a GPU: a CPU x indexed by CUDA rows); integer or complex
    weights were cast into the rows' float32 (the imaginary part dropped, ids and weights swapped
    not noticed)."""
    on_meta = moe.Dispatcher(None, rank=0, world_size=1, num_experts=4, hidden=8, top_k=2, max_tokens=4,
                             device="meta")
    d = moe.Dispatcher(Coll(World(moe.SOURCE, 1), 0, 1 << 20), rank=0, world_size=1, num_experts=4, hidden=8,
                       top_k=2, max_tokens=4)
    x, ids, w = torch.zeros(3, 8, dtype=torch.bfloat16), torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.ones(3, 2)
    cases = [
        (on_meta.dispatch, (x, ids, w), r"dispatch: x is on cpu, expected meta \(the device of this Dispatcher's buffers\)"),
        (d.dispatch, (x.float().numpy(), ids, w), "dispatch: x must be a torch.Tensor, got ndarray"),
        (d.dispatch, (x, ids.tolist(), w), "dispatch: topk_ids must be a torch.Tensor, got list"),
        (d.dispatch, (x, ids, None), "dispatch: topk_weights must be a torch.Tensor, got NoneType"),
        (d.dispatch, (x, ids, w.to(torch.complex64)),
         r"dispatch: topk_weights has dtype torch.complex64, expected a real floating dtype"),
        (d.dispatch, (x, ids, ids), r"dispatch: topk_weights has dtype torch.int64, expected a real floating dtype"),
        (on_meta.combine, (torch.zeros(4, 8, dtype=torch.bfloat16),),
         r"combine: partial is on cpu, expected meta \(the device of this Dispatcher's buffers\)"),
        (d.combine, ([[0.0] * 8] * 4,), "combine: partial must be a torch.Tensor, got list"),
    ]
    for call, args, message in cases:
        with pytest.raises(ArgumentError, match=message):
            call(*args)
    assert int(d.counts.sum()) == 0  # nothing routed


def test_a_collective_too_small_for_max_tokens_is_refused_when_the_dispatcher_is_made():
    """A capacity under capacity_for(...) was taken: a busy step's rows over it were moved as
    size 0 (those tokens lost) and the SizeError came only with the next exchange."""
    need = moe.capacity_for(8, 2, 4)
    with pytest.raises(ArgumentError, match=rf"Dispatcher: the collective's capacity is {need - 1} elements per rank "
                                            rf"pair, expected at least {need} \(max_tokens=4 rows of 16 elements: "
                                            r"moe.capacity_for\(hidden, top_k, max_tokens, dtype\)\)"):
        moe.Dispatcher(Coll(World(moe.SOURCE, 1), 0, need - 1), rank=0, world_size=1, num_experts=4, hidden=8,
                       top_k=2, max_tokens=4)
    moe.Dispatcher(Coll(World(moe.SOURCE, 1), 0, need), rank=0, world_size=1, num_experts=4, hidden=8, top_k=2,
                   max_tokens=4)


@pytest.mark.parametrize("args, message", [
    ((-8, 2, 4), r"capacity_for: hidden=-8, expected an int >= 1"),
    ((8, 0, 4), r"capacity_for: top_k=0, expected an int >= 1"),
    ((8, 2, 0), r"capacity_for: max_tokens=0, expected an int >= 1"),
    ((8, 2, 4, torch.float64), r"capacity_for: dtype=torch.float64, expected one of float32, float16, bfloat16"),
    ((8, 2, 4, torch.int32), r"capacity_for: dtype=int32, expected a floating dtype"),
])
def test_capacity_for_refuses_sizes_the_dispatcher_refuses(args, message):
    with pytest.raises(ArgumentError, match=message):
        moe.capacity_for(*args)


@pytest.mark.parametrize("change, message", [
    ({"num_experts": 0}, r"num_experts=0, expected an int >= 1"),
    ({"world_size": 0}, r"world_size=0, expected an int >= 1"),
    ({"top_k": 0}, r"top_k=0, expected an int >= 1"),
    ({"top_k": 5}, r"top_k=5, expected at most num_experts=4"),
    ({"max_tokens": 0}, r"max_tokens=0, expected an int >= 1"),
    ({"max_tokens": -1}, r"max_tokens=-1, expected an int >= 1"),
    ({"hidden": 0}, r"hidden=0, expected an int >= 1"),
    ({"rank": 2}, r"rank=2, expected a rank in \[0, 2\)"),
    ({"num_experts": 3}, "num_experts=3 does not split over world_size=2 ranks"),
    ({"dtype": torch.float64}, r"dtype=torch.float64, expected one of float32, float16, bfloat16(, float8_\w+)*$"),
    ({"dtype": torch.int32}, r"Dispatcher: dtype=int32, expected a floating dtype \(combine sums"),
    ({"dtype": "bfloat16"}, r"Dispatcher: dtype='bfloat16' \(str\), expected a torch.dtype such as torch.bfloat16"),
    ({"num_experts": 4.0}, r"num_experts=4.0, expected an int >= 1"),
])
def test_bad_sizes_are_refused_before_anything_is_allocated(change, message):
    args = dict(rank=0, world_size=2, num_experts=4, hidden=8, top_k=2, max_tokens=4)
    with pytest.raises(ArgumentError, match=message):
        moe.Dispatcher(None, **{**args, **change})


def test_numpy_integers_are_sizes():
    import numpy as np

    d = moe.Dispatcher(None, rank=np.int64(0), world_size=np.int32(2), num_experts=np.int64(4), hidden=8, top_k=2,
                       max_tokens=4, device="meta")
    assert type(d.num_experts) is int and d.local_experts == 2
    assert moe.capacity_for(np.int64(8), 2, 4) == moe.capacity_for(8, 2, 4)


def test_combine_before_any_dispatch_is_refused():
    """It was: an exchange of nothing and a (0, H) result, without a word."""
    d = moe.Dispatcher(Coll(World(moe.SOURCE, 1), 0, 1 << 20), rank=0, world_size=1, num_experts=4, hidden=8,
                       top_k=2, max_tokens=4)
    d.warm()  # leaves no routing behind, so still nothing to combine
    with pytest.raises(ArgumentError, match=r"combine: no dispatch\(\) has run on this Dispatcher"):
        d.combine(torch.zeros(4, 8, dtype=torch.bfloat16))
    got = d.dispatch(torch.ones(1, 8, dtype=torch.bfloat16), torch.tensor([[0, 1]]), torch.ones(1, 2))
    assert tuple(d.combine(got.tokens.contiguous()).shape) == (1, 8)


def test_combine_says_what_is_wrong_with_partial_and_out_dtype():
    d = moe.Dispatcher(Coll(World(moe.SOURCE, 1), 0, 1 << 20), rank=0, world_size=1, num_experts=4, hidden=8,
                       top_k=2, max_tokens=4)
    got = d.dispatch(torch.zeros(3, 8, dtype=torch.bfloat16), torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.ones(3, 2))
    with pytest.raises(ArgumentError, match=r"combine: partial is not contiguous \(strides"):
        d.combine(got.tokens)  # a view of the wider received rows
    partial = got.tokens.contiguous()
    with pytest.raises(ArgumentError, match=r"combine: out_dtype='float32' \(str\), expected a torch.dtype"):
        d.combine(partial, out_dtype="float32")
    with pytest.raises(ArgumentError, match=r"combine: out_dtype=int32, expected a floating dtype"):
        d.combine(partial, out_dtype=torch.int32)
    assert d.combine(partial, out_dtype=torch.float32).dtype == torch.float32


def test_expert_ids_out_of_range_are_refused_on_the_host():
    """Ids on the host are checked (no device synchronisation); a -1 or an id past the experts
    would otherwise index out of the routing's tensors."""
    d = moe.Dispatcher(Coll(World(moe.SOURCE, 1), 0, 1 << 20), rank=0, world_size=1, num_experts=4, hidden=8,
                       top_k=2, max_tokens=4)
    x, w = torch.zeros(3, 8, dtype=torch.bfloat16), torch.ones(3, 2)
    for bad, message in ((4, r"topk_ids\[1, 0\] = 4, expected an expert id in \[0, 4\)"),
                         (-1, r"topk_ids\[1, 0\] = -1, expected an expert id in \[0, 4\)")):
        ids = torch.tensor([[0, 1], [bad, 3], [1, 2]])
        with pytest.raises(ArgumentError, match=message):
            d.dispatch(x, ids, w)
    assert int(d.counts.sum()) == 0  # nothing routed


def test_expert_ids_out_of_range_on_the_device_are_dropped_not_scattered_out_of_bounds():
    """Ids on the GPU are not checked (class doc); the routing scattered their destination rank
    (-1, or R and more) into a [T, R] mask, which on the GPU is a device-side assert: the
    process's CUDA context gone while its peers wait in the exchange.  Such a slot is dropped:
    the token goes to the ranks of its other experts, and the sum has the other slots only."""
    R, E, k, H, T = 2, 4, 2, 8, 4
    gs, disps = _setup(R, E, H, k, T)
    ids = torch.tensor([[0, -1], [4, 3], [2, 7], [-5, 1]])  # 4..7 and negatives: no expert

    def step(rank, g):
        d = disps[rank]
        d._check_ids = lambda topk_ids: None  # as for ids on the GPU
        x = torch.arange(T * H, dtype=torch.float32).view(T, H).to(torch.bfloat16) + rank
        w = torch.tensor([[1.0, 2.0]] * T)
        got = d.dispatch(x, ids, w)
        y = d.combine(moe.expert_weighted_sum(got, scale_expert, d.local_experts))
        valid = (ids >= 0) & (ids < E)
        want = reference_moe(lambda o, i, os, is_: g.all_to_all_single(o, i, os, is_), R, x,
                             torch.where(valid, ids, 0), torch.where(valid, w, 0), scale_expert, E)
        return y, want, got.counts.tolist()

    for rank, (y, want, counts) in enumerate(on_ranks(gs, step)):
        assert torch.equal(y, want), f"rank {rank}"
        assert counts == [2, 2]  # tokens 0 and 3 to rank 0 (1 and 2 had none there), 1 and 2 to rank 1


def test_inputs_that_require_grad_are_refused():
    """The exchange has no backward: combine's result came out without grad, and the
    persistent send buffer joined the autograd graph (keeping x alive between steps).  Under
    no_grad the same tensors are fine."""
    d = moe.Dispatcher(Coll(World(moe.SOURCE, 1), 0, 1 << 20), rank=0, world_size=1, num_experts=4, hidden=8,
                       top_k=2, max_tokens=4)
    x, ids, w = torch.ones(3, 8, dtype=torch.bfloat16), torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.ones(3, 2)
    for args, label in (((x.clone().requires_grad_(), ids, w), "x"), ((x, ids, w.clone().requires_grad_()), "topk_weights")):
        with pytest.raises(ArgumentError, match=rf"dispatch: {label} requires grad, but dispatch and combine have no "
                                                 rf"gradient"):
            d.dispatch(*args)
        assert not d.send.requires_grad
    with torch.no_grad():
        got = d.dispatch(x.clone().requires_grad_(), ids, w)
    partial = got.tokens.contiguous().clone().requires_grad_()
    with pytest.raises(ArgumentError, match="combine: partial requires grad"):
        d.combine(partial)


class _HostComm:
    """One rank of a torchrun communicator's host side: ``allgather`` through a barrier."""

    def __init__(self, rank, world_size, board, barrier):
        self.rank, self.world_size, self.local_group = rank, world_size, None
        self._board, self._barrier = board, barrier

    def allgather(self, obj):
        self._board[self.rank] = obj
        self._barrier.wait()
        seen = list(self._board)
        self._barrier.wait()
        return seen


class _RankColl(Coll):
    def __init__(self, world, rank, capacity, comm):
        super().__init__(world, rank, capacity)
        self.comm = comm


def _build_on_threads(R, sizes_of):
    """Every rank's Dispatcher built on its own thread with ``sizes_of(rank)``; returns each
    rank's Dispatcher or the error its construction raised."""
    import threading

    from rank_threads import on_threads

    world, board, barrier = World(moe.SOURCE, R), [None] * R, threading.Barrier(R, timeout=30)

    def build(rank):
        comm = _HostComm(rank, R, board, barrier)
        try:
            return moe.Dispatcher(_RankColl(world, rank, 1 << 40, comm), rank=rank, world_size=R, **sizes_of(rank))
        except Exception as error:  # noqa: BLE001 - every rank's outcome is the result
            return error
    return on_threads(R, build, barrier.abort)


SIZES = dict(num_experts=12, hidden=16, top_k=2, max_tokens=4)  # 12 experts split over 2 or 3 ranks


@pytest.mark.parametrize("field, other", [("max_tokens", 8), ("hidden", 32), ("top_k", 4), ("num_experts", 24),
                                          ("dtype", torch.float32)])
def test_ranks_built_with_other_sizes_are_refused_on_every_rank(field, other):
    """Under torchrun a rank whose Dispatcher has other sizes would send rows its peers'
    buffers do not hold: every rank's construction raises, naming the field and each rank's value."""
    from purlinc.runtime.errors import MismatchError

    mine = str(SIZES.get(field, "bfloat16"))
    theirs = str(other).removeprefix("torch.")
    outcomes = _build_on_threads(3, lambda rank: dict(SIZES, **{field: other}) if rank == 2 else SIZES)
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, MismatchError), f"rank {rank}: {outcome!r}"
        assert (f"Dispatcher: the ranks disagree on {field}: rank 0 {mine}, rank 1 {mine}, rank 2 {theirs}"
                in str(outcome))


def test_ranks_built_with_the_same_sizes_agree():
    outcomes = _build_on_threads(2, lambda rank: SIZES)
    assert all(isinstance(d, moe.Dispatcher) for d in outcomes), outcomes


def test_a_rank_or_world_size_other_than_the_collectives_is_refused():
    comm = _HostComm(1, 2, [None, None], None)
    coll = _RankColl(World(moe.SOURCE, 2), 1, 1 << 40, comm)
    with pytest.raises(ArgumentError, match=r"Dispatcher: rank=0, world_size=2, but the collective is rank 1 of 2"):
        moe.Dispatcher(coll, rank=0, world_size=2, **SIZES)
    with pytest.raises(ArgumentError, match=r"Dispatcher: rank=1, world_size=4, but the collective is rank 1 of 2"):
        moe.Dispatcher(coll, rank=1, world_size=4, **SIZES)


def test_an_unpicked_experts_inf_does_not_reach_the_sum():
    """expert_weighted_sum multiplied every expert's output by a weight of 0 where a row had not
    picked it: an expert that gave inf there made the row NaN."""
    gs, (d,) = _setup(1, 2, 4, 1, 2)

    def step(rank, g):
        got = d.dispatch(torch.ones(2, 4, dtype=torch.bfloat16), torch.tensor([[0], [0]]), torch.ones(2, 1))
        partial = moe.expert_weighted_sum(got, lambda e, rows: rows * 2 if e == 0 else rows * float("inf"), 2)
        return d.combine(partial)

    (y,) = on_ranks(gs, step)
    assert torch.equal(y, torch.full((2, 4), 2.0, dtype=torch.bfloat16))


def test_warm_between_dispatch_and_combine_leaves_no_dispatch_to_combine():
    """warm() replaced the routing but left the dispatch flag: combine returned (0, H) without a word."""
    gs, (d,) = _setup(1, 4, 8, 2, 4)

    def step(rank, g):
        got = d.dispatch(torch.ones(3, 8, dtype=torch.bfloat16), torch.tensor([[0, 1], [2, 3], [1, 2]]),
                         torch.ones(3, 2))
        partial = moe.expert_weighted_sum(got, scale_expert, 4)
        d.warm()
        with pytest.raises(ArgumentError, match="no dispatch"):
            d.combine(partial)
        return True

    assert on_ranks(gs, step) == [True]


def test_dispatchers_check_every_size_before_loading(monkeypatch):
    """num_experts that does not split over the ranks was refused by the Dispatcher, after the
    load had taken staging and loaded a kernel on every rank (and nothing closed it)."""
    import purlinc

    monkeypatch.setattr(purlinc, "load", lambda *args, **kwargs: pytest.fail("loaded before the sizes were checked"))
    group = type("Group", (), {"__len__": lambda self: 2, "comms": ()})()
    with pytest.raises(ArgumentError, match="num_experts=3 does not split over world_size=2 ranks"):
        moe.dispatchers(group, num_experts=3, hidden=8, top_k=2, max_tokens=4)
    with pytest.raises(ArgumentError, match="top_k=5, expected at most num_experts=4"):
        moe.dispatchers(group, num_experts=4, hidden=8, top_k=5, max_tokens=4)


def test_the_dispatcher_takes_the_collectives_device():
    """With device=None its buffers were on the CPU beside a collective on cuda:0: the first
    dispatch failed, naming an internal send buffer "x"."""
    class OnCuda1(Coll):
        device = 1

    coll = OnCuda1(World(moe.SOURCE, 1), 0, 1 << 20)
    with pytest.raises(ArgumentError, match=r"Dispatcher: device='cpu', but the collective runs on cuda:1"):
        moe.Dispatcher(coll, rank=0, world_size=1, num_experts=2, hidden=4, top_k=1, max_tokens=2, device="cpu")
    with pytest.raises(ArgumentError, match=r"device='cuda:0', but the collective runs on cuda:1"):
        moe.Dispatcher(coll, rank=0, world_size=1, num_experts=2, hidden=4, top_k=1, max_tokens=2, device="cuda:0")
    assert moe._device_of(coll, None) == moe._device_of(coll, "cuda") == torch.device("cuda", 1)
