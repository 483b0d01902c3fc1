"""``purlinc draw``: what the marks say and where they run.  Arrows never cross a box's label
and end on the right boxes' edges; a trace whose waits end before the notifies that release
them says so; the canvas holds the heading; a plan's line colours tell every GPU of a node
apart; the hover text and the docs say what they mean."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import pytest

from purlinc.cli import main

from test_draw import EXAMPLES, NS, ROOT, _find, _good_trace_text

CHAR = 0.602 * 9.5  # a character of the boxes' 9.5 px monospace labels (DejaVu Sans Mono)
ASCENT, DESCENT = 0.76 * 9.5, 0.24 * 9.5


def _draw(tmp_path, *argv) -> ET.Element:
    out = tmp_path / "d.svg"
    assert main(["draw", *map(str, argv), "-o", str(out)]) == 0
    return ET.fromstring(out.read_text())


# ---- arrows ------------------------------------------------------------------------------

def _path_points(d: str) -> list[tuple[float, float]]:
    """Points along an arrow's path every half pixel (M, L and C commands)."""
    tokens = re.findall(r"[MLC]|-?[\d.]+", d)
    points, at, i = [], None, 0
    while i < len(tokens):
        command = tokens[i]
        if command == "M":
            at = (float(tokens[i + 1]), float(tokens[i + 2]))
            points.append(at)
            i += 3
        elif command == "L":
            end = (float(tokens[i + 1]), float(tokens[i + 2]))
            n = max(int(max(abs(end[0] - at[0]), abs(end[1] - at[1])) * 2), 1)
            points += [(at[0] + (end[0] - at[0]) * k / n, at[1] + (end[1] - at[1]) * k / n) for k in range(1, n + 1)]
            at, i = end, i + 3
        else:  # a cubic curve, as the arrows were drawn before
            c = [at] + [(float(tokens[i + j]), float(tokens[i + j + 1])) for j in (1, 3, 5)]
            for k in range(1, 401):
                t = k / 400
                w = ((1 - t) ** 3, 3 * t * (1 - t) ** 2, 3 * t * t * (1 - t), t ** 3)
                points.append((sum(wi * p[0] for wi, p in zip(w, c)), sum(wi * p[1] for wi, p in zip(w, c))))
            at, i = c[-1], i + 7
    return points


def _panels(root):
    """Per panel: boxes by "rank,channel,index" -> (x, y, w, h), every label's box, the arrows."""
    for panel in _find(root, "g", "panel"):
        boxes, labels = {}, []
        for g in _find(panel, "g", "step"):
            rect = g.find(NS + "rect")
            x, y, w, h = (float(rect.get(k)) for k in ("x", "y", "width", "height"))
            boxes[f"{g.get('data-rank')},{g.get('data-channel')},{g.get('data-index')}"] = (x, y, w, h)
            for text in g.findall(NS + "text"):
                tx, ty = float(text.get("x")), float(text.get("y"))
                labels.append((tx, ty - ASCENT, tx + CHAR * len(text.text), ty + DESCENT, text.text))
        yield boxes, labels, _find(panel, "path", "arrow")


def _on_edge(point, box) -> bool:
    x, y, w, h = box
    return x - 0.01 <= point[0] <= x + w + 0.01 and min(abs(point[1] - y), abs(point[1] - y - h)) < 0.01


ARROW_DRAWINGS = {
    "direct-push R=4": ["examples/allreduce.pln", "-R", "4"],
    "ring 4 channels": ["examples/allreduce.pln", "-R", "4", "-a", "ring", "--channels", "4"],
    "every channel": ["examples/allgather.pln", "-R", "3", "--channels", "2", "--all-channels"],
    "compare": ["examples/allreduce.pln", "-R", "4", "--compare", "direct-push,two-shot,ring", "--bytes", "1MiB",
                "--channels", "8"],
    "timeline R=8": ["examples/reduce_scatter.pln", "-R", "8", "--timeline", "--bytes", "4MiB"],
    "trace": ["examples/allreduce.pln", "--trace", "docs/img/allreduce_traced_h200x2.json"],
    "alltoall R=12": ["examples/alltoall.pln", "-R", "12"],
}


