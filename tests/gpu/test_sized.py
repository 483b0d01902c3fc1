"""Run-time sizes on ONE GPU: ``examples/sized/alltoallv.pln`` in a loopback LocalGroup
(every rank on cuda:0, a stream each) at R = 1..8, every dtype the copy path takes, random
size vectors (zeros, everything to one rank, exactly at capacity, random), eager calls and
per-rank CUDA graphs replayed with new sizes written into the same device tensors, and
sizes over the capacity / past a buffer: a SizeError naming the rank and the pair, and
nothing written outside the buffers (guard zones around every output stay poisoned).  Every
other call passes the receivers' expected sizes (what torch's output_split_sizes become), now
and then one off by one: that chunk is not written and a SizeError names it.
Every output is compared bit for bit, the whole buffer, with the evaluator
(``purlinc.frontend.evaluate.evaluate_sized``), and every out-sizes tensor with its sizes.

    python3 -m pytest -q tests/gpu/test_sized.py            # ~2-4 min on one H200 (NVRTC first)
"""

from __future__ import annotations

import contextlib

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _common import capture_per_rank, on_rank_streams, replay_per_rank  # noqa: E402
from purlinc.dtypes import DType  # noqa: E402
from purlinc.frontend.evaluate import arriving_sizes, evaluate_sized, sent_sizes  # noqa: E402
from purlinc.runtime.sized import SizeError  # noqa: E402

pytestmark = [pytest.mark.gpu]
DEVICE = 0
SIZED = Path(__file__).resolve().parents[2] / "examples" / "sized"
WORLDS = (1, 2, 3, 4, 5, 6, 7, 8)
DTYPES = tuple(DType)  # every dtype the copy path takes
BITS = {1: (np.int8, torch.int8), 2: (np.int16, torch.int16), 4: (np.int32, torch.int32), 8: (np.int64, torch.int64)}
CAPACITY = 37  # odd: chunks start at any element, so copies take the unaligned paths too
GUARD = 64  # poisoned elements before and after every output


def _torch_dtype(dtype: DType):
    from purlinc.runtime.interop import _torch_dtype_map

    return {v: k for k, v in _torch_dtype_map().items()}[dtype]


def vectors(rng, R: int, capacity: int, trial: int) -> list[list[int]]:
    """Size rows (rank r's sizes to every rank), by trial: zeros, all to one rank, at capacity, random."""
    kind = trial % 4
    if kind == 0:
        return [[0] * R for _ in range(R)]
    if kind == 1:
        target = int(rng.integers(R))
        return [[capacity if d == target else 0 for d in range(R)] for _ in range(R)]
    if kind == 2:
        return [[capacity] * R for _ in range(R)]
    return [[int(v) for v in rng.integers(0, capacity + 1, R)] for _ in range(R)]


class Buffers:
    """One rank's device buffers: input, guarded output, sizes, out sizes (all reused across calls)."""

    def __init__(self, R: int, dtype: DType, in_len: int, out_len: int, in_chunks: int | None = None,
                 out_chunks: int | None = None):
        self.np_bits, self.t_bits = BITS[dtype.itemsize]
        self.dtype, self.out_len = dtype, out_len
        self.x = torch.empty(in_len, dtype=_torch_dtype(dtype), device=f"cuda:{DEVICE}")
        self.whole = torch.empty(out_len + 2 * GUARD, dtype=_torch_dtype(dtype), device=f"cuda:{DEVICE}")
        self.out = self.whole[GUARD:GUARD + out_len]
        self.sizes = torch.zeros(R if in_chunks is None else in_chunks, dtype=torch.int64, device=f"cuda:{DEVICE}")
        self.out_sizes = torch.full((R if out_chunks is None else out_chunks,), -7, dtype=torch.int64,
                                    device=f"cuda:{DEVICE}")

    def fill(self, rng, sizes_row) -> np.ndarray:
        data = rng.integers(-100, 100, self.x.numel(), dtype=np.int64).astype(self.np_bits)
        self.x.view(self.t_bits).copy_(torch.from_numpy(data))
        self.whole.view(torch.uint8).fill_(0xFF)
        self.out_sizes.fill_(-7)
        self.sizes.copy_(torch.tensor(sizes_row, dtype=torch.int64))
        return data

    def poisoned(self) -> np.ndarray:
        return np.full(self.out_len, -1, dtype=self.np_bits)

    def check(self, want: np.ndarray, want_sizes, label: str) -> None:
        whole = self.whole.view(self.t_bits).cpu().numpy()
        assert (whole[:GUARD] == -1).all() and (whole[-GUARD:] == -1).all(), f"{label}: wrote outside the output"
        got = whole[GUARD:-GUARD]
        bad = np.flatnonzero(got != want)
        assert not bad.size, f"{label}: {bad.size} element(s) differ, first at {bad[:5]}: {got[bad[:5]]} != {want[bad[:5]]}"
        assert self.out_sizes.cpu().tolist() == want_sizes, f"{label}: out sizes {self.out_sizes.cpu().tolist()} != {want_sizes}"


