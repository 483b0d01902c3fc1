"""The runtime's inter-node phases (purlinc.runtime.hierarchical) for real, on the CPU: four
processes under torch.distributed with gloo run every inter phase of the examples' plans
(point-to-point lists, the all_reduce path, local reductions) on CPU tensors, and each rank
checks its destination buffer against the phase's moves computed with NumPy."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch")

NAMES = ("allgather", "allreduce", "alltoall", "broadcast", "gather", "reduce", "reduce_scatter", "scatter",
         "allgather_rotated", "alltoall_blocks", "pairwise_exchange", "ring_shift")
WORLD = 4
COUNT = 3


def _worker(rank: int, port: int, repo: str, queue) -> None:
    import torch.distributed as dist

    from purlinc import pipeline
    from purlinc.dtypes import DType, ReduceOp
    from purlinc.frontend.evaluate import reduce_chunks
    from purlinc.runtime.hierarchical import _inter_for
    from purlinc.snac.hierarchy import InterPhase
    from purlinc.snac.hierplan import plan_hierarchical

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    problems = []
    try:
        for G in (1, 2, 4):
            groups = [dist.new_group(ranks=list(range(l, WORLD, G))) for l in range(G)]
            for name in NAMES:
                source = pipeline.load_source(os.path.join(repo, "examples", f"{name}.pln"))
                spec = pipeline.spec_stage(pipeline.parse_stage(source), WORLD, {})
                plan = plan_hierarchical(spec, G)
                for index, phase in enumerate(plan.phases):
                    if not isinstance(phase, InterPhase):
                        continue
                    src_units = plan.layout(phase.src).units
                    dst_units = plan.layout(phase.dst).units
                    # Every rank knows every rank's source buffer (seeded by rank): the reference.
                    def source_of(r):
                        rng = np.random.default_rng(1000 * index + r)
                        return rng.integers(-50, 50, len(src_units[r]) * COUNT).astype(np.int32)
                    sources = [source_of(r) for r in range(WORLD)]
                    want = np.full(len(dst_units[rank]) * COUNT, -7, dtype=np.int32)
                    for m in phase.moves:
                        if m.dst.rank == rank:
                            parts = [sources[s.rank][s.unit * COUNT:(s.unit + 1) * COUNT] for s in m.srcs]
                            want[m.dst.unit * COUNT:(m.dst.unit + 1) * COUNT] = (
                                parts[0] if len(parts) == 1 else reduce_chunks(parts, DType.INT32, ReduceOp.SUM))
                    inter = _inter_for(plan, index, phase, rank, groups[rank % G])
                    views = {phase.src: torch.from_numpy(sources[rank].copy()),
                             phase.dst: torch.full((len(dst_units[rank]) * COUNT,), -7, dtype=torch.int32)}
                    tmp = torch.empty(inter.temps * COUNT, dtype=torch.int32)
                    runner = type("R", (), {"plan": plan, "rank": rank})()
                    from purlinc.runtime.hierarchical import HierarchicalCollective

                    HierarchicalCollective._run_inter(runner, inter, views, tmp, COUNT,
                                                      ReduceOp.SUM if spec.is_reduce else None)
                    got = views[phase.dst].numpy()
                    if not np.array_equal(got, want):
                        problems.append(f"{name} G={G} phase {index} ({phase.nccl}) rank {rank}: {got} != {want}")
        dist.barrier()
    except Exception as error:  # noqa: BLE001 - reported to the test
        problems.append(f"rank {rank}: {type(error).__name__}: {error}")
    finally:
        queue.put((rank, problems))
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(target, world: int, repo_dir, *extra, timeout: int = 240, join: int = 30):
    """Run ``target(rank, *extra, port, repo, queue)`` in ``world`` spawned processes; returns
    ({rank: what it put on the queue}, the processes, joined)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, *extra, port, str(repo_dir), queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=timeout) for _ in range(world))
    for p in procs:
        p.join(timeout=join)
    return results, procs


