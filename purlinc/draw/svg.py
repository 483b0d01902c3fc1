"""Drawings as SVG text: one panel per schedule, one lane group per rank, boxes and arrows.

A small writer, no plotting library.  Every element a reader (or a test) looks for carries a
class and data attributes:

- ``g.rank[data-rank]``: one per rank and panel, holding that rank's lanes (``g.lane``, one
  per drawn channel);
- ``g.step[data-rank][data-channel][data-index][data-verb][data-chunk][data-line]`` with a
  ``<title>`` (the hover text: operands, note, .pln line; measured times in a trace);
- ``path.arrow[data-notify][data-wait]``: "rank,channel,index" of both ends;
- ``g.prev-call``: the mark on a wait released by an earlier call.
"""

from __future__ import annotations

import colorsys
import math
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

from purlinc.draw import route
from purlinc.draw.defaults import MIN_WIDTH
from purlinc.draw.model import Drawing, StepBox
from purlinc.draw.timeline import Times

LABEL_W = 170  # lane labels
LANE_H = 44
BOX_H = 36
PREV_MARK_H = (LANE_H - BOX_H) / 2 + 1  # the previous-call mark: the lane's margin above a box, 1 px into it
COL_W = 64  # one step in the schedule view
RANK_GAP = 8
HEAD_H = 46
AXIS_H = 22
LEGEND_WRAP = 1200  # the legend wraps at the lanes' width, or this where the lanes are narrower
LEGEND_ROW_H = 16
_LEGEND_NOTE = "arrow: notify -> the wait it releases; dashed: wait; red mark: waits for the previous call"
# Added where a drawing has epilogue steps: their box has no chunk colour, only this border.
_LEGEND_EPILOGUE = "; green border: epilogue (on rows of out)"
FONT = "DejaVu Sans Mono, Menlo, Consolas, monospace"

_STROKE = {
    "stage": "#4d4d4d", "stage+notify": "#1f4fbf", "notify": "#1f4fbf", "wait": "#b8401a",
    "copy": "#4d4d4d", "reduce": "#4d4d4d", "epilogue": "#2e7d32",
}
_SHORT = {"stage+notify": "stage+ntf", "notify": "notify", "wait": "wait", "stage": "stage", "copy": "copy",
          "reduce": "reduce", "epilogue": "epilogue"}


def palette(chunks: tuple[str, ...]) -> dict[str, str]:
    """Chunk name -> fill colour: hues spread evenly in the drawing's stable chunk order, so
    a chunk has the same colour on every rank (and x[i] keeps its colour between panels of
    one collective)."""
    colours = {}
    n = max(len(chunks), 1)
    for i, name in enumerate(chunks):
        # Alternate lightness so neighbours differ even when there are many chunks.
        r, g, b = colorsys.hls_to_rgb(i / n, 0.78 if i % 2 == 0 else 0.68, 0.62)
        colours[name] = f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"
    return colours


@dataclass(frozen=True, slots=True)
class Panel:
    drawing: Drawing
    times: Times
    heading: str = ""
    measured: dict | None = None  # (rank, channel, index) -> text added to the hover (traces)


def _fmt(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".")


@dataclass(frozen=True, slots=True)
class Scale:
    """The x axis every panel shares: the lane labels' column, then ``px`` pixels per x unit
    (a step, or a microsecond)."""
    left: float
    px: float
    # The longest panel's total: every panel's ticks are spaced for it, so that compared
    # timelines' ticks fall at the same times (they were 2 us apart in one panel, 5 in the next).
    span: float = 0.0

    def at(self, value: float) -> float:
        return self.left + value * self.px


def _label_column(panels: list[Panel]) -> float:
    """LABEL_W, or wider where a lane label needs it (12 px monospace, 0.6 em a character, from
    x = 8): in a fixed 170 px, 'rank 10  (x16 channels)' ran under the lane's first box."""
    longest = max((len(lane.label) for p in panels for lane in p.drawing.lanes), default=0)
    return max(LABEL_W, math.ceil(8 + 0.6 * 12 * longest + 10))


