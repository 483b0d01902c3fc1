"""Command-line options that do not apply, conflict or are out of range are refused (exit 2,
naming the option and what is allowed), never ignored, and never an internal error (exit 3)."""

from __future__ import annotations

import argparse
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


def test_check_with_slots_verifies_the_algorithms_that_use_them(capsys):
    """--slots without -a: the algorithms without slots would refuse it, so only ring is
    checked (as --packed checks the algorithms that pack)."""
    code, out, err = cli(capsys, "check", ALLGATHER, "-R", "1..8", "--slots", "8")
    assert code == 0 and "spec and 8 schedules verified" in out, err


def test_check_with_two_stage_copies_verifies_the_algorithms_that_lower_two(capsys):
    """ring and two-shot lower to one copy: counted as verified with --stage-copies 2, they were
    verified without it (as --slots checks only the algorithms with slots)."""
    code, out, err = cli(capsys, "check", ALLREDUCE, "-R", "2..4", "--stage-copies", "2")
    assert code == 0 and "spec and 3 schedules verified" in out, err  # direct-push alone, R=2, 3, 4
    code, out, err = cli(capsys, "check", ALLREDUCE, "-R", "2..4", "--stage-copies", "1")
    assert code == 0 and "spec and 12 schedules verified" in out, err  # every algorithm takes one copy


def test_check_with_registered_outputs_verifies_the_algorithms_an_epilogue_can_run_on(capsys, tmp_path):
    """With registered outputs ring and two-shot write a rank's output from its peers, which an
    epilogue cannot run on: check stopped at two-shot with that error, so the shipped fused
    example could not be checked with --registered out without naming -a."""
    fused = EXAMPLES / "fused" / "allreduce_add_rmsnorm.pln"
    code, out, err = cli(capsys, "check", fused, "-R", "2..4", "--registered", "out")
    assert code == 0 and "spec and 6 schedules verified" in out, err  # direct-push and direct-pull, R=2, 3, 4
    err = refused(capsys, "check", fused, "-R", "2", "--registered", "out", "-a", "ring")  # asked for by name
    assert "an epilogue needs outputs no peer writes" in err and "(direct-push, direct-pull)" in err, err
    code, out, err = cli(capsys, "check", ALLREDUCE, "-R", "2..4", "--registered", "out")
    assert code == 0 and "spec and 12 schedules verified" in out, err  # no epilogue: every algorithm
    # a reduce-scatter's ring leaves each rank's output to it: verified as compile would make it
    rs = tmp_path / "rs.pln"
    rs.write_text("collective rs with scalar s {\n  in[r] = x[0..R]\n  out[r] = x[r]\n  reduce\n"
                  "  epilogue rows(64) { out = out * s }\n}\n")
    code, out, err = cli(capsys, "check", rs, "-R", "1..4", "--registered", "out")
    assert code == 0 and "spec and 12 schedules verified" in out, err  # direct-push, direct-pull and ring


def test_check_with_an_algorithm_says_the_sizes_it_does_not_apply_to(capsys):
    """-a two-shot over R=1..3 said "ok for R=1..3": two-shot does not apply at R=1, where
    compile then refused it.  The sizes without a schedule are named."""
    code, out, err = cli(capsys, "check", ALLREDUCE, "-R", "1..3", "-a", "two-shot")
    assert code == 0, err
    assert out == ("allreduce: ok for R=1..3 (3 sizes): spec and 2 schedules verified (two-shot does not apply at "
                   "R=1: no schedule there)\n")


def test_check_refuses_jobs_for_hierarchical_plans(capsys):
    assert refused(capsys, "check", ALLREDUCE, "-R", "8", "--gpus-per-node", "4", "-j", "2") == (
        "error: --jobs 2 applies to flat schedules: the hierarchical plans of --gpus-per-node are verified in one "
        "process\nnote: drop --jobs\n")


