"""The front end never crashes: mutated examples and random token streams end in success or
a ``PurlinError`` (rendered without failing), never another exception.  A few seconds here;
scripts/fuzz.py runs the same check over 100,000+ inputs."""

from __future__ import annotations

import importlib.util
import random
import time
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from purlinc.errors import PurlinError
from purlinc.frontend.check import check
from purlinc.frontend.parse import parse

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("purlin_fuzz", REPO / "scripts" / "fuzz.py")
fuzz = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz)

SEEDS = fuzz.examples()


@settings(max_examples=120)
@given(st.sampled_from(SEEDS), st.randoms(use_true_random=False))
def test_mutated_examples(seed, rng):
    assert fuzz.run_one(fuzz.mutate(seed, rng)) in ("ok", "error")


@settings(max_examples=120)
@given(st.lists(st.sampled_from(fuzz.TOKENS), max_size=40), st.booleans())
def test_token_streams(tokens, framed):
    text = " ".join((["collective", "a", "{"] if framed else []) + tokens + (["copy", "}"] if framed else []))
    assert fuzz.run_one(text.encode()) in ("ok", "error")


@settings(max_examples=60)
@given(st.binary(max_size=200))
def test_arbitrary_bytes(data):
    assert fuzz.run_one(data) in ("ok", "error")


def test_the_fuzzer_runs_clean(tmp_path):
    # The long run's own driver, briefly: counts come out and the exit status is 0.
    out = tmp_path / "counts.json"
    assert fuzz.main(["--count", "100", "--seed", "3", "--out", str(out), "--crash-dir", str(tmp_path)]) == 0
    assert '"crashes": 0' in out.read_text()


# --- the cases that used to crash or take minutes, each with a bound on the time taken -----

def _timed(text: str, world_size: int = 2, limit: float = 5.0) -> PurlinError | None:
    began = time.monotonic()
    try:
        check(parse(text, "t.pln"), world_size)
        error = None
    except PurlinError as caught:
        error = caught
        error.render()
    assert time.monotonic() - began < limit
    return error


def _with(expr: str) -> str:
    return f"collective a {{\n  in[r] = x[r]\n  out[r] = x[{expr}]\n  copy\n}}\n"


def test_a_flat_sum_of_500_terms():
    assert _timed(_with("+".join(["0"] * 500) + "+r")) is None


def test_500_nested_unary_minuses():
    assert _timed(_with("-" * 500 + "r")) is None
    quoted = "-" * 57 + "..."  # the expression as written, cut short
    assert _timed(_with("-" * 501 + "r")).message == f"index '{quoted}' is -1, out of bounds (chunk indices start at 0)"


def test_deep_parentheses():
    assert _timed(_with("(" * 5000 + "r" + ")" * 5000)) is None


def test_thousand_nested_loops_are_iterative():
    loops = " ".join(f"for v{i} in 0..1" for i in range(1000))
    assert _timed(f"collective a {{ in[r] = x[r] out[r] = x[r] {loops} copy }}") is None


def test_a_huge_range_is_counted_not_built():
    error = _timed("collective a {\n  in[r] = x[r]\n  out[r] = y[0..1000000000000]\n  copy\n}\n", limit=1.0)
    assert error.render().splitlines() == [
        "t.pln:3:12: error: 'y[0..1000000000000]' names 1,000,000,000,000 chunks, more than this spec may name "
        "at R=2 (at most 524,288 chunks over all ranks' layouts; 2 named before it)",
        "      out[r] = y[0..1000000000000]",
        "               ^^^^^^^^^^^^^^^^^^^",
        "note: while checking a for R=2",
    ]


def test_a_huge_loop_is_refused_before_it_runs():
    error = _timed("collective a {\n  in[r] = x[r]\n  out[r] = x[i] for i in 0..R*1000000000\n  copy\n}\n", limit=1.0)
    assert error.message == ("'for i in 0..R*1000000000' names at least 2,000,000,000 chunks, more than this spec "
                             "may name at R=2 (at most 524,288 chunks over all ranks' layouts; 2 named before it)")


def test_huge_products_are_out_of_range():
    error = _timed(_with("*".join(["R"] * 200)), limit=1.0)
    quoted = "R*" * 28 + "R..."  # the first partial product past 2**63 (64 factors), cut short
    assert error.message == f"'{quoted}' is out of range: its value exceeds 9223372036854775807 in magnitude"


def test_a_literal_too_long_for_python():
    error = _timed(_with("9" * 5000), limit=1.0)
    assert error.render().splitlines()[0] == (
        "t.pln:3:14: error: number 999999999999...999999 (5000 digits) is too large (at most 9223372036854775807)"
    )


def test_a_20kb_line_is_not_echoed_whole():
    error = _timed(_with("r") .replace("x[r]\n  copy", "x[r], " + "x[r], " * 3500 + "y[r]\n  copy"))
    lines = error.render().splitlines()
    assert lines[0] == "t.pln:3:21018: error: output chunk y[0] of rank 0 has no producer: no input names it"
    assert len(lines[1]) < 200 and lines[1].startswith("    ...") and lines[1].endswith("x[r], y[r]")
    assert lines[2] == " " * (len(lines[1]) - 4) + "^^^^"


def test_a_huge_world_size():
    error = _timed(_with("r"), world_size=10**12, limit=1.0)
    assert error.message == "the world size 1,000,000,000,000 is larger than Purlin supports (65,536)"


@pytest.mark.parametrize("seed", range(3))
def test_random_mutations_of_every_example(seed):
    rng = random.Random(seed)
    for data in SEEDS:
        for _ in range(6):
            assert fuzz.run_one(fuzz.mutate(data, rng)) in ("ok", "error")