def _scale(panels: list[Panel], width: int | None) -> Scale:
    """The x axis, shared by every panel (so compared timelines line up)."""
    left = _label_column(panels)
    longest = max((p.times.total for p in panels), default=1.0) or 1.0
    if all(p.times.unit == "step" for p in panels):
        return Scale(left, COL_W, longest)
    target = width or max(1200, min(4000, 40 * max(len(l.steps) for p in panels for l in p.drawing.lanes)))
    # Never narrower than MIN_WIDTH (and the time axis never shorter than in MIN_WIDTH with
    # the usual label column): below left + 30 the scale turns negative and time runs
    # backwards (the CLI refuses such widths; a caller of render() gets the minimum).
    return Scale(left, (max(target, MIN_WIDTH, left + MIN_WIDTH - LABEL_W) - left - 30) / longest, longest)


def _panel_height(panel: Panel) -> int:
    ranks = panel.drawing.world_size
    notes = len(panel.drawing.notes) + len(panel.times.notes)
    return HEAD_H + AXIS_H + len(panel.drawing.lanes) * LANE_H + ranks * RANK_GAP + 14 * notes


def _box_label(box: StepBox, w: float) -> list[str]:
    if w < 28:
        return []
    chars = max(int((w - 4) / 5.6), 1)
    what = box.chunk or (box.signal.format() if box.signal is not None else "")
    last = [f"s{box.slice_index}"] if box.slice_index is not None else []
    if box.line is not None:
        last.append(f"L{box.line}")
    sig = f"sig[{box.signal.index}]" if box.signal is not None else ""
    if box.peer is not None and box.verb != "wait":
        what = f"{box.chunk}>r{box.peer}" if box.chunk else f"r{box.peer}.{sig}" if sig else what
        if len(what) > chars and (box.chunk or sig):
            # From R=10 on, 'x[0][12]>r12' was cut to 'x[0][12]>…' and 'r10.sig[11]' to
            # 'r10.sig[1…': the rank it goes to, or the signal, was lost.  The chunk (or the
            # signal) keeps its row; the peer leads the last one.
            what = box.chunk or sig
            last.insert(0, f">r{box.peer}")
    elif not box.chunk and sig and len(what) > chars:
        what = sig  # a wait polls its own rank's signal: the lane names the rank
    rows = [_SHORT[box.verb] + (" ack" if box.ack else ""), what, " ".join(last)]
    return [_fit(r, chars) for r in rows if r]


def _fit(text: str, chars: int) -> str:
    """``text`` in ``chars`` characters, a cut one ending in an ellipsis: cut bare, x[0][3]
    read "x[0]", the name of another chunk."""
    if len(text) <= chars:
        return text
    return text[:chars - 1] + "\u2026" if chars > 1 else "\u2026"


