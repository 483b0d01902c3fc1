"""The device trace as JSON: its schema, how it is built from raw stamps, checked, and drawn.

Schema (``"format": "purlin-trace", "version": 1``)::

    {
      "format": "purlin-trace", "version": 1,
      "collective": "allreduce", "world_size": 2, "params": {},
      "options": {"algorithm": "direct-push", "channels": 1, "slices": 1, "packed": false,
                  "key": "direct-push/c1/s1/slotsall/reg-"},
      "atom": "ldst", "dtype": "bfloat16", "op": "sum", "device": "NVIDIA H200",
      "kernel": "purlin_allreduce_1a2b3c4d",
      "calls": [7, 7],                 # per rank: the call number (epoch) traced
      "timebase": "globaltimer" | "clock64",
      "clock": {"method": "ping-pong", "reference_rank": 0, "iterations": 64,
                "ranks": [{"rank": 1, "offset_ns": ..., "uncertainty_ns": ..., "min_rtt_ns": ...,
                           "globaltimer_tick_ns": ..., "sm_cycles_per_ns": ...}, ...]},
      "t0_ns": ...,                    # the reference clock at the earliest stamp
      "events": [{"rank": 0, "channel": 0, "round": 0, "block": 3, "steps": [5, 6],
                  "start_ns": 812.0, "end_ns": 1630.5,        # aligned to rank 0's clock, minus t0_ns
                  "raw": [gt_start, clk_start, gt_end, clk_end]}, ...]
    }

``offset_ns`` is the rank's timer minus the reference's; aligned time = local - offset.
Within one round of one channel, times come from ``clock64`` cycles after the round's first
global-timer stamp when the global timer ticks coarser than 100 ns (``timebase``), else from the
global timer itself.  A block covers one or more SNAC steps (a merged group of waits, an LL
receive with its consumes); the drawing splits a block's time evenly among its steps.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

from purlinc.errors import PurlinError
from purlinc.draw.timeline import Times

FORMAT = "purlin-trace"
VERSION = 1
_REQUIRED = ("collective", "world_size", "params", "options", "clock", "events")
# A trace holds one event (~200 bytes of JSON) per block of every channel program: a million
# events, far more than a drawing shows, is this much.  A path that never ends (/dev/zero) or a
# file that is no trace is refused after this many bytes instead of being read until memory runs out.
MAX_TRACE_BYTES = 256 << 20
# The longest time a trace may give, in ns: an hour, far past any call (a bad clock alignment
# gave 1e300 and a heading of 300 digits).  Times start at 0: from_stamps subtracts the first.
MAX_TRACE_NS = 3600e9


# ---- building ---------------------------------------------------------------------------

def _stamp_time(gt: int, clk: int, anchor: tuple[int, int], rate: float, use_clock: bool) -> float:
    if use_clock and rate > 0:
        return anchor[0] + (clk - anchor[1]) / rate
    return float(gt)


def from_stamps(schedule, params: dict, atom: str, parts: list[dict], clock: dict) -> dict:
    """The trace JSON from every rank's raw stamps (purlinc.runtime.trace.read_stamps) and the
    clock alignment (purlinc.runtime.trace.align)."""
    ranks = {r["rank"]: r for r in clock["ranks"]}
    ticks = [r.get("globaltimer_tick_ns") or 0 for r in clock["ranks"]]
    use_clock = max(ticks, default=0) > 100
    events = []
    for part in sorted(parts, key=lambda p: p["rank"]):
        info = ranks.get(part["rank"], {"offset_ns": 0.0, "sm_cycles_per_ns": 0.0})
        offset, rate = info["offset_ns"], info.get("sm_cycles_per_ns", 0.0)
        for c, ch in enumerate(part["channels"]):
            for i, row in enumerate(ch["stamps"]):
                anchor = row[0]
                times = [_stamp_time(gt, clk, anchor, rate, use_clock) - offset for gt, clk in row]
                for b, steps in enumerate(ch["blocks"]):
                    if b + 1 >= len(row):
                        break
                    events.append({
                        "rank": part["rank"], "channel": c, "round": i, "block": b, "steps": list(steps),
                        "start_ns": times[b], "end_ns": times[b + 1],
                        "raw": [row[b][0], row[b][1], row[b + 1][0], row[b + 1][1]],
                    })
    t0 = min((e["start_ns"] for e in events), default=0.0)
    for e in events:
        e["start_ns"] -= t0
        e["end_ns"] -= t0
    o = schedule.options
    first = parts[0] if parts else {}
    return {
        "format": FORMAT, "version": VERSION,
        "collective": schedule.collective, "world_size": schedule.world_size, "params": dict(params),
        "options": {"algorithm": o.algorithm.value, "channels": o.channels, "slices": o.slices,
                    "packed": bool(o.packed), "stage_copies": o.stage_copies, "key": o.key()},
        "atom": atom, "dtype": first.get("dtype"), "op": first.get("op"), "device": first.get("device", ""),
        "kernel": first.get("kernel", ""),
        "calls": [int(p["channels"][0]["epoch"]) if p["channels"] else None for p in sorted(parts, key=lambda p: p["rank"])],
        "timebase": "clock64" if use_clock else "globaltimer",
        "clock": clock, "t0_ns": t0, "events": events,
    }


# ---- reading ----------------------------------------------------------------------------

def load(path: str) -> dict:
    """A trace file, checked for shape; PurlinError (exit 2 in the CLI) for anything else."""
    try:
        with Path(path).open("rb") as stream:
            raw = stream.read(MAX_TRACE_BYTES + 1)
            if len(raw) > MAX_TRACE_BYTES:
                raise PurlinError(f"trace file {path} is too large: {_size(stream)}, the limit is {MAX_TRACE_BYTES:,}",
                                  notes=("a trace is what coll.trace() returns, written with json.dump",))
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise PurlinError(f"trace file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise PurlinError(f"cannot read trace file {path}: {error}") from None
    if not text.strip():
        raise PurlinError(f"trace file {path} is empty", notes=("write one with json.dump(coll.trace(), f)",))
    try:
        data = json.loads(text)
    except ValueError as error:
        raise PurlinError(f"trace file {path} is not JSON: {error}") from None
    except RecursionError:  # the decoder recurses once per level: a trace is a few levels deep
        raise PurlinError(f"trace file {path} is not a Purlin trace: its JSON is nested too deeply to read",
                          notes=("a trace is what coll.trace() returns, written with json.dump",)) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise PurlinError(
            f"{path} is not a Purlin trace: expected \"format\": \"{FORMAT}\", found {found!r}",
            notes=("a trace is what coll.trace() returns (docs/DRAW.md), not a profiler's or Chrome's trace",),
        )
    if data.get("version") != VERSION:
        raise PurlinError(f"trace file {path} has version {data.get('version')!r}; this purlinc reads version {VERSION}")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise PurlinError(f"trace file {path} lacks {', '.join(missing)}")
    try:
        _check_fields(data)
    except _Bad as bad:
        raise PurlinError(f"trace file {path}: {bad}",
                          notes=("a trace is what coll.trace() returns, unedited (its fields: docs/DRAW.md)",)) from None
    if not data["events"]:
        raise PurlinError(f"trace file {path} has no events: was the collective called before coll.trace()?")
    return data


def _size(stream) -> str:
    """A too-large trace's size: a regular file says it; a device or a pipe does not."""
    info = os.fstat(stream.fileno())
    return f"{info.st_size:,} bytes" if stat.S_ISREG(info.st_mode) else f"more than {MAX_TRACE_BYTES:,} bytes"


