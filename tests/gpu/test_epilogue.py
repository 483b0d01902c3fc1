"""Fused all-reduce + residual add + RMSNorm (examples/fused/allreduce_add_rmsnorm.pln) on ONE GPU:
a loopback LocalGroup at R = 2..8, every algorithm that applies, LL and plain paths, against
the unfused reference computed independently with torch (all-reduce in float32 rounded to
bf16, then the add and RMSNorm in float32, each result rounded to bf16), within bf16 rounding.
The residual each rank passes is written back in place (h, the next layer's residual)."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from _common import EXAMPLES, on_rank_streams  # noqa: E402

pytestmark = [pytest.mark.gpu]
DEVICE = 0
SPEC = EXAMPLES / "fused" / "allreduce_add_rmsnorm.pln"
HIDDEN = 4096
# (algorithm, packed, channels, slices): LL and plain direct-push, pipelined slices, and the others
SCHEDULES = (("direct-push", True, 1, 1), ("direct-push", False, 4, 2), ("direct-pull", False, 2, 1),
             ("two-shot", False, 2, 1), ("ring", False, 1, 2))


def _reference(xs, residual, weight, eps, hidden=HIDDEN):
    reduced = torch.stack([x.float() for x in xs]).sum(0).to(torch.bfloat16).float()
    h = (reduced + residual.float()).view(-1, hidden)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(torch.bfloat16).view(-1), h.to(torch.bfloat16).view(-1)


def _data(world: int, rows: int, gen, hidden=HIDDEN):
    """Fresh bf16 inputs, residuals and weights (1 + 0.1 N(0, 1)) of ``rows`` rows, per rank."""
    n, dev = rows * hidden, f"cuda:{DEVICE}"
    xs = [torch.randn(n, device=dev, generator=gen).to(torch.bfloat16) for _ in range(world)]
    res = [torch.randn(n, device=dev, generator=gen).to(torch.bfloat16) for _ in range(world)]
    weight = [(1 + 0.1 * torch.randn(hidden, device=dev, generator=gen)).to(torch.bfloat16) for _ in range(world)]
    return xs, res, weight


def _run_and_check(coll, streams, world: int, rows: int, gen, label: str, hops: int = 1, hidden=HIDDEN) -> None:
    """One call of the fused collective on fresh data (outputs poisoned with NaN), every rank's
    out and residual against the reference.  The residual h is the same bf16 sum up to the
    reduction's order (one bf16 rounding; a ring rounds at each of its ``hops``); out is h's
    rounding scaled by weight / rms, plus the rsqrt and the mean's order."""
    xs, res, weight = _data(world, rows, gen, hidden)
    before = [r.clone() for r in res]
    outs = [torch.full_like(x, float("nan")) for x in xs]
    _call(coll, streams, xs, outs, residual=res, weight=weight, eps=1e-6)
    for rank in range(world):
        y, h = _reference(xs, before[rank], weight[rank], 1e-6, hidden)
        msg = f"{label} rank {rank}"
        torch.testing.assert_close(res[rank].float(), h.float(), rtol=2**-7, atol=hops * 2**-6, msg=msg)
        torch.testing.assert_close(outs[rank].float(), y.float(), rtol=2**-6, atol=hops * 2**-5, msg=msg)


@contextlib.contextmanager
def _loopback(spec, world: int, seed: int, **options):
    """``spec`` loaded (``options``: load's schedule keywords) on a loopback group of ``world``
    ranks on cuda:DEVICE: yields the collective, a stream per rank and a generator seeded with
    ``seed``; the group is closed after."""
    import purlinc

    group = purlinc.LocalGroup([DEVICE] * world, share_devices=True)
    try:
        coll = purlinc.load(spec, group, **options)
        streams = [torch.cuda.Stream(device=DEVICE) for _ in range(world)]
        yield coll, streams, torch.Generator(device=f"cuda:{DEVICE}").manual_seed(seed)
    finally:
        group.close()


def _pinned(schedule) -> dict:
    """A SCHEDULES entry as load's keywords."""
    algorithm, packed, channels, slices = schedule
    return {"algorithm": algorithm, "packed": packed, "channels": channels, "slices": slices}


def _call(coll, streams, xs, outs, **operands) -> None:
    """One group call, each rank on its own stream, ordered after and before the current one;
    then the device's errors checked."""
    on_rank_streams(streams, DEVICE, lambda: coll(xs, outs, streams=streams, **operands))
    coll.check()