SLOTS_NOT_DIRECT_PUSH = ("error: --slots {n} does not apply to direct-push (the spec's default algorithm): it gives "
                         "every message its own staging unit\n"
                         "note: --slots applies to ring (pick one with -a), or leave --slots out\n")


@pytest.mark.parametrize("argv, why", [
    # no algorithm both packs (direct-push) and stages through slots (ring)
    ([ALLREDUCE, "-R", "1..4", "--packed", "--slots", "1"],
     "--packed and --slots 1 leave no algorithm to verify at R=1..4"),
    ([ALLGATHER, "-R", "2..4", "--packed", "--slots", "2"],
     "--packed and --slots 2 leave no algorithm to verify at R=2..4"),
    # ring does not lower run-time sizes
    ([ALLTOALLV, "-R", "2..4", "--slots", "3"], "--slots 3 leaves no algorithm to verify at R=2..4"),
])
def test_check_refuses_options_that_leave_no_schedule(capsys, argv, why):
    """Printed "ok ... 0 schedules verified" (exit 0) where dump and compile refuse the options:
    refused in dump's words, with what left nothing to verify."""
    slots = argv[argv.index("--slots") + 1]
    assert refused(capsys, "check", *argv) == SLOTS_NOT_DIRECT_PUSH.format(n=slots) + f"note: {why}\n"
    assert refused(capsys, "dump", *argv[:2], argv[2].split("..")[-1], "-s", "snac", *argv[3:]) == \
        SLOTS_NOT_DIRECT_PUSH.format(n=slots)


def test_check_with_no_applicable_algorithm_is_refused(capsys, monkeypatch):
    """Where the registry leaves nothing to verify and the lowering takes the options, the
    registry's word stands: there is no schedule to verify."""
    from purlinc.snac import algorithms

    monkeypatch.setattr(algorithms, "applicable", lambda spec: ())
    assert refused(capsys, "check", ALLGATHER, "-R", "2..3") == \
        "error: no algorithm applies to R=2..3: there is no schedule to verify\n"


def test_check_never_reports_ok_for_no_schedule_verified(capsys, monkeypatch):
    """Whatever the cause, a check that verified no schedule is not a pass."""
    from purlinc.cli import check

    monkeypatch.setattr(check, "_verify_schedules", lambda *args: 0)
    err = refused(capsys, "check", ALLGATHER, "-R", "2..3")
    assert err == ("error: no schedule was verified for R=2..3 (2 sizes): there is nothing to report as ok\n"
                   "note: check the spec alone with --spec-only\n")
    code, out, err = cli(capsys, "check", ALLGATHER, "-R", "2..3", "--spec-only")
    assert code == 0 and out == "allgather: ok for R=2..3 (2 sizes): spec\n", err


# ---- draw: sizes and widths ---------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--width", "100"], "argument --width: expected a width of 400 to 100,000 pixels, got 100"),
    # a page of 10^9 pixels was blank in a browser; a 400-digit count failed in float arithmetic
    (["--width", "1000000000"], "argument --width: expected a width of 400 to 100,000 pixels, got 1000000000"),
    (["--count", "1" + "0" * 400], "argument --count: expected at most 1,099,511,627,776 elements per chunk, got "
                                   "10000000000000000000... (401 digits)"),
    (["--bytes", "2048GiB"], "argument --bytes: expected a size of at most 1TiB, got '2048GiB'"),
    (["--width", "0"], "argument --width: expected a positive integer, got 0"),
    (["--count", "0"], "argument --count: expected a positive integer, got 0"),
    (["--count", "-3"], "argument --count: expected a positive integer, got -3"),
    (["--bytes", "0"], "argument --bytes: expected a size of at least 1 byte, got '0'"),
    (["--bytes", "1MiB", "--count", "10"], "argument --count: not allowed with argument --bytes"),
    (["--bytes", "2TiB"], "argument --bytes: expected a size of at most 1TiB, got '2TiB'"),
    # 2^40 elements per chunk is within --count's own bound, but two chunks of bfloat16 make 4 TiB
    (["--count", str(1 << 40)], "count=1099511627776: 2 chunk(s) of 2,199,023,255,552 B make a 4,398,046,511,104 B "
                                "message, more than 1,099,511,627,776 (1 TiB)"),
])
def test_draw_refuses_bad_sizes(capsys, argv, message):
    assert message in refused(capsys, "draw", ALLREDUCE, "-R", "2", "--timeline", *argv)


