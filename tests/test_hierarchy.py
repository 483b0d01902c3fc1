"""Hierarchical plans (nodes x G ranks): derived from the spec, proved, and simulated to the
evaluator's answer, for the standard and user-defined examples.

Copies are compared bitwise.  Reductions add node partials first, so float results differ
from the evaluator by rounding (compared with a tolerance); int32 sum wraps and is
associative, and max is order-free, so those are compared bitwise.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import pytest

from purlinc import pipeline
from purlinc.cli import main
from purlinc.errors import PurlinError
from purlinc.frontend.ast import Operation
from purlinc.frontend.evaluate import evaluate
from purlinc.snac.hiercheck import simulate_plan, verify_plan
from purlinc.snac.hierarchy import InterPhase, IntraPhase, Move, Topology, TopologyError, Unit, format_plan
from purlinc.snac.hierplan import plan_hierarchical
from purlinc.snac.ir import Algorithm, LowerOptions
from purlinc.snac.verify import VerificationError

STANDARD = ("allgather", "allreduce", "alltoall", "broadcast", "gather", "reduce", "reduce_scatter", "scatter")
USER = ("allgather_rotated", "alltoall_blocks", "pairwise_exchange", "ring_shift")
SMALL = ((2, 1), (2, 2), (4, 2), (2, 4))
BIG = ((9, 8),)
HUGE = ((32, 8),)


def _spec(repo_dir, name: str, world_size: int, **params):
    source = pipeline.load_source(repo_dir / "examples" / f"{name}.pln")
    return pipeline.spec_stage(pipeline.parse_stage(source), world_size, params)


def _inputs(spec, count: int, dtype: str, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)

    def fresh(n: int) -> np.ndarray:
        if dtype == "int32":
            return rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32)
        return rng.standard_normal(n).astype(np.float32)

    if not spec.replicated:
        return [fresh(len(layout) * count) for layout in spec.inputs]
    # 'copy replicated' promises identical producers: one value per chunk name
    values: dict = {}
    return [np.concatenate([values.setdefault(c, fresh(count)) for c in layout] or [fresh(0)])
            for layout in spec.inputs]


def _check(spec, gpus_per_node: int, *, count: int = 3, seed: int = 0, options=None, schedules=True):
    """Plan, prove and simulate ``spec``; compare with the evaluator.  Returns the plan."""
    plan = plan_hierarchical(spec, gpus_per_node, options)
    verify_plan(plan, schedules=schedules)
    if spec.is_reduce:
        cases = [("int32", "sum", True), ("int32", "max", True), ("float32", "sum", False)]
    else:
        cases = [("float32", None, True)]
    for dtype, op, exact in cases:
        inputs = _inputs(spec, count, dtype, seed)
        got = simulate_plan(plan, inputs, count, dtype, op, seed=seed)
        want = evaluate(spec, inputs, count, dtype, op)
        for rank, (g, w) in enumerate(zip(got, want)):
            if exact:
                assert g.tobytes() == w.tobytes(), f"rank {rank}, {dtype} {op}: {g} != {w}"
            else:
                # Partials round once per phase: a few ulps of the largest partial sum.
                tolerance = 1e-5 * spec.world_size
                np.testing.assert_allclose(g, w, rtol=tolerance, atol=tolerance, err_msg=f"rank {rank}")
        _holders_agree(spec, got, count, f"{dtype} {op}")
    return plan


def _holders_agree(spec, outputs, count: int, label: str) -> None:
    """Every rank holding a chunk holds the same bits (what verify_plan's agreement proves)."""
    first: dict = {}
    for rank, layout in enumerate(spec.outputs):
        for position, chunk in enumerate(layout):
            bits = outputs[rank][position * count:(position + 1) * count].tobytes()
            held = first.setdefault(chunk, (rank, bits))
            assert held[1] == bits, f"{label}: {chunk} differs between rank {held[0]} and rank {rank}"


@pytest.mark.parametrize("nodes,G", SMALL)
@pytest.mark.parametrize("name", STANDARD + USER)
def test_small_plans_verify_and_simulate(repo_dir, name, nodes, G):
    _check(_spec(repo_dir, name, nodes * G), G)


@pytest.mark.parametrize("name", ("broadcast", "gather", "reduce", "scatter"))
@pytest.mark.parametrize("nodes,G", ((2, 2), (4, 2), (3, 4)))
def test_rooted_collectives_with_every_root(repo_dir, name, nodes, G):
    for root in range(nodes * G):
        _check(_spec(repo_dir, name, nodes * G, root=root), G, seed=root)


@pytest.mark.parametrize("nodes,G", BIG)
@pytest.mark.parametrize("name", STANDARD + USER)
def test_big_plans_verify_and_simulate(repo_dir, name, nodes, G):
    start = time.process_time()
    _check(_spec(repo_dir, name, nodes * G), G, count=2, schedules=False)
    assert time.process_time() - start < 60, "a (9, 8) case should take a few seconds"


@pytest.mark.slow
@pytest.mark.parametrize("nodes,G", HUGE)
@pytest.mark.parametrize("name", STANDARD + USER)
def test_huge_plans_verify_and_simulate(repo_dir, name, nodes, G):
    _check(_spec(repo_dir, name, nodes * G), G, count=1, schedules=False)


def test_huge_allreduce_plan_verifies(repo_dir):
    """R = 256 all-reduce, proved (not simulated: the evaluator alone takes half a minute there)."""
    plan = plan_hierarchical(_spec(repo_dir, "allreduce", 256), 8)
    verify_plan(plan, schedules=False)
    assert [getattr(p, "nccl", "intra") for p in plan.phases] == ["intra", "all_reduce", "intra"]


@pytest.mark.parametrize("name,kinds", [
    ("allreduce", ["intra", "all_reduce", "intra"]),
    ("reduce_scatter", ["intra", "reduce_scatter", "intra"]),
    ("reduce", ["intra", "reduce", "intra"]),
    ("allgather", ["all_gather", "intra"]),
    ("broadcast", ["broadcast", "intra"]),
    ("gather", ["gather", "intra"]),
    ("scatter", ["scatter", "intra"]),
    ("alltoall", ["send_recv", "intra"]),
    ("pairwise_exchange", ["intra"]),  # pairs stay inside nodes of 2: no network at all
])
def test_decompositions(repo_dir, name, kinds):
    plan = plan_hierarchical(_spec(repo_dir, name, 8), 2)
    assert [getattr(p, "nccl", "intra") for p in plan.phases] == kinds


@pytest.mark.parametrize("name,world,G,kind", [
    ("scatter", 4, 2, "scatter"), ("gather", 8, 4, "gather"), ("broadcast", 8, 4, "broadcast"),
    ("allgather", 4, 2, "all_gather"), ("alltoall", 4, 2, "send_recv"), ("ring_shift", 4, 2, "send_recv"),
])
def test_two_node_phases_are_named_by_what_stays_local(repo_dir, name, world, G, kind):
    """Between two nodes a single transfer fits several NCCL names (every sent unit reaches
    "all" other nodes): the part that stays on its rank tells them apart (the root keeps what it
    broadcasts or scatters, the gatherer its own, every rank what it all-gathers; a swap keeps
    nothing it sends).  They were all broadcast or all_gather."""
    plan = plan_hierarchical(_spec(repo_dir, name, world), G)
    assert [p.nccl for p in plan.phases if isinstance(p, InterPhase)] == [kind]


def test_allreduce_is_reduce_scatter_all_reduce_all_gather(repo_dir):
    plan = plan_hierarchical(_spec(repo_dir, "allreduce", 8), 4)
    first, middle, last = plan.phases
    # intra reduce-scatter: each local rank owns R / G = 2 chunks of its node
    assert isinstance(first, IntraPhase) and first.operation is Operation.REDUCE
    assert all(len(units) == 2 for units in plan.layout("partial").units)
    # inter all-reduce of the shards, within each local index
    assert isinstance(middle, InterPhase) and len(middle.moves) == 8 * 2
    assert all(len(m.srcs) == 2 and {s.rank % 4 for s in m.srcs} == {m.dst.rank % 4} for m in middle.moves)
    # one schedule shape per phase, shared by both nodes
    assert first.schedules == (0, 0) and last.schedules == (1, 1)


def test_one_node_and_one_gpu_per_node(repo_dir):
    _check(_spec(repo_dir, "allreduce", 4), 4)  # one node: the network phase is local copies
    _check(_spec(repo_dir, "alltoall", 4), 1)  # one GPU per node: every exchange is NCCL


def test_intra_options_apply_where_they_can(repo_dir):
    spec = _spec(repo_dir, "allreduce", 8)
    plan = _check(spec, 2, options=LowerOptions(Algorithm.RING, channels=2, slices=2))
    assert {s.options.algorithm for s in plan.schedules} == {Algorithm.RING}
    plan = _check(spec, 4, options=LowerOptions(Algorithm.TWO_SHOT, channels=2))
    # two-shot applies to no phase here (each chunk has one consumer per phase): direct-push
    assert {s.options.key() for s in plan.schedules} == {"direct-push/c2/s1/slotsall/reg-"}
    # ... with every other option as asked, as if direct-push had been (slots: a bound on
    # staging the user chose; it was dropped without a word)
    asked = dict(channels=2, slices=2, slots=1, registered=frozenset({"in"}))
    fell_back = _check(spec, 4, options=LowerOptions(Algorithm.TWO_SHOT, **asked))
    direct = _check(spec, 4, options=LowerOptions(Algorithm.DIRECT_PUSH, **asked))
    assert [s.options for s in fell_back.schedules] == [s.options for s in direct.schedules]
    assert {s.options.slots for s in fell_back.schedules} == {1}


@pytest.mark.parametrize("world_size,G", [(6, 4), (3, 2), (7, 8)])
def test_world_size_not_a_multiple_of_gpus_per_node(repo_dir, world_size, G):
    with pytest.raises(TopologyError, match=f"R={world_size} is not a multiple of gpus_per_node={G}"):
        plan_hierarchical(_spec(repo_dir, "allreduce", world_size), G)


def test_gpus_per_node_must_be_positive():
    with pytest.raises(TopologyError, match="gpus_per_node must be an integer >= 1, got 0"):
        Topology.of(4, 0)


def _replace_phase(plan, index, phase):
    phases = list(plan.phases)
    phases[index] = phase
    return dataclasses.replace(plan, phases=tuple(phases))


def test_verifier_rejects_a_dropped_contribution(repo_dir):
    plan = plan_hierarchical(_spec(repo_dir, "allreduce", 4), 2)
    inter = plan.phases[1]
    moves = list(inter.moves)
    moves[0] = Move(moves[0].dst, moves[0].srcs[:1], moves[0].chunk)
    bad = _replace_phase(plan, 1, dataclasses.replace(inter, moves=tuple(moves)))
    with pytest.raises(VerificationError, match=r"r0\.out\[0\] should be x\[0\]"):
        verify_plan(bad)


def test_verifier_rejects_a_chunk_reduced_in_another_order_on_one_node(repo_dir):
    """Node 1 adds the three node partials of x[0] in reverse: every holder still has the same
    multiset, but not the same bits (the simulation shows it), so the plan is refused."""
    spec = _spec(repo_dir, "allreduce", 6)
    plan = plan_hierarchical(spec, 2)
    inter = plan.phases[1]
    moves = list(inter.moves)
    i = next(k for k, m in enumerate(moves) if str(m.chunk) == "x[0]" and m.dst.rank == 2)
    assert len(moves[i].srcs) == 3
    moves[i] = Move(moves[i].dst, moves[i].srcs[::-1], moves[i].chunk)
    bad = _replace_phase(plan, 1, dataclasses.replace(inter, moves=tuple(moves)))
    with pytest.raises(VerificationError, match=r"r2\.out\[0\] \(x\[0\]\) is reduced in another order than "
                                                r"r0\.out\[0\]"):
        verify_plan(bad)
    inputs = _inputs(spec, 1000, "float32", 3)
    got = simulate_plan(bad, inputs, 1000, "float32", "sum")
    with pytest.raises(AssertionError, match="x\\[0\\] differs between rank 0 and rank 2"):
        _holders_agree(spec, got, 1000, "float32 sum")


def test_verifier_rejects_a_move_across_local_indices(repo_dir):
    plan = plan_hierarchical(_spec(repo_dir, "allgather", 4), 2)
    inter = plan.phases[0]
    moves = list(inter.moves)
    moves[1] = Move(moves[1].dst, (Unit(1 - moves[1].dst.rank % 2, 0),), moves[1].chunk)
    bad = _replace_phase(plan, 0, dataclasses.replace(inter, moves=tuple(moves)))
    with pytest.raises(VerificationError, match="mixes local indices"):
        verify_plan(bad)


def test_verifier_rejects_a_missing_phase(repo_dir):
    plan = plan_hierarchical(_spec(repo_dir, "allreduce", 4), 2)
    bad = dataclasses.replace(plan, phases=plan.phases[::2])
    with pytest.raises(VerificationError, match="before anything wrote it"):
        verify_plan(bad)


def test_verifier_rejects_a_schedule_of_another_shape(repo_dir):
    plan = plan_hierarchical(_spec(repo_dir, "allreduce", 4), 2)
    last = plan.phases[2]
    bad = _replace_phase(plan, 2, dataclasses.replace(last, schedules=(0, 0)))
    with pytest.raises(VerificationError, match="not the shape schedule #0 was proved for"):
        verify_plan(bad)


def test_format_shows_nccl_steps(repo_dir):
    text = format_plan(plan_hierarchical(_spec(repo_dir, "allreduce", 4), 2))
    assert "phase 1: inter-node NCCL all_reduce (reduce) partial -> reduced: 8 moves, 8 over the network" in text
    assert "NCCL r0.reduced[0] = r0.partial[0] + r2.partial[0]  (x[0])" in text
    assert "phase 0: intra-node SNAC reduce in -> partial" in text


def test_cli_dump_snac_hierarchical(capsys, repo_dir):
    assert main(["dump", str(repo_dir / "examples/broadcast.pln"), "-R", "4", "-s", "snac", "--gpus-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "hierarchical broadcast (R=4 = 2 nodes x 2 GPUs, copy)" in out
    assert "NCCL r2.mid[0] = r0.in[0]  (x)" in out


def test_cli_dump_json(capsys, repo_dir):
    import json

    assert main(["dump", str(repo_dir / "examples/allreduce.pln"), "-R", "4", "-s", "snac", "--gpus-per-node", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [p["kind"] for p in data["phases"]] == ["intra", "nccl", "intra"]
    assert data["phases"][1]["moves"][0] == {"dst": [0, 0], "srcs": [[0, 0], [2, 0]], "chunk": "x[0]"}


def test_cli_check_hierarchical(capsys, repo_dir):
    assert main(["check", str(repo_dir / "examples/alltoall.pln"), "-R", "1..8", "--gpus-per-node", "2"]) == 0
    assert "4 hierarchical plans (2 GPUs per node) verified" in capsys.readouterr().out


def test_cli_check_hierarchical_names_the_sizes_it_has_no_plan_for(capsys, repo_dir):
    """R=1, 3, 5, 7 are not multiples of 2: no plan is made there, and "ok for R=1..8" alone
    read as if every size had been planned and proven (as check -a says the sizes it skips)."""
    path = str(repo_dir / "examples/allreduce.pln")
    assert main(["check", path, "-R", "1..8", "--gpus-per-node", "2"]) == 0
    assert capsys.readouterr().out == ("allreduce: ok for R=1..8 (8 sizes): 4 hierarchical plans (2 GPUs per node) "
                                       "verified (R=1, 3, 5, 7 are not multiples of 2: no plan there)\n")
    assert main(["check", path, "-R", "2..3", "--gpus-per-node", "2"]) == 0
    assert capsys.readouterr().out.endswith("1 hierarchical plan (2 GPUs per node) verified (R=3 is not a multiple "
                                            "of 2: no plan there)\n")
    assert main(["check", path, "-R", "4", "--gpus-per-node", "4"]) == 0
    assert capsys.readouterr().out == "allreduce: ok for R=4: 1 hierarchical plan (4 GPUs per node) verified\n"


def test_one_node_one_plan_one_gpu_are_singular(capsys, repo_dir):
    """"1 nodes x 4 GPUs", "1 hierarchical plans", "(1 GPUs per node)"."""
    path = str(repo_dir / "examples/allreduce.pln")
    assert main(["dump", path, "-R", "4", "-s", "snac", "--gpus-per-node", "4"]) == 0
    assert "hierarchical allreduce (R=4 = 1 node x 4 GPUs, reduce): 3 phases," in capsys.readouterr().out
    assert main(["check", path, "-R", "4", "--gpus-per-node", "4"]) == 0
    assert "ok for R=4: 1 hierarchical plan (4 GPUs per node) verified" in capsys.readouterr().out
    assert main(["check", path, "-R", "2", "--gpus-per-node", "1"]) == 0
    assert "1 hierarchical plan (1 GPU per node) verified" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["check"], ["dump", "-s", "snac"]])
def test_packed_with_an_algorithm_that_has_none_is_refused_over_nodes_too(capsys, repo_dir, command):
    """Phases where two-shot does not apply ran direct-push with the packing dropped: the flat
    lowering refuses the combination, the plan said ok."""
    path = str(repo_dir / "examples/allreduce.pln")
    assert main([*command[:1], path, *command[1:], "-R", "4", "-a", "two-shot", "--packed", "--gpus-per-node", "2"]) == 2
    assert "error: packed (LL) stages are supported for direct-push only, not two-shot" in capsys.readouterr().err


def test_cli_errors(capsys, repo_dir, tmp_path):
    path = str(repo_dir / "examples/allreduce.pln")
    for command in (["dump", path, "-s", "snac"], ["draw", path, "-o", str(tmp_path / "never.svg")], ["check", path]):
        assert main([*command, "-R", "6", "--gpus-per-node", "4"]) == 2  # one wording, the flag's, in all three
        assert "error: world size R=6 is not a multiple of --gpus-per-node 4" in capsys.readouterr().err
    assert main(["dump", path, "-R", "4", "-s", "cuda", "--gpus-per-node", "2"]) == 2
    assert "--gpus-per-node applies to --stage snac" in capsys.readouterr().err
    assert main(["check", path, "-R", "5", "--gpus-per-node", "2"]) == 2
    assert "world size R=5 is not a multiple of --gpus-per-node 2" in capsys.readouterr().err
    assert main(["check", path, "-R", "5..7", "--gpus-per-node", "4"]) == 2
    assert "no world size in R=5..7 is a multiple of --gpus-per-node 4" in capsys.readouterr().err
    assert main(["draw", str(repo_dir / "examples/gather.pln"), "--gpus-per-node", "3", "-o",
                 str(tmp_path / "never.svg")]) == 2  # R=8 was draw's default, not asked for
    assert "note: --ranks not given: R=8 is the default" in capsys.readouterr().err


@pytest.mark.parametrize("name", STANDARD + USER)
@pytest.mark.parametrize("nodes,G", ((2, 2), (3, 2), (2, 1)))
def test_phase_sources_give_back_their_sub_specs(repo_dir, name, nodes, G):
    """The runtime loads each node's phase from generated .pln text: it must check to exactly
    the canonical sub-spec the plan's schedule was proved for."""
    from purlinc.snac.hiersource import has_work, phase_name, phase_source

    plan = plan_hierarchical(_spec(repo_dir, name, nodes * G), G)
    for index, shape in enumerate(plan.canonical):
        if not has_work(shape):
            continue
        text = phase_source(shape, phase_name(plan.spec.name, index))
        spec = pipeline.spec_stage(pipeline.parse_stage(pipeline.load_source(text)), G, {})
        assert (spec.operation, spec.inputs, spec.outputs, spec.sources) == \
            (shape.operation, shape.inputs, shape.outputs, shape.sources), text


def test_phase_sources_of_the_longest_name_check():
    """A collective may have a 64-character name; its phases' names (name + '_h<phase>') were
    longer, so the runtime's load refused the text it generated for every phase."""
    from purlinc.frontend.parse import MAX_NAME_LENGTH
    from purlinc.runtime.hierarchical import intra_sources, plan_for
    from purlinc.snac.hiersource import phase_name

    name = "a" * MAX_NAME_LENGTH
    plan = plan_for(pipeline.SourceText(f"collective {name} {{ in[r] = x[0..R]  out[r] = x[0..R]  reduce }}", "long.pln"), 4, 2)
    for index, text in intra_sources(plan, 0).items():
        spec = pipeline.spec_stage(pipeline.parse_stage(pipeline.load_source(text)), 2, {})
        assert spec.name == phase_name(name, index) and len(spec.name) <= MAX_NAME_LENGTH
    assert len({phase_name(name, i) for i in range(12)}) == 12  # still one name per phase


@pytest.mark.parametrize("source,world_size,G,params", [
    ("alltoall_blocks.pln", 32, 4, {"k": 32}),  # 32 x 32 x 32 blocks: an intra all-to-all of 8,192 chunks
    # blocks of two at a stride of 144 (an NVL72 rack's node): one chunk at a time, 199 KB of text
    ("alltoall_blocks.pln", 144, 72, {"k": 2}),
    ("collective t { in[r] = x[r][(r + i) % R] for i in 0..R  out[r] = x[j][i] for i in 0..R for j in 0..R  copy }",
     32, 8, {}),  # every rank gets every block, transposed
])
def test_phase_sources_of_big_phases_load(repo_dir, source, world_size, G, params):
    """A node's phase listed every chunk one by one (c[0], c[8], ...): at 32 ranks these texts
    passed the 64 KiB a .pln may have, and the load refused its own generated source.  Runs of
    chunks are written as ranges and strided comprehensions, and still check back exactly."""
    from purlinc.frontend.source import MAX_SOURCE_BYTES
    from purlinc.runtime.hierarchical import intra_sources, plan_for

    path = repo_dir / "examples" / source if source.endswith(".pln") else source
    plan = plan_for(path, world_size, G, params)
    for node in (0, plan.topology.nodes - 1):
        for index, text in intra_sources(plan, node).items():
            assert len(text) < MAX_SOURCE_BYTES // 8, f"phase {index}: {len(text):,} bytes"
            spec = pipeline.spec_stage(pipeline.parse_stage(pipeline.load_source(text)), G, {})
            shape = plan.canonical[plan.phases[index].schedules[node]]
            assert (spec.inputs, spec.outputs, spec.sources) == (shape.inputs, shape.outputs, shape.sources)


@pytest.mark.parametrize("stride", [-6, 0, 3, 144])
def test_a_run_of_blocks_is_one_item_whatever_its_stride(stride):
    """The test that chose a block run compared count x stride with the plain run's length:
    reversed, repeated and close blocks were written one chunk at a time (a reduce-scatter of
    reversed pairs at R=144, G=72 was refused as too long), and rescanned from every position
    (64,000 indices took minutes)."""
    import time

    from purlinc.frontend.spec import Chunk
    from purlinc.snac.hiersource import _items

    indices = [100_000 + stride * i + k for i in range(4000) for k in range(2)]
    started = time.perf_counter()
    items = _items([Chunk("c", (i,)) for i in indices])
    assert len(items) == 1 and time.perf_counter() - started < 5, items[:3]


def test_phase_items_read_back_as_the_indices_they_were_made_from():
    """hiersource writes runs, strided runs and runs of blocks as single items: on random index
    sequences built of all three (and repeats, reversals), the items read back exactly."""
    import random

    from purlinc.frontend.spec import Chunk
    from purlinc.snac.hiersource import _items

    rng = random.Random(11)
    for _ in range(300):
        indices: list[int] = []
        for _ in range(rng.randint(1, 6)):
            kind, first = rng.choice(("single", "run", "blocks", "back")), rng.randrange(0, 400)
            if kind == "single":
                indices.append(first)
            elif kind == "run":
                step = rng.choice((1, 2, 7, 0))
                indices += [first + step * i for i in range(rng.randint(2, 9))]
            elif kind == "blocks":
                size, stride = rng.randint(2, 5), rng.choice((9, 144, -11, 3))
                indices += [first + 200 + stride * i + k for i in range(rng.randint(2, 6)) for k in range(size)]
            else:
                indices += [first + 50 - i for i in range(rng.randint(2, 6))]
        text = ", ".join(_items([Chunk("c", (i,)) for i in indices]))
        spec = pipeline.spec_stage(pipeline.parse_stage(pipeline.load_source(
            f"collective t {{ in[0] = {text}  out[0] = c[0]  copy replicated }}" if 0 in indices else
            f"collective t {{ in[0] = {text}, c[0]  out[0] = c[0]  copy replicated }}")), 1, {})  # repeats allowed
        got = [chunk.index[0] for chunk in spec.inputs[0]][:len(indices)]
        assert got == indices, (indices, text)


REPLICATED = {  # 'copy replicated': a node's phase may hold one chunk on several of its ranks
    "every_rank_holds_all": "collective s {\n    in[r] = x[0..R]\n    out[r] = x[(r + 1) % R]\n    copy replicated\n}\n",
    "neighbours": "collective s {\n    in[r] = x[r], x[(r + 1) % R]\n    out[0] = x[0..R]\n    copy replicated\n}\n",
    "twice_on_a_rank": "collective s {\n    in[r] = x, x\n    out[r] = x\n    copy replicated\n}\n",
}


@pytest.mark.parametrize("which", sorted(REPLICATED))
@pytest.mark.parametrize("nodes,G", ((2, 2), (1, 4), (3, 2)))
def test_replicated_phase_sources_check(which, nodes, G):
    """A node's phase of a 'copy replicated' collective names each producer once: the .pln
    text the runtime loads was a plain 'copy' naming c[0] on two ranks, which the checker
    refuses as conflicting producers (the plan itself verified)."""
    from purlinc.runtime.hierarchical import intra_sources, plan_for

    source = pipeline.load_source(REPLICATED[which])
    plan = plan_for(source, nodes * G, G)
    for node in range(nodes):
        for index, text in intra_sources(plan, node).items():
            spec = pipeline.spec_stage(pipeline.parse_stage(pipeline.load_source(text)), G, {})
            shape = plan.canonical[plan.phases[index].schedules[node]]
            assert (spec.operation, spec.inputs, spec.outputs, spec.sources) == \
                (shape.operation, shape.inputs, shape.outputs, shape.sources), text
    _check(plan.spec, G)


@pytest.mark.parametrize("name", STANDARD + USER)
@pytest.mark.parametrize("nodes,G", ((2, 2), (3, 2), (4, 1)))
def test_runtime_point_to_point_lists_pair_up(repo_dir, name, nodes, G):
    """What each rank hands NCCL for an inter phase (purlinc.runtime.hierarchical, no torch
    needed to build it): every pair's sends and receives match in order, and running them
    (sends into receives, then the local reductions) gives the phase's moves."""
    from purlinc.runtime.hierarchical import _inter_for

    plan = plan_hierarchical(_spec(repo_dir, name, nodes * G), G)
    R = plan.topology.world_size
    for index, phase in enumerate(plan.phases):
        if not isinstance(phase, InterPhase):
            continue
        runs = [_inter_for(plan, index, phase, rank, None) for rank in range(R)]
        assert len({run.all_reduce for run in runs}) == 1  # every rank takes the same path
        src = {(r, u): {(r, u)} for r in range(R) for u in range(len(plan.layout(phase.src).units[r]))}
        dst, tmp = {}, {}
        if runs[0].all_reduce:
            for m in phase.moves:
                dst[(m.dst.rank, m.dst.unit)] = set().union(*(src[(s.rank, s.unit)] for s in m.srcs))
        else:
            for a in range(R):
                for b in range(R):
                    sent = [u for u, peer in runs[a].sends if peer == b]
                    got = [d for d, peer in runs[b].recvs if peer == a]
                    assert len(sent) == len(got), f"phase {index}: r{a} sends {len(sent)} to r{b}, which receives {len(got)}"
                    for u, d in zip(sent, got):
                        target = tmp if isinstance(d, tuple) else dst
                        target[(b, d[1]) if isinstance(d, tuple) else (b, d)] = src[(a, u)]
            for rank, run in enumerate(runs):
                for d, s in run.copies:
                    dst[(rank, d)] = src[(rank, s)]
                for d, parts in run.reductions:
                    dst[(rank, d)] = set().union(*(src[(rank, u)] if kind == "src" else tmp[(rank, u)] for kind, u in parts))
        want = {(m.dst.rank, m.dst.unit): set().union(*(src[(s.rank, s.unit)] for s in m.srcs)) for m in phase.moves}
        assert dst == want


INLINE = {
    # replicated producers: a node serves x from its own ranks, y crosses nodes
    "shared": "collective shared { in[r] = x, y[r]  out[r] = x, y[(r + 1) % R]  copy replicated }",
    # a chunk twice on one rank, outputs on some ranks only, a partial reduction per parity
    "parity": "collective parity { in[r] = x, x, y[r % 2]  out[r] = y[(r + 1) % 2], x  reduce }",
    # rooted with a parameter and a non-trivial layout
    "gather2": "collective gather2(root = 1) { in[r] = a[r], b[r]  out[root] = b[0..R], a[0..R]  copy }",
}


@pytest.mark.parametrize("nodes,G", SMALL + ((3, 4),))
@pytest.mark.parametrize("name", sorted(INLINE))
def test_inline_user_collectives(name, nodes, G):
    source = pipeline.load_source(INLINE[name])
    spec = pipeline.spec_stage(pipeline.parse_stage(source), nodes * G, {})
    _check(spec, G, seed=nodes * 10 + G)


def test_cli_draw_hierarchical(capsys, repo_dir, tmp_path):
    import xml.dom.minidom

    assert main(["draw", str(repo_dir / "examples/allreduce.pln"), "-R", "8", "--gpus-per-node", "2"]) == 0
    svg = capsys.readouterr().out
    document = xml.dom.minidom.parseString(svg)
    lines = document.getElementsByTagName("line")
    # the inter all-reduce: every partial unit of r goes to the 3 other nodes' peer of r
    assert len(lines) == 8 * 3
    assert "1: NCCL all_reduce" in svg and "0: SNAC reduce" in svg and "2: SNAC copy" in svg
    page = tmp_path / "plan.html"
    assert main(["draw", str(repo_dir / "examples/broadcast.pln"), "-R", "4", "--gpus-per-node", "2", "-o", str(page)]) == 0
    assert "<svg" in page.read_text() and "NCCL broadcast" in page.read_text()
    assert main(["draw", str(repo_dir / "examples/broadcast.pln"), "-R", "4", "--gpus-per-node", "2", "--timeline"]) == 2
    assert "--timeline, --compare and --trace do not apply" in capsys.readouterr().err


@pytest.mark.parametrize("example, words", [
    ("fused/allreduce_add_rmsnorm.pln", "cannot apply an epilogue yet"),
    ("sized/alltoallv.pln", "cannot move chunks of run-time sizes"),
])
def test_what_a_plan_cannot_express_is_refused_not_dropped(example, words, capsys):
    """No phase applies an epilogue or moves run-time sizes: the plan must refuse the spec
    (check, dump and the runtime alike), not verify a plan that leaves the epilogue out."""
    path = str(Path(__file__).resolve().parent.parent / "examples" / example)
    for argv in (["check", path, "-R", "4", "--gpus-per-node", "2"],
                 ["dump", path, "-R", "4", "--gpus-per-node", "2", "-s", "snac"]):
        assert main(argv) == 2
        assert words in capsys.readouterr().err


@pytest.mark.parametrize("example, where", [
    ("fused/allreduce_add_rmsnorm.pln", "allreduce_add_rmsnorm.pln:8:5: error:"),
    ("sized/alltoallv.pln", "alltoallv.pln:4:27: error:"),
])
def test_a_refused_plan_points_at_what_it_cannot_express(example, where):
    """The refusal names the file and line of the epilogue or the sizes operand (the sizes
    one rendered as a bare 'error:' with no location)."""
    from purlinc.errors import PurlinError
    from purlinc.runtime.hierarchical import plan_for

    path = Path(__file__).resolve().parent.parent / "examples" / example
    with pytest.raises(PurlinError) as caught:
        plan_for(path, 4, 2)
    assert where in caught.value.render().splitlines()[0]


@pytest.mark.parametrize("bad", ["8", 2.5, True, None])
def test_gpus_per_node_is_an_integer(bad):
    with pytest.raises(TopologyError, match="gpus_per_node must be an integer >= 1"):
        Topology.of(8, bad)


def test_a_numpy_integer_is_an_integer():
    import numpy as np

    assert Topology.of(8, np.int64(2)).nodes == 4


def _plan_texts(source, world_size: int, G: int):
    """The plan drawing's canvas width and its texts as (x, anchor, y, size, text)."""
    import xml.dom.minidom

    from purlinc.draw.hier import plan_svg

    spec = pipeline.spec_stage(pipeline.parse_stage(source), world_size, {})
    document = xml.dom.minidom.parseString(plan_svg(plan_hierarchical(spec, G, LowerOptions())))
    root = document.documentElement
    texts = [(float(t.getAttribute("x")), t.getAttribute("text-anchor") or "start", float(t.getAttribute("y")),
              float(t.getAttribute("font-size") or 11), t.firstChild.data) for t in document.getElementsByTagName("text")]
    return float(root.getAttribute("width")), texts


def _extent(x, anchor, size, text):
    """Left and right end of a text, at a generous 0.64 em a character (DejaVu Sans digits)."""
    w = 0.64 * size * len(text)
    return {"start": (x, x + w), "middle": (x - w / 2, x + w / 2), "end": (x - w, x)}[anchor]


def test_plan_drawing_labels_do_not_collide(repo_dir):
    """16 nodes x 8 GPUs: 'node 12' sat over 'r96' on the node's first row (the rank labels'
    column was fixed for one-digit nodes and two-digit ranks); every label on a row keeps
    clear of the others."""
    width, texts = _plan_texts(pipeline.load_source(repo_dir / "examples/allgather.pln"), 128, 8)
    boxes = [(*_extent(x, anchor, size, text), y - 0.75 * size, y + 0.2 * size, text)
             for x, anchor, y, size, text in texts]
    for n, (left, right, top, bottom, text) in enumerate(boxes):
        for other_left, other_right, other_top, other_bottom, other in boxes[n + 1:]:
            apart = right <= other_left or other_right <= left or bottom <= other_top or other_bottom <= top
            assert apart, f"{text!r} and {other!r} overlap"


def test_plan_drawing_title_fits_a_long_name(repo_dir):
    """The title is inside the canvas for the longest name a collective may have (64
    characters; before, it was cut off at the canvas' edge), and one node is 'node'."""
    text = (repo_dir / "examples/allgather.pln").read_text().replace("collective allgather", "collective " + "a" * 64)
    width, texts = _plan_texts(pipeline.SourceText(text, "long.pln"), 4, 4)
    title = texts[0]
    assert title[4].startswith("a" * 64 + ": 1 node x 4 GPUs (R=4)")
    assert _extent(title[0], title[1], title[3], title[4])[1] <= width


def test_a_plan_too_large_to_make_is_refused_first(repo_dir, monkeypatch):
    """Planning walks the reads per node: an all-reduce at R=512 took 150 s and 7.7 GB before
    anything was drawn or dumped.  Past the bound it is refused before any planning."""
    import purlinc.snac.hierplan as hierplan

    spec = _spec(repo_dir, "allreduce", 8)
    reads = 8 ** 3
    monkeypatch.setattr(hierplan, "MAX_PLAN_READS", reads)
    plan_hierarchical(spec, 2)  # at the bound: planned
    monkeypatch.setattr(hierplan, "MAX_PLAN_READS", reads - 1)
    with pytest.raises(PurlinError) as caught:
        plan_hierarchical(spec, 2)
    assert caught.value.message == ("allreduce for R=8 reads 512 chunks across its ranks' outputs, more than a "
                                    "hierarchical plan covers (511)")


def test_a_phase_whose_text_cannot_be_shortened_is_refused_by_check_naming_it(tmp_path, capsys):
    """A reduce-scatter of scrambled inputs: no runs or blocks to shorten, so a node's phase at
    R=320, G=32 is 80 KB of text.  check verified the plan while every load of it refused its
    own text ('<string> is too large to be a collective'); now check refuses it, naming the phase."""
    from purlinc.cli import main

    path = tmp_path / "scrambled.pln"
    path.write_text("collective scrambled {\n    in[r] = x[(i * i + 7 * r) % R] for i in 0..R\n    out[r] = x[r]\n"
                    "    reduce\n}\n")
    assert main(["check", str(path), "-R", "320", "--gpus-per-node", "32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: scrambled_h0: a node's phase of this hierarchical plan is 80,181 bytes of .pln text, "
                          "more than a collective may be (65,536)"), err
    assert "note: a smaller gpus_per_node makes each node's phases smaller" in err

