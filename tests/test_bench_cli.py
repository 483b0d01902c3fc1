"""The benchmark scripts' command lines on the CPU: a bad value is argparse's one-line error
and exit status 2 (never a traceback, never a value that silently means something else), and a
script that needs torch, CUDA GPUs or torchrun says which is missing in one line, exit 2,
before its first CUDA call.  No GPU; torch only where a test says so."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from benchlib import argtypes, needs  # noqa: E402

TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load("bench_cli_bench", BENCH / "bench.py")


def usage_error(capsys, parse, argv) -> str:
    """``parse(argv)`` stops as argparse does: exit 2 and the error as the last stderr line."""
    with pytest.raises(SystemExit) as stop:
        parse(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


# --------------------------------------------------------------------------- argument types


@pytest.mark.parametrize("kind,text,value", [
    (argtypes.positive_int, "3", 3), (argtypes.positive_int, "+7", 7), (argtypes.nonnegative_int, "0", 0),
    (argtypes.positive_float, "2.5", 2.5), (argtypes.positive_int_list, "1, 16,128,", [1, 16, 128]),
    (argtypes.device_list, "0,0", [0, 0]), (argtypes.byte_size, "0", 0), (argtypes.positive_byte_size, "64K", 65536),
    (argtypes.byte_size_list, "1K,1M", [1024, 1 << 20]), (argtypes.nonnegative_int_list, "0,4", [0, 4]),
    (argtypes.switch_list, "1,0", [True, False]), (argtypes.byte_size, "1024G", 1 << 40),
])
def test_argument_types_read_good_values(kind, text, value):
    assert kind(text) == value


@pytest.mark.parametrize("kind,text,says", [
    (argtypes.positive_int, "0", "expected a positive integer, got '0'"),
    (argtypes.positive_int, "-2", "expected a positive integer, got '-2'"),
    (argtypes.positive_int, "abc", "expected a positive integer, got 'abc'"),
    (argtypes.positive_int, "1_000", "expected a positive integer, got '1_000'"),
    (argtypes.nonnegative_int, "-1", "expected an integer >= 0, got '-1'"),
    (argtypes.positive_float, "nan", "expected a finite number above 0, got 'nan'"),
    (argtypes.positive_float, "inf", "expected a finite number above 0, got 'inf'"),
    (argtypes.positive_float, "0", "expected a finite number above 0, got '0'"),
    (argtypes.positive_int_list, "", "expected a comma-separated list of positive integers, got ''"),
    (argtypes.positive_int_list, "1,0", "expected a positive integer, got '0'"),
    (argtypes.device_list, "x", "expected an integer >= 0, got 'x'"),
    (argtypes.positive_byte_size, "0", "expected a size of at least 1 byte, got '0'"),
    (argtypes.byte_size, "12Q", "'12Q' is not a size"),
    (argtypes.byte_size, "inf", "'inf' is not a size"),
    (argtypes.byte_size_list, "1e30", "'1e30' is more than 1 TiB, more than a GPU holds"),
    (argtypes.nonnegative_int_list, "0,-1", "expected an integer >= 0, got '-1'"),
    (argtypes.switch_list, "2", "expected 0 or 1, got '2'"),
    (argtypes.switch_list, "", "expected a comma-separated list of 0 (off) and/or 1 (on), got ''"),
])
def test_argument_types_refuse_bad_values(kind, text, says):
    with pytest.raises(argparse.ArgumentTypeError) as error:
        kind(text)
    assert says in str(error.value)


def test_names_lists_the_choices():
    assert argtypes.names("a, b", ("a", "b", "c"), "things") == ["a", "b"]
    with pytest.raises(ValueError, match="^unknown things 'x'; choose from a, b$"):
        argtypes.names("a,x", ("a", "b"), "things")
    with pytest.raises(ValueError, match=r"^no things given \(', '\); choose from a, b$"):
        argtypes.names(", ", ("a", "b"), "things")


# --------------------------------------------------------------------------- what a run needs


def fake_torch(*, cuda=True, devices=2, nccl=True):
    """A stand-in for torch with just what needs.missing() looks at."""
    dist = SimpleNamespace(is_available=lambda: True, is_nccl_available=lambda: nccl)
    return SimpleNamespace(__version__="9.9", version=SimpleNamespace(cuda="13.0" if cuda else None), distributed=dist,
                           cuda=SimpleNamespace(is_available=lambda: cuda and devices > 0, device_count=lambda: devices))


@pytest.mark.parametrize("torch,env,torchrun,says", [
    (None, {}, False, "torch is not installed in this Python"),
    (fake_torch(), {}, True, "not started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set)"),
    (fake_torch(nccl=False), TORCHRUN, True, "torch 9.9 has no NCCL (a CPU-only build?)"),
    (fake_torch(cuda=False), {}, False, "no CUDA GPU is visible (torch 9.9 is built without CUDA)"),
    (fake_torch(devices=0), {}, False, "no CUDA GPU is visible"),
    (fake_torch(devices=1), TORCHRUN, True, "2 CUDA GPUs needed, 1 visible"),  # LOCAL_RANK 1 needs cuda:1
    (fake_torch(), {**TORCHRUN, "LOCAL_RANK": "x"}, True, "LOCAL_RANK 'x' is not a rank index"),
    (fake_torch(devices=2), TORCHRUN, True, None),
])
def test_needs_says_what_is_missing(monkeypatch, torch, env, torchrun, says):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setitem(sys.modules, "torch", torch)  # None: 'import torch' fails
    assert needs.missing(torchrun=torchrun) == says


def test_needs_require_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(SystemExit) as stop:
        needs.require("x.py", "python x.py", torchrun=False)
    assert stop.value.code == 2
    assert capsys.readouterr().err == "x.py: needs CUDA GPUs and torch (python x.py): torch is not installed in this Python\n"


# --------------------------------------------------------------------------- bench.py


@pytest.mark.parametrize("argv,says", [
    (["--world-size", "0"], "argument --world-size: expected a positive integer, got '0'"),  # was: planned for R=2
    (["--world-size", "-2"], "argument --world-size: expected a positive integer, got '-2'"),
    (["--max-bytes", "0"], "argument --max-bytes: expected a size of at least 1 byte, got '0'"),  # was: 0 sizes, exit 0
    (["--min-bytes", "2G"], "no sizes to measure: none of the default sizes lies within --min-bytes 2 GiB"),
    (["--quick", "--min-bytes", "1M", "--max-bytes", "64K"],
     "no sizes to measure: none of the --quick sizes lies within --min-bytes 1 MiB and --max-bytes 64 KiB"),
    (["--sizes", "12Q"], "argument --sizes: '12Q' is not a size"),
    (["--reps", "0"], "argument --reps: expected a positive integer, got '0'"),
    (["--reps", "-1"], "argument --reps: expected a positive integer, got '-1'"),
    (["--calls-per-graph", "0"], "argument --calls-per-graph: expected a positive integer, got '0'"),
    (["--calls-per-graph", "abc"], "argument --calls-per-graph: expected a positive integer, got 'abc'"),
    (["--timeout-s", "nan"], "argument --timeout-s: expected a finite number above 0, got 'nan'"),
    (["--variant-spec", "garbage"], "--variant-spec 'garbage': expected 'NAME:algorithm=ring"),
    (["--variant-spec", "x:algorithm=nope"], "unknown algorithm 'nope'; choose from direct-push"),
    (["--variant-spec", "push-ce:atom=ce"], "--variant-spec: the name 'push-ce' is taken"),
    (["--hier-gpus-per-node", "3", "--world-size", "2"],
     "--hier-gpus-per-node: 3 GPUs per node is more than the world's 2 ranks"),
    (["--hier-gpus-per-node", "two"], "--hier-gpus-per-node: 'two' is not a number of GPUs"),
    (["--systems", "purlin/hierarchical", "--hier-gpus-per-node", ","], "--hier-gpus-per-node: no GPUs-per-node values"),
    (["--modes", "eagr"], "--modes: unknown modes 'eagr'; choose from eager, graph, insitu"),  # was: dropped
    (["--systems", ""], "--systems: no systems given"),
    (["--collectives", "allfoo"], "--collectives: unknown collectives 'allfoo'"),
    (["--variants", "bogus"], "--variants: unknown Purlin variants 'bogus'"),
    (["--nccl-variants", "bogus"], "--nccl-variants: unknown NCCL variants 'bogus'; choose from default, nomix, symm"),
    (["--merge", "/nonexistent/run.json"], "/nonexistent/run.json: cannot read the results file"),
    (["--sizes", "1e30"], "argument --sizes: '1e30' is more than 1 TiB, more than a GPU holds"),  # was: planned
    (["--variants", ""], "--variants: no Purlin variants given (''); leave --variants out for all"),  # was: all
])
def test_bench_refuses_bad_options(capsys, argv, says):
    assert says in usage_error(capsys, bench.parse_args, ["--dry-run", *argv])


def test_bench_hier_gpus_per_node_matters_only_with_the_hierarchical_system(capsys):
    """It was refused for a world of 2 even where no hierarchical row is measured."""
    args = bench.parse_args(["--dry-run", "--world-size", "2", "--systems", "nccl", "--hier-gpus-per-node", "5"])
    assert bench.make_plan(args).hier == ()
    assert "--hier-gpus-per-node: 5 GPUs per node is more than the world's 2 ranks" in usage_error(
        capsys, bench.parse_args, ["--dry-run", "--world-size", "2", "--systems", "purlin/hierarchical",
                                   "--hier-gpus-per-node", "5"])


def test_bench_checks_merge_files_before_the_run(tmp_path, capsys):
    empty = tmp_path / "old.json"
    empty.write_text("")
    assert f"{empty}: the results file is empty" in usage_error(capsys, bench.parse_args, ["--merge", str(empty)])
    empty.write_text('{"meta": {}, "rows": []}')
    assert bench.parse_args(["--merge", str(empty)]).merge == [empty]


def test_bench_refuses_to_merge_a_run_of_another_world_size(tmp_path, capsys):
    """A merged R=4 file's rows stood in this R=2 run's tables and tuning table."""
    four = tmp_path / "r4.json"
    four.write_text('{"meta": {"world_size": 4}, "rows": []}')
    says = usage_error(capsys, bench.parse_args, ["--world-size", "2", "--merge", str(four)])
    assert f"{four}: world size 4, but this run has world size 2" in says
    assert bench.parse_args(["--world-size", "4", "--merge", str(four)]).merge == [four]
    two = tmp_path / "r2.json"
    two.write_text('{"meta": {"world_size": 2}, "rows": []}')
    assert "world size 2, but this run has world size 4" in usage_error(
        capsys, bench.parse_args, ["--world-size", "4", "--merge", str(four), "--merge", str(two)])


def test_bench_world_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert bench.make_plan(bench.parse_args(["--dry-run"])).hier == (4, 1)
    monkeypatch.setenv("WORLD_SIZE", "four")
    assert "the environment's WORLD_SIZE 'four' is not a positive number of ranks" in usage_error(
        capsys, bench.parse_args, ["--dry-run"])


def test_bench_dry_run_still_works_and_a_run_needs_a_gpu(monkeypatch, capsys):
    """--dry-run plans without torch or a GPU; a measuring run without them is one line, exit 2,
    before torch.cuda is touched (it was: AttributeError from torch._C)."""
    assert bench.main(["--dry-run", "--quick", "--world-size", "2"]) == 0
    assert "estimated wall time" in capsys.readouterr().out
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(sys.modules, "torch", fake_torch())
    with pytest.raises(SystemExit) as stop:
        bench.main(["--quick"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == ("bench.py: needs torchrun, CUDA GPUs and torch (torchrun --nproc_per_node=2 "
                                       "benchmarks/bench.py; --dry-run plans without them): not started by torchrun "
                                       "(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set)\n")
    assert bench.torch is None


def test_sizes_that_round_to_one_call_are_measured_once(capsys):
    """1000 and 1001 B are both 992 B of all-reduce at R=2, 3 and 5 B both 32 B: the dry run
    listed (and the run measured) each twice, writing two rows with one key that report.py
    then refused to read."""
    plan_mod = sys.modules["benchlib.plan"]
    assert plan_mod.measured_sizes([3, 5, 1000, 1001, 1024], "allreduce", 2) == [3, 1000, 1024]
    assert plan_mod.measured_sizes([1000, 1001], "allreduce", 3) == [1000]  # both 960 B at R=3
    assert plan_mod.measured_sizes([1024, 2048], "broadcast", 8) == [1024, 2048]
    assert bench.main(["--dry-run", "--world-size", "2", "--sizes", "1000,1001,3,5", "--collectives", "allreduce"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.strip() == ("allreduce: count per size 32 B=8, 992 B=248 (5 B, 1001 B: the same call as a size "
                            "before, measured once)")


# --------------------------------------------------------------------------- moe_dispatch.py, insitu_loopback.py


def test_moe_dispatch_arguments(capsys):
    moe = _load("bench_cli_moe", BENCH / "moe_dispatch.py")  # loads without torch too
    args = moe.parse_args(["--out", "x", "--devices", "0,1", "--channels", "8"])
    assert args.devices == [0, 1] and args.channels == [8] and args.tokens == 4096
    assert "argument --devices: expected an integer >= 0, got 'x'" in usage_error(
        capsys, moe.parse_args, ["--out", "x", "--devices", "x"])  # was: ValueError traceback
    assert "argument --tokens: expected a positive integer" in usage_error(
        capsys, moe.parse_args, ["--out", "x", "--tokens", "0"])
    assert "--top-k 9 is more than the 8 experts (4 local x 2 ranks)" in usage_error(
        capsys, moe.parse_args, ["--out", "x", "--top-k", "9", "--local-experts", "4"])
    row = moe.timing_row({"median_us": float("nan")}, 1024)
    assert row["GBps"] is None and row["error"].startswith("bad timing: median nan us")
    assert moe.timing_row({"median_us": 2.0}, 4096)["GBps"] == 2.0


def test_insitu_loopback_arguments(capsys):
    tool = _load("bench_cli_insitu", BENCH / "insitu_loopback.py")
    for argv, says in ((["--sizes", "12Q"], "argument --sizes: '12Q' is not a size"),  # was: ValueError traceback
                       (["--variants", "bogus"], "--variants: unknown variants 'bogus'"),  # was: KeyError
                       (["--ranks", "0"], "argument --ranks: expected a positive integer, got '0'"),
                       (["--calls", "-1"], "argument --calls: expected a positive integer, got '-1'")):
        assert says in usage_error(capsys, tool.parse_args, argv)
    # sizes that round to one call (or are given twice) were measured twice: two rows, one key
    args = tool.parse_args(["--sizes", "1K,1000,1001,1K", "--collectives", "allreduce,allgather"])
    assert args.sizes_of == {"allreduce": [1024, 1000], "allgather": [1024, 1000]}


# --------------------------------------------------------------------------- the other benchmarks and scripts


def script_error(script: str, argv: list[str]) -> str:
    """``script argv`` run as a user would: exit 2, no traceback, argparse's error last."""
    done = subprocess.run([sys.executable, str(ROOT / script), *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("argv,says", [
    # each was read with int() inside the GPU loop (a traceback mid-run) or measured as given
    (["--bytes", "1024,1Q"], "argument --bytes: '1Q' is not a size"),
    (["--bytes", ""], "argument --bytes: expected a comma-separated list of sizes"),
    (["--bytes", "-4"], "argument --bytes: '-4' is not a size"),
    (["--packed", "2"], "argument --packed: expected 0 or 1, got '2'"),
    (["--channels", "0"], "argument --channels: expected a positive integer, got '0'"),
    (["--slices", "-1"], "argument --slices: expected a positive integer, got '-1'"),
    (["--threads", "x"], "argument --threads: expected a positive integer, got 'x'"),
    (["--inline-loops", "-1"], "argument --inline-loops: expected an integer >= 0, got '-1'"),
    (["--collectives", "foo"], "--collectives: unknown collectives 'foo'; choose from allgather,"),
    (["--algorithms", "push"], "--algorithms: unknown algorithms 'push'; choose from direct-push, direct-pull"),
])
def test_ll_sweep_checks_its_lists_before_the_run(argv, says):
    assert says in script_error("benchmarks/ll_sweep.py", ["--out", "/tmp/unused", *argv])


def test_loopback_slices_arguments(capsys):
    tool = _load("bench_cli_loopback_slices", BENCH / "loopback_slices.py")
    args = tool.parse_args(["--out", "x", "--slices", "1,2", "--bytes", "1M"])
    assert args.slices == [1, 2] and args.bytes == 1 << 20 and args.collective_list == ["allgather", "allreduce",
                                                                                       "alltoall"]
    assert "argument --slices: expected a positive integer, got 'x'" in usage_error(
        capsys, tool.parse_args, ["--out", "x", "--slices", "1,x"])  # was: ValueError mid-run
    assert "--collectives: unknown collectives 'foo'" in usage_error(
        capsys, tool.parse_args, ["--out", "x", "--collectives", "foo"])


def test_e2e_run_checks_the_world_against_the_model(capsys):
    """--loopback 3 or 16 failed after the GPU check, with a traceback."""
    pytest.importorskip("torch")  # the model's sizes are checked where the model can be imported
    run = _load("bench_cli_e2e_run", BENCH / "e2e" / "run.py")
    assert "tensor parallelism over 3 ranks needs heads (32) divisible by 3" in usage_error(
        capsys, run.parse_args, ["--loopback", "3"])
    assert "tensor parallelism over 16 ranks needs kv_heads (8) divisible by 16" in usage_error(
        capsys, run.parse_args, ["--loopback", "16"])
    assert run.parse_args(["--loopback", "2"]).loopback == 2


@pytest.mark.parametrize("argv,says", [
    (["--worlds", "1"], "argument --worlds: world size 1 is outside 2..22"),  # was: 2 experts for top-k 4
    (["--worlds", "23"], "argument --worlds: world size 23 is outside 2..22"),  # was: negative token counts
    (["--worlds", "0"], "argument --worlds: expected a positive integer, got '0'"),
    (["--channels", "0"], "argument --channels: expected a positive integer, got '0'"),
    (["--steps", "0"], "argument --steps: expected a positive integer, got '0'"),
])
def test_stress_moe_arguments(capsys, argv, says):
    tool = _load("bench_cli_stress_moe", ROOT / "scripts" / "stress_moe.py")
    assert tool.parse_args(["--worlds", "2", "22"]).worlds == [2, 22]
    assert says in usage_error(capsys, tool.parse_args, argv)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_compile_times_limit_scale_is_a_finite_number_above_0(value):
    """0 or -1 recorded every figure as a timeout (over that day's results); nan was a ValueError."""
    assert f"argument --limit-scale: expected a finite number above 0, got '{value}'" in script_error(
        "benchmarks/compile_times.py", ["--limit-scale", value])


@pytest.mark.parametrize("argv,says", [
    (["--count", "0"], "argument --count: expected a positive integer, got '0'"),
    (["--count", "-5"], "argument --count: expected a positive integer, got '-5'"),
    (["--count", "1", "--out", "/proc/no/such/dir/fuzz.json"], "--out /proc/no/such/dir/fuzz.json: cannot write there"),
])
def test_fuzz_arguments_are_checked_before_the_inputs_run(argv, says):
    assert says in script_error("scripts/fuzz.py", argv)


@pytest.mark.parametrize("script", ["scripts/probe_edges.py", "scripts/stack_growth_probe.py"])
def test_probes_know_help_and_refuse_unknown_options(script):
    """They ignored --help and started the whole GPU probe."""
    done = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 0 and done.stdout.startswith("usage: "), done.stderr[-2000:]
    assert "unrecognized arguments: --bogus" in script_error(script, ["--bogus"])


@pytest.mark.parametrize("script,argv,says", [
    # each wrote its results with mkdir / write_text after the GPU run: a traceback, the run lost
    ("benchmarks/ll_sweep.py", ["--out", "{file}"], "argument --out: '{file}' is a file, not a folder"),
    ("benchmarks/loopback_slices.py", ["--out", "{file}"], "argument --out: '{file}' is a file, not a folder"),
    ("benchmarks/loopback_slices.py", ["--out", "{dir}", "--label", "a/b"], "argument --label: expected a name for files"),
    ("benchmarks/host_path.py", ["--out", "{file}/x"], "argument --out: '{file}/x': '{file}' is a file, not a folder"),
    ("benchmarks/trace_overhead.py", ["--out", "{file}"], "argument --out: '{file}' is a file, not a folder"),
    ("benchmarks/moe_dispatch.py", ["--out", "{file}"], "argument --out: '{file}' is a file, not a folder"),
    ("benchmarks/epilogue_overhead.py", ["--out", "{file}"], "argument --out: '{file}' is a file, not a folder"),
    ("benchmarks/epilogue_overhead.py", ["--out", "{dir}", "--label", "../x"], "argument --label: expected a name for files"),
    ("benchmarks/compile_times.py", ["--out", "{file}"], "argument --out: '{file}' is a file, not a folder"),
])
def test_scripts_check_where_they_write_before_the_run(tmp_path, script, argv, says):
    taken = tmp_path / "taken"
    taken.write_text("")
    fill = {"file": str(taken), "dir": str(tmp_path)}
    assert says.format(**fill) in script_error(script, [a.format(**fill) for a in argv])


# --------------------------------------------------------------------------- the scripts themselves


@pytest.mark.parametrize("script,argv,says", [
    ("benchmarks/bench.py", ["--quick"], "bench.py: needs torchrun, CUDA GPUs and torch"),
    ("benchmarks/e2e/run.py", [], "e2e/run.py: needs torchrun, CUDA GPUs and torch"),
    ("benchmarks/e2e/run.py", ["--loopback", "2"], "e2e/run.py: needs CUDA GPUs and torch"),
    ("benchmarks/moe_dispatch.py", ["--out", "/tmp/unused"], "moe_dispatch.py: needs CUDA GPUs and torch"),
    ("benchmarks/insitu_loopback.py", [], "insitu_loopback.py: needs CUDA GPUs and torch"),
    ("examples/tp_mlp.py", [], "tp_mlp.py: needs torchrun and CUDA GPUs (and torch)"),
    ("benchmarks/host_path.py", ["--out", "/tmp/unused"], "host_path.py: needs torchrun, CUDA GPUs and torch"),
    ("benchmarks/trace_overhead.py", ["--out", "/tmp/unused"], "trace_overhead.py: needs torchrun, CUDA GPUs and torch"),
    ("benchmarks/ll_sweep.py", ["--out", "/tmp/unused"], "ll_sweep.py: needs CUDA GPUs and torch"),
    ("benchmarks/loopback_slices.py", ["--out", "/tmp/unused"], "loopback_slices.py: needs CUDA GPUs and torch"),
    ("benchmarks/epilogue_overhead.py", ["--out", "/tmp/unused"], "epilogue_overhead.py: needs CUDA GPUs and torch"),
    ("scripts/stress_moe.py", [], "stress_moe.py: needs CUDA GPUs and torch"),
])
def test_scripts_without_a_gpu_say_so_in_one_line(script, argv, says):
    """Run as a user would, without torchrun's variables and with no GPU visible (whatever
    this machine has): one line on stderr, exit status 2, no traceback."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    done = subprocess.run([sys.executable, str(ROOT / script), *argv], capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(says), done.stderr[-2000:]


@pytest.mark.parametrize("script", ["benchmarks/host_path.py", "benchmarks/trace_overhead.py", "benchmarks/ll_sweep.py",
                                    "benchmarks/loopback_slices.py", "benchmarks/epilogue_overhead.py",
                                    "scripts/stress_moe.py"])
def test_help_works_without_torch(script):
    """--help was ModuleNotFoundError where torch is not installed: torch is imported after parsing."""
    done = subprocess.run([sys.executable, "-c", "import sys, runpy; sys.modules['torch'] = None; "
                           f"sys.argv = [{script!r}, '--help']; runpy.run_path({script!r}, run_name='__main__')"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.startswith("usage: "), done.stderr[-2000:]