def test_width_at_the_minimum_draws_time_forwards(capsys):
    import xml.etree.ElementTree as ET

    code, out, err = cli(capsys, "draw", ALLREDUCE, "-R", "2", "--timeline", "--width", "400")
    assert code == 0, err
    steps = [g for g in ET.fromstring(out).iter("{http://www.w3.org/2000/svg}g") if g.get("class") == "step"]
    rects = [g.find("{http://www.w3.org/2000/svg}rect") for g in steps]
    assert rects and all(float(r.get("x")) >= 170 and float(r.get("width")) > 0 for r in rects)


def test_scale_is_clamped_for_callers_of_render():
    from purlinc.draw import svg
    from purlinc.draw.render import Request, panels_for

    panels = panels_for(Request(file=ALLREDUCE, world_size=2, timeline=True))
    clamped = svg._scale(panels, 10)
    assert clamped == svg._scale(panels, svg.MIN_WIDTH) and clamped.px > 0


@pytest.mark.parametrize("argv, chunk", [(["--bytes", "1TiB"], "549755813888 B per chunk"),
                                          (["--count", str(1 << 38)], "549755813888 B per chunk")])
def test_a_timeline_of_a_1_tib_message_is_drawn(capsys, argv, chunk):
    code, out, err = cli(capsys, "draw", ALLREDUCE, "-R", "2", "--timeline", *argv)
    assert code == 0, err
    assert chunk in out


def test_timeline_chunk_is_whole_elements(capsys):
    code, out, err = cli(capsys, "draw", ALLTOALLV, "-R", "3", "--timeline")
    assert code == 0, err
    assert "21844 B per chunk (bfloat16)" in out  # 64 KiB / 3 units = 21845.3 B: 10922 elements


def test_timeline_chunk_is_at_least_one_element(capsys):
    code, out, err = cli(capsys, "draw", ALLREDUCE, "-R", "8", "--timeline", "--bytes", "3", "--dtype", "float32")
    assert code == 0, err
    assert "4 B per chunk (float32)" in out


@pytest.mark.parametrize("argv", [["--width", "600"], ["--bytes", "1KiB"], ["--count", "4"], ["--dtype", "float32"]])
def test_timeline_options_need_a_timeline(capsys, argv):
    err = refused(capsys, "draw", ALLREDUCE, "-R", "2", *argv)
    assert f"{argv[0]} applies to a timeline" in err


# ---- draw: options that do not go together ------------------------------------------------

def test_draw_compare_refuses_an_algorithm(capsys):
    err = refused(capsys, "draw", ALLREDUCE, "-R", "4", "--compare", "ring,two-shot", "-a", "direct-pull")
    assert "-a direct-pull would be ignored" in err


@pytest.mark.parametrize("text", [",", "", "ring,,two-shot", " , "])
def test_draw_compare_refuses_an_empty_name(capsys, text):
    err = refused(capsys, "draw", ALLREDUCE, "-R", "4", "--compare", text)
    assert f"--compare {text!r}: expected algorithms separated by commas" in err


@pytest.mark.parametrize("argv, flag", [
    (["--all-channels"], "--all-channels"), (["--width", "500"], "--width"), (["--bytes", "1MiB"], "--bytes"),
    (["--count", "8"], "--count"), (["--dtype", "float32"], "--dtype"), (["--timeline"], "--timeline"),
])
def test_draw_plan_refuses_what_does_not_apply(capsys, argv, flag):
    err = refused(capsys, "draw", ALLREDUCE, "-R", "4", "--gpus-per-node", "2", *argv)
    assert f"--gpus-per-node draws the plan's phases, not steps: {flag} given, but" in err and "not apply" in err