@pytest.mark.parametrize("world", range(2, 9), ids=[f"R{w}" for w in range(2, 9)])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=["-".join(map(str, s)) for s in SCHEDULES])
def test_fused_allreduce_add_rmsnorm(world, schedule):
    with _loopback(SPEC, world, world, **_pinned(schedule)) as (coll, streams, gen):
        for call, rows in enumerate((1, 16, 3)):  # repeated calls, new sizes: epochs advance
            _run_and_check(coll, streams, world, rows, gen, f"R={world} {schedule} rows={rows} call {call}",
                           hops=world - 1 if schedule[0] == "ring" else 1)


@pytest.mark.parametrize("world, hidden", [(5, 16384), (8, 16384), (8, 8192), (3, 16384)],
                         ids=["R5-16384", "R8-16384", "R8-8192", "R3-16384"])
@pytest.mark.parametrize("schedule", SCHEDULES[:2], ids=["dp-ll", "dp"])
def test_long_rows_at_many_ranks(world, hidden, schedule):
    """Rows longer than one vector per thread at many sources: each vector's sources are loaded
    and combined in turn where all of them at once would not fit in registers (R=8 rows of
    16,384 bf16 spilled 400 bytes), at once below that (R=8 x 8,192, R=3 x 16,384)."""
    with _loopback(SPEC, world, world, params={"hidden": hidden}, **_pinned(schedule)) as (coll, streams, gen):
        for call, rows in enumerate((1, 5)):
            _run_and_check(coll, streams, world, rows, gen, f"R={world} hidden={hidden} {schedule} call {call}",
                           hidden=hidden)


@pytest.mark.parametrize("world", (2, 4), ids=["R2", "R4"])
def test_default_schedule_for_every_row_count(world):
    """A plain load (no options): each call runs the bucket its rows fall in (tuning.epilogue_model:
    LL on one block, LL on 8, the fused pass on 32 and 64 channels, capped for ranks that share
    the GPU), every size against the reference; an empty batch (0 rows: a bf16 call with
    nothing to move, which the operands' checks once took for float32) first and between."""
    with _loopback(SPEC, world, 200 + world) as (coll, streams, gen):
        for rows in (0, 1, 2, 4, 5, 16, 0, 33, 64, 300):
            _run_and_check(coll, streams, world, rows, gen, f"R={world} default schedule, rows={rows},")


@pytest.mark.parametrize("world", (2, 4), ids=["R2", "R4"])
@pytest.mark.parametrize("schedule", SCHEDULES[:2] + SCHEDULES[3:4], ids=["dp-ll", "dp", "two-shot"])
def test_nan_and_inf_rows(world, schedule):
    """A NaN in one rank's data makes its row's every output NaN (the sum of squares is NaN); an
    infinity makes h infinite and rsqrt 0, so that element's output is NaN and the row's others
    zeros: as torch computes them, with every NaN stored as bf16's 0x7fc0."""
    with _loopback(SPEC, world, 100 + world, **_pinned(schedule)) as (coll, streams, gen):
        xs, res, weight = _data(world, 4, gen)
        xs[0][HIDDEN + 5] = float("nan")  # row 1
        xs[world - 1][2 * HIDDEN + 77] = float("inf")  # row 2
        res[1][3 * HIDDEN + 9] = float("-inf")  # row 3, on one rank only
        before = [r.clone() for r in res]
        outs = [torch.zeros_like(x) for x in xs]
        _call(coll, streams, xs, outs, residual=res, weight=weight, eps=1e-6)
        for rank in range(world):
            y, h = _reference(xs, before[rank], weight[rank], 1e-6)
            label = f"R={world} {schedule} rank {rank}"
            for got, want, name in ((res[rank], h, "h"), (outs[rank], y, "out")):
                assert torch.equal(got.isnan(), want.isnan()), f"{label}: {name}'s NaNs at other places"
                assert torch.equal(got.isinf(), want.isinf()), f"{label}: {name}'s infinities at other places"
                nan_bits = got.view(torch.int16)[got.isnan()]
                assert nan_bits.numel() and (nan_bits == 0x7FC0).all(), f"{label}: {name}'s NaNs not 0x7fc0"
                finite = want.isfinite()
                torch.testing.assert_close(got[finite].float(), want[finite].float(), rtol=2**-6, atol=2**-5,
                                           msg=label)


