"""The end-to-end decode benchmark's rows, report and command line on the CPU, without torch
(tests/test_e2e_cpu.py covers the model, with torch): a step time that is not a finite positive
number is an error row, never a baseline or the best NCCL, and the files are strict JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from e2e import results, run  # noqa: E402

NAN, INF = float("nan"), float("inf")
META = {"date": "2026-12-01", "world_size": 2, "loopback": False, "layers": 2}


def table_rows(md: str) -> dict[str, str]:
    return {line.split(" | ")[1]: line for line in md.splitlines() if line.startswith("| 16 |")}


@pytest.mark.parametrize("bad", [NAN, INF, 0.0, -5.0], ids=repr)
def test_a_bad_purlin_step_is_an_error_row(bad):
    rows = [results.row("none", 16, 2, 100.0, [99.0, 101.0]),
            results.row("nccl", 16, 2, 130.0, [129.0, 131.0], agree=(True, "x")),
            results.row("purlin", 16, 2, bad, [bad, bad], agree=(True, "x"))]
    assert rows[2]["step_us"] is None and rows[2]["bad_time"] == repr(bad)
    assert rows[2]["error"] == f"bad timing: step time {bad!r} is not a finite positive number"
    results.add_comm_time(rows)
    assert "comm_us" not in rows[2] or rows[2]["comm_us"] is None
    md = results.markdown(rows, META)
    assert table_rows(md)["purlin"].startswith("| 16 | purlin | - | - | - | bad timing: step time")
    assert "1 row with a step time that is not a finite positive number" in md
    assert "nan" not in table_rows(md)["nccl"].lower()


def test_a_nan_nccl_row_is_never_the_best_nccl():
    """The probe: NaN NCCL first made every system's ratio 'nanx'."""
    rows = [results.row("none", 16, 2, 100.0, [100.0]),
            results.row("nccl", 16, 2, NAN, [NAN], agree=(True, "x")),
            results.row("nccl-nomix", 16, 2, 130.0, [130.0], agree=(True, "x")),
            results.row("purlin", 16, 2, 118.0, [118.0], agree=(True, "x"))]
    results.add_comm_time(rows)
    assert rows[3]["comm_vs_best_nccl"] == pytest.approx(18.0 / 30.0)
    md = results.markdown(rows, META)
    assert "nanx" not in md and "| 16 | purlin | 118.00 | 18.00 | 0.60x (nccl-nomix) | yes |" in md


def test_a_nan_baseline_gives_no_comm_time():
    rows = [results.row("none", 16, 2, NAN, [NAN]), results.row("nccl", 16, 2, 130.0, [130.0], agree=(True, "x"))]
    results.add_comm_time(rows)
    assert rows[0]["error"].startswith("bad timing") and rows[1].get("comm_us") is None


def test_one_bad_repeat_makes_the_row_an_error():
    r = results.row("purlin", 16, 2, 118.0, [117.0, NAN, 119.0], agree=(True, "x"))
    assert r["error"] == "bad timing: step time nan is not a finite positive number" and r["step_us"] is None


def test_rows_read_back_are_checked_too():
    """The NCCL child's rows arrive as plain dicts: add_comm_time checks them as row() does."""
    raw = [{"system": "none", "batch": 1, "world_size": 2, "step_us": 50.0},
           {"system": "nccl", "batch": 1, "world_size": 2, "step_us": -3.0, "agrees": True, "error": None}]
    results.add_comm_time(raw)
    assert raw[1]["error"] == "bad timing: step time -3.0 is not a finite positive number"


def test_no_ratio_without_real_communication_time():
    """A step at or below the no-communication one (noise) has comm_us <= 0: no ratio of it."""
    rows = [results.row("none", 16, 2, 100.0, [100.0]), results.row("nccl", 16, 2, 130.0, [130.0], agree=(True, "x")),
            results.row("purlin", 16, 2, 90.0, [90.0], agree=(True, "x"))]
    results.add_comm_time(rows)
    assert rows[2]["comm_us"] == pytest.approx(-10.0) and "comm_vs_best_nccl" not in rows[2]
    assert "| 16 | purlin | 90.00 | -10.00 | - | yes |" in results.markdown(rows, META)