def test_inter_phases_under_gloo(repo_dir):
    results, procs = _spawn(_worker, WORLD, repo_dir, join=60)
    problems = [p for r in range(WORLD) for p in results[r]]
    assert not problems, "\n".join(problems[:20])
    assert all(p.exitcode == 0 for p in procs)


# (LOCAL_WORLD_SIZE on rank 0, on rank 1 (None: unset), gpus_per_node, collective, params on
# rank 0, on rank 1): each a load that must fail on both ranks alike, before any GPU is touched.
_LOAD_CASES = (
    ("1", "1", 3, "allreduce", {}, {}),  # R=2 not a multiple of the given G
    ("1", "2", None, "allreduce", {}, {}),  # torchrun nodes of unequal size
    ("2", "3", None, "allreduce", {}, {}),  # rank 1 alone finds R=2 no multiple of its G: it used to
    ("1", None, None, "allreduce", {}, {}),  # raise alone, rank 0 waiting in the node check
    ("4", "4", None, "allreduce", {}, {}),  # R not a multiple of torchrun's G
    ("1", "2", 1, "allreduce", {}, {}),  # G given: LOCAL_WORLD_SIZE does not matter (fails at CUDA)
    ("1", "1", 1, "broadcast", {"root": 0}, {"root": 7}),  # one rank cannot plan
    ("1", "1", 1, "broadcast", {"root": 0}, {"root": 1}),  # the ranks plan different collectives
    ("2", "2", 2, "allreduce", {}, {}),  # one node of 2 ranks on two hosts
)


def _topology_worker(rank: int, port: int, repo: str, queue) -> None:
    """Two gloo processes (a short process-group timeout: a rank left waiting fails the test in
    seconds): the load-time refusals, each raised by both ranks from the load's one exchange."""
    import datetime
    import socket as socket_module

    import torch.distributed as dist

    from purlinc.runtime import hierarchical

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=4))
    seen = []
    real = socket_module.gethostname
    try:
        for index, (lws0, lws1, G, name, params0, params1) in enumerate(_LOAD_CASES):
            lws = (lws0, lws1)[rank]
            os.environ.pop("LOCAL_WORLD_SIZE", None)
            if lws is not None:
                os.environ["LOCAL_WORLD_SIZE"] = lws
            if index == len(_LOAD_CASES) - 1:
                socket_module.gethostname = lambda: f"host{rank}"
            options = hierarchical.LoadOptions.of(params=(params0, params1)[rank])
            try:
                hierarchical.load_hierarchical(os.path.join(repo, "examples", f"{name}.pln"), G, options)
                seen.append("loaded")
            except Exception as error:  # noqa: BLE001 - the message is the result
                seen.append(f"{type(error).__name__}: {str(getattr(error, 'message', error)).splitlines()[0]}")
    finally:
        socket_module.gethostname = real
        queue.put((rank, seen))
        dist.destroy_process_group()