# ---- the fields' types ------------------------------------------------------------------
# One pass over every field the drawing reads, so that a hand-edited or truncated trace is a
# message naming the field ("events[0].start_ns: expected a number, got 'a'"), never a
# TypeError deep in the drawing.  Fields the drawing does not read are not checked.

class _Bad(Exception):
    """A field of the wrong type or value; its text is "where: what was expected, got what"."""


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _expect(ok: bool, where: str, what: str, value) -> None:
    if not ok:
        raise _Bad(f"{where}: expected {what}, got {_shown(value)}")


def _field(record: dict, name: str, where: str):
    if name not in record:
        raise _Bad(f"{where}.{name} is missing" if where else f"{name} is missing")
    return record[name]


def _object(value, where: str) -> dict:
    _expect(isinstance(value, dict), where, "an object", value)
    return value


def _array(value, where: str) -> list:
    _expect(isinstance(value, list), where, "a list", value)
    return value


def _integer(value, where: str, least: int | None = 0) -> int:
    # bool is an int to Python, not to a reader of the file
    _expect(isinstance(value, int) and not isinstance(value, bool), where, "an integer", value)
    _expect(least is None or value >= least, where, f"an integer of at least {least}", value)
    return value


def _number(value, where: str) -> float:
    _expect(isinstance(value, (int, float)) and not isinstance(value, bool), where, "a number", value)
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer past float's range: JSON has no limit on its digits
        finite = False
    _expect(finite, where, "a finite number", value)
    return value