def test_operand_errors_name_the_operand():
    from purlinc.runtime.errors import ArgumentError

    with _loopback(SPEC, 2, 0, algorithm="direct-push") as (coll, streams, gen):
        x = [torch.randn(HIDDEN, device=f"cuda:{DEVICE}", generator=gen).to(torch.bfloat16) for _ in range(2)]
        res = [torch.zeros(HIDDEN, device=f"cuda:{DEVICE}", dtype=torch.bfloat16) for _ in range(2)]
        bad = [torch.ones(HIDDEN, device=f"cuda:{DEVICE}", dtype=torch.float32) for _ in range(2)]
        with pytest.raises(ArgumentError, match="operand 'weight': expected dtype bfloat16, got float32"):
            coll(x, streams=streams, residual=res, weight=bad, eps=1e-6)
        with pytest.raises(ArgumentError, match="missing operand 'eps'"):
            coll(x, streams=streams, residual=res, weight=[w.to(torch.bfloat16) for w in bad])
        # out 2 bytes off a 16-byte boundary: the epilogue's vectors would fault the context
        weight = [w.to(torch.bfloat16) for w in bad]
        outs = [torch.empty(HIDDEN + 8, device=f"cuda:{DEVICE}", dtype=torch.bfloat16)[1:1 + HIDDEN] for _ in range(2)]
        with pytest.raises(ArgumentError, match=r"out at 0x[0-9a-f]+ is not 16-byte aligned"):
            coll(x, outs, streams=streams, residual=res, weight=weight, eps=1e-6)
        got = coll(x, streams=streams, residual=res, weight=weight, eps=1e-6)  # the group still works after
        torch.cuda.synchronize(DEVICE)
        assert all(g.isfinite().all() for g in got)


FP8 = EXAMPLES / "fused" / "allreduce_add_rmsnorm_fp8.pln"


@pytest.mark.parametrize("world", (2, 4, 8), ids=["R2", "R4", "R8"])
@pytest.mark.parametrize("schedule", SCHEDULES[:2] + SCHEDULES[3:4], ids=["dp-ll", "dp", "two-shot"])
def test_fp8_variant(world, schedule):
    """q = rmsnorm(h) * weight * inv_scale in e4m3 (saturating): against torch's reference
    clamped to +-448 and cast with float8_e4m3fn, within one e4m3 rounding of bf16-level inputs."""
    with _loopback(FP8, world, world, **_pinned(schedule)) as (coll, streams, gen):
        n = 16 * HIDDEN
        dev = f"cuda:{DEVICE}"
        xs, res, weight = _data(world, 16, gen)
        weight = [torch.ones_like(w) for w in weight]  # y = h / rms: the saturation checked below
        q = [torch.zeros(n, device=dev, dtype=torch.float8_e4m3fn) for _ in range(world)]
        before = [r.clone() for r in res]
        outs = [torch.empty(n, device=dev, dtype=torch.bfloat16) for _ in range(world)]
        _call(coll, streams, xs, outs, residual=res, weight=weight, eps=1e-6, q=q, inv_scale=200.0)
        for rank in range(world):
            y, _ = _reference(xs, before[rank], weight[rank], 1e-6)
            want = (y.float() * 200.0).clamp(-448, 448).to(torch.float8_e4m3fn).float()
            got = q[rank].float()
            assert got.abs().max() <= 448 and (got.abs() == 448).any()  # |y| > 2.24: about 2.5 % of 64k values
            torch.testing.assert_close(got, want, rtol=2**-3, atol=2**-9 * 200, msg=f"R={world} {schedule} rank {rank}")


# The reduced output kept as it is: what the fused pass's reduce alone computes.
KEEP = """collective allreduce_keep(hidden = 4096) with rows kept {
    in[r]  = x
    out[r] = x
    reduce
    epilogue rows(hidden) {
        kept = out
    }
}"""


@pytest.mark.parametrize("schedule", SCHEDULES[1:2] + SCHEDULES[3:4], ids=["dp", "two-shot"])
def test_two_source_reduce_of_every_bf16_value(schedule):
    """At R=2 the fused pass sums its two sources a bf16 pair per instruction (elem.cuh's
    purlin_bf16_sum2_n): every one of the 65,536 bf16 values (NaNs, infinities, subnormals, -0,
    the largest finite) against a shuffled copy of them, and each against its negation and itself
    (x - x is +0; the largest value twice overflows), bit for bit against torch's float sum
    rounded to bf16 (NaNs as 0x7fc0), in `out` and in the operand the epilogue copies it to.
    Two-shot reduces two sources as well (each rank's half), and its epilogue runs on the whole
    output after the gather: the same bits through the separate pass."""
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(f"cuda:{DEVICE}")
    with _loopback(KEEP, 2, 7, **_pinned(schedule)) as (coll, streams, gen):
        shuffled = every[torch.randperm(every.numel(), device=f"cuda:{DEVICE}", generator=gen)]
        for label, second in (("shuffled", shuffled), ("negated", -every), ("itself", every.clone())):
            xs = [every.clone(), second]
            outs = [torch.full_like(every, float("nan")) for _ in range(2)]
            kept = [torch.full_like(every, float("nan")) for _ in range(2)]
            _call(coll, streams, xs, outs, kept=kept)
            sums = (every.float() + second.float()).to(torch.bfloat16)
            # torch keeps a NaN's sign and payload; Purlin stores every NaN as 0x7fc0
            want = torch.where(sums.isnan(), torch.full_like(sums.view(torch.int16), 0x7FC0), sums.view(torch.int16))
            for rank in range(2):
                for name, got in (("out", outs[rank]), ("kept", kept[rank])):
                    differ = (got.view(torch.int16) != want).nonzero().flatten()
                    assert differ.numel() == 0, (
                        f"{schedule} {label} rank {rank} {name}: {differ.numel()} values differ, first at "
                        f"{differ[0].item()}: {every[differ[0]].item()} + {second[differ[0]].item()} gave bits "
                        f"{got.view(torch.int16)[differ[0]].item() & 0xFFFF:#06x}, want {want[differ[0]].item() & 0xFFFF:#06x}")