def test_load_topology_errors(repo_dir):
    results, _ = _spawn(_topology_worker, 2, repo_dir, timeout=60)
    assert len(results[0]) == len(results[1]) == len(_LOAD_CASES), results
    (multiple, unequal, alone, unset, torchrun_g, given, unplanned, different, hosts) = results[0]
    assert multiple == "TopologyError: world size R=2 is not a multiple of gpus_per_node=3", multiple
    assert unequal == ("TopologyError: nodes of unequal size: the ranks disagree on gpus_per_node: "
                       "rank 0: LOCAL_WORLD_SIZE=1; rank 1: LOCAL_WORLD_SIZE=2"), unequal
    assert alone == ("TopologyError: nodes of unequal size: the ranks disagree on gpus_per_node: "
                     "rank 0: LOCAL_WORLD_SIZE=2; rank 1: LOCAL_WORLD_SIZE=3"), alone
    assert unset == ("TopologyError: nodes of unequal size: the ranks disagree on gpus_per_node: rank 0: "
                     "LOCAL_WORLD_SIZE=1; rank 1: gpus_per_node: not given and LOCAL_WORLD_SIZE (torchrun) is "
                     "not set"), unset
    assert torchrun_g == ("TopologyError: world size R=2 is not a multiple of gpus_per_node=4 "
                          "(torchrun's LOCAL_WORLD_SIZE)"), torchrun_g
    # Past every topology check on both ranks: both fail alike at the first CUDA call (no GPU).
    assert "Error" in given and "Topology" not in given and "Dist" not in given, given
    assert unplanned == "PurlinError: no hierarchical load: rank 1: PurlinError: rank index 'root' is 7, outside 0..1"
    assert different.startswith("MismatchError: the ranks load different collectives (spec, params or world): "
                                "rank 0: broadcast ("), different
    assert hosts.startswith("TopologyError: node 0 (ranks 0..1) spans hosts ['host0', 'host1']"), hosts
    for index, (mine, theirs) in enumerate(zip(results[0], results[1])):
        if index != 6:  # the rank that could not plan raises its own error
            assert mine == theirs, (index, mine, theirs)
    assert results[1][6] == "PurlinError: rank index 'root' is 7, outside 0..1", results[1][6]


def _agreement_worker(rank: int, port: int, repo: str, queue) -> None:
    """Two gloo processes, 2 nodes x 1 GPU: the world-wide agreement on each new (dtype, op,
    count) of a hierarchical call (host only, through the torch store), and the node check that
    every rank makes whatever its environment says."""
    import datetime

    import torch.distributed as dist

    from purlinc.runtime import hierarchical
    from purlinc.runtime.rendezvous import Exchange

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20))
    seen = []
    try:
        plan = hierarchical.plan_for(os.path.join(repo, "examples", "allreduce.pln"), 2, 1)
        store = hierarchical._TorchStore(dist.distributed_c10d._get_default_store(), 20.0)
        world = Exchange(store, rank, 2, prefix="test-agree/world")
        coll = hierarchical.HierarchicalCollective(plan, rank, 0, None, {}, {}, world)
        coll._agree("float32", "sum", 8)
        rounds = world.round
        coll._agree("float32", "sum", 8)  # known: no exchange
        seen.append(f"rounds {rounds} {world.round}")
        cases = (("float32", 9 + rank, None), ("float32" if rank == 0 else "int32", 10, None),
                 ("float32", 11, "OutOfMemoryError: CUDA out of memory" if rank == 1 else None))
        for dtype, count, problem in cases:
            try:
                coll._agree(dtype, "sum", count, problem)
                seen.append("agreed")
            except Exception as error:  # noqa: BLE001 - the message is the result
                seen.append(f"{type(error).__name__}: {getattr(error, 'message', error)}")
        coll._agree("float32", "sum", 11)  # not agreed after the failure: exchanged again
        coll.free_scratch()  # drops the agreements with the scratch: count 8 is exchanged again
        before = world.round
        coll._agree("float32", "sum", 8)
        seen.append(f"again {world.round - before}")
        # A wrong first call on rank 0 (x missing where it gives chunks): rank 0 refuses before the
        # agreement and tells rank 1, which waits there (nothing is agreed yet, so every call is
        # new): rank 1 raised RendezvousTimeout after the exchange's timeout instead.  Once a
        # signature is agreed, rank 1 may be in the phases (a known signature), so no record is
        # left: rank 1, with a new one, times out naming rank 0 (docs/HIERARCHY.md, "Agreement
        # and hangs").
        short = Exchange(store, rank, 2, prefix="test-agree/wrong", timeout=1.0)
        wrong = hierarchical.HierarchicalCollective(plan, rank, "cpu", None, {}, {}, short)
        for later in (False, True):
            if later:
                wrong._agree("float32", "sum", 3)
            try:
                wrong(None if rank == 0 else torch.zeros(6 + 2 * later), count=3 + later, dtype=torch.float32)
            except Exception as error:  # noqa: BLE001
                seen.append(f"{type(error).__name__}: {getattr(error, 'message', error)}")
        # LOCAL_WORLD_SIZE on rank 0 only, one node of 2: both ranks must still check the nodes
        # together (the check used to run only where the variable was set: rank 0 then waited
        # alone in its all-gather), then both fail alike at the first CUDA call (no GPU here).
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        if rank == 0:
            os.environ["LOCAL_WORLD_SIZE"] = "2"
        try:
            hierarchical.load_hierarchical(os.path.join(repo, "examples", "allreduce.pln"), 2)
            seen.append("loaded")
        except Exception as error:  # noqa: BLE001
            seen.append(type(error).__name__)
        dist.barrier()
    except Exception as error:  # noqa: BLE001
        seen.append(f"rank {rank}: {type(error).__name__}: {error}")
    finally:
        queue.put((rank, seen))
        dist.destroy_process_group()