def _group(R: int):
    import purlinc

    group = purlinc.LocalGroup([DEVICE] * R, share_devices=True)
    group.streams = [torch.cuda.Stream(device=DEVICE) for _ in range(R)]
    return group


def _run(coll, group, bufs, expected=None) -> None:
    """One call of every rank (``expected``: per rank, the int64 device tensor of the sizes it
    expects, or None)."""
    on_rank_streams(group.streams, DEVICE, lambda: coll(
        [b.x for b in bufs], [b.sizes for b in bufs], [b.out for b in bufs], [b.out_sizes for b in bufs],
        streams=group.streams, expected_sizes=expected))


def _expectations(rng, spec, rows, trial: int):
    """Every other trial, each rank's expected sizes (host lists, device tensors): what arrives,
    and in every fourth trial one rank's chunk off by one; else (None, None)."""
    if trial % 2 == 0:
        return None, None
    R = len(rows)
    lists = arriving_sizes(spec, [sent_sizes(rows[r], CAPACITY, len(rows[r]) * CAPACITY)[1] for r in range(R)])
    if trial % 4 == 3:
        late = [r for r in range(R) if lists[r]]
        if late:
            r = late[int(rng.integers(len(late)))]
            k = int(rng.integers(len(lists[r])))
            lists[r][k] += 1 if lists[r][k] < CAPACITY else -1
    return lists, [torch.tensor(v, dtype=torch.int64, device=f"cuda:{DEVICE}") for v in lists]


def _check_outputs(spec, datas, rows, bufs, label: str, expected=None) -> list:
    """Every rank's output, out_sizes and guard zones against the evaluator (``expected``: the
    sizes each rank expects, or None); returns the size errors it expects."""
    want, want_sizes, errors = evaluate_sized(spec, datas, rows, CAPACITY, [b.poisoned() for b in bufs], expected)
    for r, b in enumerate(bufs):
        b.check(want[r], want_sizes[r], f"{label} rank {r}")
    return errors


def _trials(source, R: int, dtypes, seed: int, trials: int) -> None:
    """``source`` (a sized collective) loaded on R loopback ranks: ``trials`` size vectors per
    dtype (``vectors``, each rank's row cut to its input chunks), every other one with the
    receivers' expected sizes (``_expectations``), every rank's output, out sizes and guard zones
    against the evaluator."""
    import purlinc

    group = _group(R)
    coll = purlinc.load(source, group, capacity=CAPACITY, channels=2)
    spec = coll[0].compiled.spec
    ins, outs = [len(c) for c in spec.inputs], [len(c) for c in spec.outputs]
    rng = np.random.default_rng(seed)
    try:
        for dtype in dtypes:
            bufs = [Buffers(R, dtype, ins[r] * CAPACITY, outs[r] * CAPACITY, ins[r], outs[r]) for r in range(R)]
            for trial in range(trials):
                rows = [v[:ins[r]] for r, v in enumerate(vectors(rng, R, CAPACITY, trial))]
                datas = [b.fill(rng, row) for b, row in zip(bufs, rows)]
                lists, expected = _expectations(rng, spec, rows, trial)
                _run(coll, group, bufs, expected)
                errors = _check_outputs(spec, datas, rows, bufs, f"R={R} {dtype.value} trial {trial}", lists)
                if any(errors):  # an expectation off by one: that chunk alone is not written
                    assert [e[2] for rank_errors in errors for e in rank_errors] == ["expected"]
                    with pytest.raises(SizeError, match="differs from the"):
                        coll.check()
                coll.check()
    finally:
        coll.close()
        group.close()