def _render_panel(panel: Panel, y0: float, scale: Scale, colours: dict, parts: list[str]) -> tuple[float, dict]:
    d, t = panel.drawing, panel.times
    parts.append(f'<g class="panel" transform="translate(0,{_fmt(y0)})">')
    parts.append(f'<text x="10" y="20" font-size="15" font-weight="bold">{escape(panel.heading or d.title)}</text>')
    steps = int(t.total)
    total = f"{t.total:.2f} us" if t.unit == "us" else f"{steps} step{'' if steps == 1 else 's'} on the longest lane"
    parts.append(f'<text x="10" y="38" font-size="11" fill="#333">{escape(d.subtitle)}; {escape(total)}</text>')
    y = HEAD_H
    right = _axis(parts, t, scale, y)
    y += AXIS_H
    anchors: dict = {}
    spans: list[route.LaneSpan] = []  # every drawn lane, top to bottom: where the arrows may run
    by_rank: dict[int, list] = {}
    for lane in d.lanes:
        by_rank.setdefault(lane.rank, []).append(lane)
    for rank in sorted(by_rank):
        parts.append(f'<g class="rank" data-rank="{rank}">')
        for lane in by_rank[rank]:
            shade = "#f4f6fa" if rank % 2 == 0 else "#fbfbf6"
            parts.append(f'<g class="lane" data-rank="{lane.rank}" data-channel="{lane.channel}">')
            parts.append(f'<rect x="0" y="{_fmt(y)}" width="{_fmt(right + 20)}" height="{LANE_H}" fill="{shade}"/>')
            parts.append(f'<text x="8" y="{_fmt(y + LANE_H / 2 + 4)}" font-size="12">{escape(lane.label)}</text>')
            xs = []
            for box in lane.steps:
                x0, x1 = _step_box(parts, panel, box, y, scale, colours)
                anchors[box.key] = route.End(x0, x1, len(spans))
                xs.append((x0, x1))
            top = y + (LANE_H - BOX_H) / 2
            spans.append(route.LaneSpan(top, top + BOX_H, tuple(sorted(xs))))
            parts.append("</g>")
            y += LANE_H
        parts.append("</g>")
        y += RANK_GAP
    _arrows(parts, d, t, anchors, spans)
    for note in d.notes + t.notes:
        # A warning (a trace whose clocks contradict its own order) in red: it says what not to trust
        fill = "#b00020" if note.startswith("warning:") else "#333"
        parts.append(f'<text class="note" x="10" y="{_fmt(y + 12)}" font-size="11" fill="{fill}">{escape(note)}</text>')
        y += 14
    parts.append("</g>")
    return y0 + _panel_height(panel), anchors


TICK_CHAR_PX = 0.6 * 9  # a character of the 9 px monospace tick labels
TICK_GAP_PX = 8  # between one tick label's end and the next one's start


def _tick_label(value: float, tick: float, unit: str) -> str:
    """A tick's label, with as many decimals as the tick step needs (one, always, put every
    tick of a 0.01 us step at '0 us' or '0.1 us')."""
    if unit != "us":
        return f"{int(value)}"
    decimals = max(0, -math.floor(math.log10(tick) + 1e-9))
    text = f"{value:.{decimals}f}"
    return f"{text.rstrip('0').rstrip('.') if decimals else text} us"


def _ticks(t, scale: Scale) -> list[tuple[float, str]]:
    """(x, label) of every tick: about ten, spaced wide enough for their labels (at the
    narrowest --width, ten ticks over 200 px of axis overlapped)."""
    span = max(t.total, scale.span)
    tick = max(_nice(span / 10 if span else 1), 1.0 if t.unit == "step" else 0.0)
    while tick * scale.px < TICK_CHAR_PX * len(_tick_label(span, tick, t.unit)) + TICK_GAP_PX:
        tick = _nice(tick * 1.5)  # the next of 1, 2, 5 x 10^n
    count = int(t.total / tick + 1e-9)
    return [(scale.at(n * tick), _tick_label(n * tick, tick, t.unit)) for n in range(count + 1)]


def _ticks_right(panels: list[Panel], scale: Scale) -> float:
    """The right end of the rightmost tick label (drawn 2 px right of its tick)."""
    return max(x + 2 + TICK_CHAR_PX * len(label) for p in panels for x, label in _ticks(p.times, scale))


def _axis(parts: list[str], t, scale: Scale, y: float) -> float:
    """The time (or step) axis, ticks every nice step of x units; its right end."""
    right = scale.at(t.total)
    parts.append(f'<g class="axis"><line x1="{_fmt(scale.left)}" y1="{y + 16}" x2="{_fmt(right)}" y2="{y + 16}" stroke="#999"/>')
    for x, label in _ticks(t, scale):
        parts.append(f'<line x1="{_fmt(x)}" y1="{y + 12}" x2="{_fmt(x)}" y2="{y + 20}" stroke="#999"/>'
                     f'<text x="{_fmt(x + 2)}" y="{y + 10}" font-size="9" fill="#666">{escape(label)}</text>')
    parts.append("</g>")
    return right