def test_world_agreement_and_node_check(repo_dir):
    results, procs = _spawn(_agreement_worker, 2, repo_dir, timeout=120)
    for rank in range(2):
        assert len(results[rank]) == 8, results[rank]
        rounds, count, dtype, scratch, again, wrong, wrong_later, load = results[rank]
        assert rounds == "rounds 1 1", rounds
        assert count == ("MismatchError: allreduce (hierarchical): the ranks disagree on the count: expected 9 "
                         "elements per chunk (as rank 0), but rank 1 passed 10 elements per chunk"), count
        assert dtype == ("MismatchError: allreduce (hierarchical): the ranks disagree on the dtype: expected "
                         "float32 (as rank 0), but rank 1 passed int32"), dtype
        assert scratch == ("PurlinError: allreduce (hierarchical): no call with 11 elements per chunk: "
                           "rank 1: OutOfMemoryError: CUDA out of memory"), scratch
        assert again == "again 1", again
        refusal = "allreduce (hierarchical) on rank 0: x is required (this rank gives 2 chunk(s)), got None"
        assert wrong == (f"ArgumentError: {refusal}" if rank == 0 else
                         f"PurlinError: allreduce (hierarchical): no call: the call was refused on rank 0: "
                         f"ArgumentError: {refusal}"), wrong
        assert wrong_later.startswith(f"ArgumentError: {refusal}" if rank == 0 else
                                      "RendezvousTimeout: rendezvous round 2: rank 1 waited 1 s for rank 0 of 2"), \
            wrong_later
        # Not a distributed timeout: both ranks got past the node check and failed at CUDA alike.
        assert load == results[0][7] and "Dist" not in load and load != "loaded", load
    assert all(p.exitcode == 0 for p in procs)


class _NodeStandIn:
    """Stands in for an intra phase's Purlin collective on one node: the ranks of the node
    gather their inputs (gloo) and each evaluates the node's sub-spec with NumPy, with the flat
    collective's checks on what it is given (a rank with no chunks passes count= and dtype=,
    and still takes part, as in the real phase's agreement)."""

    def __init__(self, spec, group, local: int):
        self.spec, self.group, self.local = spec, group, local

    def __call__(self, x=None, out=None, op="sum", *, count=None, dtype=None):
        import torch.distributed as dist

        from purlinc.dtypes import DType
        from purlinc.frontend.evaluate import evaluate

        n_in, n_out = len(self.spec.inputs[self.local]), len(self.spec.outputs[self.local])
        assert (x is None) == (n_in == 0) and (out is None) == (n_out == 0), (self.spec.name, x, out)
        assert x is None or x.numel() == n_in * count
        assert out is None or out.numel() == n_out * count
        assert (dtype is not None) == (x is None and out is None)
        kind = (x if x is not None else out).dtype if dtype is None else dtype
        dt = {torch.int32: DType.INT32, torch.float32: DType.FLOAT32}[kind]
        mine = x.numpy().copy() if x is not None else np.zeros(0, dtype=np.int32)
        values = [mine]
        if self.group is not None:
            values = [None] * self.spec.world_size
            dist.all_gather_object(values, mine, group=self.group)
        result = evaluate(self.spec, values, count, dt, op if self.spec.is_reduce else None)[self.local]
        if out is not None:
            out.copy_(torch.from_numpy(result))
        return out


