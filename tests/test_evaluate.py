"""The reference evaluator against hand-written NumPy formulas, one per collective.

The formulas below never look at the spec: they read each rank's input as an array of
chunks and say what a collective means in NumPy terms.  Reductions: widen to float32,
reduce over the rank axis in rank order (NumPy reduces an outer axis one row after another),
round once with ``from_float32``; int32 wraps.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from purlinc.dtypes import DType, ReduceOp, from_float32
from purlinc.frontend.check import check, supports
from purlinc.frontend.evaluate import evaluate
from purlinc.frontend.parse import parse, parse_file
REPO = Path(__file__).resolve().parent.parent

REDUCIBLE = (DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16, DType.INT32, DType.INT64)
ALL_DTYPES = (*REDUCIBLE, DType.FLOAT8_E4M3, DType.FLOAT8_E5M2)

world_sizes = st.integers(1, 8)
counts = st.one_of(st.sampled_from([0, 1, 2, 3]), st.integers(0, 37))
seeds = st.integers(0, 2**32 - 1)
copy_dtypes = st.sampled_from(ALL_DTYPES)
reduce_dtypes = st.sampled_from(REDUCIBLE)
ops = st.sampled_from(list(ReduceOp))


@functools.cache
def example(name: str):
    return parse_file(REPO / "examples" / f"{name}.pln")


# --- data and hand formulas -------------------------------------------------------------

def random_storage(rng: np.random.Generator, size: int, dtype: DType) -> np.ndarray:
    """Values in dtype's storage; int32 over its whole range so sums and products wrap."""
    if dtype is DType.INT32:
        return rng.integers(-(2**31), 2**31, size=size, dtype=np.int64).astype(np.int32)
    if dtype is DType.INT64:  # the whole range: sums and products wrap
        return rng.integers(-(2**63), 2**63 - 1, size=size, dtype=np.int64)
    if dtype in (DType.FLOAT8_E4M3, DType.FLOAT8_E5M2):
        return rng.integers(0, 256, size=size).astype(np.uint8)  # every bit pattern, NaNs included
    return from_float32(rng.standard_normal(size).astype(np.float32), dtype)