# Epilogues unlike the example's: rmsnorm of a value constant along the row, arithmetic on
# scalars and literals only, division, a rows operand written from out alone, stores before
# the norm and after it in either order.
UNUSUAL = {
    "constant-norm": ("row w, scalar s", "out = rmsnorm(s * 3.0 - 1.0, w, 1e-6) + out * 0.5"),
    "scalars": ("scalar s, rows kept", "kept = out\n        out = (out - s) / (s * s + 1.0) * -2.0"),
    "norm-of-weight": ("row w, rows res", "h = out / 4.0 + res\n        res = h\n        out = rmsnorm(w, w, 1e-5) * h"),
    # out left as reduced (the fused pass stores it before the norm), res normalized
    "out-kept": ("row w, rows res", "res = rmsnorm(out + res, w, 1e-5)"),
    # out needs no norm (stored before it), res does (after it)
    "late-res": ("row w, rows res", "h = out + res\n        y = rmsnorm(h, w, 1e-6)\n        res = y * 2.0\n        out = h * 0.5"),
}


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("name", sorted(UNUSUAL))
def test_unusual_epilogues_equal_the_evaluator(name, dtype):
    """Each against the NumPy evaluator (purlinc.frontend.evaluate) on the same data, R=2,
    direct-push on 2 channels (the fused pass): float32 within rsqrtf's and the row sum's order
    (a few ulp), bf16 within one bf16 rounding."""
    import numpy as np

    from purlinc.dtypes import DType, from_float32, to_float32
    from purlinc.frontend.evaluate import evaluate

    declared, body = UNUSUAL[name]
    source = (f"collective e_{name.replace('-', '_')}(hidden = 64) with {declared} {{\n    in[r] = x\n    out[r] = x\n"
              f"    reduce\n    epilogue rows(hidden) {{\n        {body}\n    }}\n}}\n")
    dt = DType.parse(dtype)
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    with _loopback(source, 2, 11, algorithm="direct-push", channels=2) as (coll, streams, gen):
        spec = coll[0].compiled.spec
        rng = np.random.default_rng(len(name))
        n = 4 * 64
        host = [from_float32(rng.standard_normal(n).astype(np.float32), dt) for _ in range(2)]
        ops = [{} for _ in range(2)]
        for o in ops:
            if "row w" in declared:
                o["w"] = from_float32((1 + 0.1 * rng.standard_normal(64)).astype(np.float32), dt)
            if "rows res" in declared:
                o["res"] = from_float32(rng.standard_normal(n).astype(np.float32), dt)
            if "rows kept" in declared:
                o["kept"] = from_float32(np.zeros(n, np.float32), dt)
            if "scalar s" in declared:
                o["s"] = 0.75
        want_ops = [{k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in o.items()} for o in ops]
        want = evaluate(spec, host, n, dt, "sum", want_ops)

        def dev(a):
            return torch.from_numpy(np.ascontiguousarray(a)).view(tdt).to(f"cuda:{DEVICE}")

        xs = [dev(h) for h in host]
        outs = [torch.full_like(x, float("nan")) for x in xs]
        operands = {k: [dev(o[k]) for o in ops] if isinstance(ops[0][k], np.ndarray) else ops[0][k] for k in ops[0]}
        _call(coll, streams, xs, outs, **operands)
        tol = {"rtol": 2e-6, "atol": 1e-6} if dtype == "float32" else {"rtol": 2**-7, "atol": 2**-7}
        for rank in range(2):
            got = {"out": outs[rank], **{k: v[rank] for k, v in operands.items() if isinstance(v, list)}}
            expected = {"out": want[rank], **{k: v for k, v in want_ops[rank].items() if isinstance(v, np.ndarray)}}
            for key, g in got.items():
                e = torch.from_numpy(to_float32(expected[key], dt))
                torch.testing.assert_close(g.float().cpu(), e, **tol, msg=f"{name} {dtype} rank {rank} {key}")