def _step_box(parts: list[str], panel: Panel, box, y: float, scale: Scale, colours: dict) -> tuple[float, float]:
    """One step's box (with its hover detail and label) on the lane at ``y``; its left and
    right ends, for the arrows."""
    t = panel.times
    start, end = t.spans[box.key]
    x, w = scale.at(start), max((end - start) * scale.px - (3 if t.unit == "step" else 0), 1.5)
    by = y + (LANE_H - BOX_H) / 2
    fill = colours.get(box.chunk, "#e6e6e6")
    stroke = _STROKE[box.verb]
    dash = ' stroke-dasharray="3,2"' if box.verb == "wait" else ""
    detail = box.detail()
    if panel.measured and box.key in panel.measured:
        detail += "\n" + panel.measured[box.key]
    elif t.unit == "us":
        detail += f"\nmodel: {start:.3f} .. {end:.3f} us"
    parts.append(
        f'<g class="step" data-rank="{box.rank}" data-channel="{box.channel}" data-index="{box.index}" '
        f'data-verb="{box.verb}" data-chunk={quoteattr(box.chunk)} data-line="{box.line or ""}" '
        f'data-detail={quoteattr(detail)}><title>{escape(detail)}</title>'
        f'<rect x="{_fmt(x)}" y="{_fmt(by)}" width="{_fmt(w)}" height="{BOX_H}" rx="3" '
        f'fill="{fill}" stroke="{stroke}"{dash}/>'
    )
    for row, text in enumerate(_box_label(box, w)):
        weight = ' font-weight="bold"' if row == 0 else ""
        parts.append(f'<text x="{_fmt(x + 3)}" y="{_fmt(by + 11 + 11 * row)}" font-size="9.5"{weight}>'
                     f'{escape(text)}</text>')
    if box.previous_call:
        # Above the wait, pointing down at its first pixels (the lane's margin over the boxes):
        # left of the wait, as it was, the mark lay on the corner of the step *before* it (3 px
        # away in the schedule view, touching in time) and read as that step's.
        tip = x + min(w, 6) / 2
        parts.append(f'<g class="prev-call"><path d="M{_fmt(tip - 3)},{_fmt(by + 1 - PREV_MARK_H)} h6 '
                     f'l-3,{PREV_MARK_H} z" fill="#b8401a"/></g>')
    parts.append("</g>")
    return (x, x + w)


def _arrows(parts: list[str], d, t, anchors: dict, lanes: list) -> None:
    """An arrow from each notify to the wait it releases (both drawn), along the gaps between
    lanes and boxes (purlinc/draw/route.py): never through a label."""
    tracks = route.Tracks()
    for n, pair in enumerate(d.pairs):
        if pair.notify not in anchors or pair.wait not in anchors:
            continue
        # Schedule view: into the wait's start (it runs after the notify).  In time a wait ends
        # when released -- a measured one spans its polling; a modelled one is drawn from its
        # release on, the lane blank while it waits: into its end.
        points = tracks.place(lanes, anchors[pair.notify], anchors[pair.wait], into_end=t.unit != "step", first=n)
        path = "M" + " L".join(f"{_fmt(x)},{_fmt(y)}" for x, y in points)
        parts.append(
            f'<path class="arrow" data-notify="{",".join(map(str, pair.notify))}" '
            f'data-wait="{",".join(map(str, pair.wait))}" data-signal="{escape(pair.signal.format())}" '
            f'data-k="{pair.k}" d="{path}" fill="none" stroke="#1f4fbf" stroke-opacity="0.55" stroke-width="1.2" '
            f'stroke-linejoin="round" marker-end="url(#head)"/>'
        )


def _nice(raw: float) -> float:
    """The smallest of 1, 2, 5 times a power of ten that is >= raw (axis tick spacing)."""
    if raw <= 0:
        return 1.0
    exp = 10.0 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if m * exp >= raw * (1 - 1e-9):
            return m * exp
    return 10 * exp