@pytest.mark.parametrize("name", sorted(ARROW_DRAWINGS))
def test_arrows_cross_no_label_and_end_on_their_boxes(name, tmp_path, monkeypatch):
    """Arrows ran at the boxes' mid-height, through the middle label row ('r2.sig[0]') of the
    notify, the wait and every box between them."""
    monkeypatch.chdir(ROOT)
    root = _draw(tmp_path, *ARROW_DRAWINGS[name])
    drawn = 0
    for boxes, labels, arrows in _panels(root):
        for arrow in arrows:
            points = _path_points(arrow.get("d"))
            assert _on_edge(points[0], boxes[arrow.get("data-notify")]), (arrow.get("d"), arrow.get("data-notify"))
            assert _on_edge(points[-1], boxes[arrow.get("data-wait")]), (arrow.get("d"), arrow.get("data-wait"))
            for x0, y0, x1, y1, text in labels:
                crossed = [p for p in points if x0 + 0.3 < p[0] < x1 - 0.3 and y0 + 0.3 < p[1] < y1 - 0.3]
                assert not crossed, f"{name}: arrow {arrow.get('data-notify')} -> {arrow.get('data-wait')} " \
                                    f"crosses label {text!r} at {crossed[0]}"
            drawn += 1
    assert drawn


def _segments(d: str) -> list[tuple[float, float, float, float]]:
    """An arrow's straight segments (its path is M and L commands)."""
    xy = [float(v) for v in re.findall(r"-?[\d.]+", d)]
    points = list(zip(xy[::2], xy[1::2]))
    return [(*a, *b) for a, b in zip(points, points[1:])]


def _shared_stretch(a, b) -> bool:
    """Whether segments a and b lie on one line for more than a point."""
    (ax0, ay0, ax1, ay1), (bx0, by0, bx1, by1) = a, b
    if ay0 == ay1 == by0 == by1:
        return min(max(ax0, ax1), max(bx0, bx1)) - max(min(ax0, ax1), min(bx0, bx1)) > 1e-6
    if ax0 == ax1 == bx0 == bx1:
        return min(max(ay0, ay1), max(by0, by1)) - max(min(ay0, ay1), min(by0, by1)) > 1e-6
    return False


@pytest.mark.parametrize("argv", [
    ["examples/allgather.pln", "-R", "4", "-a", "ring"],
    ["examples/allreduce.pln", "-R", "8", "-a", "ring", "--channels", "2"],
    ["examples/allgather.pln", "-R", "2"],
])
def test_no_two_arrows_run_on_one_line(argv, tmp_path, monkeypatch):
    """A ring's wrap-around arrow (rank R-1 up to rank 0) took the track of every other arrow of
    its column (by index, n % 3), and left its notify at the x where the notify above left for
    the lane below: it lay on the arrow from rank 0 down, as if rank 0's notify released its own
    wait, and a line joined the notifies of ranks R-2 and R-1.  Two arrows may cross; none lies
    on another."""
    monkeypatch.chdir(ROOT)
    root = _draw(tmp_path, *argv)
    for _, _, arrows in _panels(root):
        paths = [(a.get("data-notify") + " -> " + a.get("data-wait"), _segments(a.get("d"))) for a in arrows]
        assert len(paths) > 1
        for n, (name, segments) in enumerate(paths):
            for other, others in paths[n + 1:]:
                shared = [(s, t) for s in segments for t in others if _shared_stretch(s, t)]
                assert not shared, f"{name} and {other} share {shared[0]}"


def test_a_route_crosses_a_lane_between_boxes():
    """Two lanes down, over a lane whose boxes touch (a time view): it crosses at their
    boundary, the nearest to the wait, and enters the wait by its top edge near its end."""
    from purlinc.draw import route

    lanes = [route.LaneSpan(10, 46, ((0, 50),)), route.LaneSpan(58, 94, ((0, 40), (40, 90), (90, 200))),
             route.LaneSpan(106, 142, ((100, 150),))]
    points = route.route(lanes, route.End(0, 50, 0), route.End(100, 150, 2), into_end=True, track=1)
    assert points == [(46, 46), (46, 52), (90, 52), (90, 100), (146, 100), (146, 106)]
    # upwards: out of the top edge, into the wait's bottom edge
    # (out of the top edge twice as far from the end as out of the bottom one: 9 px)
    points = route.route(lanes, route.End(100, 150, 2), route.End(0, 50, 0), into_end=False)
    assert points[0] == (141, 106) and points[-1] == (9, 46)


