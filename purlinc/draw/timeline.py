"""Where each drawn step sits along the x axis: in steps (the schedule view) or in time.

Both are the same list scheduling of the drawn lanes: every lane runs its steps in order,
and a wait cannot end before the step that releases it (its pair) has.  Only the cost of a
step differs:

- ``logical``: every step is one column, a wait starts no earlier than the column after its
  notify: the schedule view, where every arrow points right.
- ``CostModel``: microseconds from a simple model of one H200 NVLink machine (figures measured on
  2 x H200, NV18, by probes written before this repository's benchmarks):

  * a kernel starts ``launch_us`` (0.56: an empty kernel in a CUDA graph) after time 0;
  * a signal becomes visible to its waiter ``signal_us`` (1.26: one release store / acquire
    poll between two GPUs) after the notify ends;
  * bytes to or from a peer move at ``min(link_gbps / channels, cta_link_gbps)`` per channel
    (365 GB/s each way shared by the channels; one 512-thread block reaches ~46 GB/s);
  * local bytes (a consume reading the staging buffer and the input, writing the output)
    move at ``min(local_gbps / channels, cta_local_gbps)``: 4.1 TB/s read + write for the
    device, one block assumed to reach a quarter of it (an assumption, not a measurement);
  * a packed (LL) stage writes twice its bytes (a flag word in every 16-byte packet);
  * every step also pays ``step_us`` (a block barrier and a few instructions).

  The model ignores contention between ranks and rounds (messages larger than the staging
  space run in several rounds): it is for comparing schedules by eye, not for predicting.
"""

from __future__ import annotations

from dataclasses import dataclass

from purlinc.draw.model import Drawing
from purlinc.frontend.ast import OperandKind
from purlinc.snac.ir import Consume, Epilogue, Notify, Schedule, Stage


@dataclass(frozen=True, slots=True)
class CostModel:
    launch_us: float = 0.56
    signal_us: float = 1.26
    link_gbps: float = 365.0
    cta_link_gbps: float = 46.0
    local_gbps: float = 4100.0
    cta_local_gbps: float = 1025.0
    step_us: float = 0.02
    notify_us: float = 0.05

    def to_json(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__}


@dataclass(frozen=True, slots=True)
class Times:
    unit: str  # "step" or "us"
    spans: dict  # (rank, channel, index) -> (start, end)
    total: float
    notes: tuple[str, ...] = ()


def _epilogue_bytes(schedule: Schedule, slice_bytes: float) -> float:
    """Local bytes one Epilogue step moves over an OUT slice: the slice read and written, and
    each ``rows`` operand read and, where the epilogue assigns it, written (the ``row`` and
    ``scalar`` operands are one row or a word: left out).  As a separate pass: the kernel fuses
    it into the reduce before it where it can, which saves out's read and write."""
    rows = [o for o in schedule.epilogue.operands if o.kind is OperandKind.ROWS] if schedule.epilogue else []
    return slice_bytes * (2 + sum(2 if o.written else 1 for o in rows))


def _durations(schedule: Schedule, drawing: Drawing, model: CostModel | None, chunk_bytes: int):
    """(rank, channel, index) -> duration, and the latency a released wait sees."""
    if model is None:
        return {box.key: 1.0 for lane in drawing.lanes for box in lane.steps}, 0.0, 0.0
    channels = schedule.channels
    slices = schedule.channels * schedule.options.slices
    slice_bytes = chunk_bytes / slices
    link = min(model.link_gbps / channels, model.cta_link_gbps) * 1e3  # bytes per us
    local = min(model.local_gbps / channels, model.cta_local_gbps) * 1e3
    out = {}
    for lane in drawing.lanes:
        program = schedule.program(lane.rank, lane.channel)
        for box in lane.steps:
            step = program.steps[box.index]
            cost = model.step_us
            if isinstance(step, Stage):
                remote = step.src.rank != lane.rank or step.dst.rank != lane.rank
                factor = 2 if step.packed else 1
                cost += factor * slice_bytes / (link if remote else local)
            elif isinstance(step, Consume):
                srcs = step.srcs if len(step.srcs) > 1 or step.operation.value == "reduce" else step.srcs[:1]
                remote = sum(1 for s in srcs if s.rank != lane.rank)
                local_bytes = (len(srcs) - remote + 1) * slice_bytes  # local reads + the write
                cost += remote * slice_bytes / link + local_bytes / local
            elif isinstance(step, Epilogue):
                cost += _epilogue_bytes(schedule, slice_bytes) / local
            elif isinstance(step, Notify):
                cost += model.notify_us
            out[box.key] = cost
    return out, model.signal_us, model.launch_us


