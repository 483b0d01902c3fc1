"""Every example x algorithm x atom on every visible GPU (two or more) through a LocalGroup (one process, peer access),
eager and CUDA-graph replay, against the reference evaluator, with poisoned outputs."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _common import (  # noqa: E402
    ALGORITHMS, COUNTS, EXAMPLES, applicable, compare_outputs, dtype_matrix, examples, expected, inputs_for,
    poison, to_torch, torch_dtype,
)
from purlinc.dtypes import DType  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
# Every visible GPU is a rank: the same tests run on 2-, 4- and 8-GPU machines.
DEVICES = list(range(torch.cuda.device_count()))
ATOM = os.environ.get("PURLIN_TEST_ATOMS", "ldst,tma,ce").split(",")


@pytest.fixture(scope="module")
def group():
    import purlinc

    g = purlinc.LocalGroup(DEVICES)
    yield g
    g.close()


def _sync():
    for d in DEVICES:
        torch.cuda.synchronize(d)


def _buffers(spec, count, dtype, inputs):
    xs = [to_torch(a, dtype, r) if len(spec.inputs[r]) else None for r, a in enumerate(inputs)]
    outs = [
        torch.empty(len(spec.outputs[r]) * count, dtype=torch_dtype(dtype), device=f"cuda:{r}")
        if len(spec.outputs[r]) else None
        for r in range(spec.world_size)
    ]
    return xs, outs


def run_once(coll, spec, count, dtype, op, rng, label):
    inputs = inputs_for(spec, count, dtype, rng)
    xs, outs = _buffers(spec, count, dtype, inputs)
    for out in outs:
        if out is not None:
            poison(out)
    result = coll(xs, outs, op=op)
    _sync()
    coll.check()
    assert all(a is b for a, b in zip(result, outs))
    compare_outputs(spec, outs, expected(spec, inputs, count, dtype, op), dtype, label)
    return outs


MAIN = [(n, a, t) for n in examples() for a in ALGORITHMS for t in ATOM]


@pytest.mark.parametrize("name,algorithm,atom", MAIN)
def test_collective(group, name, algorithm, atom):
    import purlinc

    prepared = applicable(name, algorithm, atom)
    if isinstance(prepared, str):
        pytest.skip(prepared)
    coll = purlinc.load(EXAMPLES / name, group, algorithm=algorithm, atom=atom)
    rng = np.random.default_rng(hash((name, algorithm, atom)) % 2**32)
    try:
        for count in COUNTS:
            run_once(coll, prepared.spec, count, DType.FLOAT32, "sum", rng, f"{name}/{algorithm}/{atom}/n={count}")
        if prepared.spec.is_reduce:
            run_once(coll, prepared.spec, 1000, DType.FLOAT32, "max", rng, f"{name}/{algorithm}/{atom}/max")
    finally:
        coll.close()


@pytest.mark.parametrize("name", examples())
def test_packed_ll(group, name):
    """The LL protocol (notify inside every 16-byte packet): every example that direct-push
    lowers, odd counts, copies bitwise, reductions bitwise against the evaluator's order,
    two channels, and CUDA-graph replays (flags are epoch-stamped: replays need no reset).
    Whole packets in 8-byte aligned buffers take the lean entries (abi.KernelABI.lean_fits),
    odd counts and shifted buffers the wide ones."""
    import purlinc
    from purlinc.errors import PurlinError

    rng = np.random.default_rng(5)
    for channels in (1, 2):
        try:
            coll = purlinc.load(EXAMPLES / name, group, algorithm="direct-push", packed=True, channels=channels)
        except PurlinError as error:
            pytest.skip(str(error).splitlines()[0])
        spec = coll[0].compiled.spec
        label = f"{name}/ll/c{channels}"
        try:
            for count in (1, 7, 1000, 4097, 20_000):
                for dtype in (DType.FLOAT32, DType.BFLOAT16):
                    run_once(coll, spec, count, dtype, "sum", rng, f"{label}/{dtype.value}/n={count}")
            for shift in (1, 4):  # buffers 2 bytes (wide) and 8 bytes (lean) into their allocation
                run_shifted(coll, spec, 1000, DType.BFLOAT16, shift, rng, f"{label}/shift={shift}")
            for count in (4096, 4097):
                graph_replays(coll, spec, count, DType.BFLOAT16, rng, label)
        finally:
            coll.close()


def run_shifted(coll, spec, count, dtype, shift, rng, label):
    """run_once on views ``shift`` elements into larger buffers, whose other elements must
    keep their poison: nothing is written outside the call's output."""
    inputs = inputs_for(spec, count, dtype, rng)
    whole, xs, outs = [], [], []
    for r in range(spec.world_size):
        x = None
        if len(spec.inputs[r]):
            x = torch.empty(inputs[r].size + shift + 3, dtype=torch_dtype(dtype), device=f"cuda:{r}")
            x = x[shift:shift + inputs[r].size]
            x.copy_(to_torch(inputs[r], dtype, r))
        n = len(spec.outputs[r]) * count
        out = torch.empty(n + shift + 3, dtype=torch_dtype(dtype), device=f"cuda:{r}") if n else None
        if out is not None:
            poison(out)
        whole.append(out)
        xs.append(x)
        outs.append(out[shift:shift + n] if out is not None else None)
    coll(xs, outs, op="sum")
    _sync()
    coll.check()
    compare_outputs(spec, outs, expected(spec, inputs, count, dtype, "sum"), dtype, label)
    for r, out in enumerate(whole):
        if out is not None:
            edges = torch.cat([out[:shift], out[shift + outs[r].numel():]]).view(torch.uint8)
            assert bool((edges == 0xFF).all()), f"{label}: rank {r} wrote outside its output"


