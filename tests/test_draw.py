"""``purlinc draw``: SVG and HTML that parse, one lane group per rank, one arrow per Notify/Wait
pair (checked against the schedule's own steps, not the drawing's matcher), the golden of
all-gather at R=2, timelines, traces (synthetic stamps through the real JSON path), the
traced kernel's codegen, bad input, and an HTML screenshot in headless Chromium."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
import zlib
from functools import lru_cache
from html.parser import HTMLParser
from pathlib import Path

import pytest

from purlinc import pipeline
from purlinc.cli import main
from purlinc.draw import html as draw_html
from purlinc.draw import svg
from purlinc.draw.model import build, channels_identical
from purlinc.draw.render import Request, render
from purlinc.draw.timeline import CostModel, schedule_times
from purlinc.snac.ir import Algorithm, LowerOptions, Notify, Stage, Wait

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
STANDARD = ("allgather", "reduce_scatter", "allreduce", "alltoall", "broadcast", "reduce", "gather", "scatter")
NS = "{http://www.w3.org/2000/svg}"


@lru_cache(maxsize=None)
def _schedule(name: str, world: int, channels: int = 1, algorithm: str = "direct-push"):
    source = pipeline.load_source(EXAMPLES / f"{name}.pln")
    spec = pipeline.spec_stage(pipeline.parse_stage(source), world, {})
    options = LowerOptions(algorithm=Algorithm(algorithm), channels=channels)
    return pipeline.snac_stage(spec, options)


def _svg_of(schedule, **kw) -> str:
    drawing = build(schedule, **kw)
    return svg.render([svg.Panel(drawing, schedule_times(schedule, drawing))])


def _classes(el) -> set[str]:
    return set(el.get("class", "").split())


def _find(root, tag: str, cls: str):
    return [el for el in root.iter(NS + tag) if cls in _classes(el)]


def _expected_pairs(schedule, channels) -> set[tuple]:
    """Every (notify-side step, wait step) of one call, straight from the programs."""
    raisers = {}
    for r in range(schedule.world_size):
        for c in channels:
            for i, step in enumerate(schedule.program(r, c).steps):
                if isinstance(step, Notify) or (isinstance(step, Stage) and step.signal is not None):
                    raisers[(step.signal, step.k)] = (r, c, i)
    pairs = set()
    for r in range(schedule.world_size):
        for c in channels:
            for i, step in enumerate(schedule.program(r, c).steps):
                if isinstance(step, Wait) and step.k >= 1:
                    pairs.add((raisers[(step.signal, step.k)], (r, c, i)))
    return pairs


def _arrows(elements) -> set[tuple]:
    key = lambda text: tuple(int(v) for v in text.split(","))  # noqa: E731
    return {(key(a.get("data-notify")), key(a.get("data-wait"))) for a in elements}


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("name", STANDARD)
def test_svg_lanes_and_arrows(name, world):
    schedule = _schedule(name, world)
    root = ET.fromstring(_svg_of(schedule))
    ranks = _find(root, "g", "rank")
    assert sorted(int(g.get("data-rank")) for g in ranks) == list(range(world))
    arrows = _find(root, "path", "arrow")
    want = _expected_pairs(schedule, range(schedule.channels))
    assert len(arrows) == len(want) and _arrows(arrows) == want
    steps = _find(root, "g", "step")
    assert len(steps) == sum(len(schedule.program(r, 0).steps) for r in range(world))
    for g in steps:  # every box says what it is
        assert g.find(NS + "title").text and g.get("data-verb") in svg._STROKE


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("name", STANDARD)
def test_html_parses_with_same_lanes_and_arrows(name, world):
    schedule = _schedule(name, world)
    page = draw_html.render(_svg_of(schedule), title=name)

    class Counter(HTMLParser):
        def __init__(self):
            super().__init__()
            self.ranks, self.arrows, self.steps, self.script = set(), 0, 0, False

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            cls = set((a.get("class") or "").split())
            if tag == "g" and "rank" in cls:
                self.ranks.add(int(a["data-rank"]))
            if tag == "path" and "arrow" in cls:
                self.arrows += 1
            if tag == "g" and "step" in cls:
                self.steps += 1
                assert a.get("data-detail")
            self.script |= tag == "script"

    parser = Counter()
    parser.feed(page)
    parser.close()
    assert parser.ranks == set(range(world))
    assert parser.arrows == len(_expected_pairs(schedule, range(1)))
    assert parser.steps > 0 and parser.script


def test_golden_allgather_r2(golden):
    text = render(Request(file=str(EXAMPLES / "allgather.pln"), world_size=2), "svg")
    golden("draw/allgather_r2.svg", text)


def test_identical_channels_collapse_to_one_lane_per_rank():
    schedule = _schedule("allreduce", 8, channels=8)
    assert channels_identical(schedule)
    root = ET.fromstring(_svg_of(schedule))
    assert len(_find(root, "g", "rank")) == 8 and len(_find(root, "g", "lane")) == 8
    assert _arrows(_find(root, "path", "arrow")) == _expected_pairs(schedule, range(1))
    assert any("identical up to slice offset" in (t.text or "") for t in _find(root, "text", "note"))
    # Every channel drawn: 8 sub-lanes per rank, every pair of every channel.
    root = ET.fromstring(_svg_of(schedule, collapse=False))
    assert len(_find(root, "g", "rank")) == 8 and len(_find(root, "g", "lane")) == 64
    assert _arrows(_find(root, "path", "arrow")) == _expected_pairs(schedule, range(8))


def test_ring_channels_identical_and_packed_stage_carries_the_arrow():
    assert channels_identical(_schedule("allreduce", 4, channels=4, algorithm="ring"))
    source = pipeline.load_source(EXAMPLES / "allgather.pln")
    spec = pipeline.spec_stage(pipeline.parse_stage(source), 2, {})
    schedule = pipeline.snac_stage(spec, LowerOptions(packed=True))
    root = ET.fromstring(_svg_of(schedule))
    arrows = _find(root, "path", "arrow")
    assert arrows and _arrows(arrows) == _expected_pairs(schedule, range(1))
    verbs = {(g.get("data-rank"), g.get("data-index")): g.get("data-verb") for g in _find(root, "g", "step")}
    for a in arrows:
        r, _, i = a.get("data-notify").split(",")
        assert verbs[(r, i)] == "stage+notify"


def test_schedule_view_arrows_point_forward():
    for name in STANDARD:
        schedule = _schedule(name, 4)
        drawing = build(schedule)
        times = schedule_times(schedule, drawing)
        for pair in drawing.pairs:
            assert times.spans[pair.wait][0] >= times.spans[pair.notify][1]


def test_timeline_respects_signal_latency_and_bandwidth():
    model = CostModel()
    small, large = [], []
    for algorithm in ("ring", "direct-push"):
        schedule = _schedule("allreduce", 4, algorithm=algorithm)
        drawing = build(schedule)
        for chunk, out in ((1024, small), (1 << 20, large)):
            t = schedule_times(schedule, drawing, model, chunk_bytes=chunk)
            for pair in drawing.pairs:
                assert t.spans[pair.wait][1] >= t.spans[pair.notify][1] + model.signal_us - 1e-9
            for lane in drawing.lanes:
                spans = [t.spans[b.key] for b in lane.steps]
                assert spans[0][0] >= model.launch_us
                assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))
            out.append(t.total)
    assert all(s < l for s, l in zip(small, large))
    assert small[1] < small[0]  # one-shot beats the ring at 1 KiB (fewer signal hops)


def test_compare_draws_one_panel_per_algorithm(tmp_path):
    out = tmp_path / "cmp.svg"
    assert main(["draw", str(EXAMPLES / "allreduce.pln"), "--ranks", "4", "--compare", "ring,direct-push",
                 "--bytes", "1MiB", "-o", str(out)]) == 0
    root = ET.fromstring(out.read_text())
    panels = _find(root, "g", "panel")
    assert len(panels) == 2
    assert [len(_find(p, "g", "rank")) for p in panels] == [4, 4]
    heads = [p.find(NS + "text").text for p in panels]
    assert "ring" in heads[0] and "direct-push" in heads[1]


def test_cli_html_by_extension(tmp_path):
    out = tmp_path / "s.html"
    assert main(["draw", str(EXAMPLES / "alltoall.pln"), "--ranks", "4", "--timeline", "-o", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("<!DOCTYPE html>") and "model:" in text


# ---- bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["draw", "{ex}/allgather.pln", "-o", "{tmp}/x.png"], "unknown drawing format 'png'"),
    (["draw", "{ex}/allgather.pln", "--format", "pdf"], "unknown drawing format 'pdf'"),
    (["draw", "{ex}/allgather.pln", "--compare", "ring,zigzag"], "unknown algorithm 'zigzag'"),
    (["draw", "{ex}/allgather.pln", "--trace", "{tmp}/missing.json"], "does not exist"),
    (["draw", "{ex}/allgather.pln", "--trace", "{tmp}/empty.json"], "is empty"),
    (["draw", "{ex}/allgather.pln", "--trace", "{tmp}/chrome.json"], "is not a Purlin trace"),
    (["draw", "{ex}/allgather.pln", "--trace", "{tmp}/garbage.json"], "is not JSON"),
    (["draw", "{ex}/allgather.pln", "--dtype", "float7"], "float7"),
])
def test_bad_input_exits_2(tmp_path, capsys, argv, message):
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "chrome.json").write_text(json.dumps({"traceEvents": [{"ph": "X", "ts": 1}]}))
    (tmp_path / "garbage.json").write_text("{not json")
    argv = [a.format(ex=EXAMPLES, tmp=tmp_path) for a in argv]
    assert main(argv + ["--timeline"] * ("--dtype" in argv)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_unknown_stage_exits_2(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["dump", str(EXAMPLES / "allgather.pln"), "--stage", "bogus"])
    assert stop.value.code == 2
    assert "invalid choice: 'bogus'" in capsys.readouterr().err


# ---- traces -------------------------------------------------------------------------------

def _traced_kernel(schedule, spec_name="allreduce", world=2):
    from purlinc.atom.codegen import generate
    from purlinc.dtypes import DType, ReduceOp

    source = pipeline.load_source(EXAMPLES / f"{spec_name}.pln")
    spec = pipeline.spec_stage(pipeline.parse_stage(source), world, {})
    op = ReduceOp.SUM if spec.is_reduce else None
    plain = generate(schedule, spec, atom="ldst", arch="sm_90", dtype=DType.BFLOAT16, op=op)
    off = generate(schedule, spec, atom="ldst", arch="sm_90", dtype=DType.BFLOAT16, op=op, trace=False)
    traced = generate(schedule, spec, atom="ldst", arch="sm_90", dtype=DType.BFLOAT16, op=op, trace=True)
    return plain, off, traced


def test_traced_codegen_is_additive_and_covers_every_step():
    for options in (LowerOptions(), LowerOptions(channels=2, slices=2), LowerOptions(packed=True)):
        source = pipeline.load_source(EXAMPLES / "allreduce.pln")
        spec = pipeline.spec_stage(pipeline.parse_stage(source), 2, {})
        schedule = pipeline.snac_stage(spec, options)
        plain, off, traced = _traced_kernel(schedule)
        assert off.source == plain.source and "trace" not in plain.source and plain.trace_blocks == ()
        assert "purlin_trace_buf" in traced.source and traced.abi == plain.abi
        for rank, channels in enumerate(traced.trace_blocks):
            for channel, blocks in enumerate(channels):
                covered = [s for block in blocks for s in block]
                assert covered == list(range(len(schedule.program(rank, channel).steps)))


def test_traced_kernel_compiles():
    from purlinc.atom import nvrtc

    _, _, traced = _traced_kernel(_schedule("allreduce", 2, channels=2))
    assert nvrtc.compile_cubin(traced.source, traced.filename, "sm_90")[:4] == b"\x7fELF"
    from purlinc.runtime.trace import ALIGN_SOURCE  # the clock-alignment ping-pong kernel

    assert nvrtc.compile_cubin(ALIGN_SOURCE, "purlin_clock_align.cu", "sm_90")[:4] == b"\x7fELF"


def test_clock_offset_from_ping_pong_samples():
    from purlinc.runtime.trace import offset_from_samples

    # Peer clock 5000 ns ahead, one-way latency 1300 ns, one slow outlier round trip.
    samples = [(t, t + 1300 + 5000, t + 2600) for t in range(0, 64000, 4000)] + [(100000, 106300, 109000)]
    offset, uncertainty, rtt = offset_from_samples(samples)
    assert offset == pytest.approx(5000) and uncertainty == pytest.approx(1300) and rtt == 2600


def _fake_trace(schedule):
    """Raw stamps as the device would write them: every block 100 ns, rank 1's clock 7 us ahead,
    waits stretched until their notify (so the trace is causal once aligned)."""
    from purlinc.draw.trace import from_stamps

    _, _, traced = _traced_kernel(schedule)
    parts = []
    for rank in range(schedule.world_size):
        channels = []
        for c, blocks in enumerate(traced.trace_blocks[rank]):
            gt = 1_000_000 + 7000 * rank + 40 * c
            row = [(gt, 10 * gt)]
            for block in blocks:
                gt += 1500 if any(isinstance(schedule.program(rank, c).steps[s], Wait) for s in block) else 100
                row.append((gt, 10 * gt))
            channels.append({"epoch": 3, "rounds": 1, "stamps": [row], "blocks": [list(b) for b in blocks]})
        parts.append({"rank": rank, "device": "fake GPU", "kernel": traced.kernel_base, "dtype": "bfloat16",
                      "op": "sum", "channels": channels})
    clock = {"method": "ping-pong", "reference_rank": 0, "iterations": 1,
             "ranks": [{"rank": r, "offset_ns": 7000.0 * r, "uncertainty_ns": 50.0, "min_rtt_ns": 2600.0,
                        "globaltimer_tick_ns": 32, "sm_cycles_per_ns": 10.0} for r in range(schedule.world_size)]}
    return from_stamps(schedule, {}, "ldst", parts, clock)


def test_trace_json_and_drawing(tmp_path):
    schedule = _schedule("allreduce", 2, channels=2)
    data = _fake_trace(schedule)
    assert data["format"] == "purlin-trace" and data["timebase"] == "globaltimer" and data["calls"] == [3, 3]
    starts = {e["rank"]: e["start_ns"] for e in data["events"] if e["block"] == 0 and e["channel"] == 0}
    assert starts == {0: 0.0, 1: 0.0}  # aligned: the 7 us offset is gone
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "traced.svg"
    assert main(["draw", str(EXAMPLES / "allreduce.pln"), "--trace", str(path), "-o", str(out)]) == 0
    root = ET.fromstring(out.read_text())
    assert len(_find(root, "g", "rank")) == 2 and len(_find(root, "g", "lane")) == 4
    assert all("measured: block" in g.get("data-detail") for g in _find(root, "g", "step"))
    assert _arrows(_find(root, "path", "arrow")) == _expected_pairs(schedule, range(2))


def test_trace_of_another_schedule_is_refused(tmp_path, capsys):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_fake_trace(_schedule("allreduce", 2, channels=2))))
    assert main(["draw", str(EXAMPLES / "allgather.pln"), "--trace", str(path)]) == 2
    assert "trace" in capsys.readouterr().err
    data = json.loads(path.read_text())
    data["events"] = []
    path.write_text(json.dumps(data))
    assert main(["draw", str(EXAMPLES / "allreduce.pln"), "--trace", str(path)]) == 2
    assert "no events" in capsys.readouterr().err


@lru_cache(maxsize=None)
def _good_trace_text() -> str:
    return json.dumps(_fake_trace(_schedule("allreduce", 2, channels=2)))


def _edited_trace(tmp_path, edit) -> Path:
    data = json.loads(_good_trace_text())
    edit(data)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    return path


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def edit(data):
        for key in keys[:-1]:
            data = data[key]
        data[keys[-1]] = value
    return edit


def test_deeply_nested_json_is_refused_as_not_a_trace(tmp_path, capsys):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert main(["draw", str(EXAMPLES / "allreduce.pln"), "--trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"trace file {path} is not a Purlin trace: its JSON is nested too deeply" in err, err
    assert "internal error" not in err


@pytest.mark.parametrize("edit, message", [
    (_set("events", 0, "start_ns", "a"), "events[0].start_ns: expected a number, got 'a'"),
    (_set("events", 0, "end_ns", None), "events[0].end_ns: expected a number, got None"),
    (_set("events", 0, "end_ns", 10**400), "events[0].end_ns: expected a finite number, got 10000000000"),
    (_set("events", 0, "start_ns", -10**400), "events[0].start_ns: expected a finite number, got -1000000000"),
    (_set("events", 0, "end_ns", -1), "events[0].end_ns: expected a time at or after start_ns"),
    (_set("events", 0, "steps", 5), "events[0].steps: expected a list, got 5"),
    (_set("events", 0, "steps", [0, "1"]), "events[0].steps[1]: expected an integer, got '1'"),
    (_set("events", 0, "rank", "x"), "events[0].rank: expected an integer, got 'x'"),
    (_set("events", 1, "channel", True), "events[1].channel: expected an integer, got True"),
    (_set("events", 0, "round", "0"), "events[0].round: expected an integer, got '0'"),
    (lambda d: d["events"][0].pop("block"), "events[0].block is missing"),
    (_set("events", {"a": 1}), "events: expected a list, got {'a': 1}"),
    (_set("events", [7]), "events[0]: expected an object, got 7"),
    (lambda d: d["clock"].pop("ranks"), "clock.ranks is missing"),
    (_set("clock", []), "clock: expected an object, got []"),
    (_set("clock", "ranks", 0, "rank", 0.5), "clock.ranks[0].rank: expected an integer, got 0.5"),
    (_set("clock", "ranks", 1, "uncertainty_ns", "50"), "clock.ranks[1].uncertainty_ns: expected a number, got '50'"),
    (_set("world_size", "2"), "world_size: expected an integer, got '2'"),
    (_set("world_size", 0), "world_size: expected an integer of at least 1, got 0"),
    (_set("params", [1]), "params: expected an object, got [1]"),
    (_set("params", {"root": "1"}), "params.root: expected an integer, got '1'"),
    (_set("collective", 3), "collective: expected a string, got 3"),
    (_set("options", []), "options: expected an object, got []"),
    (_set("options", "algorithm", "zzz"), "options.algorithm: expected one of direct-push, direct-pull, two-shot, ring, got 'zzz'"),
    (_set("options", "channels", "2"), "options.channels: expected an integer, got '2'"),
    (_set("options", "stage_copies", 3), "options.stage_copies: expected 1 or 2, got 3"),
    (_set("options", "packed", "no"), "options.packed: expected true or false, got 'no'"),
    # times before the first stamp or past an hour: all negative crashed the axis (log10 of 0)
    (_set("events", 0, "start_ns", -5.0), "events[0].start_ns: expected a time from 0 (the call's first stamp)"),
    (_set("events", 0, "end_ns", 1e300), "events[0].end_ns: expected a time at or after start_ns (0.0), at most"),
    (lambda d: d["options"].pop("key"), "options.key is missing"),
])
def test_malformed_trace_names_the_file_and_field(tmp_path, capsys, edit, message):
    path = _edited_trace(tmp_path, edit)
    assert main(["draw", str(EXAMPLES / "allreduce.pln"), "--trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: {message}" in err and "internal error" not in err


@pytest.mark.parametrize("edit, message", [
    (_set("world_size", 4), "ranks 2, 3 of its world size 4 have no stamped step in round 0"),
    (lambda d: [e.update(round=1) for e in d["events"]], "ranks 0, 1 of its world size 2 have no stamped step"),
    (lambda d: [e.update(steps=[]) for e in d["events"]], "ranks 0, 1 of its world size 2 have no stamped step"),
])
def test_a_trace_whose_ranks_have_nothing_to_draw_is_refused(tmp_path, capsys, edit, message):
    """world_size 4 over an R=2 run drew the R=2 times at R=4's steps and two empty columns;
    nothing in round 0 drew only empty boxes."""
    path = _edited_trace(tmp_path, edit)
    assert main(["draw", str(EXAMPLES / "allreduce.pln"), "--trace", str(path)]) == 2
    assert f"trace {path}: {message}" in capsys.readouterr().err


def test_a_trace_parameter_the_spec_lacks_names_the_trace(tmp_path, capsys):
    path = _edited_trace(tmp_path, _set("params", {"root": 1}))
    assert main(["draw", str(EXAMPLES / "allreduce.pln"), "--trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert "allreduce has no parameter 'root'" in err
    assert f"note: the world size, parameters and options come from the trace {path}" in err


@pytest.mark.parametrize("argv, message", [
    (["-R", "4"], "--ranks 4 (the trace ran R=2)"),
    (["-p", "root=1"], "--param root=1 (the trace has no root)"),
    (["-a", "ring"], "--algorithm ring (the trace ran --algorithm direct-push)"),
    (["--channels", "1"], "--channels 1 (the trace ran --channels 2)"),
    (["--slices", "2"], "--slices 2 (the trace ran --slices 1)"),
    (["--packed"], "--packed (the trace ran no --packed)"),
    (["--dtype", "float32"], "--dtype float32 (the trace ran bfloat16)"),
])
def test_trace_refuses_options_that_differ_from_it(tmp_path, capsys, argv, message):
    path = _edited_trace(tmp_path, lambda d: None)
    assert main(["draw", str(EXAMPLES / "allreduce.pln"), "--trace", str(path), *argv]) == 2
    err = capsys.readouterr().err
    assert f"trace {path} fixes the schedule it was recorded with" in err and message in err


@pytest.mark.parametrize("argv, message", [
    (["--compare", "ring,direct-push"], "--compare draws modelled timelines"),
    (["--timeline", "--bytes", "1MiB"], "--bytes and --count size the modelled timeline"),
    (["--timeline", "--count", "8"], "--bytes and --count size the modelled timeline"),
])
def test_trace_refuses_the_model_options(tmp_path, capsys, argv, message):
    path = _edited_trace(tmp_path, lambda d: None)
    assert main(["draw", str(EXAMPLES / "allreduce.pln"), "--trace", str(path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_trace_accepts_options_that_agree_with_it(tmp_path, capsys):
    path = _edited_trace(tmp_path, lambda d: None)
    argv = ["-R", "2", "-a", "direct-push", "--channels", "2", "--slices", "1", "--dtype", "bfloat16"]
    assert main(["draw", str(EXAMPLES / "allreduce.pln"), "--trace", str(path), *argv]) == 0
    assert "measured: block" in capsys.readouterr().out


# ---- a browser looks at the HTML ----------------------------------------------------------

def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _png_pixels(data: bytes) -> bytes:
    """The decompressed scanlines of a PNG (filter bytes included): enough to see variety."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"IDAT":
            idat += data[pos + 8:pos + 8 + length]
        pos += 12 + length
    return zlib.decompress(idat)


