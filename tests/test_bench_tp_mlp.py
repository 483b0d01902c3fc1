"""examples/tp_mlp.py's checks on the CPU: a non-finite output (Purlin's or NCCL's, any rank),
ranks whose all-reduce outputs differ, a NaN difference or time, all fail; the printed table
and the JSON never hide a NaN; without torchrun, CUDA or torch it says so in one line, exit 2."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAN = float("nan")
TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}


def _load():
    spec = importlib.util.spec_from_file_location("tp_mlp_under_test", ROOT / "examples" / "tp_mlp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # no torch at import: the checks and --help run without it
    return module


tp = _load()


def good_row(**change) -> dict:
    row = {"tokens": 8, "mode": "eager", "allreduce_bytes": 65536, "purlin_us": 100.0, "nccl_us": 110.0,
           "speedup": 1.1, "outputs_equal_all_ranks": False, "max_abs_diff": 0.004,
           "nonfinite": {"purlin": 0, "nccl": 0}, "ranks_agree": {"purlin": True, "nccl": True}, "graph_breaks": 0}
    return {**row, **change}


def test_a_good_row_passes():
    assert tp.problems(good_row()) == []  # equal bits are not required: within TOLERANCE is


@pytest.mark.parametrize("change,says", [
    ({"nonfinite": {"purlin": 768, "nccl": 0}, "max_abs_diff": NAN}, "768 non-finite values in purlin's outputs"),
    ({"nonfinite": {"purlin": 0, "nccl": 3}, "max_abs_diff": NAN}, "3 non-finite values in nccl's outputs"),
    ({"max_abs_diff": NAN}, "max |Purlin - NCCL| NaN is not within 0.01"),  # max(0.0, nan) hid this
    ({"max_abs_diff": 0.5}, "max |Purlin - NCCL| 0.50 is not within 0.01"),
    ({"ranks_agree": {"purlin": False, "nccl": True}}, "purlin's all-reduce outputs differ between ranks"),
    ({"ranks_agree": {"purlin": True, "nccl": False}}, "nccl's all-reduce outputs differ between ranks"),
    ({"graph_breaks": 2}, "2 graph breaks"),
    ({"purlin_us": NAN}, "purlin_us NaN is not a finite positive time"),
    ({"nccl_us": 0.0}, "nccl_us 0.00 is not a finite positive time"),
])
def test_every_kind_of_bad_row_fails(change, says):
    assert says in tp.problems(good_row(**change))


def test_the_table_and_the_json_show_nan():
    row = good_row(nonfinite={"purlin": 768, "nccl": 0}, max_abs_diff=NAN, purlin_us=NAN, speedup=None)
    row["problems"] = tp.problems(row)
    line = tp.table([row])[2]
    assert "| NaN | 110.00 | - | NaN (purlin 768 non-finite) |" in line and "FAIL: 768 non-finite" in line
    text = json.dumps(tp.strict({"rows": [row]}), allow_nan=False)  # strict JSON; problems say what was NaN
    assert json.loads(text)["rows"][0]["max_abs_diff"] is None and "NaN" in text


def test_nan_max_keeps_a_nan_wherever_it_is():
    assert math.isnan(tp._nan_max([5.0, NAN])) and math.isnan(tp._nan_max([NAN, 5.0])) and tp._nan_max([1, 3]) == 3


def test_checks_on_tensors():
    """The probe's case: Purlin's output all NaN, NCCL's finite, on every check and rank: a
    failure (it was max_abs_diff 0.0, a pass).  Ranks whose outputs differ fail too."""
    torch = pytest.importorskip("torch")
    tp.torch = torch
    nan = torch.full((8, 16), NAN, dtype=torch.bfloat16)
    ones = torch.ones(8, 16, dtype=torch.bfloat16)
    base = {"tokens": 8, "mode": "eager", "allreduce_bytes": 256, "graph_breaks": None}
    checks = [tp.compare(nan, ones) for _ in range(tp.CHECKS)]
    row = tp.finish_row(base, [(100.0, 110.0, checks), (101.0, 111.0, checks)])
    assert row["nonfinite"] == {"purlin": 2 * 3 * 128, "nccl": 0} and math.isnan(row["max_abs_diff"])
    assert row["problems"] == ["768 non-finite values in purlin's outputs"]
    same = [tp.compare(ones, ones.clone())]
    assert tp.finish_row(base, [(100.0, 110.0, same), (101.0, 111.0, same)])["problems"] == []
    other = [tp.compare(ones + 1, ones + 1)]  # rank 1 holds another sum: an all-reduce replicates one
    row = tp.finish_row(base, [(100.0, 110.0, same), (NAN, 111.0, other)])
    assert row["ranks_agree"] == {"purlin": False, "nccl": False} and math.isnan(row["purlin_us"])
    assert row["speedup"] is None and "purlin_us NaN is not a finite positive time" in row["problems"]
    neg_zero = torch.zeros(4, dtype=torch.bfloat16).neg()
    assert tp.fingerprint(neg_zero) != tp.fingerprint(torch.zeros(4, dtype=torch.bfloat16))  # bits, not values


@pytest.mark.parametrize("argv,says", [
    (["--modes", "eager,bogus"], "argument --modes: expected a comma-separated list of eager, compile, reduce-overhead"),
    (["--tokens", "0"], "argument --tokens: expected a positive integer, got '0'"),
    (["--hidden", "-1"], "argument --hidden: expected a positive integer, got '-1'"),
])
def test_bad_options(capsys, argv, says):
    with pytest.raises(SystemExit) as stop:
        tp.parse_args(argv)
    assert stop.value.code == 2 and says in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("env,torch_present,says", [
    ({}, False, "torch is not installed in this Python"),
    ({}, True, "not started by torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set)"),
    (TORCHRUN, True, None),  # then: NCCL, CUDA (torch's own answers, below)
])
def test_without_torchrun_cuda_or_torch(monkeypatch, capsys, env, torch_present, says):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if not torch_present:
        monkeypatch.setitem(sys.modules, "torch", None)
    elif "torch" not in sys.modules:
        pytest.importorskip("torch")
    missing = tp.needs()
    if says is None:  # this machine's torch decides: a CPU build has no NCCL, a GPU one may lack devices
        torch = sys.modules["torch"]
        if torch.distributed.is_nccl_available() and torch.cuda.device_count() > 0:
            pytest.skip("this machine can run tp_mlp")
        assert missing is not None and ("no NCCL" in missing or "no CUDA GPU" in missing)
    else:
        assert missing == says
    with pytest.raises(SystemExit) as stop:
        tp.main([])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1
    assert err.startswith("tp_mlp.py: needs torchrun and CUDA GPUs (and torch), e.g. torchrun --nproc_per_node=2 "
                          "examples/tp_mlp.py: ")