def test_a_crossing_found_by_bisection_is_the_one_a_scan_of_every_box_finds():
    """route's lanes index their boxes once (an all-gather at R=128 took minutes scanning every
    box per crossing): random lanes, boxes that touch, overlap or stand apart, give the same
    crossing as the scan over every free x."""
    import random

    from purlinc.draw import route

    def scanned(lane, at, to):
        if not any(x0 <= to <= x1 for x0, x1 in lane.spans):
            return to
        lo, hi = min(at, to), max(at, to)
        free = route._free_xs(lane) + ([at] if not any(x0 <= at <= x1 for x0, x1 in lane.spans) else [])
        return min(free, key=lambda x: (max(lo - x, x - hi, 0.0), abs(x - to)))  # ties: the first in this order

    rng = random.Random(7)
    for _ in range(3000):
        x, spans = 0.0, []
        for _ in range(rng.randint(1, 12)):
            x += rng.choice((0.0, 0.5, 3.0, 10.0, -4.0))  # touching, near, apart, overlapping
            width = rng.choice((4.0, 61.0, 20.0))
            spans.append((x, x + width))
            x += width
        lane = route.LaneSpan(0, 36, tuple(sorted(spans)))
        for _ in range(8):
            at, to = rng.uniform(-20, x + 20), rng.uniform(-20, x + 20)
            assert route._crossing(lane, at, to) == scanned(lane, at, to), (lane.spans, at, to)
            assert route._crossing(lane, to, to) == scanned(lane, to, to), (lane.spans, to)  # ties: at == to
            whole = float(rng.randint(-20, int(x) + 20))  # whole and half coordinates: ties between free x's
            assert route._crossing(lane, whole, whole) == scanned(lane, whole, whole), (lane.spans, whole)
        probe = rng.uniform(-5, x + 5)
        assert route._covered(lane, probe) == any(x0 <= probe <= x1 for x0, x1 in lane.spans)


# ---- a trace whose clocks contradict it ----------------------------------------------------

CAUSALITY = ("waits end before the notify that releases them by more than the clocks' uncertainty")


def _notes(root) -> list[str]:
    return [t.text for t in _find(root, "text", "note")]


def test_the_docs_trace_says_its_clocks_are_misaligned(tmp_path, monkeypatch):
    """Rank 1's notify at ~18 us released rank 0's wait that ended at ~5 us, +-1.5 us, and the
    drawing said nothing."""
    monkeypatch.chdir(ROOT)
    root = _draw(tmp_path, "examples/allreduce.pln", "--trace", "docs/img/allreduce_traced_h200x2.json")
    warning = [t for t in _find(root, "text", "note") if CAUSALITY in t.text]
    assert len(warning) == 1 and warning[0].get("fill") == "#b00020"
    assert warning[0].text.startswith("warning: 2 waits end before") and warning[0].text.endswith(
        "the ranks' clocks are misaligned, so cross-rank order in this drawing is not reliable")
    # DRAW.md quotes the warning with N waits and a gap of D us: it left out the gap and the prefix
    doc = " ".join((ROOT / "docs" / "DRAW.md").read_text().split())
    match = re.search(r'"(warning: N waits end before [^"]*)"', doc)
    assert match, "DRAW.md does not quote the warning as drawn"
    quoted = match.group(1)
    shown = re.escape(quoted).replace("N", r"\d+", 1).replace(r"\ D\ us", r"\ [0-9.]+\ us")
    assert re.fullmatch(shown, warning[0].text), (quoted, warning[0].text)


def test_a_causal_trace_has_no_warning_and_a_shifted_one_has(tmp_path):
    data = json.loads(_good_trace_text())
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    assert not [n for n in _notes(_draw(tmp_path, EXAMPLES / "allreduce.pln", "--trace", path)) if CAUSALITY in n]
    for event in data["events"]:  # rank 1 drawn 20 us late: its notifies after the waits they release
        if event["rank"] == 1:
            event["start_ns"] += 20000
            event["end_ns"] += 20000
    path.write_text(json.dumps(data))
    notes = _notes(_draw(tmp_path, EXAMPLES / "allreduce.pln", "--trace", path))
    assert [n for n in notes if CAUSALITY in n and n.startswith("warning: ")], notes


