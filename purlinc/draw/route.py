"""Where a notify -> wait arrow runs: in the gaps between lanes and across lanes only where no
label is, so that no arrow strikes through a box's text.

An arrow drawn straight (a curve from the notify's right edge at mid-height to the wait's) ran
through the middle label row of the notify, the wait and every box between them.  Here it leaves
the notify by its bottom (or top) edge, runs along the gap between two lanes, crosses each lane
in between at a boundary between two boxes (a box's text starts 3 px in and ends before its right
edge), and enters the wait by its top (or bottom) edge.  Pure geometry, tested without a drawing.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

# How far into a box (from its end) an arrow leaves or enters it, where the box is wide enough
END_INSET = 4.0
FAR_INSET = 2 * END_INSET + 1  # the other edge's inset, where two arrows would meet at one x
# Arrows sharing a gap between two lanes run this far apart (three tracks), so that they do not
# lie on one another for their whole length
TRACK_PX = 2.5


@dataclass(frozen=True, slots=True)
class LaneSpan:
    """One drawn lane: its boxes' top and bottom edges and their x spans, sorted.  What a route
    asks of it is made once here (an all-gather at R=128 crosses lanes of thousands of boxes
    hundreds of thousands of times: scanning the spans each time took minutes)."""

    top: float
    bottom: float
    spans: tuple[tuple[float, float], ...]
    # The spans merged where they touch or overlap (starts, ends), and the free x's sorted
    _starts: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _ends: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _free: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        starts: list[float] = []
        ends: list[float] = []
        for x0, x1 in sorted(self.spans):
            if ends and x0 <= ends[-1]:
                ends[-1] = max(ends[-1], x1)
            else:
                starts.append(x0)
                ends.append(x1)
        object.__setattr__(self, "_starts", tuple(starts))
        object.__setattr__(self, "_ends", tuple(ends))
        object.__setattr__(self, "_free", tuple(sorted(_free_xs(self))))


@dataclass(frozen=True, slots=True)
class End:
    """One end of an arrow: its box's x span and the lane (an index into the lanes) it is on."""

    x0: float
    x1: float
    lane: int


def _gap(lanes: list[LaneSpan], above: int) -> float:
    """The middle of the gap under lane ``above`` (-1: the margin over the first lane)."""
    if above < 0:
        return lanes[0].top - 4
    if above + 1 >= len(lanes):
        return lanes[above].bottom + 4
    return (lanes[above].bottom + lanes[above + 1].top) / 2


def _free_xs(lane: LaneSpan) -> list[float]:
    """x positions where a vertical line crosses the lane without crossing a label: the middle
    of a gap between two boxes, or the boundary of two boxes that touch (time views)."""
    spans = lane.spans
    if not spans:
        return []
    xs = [spans[0][0] - 1.5, spans[-1][1] + 1.5]
    for (_, a1), (b0, _) in zip(spans, spans[1:]):
        xs.append((a1 + b0) / 2 if b0 - a1 >= 1 else b0)
    return xs


def _covered(lane: LaneSpan, x: float) -> bool:
    """Whether a box of ``lane`` covers x (its edges included)."""
    i = bisect_right(lane._starts, x) - 1
    return i >= 0 and x <= lane._ends[i]


def _crossing(lane: LaneSpan, at: float, to: float) -> float:
    """Where to cross ``lane`` going from x ``at`` towards x ``to``: a free x between the two
    (the nearest to ``to``), else the free x nearest to that stretch.  Only the free x's next
    to ``lo``, ``hi`` and ``to`` can be that one (they are sorted)."""
    if not _covered(lane, to):
        return to
    lo, hi = min(at, to), max(at, to)
    free = lane._free
    near = {i for k in (bisect_left(free, lo), bisect_right(free, hi), bisect_left(free, to))
            for i in (k - 1, k) if 0 <= i < len(free)}
    # Ties go as they went when every free x was scanned in _free_xs's order (the left end,
    # the right end, then the gaps from the left; ``at`` last): the drawings stay as they were.
    order = {free[0]: 0, free[-1]: 1}
    candidates = [(free[i], order.get(free[i], 2)) for i in near] + ([(at, 3)] if not _covered(lane, at) else [])
    return min(candidates, key=lambda c: (max(lo - c[0], c[0] - hi, 0.0), abs(c[0] - to), c[1], c[0]))[0]