def test_draw_plan_still_draws(capsys):
    code, out, err = cli(capsys, "draw", ALLREDUCE, "-R", "4", "--gpus-per-node", "2")
    assert code == 0 and out.startswith("<svg"), err


# ---- compile and dump ---------------------------------------------------------------------

def test_unknown_op_is_refused_for_a_copy_collective(capsys, tmp_path):
    err = refused(capsys, "compile", ALLGATHER, "-R", "2", "--op", "bogus", "-o", tmp_path / "out")
    assert "unknown reduce op 'bogus'; expected one of sum, prod, max, min" in err
    assert not (tmp_path / "out").exists()  # refused before the output directory is made
    err = refused(capsys, "dump", ALLGATHER, "-R", "2", "-s", "cuda", "--op", "bogus")
    assert "unknown reduce op 'bogus'" in err


@pytest.mark.parametrize("stage", ["ast", "spec", "snac"])
def test_dump_checks_the_target_at_every_stage(capsys, stage):
    ranks = () if stage == "ast" else ("-R", "2")  # ast takes none (test_dump_ast_refuses_ranks_it_would_not_use)
    err = refused(capsys, "dump", ALLGATHER, *ranks, "-s", stage, "--arch", "bogus")
    assert "unknown target architecture 'bogus'" in err and "sm_90" in err


@pytest.mark.parametrize("stage", ["ast", "cuda"])
def test_dump_json_only_for_spec_and_snac(capsys, stage):
    err = refused(capsys, "dump", ALLGATHER, "-R", "2", "-s", stage, "--json")
    assert f"--json applies to --stage spec and snac, not --stage {stage}" in err


@pytest.mark.parametrize("stage", ["ast", "spec", "cuda"])
def test_dump_gpus_per_node_only_for_snac(capsys, stage):
    err = refused(capsys, "dump", ALLGATHER, "-R", "4", "-s", stage, "--gpus-per-node", "2")
    assert f"--gpus-per-node applies to --stage snac, not --stage {stage}" in err


@pytest.mark.parametrize("stage", ["ast", "spec"])
def test_dump_lowering_options_only_where_a_schedule_is_made(capsys, stage):
    """Read at --stage snac and cuda only; earlier stages accepted even what lowering refuses
    (--channels 5000, --packed on an all-gather with two-shot) and printed as if asked."""
    err = refused(capsys, "dump", ALLGATHER, "-R", "2", "-s", stage, "--algorithm", "two-shot", "--channels", "5000",
                  "--packed")
    assert f"--algorithm, --channels, --packed apply to --stage snac and cuda, not --stage {stage}" in err
    err = refused(capsys, "dump", ALLGATHER, "-R", "2", "-s", stage, "--stage-copies", "2")
    assert f"--stage-copies applies to --stage snac and cuda, not --stage {stage}" in err


def test_dump_params_not_at_the_parsed_stage(capsys):
    err = refused(capsys, "dump", ALLGATHER, "-s", "ast", "--param", "nope=3")
    assert "--param applies to --stage spec, snac and cuda, not --stage ast" in err


@pytest.mark.parametrize("command", ["compile", "dump", "check", "draw"])
def test_two_stage_copies_name_the_algorithm(capsys, tmp_path, command):
    extra = {"compile": ["-o", tmp_path / "out"], "dump": ["-s", "snac"]}.get(command, [])
    err = refused(capsys, command, ALLGATHER, "-R", "2", "-a", "ring", "--stage-copies", "2", *extra)
    assert "--stage-copies 2 does not apply to ring: it lowers to 1 staging copy" in err
    assert "two staging copies apply to direct-push only" in err