def test_each_ratio_names_the_nccl_setting_it_is_over():
    """The best NCCL setting can change from batch to batch: each ratio says which it is over."""
    rows = []
    for batch, default, nomix in ((1, 120.0, 110.0), (16, 125.0, 140.0)):
        rows += [results.row("none", batch, 2, 100.0, [100.0]),
                 results.row("nccl", batch, 2, default, [default], agree=(True, "x")),
                 results.row("nccl-nomix", batch, 2, nomix, [nomix], agree=(True, "x")),
                 results.row("purlin", batch, 2, 105.0, [105.0], agree=(True, "x"))]
    results.add_comm_time(rows)
    assert [(r["batch"], r["best_nccl"]) for r in rows if r["system"] == "purlin"] == [(1, "nccl-nomix"), (16, "nccl")]
    md = results.markdown(rows, META)
    assert "| 1 | purlin | 105.00 | 5.00 | 0.50x (nccl-nomix) | yes |" in md
    assert "| 16 | purlin | 105.00 | 5.00 | 0.20x (nccl) | yes |" in md


def test_files_are_strict_json(tmp_path):
    rows = [results.row("none", 16, 2, 100.0, [100.0]), results.row("purlin", 16, 2, INF, [INF], agree=(True, "x")),
            results.row("nccl", 16, 2, 130.0, [130.0], agree=(True, "x"), extra_metric=NAN)]
    results.add_comm_time(rows)
    paths = results.write(rows, {**META, "odd": NAN}, tmp_path, "e2e")

    def refuse(token):
        raise ValueError(token)

    doc = json.loads(paths["json"].read_text(), parse_constant=refuse)
    assert doc["rows"][1]["bad_time"] == "inf" and doc["rows"][2]["extra_metric"] is None and doc["meta"]["odd"] is None
    assert json.loads(results.strict_json(rows), parse_constant=refuse)[1]["step_us"] is None


def test_child_rows_must_have_the_shape(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps([{"system": "nccl-nomix", "batch": 1, "step_us": 3.0}]))
    assert run._child_rows(good)[0]["system"] == "nccl-nomix"
    for text in ("{}", "[1]", '[{"batch": 1}]'):
        good.write_text(text)
        with pytest.raises(ValueError, match="expected a JSON list of rows"):
            run._child_rows(good)


@pytest.mark.parametrize("argv,says", [
    (["--batches", "0,-4"], "argument --batches: expected a positive integer, got '0'"),
    (["--batches", ""], "argument --batches: expected a comma-separated list of positive integers, got ''"),
    (["--batches", "abc"], "argument --batches: expected a positive integer, got 'abc'"),  # was: a traceback
    (["--layers", "0"], "argument --layers: expected a positive integer, got '0'"),
    (["--layers", "-1"], "argument --layers: expected a positive integer, got '-1'"),
    (["--reps", "0"], "argument --reps: expected a positive integer, got '0'"),
    (["--replays", "0"], "argument --replays: expected a positive integer, got '0'"),
    (["--kv-len", "-5"], "argument --kv-len: expected a positive integer, got '-5'"),
    (["--systems", ""], "--systems: no systems given ('')"),  # was: every system
    (["--loopback", "-3"], "argument --loopback: expected a positive integer, got '-3'"),  # was: true, then a crash
    (["--loopback", "0"], "argument --loopback: expected a positive integer, got '0'"),
])
def test_run_refuses_bad_options(capsys, argv, says):
    with pytest.raises(SystemExit) as stop:
        run.parse_args(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err
    assert says in err.strip().splitlines()[-1]