def _call_worker(rank: int, world: int, G: int, port: int, repo: str, queue) -> None:
    """nodes x G ranks under gloo: every standard collective called exactly as the benchmark
    calls purlin/hierarchical (benchmarks/purlin_api.call, count=, x or out None where the rank
    has none), intra phases stood in for on the CPU, inter phases and the agreement for real;
    every rank's output against the evaluator."""
    import sys

    import torch.distributed as dist

    from purlinc.dtypes import DType
    from purlinc.frontend.evaluate import evaluate
    from purlinc.runtime import hierarchical
    from purlinc.runtime.rendezvous import Exchange

    sys.path.insert(0, os.path.join(repo, "benchmarks"))
    import purlin_api

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    problems = []
    try:
        node, local = divmod(rank, G)
        # every rank creates every group, in the same order (torch requires it)
        by_local = [dist.new_group(ranks=list(range(l, world, G))) for l in range(G)]
        by_node = [dist.new_group(ranks=list(range(n * G, n * G + G))) for n in range(world // G)] if G > 1 else None
        store = hierarchical._TorchStore(dist.distributed_c10d._get_default_store(), 30.0)
        for serial, name in enumerate(NAMES[:8]):
            plan = hierarchical.plan_for(os.path.join(repo, "examples", f"{name}.pln"), world, G)
            spec = plan.spec
            intra = {i: _NodeStandIn(plan.canonical[plan.phases[i].schedules[node]],
                                     by_node[node] if by_node else None, local)
                     for i in hierarchical.intra_sources(plan, node)}
            inter = {i: hierarchical._inter_for(plan, i, p, rank, by_local[local]) for i, p in enumerate(plan.phases)
                     if isinstance(p, hierarchical.InterPhase)}
            exchange = Exchange(store, rank, world, prefix=f"test-call/{serial}")
            coll = hierarchical.HierarchicalCollective(plan, rank, "cpu", None, intra, inter, exchange)
            for count in (4, 7):
                rng = np.random.default_rng(17 * count + serial)  # the same on every rank
                ins = [rng.integers(-1000, 1000, len(spec.inputs[r]) * count).astype(np.int32) for r in range(world)]
                want = evaluate(spec, ins, count, DType.INT32, "sum" if spec.is_reduce else None)[rank]
                # the benchmark's buffers: X = the root's input size, Y = the root's output size
                n_in = max(len(u) for u in spec.inputs)
                n_out = max(len(u) for u in spec.outputs)
                X = torch.zeros(n_in * count, dtype=torch.int32)
                X[:ins[rank].size] = torch.from_numpy(ins[rank])
                Y = torch.full((n_out * count,), -7, dtype=torch.int32)
                purlin_api.call(coll, name, X, Y, rank=rank, root=0, reduce=spec.is_reduce, count=count)
                if len(spec.outputs[rank]):
                    got = Y.numpy()[:want.size]
                    if not np.array_equal(got, want):
                        problems.append(f"{name} {world // G}x{G} count {count} rank {rank}: {got} != {want}")
        dist.barrier()
    except Exception as error:  # noqa: BLE001 - reported to the test
        import traceback

        problems.append(f"rank {rank}: {type(error).__name__}: {error}\n{traceback.format_exc()}")
    finally:
        queue.put((rank, problems))
        dist.destroy_process_group()


@pytest.mark.parametrize("world,G", [(2, 1), (4, 2)])
def test_calls_as_the_benchmark_makes_them(repo_dir, world, G):
    results, procs = _spawn(_call_worker, world, repo_dir, world, G)
    problems = [p for r in range(world) for p in results[r]]
    assert not problems, "\n".join(problems[:10])
    assert all(p.exitcode == 0 for p in procs)