@pytest.mark.parametrize("command", ["compile", "dump", "check", "draw"])
def test_one_stage_copy_is_refused_for_run_time_sizes(capsys, tmp_path, command):
    """Sized schedules always run two copies: --stage-copies 1 was dropped without a word."""
    extra = {"compile": ["-o", tmp_path / "out"], "dump": ["-s", "snac"], "draw": ["-o", tmp_path / "d.svg"]}
    err = refused(capsys, command, EXAMPLES / "sized" / "alltoallv.pln", "-R", "2", "--stage-copies", "1",
                  *extra.get(command, []))
    assert ("--stage-copies 1 does not apply to a collective with run-time sizes: its schedules always run two "
            "staging copies") in err


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


@pytest.mark.parametrize("command, flag", [("compile", "-o/--output-dir"), ("draw", "-o/--output")])
def test_an_empty_output_path_is_refused(capsys, tmp_path, monkeypatch, command, flag):
    monkeypatch.chdir(tmp_path)
    err = refused(capsys, command, ALLGATHER, "-R", "2", "-o", "")
    assert f"argument {flag}: expected a path, got an empty string" in err
    assert not list(tmp_path.iterdir())  # nothing written to ./purlin-out or anywhere


@pytest.mark.parametrize("command", ["compile", "dump", "check", "draw"])
def test_an_empty_input_path_is_refused(capsys, tmp_path, monkeypatch, command):
    """`purlinc dump "$SPEC"` with SPEC unset: Path('') is '.', which was reported as ". is a
    directory, not a .pln file", naming a path the command line does not hold."""
    monkeypatch.chdir(tmp_path)
    err = refused(capsys, command, "")
    assert "argument file: expected a path, got an empty string" in err
    assert ". is a directory" not in err


def test_purlin_out_is_ignored_by_git():
    assert "purlin-out/" in (REPO / ".gitignore").read_text().split()


def test_packed_with_one_staging_copy_is_refused(capsys):
    """Packed (LL) schedules always run two copies: --stage-copies 1 would be ignored."""
    err = refused(capsys, "dump", str(EXAMPLES / "allreduce.pln"), "-R", "2", "-s", "snac", "--packed",
                  "--stage-copies", "1")
    assert "--stage-copies 1 does not apply to --packed" in err


def test_an_unknown_dtype_in_draw_is_one_error_not_two(capsys):
    err = refused(capsys, "draw", str(EXAMPLES / "allreduce.pln"), "-R", "2", "--timeline", "--dtype", "bogus",
                  "-o", "/tmp/never-written.svg")
    assert err.startswith("error: unknown dtype 'bogus'") and "error: error:" not in err


# ---- compile and dump: what the code generator refuses, refused with the spec ----------------

FP8_REDUCE = ("error: --dtype float8_e4m3: float8_e4m3 cannot be reduced, and the collective {name} is a reduction\n"
              "note: a reduction takes float32, float16, bfloat16, int32, int64; fp8 is supported for copies only\n")
SIZED_TMA = ("error: run-time sizes run on the 'ldst' atom only, not 'tma'\n"
             "note: the sized kernels are generated for ldst only: their copy loops take bounds read on the device\n"
             "note: use the ldst atom (--atom ldst, or atom=\"ldst\")\n")
RS2 = "collective rs2(k = 3) {\n    in[r]  = x[0..R][0..k]\n    out[r] = x[r][0..k]\n    reduce\n}\n"


def test_compile_refuses_fp8_for_a_reduction_with_one_note(capsys, tmp_path):
    """Both the generator ("while generating rs2") and the pipeline ("while generating rs2's
    float8_e4m3 kernels for R=3") added a note; compile now refuses the dtype with the spec."""
    source = tmp_path / "rs2.pln"
    source.write_text(RS2)
    err = refused(capsys, "compile", source, "-R", "3", "--dtype", "float8_e4m3", "-o", tmp_path / "out")
    assert err == FP8_REDUCE.format(name="rs2")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stage", ["spec", "snac", "cuda"])
def test_dump_refuses_a_dtype_a_reduction_cannot_reduce(capsys, stage):
    """--stage snac printed a schedule compile refuses to make a kernel of."""
    err = refused(capsys, "dump", str(EXAMPLES / "reduce.pln"), "-R", "3", "-s", stage, "--dtype", "float8_e4m3")
    assert err == FP8_REDUCE.format(name="reduce")


