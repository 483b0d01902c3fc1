"""Regression tests for the benchmark tooling's checks, argument handling, merging and history
(the defects a probe found): no GPU; torch (CPU) only where a check runs."""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

import pytest

from test_bench_report import BENCH, _load, report  # report: loaded there, which put benchmarks/ on sys.path

ROOT = Path(__file__).resolve().parent.parent
KiB, MiB = report.KiB, report.MiB


def row(variant, time_us, *, options=None, system="purlin", nbytes=KiB, mode="graph", coll="allreduce"):
    return {"system": system, "variant": variant, "collective": coll, "bytes": nbytes, "mode": mode,
            "calls_per_graph": 20 if mode == "graph" else None, "time_us": time_us, "world_size": 2,
            "checked": True, "error": None, "options": options or {}}


PUSH1 = {"algorithm": "direct-push", "atom": "ldst", "channels": 1}

# The checks run on torch tensors: these tests skip without torch, and .ci/run's torch line runs them.
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (CPU build)")


# --------------------------------------------------------------------------- 1: choices are no schedules


@pytest.mark.parametrize("choice", ["default", "zerocopy", "graph-staged", "graph-registered"])
def test_a_choice_of_the_runtime_never_wins_best_variant_or_the_tuning_table(choice):
    doc = {"meta": {"world_size": 2},
           "rows": [row("default", 2.0), row(choice, 1.5, options={"graph_buffers": "register"}),
                    row("push-ldst-c1", 3.0, options=PUSH1)]}
    assert report.best_purlin(report.prepared(doc)["rows"], "allreduce", KiB, "graph")["variant"] == "push-ldst-c1"
    (entry,) = report.tuning_table(doc)["allreduce"]["2"]
    assert entry["variant"] == "push-ldst-c1" and entry["algorithm"] == "direct-push"


def test_every_purlin_variant_without_a_pinned_schedule_is_a_choice():
    api = _load("purlin_api")
    rows = importlib.import_module("benchlib.rows")
    unpinned = {v.name for v in api.VARIANTS if not v.options}
    assert unpinned <= set(rows.NOT_SCHEDULES), unpinned - set(rows.NOT_SCHEDULES)


# --------------------------------------------------------------------------- 2: reductions element by element


def _check_lib():
    pytest.importorskip("torch")
    return importlib.import_module("benchlib.check")


@needs_torch
@pytest.mark.parametrize("nbytes, tail", [(MiB, 64), (16 * MiB, 1024), (16 * MiB, 16384)])
def test_an_unreduced_or_unwritten_tail_fails_the_check(nbytes, tail):
    import torch

    check = _check_lib()
    R = 2
    lay = report.layout("allreduce", R, nbytes)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(lay.in_elems, generator=g).to(torch.bfloat16) for _ in range(R)]
    want = check.expected_output(lay, torch.cat(xs), 0, R)
    assert check.compare(want.value.clone(), want)[0]
    unreduced = want.value.clone()
    unreduced[-tail:] = xs[0][-tail:]  # rank 0's own input: the tail never reduced
    good, note = check.compare(unreduced, want)
    assert not good and "beyond their rounding bound" in note, note
    zeros = want.value.clone()
    zeros[-tail:] = 0
    assert not check.compare(zeros, want)[0]


@needs_torch
def test_one_element_missing_an_addend_of_its_size_fails():
    import torch

    check = _check_lib()
    lay = report.layout("allreduce", 4, 4 * KiB)
    xs = [torch.full((lay.in_elems,), 0.5 + r, dtype=torch.bfloat16) for r in range(4)]
    want = check.expected_output(lay, torch.cat(xs), 0, 4)
    out = want.value.clone()
    out[7] -= xs[3][7]  # one element short of rank 3's addend
    good, note = check.compare(out, want)
    assert not good and note.startswith("1 of ") and "first at 7" in note


def _sums(xs, dtype, order):
    """Correct sums a system may produce: in the dtype itself in ``order``, pairwise, or in
    float32 rounded once."""
    import torch

    seq = xs[order[0]].clone()
    for i in order[1:]:
        seq = (seq + xs[i]).to(dtype)
    level = list(xs)
    while len(level) > 1:
        level = [(level[i] + level[i + 1]).to(dtype) if i + 1 < len(level) else level[i]
                 for i in range(0, len(level), 2)]
    return [seq, level[0], torch.stack([x.float() for x in xs]).sum(0).to(dtype)]