# --- found by scripts/fuzz.py (seed 13): parameter values were not bounded -------------------

def test_a_parameter_default_too_long_for_python():
    error = _timed("collective s(shift = " + "9" * 5000 + ") {\n  in[r] = x[r]\n  out[r] = x[r]\n  copy\n}\n", limit=1.0)
    assert error.render().splitlines()[0] == (
        "t.pln:1:22: error: number 999999999999...999999 (5000 digits) is too large (at most 9223372036854775807)"
    )


def test_a_huge_parameter_range_is_counted_without_len():
    text = "collective b(k = 9223372036854775807) {\n  in[r] = x[r][0..k]\n  out[r] = x[r][0..k]\n  copy\n}\n"
    assert _timed(text, limit=1.0).message.startswith(
        "'x[r][0..k]' names 9,223,372,036,854,775,807 chunks, more than this spec may name at R=2")


def test_a_parameter_given_out_of_range():
    definition = parse("collective b(k = 1) {\n  in[r] = x[r][0..k]\n  out[r] = x[r][0..k]\n  copy\n}\n", "t.pln")
    with pytest.raises(PurlinError) as caught:
        check(definition, 2, {"k": 10**30})
    assert caught.value.message == ("parameter 'k' = 100000...000000 (31 digits) is out of range "
                                    "(at most 9223372036854775807 in magnitude)")
    with pytest.raises(PurlinError) as caught:  # 10**400: not 401 digits in the message and again in its note
        check(definition, 2, {"k": -(10**400) - 7})
    assert caught.value.message.startswith("parameter 'k' = -100000...000007 (401 digits) is out of range")
    assert caught.value.notes == ("while checking b for R=2, k=-100000...000007 (401 digits)",)
    with pytest.raises(PurlinError) as caught:  # up to 24 digits, in full
        check(definition, 2, {"k": 10**23})
    assert caught.value.message.startswith("parameter 'k' = 100000000000000000000000 is out of range")


def test_the_work_meter_stops_a_check_and_says_what_to_do():
    from purlinc.frontend.check import Meter, check_all

    definition = parse(_with("r" + "+0" * 50), "t.pln")
    with pytest.raises(PurlinError) as caught:
        check(definition, 4, meter=Meter(100))
    assert caught.value.render().splitlines() == [
        "t.pln:3:14: error: this spec takes too much work to check: more than 100 steps (expression steps, "
        "8 per chunk reference evaluated and one per index, 2 per chunk named)",
        "      out[r] = x[r+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0+0]",
        "                 " + "^" * 80,  # a long underline is cut at half the window
        "note: check fewer world sizes (purlinc check --ranks LO..HI), or write shorter layouts and expressions",
        "note: while checking a for R=4",
    ]
    assert check_all(definition, range(1, 65)) == list(range(1, 65))  # the default bound is far above this


def test_one_chunk_past_the_budget_is_one_chunk():
    # The budget can run out on a chunk reference naming one chunk: "names 1 chunk", not "1 chunks"
    statements = "\n".join(f"  in[{i}] = x{i}" for i in range(4))
    outputs = ", ".join(f"x{i}" for i in range(4))
    text = f"collective a {{\n{statements}\n  out[r] = {outputs}\n  copy\n}}\n"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("purlinc.frontend.check.MAX_CHUNKS", 10)
        error = _timed(text, world_size=4)
    assert error.message == ("'x2' names 1 chunk, more than this spec may name at R=4 (at most 10 chunks over all "
                             "ranks' layouts; 10 named before it)")


ONE_CHUNK_ALLREDUCE = "collective t {\n    in[r] = x\n    out[r] = x\n    reduce\n}\n"


def test_a_reductions_sources_are_held_once_per_chunk():
    """Every rank's output chunk x has the same R producers: the spec holds that tuple once.  A
    tuple per output position made R x R slots: 2.1 GB at R = 16,384, a MemoryError at 65,536."""
    import tracemalloc

    tracemalloc.start()
    spec = check(parse(ONE_CHUNK_ALLREDUCE, "t.pln"), 1 << 16)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(spec.sources[0][0]) == 1 << 16 and spec.sources[0][0] is spec.sources[-1][0]
    assert peak < 200 << 20, f"checking took {peak >> 20} MiB"


def test_every_index_of_a_chunk_reference_is_metered():
    """Indices that are plain numbers were free: a 6 KB spec of x[r][i][0]...[0] (998 zeros) in a
    loop of 2,048 ran for minutes; now the work meter stops it, at the reference."""
    zeros = "[0]" * 998
    source = f"collective t {{\n in[r] = x[r][i]{zeros} for i in 0..2048\n out[r] = x[r][i]{zeros} for i in 0..2048\n copy\n}}\n"
    started = time.perf_counter()
    with pytest.raises(PurlinError, match="takes too much work to check") as caught:
        check(parse(source, "t.pln"), 8)
    assert caught.value.span.line == 2 and time.perf_counter() - started < 30


def test_dump_refuses_to_list_more_sources_than_it_can_print(tmp_path, capsys):
    from purlinc.cli import main

    path = tmp_path / "t.pln"
    path.write_text(ONE_CHUNK_ALLREDUCE)
    assert main(["dump", str(path), "--ranks", "65536"]) == 2
    err = capsys.readouterr().err
    assert ("error: the spec of t at R=65536 lists 4,294,967,296 producer slots over its output chunks, more than "
            "4,194,304 to print") in err
    assert main(["dump", str(path), "--ranks", "64"]) == 0  # 4,096 slots: listed