def test_html_screenshot_is_not_blank(tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("headless Chromium not installed (apt-get install chromium): screenshot not taken")
    page = tmp_path / "s.html"
    assert main(["draw", str(EXAMPLES / "allreduce.pln"), "--ranks", "4", "-o", str(page)]) == 0
    shot = tmp_path / "shot.png"
    subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--screenshot={shot}",
         "--window-size=1200,700", page.as_uri()],
        check=True, capture_output=True, timeout=120,
    )
    pixels = _png_pixels(shot.read_bytes())
    assert len(set(pixels)) > 16, "the screenshot is blank"
    assert pixels.count(255) < 0.97 * len(pixels), "the screenshot is nearly all white"


@pytest.mark.parametrize("timeline", [False, True])
def test_unindexed_chunks_are_coloured_and_named(tmp_path, timeline):
    """A spec whose chunks carry no index (``in[r] = x``): its steps still get the chunk's
    colour and name, and the legend lists it, as for ``x[0]``; the notes' other words
    ("for", "from", "done") are not taken for chunks."""
    page = tmp_path / "fused.svg"
    argv = ["draw", str(EXAMPLES / "fused" / "allreduce_add_rmsnorm.pln"), "--ranks", "4", "-o", str(page)]
    assert main(argv + (["--timeline"] if timeline else [])) == 0
    root = ET.fromstring(page.read_text())
    steps = _find(root, "g", "step")
    moved = [g for g in steps if g.get("data-verb") in ("stage", "reduce")]
    assert moved and all(g.get("data-chunk") == "x" for g in moved)
    assert all(g.find(NS + "rect").get("fill") != "#e6e6e6" for g in moved), "a step of x drawn grey"
    assert {g.get("data-chunk") for g in steps} <= {"x", ""}
    legend = _find(root, "g", "legend")[0]
    assert [t.text for t in legend.iter(NS + "text")][:2] == ["chunks:", "x"]