def graph_replays(coll, spec, count, dtype, rng, label, replays=3):
    """Three calls per CUDA graph per device (epochs must advance inside a graph), ``replays``
    replays, fresh inputs and poisoned outputs before each."""
    xs, outs = _buffers(spec, count, dtype, inputs_for(spec, count, dtype, rng))
    coll(xs, outs)  # warm: compile and cache outside the capture
    _sync()
    graphs = []
    for r in DEVICES:
        with torch.cuda.device(r):
            g = torch.cuda.CUDAGraph()
            # torch's default capture stream is made once, on the first device used: give
            # each device its own.
            with torch.cuda.graph(g, stream=torch.cuda.Stream(device=r)):
                for _ in range(3):
                    coll[r](xs[r], outs[r])
            graphs.append(g)
    for it in range(replays):
        inputs = inputs_for(spec, count, dtype, rng)
        for r in DEVICES:
            if xs[r] is not None:
                xs[r].copy_(to_torch(inputs[r], dtype, r))
            if outs[r] is not None:
                poison(outs[r])
        _sync()
        for g in graphs:
            g.replay()
        _sync()
        coll.check()
        compare_outputs(spec, outs, expected(spec, inputs, count, dtype, "sum"), dtype, f"{label} graph n={count} {it}")
    return xs, outs


@pytest.mark.parametrize("name", ["allreduce.pln", "allgather.pln", "reduce_scatter.pln", "alltoall.pln",
                                  "broadcast.pln", "reduce.pln", "gather.pln", "scatter.pln"])
def test_tuned_default_across_size_buckets(group, name):
    """A plain load picks a schedule per size bucket: every bucket must be right, and the
    ranks must agree on the bucket (a gather's root and leaves hold different sizes)."""
    import purlinc

    coll = purlinc.load(EXAMPLES / name, group)
    spec = coll[0].spec
    rng = np.random.default_rng(11)
    try:
        buckets = coll[0].buckets
        assert len({id(v) for v in coll[0].variants}) >= 2, coll[0]
        for count in (1, 301, 4097, 70_000, 1_100_000):
            run_once(coll, spec, count, DType.BFLOAT16, "sum", rng, f"{name}/default/n={count}")
        assert len(buckets) >= 2 and buckets[-1].max_bytes is None
    finally:
        coll.close()


def test_tuned_warm_compiles_every_bucket(group):
    """``warm`` on a plain load compiles every bucket's kernel at once (purlinc.concurrent,
    NVRTC in threads) and loads it on every rank; then every bucket computes the right thing."""
    import purlinc
    from purlinc.dtypes import ReduceOp

    coll = purlinc.load(EXAMPLES / "allreduce.pln", group)
    spec = coll[0].spec
    rng = np.random.default_rng(5)
    try:
        coll.warm("float32", "sum")
        for tuned in coll.ranks:
            for variant in tuned._distinct:
                assert variant._ce is not None or (DType.FLOAT32, ReduceOp.SUM) in variant._variants, \
                    variant.compiled.options.key()
        for count in (1, 301, 4097, 70_000, 1_100_000):
            run_once(coll, spec, count, DType.FLOAT32, "sum", rng, f"allreduce/warm/n={count}")
    finally:
        coll.close()