@pytest.mark.parametrize("R", WORLDS, ids=[f"R{w}" for w in WORLDS])
def test_random_sizes_every_dtype(R):
    _trials(SIZED / "alltoallv.pln", R, DTYPES, R, trials=6)


TWICE = "collective allgatherv_twice with sizes n[R] of x {\n    in[r] = x[r]\n    out[r] = x[0..R], x[0..R]\n    copy\n}\n"


@pytest.mark.parametrize("R", (1, 2, 3, 5, 8), ids=lambda R: f"R{R}")
def test_an_output_holding_each_chunk_twice(R):
    """Each chunk twice in the output: the second copies read the staging slot (or own input)
    again, never the first copy in OUT (its offset is another unit's)."""
    _trials(TWICE, R, (DType.BFLOAT16, DType.FLOAT8_E4M3), 100 + R, trials=4)  # 2 and 1 byte elements


ROOT_ONLY = "collective root_keeps with sizes n[R] of x {\n    in[r] = x[r]\n    out[0] = x[0]\n    copy\n}\n"


@pytest.mark.parametrize("R", (2, 3, 5), ids=lambda R: f"R{R}")
def test_ranks_with_nothing_to_do(R):
    """Only rank 0 moves data (its own chunk into its output): the other ranks' programs have
    no steps and their outputs no chunks; their kernels run, write nothing and return."""
    _trials(ROOT_ONLY, R, (DType.FLOAT32,), 300 + R, trials=4)


@pytest.mark.parametrize("R, channels", [(2, 1), (4, 3), (8, 2)])
def test_graph_replays_with_new_sizes(R, channels):
    """One call per rank captured once; every replay reads the sizes the device holds then."""
    import purlinc

    group = _group(R)
    coll = purlinc.load(SIZED / "alltoallv.pln", group, capacity=CAPACITY, channels=channels, dtype="bfloat16")
    spec = coll[0].compiled.spec
    rng = np.random.default_rng(100 + R)
    bufs = [Buffers(R, DType.BFLOAT16, R * CAPACITY, R * CAPACITY) for _ in range(R)]
    try:
        for b, row in zip(bufs, vectors(rng, R, CAPACITY, 3)):
            b.fill(rng, row)
        _run(coll, group, bufs)  # compile and load outside the capture
        graphs = capture_per_rank(group.streams,
                                  lambda r: coll[r](bufs[r].x, bufs[r].sizes, bufs[r].out, bufs[r].out_sizes))
        for it in range(8):
            rows = vectors(rng, R, CAPACITY, it)
            datas = [b.fill(rng, row) for b, row in zip(bufs, rows)]
            replay_per_rank(graphs, group.streams, DEVICE)
            coll.check()
            _check_outputs(spec, datas, rows, bufs, f"graph R={R} replay {it}")
    finally:
        coll.close()
        group.close()


def test_over_capacity_and_past_the_output_are_size_errors():
    """A size over the capacity (rank 2 to rank 1) and an output too short (rank 3's): each
    raises a SizeError naming the rank and the pair, the chunks are moved as 0, and the
    guard zones around every output stay poisoned."""
    import purlinc

    R = 4
    group = _group(R)
    coll = purlinc.load(SIZED / "alltoallv.pln", group, capacity=CAPACITY, channels=2)
    spec = coll[0].compiled.spec
    rng = np.random.default_rng(9)
    try:
        for case in ("capacity", "output"):
            short = case == "output"
            bufs = [Buffers(R, DType.FLOAT32, R * CAPACITY, R * CAPACITY - (CAPACITY + 3 if short and r == 3 else 0))
                    for r in range(R)]
            rows = vectors(rng, R, CAPACITY, 2)  # everything at capacity
            if not short:
                rows[2][1] = CAPACITY + 5
            datas = [b.fill(rng, row) for b, row in zip(bufs, rows)]
            _run(coll, group, bufs)
            expected = r"rank 2, call \d+: chunk x\[2\]\[1\] from rank 2 to rank 1: size n\[2\]\[1\] = 42 outside 0..37" \
                if not short else r"rank 3, call \d+: chunk x\[[23]\]\[3\] from rank [23] to rank 3: size 37 reaches past the end of rank 3's output"
            with pytest.raises(SizeError, match=expected):
                coll.check()
            coll.check()  # raised once
            assert any(_check_outputs(spec, datas, rows, bufs, case))
        # and the collective keeps working after an error
        bufs = [Buffers(R, DType.FLOAT32, R * CAPACITY, R * CAPACITY) for _ in range(R)]
        rows = vectors(rng, R, CAPACITY, 3)
        datas = [b.fill(rng, row) for b, row in zip(bufs, rows)]
        _run(coll, group, bufs)
        coll.check()
        _check_outputs(spec, datas, rows, bufs, "after the errors,")
    finally:
        coll.close()
        group.close()


