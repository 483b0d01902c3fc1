"""The CLI's spec side: dump --stage ast/spec, check --spec-only, --help, --param, and user
errors on stderr with exit status 2 and no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from purlinc.cli import main
from purlinc.frontend.check import check
from purlinc.frontend.parse import parse_file

EXAMPLES = ("allgather", "allgather_rotated", "allreduce", "alltoall", "alltoall_blocks", "broadcast",
            "gather", "pairwise_exchange", "reduce", "reduce_scatter", "ring_shift", "scatter")


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_every_example_is_listed(example_paths):
    assert tuple(example_paths) == EXAMPLES


@pytest.mark.parametrize("name", EXAMPLES)
def test_dump_spec(capsys, example_paths, name):
    code, out, err = cli(capsys, "dump", example_paths[name], "--ranks", "4", "--stage", "spec")
    assert (code, err) == (0, "")
    assert out == check(parse_file(example_paths[name]), 4).format()
    assert out.startswith(f"collective {name} (R=4")


@pytest.mark.parametrize("name", EXAMPLES)
def test_dump_spec_json(capsys, example_paths, name):
    code, out, err = cli(capsys, "dump", example_paths[name], "--ranks", "4", "--stage", "spec", "--json")
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert data == check(parse_file(example_paths[name]), 4).to_json()
    assert data["world_size"] == 4 and len(data["ranks"]) == 4


@pytest.mark.parametrize("name", EXAMPLES)
def test_dump_ast_reprints_the_source(capsys, example_paths, name):
    code, out, _ = cli(capsys, "dump", example_paths[name], "--stage", "ast")
    assert code == 0
    assert out == parse_file(example_paths[name]).format()
    assert out.startswith(f"collective {name}") and out.endswith("}\n")


@pytest.mark.parametrize("name", ["allgather", "alltoall"])
def test_dump_spec_golden(capsys, example_paths, golden, name):
    code, out, _ = cli(capsys, "dump", example_paths[name], "--ranks", "4", "--stage", "spec")
    assert code == 0
    golden(f"spec/{name}_r4.txt", out)


def test_dump_spec_default_is_eight_ranks(capsys, example_paths):
    code, out, _ = cli(capsys, "dump", example_paths["allgather"])
    assert code == 0 and out.startswith("collective allgather (R=8, copy)\n")


def test_param_binds(capsys, example_paths):
    code, out, _ = cli(capsys, "dump", example_paths["gather"], "-R", "3", "--param", "root=2")
    assert code == 0
    assert out.splitlines()[0] == "collective gather (R=3, root=2, copy)"
    assert "rank 2:\n  in:  x[2]\n  out: x[0] x[1] x[2]\n" in out
    code, out, _ = cli(capsys, "dump", example_paths["alltoall_blocks"], "-R", "2", "-p", "k=1", "--json")
    assert json.loads(out)["ranks"][0]["in"] == ["x[0][0][0]", "x[0][1][0]"]


def test_unknown_param(capsys, example_paths):
    path = example_paths["broadcast"]
    code, out, err = cli(capsys, "dump", path, "-R", "4", "--param", "rot=1")
    assert (code, out) == (2, "")
    assert err == (
        f"{path}:2:1: error: broadcast has no parameter 'rot' (its parameters: root)\n"
        "    collective broadcast(root = 0) {\n"
        "    ^\n"
        "note: while checking broadcast for R=4, rot=1\n"
    )


@pytest.mark.parametrize("bad", ["root", "root=x", "=1", "1x=2"])
def test_malformed_param_is_a_usage_error(capsys, example_paths, bad):
    with pytest.raises(SystemExit) as info:
        main(["dump", str(example_paths["broadcast"]), "--param", bad])
    assert info.value.code == 2
    assert "argument --param/-p" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["dump", "x.pln", "-R", "0"], ["check", "x.pln", "-R", "5..2"],
                                  ["check", "x.pln", "-R", "0..3"], ["dump", "x.pln", "--stage", "nope"], []])
def test_bad_arguments_are_usage_errors(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "usage: purlinc" in capsys.readouterr().err


def test_check_spec_only(capsys, example_paths):
    code, out, _ = cli(capsys, "check", example_paths["alltoall"], "--spec-only", "-R", "1..16")
    assert (code, out) == (0, "alltoall: ok for R=1..16 (16 sizes): spec\n")
    code, out, _ = cli(capsys, "check", example_paths["pairwise_exchange"], "--spec-only", "-R", "1..8")
    assert (code, out) == (0, "pairwise_exchange: ok for R=2..8 (4 sizes) where R % 2 == 0: spec\n")
    code, out, _ = cli(capsys, "check", example_paths["gather"], "--spec-only", "-R", "3", "-p", "root=2")
    assert (code, out) == (0, "gather: ok for R=3: spec\n")


@pytest.mark.parametrize("options,named", [
    (["--gpus-per-node", "3"], "--gpus-per-node applies"),
    (["-a", "ring", "--channels", "2", "--packed"], "--algorithm, --channels, --packed apply"),
    (["--registered", "out", "--stage-copies", "1", "-j", "2"], "--registered, --stage-copies, --jobs apply"),
])
def test_check_spec_only_refuses_what_only_schedules_take(capsys, example_paths, options, named):
    """--spec-only verifies no schedule, so an option for them would be ignored without a word."""
    code, out, err = cli(capsys, "check", example_paths["allreduce"], "--spec-only", "-R", "1..8", *options)
    assert (code, out) == (2, "")
    assert err.startswith(f"error: {named} to the schedules, which --spec-only does not check\n"), err


@pytest.mark.parametrize("name", EXAMPLES)
def test_check_spec_only_every_example(capsys, example_paths, name):
    code, out, _ = cli(capsys, "check", example_paths[name], "--spec-only", "-R", "1..16")
    assert code == 0 and out.startswith(f"{name}: ok for R=")


def test_check_defaults_to_sizes_1_to_64(capsys, example_paths):
    code, out, _ = cli(capsys, "check", example_paths["allgather"], "--spec-only")
    assert (code, out) == (0, "allgather: ok for R=1..64 (64 sizes): spec\n")


def test_check_reports_the_failing_world_size(capsys, tmp_path):
    path = tmp_path / "shift.pln"
    path.write_text("collective shift {\n    in[r] = x[r]\n    out[r] = x[r + 1]\n    copy\n}\n")
    code, out, err = cli(capsys, "check", path, "--spec-only")
    assert (code, out) == (2, "")
    assert err == (
        f"{path}:3:14: error: output chunk x[1] of rank 0 has no producer: no input names it\n"
        "        out[r] = x[r + 1]\n"
        "                 ^^^^^^^^\n"
        "note: the inputs name 1 chunk called 'x': x[0]\n"
        "note: while checking shift for R=1\n"
    )


def test_check_where_excludes_every_size(capsys, example_paths):
    code, _, err = cli(capsys, "check", example_paths["pairwise_exchange"], "--spec-only", "-R", "3")
    assert code == 2
    assert err.startswith(f"{example_paths['pairwise_exchange']}:2:36: error: pairwise_exchange is defined for "
                          "no world size in 3..3\n")


def test_dump_outside_the_where_clause(capsys, example_paths):
    code, _, err = cli(capsys, "dump", example_paths["pairwise_exchange"], "-R", "3")
    assert code == 2
    assert "error: pairwise_exchange is not defined for R=3: it requires R % 2 == 0" in err


# --- files that are not valid specs ---------------------------------------------------------

def test_syntax_error(capsys, tmp_path):
    path = tmp_path / "bad.pln"
    path.write_text("collective bad {\n    in[r] = x[r]\n    out[r] = x[0..R]\n}\n")
    code, out, err = cli(capsys, "dump", path, "--stage", "ast")
    assert (code, out) == (2, "")
    assert err == (
        f"{path}:4:1: error: missing the operation: a collective ends with 'copy' or 'reduce'\n"
        "    }\n"
        "    ^\n"
    )


@pytest.mark.parametrize("content, message", [
    (b"", "error: the file is empty"),
    (b"  \n\n", "error: the file is empty"),
    (b"\x7fELF\x02\x01\x01\x00\x00", "f.pln:1:8: error: not a text file: it contains a NUL byte"),
    (b"collective \xc3\x28 {}", "f.pln:1:12: error: not UTF-8 text: byte 0xc3 (at byte offset 11)"),
])
def test_unusable_files(capsys, tmp_path, content, message):
    path = tmp_path / "f.pln"
    path.write_bytes(content)
    for command in (["dump", path], ["dump", path, "--stage", "ast"], ["check", path, "--spec-only"]):
        code, out, err = cli(capsys, *command)
        assert (code, out) == (2, ""), command
        assert message in err and "Traceback" not in err


def test_missing_file(capsys, tmp_path):
    code, _, err = cli(capsys, "dump", tmp_path / "nope.pln")
    assert (code, err) == (2, f"error: no such file: {tmp_path / 'nope.pln'}\n")


def test_debug_reraises(capsys, tmp_path, monkeypatch):
    from purlinc.errors import PurlinError

    monkeypatch.setenv("PURLIN_DEBUG", "1")
    with pytest.raises(PurlinError, match="no such file"):
        main(["dump", str(tmp_path / "nope.pln")])


def test_real_process_exits_2_without_traceback(tmp_path):
    path = tmp_path / "bad.pln"
    path.write_text("collective bad {\n    in[r] = x[r]\n    out[r] = y[0..N]\n    copy\n}\n")
    result = subprocess.run([sys.executable, "-m", "purlinc.cli", "dump", str(path), "-R", "2"],
                            capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "PURLIN_DEBUG"})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"{path}:3:19: error: unknown name 'N'\n") and "Traceback" not in result.stderr


# --- help ---------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, phrases", [
    ([], ["compile", "dump", "check", "docs/LANGUAGE.md", "purlinc dump examples/allreduce.pln"]),
    (["dump"], ["--stage", "ast (the parsed file)", "--param NAME=N", "--ranks N", "default 8", "--json"]),
    (["check"], ["--spec-only", "LO..HI with both ends included", "--param NAME=N", "where"]),
    (["compile"], ["--arch", "--output-dir", "Needs no GPU"]),
])
def test_help(capsys, argv, phrases):
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines where it likes
    for phrase in phrases:
        assert phrase in text, phrase
