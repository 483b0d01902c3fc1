"""``purlinc draw --gpus-per-node G``: a hierarchical plan as one SVG.

One row per rank, ranks of a node on one shaded band; one column per buffer (``in``, the
scratch buffers, ``out``) and between two columns the phase that turns one into the next:
an intra-node phase is a box per node naming its SNAC schedule, an inter-node phase draws one
line per (sending rank, receiving rank) pair of its NCCL moves, whose hover text says how many
units it carries (local copies are not drawn).
"""

from __future__ import annotations

import colorsys
from xml.sax.saxutils import escape

from purlinc.draw.model import params_text
from purlinc.snac.hierarchy import HierPlan, IntraPhase, plural

ROW, COL, LEFT, TOP = 18, 230, 90, 62  # TOP: the title (y 18), the phase labels, the buffer names
KEY_H = 15  # a line of the key under the rows
EM = 0.64  # a character's width in em, at most (DejaVu Sans digits; most letters are narrower)


def _text_px(text: str, size: float = 11) -> float:
    return EM * size * len(text)


def _left(t) -> float:
    """Where the first column goes: right of the node labels (from x = 8) and the rank labels
    beside them (ending 30 px left of the column), so 'node 12' does not run into 'r96'."""
    return max(LEFT, round(8 + _text_px(f"node {t.nodes - 1}") + 6 + _text_px(f"r{t.world_size - 1}") + 30))


def plan_title(plan: HierPlan) -> str:
    t = plan.topology
    bound = f"{params_text(plan.spec.params)}, " if plan.spec.params else ""  # root=5: not root 0's plan
    return (f"{plan.spec.name}: {plural(t.nodes, 'node')} x {plural(t.gpus_per_node, 'GPU')} (R={t.world_size}), {bound}"
            f"{plan.spec.operation.value}")


def plan_key(plan: HierPlan) -> list[str]:
    """What the boxes and lines stand for, under the rows: a box said only 'schedule #1', its
    options and size were in a hover alone (and nowhere in a PNG), and nothing said what the
    colours of the NCCL lines mean."""
    lines = []
    for which, schedule in enumerate(plan.schedules):
        steps = sum(len(p.steps) for p in schedule.programs)
        # Not the sub-collective's name: the planner's (".scatter" for a node's copy phase
        # that gathers to one rank) would contradict the phase label above the box.
        lines.append(f"schedule #{which}: {plural(schedule.world_size, 'rank')}, {schedule.options.key()}, "
                     f"{plural(steps, 'step')} in all")
    # Only where lines are drawn: a single node's NCCL phase moves nothing between ranks, and
    # the key explained lines the drawing did not have.
    nccl = [(index, phase) for index, phase in enumerate(plan.phases) if not isinstance(phase, IntraPhase)]
    if any(nccl_pairs(phase) for _, phase in nccl):
        lines.append("NCCL lines: one per (sending rank, receiving rank), coloured by the sender's GPU in its node")
    for index, phase in nccl:
        if not nccl_pairs(phase):
            lines.append(f"phase {index} (NCCL {phase.nccl}): nothing moves between ranks (local copies, not drawn)")
    return lines


def nccl_pairs(phase) -> dict[tuple[int, int], int]:
    """An NCCL phase's lines: (sending rank, receiving rank) -> units, local copies left out."""
    pairs: dict[tuple[int, int], int] = {}
    for move in phase.moves:
        for src in move.srcs:
            if src.rank != move.dst.rank:
                pairs[(src.rank, move.dst.rank)] = pairs.get((src.rank, move.dst.rank), 0) + 1
    return pairs


COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def gpu_colours(gpus_per_node: int) -> tuple[str, ...]:
    """One line colour per GPU of a node, all different: COLORS up to 8 GPUs; past them (16
    GPUs a node drew GPU 8's lines in GPU 0's colour, which the key says tells senders
    apart) hues spread evenly, in two lightnesses taken in turn so that neighbours differ."""
    if gpus_per_node <= len(COLORS):
        return COLORS
    colours = []
    for i in range(gpus_per_node):
        r, g, b = colorsys.hls_to_rgb(i / gpus_per_node, 0.38 if i % 2 == 0 else 0.48, 0.75)
        colours.append(f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}")
    return tuple(colours)


