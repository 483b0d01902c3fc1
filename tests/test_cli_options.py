"""Command-line options that do not apply, conflict or are out of range are refused (exit 2,
naming the option and what is allowed), never ignored, and never an internal error (exit 3)."""

from __future__ import annotations

from pathlib import Path

import pytest

from purlinc.cli import main

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
ALLGATHER, ALLREDUCE, BROADCAST = (str(EXAMPLES / f"{n}.pln") for n in ("allgather", "allreduce", "broadcast"))
ALLTOALLV = str(EXAMPLES / "sized" / "alltoallv.pln")


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PURLIN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "options-cache"))


def cli(capsys, *argv) -> tuple[int, str, str]:
    """Exit status, stdout, stderr of ``purlinc argv``: argparse's errors (SystemExit) included."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def refused(capsys, *argv) -> str:
    code, out, err = cli(capsys, *argv)
    assert code == 2, (code, err)
    assert "Traceback" not in err and "internal error" not in err
    return err


# ---- check -a: an algorithm that applies to no size ---------------------------------------

@pytest.mark.parametrize("argv, reason", [
    ([ALLGATHER, "-R", "2..4", "-a", "two-shot"], "two-shot applies to reductions only"),
    ([ALLTOALLV, "-R", "1..4", "-a", "ring"], "cannot be lowered with algorithm ring"),
    ([ALLREDUCE, "-R", "1", "-a", "two-shot"], "two-shot needs an output chunk that several ranks receive"),
])
def test_check_refuses_a_pinned_algorithm_that_applies_to_no_size(capsys, argv, reason):
    err = refused(capsys, "check", *argv)
    assert reason in err and "applies to none of the sizes checked" in err


def test_check_pinned_algorithm_verifies_the_sizes_it_applies_to(capsys):
    code, out, err = cli(capsys, "check", ALLREDUCE, "-R", "1..3", "-a", "two-shot")
    assert code == 0, err
    assert "2 schedules verified" in out  # R=1 has nothing to reduce twice: skipped, as before


def test_check_without_a_pinned_algorithm_is_unchanged(capsys):
    code, out, err = cli(capsys, "check", ALLGATHER, "-R", "2..3")
    assert code == 0 and "ok for R=2..3" in out, err


# ---- compile and dump ---------------------------------------------------------------------

def test_unknown_op_is_refused_for_a_copy_collective(capsys, tmp_path):
    err = refused(capsys, "compile", ALLGATHER, "-R", "2", "--op", "bogus", "-o", tmp_path / "out")
    assert "unknown reduce op 'bogus'; expected one of sum, prod, max, min" in err
    assert not (tmp_path / "out").exists()  # refused before the output directory is made
    err = refused(capsys, "dump", ALLGATHER, "-R", "2", "-s", "cuda", "--op", "bogus")
    assert "unknown reduce op 'bogus'" in err


@pytest.mark.parametrize("stage", ["ast", "spec", "snac"])
def test_dump_checks_the_target_at_every_stage(capsys, stage):
    err = refused(capsys, "dump", ALLGATHER, "-R", "2", "-s", stage, "--arch", "bogus")
    assert "unknown target architecture 'bogus'" in err and "sm_90" in err


@pytest.mark.parametrize("stage", ["ast", "cuda"])
def test_dump_json_only_for_spec_and_snac(capsys, stage):
    err = refused(capsys, "dump", ALLGATHER, "-R", "2", "-s", stage, "--json")
    assert f"--json applies to --stage spec and snac, not --stage {stage}" in err


@pytest.mark.parametrize("stage", ["ast", "spec", "cuda"])
def test_dump_gpus_per_node_only_for_snac(capsys, stage):
    err = refused(capsys, "dump", ALLGATHER, "-R", "4", "-s", stage, "--gpus-per-node", "2")
    assert f"--gpus-per-node applies to --stage snac, not --stage {stage}" in err


@pytest.mark.parametrize("command", ["compile", "dump", "check", "draw"])
def test_two_stage_copies_name_the_algorithm(capsys, tmp_path, command):
    extra = ["-o", tmp_path / "out"] if command == "compile" else []
    err = refused(capsys, command, ALLGATHER, "-R", "2", "-a", "ring", "--stage-copies", "2", *extra)
    assert "--stage-copies 2 does not apply to ring: it lowers to 1 staging copy" in err
    assert "two staging copies apply to direct-push only" in err


def test_two_stage_copies_with_direct_push(capsys):
    code, _, err = cli(capsys, "dump", ALLGATHER, "-R", "2", "-s", "snac", "-a", "direct-push", "--stage-copies", "2")
    assert code == 0, err


@pytest.mark.parametrize("command", ["compile", "dump", "check", "draw"])
def test_a_parameter_given_twice_is_refused(capsys, command):
    err = refused(capsys, command, BROADCAST, "-R", "2", "-p", "root=1", "-p", "root=0")
    assert "argument --param/-p: root given twice (root=1, root=0)" in err


def test_a_parameter_given_once_each(capsys):
    code, out, err = cli(capsys, "dump", BROADCAST, "-R", "2", "-p", "root=1")
    assert code == 0, err


@pytest.mark.parametrize("command, flag", [("compile", "-o/--output-dir")])
def test_an_empty_output_path_is_refused(capsys, tmp_path, monkeypatch, command, flag):
    monkeypatch.chdir(tmp_path)
    err = refused(capsys, command, ALLGATHER, "-R", "2", "-o", "")
    assert f"argument {flag}: expected a path, got an empty string" in err
    assert not list(tmp_path.iterdir())  # nothing written to ./purlin-out or anywhere


def test_purlin_out_is_ignored_by_git():
    assert "purlin-out/" in (REPO / ".gitignore").read_text().split()