def test_draw_reads_standard_input_once(monkeypatch, capsys):
    """``draw -`` reads the .pln from standard input, as dump and check do (FILE's help says
    so); --compare builds two panels from the one text.  Before: 'error: no such file: -'."""
    text = (EXAMPLES / "allreduce.pln").read_bytes()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text)))
    assert main(["draw", "-", "--ranks", "2", "--compare", "ring,two-shot"]) == 0
    drawn = capsys.readouterr().out
    assert drawn.startswith("<svg") and drawn.count('class="panel"') == 2


def test_draw_file_name_with_a_brace_is_a_path(tmp_path, capsys):
    """A file name is never read as .pln text, whatever it contains (as for dump): before,
    a path with '{' in it was parsed as the collective itself."""
    path = tmp_path / "odd{name}.pln"
    path.write_bytes((EXAMPLES / "allgather.pln").read_bytes())
    assert main(["draw", str(path), "--ranks", "2"]) == 0
    assert capsys.readouterr().out.startswith("<svg")


def test_legend_of_many_chunks_wraps_within_the_lanes():
    """alltoall at R=16 has 256 chunks: the legend wraps into rows no wider than the lanes
    (and the explanation after it too), every entry inside the canvas.  Before, it was one
    row that made the canvas several times wider than the drawing (311,000 px at R=64)."""
    root = ET.fromstring(_svg_of(_schedule("alltoall", 16)))
    width, height = float(root.get("width")), float(root.get("height"))
    lanes = max(float(el.get("width")) for el in root.iter(NS + "rect") if el.get("x") == "0" and el.get("height") == "44")
    assert width <= max(lanes, 1200) + 20  # the canvas ends a little right of the lane shading
    (legend,) = _find(root, "g", "legend")
    texts = list(legend.iter(NS + "text"))
    rows = {float(t.get("y")) for t in texts}
    assert len(rows) > 1 and len(texts) == 256 + 2  # "chunks:", every chunk, the explanation
    assert all(float(t.get("y")) < height for t in texts)
    for t in texts:  # each entry starts inside the canvas and its text (6.2 px a character) ends there
        assert float(t.get("x")) + 6.2 * len(t.text) <= width + 1, t.text


