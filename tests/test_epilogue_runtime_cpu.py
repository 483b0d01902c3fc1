"""An epilogue's operands at the call, without a GPU: every check names the operand, the
expected and the actual, and the words the kernel gets (purlinc/runtime/operands.py)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from purlinc.dtypes import DType, ReduceOp
from purlinc.frontend.check import check
from purlinc.frontend.parse import parse
from purlinc.runtime.errors import ArgumentError
from purlinc.runtime.interop import ArrayInfo
from purlinc.runtime.operands import operand_words
from purlinc.runtime.validate import CallShape, choose_piece

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fused" / "allreduce_add_rmsnorm.pln"
SPEC = check(parse(EXAMPLE.read_text(), str(EXAMPLE)), 2, {"hidden": 64})  # the example, with rows of 64
EPILOGUE = SPEC.epilogue
BF16 = DType.BFLOAT16


def tensor(ptr, numel, dtype=BF16, device=0, contiguous=True):
    return ArrayInfo(ptr, numel, dtype, dtype.value if dtype else "int8", device, contiguous, "torch")


def words(operands, count=128, out_numel=128, buffers=((0x10000, 256), (0x20000, 256))):
    shape = CallShape(BF16, ReduceOp.SUM, count, 0x10000, 0x20000)
    return operand_words("fused", EPILOGUE, operands, shape, out_numel, 0, buffers, describe=lambda info: info)


GOOD = {"residual": tensor(0x30000, 128), "weight": tensor(0x40000, 64), "eps": 1e-6}


def test_words_are_pointers_and_float_bits():
    assert words(GOOD) == (0x30000, 0x40000, struct.unpack("<I", struct.pack("<f", 1e-6))[0])


def test_a_read_operand_may_share_the_input():
    """Only the output is written while operands are read: a weight inside x is sound."""
    assert words({**GOOD, "weight": tensor(0x10000, 64)})[1] == 0x10000


def test_numpy_scalars_and_the_float32_maximum_are_numbers():
    import numpy as np

    bits = lambda v: struct.unpack("<I", struct.pack("<f", v))[0]  # noqa: E731
    for eps in (np.float32(1e-5), np.float64(1e-5), np.int64(0), 3.4028234663852886e38):
        assert words({**GOOD, "eps": eps})[2] == bits(float(eps))


def test_an_operand_that_is_no_array_is_named():
    shape = CallShape(BF16, ReduceOp.SUM, 128, 0x10000, 0x20000)
    with pytest.raises(ArgumentError) as info:
        operand_words("fused", EPILOGUE, {**GOOD, "residual": [0.0] * 128}, shape, 128, 0)
    assert info.value.message.startswith("fused: operand 'residual': expected a torch tensor")
    assert info.value.message.endswith("got list")


@pytest.mark.parametrize("change, message", [
    ({"eps": None}, "fused: missing operand 'eps' (scalar eps)"),
    ({"bias": tensor(0x50000, 64)}, "fused: unknown operand 'bias'; the epilogue takes residual, weight, eps"),
    ({"eps": "1e-6"}, "fused: operand 'eps': expected a number (float32), got str"),
    ({"eps": 1e300}, "fused: operand 'eps': expected a finite float32 value, got 1e+300"),
    ({"eps": 3.5e38}, "fused: operand 'eps': expected a finite float32 value, got 3.5e+38"),
    ({"eps": float("nan")}, "fused: operand 'eps': expected a finite float32 value, got nan"),
    ({"eps": float("-inf")}, "fused: operand 'eps': expected a finite float32 value, got -inf"),
    # float32 rounds it to 0: eps=1e-50 ran as eps=0 (an all-zero row became NaN), as a literal it is refused
    ({"eps": 1e-50}, "fused: operand 'eps': expected a value float32 can hold, got 1e-50: it would be 0"),
    ({"residual": tensor(0x30000, 128, device=1)}, "fused: operand 'residual': expected a tensor on cuda:0, got one in cuda:1"),
    ({"residual": tensor(0x30000, 128, device=-1)}, "fused: operand 'residual': expected a tensor on cuda:0, got one in host memory"),
    ({"weight": tensor(0x40000, 64, DType.FLOAT32)}, "fused: operand 'weight': expected dtype bfloat16, got float32"),
    ({"weight": tensor(0x40000, 32)}, "fused: operand 'weight': expected 64 elements (one row's), got 32"),
    ({"residual": tensor(0x30000, 64)}, "fused: operand 'residual': expected 128 elements (the output's), got 64"),
    ({"residual": tensor(0x30000, 128, contiguous=False)}, "fused: operand 'residual': expected a contiguous tensor, got a strided one"),
    ({"residual": tensor(0x30008, 128)}, "fused: operand 'residual': expected a 16-byte aligned address, got 0x30008"),
    ({"residual": tensor(0x20000, 128)}, "fused: operand 'residual' is written by the epilogue and overlaps the output"),
    ({"residual": tensor(0x40000, 128)}, "fused: operand 'residual' is written by the epilogue and overlaps operand 'weight'"),
    # a read operand inside the output: blocks write out's rows while others read the weight
    ({"weight": tensor(0x20000, 64)}, "fused: operand 'weight' is read by the epilogue and overlaps the output"),
    ({"weight": tensor(0x20080, 64)}, "fused: operand 'weight' is read by the epilogue and overlaps the output"),
])
def test_operand_errors(change, message):
    operands = {**GOOD, **change}
    if change.get("eps", 0) is None:
        del operands["eps"]
    with pytest.raises(ArgumentError) as info:
        words(operands)
    assert info.value.message == message


def test_a_misaligned_output_is_refused():
    """The epilogue moves out's rows in 16-byte vectors and has no scalar path: out 2 bytes off
    (a view buf[1:]) passed validation, which checks the element size, and would fault."""
    shape = CallShape(BF16, ReduceOp.SUM, 128, 0x10000, 0x20002)
    with pytest.raises(ArgumentError) as info:
        operand_words("fused", EPILOGUE, GOOD, shape, 128, 0, describe=lambda info: info)
    assert info.value.message == ("fused: out at 0x20002 is not 16-byte aligned: an epilogue reads and writes its "
                                  "rows as 16-byte vectors")


def test_chunks_of_whole_rows():
    with pytest.raises(ArgumentError) as info:
        words(GOOD, count=96, out_numel=96)
    assert info.value.message == (
        "fused: out has 96 elements per chunk, not a whole number of rows of 64 (the epilogue's rows(64))")


def test_pieces_are_whole_rows():
    from purlinc.atom.abi import StagingPlacement

    # 1000 bytes of staging for 2 units of bf16: 250 elements fit, 192 are whole rows of 64
    small = StagingPlacement.for_space(1000, 2)
    assert choose_piece(4096, small, 2, 64) == 192
    assert choose_piece(4096, small, 2) == 248
    assert choose_piece(100, StagingPlacement.for_space(1 << 20, 2), 2, 50) == 100


def test_hierarchical_load_refuses_an_epilogue():
    from pathlib import Path

    from purlinc.errors import PurlinError
    from purlinc.runtime.loader import load

    example = Path(__file__).resolve().parent.parent / "examples" / "fused" / "allreduce_add_rmsnorm.pln"
    with pytest.raises(PurlinError, match="a hierarchical collective .gpus_per_node=. cannot apply an epilogue yet"):
        load(example, None, gpus_per_node=2)