def test_dump_takes_fp8_for_a_copy_and_at_the_parsed_stage(capsys):
    """fp8 is for copies; at --stage ast no spec is resolved, and the name alone is checked."""
    for argv in ([ALLGATHER, "-R", "3", "-s", "snac"], [str(EXAMPLES / "reduce.pln"), "-s", "ast"]):
        code, out, err = cli(capsys, "dump", *argv, "--dtype", "float8_e4m3")
        assert code == 0 and out, err


@pytest.mark.parametrize("command", [["dump", "-s", "spec"], ["dump", "-s", "snac"], ["dump", "-s", "cuda"],
                                     ["compile"]])
def test_run_time_sizes_refuse_the_tma_atom(capsys, tmp_path, command):
    """--stage snac printed a schedule for --atom tma, which compile refuses for run-time sizes."""
    extra = ["-o", tmp_path / "out"] if command == ["compile"] else []
    assert refused(capsys, *command, ALLTOALLV, "-R", "2", "--atom", "tma", *extra) == SIZED_TMA


@pytest.mark.parametrize("argv, flag", [([], "the default dtype bfloat16 (--dtype)"),
                                        (["--dtype", "bf16"], "--dtype bf16")])
@pytest.mark.parametrize("command", [["dump", "-s", "cuda"], ["compile"]])
def test_epilogue_rows_name_the_dtype_as_given(capsys, tmp_path, command, argv, flag):
    """Rows of 4 run in float32 only: without --dtype the default is named as the default."""
    source = _rows_of_four(tmp_path)
    extra = ["-o", tmp_path / "out"] if command == ["compile"] else []
    err = refused(capsys, *command, source, "-R", "2", *argv, *extra)
    assert err.startswith(f"{source}:5:17: error: {flag}: a row of 4 bfloat16 elements is 8 bytes, not a multiple "
                          "of 16 (the kernels move 16-byte vectors)\n"), err
    code, out, err = cli(capsys, "dump", source, "-R", "2", "-s", "snac", "--dtype", "float32")
    assert code == 0, err


def _rows_of_four(tmp_path):
    source = tmp_path / "four.pln"
    source.write_text("collective four(hidden = 4) {\n  in[r] = x\n  out[r] = x\n  reduce\n"
                      "  epilogue rows(hidden) { out = out * 2.0 }\n}\n")
    return source


@pytest.mark.parametrize("stage", ["spec", "snac"])
def test_a_spec_whose_rows_only_float32_meets_dumps_without_a_dtype(capsys, tmp_path, stage):
    """LANGUAGE.md calls such a spec valid (a kernel for another dtype is refused): its spec
    and schedule, which no dtype changes, were refused for the default bfloat16 nobody chose."""
    source = _rows_of_four(tmp_path)
    code, out, err = cli(capsys, "dump", source, "-R", "2", "-s", stage)
    assert code == 0 and out, err
    err = refused(capsys, "dump", source, "-R", "2", "-s", stage, "--dtype", "bf16")  # chosen: refused
    assert err.startswith(f"{source}:5:17: error: --dtype bf16: a row of 4 bfloat16 elements is 8 bytes"), err


# ---- check --ranks: a range past the limit --------------------------------------------------

@pytest.mark.parametrize("ranks", ["1..9999999999999999999999999999", "9999999999999999999999999998..9999999999999999999999999999"])
def test_check_refuses_a_range_past_the_largest_world_size(capsys, ranks):
    # len() of such a range overflows a C ssize_t: it was an internal error (exit 3)
    err = refused(capsys, "check", ALLGATHER, "--ranks", ranks)
    assert err == "error: the world size 9,999,999,999,999,999,999,999,999,999 is larger than Purlin supports (65,536)\n"


# ---- --op: a reduction's, refused where nothing would read it ------------------------------