@needs_torch
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("R", range(2, 9))
def test_correct_sums_in_any_order_pass(dtype_name, R):
    import torch

    check = _check_lib()
    dtype = getattr(torch, dtype_name)
    n = 840 * 16  # divisible by every R of 2..8, in 16-byte chunks
    g = torch.Generator().manual_seed(R)
    scale = torch.exp2(torch.randint(-6, 7, (n,), generator=g).float())  # magnitudes 2^-6 .. 2^6 mixed
    xs = [(torch.randn(n, generator=g) * scale).to(dtype) for _ in range(R)]
    size = xs[0].element_size()
    want = check.expected_output(report.layout("allreduce", R, n * size, size), torch.cat(xs), 0, R)
    order = torch.randperm(R, generator=g).tolist()
    for got in _sums(xs, dtype, order):
        good, note = check.compare(got, want)
        assert good, (dtype_name, R, note)
    rs = check.expected_output(report.layout("reduce_scatter", R, n * size, size), torch.cat(xs), R - 1, R)
    chunk = slice((R - 1) * (n // R), n)
    assert check.compare(_sums([x[chunk] for x in xs], dtype, order)[0], rs)[0]
    short = want.value.clone()  # the last element missing one rank's addend
    short[-1] = (short[-1].float() - xs[order[-1]][-1].float() * 1.0).to(dtype)
    if xs[order[-1]][-1].abs() > want.bound[-1]:
        assert not check.compare(short, want)[0]
    nan = want.value.clone()
    nan[0] = float("nan")
    assert not check.compare(nan, want)[0]


@needs_torch
def test_copies_stay_bit_exact():
    import torch

    check = _check_lib()
    lay = report.layout("allgather", 2, 4 * KiB)
    allx = torch.randn(2 * lay.in_elems).to(torch.bfloat16)
    want = check.expected_output(lay, allx, 1, 2)
    assert check.compare(allx.clone(), want) == (True, "bit-exact")
    off = allx.clone()
    off[3] = -off[3] if off[3] != 0 else 1.0
    assert not check.compare(off, want)[0]


# --------------------------------------------------------------------------- 3: e2e without a reference


def test_e2e_without_a_reference_is_a_failure(tmp_path, capsys):
    import types

    pytest.importorskip("torch")
    results = importlib.import_module("e2e.results")
    run = importlib.import_module("e2e.run")
    rows = [results.row("none", 1, 2, 100.0, [100.0]),
            results.row("reference", 1, 2, None, None, error="rank 1: RuntimeError: NCCL all_gather failed"),
            results.row("nccl", 1, 2, 120.0, [120.0]),
            results.row("purlin", 1, 2, 110.0, [110.0]),
            results.row("none", 16, 2, 100.0, [100.0]),
            results.row("reference", 16, 2, 130.0, [130.0], agree=(True, "the reference")),
            results.row("purlin", 16, 2, 110.0, [110.0], agree=(True, "max rel err 0.0e+00"))]
    assert results.unchecked_batches(rows) == [1]
    assert "NOT CHECKED: the reference failed or is missing at batch 1" in results.markdown(rows, {})
    args = types.SimpleNamespace(results_dir=tmp_path, out=None)
    meta = {"date": "2026-12-04", "loopback": False, "world_size": 2, "layers": 2, "kv_len": 1024}
    assert run.write(args, rows, meta) == 1
    assert "no reference at batch 1" in capsys.readouterr().err
    assert run.write(args, rows[4:], meta) == 0  # checked everywhere: success
    assert "NOT CHECKED" not in results.markdown(rows[4:], {})


# --------------------------------------------------------------------------- 4, 8: bench.py's options


bench = _load("bench")


def _usage(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(["--dry-run", *argv])
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_bench_refuses_a_machine_tag_that_is_no_file_name(capsys):
    for bad in ("x/y", "../up", "", "a b"):
        assert "argument --machine: expected a name for files" in _usage(capsys, ["--machine", bad])
    assert bench.parse_args(["--dry-run", "--machine", "h200x2-nvl.1"]).machine == "h200x2-nvl.1"


@pytest.mark.parametrize("option", ["--results-dir", "--out"])
def test_bench_refuses_an_output_folder_that_is_a_file_before_the_run(tmp_path, capsys, option):
    afile = tmp_path / "results.json"
    afile.write_text("{}")
    assert f"argument {option}: '{afile}' is a file, not a folder" in _usage(capsys, [option, str(afile)])
    under = afile / "sub"
    assert f"argument {option}: '{under}': '{afile}' is a file, not a folder" in _usage(capsys, [option, str(under)])
    new = tmp_path / "new" / "deeper"
    assert getattr(bench.parse_args(["--dry-run", option, str(new)]), option[2:].replace("-", "_")) == new
    assert not new.exists()  # nothing is created until the run writes


def test_bench_keeps_an_explicit_reps_with_quick():
    assert bench.parse_args(["--dry-run", "--quick", "--reps", "5"]).reps == 5
    assert bench.parse_args(["--dry-run", "--quick"]).reps == 3
    assert bench.parse_args(["--dry-run"]).reps == 5
    assert bench.parse_args(["--dry-run", "--reps", "3"]).reps == 3


def test_bench_budget_help_says_what_the_code_does(capsys):
    assert bench.parse_args(["--dry-run", "--quick"]).budget_s == 230.0
    assert bench.parse_args(["--dry-run"]).budget_s == 330.0
    with pytest.raises(SystemExit):
        bench.parse_args(["--help"])
    helptext = " ".join(capsys.readouterr().out.split())
    assert "(default 330, quick 230)" in helptext
    assert "no new size after 230 s" in (BENCH / "README.md").read_text()


# --------------------------------------------------------------------------- 5, 6, 11: the scripts


def _script(name: str):
    return _load(name, ROOT / "scripts")


def _result(path: Path, rows: list[dict], world=2, **meta) -> Path:
    path.write_text(json.dumps({"meta": {"world_size": world, "date": "2026-12-09", **meta}, "rows": rows}))
    return path


def test_history_replaces_a_run_whole(tmp_path, monkeypatch):
    history = _script("results_history")
    monkeypatch.setattr(history, "HISTORY", tmp_path / "history.csv")
    monkeypatch.setattr(history, "RUNS", tmp_path / "runs.csv")
    run = tmp_path / "run7.json"
    two = [row("default", 2.0), row("default", 3.0, nbytes=MiB)]
    assert history.main([str(_result(run, two))]) == 0
    assert history.main([str(_result(tmp_path / "run8.json", [row("default", 9.0)]))]) == 0
    assert history.main([str(_result(run, [row("default", 2.5)]))]) == 0  # run 7 again, without 1 MiB
    lines = (tmp_path / "history.csv").read_text().splitlines()
    run7 = [line for line in lines if line.startswith("run7,")]
    assert run7 == ["run7,allreduce,1024,graph,20,purlin,default,2.5,"], run7
    assert any(line.startswith("run8,") for line in lines)


@pytest.mark.parametrize("broken, says", [
    ({"bytes": None}, "row 1: no bytes in a row without an error"),
    ({"mode": None}, "row 1: no mode in a row without an error"),
    ({"collective": "allreduc"}, "row 1: unknown collective 'allreduc'"),
    ({"mode": "grph"}, "row 1: unknown mode 'grph'; expected one of eager, graph, insitu"),
])
def test_malformed_rows_are_refused_naming_the_file_and_row(tmp_path, capsys, broken, says):
    path = _result(tmp_path / "bad.json", [row("default", 2.0), {**row("default", 3.0, nbytes=MiB), **broken}])
    with pytest.raises(report.ResultsError, match="bad.json: " + says.replace("(", r"\(")):
        report.load_results(path)
    history = _script("results_history")
    assert history.main([str(path)]) == 2
    assert f"{path}: {says}" in capsys.readouterr().err
    assert report.main([str(path), "--out-dir", str(tmp_path / "out"), "--no-plots"]) == 2
    assert f"{path}: {says}" in capsys.readouterr().err


def test_a_failed_load_row_may_lack_bytes_and_mode(tmp_path):
    load_error = {**row("push-ce", None), "bytes": None, "mode": None, "error": "load: no", "phase": "load"}
    doc = report.load_results(_result(tmp_path / "ok.json", [row("default", 2.0), load_error]))
    assert len(doc["rows"]) == 2


def test_target_ranges_refuses_runs_of_different_world_sizes(tmp_path, capsys):
    ranges = _script("target_ranges")
    two = _result(tmp_path / "r2.json", [row("default", 2.0)])
    four = _result(tmp_path / "r4.json", [{**row("default", 2.0), "world_size": 4}], world=4)
    assert ranges.main([str(two), str(four)]) == 2
    assert "world size 4, but" in capsys.readouterr().err
    assert ranges.main([str(two), str(two)]) == 0


# --------------------------------------------------------------------------- 10: merged peaks


def _peaks(**methods) -> dict:
    return {"meta": {"world_size": 2, "peaks": methods}, "rows": []}


def test_merge_keeps_the_best_peak():
    error = {"error": "timed out"}
    slow = {"points": [{"bytes": MiB, "gbps": 300.0}]}
    fast = {"points": [{"bytes": MiB, "gbps": 200.0}, {"bytes": 1 << 30, "gbps": 395.0}]}
    assert report.merge([_peaks(ce=error), _peaks(ce=fast)])["meta"]["peaks"]["ce"] == fast
    assert report.merge([_peaks(ce=fast), _peaks(ce=error)])["meta"]["peaks"]["ce"] == fast
    assert report.merge([_peaks(ce=slow), _peaks(ce=fast)])["meta"]["peaks"]["ce"] == fast
    assert report.merge([_peaks(ce=fast), _peaks(ce=slow)])["meta"]["peaks"]["ce"] == fast
    merged = report.merge([_peaks(ce=slow), _peaks(sm=fast)])["meta"]["peaks"]
    assert merged == {"ce": slow, "sm": fast}


def test_bench_merge_keeps_the_merged_files_peaks_and_footprint(tmp_path, capsys):
    import threading
    import types

    pytest.importorskip("torch")
    output = importlib.import_module("benchlib.output")
    first = {"meta": {"world_size": 2, "run_id": "first", "purlin_footprint": {"after_loads": 1},
                      "peaks": {"ce": {"points": [{"bytes": MiB, "gbps": 390.0}]}}},
             "rows": [row("default", 2.0), row("default", 3.0, nbytes=MiB)]}
    path = tmp_path / "first.json"
    path.write_text(json.dumps(first))
    args = types.SimpleNamespace(merge=[path])
    ctx = types.SimpleNamespace(lock=threading.Lock(), rows=[row("default", 1.0)], t0=0.0, args=args,
                                meta={"world_size": 2, "run_id": "second", "peaks": {"ce": {"error": "no peer"}}})
    doc = output.document(ctx)
    assert doc["meta"]["peaks"]["ce"]["points"][0]["gbps"] == 390.0
    assert doc["meta"]["purlin_footprint"] == {"after_loads": 1}
    assert doc["meta"]["run_id"] == "second" and doc["meta"]["merged_from"] == [str(path)]
    times = {r["bytes"]: r["time_us"] for r in doc["rows"]}
    assert times == {KiB: 1.0, MiB: 3.0}  # this run's row wins
    # a file of other GPUs (known only when this run ends) is left out, with one line saying so
    path.write_text(json.dumps({**first, "meta": {**first["meta"], "gpus": ["NVIDIA H100", "NVIDIA H100"]}}))
    ctx.meta["gpus"] = ["NVIDIA H200", "NVIDIA H200"]
    doc = output.document(ctx)
    assert {r["bytes"]: r["time_us"] for r in doc["rows"]} == {KiB: 1.0}
    assert "bench: not merged: " in capsys.readouterr().err


# --------------------------------------------------------------------------- 7: the README table's caption


def test_readme_caption_says_how_the_quoted_rows_were_timed(tmp_path):
    readme = _script("readme_table")

    def rows(big_calls, reps):
        out = []
        for nbytes in (KiB, MiB, 16 * MiB):
            for system, variant in (("purlin", "default"), ("nccl", "default")):
                calls = 100 if nbytes <= MiB else big_calls
                r = {**row(variant, 2.0 if system == "purlin" else 3.0, system=system, nbytes=nbytes),
                     "calls_per_graph": calls, "reps": reps, "busbw_gbps": 100.0}
                out.append(r)
        return out

    path = tmp_path / "run.json"
    text = readme.caption(path, {}, rows(20, 3))
    assert "Graph replay, 100 calls per graph up to 1 MiB, 20 above; the slowest rank's median of 3 repeats;" in text
    text = readme.caption(path, {}, rows(100, 5))
    assert "Graph replay, 100 calls per graph; the slowest rank's median of 5 repeats;" in text
    committed = BENCH / "results" / "2026-12-01-h200x2-run21.json"
    doc = report.load_results(committed)
    assert "100 calls per graph up to 1 MiB, 20 above; the slowest rank's median of 3 repeats" in readme.caption(
        committed, doc["meta"], doc["rows"])


# --------------------------------------------------------------------------- 12: an independent reference


@needs_torch
def test_the_reference_uses_no_communication(monkeypatch):
    import types

    import torch

    check = _check_lib()

    def no_nccl(*_args, **_kwargs):
        raise AssertionError("the reference must not gather through torch.distributed")

    for name in ("all_gather_into_tensor", "all_gather", "broadcast", "all_gather_object"):
        monkeypatch.setattr(check.dist, name, no_nccl)
    R, salt = 4, 7
    ranks = [types.SimpleNamespace(args=types.SimpleNamespace(seed=1234), device=torch.device("cpu"), rank=r, world=R)
             for r in range(R)]
    for coll in ("allgather", "gather", "allreduce", "alltoall"):
        lay = report.layout(coll, R, 4 * KiB)
        inputs = [check.fresh_input(ctx, lay.in_elems, salt) for ctx in ranks]  # what each rank calls with
        for ctx in ranks:
            want = check.expected_output(lay, torch.cat(inputs), ctx.rank, R)
            got = check.reference(ctx, lay, salt)
            assert (got is None) == (want is None)
            if want is not None:
                assert torch.equal(got.value, want.value)
    assert not torch.equal(inputs[0], inputs[1])


# --------------------------------------------------------------------------- 14: the loopback graph row's check


@needs_torch
def test_insitu_loopback_checks_the_back_to_back_graph_itself(monkeypatch):
    import types

    import torch

    pytest.importorskip("purlinc")
    loopback = importlib.import_module("benchlib.loopback")
    api = _load("purlin_api")
    monkeypatch.setattr(loopback, "DEVICE", "cpu")
    monkeypatch.setattr(loopback.torch.cuda, "synchronize", lambda *_: None)
    monkeypatch.setattr(loopback, "replays_us", lambda *_args: 10.0)
    monkeypatch.setattr(loopback, "graph_replays", lambda *_args: 1)
    R = 2
    lay = report.layout("allreduce", R, 4 * KiB)
    xs = [torch.empty(lay.in_elems, dtype=torch.bfloat16) for _ in range(R)]
    outs = [torch.empty(lay.out_elems, dtype=torch.bfloat16) for _ in range(R)]
    coll = types.SimpleNamespace(check=lambda: None)
    steps = loopback.Steps(coll, lay, xs, outs, xs, outs, [None] * R)

    def reduce_into_outputs():
        total = torch.stack([x.float() for x in xs]).sum(0).to(torch.bfloat16)
        for out in outs:
            out.copy_(total)

    def produce_and_reduce():
        for src, dst in zip(steps.sources, steps.targets):
            dst.copy_(src)
        reduce_into_outputs()

    class Graph:
        def __init__(self, work):
            self.replay = work

    point = loopback.Point(lay, api.VARIANTS[0], calls=2, reps=1, target_rep_us=100.0, seed=1)
    base = {"variant": "default@loopback"}
    good = {"back": Graph(reduce_into_outputs), "with": Graph(produce_and_reduce), "without": Graph(lambda: None)}
    graph_row, insitu_row = loopback._timed(steps, good, point, base)
    assert graph_row["checked"] is True and insitu_row["checked"] is True
    broken = {**good, "back": Graph(lambda: None)}  # the back-to-back graph leaves the outputs unwritten
    graph_row, insitu_row = loopback._timed(steps, broken, point, base)
    assert graph_row["checked"] is False and "not finite" in graph_row["check_note"]
    assert insitu_row["checked"] is True


# --------------------------------------------------------------------------- 14: gpu_summary


@pytest.mark.parametrize("seconds, recorded, says", [
    ("812", 812, None), ("812.5", 812.5, None), ("12m", None, "SUITE_SECONDS='12m' is not a finite number"),
    ("nan", None, "SUITE_SECONDS='nan' is not a finite number"), (None, None, None)])
def test_gpu_summary_reads_suite_seconds_and_writes_strict_json(tmp_path, monkeypatch, seconds, recorded, says):
    gpu = _script("gpu_summary")
    monkeypatch.setattr(gpu, "sh", lambda cmd: "")
    monkeypatch.setattr(gpu, "versions", lambda: {})
    if seconds is None:
        monkeypatch.delenv("SUITE_SECONDS", raising=False)
    else:
        monkeypatch.setenv("SUITE_SECONDS", seconds)
    (tmp_path / "steps.tsv").write_text("zz_a\t0\t12\nzz_b\t0\tnan\nzz_c\t0\tinf\n")
    (tmp_path / "scale.json").write_text('{"passed": 1, "total": 1, "worst": NaN}')
    assert gpu.cli([str(tmp_path)]) == 0
    text = (tmp_path / "summary.json").read_text()
    summary = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in summary.json"))
    assert summary["seconds"] == recorded
    assert [s["name"] for s in summary["steps"]] == ["zz_a"] and len(summary["bad_steps_lines"]) == 2
    assert summary["results"]["scale.json"]["worst"] is None
    md = (tmp_path / "summary.md").read_text()
    assert (says in md and summary["notes"] == [says + " of seconds >= 0"]) if says else summary["notes"] == []