def plan_svg(plan: HierPlan) -> str:
    t = plan.topology
    R = t.world_size
    buffers = [plan.phases[0].src] + [p.dst for p in plan.phases]
    left_edge, title, key = _left(t), plan_title(plan), plan_key(plan)
    colours = gpu_colours(t.gpus_per_node)
    # the title (14 px bold) may be the widest thing: a collective's name has up to 64 characters
    width = round(max(left_edge + COL * len(plan.phases) + 120, 8 + _text_px(title, 14) + 8,
                      *(8 + _text_px(line) + 8 for line in key)))
    height = TOP + ROW * R + 30 + KEY_H * len(key)

    def y(rank: int) -> float:
        return TOP + ROW * rank + ROW / 2

    def x(column: int) -> float:
        return left_edge + COL * column

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<text x="8" y="18" font-size="14" font-weight="bold">{escape(title)}</text>']
    for node in range(t.nodes):
        top = TOP + ROW * node * t.gpus_per_node
        shade = "#f2f2f2" if node % 2 == 0 else "#e6eef7"
        out.append(f'<rect x="0" y="{top}" width="{width}" height="{ROW * t.gpus_per_node}" fill="{shade}"/>')
        out.append(f'<text x="8" y="{top + 12}" fill="#555">node {node}</text>')
    for rank in range(R):
        out.append(f'<text x="{left_edge - 30}" y="{y(rank) + 4}" text-anchor="end">r{rank}</text>')
    for column, name in enumerate(buffers):
        out.append(f'<text x="{x(column)}" y="{TOP - 10}" text-anchor="middle" font-weight="bold">{escape(name)}</text>')
        for rank in range(R):
            units = len(plan.layout(name).units[rank])
            out.append(f'<circle cx="{x(column)}" cy="{y(rank)}" r="{3 if units else 1.5}" fill="{"#333" if units else "#bbb"}">'
                       f'<title>r{rank}.{escape(name)}: {units} units</title></circle>')
    for index, phase in enumerate(plan.phases):
        left, right = x(index) + 12, x(index + 1) - 12
        if isinstance(phase, IntraPhase):
            label = f"SNAC {phase.operation.value}"
            for node, which in enumerate(phase.schedules):
                schedule = plan.schedules[which]
                top = TOP + ROW * node * t.gpus_per_node + 2
                steps = sum(len(p.steps) for p in schedule.programs)
                out.append(f'<rect x="{left}" y="{top}" width="{right - left}" height="{ROW * t.gpus_per_node - 4}" '
                           f'fill="#fff" stroke="#1f77b4" rx="4"><title>node {node}: schedule #{which}, '
                           f'{escape(schedule.options.key())}, {steps} steps</title></rect>')
                if t.gpus_per_node * ROW >= 14:
                    out.append(f'<text x="{(left + right) / 2}" y="{top + min(ROW * t.gpus_per_node / 2 + 2, 13)}" '
                               f'text-anchor="middle" fill="#1f77b4">schedule #{which}</text>')
        else:
            label = f"NCCL {phase.nccl}"
            for (a, b), n in sorted(nccl_pairs(phase).items()):
                color = colours[t.local_of(a)]
                out.append(f'<line x1="{left}" y1="{y(a)}" x2="{right}" y2="{y(b)}" stroke="{color}" '
                           f'stroke-opacity="0.7"><title>r{a} -> r{b}: {n} units</title></line>')
        out.append(f'<text x="{(x(index) + x(index + 1)) / 2}" y="{TOP - 24}" text-anchor="middle">'
                   f'{index}: {escape(label)}</text>')
    for n, line in enumerate(key):
        out.append(f'<text class="key" x="8" y="{TOP + ROW * R + 22 + KEY_H * n}" fill="#333">{escape(line)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