def _string(value, where: str) -> str:
    _expect(isinstance(value, str), where, "a string", value)
    return value


def _check_options(options) -> None:
    from purlinc.snac.algorithms import ALGORITHMS

    _object(options, "options")
    names = ALGORITHMS.names()
    algorithm = _field(options, "algorithm", "options")
    _expect(algorithm in names, "options.algorithm", f"one of {', '.join(names)}", algorithm)
    _integer(_field(options, "channels", "options"), "options.channels", 1)
    _integer(_field(options, "slices", "options"), "options.slices", 1)
    if "packed" in options:
        _expect(isinstance(options["packed"], bool), "options.packed", "true or false", options["packed"])
    if "stage_copies" in options:  # traces from before staging copies have none (one copy)
        _expect(options["stage_copies"] in (1, 2) and not isinstance(options["stage_copies"], bool),
                "options.stage_copies", "1 or 2", options["stage_copies"])
    key = _string(_field(options, "key", "options"), "options.key")  # what check_matches compares
    from purlinc.snac.ir import KEY_PATTERN

    _expect(KEY_PATTERN.fullmatch(key) is not None, "options.key",
            "an options key like 'direct-push/c1/s1/slotsall/reg-' (LowerOptions.key())", key)


def _check_clock(clock) -> None:
    _object(clock, "clock")
    for n, entry in enumerate(_array(_field(clock, "ranks", "clock"), "clock.ranks")):
        where = f"clock.ranks[{n}]"
        _object(entry, where)
        _integer(_field(entry, "rank", where), f"{where}.rank")
        if "uncertainty_ns" in entry:
            _number(entry["uncertainty_ns"], f"{where}.uncertainty_ns")


def _check_event(event, where: str) -> None:
    _object(event, where)
    for name in ("rank", "channel", "block"):
        _integer(_field(event, name, where), f"{where}.{name}")
    if "round" in event:
        _integer(event["round"], f"{where}.round")
    for j, step in enumerate(_array(_field(event, "steps", where), f"{where}.steps")):
        _integer(step, f"{where}.steps[{j}]")
    start, end = (_number(_field(event, name, where), f"{where}.{name}") for name in ("start_ns", "end_ns"))
    _expect(0 <= start <= MAX_TRACE_NS, f"{where}.start_ns",
            f"a time from 0 (the call's first stamp) to {MAX_TRACE_NS:,.0f} ns (an hour)", start)
    _expect(start <= end <= MAX_TRACE_NS, f"{where}.end_ns",
            f"a time at or after start_ns ({_shown(start)}), at most {MAX_TRACE_NS:,.0f} ns (an hour)", end)


def _check_fields(data: dict) -> None:
    _string(data["collective"], "collective")
    _integer(data["world_size"], "world_size", 1)
    for name, value in _object(data["params"], "params").items():
        _integer(value, f"params.{name}", None)  # a parameter may be negative
    _check_options(data["options"])
    _check_clock(data["clock"])
    for n, event in enumerate(_array(data["events"], "events")):
        _check_event(event, f"events[{n}]")


def options_of(data: dict) -> dict:
    """The LowerOptions fields the trace fixes (load() has checked their types and the key's
    shape): slots and registered buffers from the options' key, where alone they are."""
    from purlinc.snac.ir import KEY_PATTERN, Algorithm

    o = data["options"]
    key = KEY_PATTERN.fullmatch(o["key"])
    slots = None if key["slots"] == "all" else int(key["slots"])
    registered = frozenset() if key["registered"] == "-" else frozenset(key["registered"].split(","))
    # A trace from before staging copies existed ran one copy (its key has no /x2).
    return {"algorithm": Algorithm(o["algorithm"]), "channels": o["channels"], "slices": o["slices"],
            "packed": o.get("packed", False), "stage_copies": o.get("stage_copies", 1),
            "slots": slots, "registered": registered}


def channels_of(data: dict) -> tuple[int, ...]:
    return tuple(sorted({int(e["channel"]) for e in data["events"]}))


def check_matches(data: dict, schedule, path: str) -> None:
    """The trace must come from this schedule: same collective, world size and options."""
    want = (schedule.collective, schedule.world_size, schedule.options.key())
    got = (data["collective"], data["world_size"], data["options"].get("key"))
    if want != got:
        raise PurlinError(
            f"trace {path} is of {got[0]} R={got[1]} {got[2]}, but the file gives {want[0]} R={want[1]} {want[2]}",
            notes=("draw a trace with the .pln file it was recorded from",),
        )
    for e in data["events"]:
        rank, channel = int(e["rank"]), int(e["channel"])
        if not (0 <= rank < schedule.world_size and 0 <= channel < schedule.channels):
            raise PurlinError(f"trace {path}: event of rank {rank} channel {channel} is outside the schedule")
        steps = len(schedule.program(rank, channel).steps)
        bad = [s for s in e["steps"] if not 0 <= int(s) < steps]
        if bad:
            raise PurlinError(f"trace {path}: rank {rank} channel {channel} names step {bad[0]}, "
                              f"but its program has {steps} step{'' if steps == 1 else 's'}")
    _check_every_rank_drawn(data, schedule, path)