def test_the_clocks_uncertainty_excuses_a_small_inversion(tmp_path):
    """Only an inversion larger than both ranks' uncertainty together is reported."""
    data = json.loads(_good_trace_text())
    for entry in data["clock"]["ranks"]:
        entry["uncertainty_ns"] = 15000.0
    for event in data["events"]:
        if event["rank"] == 1:
            event["start_ns"] += 20000
            event["end_ns"] += 20000
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    assert not [n for n in _notes(_draw(tmp_path, EXAMPLES / "allreduce.pln", "--trace", path)) if CAUSALITY in n]


# ---- the canvas holds the heading -----------------------------------------------------------

def test_a_narrow_drawing_holds_its_heading(tmp_path):
    """At --width 400 a long heading ran past the canvas's right edge."""
    name = "allreduce_with_a_long_name_for_the_heading_to_be_the_widest_line"
    text = (EXAMPLES / "allreduce.pln").read_text().replace("collective allreduce", f"collective {name}")
    pln = tmp_path / "long.pln"
    pln.write_text(text)
    root = _draw(tmp_path, pln, "-R", "2", "--timeline", "--width", "400")
    heading = next(t for t in root.iter(NS + "text") if t.get("font-size") == "15")
    assert heading.text.startswith(name)
    assert float(root.get("width")) >= 10 + 0.602 * 15 * len(heading.text)


# ---- the hierarchical plan's colours and key --------------------------------------------------

def test_a_plan_colours_every_gpu_of_a_node_apart(tmp_path):
    """16 GPUs a node drew GPU 8's lines in GPU 0's colour (8 colours, by GPU mod 8)."""
    root = _draw(tmp_path, EXAMPLES / "allreduce.pln", "-R", "32", "--gpus-per-node", "16")
    by_gpu: dict[int, set[str]] = {}
    for line in root.iter(NS + "line"):
        sender = int(re.match(r"r(\d+) ->", line.find(NS + "title").text).group(1))
        by_gpu.setdefault(sender % 16, set()).add(line.get("stroke"))
    assert sorted(by_gpu) == list(range(16)) and all(len(c) == 1 for c in by_gpu.values())
    assert len(set.union(*by_gpu.values())) == 16


def test_a_single_node_plan_explains_no_lines_it_does_not_draw(tmp_path):
    root = _draw(tmp_path, EXAMPLES / "allreduce.pln", "-R", "8", "--gpus-per-node", "8")
    assert not list(root.iter(NS + "line"))
    key = [t.text for t in root.iter(NS + "text") if t.get("class") == "key"]
    assert not [k for k in key if k.startswith("NCCL lines")]
    assert "phase 1 (NCCL local): nothing moves between ranks (local copies, not drawn)" in key
    root = _draw(tmp_path, EXAMPLES / "allreduce.pln", "-R", "16", "--gpus-per-node", "8")
    assert [t for t in root.iter(NS + "text") if (t.text or "").startswith("NCCL lines")]


# ---- hover text and the docs -------------------------------------------------------------------

def test_a_note_in_parentheses_is_not_put_in_more(tmp_path):
    root = _draw(tmp_path, EXAMPLES / "allreduce.pln", "-R", "2")
    details = [g.get("data-detail") for g in _find(root, "g", "step")]
    assert not [d for d in details if "((" in d or "))" in d]
    assert any(d.endswith("  (x[0], x[1] from r1)") for d in details), details


def test_an_unparenthesized_note_is_put_in_parentheses():
    from purlinc.draw.model import _parenthesized

    assert _parenthesized("(x from r3)") and not _parenthesized("(a) and (b)") and not _parenthesized("x (y)")


def test_the_docs_say_an_epilogue_rounds_bytes_to_whole_rows(tmp_path):
    """DRAW.md said --bytes is rounded down to the element size; an epilogue's chunk is whole
    rows, one row at least: --bytes 1 models 4096 bfloat16 elements a chunk."""
    root = _draw(tmp_path, EXAMPLES / "fused" / "allreduce_add_rmsnorm.pln", "-R", "2", "--timeline", "--bytes", "1")
    heading = next(t.text for t in root.iter(NS + "text") if t.get("font-size") == "15")
    assert "8192 B per chunk" in heading
    doc = " ".join((ROOT / "docs" / "DRAW.md").read_text().split())
    assert "rounded down to whole rows, or up to one row where `--bytes` gives a chunk less than a row" in doc