@pytest.mark.parametrize("name,algorithm,atom,dtype,op", dtype_matrix())
def test_dtypes_and_ops(group, name, algorithm, atom, dtype, op):
    import purlinc

    if atom not in ATOM:
        pytest.skip(f"atom {atom} not selected")
    prepared = applicable(name, algorithm, atom)
    if isinstance(prepared, str):
        pytest.skip(prepared)
    coll = purlinc.load(EXAMPLES / name, group, algorithm=algorithm, atom=atom)
    rng = np.random.default_rng(7)
    try:
        for count in (7, 1000, 4097):
            outs = run_once(coll, prepared.spec, count, DType.parse(dtype), op or "sum", rng,
                            f"{name}/{algorithm}/{atom}/{dtype}/{op}/n={count}")
            if name == "allreduce.pln":  # every rank holds the same bits
                assert torch.equal(outs[0].view(torch.uint8).cpu(), outs[1].view(torch.uint8).cpu())
    finally:
        coll.close()


@pytest.mark.parametrize("name,algorithm,atom,channels", [
    ("allreduce.pln", "direct-push", "ldst", None), ("allreduce.pln", "two-shot", "tma", None),
    ("allgather.pln", "direct-push", "ce", None), ("allgather.pln", "direct-push", "ce", 2),
    ("alltoall.pln", "ring", "ldst", 2),
])
def test_graph_replay(group, name, algorithm, atom, channels):
    import purlinc

    if atom not in ATOM:
        pytest.skip(f"atom {atom} not selected")
    prepared = applicable(name, algorithm, atom)
    if isinstance(prepared, str):
        pytest.skip(prepared)
    coll = purlinc.load(EXAMPLES / name, group, algorithm=algorithm, atom=atom, channels=channels)
    rng = np.random.default_rng(11)
    try:
        xs, outs = graph_replays(coll, prepared.spec, 4097, DType.FLOAT32, rng, name, replays=5)
        coll(xs, outs)  # eager after replays still in step
        _sync()
        coll.check()
    finally:
        coll.close()


def test_two_collectives_on_two_streams(group):
    import purlinc

    ar = purlinc.load(EXAMPLES / "allreduce.pln", group)
    ag = purlinc.load(EXAMPLES / "allgather.pln", group, atom="tma")
    sa = [torch.cuda.Stream(device=r) for r in DEVICES]
    sb = [torch.cuda.Stream(device=r) for r in DEVICES]
    rng = np.random.default_rng(3)
    count, dtype = 300_001, DType.FLOAT32
    try:
        for it in range(5):
            ia = inputs_for(ar.ranks[0].compiled.spec, count, dtype, rng)
            ib = inputs_for(ag.ranks[0].compiled.spec, count, dtype, rng)
            xa, oa = _buffers(ar.ranks[0].compiled.spec, count, dtype, ia)
            xb, ob = _buffers(ag.ranks[0].compiled.spec, count, dtype, ib)
            for r in DEVICES:
                poison(oa[r]), poison(ob[r])
                sa[r].wait_stream(torch.cuda.current_stream(r))
                sb[r].wait_stream(torch.cuda.current_stream(r))
            ar(xa, oa, streams=sa)
            ag(xb, ob, streams=sb)
            _sync()
            compare_outputs(ar.ranks[0].compiled.spec, oa, expected(ar.ranks[0].compiled.spec, ia, count, dtype, "sum"),
                     dtype, "allreduce beside allgather")
            compare_outputs(ag.ranks[0].compiled.spec, ob, expected(ag.ranks[0].compiled.spec, ib, count, dtype, None),
                     dtype, "allgather beside allreduce")
    finally:
        ar.close()
        ag.close()


@pytest.mark.parametrize("name,algorithm,atom", [
    ("allgather.pln", "direct-push", "ldst"), ("allgather.pln", "direct-push", "ce"),
    ("allgather.pln", "direct-push", "tma"), ("allreduce.pln", "two-shot", "ldst"),
])
def test_large(group, name, algorithm, atom):
    import purlinc

    if atom not in ATOM:
        pytest.skip(f"atom {atom} not selected")
    n = 64 << 20  # 256 MiB of float32 per rank
    coll = purlinc.load(EXAMPLES / name, group, algorithm=algorithm, atom=atom)
    try:
        if name == "allgather.pln":
            xs = [torch.randn(n, device=f"cuda:{r}") for r in DEVICES]
            want = torch.cat([x.to("cuda:0") for x in xs])
        else:
            xs = [torch.randn(len(DEVICES) * n, device=f"cuda:{r}") for r in DEVICES]
            want = sum(x.to("cuda:0") for x in xs)
        outs = [torch.full_like(want.to(f"cuda:{r}"), float("nan")) for r in DEVICES]
        _sync()
        start = time.perf_counter()
        coll(xs, outs)
        _sync()
        seconds = time.perf_counter() - start
        coll.check()
        for r in DEVICES:
            assert torch.equal(outs[r].to("cuda:0"), want), f"{name} large: rank {r} differs"
        _record("large", {"name": name, "algorithm": algorithm, "atom": atom, "bytes_per_rank": xs[0].numel() * 4,
                          "seconds_first_call": round(seconds, 4)})
    finally:
        coll.close()