@pytest.mark.parametrize("timeline", [False, True])
def test_lane_labels_end_before_the_first_box(timeline):
    """'rank 10  (x16 channels)' is 23 characters of 12 px monospace (0.6 em each): the label
    column widens to hold it.  Before, it was 170 px whatever the labels, and the label ran
    under the lane's first box from rank 10 on."""
    schedule = _schedule("allgather", 11, channels=16)
    drawing = build(schedule)
    times = schedule_times(schedule, drawing, CostModel(), chunk_bytes=4096) if timeline else schedule_times(schedule, drawing)
    root = ET.fromstring(svg.render([svg.Panel(drawing, times)]))
    (axis,) = _find(root, "g", "axis")
    origin = float(axis.find(NS + "line").get("x1"))  # time 0 (or step 0): where boxes may start
    for lane in _find(root, "g", "lane"):
        label = next(t for t in lane.iter(NS + "text") if t.text.startswith("rank "))
        assert float(label.get("x")) + 0.6 * 12 * len(label.text) < origin, label.text
        assert min(float(r.get("x")) for r in lane.iter(NS + "rect") if r.get("x") != "0") >= origin


def _tick_labels(root):
    """The time axis' labels as (left, right, text): 9 px monospace, 0.6 em a character."""
    (axis,) = _find(root, "g", "axis")
    return [(float(t.get("x")), float(t.get("x")) + 0.6 * 9 * len(t.text), t.text) for t in axis.iter(NS + "text")]


@pytest.mark.parametrize("model, width", [
    (CostModel(launch_us=0.01, signal_us=0.01, step_us=0.001, notify_us=0.001), None),  # 0.06 us in all
    (CostModel(launch_us=0.42), 400),  # 1.9 us over the narrowest --width: ticks every 0.2 us were 21 px apart
])
def test_time_axis_labels_are_distinct_apart_and_inside(model, width):
    """Ticks every 0.01 us were all labelled '0 us' or '0.1 us' (one decimal whatever the
    step: a measured trace of a short call read '0 us' five times), ticks every 0.5 us over
    200 px of axis (--width 400) overlapped, and the last label ran off the canvas."""
    schedule = _schedule("allgather", 2)
    drawing = build(schedule)
    times = schedule_times(schedule, drawing, model, chunk_bytes=2)
    root = ET.fromstring(svg.render([svg.Panel(drawing, times)], width=width))
    labels = _tick_labels(root)
    assert len(labels) >= 2 and len({text for _, _, text in labels}) == len(labels), labels
    assert all(right <= next_left for (_, right, _), (next_left, _, _) in zip(labels, labels[1:])), labels
    assert labels[-1][1] <= float(root.get("width")), labels[-1]