def _check_every_rank_drawn(data: dict, schedule, path: str) -> None:
    """Every rank with steps has a stamped step in the drawn round (0): a trace whose world_size
    disagrees with its events (R=4 over an R=2 run) drew its ranks at the wrong steps and the
    rest as empty columns; one with nothing in round 0 drew only empty boxes."""
    world_size = schedule.world_size
    stamped = {int(e["rank"]) for e in data["events"] if e.get("round", 0) == 0 and e["steps"]}
    working = {rank for rank in range(world_size)
               if any(schedule.program(rank, c).steps for c in range(schedule.channels))}
    missing = sorted(working - stamped)
    if not missing:
        return
    shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
    raise PurlinError(f"trace {path}: rank{'s' if len(missing) > 1 else ''} {shown} of its world size "
                      f"{world_size} {'have' if len(missing) > 1 else 'has'} no stamped step in round 0",
                      notes=("a trace holds every rank's stamps (coll.trace() on every rank); its world_size "
                             "must be the ranks it was recorded on",))


def times(data: dict, drawing, round_: int = 0) -> tuple[Times, dict]:
    """Measured spans (us) of every drawn step, from one round; and the hover text per step."""
    spans, measured, blocks = {}, {}, {}
    clock = {r["rank"]: r for r in data["clock"]["ranks"]}
    for e in data["events"]:
        if e.get("round", 0) != round_ or not e["steps"]:
            continue
        start, end = e["start_ns"] / 1e3, e["end_ns"] / 1e3
        n = len(e["steps"])
        skew = clock.get(e["rank"], {}).get("uncertainty_ns", 0.0)
        for j, step in enumerate(e["steps"]):
            key = (int(e["rank"]), int(e["channel"]), int(step))
            spans[key] = (start + (end - start) * j / n, start + (end - start) * (j + 1) / n)
            blocks[key] = (start, end)
            measured[key] = (f"measured: block {e['block']} (steps {', '.join(map(str, e['steps']))}) "
                             f"{start:.3f} .. {end:.3f} us (rank 0's clock, +-{skew:.0f} ns)")
    missing = 0
    for lane in drawing.lanes:
        last = 0.0
        for box in lane.steps:
            if box.key in spans:
                last = spans[box.key][1]
            else:
                spans[box.key] = (last, last)
                missing += 1
    total = max((e for _, e in spans.values()), default=0.0)
    notes = [f"measured on {data.get('device') or 'the GPU'}, call {data.get('calls')}, round {round_}; "
             f"timebase {data.get('timebase')}; clocks aligned by {data['clock'].get('method')}"]
    if missing:
        notes.append(f"{missing} step(s) have no stamp (drawn with no width)")
    early, gap = acausal_waits(drawing, blocks, clock)
    if early:
        notes.append(f"warning: {early} wait{'s end' if early != 1 else ' ends'} before the notify that releases "
                     f"{'them' if early != 1 else 'it'} by more than the clocks' uncertainty (by up to {gap:.2f} us): "
                     "the ranks' clocks are misaligned, so cross-rank order in this drawing is not reliable")
    return Times("us", spans, total, tuple(notes)), measured


def acausal_waits(drawing, blocks: dict, clock: dict) -> tuple[int, float]:
    """Notify -> wait pairs whose wait ends before its notify starts, by more than the two
    ranks' clock uncertainty together: a wait cannot end before the store that releases it, so
    the aligned clocks are wrong there.  Compared by the blocks' stamps (a block's time split
    among its steps is drawn, not measured).  (How many, the largest gap in us.)"""
    count, worst = 0, 0.0
    for pair in drawing.pairs:
        if pair.notify not in blocks or pair.wait not in blocks:
            continue
        bound = sum(clock.get(key[0], {}).get("uncertainty_ns", 0.0) for key in (pair.notify, pair.wait)) / 1e3
        gap = blocks[pair.notify][0] - blocks[pair.wait][1]
        if gap > bound:
            count, worst = count + 1, max(worst, gap)
    return count, worst