def route(lanes: list[LaneSpan], notify: End, wait: End, *, into_end: bool,
          track: int = 0) -> list[tuple[float, float]]:
    """The arrow's corner points, from the notify's edge to the wait's edge.  ``into_end``: the
    arrow enters the wait near its end (a time view: a wait ends when released), else near its
    start (the schedule view).  ``track``: which of three tracks of a gap it runs along."""
    offset = ((track % 3) - 1) * TRACK_PX
    i, j = notify.lane, wait.lane
    down = j >= i  # the same lane: out of the bottom edge and back into it
    # Out of the bottom edge END_INSET from the end, out of the top edge twice as far: two
    # notifies of one column, one releasing the lane below and one (a ring's wrap-around) the
    # lanes above, left the gap between them at one x, a line joining the two notifies.
    sx = max((notify.x0 + notify.x1) / 2, notify.x1 - (END_INSET if down else FAR_INSET))
    # Into the top edge END_INSET from the end, into the bottom edge twice as far: one arrow
    # from above and one from below, in one gap, met head to head at one x.
    inset = END_INSET if down and j != i else FAR_INSET
    if into_end:
        ex = max((wait.x0 + wait.x1) / 2, wait.x1 - inset)
    else:
        ex = min((wait.x0 + wait.x1) / 2, wait.x0 + inset)
    step = 1 if down else -1
    points = [(sx, lanes[i].bottom if down else lanes[i].top)]
    x = sx

    def gap_of(k: int) -> float:  # the gap on the wait's side of lane k
        return _gap(lanes, k if down else k - 1)

    y = gap_of(i) + offset
    points.append((x, y))
    for k in range(i + step, j, step):  # the lanes in between
        cross = _crossing(lanes[k], x, ex)
        points.append((cross, y))
        x, y = cross, gap_of(k) + offset
        points.append((x, y))
    points.append((ex, y))
    points.append((ex, lanes[j].top if down and j != i else lanes[j].bottom))
    return _simplified(points)


def _simplified(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Without repeated points (a crossing at the x the arrow already runs at)."""
    out = [points[0]]
    for point in points[1:]:
        if abs(point[0] - out[-1][0]) > 1e-9 or abs(point[1] - out[-1][1]) > 1e-9:
            out.append(point)
    return out


class Tracks:
    """The stretches of the gaps' tracks that arrows already run along, so that the next arrow
    takes a track where it lies on none of them.  By its index alone (``n % 3``) every arrow of
    a ring's column took one track: the wrap-around arrow (rank R-1 up to rank 0) ran on the
    same line as the arrows from rank 0 down and from rank R-2 down, and read as rank 0's notify
    releasing its own wait."""

    def __init__(self):
        # y of a track -> the stretches taken on it, merged: sorted starts and their ends
        self._taken: dict[float, tuple[list[float], list[float]]] = {}

    def place(self, lanes: list[LaneSpan], notify: End, wait: End, *, into_end: bool,
              first: int = 0) -> list[tuple[float, float]]:
        """``route``'s points on the first track from ``first`` on (of three) where none of the
        arrow's stretches along a gap lies on a taken one; ``first``'s when every track has one."""
        chosen = route(lanes, notify, wait, into_end=into_end, track=first)
        for track in range(first, first + 3):
            # Another track moves every point along a gap by the tracks' distance, nothing else
            # (the crossings depend on x alone): no second route (an all-gather at R=96 has
            # 9,120 arrows, most of them finding every track taken somewhere)
            delta = ((track % 3) - (first % 3)) * TRACK_PX
            points = chosen if not delta else [chosen[0], *((x, y + delta) for x, y in chosen[1:-1]), chosen[-1]]
            if not any(self._taken_at(y, x0, x1) for y, x0, x1 in _runs(points)):
                chosen = points
                break
        for y, x0, x1 in _runs(chosen):
            self._take(y, x0, x1)
        return chosen

    def _taken_at(self, y: float, x0: float, x1: float) -> bool:
        starts, ends = self._taken.get(y, ((), ()))
        i = bisect_left(starts, x1 - 1e-9) - 1  # the last stretch starting before x1
        return i >= 0 and ends[i] > x0 + 1e-9

    def _take(self, y: float, x0: float, x1: float) -> None:
        starts, ends = self._taken.setdefault(y, ([], []))
        i = bisect_left(starts, x0)
        j = bisect_right(starts, x1)
        if i > 0 and ends[i - 1] >= x0:  # merge with the stretch before, where they touch
            i -= 1
            x0 = starts[i]
        x1 = max([x1] + ends[i:j])
        starts[i:j], ends[i:j] = [x0], [x1]


def _runs(points: list[tuple[float, float]]):
    """The arrow's stretches along a gap: (y, left x, right x) of each horizontal segment."""
    for (xa, ya), (xb, yb) in zip(points, points[1:]):
        if ya == yb and xa != xb:
            yield ya, min(xa, xb), max(xa, xb)