def test_a_drawing_too_big_to_read_is_refused(tmp_path, monkeypatch, capsys):
    """allreduce at R=48 (direct-push) would draw 115,104 boxes, each under a pixel wide, in a
    page of tens of megabytes.  Past MAX_BOXES the draw is refused, saying how big it would be
    and what draws less; nothing is written.  Every rank's channel 0 is drawn, so its steps
    alone refuse a schedule as soon as it is lowered, before verifying it (at R=48-64 the
    verification and the drawing took 17-29 s before the refusal); what only the drawn lanes
    show (every channel, --all-channels) is refused once they are built."""
    from purlinc.draw import render as draw_render
    from purlinc.snac import verify as verify_module

    assert draw_render.MAX_BOXES >= 20_000  # alltoall and allgather at R=64 (about 16,000) still draw
    monkeypatch.setattr(draw_render, "MAX_BOXES", 100)
    out = tmp_path / "big.html"
    with monkeypatch.context() as m:
        m.setattr(verify_module, "verify", lambda *a: pytest.fail("verified a schedule too big to draw"))
        assert main(["draw", str(EXAMPLES / "allgather.pln"), "--ranks", "8", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: this drawing would have at least 232 step boxes, more than 100: too many to read"), err
    assert "--ranks" in err and not out.exists()
    assert main(["draw", str(EXAMPLES / "allgather.pln"), "--ranks", "4", "-o", str(out)]) == 0  # fewer boxes
    # channel 0 alone fits; all four channels drawn do not
    assert main(["draw", str(EXAMPLES / "allgather.pln"), "--ranks", "4", "--channels", "4", "--all-channels",
                 "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert re.match(r"error: this drawing would have \d+ step boxes, more than 100: too many to read", err), err


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_trace_without_end_is_refused_not_read_forever(tmp_path, capsys, monkeypatch):
    # --trace /dev/zero read until memory ran out: a trace is read up to a bound, then refused.
    from purlinc.draw import trace as tracing

    monkeypatch.setattr(tracing, "MAX_TRACE_BYTES", 1 << 20)
    big = tmp_path / "big.json"
    big.write_text(" " * ((1 << 20) + 1))
    for path, size in (("/dev/zero", "more than 1,048,576 bytes"), (big, "1,048,577 bytes")):
        assert main(["draw", str(EXAMPLES / "allreduce.pln"), "--trace", str(path)]) == 2
        assert capsys.readouterr().err == (f"error: trace file {path} is too large: {size}, the limit is 1,048,576\n"
                                           "note: a trace is what coll.trace() returns, written with json.dump\n")


def test_a_schedule_too_large_to_draw_is_refused(capsys):
    # 2.6 million steps (1024 channels of 256 slices) took minutes and gigabytes to draw
    assert main(["draw", str(EXAMPLES / "allgather.pln"), "--ranks", "2", "--channels", "1024", "--slices", "256"]) == 2
    assert capsys.readouterr().err == (
        "error: allgather at R=2 has 2,621,440 steps (2,560 per channel x 1024 channels), more than a drawing "
        "takes (262,144)\n"
        "note: draw fewer ranks, channels or slices; purlinc dump --stage snac prints a schedule of any size\n")


def test_the_legend_of_many_chunks_is_linear():
    # The legend's chunks were collected with a list search per chunk: 65,536 chunks (alltoall at
    # R=256) spent ~40 s there.  First-seen order across panels is kept.
    from purlinc.draw.model import Drawing
    from purlinc.draw.timeline import Times

    def panel(names):
        drawing = Drawing("t", "", 1, 1, False, (), (), tuple(names))
        return svg.Panel(drawing, Times("step", {}, 1.0))

    many = [f"x[{i}]" for i in range(60_000)]
    began = time.monotonic()
    text = svg.render([panel(many), panel(["y", "x[0]"])])
    assert time.monotonic() - began < 10  # ~0.5 s; the list search took over a minute
    assert text.index(">x[59999]<") < text.index(">y<") and text.count(">x[0]<") == 1


def test_fused_schedules_with_channels_are_drawn_and_their_epilogue_costed(tmp_path):
    """An Epilogue step has no operation: the identical-channels check read it as a consume
    (AttributeError, an internal error for every fused spec with --channels > 1), and the
    timeline gave it the cost of a bare step (a sliver for a pass over the rows)."""
    fused = EXAMPLES / "fused" / "allreduce_add_rmsnorm.pln"
    for timeline in (False, True):
        text = render(Request(fused, 4, overrides=(("channels", 2),), timeline=timeline), "svg")
        assert text.count('class="step') > 0 and "epilogue" in text
    from purlinc.draw.render import schedule_for

    spec, schedule = schedule_for(fused, 4, (), {"channels": 2}, verify=False)
    drawing = build(schedule)
    times = schedule_times(schedule, drawing, CostModel(), chunk_bytes=65536)
    epilogue = [box for lane in drawing.lanes for box in lane.steps if box.verb == "epilogue"]
    reduce = [box for lane in drawing.lanes for box in lane.steps if box.verb == "reduce"]
    span = lambda box: times.spans[box.key][1] - times.spans[box.key][0]  # noqa: E731
    # out read and written, residual read and written: about as long as the reduce of 4 sources
    assert epilogue and all(span(e) > 0.5 * span(reduce[0]) for e in epilogue)


@pytest.mark.parametrize("request_args, message", [
    ({"width": 10 ** 9}, "width=1000000000: expected 400 to 100,000 pixels"),
    ({"count": 10 ** 30, "timeline": True}, "count=1000000000000000000000000000000: expected 1 to 1,099,511,627,776"),
])
def test_sizes_from_python_are_bounded_as_on_the_command_line(request_args, message):
    from purlinc.errors import PurlinError

    with pytest.raises(PurlinError) as caught:
        render(Request(EXAMPLES / "allgather.pln", 2, **request_args), "svg")
    assert caught.value.message.startswith(message)


@pytest.mark.parametrize("argv, message", [
    (["--count", "7"], "count=7: not a whole number of the epilogue's rows of 4096 elements"),
    (["--dtype", "int32"], "--dtype int32: an epilogue computes in float32; int32 outputs are not supported"),
])
def test_timeline_of_a_fused_call_refuses_what_a_call_would(tmp_path, capsys, argv, message):
    out = tmp_path / "t.svg"
    argv = ["draw", str(EXAMPLES / "fused" / "allreduce_add_rmsnorm.pln"), "-R", "4", "--timeline", *argv, "-o", str(out)]
    assert main(argv) == 2
    assert message in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("dtype", ["float8_e5m2", "float8_e4m3"])
@pytest.mark.parametrize("modes", [["--timeline"], ["--compare", "ring,two-shot"]])
def test_timeline_of_a_reduction_refuses_a_dtype_it_cannot_reduce(tmp_path, capsys, dtype, modes):
    """fp8 is for copies only: compile refuses it for a reduction, and a call would be refused,
    so a timeline of one is refused too rather than drawn."""
    out = tmp_path / "t.svg"
    assert main(["draw", str(EXAMPLES / "allreduce.pln"), "-R", "4", *modes, "--dtype", dtype, "-o", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"error: --dtype {dtype}: {dtype} cannot be reduced, and the collective allreduce is a reduction\n"
        "note: a call of this collective would be refused\n"
        "note: a reduction takes float32, float16, bfloat16, int32, int64; fp8 is supported for copies only\n")
    assert not out.exists()


def test_timeline_of_a_copy_takes_fp8(tmp_path, capsys):
    out = tmp_path / "t.svg"
    assert main(["draw", str(EXAMPLES / "allgather.pln"), "-R", "4", "--timeline", "--dtype", "float8_e5m2",
                 "-o", str(out)]) == 0
    assert "(float8_e5m2)" in out.read_text()


ROWS_OF_4 = ("collective four(hidden = 4) {\n  in[r] = x\n  out[r] = x\n  reduce\n"
             "  epilogue rows(hidden) { out = out * 2.0 }\n}\n")  # rows that run in float32 only


@pytest.mark.parametrize("argv, flag", [([], "the default dtype bfloat16 (--dtype)"),
                                        (["--dtype", "bf16"], "--dtype bf16")])
def test_timeline_error_names_the_dtype_as_given(tmp_path, capsys, argv, flag):
    """Rows of 4 run in float32 only: without --dtype the error names the default as the
    default, not as a --dtype the command line does not have."""
    source, out = tmp_path / "four.pln", tmp_path / "t.svg"
    source.write_text(ROWS_OF_4)
    assert main(["draw", str(source), "-R", "2", "--timeline", *argv, "-o", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"error: {flag}: a row of 4 bfloat16 elements is 8 bytes, not a multiple of 16 (the kernels move 16-byte "
        "vectors)\nnote: a call of this collective would be refused\n")
    assert main(["draw", str(source), "-R", "2", "--timeline", "--dtype", "float32", "-o", str(out)]) == 0


def test_timeline_of_a_fused_call_models_whole_rows(tmp_path):
    """--bytes below a row models one row per chunk, as the smallest call moves."""
    out = tmp_path / "t.svg"
    argv = ["draw", str(EXAMPLES / "fused" / "allreduce_add_rmsnorm.pln"), "-R", "4", "--timeline", "--bytes", "100",
            "-o", str(out)]
    assert main(argv) == 0
    assert "8192 B per chunk (bfloat16)" in out.read_text()


# ---- the output file ------------------------------------------------------------------------

def test_draw_refuses_to_overwrite_its_input(tmp_path, capsys):
    """`purlinc draw x.svg -o x.svg` (or -o a link to the input) replaced the .pln with its drawing."""
    source = tmp_path / "spec.svg"
    source.write_text((EXAMPLES / "allgather.pln").read_text())
    (tmp_path / "link.svg").symlink_to(source)
    for output in (source, tmp_path / "link.svg"):
        assert main(["draw", str(source), "-R", "2", "-o", str(output)]) == 2
        assert capsys.readouterr().err == (f"error: -o {output}: is the input file {source}; writing the drawing "
                                           "there would overwrite it\n")
    assert source.read_text() == (EXAMPLES / "allgather.pln").read_text()


@pytest.mark.parametrize("output, message", [
    ("missing/x.svg", "the directory {tmp}/missing does not exist"),
    ("file.txt/x.svg", "{tmp}/file.txt is not a directory"),
    ("folder", "is a directory; name a file in it, e.g. schedule.svg"),
])
def test_draw_checks_the_output_place_first(tmp_path, capsys, monkeypatch, output, message):
    """Named with -o, and before the drawing is made (before, after it: 'error: x.svg: No such file')."""
    (tmp_path / "file.txt").write_text("")
    (tmp_path / "folder").mkdir()
    monkeypatch.setattr("purlinc.draw.render.render", lambda *a: pytest.fail("drawn before the output was checked"))
    assert main(["draw", str(EXAMPLES / "allgather.pln"), "-o", str(tmp_path / output), "-f", "svg"]) == 2
    assert capsys.readouterr().err == f"error: -o {tmp_path / output}: {message.format(tmp=tmp_path)}\n"


def test_draw_into_a_file_of_a_read_only_directory_is_refused_first(tmp_path, capsys, monkeypatch):
    """The drawing is written beside its file and renamed, so the directory must be writable even
    where the file already is (os.access is patched: root may write anywhere)."""
    out = tmp_path / "x.svg"
    out.write_text("old")
    real = os.access
    monkeypatch.setattr("purlinc.cli.common.os.access", lambda path, mode: Path(path) != tmp_path and real(path, mode))
    monkeypatch.setattr("purlinc.draw.render.render", lambda *a: pytest.fail("drawn before the output was checked"))
    assert main(["draw", str(EXAMPLES / "allgather.pln"), "-o", str(out)]) == 2
    assert capsys.readouterr().err == f"error: -o {out}: the directory {tmp_path} is not writable\n"
    assert out.read_text() == "old"


def test_a_failed_write_leaves_the_old_file_whole(tmp_path):
    """A write cut short (here a file size limit: Python ignores SIGXFSZ, so the write fails with
    EFBIG) left the first 4 KiB of the drawing in place of the old file; now the old file stays as
    it was and no temporary file is left.  In a child process: the limit would also cut the test
    runner's own output files."""
    resource = pytest.importorskip("resource")
    out = tmp_path / "x.svg"
    out.write_text("old")

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    done = subprocess.run([sys.executable, "-m", "purlinc", "draw", str(EXAMPLES / "allgather.pln"), "-R", "2",
                           "-o", str(out)], capture_output=True, text=True, preexec_fn=limit, timeout=120)  # ~8 KiB
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"error: -o {out}: cannot write the drawing: File too large\n"
    assert [p.name for p in tmp_path.iterdir()] == ["x.svg"] and out.read_text() == "old"


def test_draw_writes_through_a_device_and_keeps_a_file_mode(tmp_path, capsys):
    assert main(["draw", str(EXAMPLES / "allgather.pln"), "-R", "2", "-o", "/dev/null", "-f", "svg"]) == 0
    assert capsys.readouterr().out == ""  # no path printed: `-o /dev/stdout` would get it inside the drawing
    out = tmp_path / "x.svg"
    out.write_text("old")
    out.chmod(0o640)
    assert main(["draw", str(EXAMPLES / "allgather.pln"), "-R", "2", "-o", str(out)]) == 0
    assert out.read_text().startswith("<svg") and (out.stat().st_mode & 0o777) == 0o640


@pytest.mark.parametrize("argv, message", [
    (["--format", ""], "error: unknown drawing format '' (from --format ''): expected svg or html\n"),  # was 'from None'
    (["-o", "{tmp}/x"], "error: unknown drawing format '' (from -o {tmp}/x, a name without an extension): expected "
                        "svg or html\n"),
    (["-o", "{tmp}/x.svg", "--format", "html"], "error: --format html does not agree with -o {tmp}/x.svg, a .svg file\n"
                                                "note: give one of them, or name the file for the format\n"),
])
def test_draw_format_errors_say_where_the_format_came_from(tmp_path, capsys, argv, message):
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(["draw", str(EXAMPLES / "allgather.pln"), *argv]) == 2
    assert capsys.readouterr().err.startswith(message.format(tmp=tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_draw_format_may_name_a_file_of_another_extension(tmp_path, capsys):
    out = tmp_path / "x.txt"
    assert main(["draw", str(EXAMPLES / "allgather.pln"), "-R", "2", "-o", str(out), "--format", "svg"]) == 0
    assert out.read_text().startswith("<svg")


def test_plan_title_clears_the_phase_labels():
    """The 14 px title (baseline 18) and the phase labels (11 px) touched: 'GPUs (R=8)' ran into
    '0: SNAC reduce'.  A phase label's capitals start at least 8 px below the title's descenders."""
    from purlinc.draw.hier import plan_svg
    from purlinc.snac.hierplan import plan_hierarchical

    spec = pipeline.spec_stage(pipeline.parse_stage(pipeline.load_source(EXAMPLES / "allreduce.pln")), 8, {})
    text = plan_svg(plan_hierarchical(spec, 4, pipeline.default_options(spec)))
    root = ET.fromstring(text)
    texts = root.findall(NS + "text")
    title = float(texts[0].get("y"))
    phases = [float(t.get("y")) for t in texts if re.match(r"\d+: ", t.text or "")]
    buffers = [float(t.get("y")) for t in texts if t.get("font-weight") == "bold" and t is not texts[0]]
    assert phases and buffers
    assert min(phases) - 8 >= title + 4 + 8  # capitals 8 px above the baseline, descenders 4 px below
    assert min(buffers) - 8 >= max(phases) + 3 + 3


def _subtitle(text: str) -> str:
    """The first panel's second line (the schedule's options)."""
    return ET.fromstring(text).find(f"{NS}g[@class='panel']").findall(NS + "text")[1].text


@pytest.mark.parametrize("path, argv, says", [
    ("allreduce.pln", ["-a", "ring", "--registered", "both"], "registered in+out"),
    ("allgather.pln", ["-a", "ring", "--slots", "1"], "1 staging slot per edge"),
    ("sized/alltoallv.pln", [], "run-time sizes n[4][4] of x"),
    ("fused/allreduce_add_rmsnorm.pln", [], "epilogue rows(4096)"),
])
def test_subtitle_names_every_option_that_changes_the_schedule(tmp_path, path, argv, says):
    """The subtitle said nothing of slots, registered buffers, run-time sizes or an epilogue: a
    ring allreduce --registered both (other steps) and alltoallv read as the plain schedules."""
    out = tmp_path / "d.svg"
    assert main(["draw", str(EXAMPLES / path), "-R", "4", *argv, "-o", str(out)]) == 0
    subtitle = _subtitle(out.read_text())
    assert says in subtitle
    root = ET.fromstring(out.read_text())  # and the canvas is wide enough for it (11 px monospace)
    assert 10 + 0.602 * 11 * len(subtitle) <= float(root.get("width"))
    plain = tmp_path / "plain.svg"
    assert main(["draw", str(EXAMPLES / "allreduce.pln"), "-R", "4", "-o", str(plain)]) == 0
    assert not re.search(r"slot|registered|sizes|epilogue", _subtitle(plain.read_text()))


@pytest.mark.parametrize("timeline", [False, True])
def test_previous_call_mark_points_at_its_own_wait(tmp_path, timeline):
    """The red mark sat left of the wait, on the top-right corner of the step before it (3 px
    away in the schedule view), and read as that step's.  It now points down at the wait's
    own first pixels from the lane's margin, and touches no other box."""
    out = tmp_path / "d.svg"
    argv = ["draw", str(EXAMPLES / "allgather.pln"), "-R", "4", "-a", "ring", "--slots", "1", "-o", str(out)]
    assert main(argv + (["--timeline"] if timeline else [])) == 0
    root = ET.fromstring(out.read_text())
    marks = 0
    for lane in _find(root, "g", "lane"):
        boxes = [(g, g.find(NS + "rect")) for g in _find(lane, "g", "step")]
        for g, rect in boxes:
            mark = g.find(f"{NS}g[@class='prev-call']")
            if mark is None:
                continue
            marks += 1
            m = re.fullmatch(r"M([\d.]+),([\d.]+) h6 l-3,([\d.]+) z", mark.find(NS + "path").get("d"))
            left, top, height = (float(v) for v in m.groups())
            x, y, w = (float(rect.get(k)) for k in ("x", "y", "width"))
            tip_x, tip_y = left + 3, top + height
            assert x <= tip_x <= x + w and y <= tip_y <= y + 2  # at the wait's top edge
            assert top >= y - (svg.LANE_H - svg.BOX_H) / 2  # inside its own lane
            # Below the boxes' top edge (y) the triangle is tip_x +- half; that part lies on the
            # wait (above it, the lane's margin is empty): over no other step's box.
            half = 3 * (tip_y - y) / height
            for other, orect in boxes:
                if other is not g:
                    ox, ow = float(orect.get("x")), float(orect.get("width"))
                    assert tip_x + half <= ox + 0.01 or tip_x - half >= ox + ow - 0.01
    assert marks == 4  # each rank's first slot wait: for the previous call's reader (k <= 0)


def _labels(root) -> dict[tuple[int, int, int], list[str]]:
    return {(int(g.get("data-rank")), int(g.get("data-channel")), int(g.get("data-index"))):
            [t.text for t in g.findall(NS + "text")] for g in _find(root, "g", "step")}


def test_a_stage_to_a_two_digit_rank_keeps_its_peer_in_the_label():
    """At R >= 10 'x[0][12]>r12' did not fit a column and was cut to 'x[0][12]>…', losing the
    rank it goes to.  The chunk keeps its row and the peer leads the last one; every label
    still fits its box (9.5 px monospace, 0.602 em a character, from 3 px in)."""
    schedule = _schedule("alltoall", 16)
    root = ET.fromstring(_svg_of(schedule))
    labels = _labels(root)
    stages = [rows for key, rows in labels.items() if key[0] == 0 and rows[0] == "stage"]
    assert ["stage", "x[0][1]>r1", "L4"] in stages  # fits: as before
    assert ["stage", "x[0][12]", ">r12 L4"] in stages
    signals = [rows for key, rows in labels.items() if key[0] == 12 and rows[0] in ("notify ack", "wait ack")]
    assert ["notify ack", "r9.sig[26]"] in signals and ["notify ack", "sig[26]", ">r10"] in signals  # 'r10.sig[26]'
    assert ["wait ack", "sig[15]"] in signals  # 'r12.sig[15]': the lane is rank 12's
    for g in _find(root, "g", "step"):
        box = g.find(NS + "rect")
        right = float(box.get("x")) + float(box.get("width"))
        for text in g.findall(NS + "text"):
            assert "\u2026" not in text.text
            assert float(text.get("x")) + 0.602 * 9.5 * len(text.text) <= right


def test_slices_of_one_chunk_are_told_apart():
    """With --slices 2 the two stages of x[0] to r1 had the same label: read as the same data
    moved twice.  Each data step names its slice (absolute: channel 1's are S..2S-1)."""
    source = pipeline.load_source(EXAMPLES / "allreduce.pln")
    spec = pipeline.spec_stage(pipeline.parse_stage(source), 2, {})
    schedule = pipeline.snac_stage(spec, LowerOptions(algorithm=Algorithm.TWO_SHOT, channels=2, slices=2))
    labels = _labels(ET.fromstring(_svg_of(schedule, collapse=False)))
    by_channel = {c: {rows[-1] for key, rows in labels.items() if key[1] == c and rows[0] == "stage"} for c in (0, 1)}
    assert by_channel == {0: {"s0 L4", "s1 L4"}, 1: {"s2 L4", "s3 L4"}}
    assert all(not rows[-1].startswith("s") for rows in labels.values() if rows[0] in ("notify", "wait"))
    one = _labels(ET.fromstring(_svg_of(_schedule("allreduce", 2, channels=2))))  # 1 slice a channel: no slice
    assert all(rows[-1] == "L4" for rows in one.values() if rows[0] in ("stage", "reduce", "copy"))


def test_the_legend_explains_the_epilogue_border_where_there_is_one(tmp_path):
    """An epilogue step's box has no chunk colour, only a green border the legend did not
    explain.  The legend does where the drawing has one (and its line fits the canvas)."""
    def legend_note(path, *argv):
        out = tmp_path / "d.svg"
        assert main(["draw", str(EXAMPLES / path), "-R", "2", *argv, "-o", str(out)]) == 0
        root = ET.fromstring(out.read_text())
        epilogues = [g for g in _find(root, "g", "step") if g.get("data-verb") == "epilogue"]
        note = [t for t in _find(root, "g", "legend")[0].findall(NS + "text") if "arrow:" in (t.text or "")][0]
        assert float(note.get("x")) + 0.602 * 10 * len(note.text) <= float(root.get("width"))
        return note.text, epilogues

    note, epilogues = legend_note("fused/allreduce_add_rmsnorm.pln")
    assert epilogues and all(g.find(NS + "rect").get("stroke") == svg._STROKE["epilogue"] for g in epilogues)
    assert "green border: epilogue" in note
    note, epilogues = legend_note("fused/allreduce_add_rmsnorm.pln", "--compare", "ring,direct-push")
    assert epilogues and "green border: epilogue" in note
    note, epilogues = legend_note("allreduce.pln")
    assert not epilogues and "epilogue" not in note


def test_plan_drawing_says_what_each_schedule_box_is(tmp_path):
    """A plan's boxes said only 'schedule #1' (its options and size in a hover, which a PNG or
    print lacks) and nothing said what the NCCL lines' colours mean.  A key under the rows
    says both, inside the canvas."""
    from purlinc.draw.hier import EM, ROW, TOP

    out = tmp_path / "plan.svg"
    argv = ["draw", str(EXAMPLES / "allreduce.pln"), "-R", "8", "--gpus-per-node", "2", "-a", "ring", "--channels", "2"]
    assert main(argv + ["-o", str(out)]) == 0
    root = ET.fromstring(out.read_text())
    width, height = float(root.get("width")), float(root.get("height"))
    boxes = {t.text for t in root.findall(NS + "text") if re.fullmatch(r"schedule #\d+", t.text or "")}
    key = [t for t in root.findall(NS + "text") if "key" in _classes(t)]
    assert boxes == {"schedule #0", "schedule #1"}
    assert [t.text.split(":")[0] for t in key[:2]] == ["schedule #0", "schedule #1"]
    assert all("ring/c2/s1" in t.text and "steps in all" in t.text for t in key[:2])
    assert "NCCL lines" in key[-1].text and "coloured by" in key[-1].text
    for t in key:
        assert float(t.get("y")) - 11 >= TOP + ROW * 8  # under the last rank's row
        assert float(t.get("y")) + 4 <= height and float(t.get("x")) + EM * 11 * len(t.text) <= width


def test_a_timeline_of_run_time_sizes_says_every_chunk_is_modelled_full(tmp_path):
    """alltoallv's timeline drew every chunk the same length with nothing to say the sizes
    are the call's (on the device): a note under the lanes says the model takes them full."""
    out = tmp_path / "t.svg"
    assert main(["draw", str(EXAMPLES / "sized/alltoallv.pln"), "-R", "4", "--timeline", "--bytes", "1MiB",
                 "-o", str(out)]) == 0
    root = ET.fromstring(out.read_text())
    notes = [t.text for t in _find(root, "text", "note")]
    assert notes == ["run-time sizes: every chunk modelled full (262144 B); a call moves the sizes n gives, at most that"]
    assert 10 + 0.602 * 11 * len(notes[0]) <= float(root.get("width"))
    plain = tmp_path / "p.svg"
    assert main(["draw", str(EXAMPLES / "sized/alltoallv.pln"), "-R", "4", "-o", str(plain)]) == 0  # no model: no note
    assert not _find(ET.fromstring(plain.read_text()), "text", "note")


def test_a_long_note_under_the_lanes_fits_the_canvas():
    """The canvas took the lanes, the legend and the subtitle, not the notes: a trace's note
    lists every rank's call number ('call [3, 3, ...]', 3 characters a rank), past the edge
    at R=64.  A note of any length is now inside."""
    from dataclasses import replace

    schedule = _schedule("allreduce", 2)
    drawing = build(schedule)
    times = schedule_times(schedule, drawing, CostModel(), chunk_bytes=1024)
    note = "measured on the GPU, call " + str([3] * 64) + ", round 0; timebase globaltimer; clocks aligned by ping-pong"
    root = ET.fromstring(svg.render([svg.Panel(drawing, replace(times, notes=(note,)))], width=400))
    shown = [t for t in _find(root, "text", "note") if t.text == note]
    assert shown and float(shown[0].get("x")) + 0.602 * 11 * len(note) <= float(root.get("width"))


def test_compared_timelines_tick_at_the_same_times(tmp_path):
    """The panels share one x scale but each chose its tick step from its own length: 5 us
    apart over ring's panel, 10 us over direct-push's, so equal times had unequal marks.  The
    ticks of a shorter panel are now those of the longest, as far as it goes."""
    out = tmp_path / "cmp.svg"
    assert main(["draw", str(EXAMPLES / "allreduce.pln"), "-R", "4", "--compare", "ring,direct-push,two-shot",
                 "--bytes", "1MiB", "-o", str(out)]) == 0
    root = ET.fromstring(out.read_text())
    panels = [[(float(t.get("x")), t.text) for t in axis.findall(NS + "text")]
              for axis in _find(root, "g", "axis")]
    assert len(panels) == 3
    longest = max(panels, key=len)
    assert all(ticks == longest[:len(ticks)] and len(ticks) >= 3 for ticks in panels), panels


def test_an_acknowledgement_is_labelled_ack_not_as_data_sent():
    """Ring scatter's rank 1, done with x[1], notifies r0 that its slot is free: the box read
    'notify x[1]>r0', the label of x[1] being sent to r0.  Notifies and waits of ack signals
    say 'ack'; data ones do not."""
    from purlinc.snac.ir import Role

    schedule = _schedule("scatter", 4, algorithm="ring")
    acks = {d.signal for d in schedule.signal_decls() if d.role is Role.ACK}
    root = ET.fromstring(_svg_of(schedule))
    seen = set()
    for g in _find(root, "g", "step"):
        step = schedule.program(int(g.get("data-rank")), 0).steps[int(g.get("data-index"))]
        if isinstance(step, (Notify, Wait)):
            head = g.findall(NS + "text")[0].text
            assert head == f"{g.get('data-verb')}{' ack' if step.signal in acks else ''}"
            seen.add(head)
    assert seen == {"notify", "notify ack", "wait", "wait ack"}
    assert ["notify ack", "x[1]>r0", "L4"] in _labels(root).values()


# The drawings docs/DRAW.md shows, each with the command line that makes it: the docs show what
# the code draws today (three of them had gone stale as the drawing gained labels and marks).
DOC_IMAGES = {
    "allreduce_r4_ring.svg": ["examples/allreduce.pln", "-R", "4", "-a", "ring", "--channels", "4"],
    "allreduce_r4_compare.svg": ["examples/allreduce.pln", "-R", "4", "--compare", "direct-push,two-shot,ring",
                                 "--bytes", "1048576", "--dtype", "bfloat16", "--channels", "8"],
    "allreduce_traced_h200x2.svg": ["examples/allreduce.pln", "--trace", "docs/img/allreduce_traced_h200x2.json"],
}


@pytest.mark.parametrize("name", sorted(DOC_IMAGES))
def test_the_docs_drawings_are_what_the_code_draws(name, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / name
    assert main(["draw", *DOC_IMAGES[name], "-o", str(out)]) == 0
    assert out.read_text() == (ROOT / "docs" / "img" / name).read_text(), (
        f"docs/img/{name} is stale: purlinc draw {' '.join(DOC_IMAGES[name])} -o docs/img/{name}")
    assert f"(img/{name})" in (ROOT / "docs" / "DRAW.md").read_text()


def test_one_rank_draws_one_step_and_no_staging_copies():
    """R=1 said "2 staging copies by call parity" of a schedule that stages nothing, and "1 steps"."""
    def drawn(world):
        spec = pipeline.spec_stage(pipeline.parse_stage(pipeline.load_source(EXAMPLES / "allgather.pln")), world, {})
        schedule = pipeline.snac_stage(spec, LowerOptions(algorithm=Algorithm.DIRECT_PUSH, stage_copies=2))
        return schedule, _svg_of(schedule)

    schedule, text = drawn(1)
    assert schedule.stage_units == 0 and schedule.stage_copies == 2
    assert "staging copies" not in text
    assert "; 1 step on the longest lane<" in text
    assert "staging copies by call parity" in drawn(2)[1]