def make_inputs(spec, count: int, dtype: DType, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [random_storage(rng, len(spec.inputs[rank]) * count, dtype) for rank in range(spec.world_size)]


def widen(stored: np.ndarray, dtype: DType) -> np.ndarray:
    if dtype is DType.BFLOAT16:
        return (stored.astype(np.uint32) << 16).view(np.float32)  # bf16 is the top half of a float32
    return stored.astype(np.float32)


def hand_reduce(arrays: list[np.ndarray], dtype: DType, op: ReduceOp) -> np.ndarray:
    """Element-wise reduction over ``arrays`` (one per contributing rank)."""
    if dtype in (DType.INT32, DType.INT64):
        width = dtype.storage
        stacked = np.stack(arrays).astype(width)
        accumulate = {
            "sum": lambda s: s.sum(axis=0, dtype=width),  # integer arithmetic wraps
            "prod": lambda s: s.prod(axis=0, dtype=width),
            "max": lambda s: s.max(axis=0),
            "min": lambda s: s.min(axis=0),
        }[op.value]
        return accumulate(stacked)
    stacked = np.stack([widen(a, dtype) for a in arrays])
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        reduced = {
            "sum": lambda s: s.sum(axis=0, dtype=np.float32),
            "prod": lambda s: s.prod(axis=0, dtype=np.float32),
            "max": lambda s: s.max(axis=0),
            "min": lambda s: s.min(axis=0),
        }[op.value](stacked)
    return from_float32(reduced.astype(np.float32), dtype)


def chunks(array: np.ndarray, count: int) -> np.ndarray:
    """A rank's buffer as rows of ``count`` elements."""
    return array.reshape(-1, count) if count else array.reshape(0, 0)


def assert_bitwise_equal(actual: list[np.ndarray], expected: list[np.ndarray], dtype: DType) -> None:
    assert len(actual) == len(expected)
    for rank, (got, want) in enumerate(zip(actual, expected)):
        want = np.asarray(want, dtype=dtype.storage).reshape(-1)
        assert got.dtype == dtype.storage, f"rank {rank}: dtype {got.dtype}"
        assert got.shape == want.shape, f"rank {rank}: shape {got.shape} != {want.shape}"
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"rank {rank} differs"


def empty(dtype: DType) -> np.ndarray:
    return np.empty(0, dtype=dtype.storage)


def hand_allgather(inputs, R, count, dtype, op, root):
    return [np.concatenate(inputs) for _ in range(R)]


def hand_reduce_scatter(inputs, R, count, dtype, op, root):
    if count == 0:
        return [empty(dtype) for _ in range(R)]
    return [hand_reduce([chunks(a, count)[r] for a in inputs], dtype, op) for r in range(R)]


def hand_allreduce(inputs, R, count, dtype, op, root):
    return [hand_reduce(list(inputs), dtype, op) for _ in range(R)]


def hand_alltoall(inputs, R, count, dtype, op, root):
    if count == 0:
        return [empty(dtype) for _ in range(R)]
    return [np.concatenate([chunks(inputs[i], count)[r] for i in range(R)]) for r in range(R)]


def hand_broadcast(inputs, R, count, dtype, op, root):
    return [inputs[root] for _ in range(R)]


def hand_reduce_to_root(inputs, R, count, dtype, op, root):
    return [hand_reduce(list(inputs), dtype, op) if r == root else empty(dtype) for r in range(R)]


def hand_gather(inputs, R, count, dtype, op, root):
    return [np.concatenate(inputs) if r == root else empty(dtype) for r in range(R)]


def hand_scatter(inputs, R, count, dtype, op, root):
    if count == 0:
        return [empty(dtype) for _ in range(R)]
    return [chunks(inputs[root], count)[r] for r in range(R)]


COPIES = {"allgather": hand_allgather, "alltoall": hand_alltoall, "broadcast": hand_broadcast,
          "gather": hand_gather, "scatter": hand_scatter}
REDUCTIONS = {"reduce_scatter": hand_reduce_scatter, "allreduce": hand_allreduce, "reduce": hand_reduce_to_root}
ROOTED = {"broadcast", "gather", "scatter", "reduce"}


def run(name, data, formula, dtype, op):
    R = data.draw(world_sizes, label="R")
    count = data.draw(counts, label="count")
    root = data.draw(st.integers(0, R - 1), label="root") if name in ROOTED else None
    seed = data.draw(seeds, label="seed")
    spec = check(example(name), R, {"root": root} if root is not None else None)
    inputs = make_inputs(spec, count, dtype, seed)
    expected = formula([a.copy() for a in inputs], R, count, dtype, op, root)
    assert_bitwise_equal(evaluate(spec, inputs, count, dtype, op), expected, dtype)


# --- the eight standard collectives -------------------------------------------------------

@pytest.mark.parametrize("name", sorted(COPIES))
@given(data=st.data(), dtype=copy_dtypes)
def test_copy_collectives(name, data, dtype):
    run(name, data, COPIES[name], dtype, None)


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
@given(data=st.data(), dtype=reduce_dtypes, op=ops)
def test_reduce_collectives(name, data, dtype, op):
    run(name, data, REDUCTIONS[name], dtype, op)


@pytest.mark.parametrize("name", sorted(COPIES))
def test_copies_ignore_op(name):
    spec = check(example(name), 2)
    inputs = make_inputs(spec, 3, DType.FLOAT32, 0)
    assert_bitwise_equal(evaluate(spec, inputs, 3, "float32", "max"), evaluate(spec, inputs, 3, "float32"), DType.FLOAT32)


# --- the extra examples ----------------------------------------------------------------

@given(R=world_sizes, count=counts, shift=st.integers(-9, 9), dtype=copy_dtypes, seed=seeds)
def test_ring_shift(R, count, shift, dtype, seed):
    spec = check(example("ring_shift"), R, {"shift": shift})
    inputs = make_inputs(spec, count, dtype, seed)
    expected = [inputs[(r + shift) % R] for r in range(R)]
    assert_bitwise_equal(evaluate(spec, inputs, count, dtype), expected, dtype)


@given(half=st.integers(1, 4), count=counts, dtype=copy_dtypes, seed=seeds)
def test_pairwise_exchange(half, count, dtype, seed):
    R = 2 * half
    spec = check(example("pairwise_exchange"), R)
    inputs = make_inputs(spec, count, dtype, seed)
    expected = [inputs[r ^ 1] for r in range(R)]
    assert_bitwise_equal(evaluate(spec, inputs, count, dtype), expected, dtype)


@pytest.mark.parametrize("R", [1, 3, 5, 7])
def test_pairwise_exchange_needs_an_even_world(R):
    assert not supports(example("pairwise_exchange"), R)
    with pytest.raises(Exception, match=f"pairwise_exchange is not defined for R={R}: it requires R % 2 == 0"):
        check(example("pairwise_exchange"), R)


@given(R=world_sizes, k=st.integers(1, 3), count=counts, dtype=copy_dtypes, seed=seeds)
def test_alltoall_blocks(R, k, count, dtype, seed):
    spec = check(example("alltoall_blocks"), R, {"k": k})
    inputs = make_inputs(spec, count, dtype, seed)
    # in[i] holds blocks [peer][slot]; rank r receives every i's blocks for peer r, in i order.
    blocks = [a.reshape(R, k, count) for a in inputs]
    expected = [np.stack([blocks[i][r] for i in range(R)]) for r in range(R)]
    assert_bitwise_equal(evaluate(spec, inputs, count, dtype), expected, dtype)


@given(R=world_sizes, count=counts, dtype=copy_dtypes, seed=seeds)
def test_allgather_rotated(R, count, dtype, seed):
    spec = check(example("allgather_rotated"), R)
    inputs = make_inputs(spec, count, dtype, seed)
    expected = [np.concatenate([inputs[(r + i) % R] for i in range(R)]) for r in range(R)]
    assert_bitwise_equal(evaluate(spec, inputs, count, dtype), expected, dtype)


# --- copy replicated ------------------------------------------------------------------

REPLICATED = "collective shared { in[r] = x, y[r]  out[r] = x, y[(r + 1) % R]  copy replicated }"


@given(R=world_sizes, count=st.integers(1, 9), dtype=copy_dtypes, seed=seeds)
def test_copy_replicated_accepts_identical_producers(R, count, dtype, seed):
    spec = check(parse(REPLICATED), R)
    rng = np.random.default_rng(seed)
    x = random_storage(rng, count, dtype)
    ys = [random_storage(rng, count, dtype) for _ in range(R)]
    inputs = [np.concatenate([x, ys[r]]) for r in range(R)]
    expected = [np.concatenate([x, ys[(r + 1) % R]]) for r in range(R)]
    assert_bitwise_equal(evaluate(spec, inputs, count, dtype), expected, dtype)


def test_copy_replicated_rejects_differing_producers():
    spec = check(parse(REPLICATED), 3)
    inputs = [np.array([1.0, 10.0], np.float32), np.array([1.0, 11.0], np.float32), np.array([2.0, 12.0], np.float32)]
    with pytest.raises(ValueError, match=r"'copy replicated' promises identical producers, but x differs "
                                         r"between r0\.in\[0\] and r2\.in\[0\]"):
        evaluate(spec, inputs, 1, "float32")


def test_copy_replicated_compares_bits_not_values():
    spec = check(parse(REPLICATED), 2)
    zero, negative_zero = np.array([0.0, 1.0], np.float32), np.array([-0.0, 2.0], np.float32)
    with pytest.raises(ValueError, match="differs"):
        evaluate(spec, [zero, negative_zero], 1, "float32")
    nan = np.array([np.nan, 1.0], np.float32)
    out = evaluate(spec, [nan, nan.copy()], 1, "float32")  # identical NaN bits are identical data
    assert np.isnan(out[0][0]) and np.isnan(out[1][0])


# --- the evaluator's arithmetic, pinned down -----------------------------------------------

def test_sum_accumulates_in_rank_order_in_float32():
    spec = check(example("allreduce"), 3)
    # 1 + 1e8 rounds back to 1e8 in float32, so rank order gives 0; (1e8 - 1e8) + 1 would give 1.
    inputs = [np.full(3, value, np.float32) for value in (1.0, 1e8, -1e8)]
    assert [o.tolist() for o in evaluate(spec, inputs, 1, "float32", "sum")] == [[0.0] * 3] * 3


def test_bfloat16_rounds_once():
    spec = check(example("reduce"), 4)
    values = [1.0, 2.0**-9, 2.0**-9, 2.0**-9]  # each representable in bf16; the sum is not
    inputs = [from_float32(np.array([v], np.float32), DType.BFLOAT16) for v in values]
    (out, *_) = evaluate(spec, inputs, 1, "bfloat16", "sum")
    # rounding after every step would stay at 1.0; once, at the end, gives 1 + 2**-7.
    assert widen(out, DType.BFLOAT16).tolist() == [1.0 + 2.0**-7]


def test_int64_wraps_in_64_bits():
    spec = check(parse("collective allreduce { in[r] = x[0..R]  out[r] = x[0..R]  reduce }"), 2, None)
    big = np.array([2**63 - 1, -(2**63), 2**40, 5], np.int64)
    out = evaluate(spec, [big, np.array([1, -1, 2**40, -7], np.int64)], 2, "int64", "sum")[0]
    assert out.dtype == np.int64 and out.tolist() == [-(2**63), 2**63 - 1, 2**41, -2]


def test_int32_wraps():
    spec = check(example("reduce"), 2)
    inputs = [np.array([2**31 - 1, -(2**31), 65536], np.int32), np.array([1, -1, 65536], np.int32)]
    assert evaluate(spec, inputs, 3, "int32", "sum")[0].tolist() == [-(2**31), 2**31 - 1, 131072]
    assert evaluate(spec, inputs, 3, "int32", "prod")[0].tolist() == [2**31 - 1, -(2**31), 0]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_float16_overflows_to_infinity():
    spec = check(example("reduce"), 2)
    inputs = [np.array([60000, -60000], np.float16)] * 2
    assert evaluate(spec, inputs, 2, "float16", "sum")[0].tolist() == [np.inf, -np.inf]


# --- misuse of the evaluator is a ValueError, not a wrong answer ---------------------------

@pytest.mark.parametrize(
    "inputs, count, dtype, op, message",
    [
        ([np.zeros(2, np.float32)], 1, "float32", "sum", r"expected 2 input arrays \(one per rank\), got 1"),
        ([np.zeros(2, np.float32), np.zeros(2, np.float16)], 1, "float32", "sum",
         r"input of rank 1: expected NumPy dtype float32 \(storage of float32\), got float16"),
        ([np.zeros(2, np.float32), np.zeros(3, np.float32)], 1, "float32", "sum",
         r"input of rank 1: expected shape \(2,\) \(2 chunks x 1 elements\), got \(3,\)"),
        ([np.zeros(2, np.float32)] * 2, -1, "float32", "sum", "count must be >= 0, got -1"),
        ([np.zeros(2, np.float32)] * 2, 1.0, "float32", "sum", r"count must be an integer, got 1.0 \(float\)"),
        ([np.zeros(2, np.float32)] * 2, True, "float32", "sum", r"count must be an integer, got True \(bool\)"),
        ([np.zeros(2, np.float32)] * 2, 1, "float32", None, "allreduce is a reduction: give op"),
        ([np.zeros(2, np.float32)] * 2, 1, "float32", "avg", "unknown reduce op 'avg'"),
        ([np.zeros(2, np.uint8)] * 2, 1, "float8_e4m3", "sum", "float8_e4m3 cannot be reduced"),
        ([np.zeros(2, np.float32)] * 2, 1, "float64", "sum", "unknown dtype 'float64'"),
    ],
)
def test_misuse(inputs, count, dtype, op, message):
    with pytest.raises(ValueError, match=message):
        evaluate(check(example("allreduce"), 2), inputs, count, dtype, op)


def test_an_epilogue_on_integers_is_refused_as_the_kernels_refuse_it():
    from purlinc.frontend.parse import parse_file

    path = Path(__file__).resolve().parent.parent / "examples" / "fused" / "allreduce_add_rmsnorm.pln"
    spec = check(parse_file(path), 2, {"hidden": 4})
    operands = [{"residual": np.zeros(4, np.int32), "weight": np.ones(4, np.int32), "eps": 1e-6}] * 2
    with pytest.raises(ValueError, match="an epilogue computes in float32; int32 outputs are not supported"):
        evaluate(spec, [np.ones(4, np.int32)] * 2, 4, "int32", "sum", operands)


@pytest.mark.parametrize("eps, ok", [(np.float32(1e-6), True), (np.int64(0), True), (True, False), ("1e-6", False)])
def test_a_scalar_operand_is_any_real_number_but_a_bool(eps, ok):
    from purlinc.frontend.parse import parse_file

    path = Path(__file__).resolve().parent.parent / "examples" / "fused" / "allreduce_add_rmsnorm.pln"
    spec = check(parse_file(path), 2, {"hidden": 4})
    operands = [{"residual": np.zeros(4, np.float32), "weight": np.ones(4, np.float32), "eps": eps} for _ in range(2)]
    run = lambda: evaluate(spec, [np.ones(4, np.float32)] * 2, 4, "float32", "sum", operands)  # noqa: E731
    if ok:
        assert np.isfinite(run()[0]).all()
    else:
        with pytest.raises(ValueError, match="operand 'eps': expected a number"):
            run()


# ---- NaN bits, one source, epilogue scalars (what the simulator and the runtime do too) ------

def _lowered(text, world_size, **options):
    from purlinc.snac.ir import Algorithm, LowerOptions
    from purlinc.snac.lower import lower

    spec = check(parse(text), world_size)
    algorithm = Algorithm(options.pop("algorithm", "direct-push"))
    return spec, lower(spec, LowerOptions(algorithm, **options))


@pytest.mark.parametrize("count", [1, 16, 17, 33])
def test_a_reduced_nan_is_the_canonical_one_whatever_the_count(count):
    """NumPy's SIMD loop and its remainder keep different operands' NaN payloads, so the
    evaluator's bits depended on the count and the simulator (other slice lengths) disagreed."""
    from purlinc.snac.simulate import simulate

    spec, schedule = _lowered("collective ar { in[r] = x out[r] = x reduce }", 2, channels=2)
    for dtype, bits in (("float32", (0x7FC00000, 0xFFC00000, np.uint32)), ("float16", (0x7E00, 0xFE01, np.uint16))):
        storage = DType.parse(dtype).storage
        xs = [np.full(count, bits[2](bits[0])).view(storage), np.full(count, bits[2](bits[1])).view(storage)]
        want = evaluate(spec, xs, count, dtype, "sum")
        got = simulate(schedule, spec, xs, count, dtype, "sum")
        canonical = np.array([np.nan], storage).view(bits[2])[0]
        for out in (*want, *got):
            assert (out.view(bits[2]) == canonical).all(), (dtype, [hex(v) for v in out.view(bits[2])])


def test_one_source_is_its_own_reduction_bit_for_bit():
    """The lowerings copy a chunk with one source; the evaluator rounded it through float32,
    which canonicalized a NaN's payload."""
    from purlinc.snac.simulate import simulate

    spec, schedule = _lowered("collective s { in[r] = x[r]  out[r] = x[(r + 1) % R]  reduce }", 2)
    xs = [np.array([0x7F81, 0xFFC1], np.uint16)] * 2  # bf16 NaNs with payloads
    want = evaluate(spec, xs, 2, "bfloat16", "sum")
    got = simulate(schedule, spec, xs, 2, "bfloat16", "sum")
    for out in (*want, *got):
        assert [hex(v) for v in out] == ["0x7f81", "0xffc1"]


FUSED = Path(__file__).resolve().parent.parent / "examples" / "fused" / "allreduce_add_rmsnorm.pln"


@pytest.mark.parametrize("eps, problem", [
    (-1.0, "rmsnorm's eps must be >= 0, got -1.0"),
    (float("nan"), "expected a finite float32 value, got nan"),
    (1e39, "expected a finite float32 value, got 1e\\+39"),
    (10**400, "expected a finite float32 value, got 1000"),
    ("1e-6", "expected a number \\(float32\\), got str"),
])
def test_the_oracle_refuses_the_scalars_the_runtime_refuses(eps, problem):
    spec = check(parse_file(FUSED), 1, {"hidden": 8})
    operands = [{"residual": np.zeros(8, np.float32), "weight": np.ones(8, np.float32), "eps": eps}]
    with pytest.raises(ValueError, match=rf"operand 'eps': {problem}"):
        evaluate(spec, [np.full(8, 0.5, np.float32)], 8, "float32", "sum", operands)


def test_the_epilogue_oracle_warns_of_nothing_the_kernels_compute(recwarn):
    """A zero row with eps=0 is 0 * inf = NaN, as in the kernels (rsqrtf(0) = inf): NumPy's
    warnings were errors under -W error, as the reductions' are not."""
    import warnings

    spec = check(parse_file(FUSED), 1, {"hidden": 8})
    operands = [{"residual": np.zeros(8, np.float32), "weight": np.ones(8, np.float32), "eps": 0.0}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = evaluate(spec, [np.zeros(8, np.float32)], 8, "float32", "sum", operands)[0]
    assert np.isnan(out).all()


def test_inputs_may_keep_their_nan_payloads():
    """The GPU tests' special inputs are built through from_float32 to carry payload NaNs: the
    canonical rounding of results must not take them away from inputs."""
    payload = np.array([0x7FA00001, 0xFF800003], np.uint32).view(np.float32)
    kept = from_float32(payload, DType.FLOAT32, canonical_nan=False).view(np.uint32)
    assert [hex(v) for v in kept] == ["0x7fa00001", "0xff800003"]
    assert (from_float32(payload, DType.FLOAT32).view(np.uint32) == 0x7FC00000).all()
    half = from_float32(payload, DType.FLOAT16, canonical_nan=False).view(np.uint16)
    assert np.isnan(half.view(np.float16)).all() and (half != 0x7E00).any()