@pytest.mark.parametrize("argv, message", [
    (["compile", ALLGATHER, "-R", "2", "--op", "max"], "error: --op applies to reduce collectives; allgather is a copy"),
    (["dump", ALLGATHER, "-R", "2", "-s", "cuda", "--op", "max"],
     "error: --op applies to reduce collectives; allgather is a copy"),
    (["dump", ALLREDUCE, "-R", "2", "-s", "snac", "--op", "max"], "error: --op applies to --stage cuda, not --stage snac"),
    (["dump", ALLREDUCE, "-R", "2", "-s", "cuda", "--op", "mean"], "mean"),
])
def test_op_where_nothing_reads_it_is_refused(capsys, argv, message):
    assert message in refused(capsys, *argv)


def test_op_defaults_to_sum_and_is_taken_on_a_reduction(capsys, tmp_path):
    import json

    for op, want in ((None, "sum"), ("max", "max")):
        given = ["--op", op] if op else []
        code, out, err = cli(capsys, "compile", ALLREDUCE, "-R", "2", "-o", str(tmp_path / want), *given)
        assert code == 0, err
        manifest = next((tmp_path / want).glob("*.manifest.json"))
        assert json.loads(manifest.read_text())["op"] == want


@pytest.mark.parametrize("argv, message", [
    (["-R", "1_000"], "argument --ranks/-R: expected a positive integer, got '1_000'"),
    (["-R", "\u0663"], "argument --ranks/-R: expected a positive integer, got '\u0663'"),  # an Arabic-Indic 3
    (["-R", " 3"], "argument --ranks/-R: expected a positive integer, got ' 3'"),
    (["-R", "3", "--param", "root=1_0"], "argument --param/-p: parameter root: '1_0' is not an integer"),
    (["-R", "3", "--param", "root= 1"], "argument --param/-p: parameter root: ' 1' is not an integer"),
])
def test_integers_are_written_as_in_a_pln_file(capsys, argv, message):
    """int() takes "1_000", " 3" and other scripts' digits; a .pln file does not, nor does the CLI."""
    assert message in refused(capsys, "dump", BROADCAST, *argv)


def test_compare_refuses_an_algorithm_named_twice(capsys):
    err = refused(capsys, "draw", ALLREDUCE, "-R", "2", "--compare", "ring,direct-push,ring")
    assert "--compare 'ring,direct-push,ring': ring named twice; name each algorithm once" in err


# ---- --slots where the algorithm has none ------------------------------------------------

@pytest.mark.parametrize("argv, algorithm", [
    (["dump", ALLGATHER, "-R", "4", "-s", "snac", "--slots", "2"], "direct-push (the spec's default algorithm)"),
    (["dump", ALLGATHER, "-R", "4", "-s", "cuda", "--slots", "2", "-a", "direct-pull"], "direct-pull"),
    (["compile", ALLGATHER, "-R", "4", "--slots", "2"], "direct-push (the spec's default algorithm)"),
    (["check", ALLGATHER, "-R", "2..4", "--slots", "2", "-a", "direct-push"], "direct-push"),
    (["draw", ALLGATHER, "-R", "4", "--slots", "2"], "direct-push"),
])
def test_slots_are_refused_where_the_algorithm_has_none(capsys, tmp_path, monkeypatch, argv, algorithm):
    """Direct-push, direct-pull and two-shot give every message its own unit: --slots N went
    into the options' key (and the kernel's name) and changed nothing else."""
    monkeypatch.chdir(tmp_path)
    err = refused(capsys, *argv)
    assert err.startswith(f"error: --slots 2 does not apply to {algorithm}: it gives every message its own "
                          "staging unit\nnote: --slots applies to ring"), err
    assert list(tmp_path.iterdir()) == []  # compile wrote nothing, made no purlin-out