def test_a_size_error_of_a_call_in_rows_counts_rows():
    """row=8: sizes and the capacity count rows of 8 elements; the kernel records the row, so
    the error says 9 rows outside 0..8 rather than naming the load's 64 elements as 8."""
    import purlinc

    R, row, capacity = 2, 8, 64
    group = _group(R)
    coll = purlinc.load(SIZED / "alltoallv.pln", group, capacity=capacity)
    try:
        bufs = [Buffers(R, DType.FLOAT32, R * capacity, R * capacity) for _ in range(R)]
        rng = np.random.default_rng(3)
        for r, b in enumerate(bufs):
            b.fill(rng, [capacity // row + 1 if r == 0 else 1, 1])
        on_rank_streams(group.streams, DEVICE, lambda: coll(
            [b.x for b in bufs], [b.sizes for b in bufs], [b.out for b in bufs], [b.out_sizes for b in bufs],
            streams=group.streams, row=row))
        with pytest.raises(SizeError, match=r"rank 0, call \d+: chunk x\[0\]\[0\] from rank 0 to rank 0: size "
                                            r"n\[0\]\[0\] = 9 rows outside 0..8 \(the capacity fixed at load, in "
                                            r"rows of 8 elements\)"):
            coll.check()
    finally:
        coll.close()
        group.close()


def _expected_rows(rows, R: int) -> list[list[int]]:
    """What each rank receives from every rank: its column of the size table."""
    return [[rows[src][dst] for src in range(R)] for dst in range(R)]


def test_expected_sizes_lay_out_the_output_and_catch_a_disagreement():
    """Every rank passes the sizes it expects to receive (``expected_sizes``, what torch's
    output_split_sizes become): where they agree with what arrives, the outputs equal the
    evaluator's and nothing is raised; where rank 1 expects one unit more from rank 2 than
    rank 2 sends, that chunk is not written, the chunks after it lie at the offsets the
    expectation gives them, and a SizeError names the pair and both sizes."""
    import purlinc

    R = 4
    group = _group(R)
    coll = purlinc.load(SIZED / "alltoallv.pln", group, capacity=CAPACITY, channels=2)
    spec = coll[0].compiled.spec
    rng = np.random.default_rng(17)
    bufs = [Buffers(R, DType.FLOAT32, R * CAPACITY, R * CAPACITY + 3) for _ in range(R)]
    expect = [torch.zeros(R, dtype=torch.int64, device=f"cuda:{DEVICE}") for _ in range(R)]
    try:
        for case in ("agree", "disagree", "agree again"):
            rows = [[int(v) for v in rng.integers(1, CAPACITY, R)] for _ in range(R)]
            expected = _expected_rows(rows, R)
            if case == "disagree":
                expected[1][2] += 1
            for e, row in zip(expect, expected):
                e.copy_(torch.tensor(row, dtype=torch.int64))
            datas = [b.fill(rng, row) for b, row in zip(bufs, rows)]
            on_rank_streams(group.streams, DEVICE, lambda: coll(
                [b.x for b in bufs], [b.sizes for b in bufs], [b.out for b in bufs], [b.out_sizes for b in bufs],
                streams=group.streams, expected_sizes=expect))
            want, want_sizes, errors = evaluate_sized(spec, datas, rows, CAPACITY, [b.poisoned() for b in bufs],
                                                      expected)
            for r, b in enumerate(bufs):
                b.check(want[r], want_sizes[r], f"{case} rank {r}")
            if case == "disagree":
                assert errors[1] == [("out", 2, "expected", rows[2][1], rows[2][1] + 1)]
                assert want_sizes[1][2] == 0 and want_sizes[1][3] == rows[3][1]
                with pytest.raises(SizeError, match=rf"rank 1, call \d+: chunk x\[2\]\[1\] from rank 2 to rank 1: "
                                                    rf"size {rows[2][1]} differs from the {rows[2][1] + 1} rank 1 "
                                                    r"expects \(its expected sizes\); it was not written"):
                    coll.check()
            else:
                assert not any(errors)
            coll.check()
    finally:
        coll.close()
        group.close()


class _TorchRank:
    """What purlinc.torch.sized needs of a group: one rank of a loopback LocalGroup."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size, self.device, self.comm = rank, world_size, torch.device(f"cuda:{DEVICE}"), None


@contextlib.contextmanager
def _torch_ranks(R: int, capacity: int, **options):
    """R loopback ranks as purlinc.torch.sized sees them, their uneven all-to-all loaded with
    ``capacity`` (``options`` to the load), every kernel loaded first: (group, a2a, ranks)."""
    import purlinc
    from purlinc.torch import sized

    group = _group(R)
    a2a = purlinc.load(SIZED / "alltoallv.pln", group, capacity=capacity, **options)
    ranks = [_TorchRank(r, R) for r in range(R)]
    try:
        for r in range(R):  # every kernel loaded before any rank's call spins (a module load waits for it)
            a2a[r].warm("float32")
        for r, g in enumerate(ranks):
            sized.configure(g, capacity=capacity, loader=lambda source, comm, cap, r=r: a2a[r])
        yield group, a2a, ranks
    finally:
        for g in ranks:
            sized.state_of(g).close()
        a2a.close()
        group.close()


def _all_to_all_single_on_ranks(group, ranks, outs, inputs, out_splits, splits) -> None:
    """Every rank's all_to_all_single on its own stream, the device synchronized after."""
    from purlinc.torch import sized

    def issue():
        for r, rank in enumerate(ranks):
            with torch.cuda.stream(group.streams[r]):
                sized.all_to_all_single(rank, outs[r], inputs[r], out_splits[r], splits[r])
    on_rank_streams(group.streams, DEVICE, issue)


def test_all_to_all_single_checks_output_split_sizes():
    """purlinc.torch.sized.all_to_all_single (host split lists) on R=3 loopback ranks: with
    output_split_sizes that agree with what the peers send, every output equals the rows
    packed by source; where rank 0 expects one row less from rank 1 and one more from rank 2
    (the same total), those rows are not written, rank 0's own rows lie where its lists put
    them, and the next call raises a SizeError naming the first pair."""
    R, H = 3, 8
    rng = np.random.default_rng(23)
    with _torch_ranks(R, CAPACITY * H, channels=2) as (group, a2a, ranks):
        for case in ("agree", "disagree", "agree again"):
            splits = [[int(v) for v in rng.integers(1, 6, R)] for _ in range(R)]  # splits[src][dst] rows
            inputs = [torch.randn(sum(row), H, device=f"cuda:{DEVICE}") for row in splits]
            out_splits = _expected_rows(splits, R)
            if case == "disagree":
                out_splits[0][1] -= 1
                out_splits[0][2] += 1
            outs = [torch.full((sum(o), H), float("nan"), device=f"cuda:{DEVICE}") for o in out_splits]
            _all_to_all_single_on_ranks(group, ranks, outs, inputs, out_splits, splits)
            for r in range(R):
                offset = 0
                for src in range(R):
                    rows = out_splits[r][src]
                    got = outs[r][offset:offset + rows]
                    if rows == splits[src][r]:
                        start = sum(splits[src][:r])
                        assert torch.equal(got, inputs[src][start:start + rows]), f"{case}: rank {r} from {src}"
                    else:
                        assert got.isnan().all(), f"{case}: rank {r} wrote the rows from rank {src} it did not expect"
                    offset += rows
            if case == "disagree":
                with pytest.raises(SizeError, match=rf"rank 0, call \d+: chunk x\[1\]\[0\] from rank 1 to rank 0: "
                                                    rf"size {splits[1][0]} rows differs from the {splits[1][0] - 1} "):
                    a2a[0].check()
            a2a.check()


def test_all_to_all_single_counts_each_tensors_own_rows():
    """torch's rule: input_split_sizes count input's rows (8 elements here), output_split_sizes
    output's (4 elements: another shape, the same bytes per pair); R=3 loopback ranks, every
    output element written with its source rows' values."""
    R, H = 3, 8
    rng = np.random.default_rng(29)
    with _torch_ranks(R, CAPACITY * H) as (group, a2a, ranks):
        splits = [[int(v) for v in rng.integers(0, 5, R)] for _ in range(R)]  # splits[src][dst], rows of H
        inputs = [torch.randn(sum(row), H, device=f"cuda:{DEVICE}") for row in splits]
        out_splits = [[2 * v for v in o] for o in _expected_rows(splits, R)]  # rows of H // 2
        outs = [torch.full((sum(o), H // 2), float("nan"), device=f"cuda:{DEVICE}") for o in out_splits]
        _all_to_all_single_on_ranks(group, ranks, outs, inputs, out_splits, splits)
        a2a.check()
        for r in range(R):
            want = torch.cat([inputs[src][sum(splits[src][:r]):sum(splits[src][:r + 1])] for src in range(R)])
            assert torch.equal(outs[r].reshape(-1), want.reshape(-1)), f"rank {r}"


def test_all_to_all_single_in_place_reads_from_a_copy():
    """Split lists with output = input (the equal form's in-place call): the kernel reads a copy
    of input, so no rank reads rows a peer has already overwritten; R=4 loopback ranks, even
    lists (in place needs each rank to receive as many rows as it sends)."""
    R, H = 4, 8
    with _torch_ranks(R, CAPACITY * H) as (group, a2a, ranks):
        splits = [[3] * R for _ in range(R)]
        inputs = [torch.randn(3 * R, H, device=f"cuda:{DEVICE}") for _ in range(R)]
        before = [x.clone() for x in inputs]
        _all_to_all_single_on_ranks(group, ranks, inputs, inputs, splits, splits)
        a2a.check()
        for r in range(R):
            want = torch.cat([before[src][3 * r:3 * r + 3] for src in range(R)])
            assert torch.equal(inputs[r], want), f"rank {r}"


def test_all_to_all_single_does_not_wait_for_the_gpu_and_refuses_a_capture():
    """Host split lists reach the GPU by a copy that does not block the host: a call issued
    behind 50 ms of queued work returns while that work still runs (a copy from pageable memory
    made torch synchronize the stream), and its output is right once the stream drains.  Under
    a CUDA graph capture the call is refused by name before anything is captured."""
    import purlinc
    from purlinc.runtime.errors import ArgumentError
    from purlinc.torch import sized

    group = _group(1)
    a2a = purlinc.load(SIZED / "alltoallv.pln", group, capacity=CAPACITY * 4, channels=2)
    rank = _TorchRank(0, 1)
    sized.configure(rank, capacity=CAPACITY * 4, loader=lambda source, comm, cap: a2a[0])
    stream = group.streams[0]
    x = torch.randn(5, 4, device=f"cuda:{DEVICE}")
    out = torch.full((5, 4), float("nan"), device=f"cuda:{DEVICE}")
    try:
        with torch.cuda.stream(stream):
            sized.all_to_all_single(rank, out, x, [5], [5])  # loads the kernel
        stream.synchronize()
        cycles = 100_000_000  # about 50 ms at 2 GHz
        out.fill_(float("nan"))
        torch.cuda.synchronize(DEVICE)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)
            sized.all_to_all_single(rank, out, x, [5], [5])
            assert not stream.query(), "the call waited for the work queued before it"
        stream.synchronize()
        assert torch.equal(out, x)
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(ArgumentError, match="all_to_all_single: split lists given while a CUDA graph is captured"):
            with torch.cuda.graph(graph, stream=stream):
                sized.all_to_all_single(rank, out, x, [5], [5])
        a2a.check()
    finally:
        sized.state_of(rank).close()
        a2a.close()
        group.close()
