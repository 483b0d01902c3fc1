"""The end-to-end decode benchmark's pieces that need no GPU (benchmarks/e2e): shapes and
sharding, that a tensor-parallel step equals the unsharded one, argument parsing and results."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from e2e import model, results, run  # noqa: E402

TINY = model.Config(hidden=256, mlp=1024, heads=8, kv_heads=4, head_dim=32, layers=2, kv_len=16)


def test_llama3_8b_shards():
    c = model.Config()
    assert (c.hidden, c.mlp, c.heads, c.kv_heads, c.head_dim) == (4096, 14336, 32, 8, 128)
    s = c.shard(2)
    assert (s.heads, s.kv_heads, s.mlp, s.qkv) == (16, 4, 7168, (16 + 8) * 128)
    assert s.weight_shapes() == {"ln1": (4096,), "wqkv": (4096, 3072), "wo": (2048, 4096), "ln2": (4096,),
                                 "wgu": (4096, 14336), "wd": (7168, 4096)}
    assert c.shard(8).kv_heads == 1 and c.shard(8).kv_shape(16) == (16, 1, 1024, 128)
    with pytest.raises(ValueError, match="needs kv_heads \\(8\\) divisible by 16"):
        c.shard(16)
    with pytest.raises(ValueError, match="needs heads \\(32\\) divisible by 3"):
        c.shard(3)
    with pytest.raises(ValueError, match="needs mlp \\(14400\\) divisible by 256 \\(2 ranks x blocks of 128\\)"):
        model.Config(mlp=14400).shard(2)


def test_weights_have_the_shapes_and_every_shard_is_a_slice_of_one_model():
    full = model.make_weights(TINY.shard(1), 0, seed=3)
    halves = [model.make_weights(TINY.shard(2), r, seed=3) for r in (0, 1)]
    shapes = TINY.shard(2).weight_shapes()
    for name, shape in shapes.items():
        assert tuple(getattr(halves[1].layers[1], name).shape) == shape
    # columns of Q (heads 2-3 live on rank 1) and of the MLP's gate, rows of wo: slices of the full model
    q_cols = TINY.heads // 2 * TINY.head_dim
    assert torch.equal(halves[1].layers[0].wqkv[:, :q_cols], full.layers[0].wqkv[:, q_cols:2 * q_cols])
    assert torch.equal(halves[1].layers[0].wo, full.layers[0].wo[q_cols:])
    mlp = TINY.mlp // 2
    assert torch.equal(halves[1].layers[1].wgu[:, :mlp], full.layers[1].wgu[:, mlp:TINY.mlp])
    assert torch.equal(halves[0].layers[1].ln2, full.layers[1].ln2)  # replicated


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_step_equals_the_unsharded_step(world):
    """R ranks (in one process, partial sums added by SumGroup) compute what one rank with the
    whole model computes, to bf16 rounding; without communication they do not."""
    batch = 3
    one = TINY.shard(1)
    ref_state = model.make_state(one, 0, batch, seed=5)
    h0 = ref_state.h.clone()
    want = model.decode_step(one, model.make_weights(one, 0, seed=5), ref_state,
                             SumOne(), model.Buffers.make(one, batch, model.NoComm(), torch.bfloat16, "cpu"))
    shard = TINY.shard(world)
    weights = [model.make_weights(shard, r, seed=5) for r in range(world)]
    states = [model.make_state(shard, r, batch, seed=5) for r in range(world)]
    assert all(torch.equal(s.h, h0) for s in states)
    bufs = model.group_buffers(shard, batch, model.SumGroup(), torch.bfloat16, "cpu")
    got = model.decode_step_group(shard, weights, states, model.SumGroup(), bufs)
    for y, s in zip(got, states):
        assert y.shape == (batch, TINY.hidden) and y.dtype == torch.bfloat16
        assert results.agree(y, want, results.TOLERANCE)[0]
        assert results.agree(s.h, ref_state.h, results.TOLERANCE)[0]  # the residual stream too
    states = [model.make_state(shard, r, batch, seed=5) for r in range(world)]
    alone = model.decode_step_group(shard, weights, states, model.NoGroup(), bufs)
    assert not results.agree(alone[0], want, results.TOLERANCE)[0]


class SumOne(model.Comm):
    def allreduce(self, x):
        return x


def _usage_error(capsys, argv) -> str:
    """parse_args(argv) stops as argparse does for a bad command line: exit 2, one error line."""
    with pytest.raises(SystemExit) as stop:
        run.parse_args(argv)
    assert stop.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_arguments(capsys):
    args = run.parse_args(["--loopback", "4", "--batches", "1,16", "--layers", "3", "--systems", "purlin,purlin-heap"])
    assert args.loopback == 4 and args.batch_list == [1, 16] and args.layers == 3
    assert args.system_list == ["none", "reference", "purlin", "purlin-heap"]  # baseline and reference always run
    full = run.parse_args([])
    assert full.batch_list == [1, 16, 128] and full.loopback == 0 and full.kv_len == 1024
    assert full.system_list[0] == "none" and "nccl-symm" in full.system_list and "purlin-fused" in full.system_list
    assert "--systems: unknown systems 'mpi'" in _usage_error(capsys, ["--systems", "mpi"])
    # loopback runs Purlin (and the reference) only: NCCL and torch symmetric memory need a process per GPU
    assert run.parse_args(["--loopback", "2"]).system_list == ["none", "reference", "purlin", "purlin-heap",
                                                                "purlin-fused"]
    assert "nccl needs one process per GPU" in _usage_error(capsys, ["--loopback", "2", "--systems", "nccl"])
    # the NCCL child gets the same batches back as one argument
    assert run.child_command(args, ["nccl-nomix"], Path("/tmp/x.json"))[3] == "1,16"


def test_results_rows_and_report(tmp_path):
    rows = [results.row("none", 16, 2, 100.0, [99.0, 101.0], agree=None),
            results.row("nccl", 16, 2, 130.0, [129.0, 131.0], agree=(True, "max rel err 0.0e+00 (the reference)")),
            results.row("purlin", 16, 2, 118.0, [117.0, 119.0], agree=(True, "max rel err 3.1e-03")),
            results.row("purlin-fused", 16, 2, None, None, error="absent: purlinc.torch has no fused_add_rmsnorm_op")]
    results.add_comm_time(rows)
    assert rows[1]["comm_us"] == pytest.approx(30.0) and rows[2]["comm_us"] == pytest.approx(18.0)
    assert rows[2]["comm_vs_best_nccl"] == pytest.approx(18.0 / 30.0)
    meta = {"date": "2026-12-01", "world_size": 2, "loopback": False, "layers": 2}
    paths = results.write(rows, meta, tmp_path, "e2e")
    doc = json.loads(paths["json"].read_text())
    assert doc["meta"]["layers"] == 2 and len(doc["rows"]) == 4
    md = paths["md"].read_text()
    assert "| 16 | purlin | 118.00 | 18.00 | 0.60x (nccl) | yes |" in md
    assert "| 16 | purlin-fused | - | - | - | absent: purlinc.torch has no fused_add_rmsnorm_op |" in md
    loop = results.markdown(rows, {**meta, "loopback": True})
    assert "loopback" in loop.splitlines()[2] and "no link speed" in loop


def test_agreement_tolerance():
    a = torch.randn(4, 256).to(torch.bfloat16)
    assert results.agree(a, a.clone(), results.TOLERANCE) == (True, "max rel err 0.0e+00")
    b = a.clone()
    b[0, 0] += 10.0
    good, note = results.agree(b, a, results.TOLERANCE)
    assert not good and "max rel err" in note
    nan = a.clone()
    nan[1, 1] = float("nan")
    assert results.agree(nan, a, results.TOLERANCE) == (False, "1 of 1024 values not finite")


def test_a_reference_that_is_not_finite_does_not_agree_with_itself():
    """The reference row was marked as agreeing unconditionally: one gone NaN showed "yes" and
    every other system "NO", blamed for the reference's fault."""
    good = [torch.ones(2, 4), torch.ones(2, 4)]
    assert results.reference_agrees(good, "the reference") == (True, "the reference")
    bad = [torch.ones(2, 4), torch.tensor([[1.0, float("nan"), 1.0, float("inf")], [1.0] * 4])]
    assert results.reference_agrees(bad, "the reference") == (
        False, "the reference itself: rank 1: 2 of 8 values not finite")
    assert results.reference_agrees(bad[1:], "x") == (False, "the reference itself: 2 of 8 values not finite")