def _legend(chunks: list[str], colours: dict, top: float, limit: float,
            note: str = _LEGEND_NOTE) -> tuple[list[str], float, float]:
    """The chunk colours, then what the marks mean, in rows that wrap at ``limit`` pixels (the
    lanes' width, or LEGEND_WRAP): in one row, the 4,096 chunks of an alltoall at R=64 made
    the canvas 311,000 px wide.  Returns the elements, the right end and the height."""
    parts = [f'<g class="legend"><text x="10" y="{_fmt(top + 11)}" font-size="11">chunks:</text>']
    x, y, right = 66.0, top, 66.0
    # (swatch and name) per chunk, then the explanation: about 6.2 px a character at 10 px
    items = [(name, 22 + 6.2 * len(name)) for name in chunks] + [(None, 10 + 6.2 * len(note))]
    for name, w in items:
        if x + w > limit and x > 66:
            x, y = 66.0, y + LEGEND_ROW_H
        if name is None:
            parts.append(f'<text x="{_fmt(x + 10)}" y="{_fmt(y + 11)}" font-size="10" fill="#1f4fbf">'
                         f'{escape(note)}</text>')
        else:
            parts.append(f'<rect x="{_fmt(x)}" y="{_fmt(y + 1)}" width="12" height="12" fill="{colours[name]}" '
                         f'stroke="#555"/><text x="{_fmt(x + 15)}" y="{_fmt(y + 11)}" font-size="10">{escape(name)}</text>')
        x += w
        right = max(right, x)
    parts.append("</g>")
    return parts, right + 10, y - top + 24


def render(panels: list[Panel], *, width: int | None = None) -> str:
    """SVG text of the panels, stacked, sharing the x scale."""
    if not panels:
        raise ValueError("nothing to draw")
    scale = _scale(panels, width)
    # In first-seen order, without a list search per chunk (65,536 chunks at R=256 made that
    # search most of the drawing's time)
    chunks = list(dict.fromkeys(c for p in panels for c in p.drawing.chunks))
    colours = palette(tuple(chunks))
    parts: list[str] = []
    y = 0.0
    for panel in panels:
        y, _ = _render_panel(panel, y, scale, colours, parts)
    lanes_px = max(scale.at(max(p.times.total for p in panels)) + 30, _ticks_right(panels, scale))
    epilogue = any(box.verb == "epilogue" for p in panels for lane in p.drawing.lanes for box in lane.steps)
    note = _LEGEND_NOTE + (_LEGEND_EPILOGUE if epilogue else "")
    legend, legend_right, legend_h = _legend(chunks, colours, y + 6, max(lanes_px, LEGEND_WRAP), note)
    # Wide enough for the lanes, the legend and every panel's subtitle line (11 px monospace,
    # about 6.7 px a character: a long option list must not be clipped by the canvas).
    subtitle_px = max(10 + 6.7 * (len(p.drawing.subtitle) + 40) for p in panels)
    # and every note under the lanes (the same size): a narrow --width clipped a long one
    notes_px = max((10 + 6.7 * len(note) for p in panels for note in p.drawing.notes + p.times.notes), default=0)
    # and every heading (15 px bold monospace, about 9.1 px a character): a narrow --width clipped it
    heading_px = max(10 + 9.1 * len(p.heading or p.drawing.title) + 10 for p in panels)
    width_px = max(lanes_px, legend_right, subtitle_px, notes_px, heading_px)
    height_px = y + 6 + legend_h
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="purlin-schedule" width="{_fmt(width_px)}" '
        f'height="{_fmt(height_px)}" viewBox="0 0 {_fmt(width_px)} {_fmt(height_px)}" font-family="{FONT}">\n'
        '<defs><marker id="head" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="5.5" markerHeight="5.5" '
        'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#1f4fbf"/></marker></defs>\n'
        f'<rect x="0" y="0" width="{_fmt(width_px)}" height="{_fmt(height_px)}" fill="white"/>\n'
    )
    return head + "\n".join(parts + legend) + "\n</svg>\n"
