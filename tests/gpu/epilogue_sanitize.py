"""Epilogues under compute-sanitizer (memcheck, racecheck, synccheck): one rank (R=1, so no
kernel waits for another, which a sanitizer's serialised launches would turn into a timeout),
where the all-reduce is a copy and the epilogue runs as its own pass over the output's rows.
That pass's row loop is the one the fused reduce + epilogue runs (templates/epilogue_rows.cuh.j2):
its loads, its stores before and after the norm, and the per-warp sums of squares in shared
memory, in two sets that row groups alternate, are what racecheck and synccheck look at.

Cases: the decoder's epilogue (examples/fused/allreduce_add_rmsnorm.pln) at rows of 1,024,
4,096 and 16,384 elements (several rows per block, one row per block, several vectors per
thread), 1 to 300 rows, 1 and 4 channels; its fp8 variant; and epilogues that store before and
after the norm in either order, in bf16, f16 and f32.  Every call on fresh random data, outputs
poisoned first, each output and written operand checked against the NumPy evaluator.

    compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 3 \\
        python3 tests/gpu/epilogue_sanitize.py

Passing: "epilogue sanitize: N calls ok" and exit status 0 (3 if the sanitizer found an error).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
FUSED = HERE.parents[1] / "examples" / "fused"

# (name, with-clause, body): stores before the norm and after it, in either order
EPILOGUES = (
    ("late-res", "row w, rows res", "h = out + res\n        y = rmsnorm(h, w, 1e-6)\n        res = y * 2.0\n"
                                    "        out = h * 0.5"),
    ("norm-of-weight", "row w, rows res", "h = out / 4.0 + res\n        res = h\n        out = rmsnorm(w, w, 1e-5) * h"),
    ("scalars", "scalar s, rows kept", "kept = out\n        out = (out - s) / (s * s + 1.0) * -2.0"),
)
# The decoder's epilogue: (hidden, rows, channels)
DECODER = ((4096, 1, 1), (4096, 16, 4), (4096, 3, 1), (1024, 300, 4), (1024, 7, 1), (16384, 5, 4), (16384, 1, 1))


def _tolerance(dtype) -> dict:
    """float32 within rsqrtf's and the row sum's order; 16-bit types within one rounding;
    e4m3 within one of its roundings."""
    if dtype.itemsize == 4:
        return {"rtol": 2e-6, "atol": 1e-6}
    if dtype.itemsize == 1:
        return {"rtol": 2**-3, "atol": 2**-6}
    return {"rtol": 2**-7, "atol": 2**-7}


def _stored(values: np.ndarray, dtype) -> np.ndarray:
    """float32 values as ``dtype``'s bits (e4m3 too: a storage format epilogues read and write)."""
    from purlinc.dtypes import DType, e4m3_from_float32, from_float32

    return e4m3_from_float32(values) if dtype is DType.FLOAT8_E4M3 else from_float32(values, dtype)


def _widened(bits: np.ndarray, dtype) -> np.ndarray:
    from purlinc.dtypes import DType, e4m3_to_float32, to_float32

    return e4m3_to_float32(bits) if dtype is DType.FLOAT8_E4M3 else to_float32(bits, dtype)


def _data(spec, dt, hidden: int, rows: int, rng):
    """Fresh input and operands for one call (rows operands in their own dtypes), and what the
    evaluator expects: (x, operands, dtypes of the tensor operands, out, operands after)."""
    from purlinc.dtypes import DType
    from purlinc.frontend.ast import OperandKind
    from purlinc.frontend.evaluate import evaluate

    n = rows * hidden
    x = _stored(rng.standard_normal(n).astype(np.float32), dt)
    operands, dtypes = {}, {}
    for operand in spec.epilogue.operands:
        if operand.kind is OperandKind.SCALAR:  # eps as a model's; others of the order of 1
            operands[operand.name] = 1e-6 if operand.name == "eps" else float(np.float32(0.5 + rng.random()))
            continue
        own = dtypes[operand.name] = DType.parse(operand.dtype) if operand.dtype else dt
        length = hidden if operand.kind is OperandKind.ROW else n
        values = rng.standard_normal(length).astype(np.float32)
        if operand.kind is OperandKind.ROW:  # a weight: 1 + 0.1 N(0, 1)
            values = 1 + np.float32(0.1) * values
        operands[operand.name] = _stored(values, own)
    after = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in operands.items()}
    out = evaluate(spec, [x], n, dt, "sum", [after])[0]  # rows operands it writes updated in `after`
    return x, operands, dtypes, out, after


def _run_case(purlinc, torch, group, source, label: str, dtype_name: str, hidden: int, rows: int, channels: int,
              rng, params=None) -> None:
    """One load and two calls on fresh data: every output and written operand against the
    evaluator (the second call: the row loop's sums sets start from the other parity)."""
    from purlinc.dtypes import DType

    dt = DType.parse(dtype_name)
    coll = purlinc.load(source, group, params=params, algorithm="direct-push", channels=channels)
    spec = coll[0].compiled.spec

    def device(array, dtype):
        return torch.from_numpy(np.ascontiguousarray(array)).view(getattr(torch, dtype.info.torch_name)).to("cuda:0")

    for call in range(2):
        x, operands, dtypes, want_out, want_ops = _data(spec, dt, hidden, rows, rng)
        tensors = {k: device(v, dtypes[k]) for k, v in operands.items() if k in dtypes}
        out = torch.full((x.size,), float("nan"), device="cuda:0").to(getattr(torch, dt.info.torch_name))
        coll([device(x, dt)], [out], **{k: [tensors[k]] if k in tensors else v for k, v in operands.items()})
        torch.cuda.synchronize(0)
        coll.check()
        checks = [("out", out, want_out, dt)] + [(k, t, want_ops[k], dtypes[k]) for k, t in tensors.items()]
        for name, got, want, own in checks:
            torch.testing.assert_close(got.float().cpu(), torch.from_numpy(_widened(want, own)), **_tolerance(own),
                                       msg=f"{label} call {call}: {name}")
    coll.close()


def main() -> int:
    import purlinc
    import torch

    group = purlinc.LocalGroup([0], share_devices=True)
    rng = np.random.default_rng(0)
    calls = 0
    decoder = (FUSED / "allreduce_add_rmsnorm.pln").read_text()
    for hidden, rows, channels in DECODER:
        _run_case(purlinc, torch, group, decoder, f"decoder hidden={hidden} rows={rows} c{channels}", "bfloat16",
                  hidden, rows, channels, rng, params={"hidden": hidden})
        calls += 2
    fp8 = (FUSED / "allreduce_add_rmsnorm_fp8.pln").read_text()
    _run_case(purlinc, torch, group, fp8, "fp8 hidden=4096 rows=16 c4", "bfloat16", 4096, 16, 4, rng)
    calls += 2
    for name, declared, body in EPILOGUES:
        source = (f"collective e_{name.replace('-', '_')}(hidden = 256) with {declared} {{\n    in[r] = x\n"
                  f"    out[r] = x\n    reduce\n    epilogue rows(hidden) {{\n        {body}\n    }}\n}}\n")
        for dtype in ("bfloat16", "float16", "float32"):
            for rows, channels in ((40, 2), (1, 1)):
                _run_case(purlinc, torch, group, source, f"{name} {dtype} rows={rows} c{channels}", dtype,
                          256, rows, channels, rng)
                calls += 2
    group.close()
    print(f"epilogue sanitize: {calls} calls ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