def test_validation_before_launch(group):
    import purlinc

    if len(DEVICES) != 2:
        pytest.skip("the bad-argument table is written for two ranks")
    from purlinc.runtime import ArgumentError

    coll = purlinc.load(EXAMPLES / "allgather.pln", group)
    try:
        x0, x1 = torch.randn(16, device="cuda:0"), torch.randn(16, device="cuda:1")
        o0, o1 = torch.empty(32, device="cuda:0"), torch.empty(32, device="cuda:1")
        cases = [
            ([x1, x0], [o0, o1], "cuda:1"),  # wrong device
            ([x0, x1], [o0, o1[:31]], "31"),  # out size
            ([x0.half(), x1], [o0, o1], "dtype"),
            ([torch.randn(32, device="cuda:0")[::2], x1], [o0, o1], "contiguous"),
            ([o0[:16], x1], [o0, o1], "overlap"),
        ]
        for xs, outs, word in cases:
            with pytest.raises(ArgumentError, match=word):
                coll(xs, outs)
        # nothing was launched: a correct call afterwards is still in step
        coll([x0, x1], [o0, o1])
        _sync()
        coll.check()
        assert torch.equal(o1[:16].cpu(), x0.cpu()) and torch.equal(o0[16:].cpu(), x1.cpu())
        # out allocated when omitted, of the input's kind
        outs = coll([x0, x1])
        _sync()
        assert outs[0].shape == (32,) and outs[0].device == x0.device
    finally:
        coll.close()


def test_cupy_and_dlpack_inputs(group):
    cupy = pytest.importorskip("cupy")
    import purlinc

    coll = purlinc.load(EXAMPLES / "allgather.pln", group)
    try:
        xs = []
        for r in DEVICES:
            with cupy.cuda.Device(r):
                xs.append(cupy.arange(1000, dtype=cupy.float32) + 1000 * r)
        outs = coll(xs)
        for r in DEVICES:
            with cupy.cuda.Device(r):
                cupy.cuda.Device(r).synchronize()
                assert isinstance(outs[r], cupy.ndarray)
                assert cupy.asnumpy(outs[r]).tolist() == list(map(float, range(1000 * len(DEVICES))))
    finally:
        coll.close()


def test_eager_host_overhead(group):
    import purlinc

    coll = purlinc.load(EXAMPLES / "allreduce.pln", group)
    try:
        xs = [torch.randn(512, device=f"cuda:{r}") for r in DEVICES]
        outs = [torch.empty(512, device=f"cuda:{r}") for r in DEVICES]
        for _ in range(20):
            coll(xs, outs)
        _sync()
        calls = 400
        start = time.perf_counter()
        for _ in range(calls):
            coll(xs, outs)
        host = (time.perf_counter() - start) / (2 * calls)
        _sync()
        per_call = (time.perf_counter() - start) / calls
        coll.check()
        _record("eager", {"host_us_per_rank_call": round(host * 1e6, 2),
                          "wall_us_per_group_call": round(per_call * 1e6, 2)})
        assert host < 50e-6
    finally:
        coll.close()


def test_timeout_is_reported_not_hung(group, monkeypatch):
    import purlinc
    from purlinc.runtime import PurlinTimeoutError

    monkeypatch.setenv("PURLIN_WAIT_TIMEOUT_S", "0.5")
    coll = purlinc.load(EXAMPLES / "allgather.pln", group)
    try:
        x0, o0 = torch.randn(1000, device="cuda:0"), torch.empty(2000, device="cuda:0")
        start = time.perf_counter()
        coll[0](x0, o0)  # rank 1 never calls
        torch.cuda.synchronize(0)
        elapsed = time.perf_counter() - start
        with pytest.raises(PurlinTimeoutError) as caught:
            coll[0].check()
        text = str(caught.value)
        assert "rank 0" in text and "channel" in text and "signal" in text, text
        assert elapsed < 10, elapsed
        with pytest.raises(PurlinTimeoutError):
            coll[0](x0, o0)  # later calls say so too
        _record("timeout", {"seconds_until_kernel_returned": round(elapsed, 3), "message": text.splitlines()[0]})
    finally:
        coll.close()


def _record(key: str, value) -> None:
    out = os.environ.get("PURLIN_RESULTS")
    if not out:
        return
    path = os.path.join(out, "local_results.json")
    data = json.load(open(path)) if os.path.exists(path) else {}
    data.setdefault(key, []).append(value)
    json.dump(data, open(path, "w"), indent=1)