def test_slots_on_ring_and_in_a_comparison_with_ring(capsys):
    code, out, err = cli(capsys, "dump", ALLGATHER, "-R", "4", "-s", "snac", "--slots", "2", "-a", "ring")
    assert code == 0 and "slots 2" in out, err
    code, out, err = cli(capsys, "draw", ALLGATHER, "-R", "3", "--slots", "2", "--compare", "ring,direct-push")
    assert code == 0 and out.startswith("<svg"), err
    err = refused(capsys, "draw", ALLGATHER, "-R", "3", "--slots", "2", "--compare", "direct-pull,direct-push")
    assert err == ("error: --slots 2 does not apply to direct-pull, direct-push: they give every message its own "
                   "staging unit\nnote: --slots applies to ring (pick one with -a or --compare), or leave --slots out\n")


# ---- --arch and --atom are named in their errors -----------------------------------------

@pytest.mark.parametrize("arch", ["sm_75", "SM_90", "compute_90", "sm_999", ""])
def test_a_bad_arch_names_the_flag(capsys, arch):
    err = refused(capsys, "dump", ALLGATHER, "-R", "2", "--arch", arch)
    assert err.startswith(f"error: --arch: unknown target architecture {arch!r}\nnote: expected sm_NN"), err


def test_an_atom_the_arch_lacks_names_both_flags(capsys):
    err = refused(capsys, "dump", ALLGATHER, "-R", "2", "-s", "cuda", "--atom", "tma", "--arch", "sm_80")
    assert err == "error: --atom tma needs sm_90 or newer, not --arch sm_80\nnote: atoms for sm_80: ldst\n"


def test_a_spec_refused_at_the_default_world_size_says_it_was_the_default(capsys, tmp_path):
    """"small is not defined for R=8" read as if 8 had been asked for; given -R 8, no note."""
    source = tmp_path / "small.pln"
    source.write_text("collective small where R <= 4 {\n  in[r] = x[r]\n  out[r] = x[0..R]\n  copy\n}\n")
    note = "note: --ranks not given: R=8 is the default (choose one with --ranks N)"
    for argv in (["dump", source], ["compile", source, "-o", tmp_path / "out"]):
        err = refused(capsys, *argv)
        assert "error: small is not defined for R=8: it requires R <= 4" in err and err.rstrip().endswith(note), err
        assert note not in refused(capsys, *argv, "-R", "8")
    code, out, err = cli(capsys, "dump", source, "-R", "2")
    assert code == 0 and out.startswith("collective small (R=2, copy)"), err


def test_compile_refuses_gpus_per_node_saying_where_plans_are_made(capsys, tmp_path):
    """argparse's "unrecognized arguments" came under the top-level usage."""
    err = refused(capsys, "compile", str(EXAMPLES / "allreduce.pln"), "-R", "8", "--gpus-per-node", "4",
                  "-o", tmp_path / "out")
    assert err.startswith("error: --gpus-per-node 4: compile writes one flat collective's kernels; a hierarchical "
                          "plan is made when it is loaded\nnote: purlinc.load(path, None, gpus_per_node=G)"), err
    assert not (tmp_path / "out").exists()


def test_compile_states_its_default_world_size_and_it_is_the_apis():
    from purlinc import pipeline
    from purlinc.cli import compile as compile_cli

    assert compile_cli.DEFAULT_RANKS == pipeline.DEFAULT_WORLD_SIZE
    from purlinc.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert "world size (number of ranks); default 8" in " ".join(commands.choices["compile"].format_help().split())


def test_dump_ast_refuses_ranks_it_would_not_use(capsys):
    assert refused(capsys, "dump", ALLGATHER, "-s", "ast", "-R", "5") == \
        "error: --ranks 5 applies to --stage spec, snac and cuda, not --stage ast\n"


def test_check_counts_one_schedule_in_the_singular(capsys):
    """"spec and 1 schedules verified"."""
    assert main(["check", str(EXAMPLES / "allreduce.pln"), "-R", "3", "--packed"]) == 0
    assert capsys.readouterr().out == "allreduce: ok for R=3: spec and 1 schedule verified\n"