def schedule_times(schedule: Schedule, drawing: Drawing, model: CostModel | None = None, *,
                   chunk_bytes: int = 0) -> Times:
    """List-schedule the drawn lanes: ``model=None`` gives columns, a CostModel microseconds."""
    durations, latency, launch = _durations(schedule, drawing, model, chunk_bytes)
    release = {pair.wait: pair.notify for pair in drawing.pairs}
    spans: dict = {}
    cursor = {(lane.rank, lane.channel): 0 for lane in drawing.lanes}
    clock = {(lane.rank, lane.channel): launch for lane in drawing.lanes}
    lanes = {(lane.rank, lane.channel): lane for lane in drawing.lanes}
    forced = 0
    while True:
        progress = False
        for key, lane in lanes.items():
            while cursor[key] < len(lane.steps):
                box = lane.steps[cursor[key]]
                start = clock[key]
                source = release.get(box.key)
                if source is not None:
                    if source not in spans:
                        break  # its notify has not run yet: try the other lanes
                    start = max(start, spans[source][1] + latency)
                end = start + durations[box.key]
                spans[box.key] = (start, end)
                clock[key] = end
                cursor[key] += 1
                progress = True
        if all(cursor[k] == len(lanes[k].steps) for k in lanes):
            break
        if not progress:
            # Only a schedule the verifier would reject gets here (a wait-for cycle): release
            # the earliest blocked wait now, say so, and go on drawing.
            key = min((k for k in lanes if cursor[k] < len(lanes[k].steps)), key=lambda k: clock[k])
            box = lanes[key].steps[cursor[key]]
            spans[box.key] = (clock[key], clock[key] + durations[box.key])
            clock[key] = spans[box.key][1]
            cursor[key] += 1
            forced += 1
    total = max((end for _, end in spans.values()), default=0.0)
    notes = (f"{forced} wait(s) could not be ordered after their notify (a cycle)",) if forced else ()
    if model is not None and schedule.sizes is not None:
        # A call's sizes are known only on the device: the model cannot know them, and a
        # reader of equal boxes should not take them for measured or equal sizes.
        notes += (f"run-time sizes: every chunk modelled full ({chunk_bytes} B); a call moves the sizes "
                  f"{schedule.sizes.operand} gives, at most that",)
    return Times("us" if model is not None else "step", spans, total, notes)


def buffer_units(schedule: Schedule) -> int:
    """Chunks in the larger of one rank's input and output, the largest over ranks (at least
    one): what a message of ``nbytes`` is cut into."""
    return max(max(schedule.in_units, default=0), max(schedule.out_units, default=0), 1)


def chunk_bytes_for(schedule: Schedule, *, nbytes: int | None, count: int | None, itemsize: int) -> int:
    """Bytes of one chunk: from ``count`` (elements per chunk) or ``nbytes`` (the larger of one
    rank's input and output, as nccl-tests and the tuning table count).  A chunk holds whole
    elements, at least one: ``nbytes`` split over the units is rounded down to the item size,
    and with an epilogue to whole rows (a call's chunks hold whole rows), at least one."""
    if count is not None:
        return max(count, 1) * itemsize
    row = schedule.epilogue.row if schedule.epilogue is not None else 1
    elements = int(nbytes or 0) // buffer_units(schedule) // itemsize // row * row
    return max(elements, row) * itemsize
