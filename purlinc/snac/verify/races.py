"""3. Races and 4. the result (see the package docstring): one walk of the topological order
checks every conflicting pair is ordered and executes call 0 symbolically."""

from __future__ import annotations

from collections import Counter
from operator import attrgetter

from purlinc.frontend.spec import Slot, Spec
from purlinc.snac.ir import Consume, Region, Schedule, Space, Stage
from purlinc.snac.verify.common import VerificationError, describe, step_kind
from purlinc.snac.verify.order import Node, Order


def _race_message(order: Order, region: Region, later: Node, earlier: Node, later_writes: bool, earlier_writes: bool):
    """(key, error) for an unordered conflicting pair, located at a program step."""
    text = region.format()
    if order.is_caller(later) or order.is_caller(earlier):
        caller, other = (later, earlier) if order.is_caller(later) else (earlier, later)
        owner = caller[0] - order.np
        verb = "writes" if (later_writes if other == later else earlier_writes) else "reads"
        if order.call_of(other) == 0:  # may still run after the owner finished call 0
            message = (
                f"{verb} {text}, which rank {owner}'s caller owns again once rank {owner} finishes "
                "the call; it is not ordered before that by any notify/wait"
            )
        else:
            message = (
                f"{verb} {text} without being ordered after rank {owner} finishing the previous call "
                f"by any notify/wait (its caller may still be using its {region.space.value} buffer)"
            )
        return order.key(other), order.error(other, message)
    kind = step_kind(order.step(earlier))
    where = f"{kind} at {order.short(earlier)}"
    if not later_writes:
        message = f"reads {text}, whose {where} is not ordered before it by any notify/wait"
    elif not earlier_writes:
        message = (
            f"overwrites {text}, which the {where} reads, without being ordered after that read "
            "by any notify/wait (the slot is reused too early)"
        )
    else:
        message = f"writes {text}, also written by the {where}, and no notify/wait orders the two"
    return order.key(later), order.error(later, message)


_slot_key = attrgetter("rank", "position")  # Slot's own order, compared in C


def _format_value(value: tuple[Slot, ...] | None) -> str:
    if value is None:
        return "garbage"
    return " + ".join(map(str, value))


def _access_table(programs, extra_reads=None) -> tuple[list, list, dict]:
    """Per program and step, its accesses over interned regions: (reads, write, sources),
    where ``reads`` are region ids read and not written by the step (each once), ``write``
    is the id of the region written (-1: none) and ``sources`` the ids of its sources in
    order (what the symbolic execution reads).  ``extra_reads[p][i]``: regions step i of
    program p reads besides its sources (a sized Consume's size headers), for the race check
    only.  Regions are numbered once here, so the walk below indexes lists instead of hashing
    a Region per access and call."""
    ids: dict[Region, int] = {}
    regions: list[Region] = []
    # Lowerings share one Region object per place (``kit.region``): look objects up by
    # identity first (an int hashed in C; a Region's hash is Python code), by value on a miss,
    # so equal regions that are distinct objects still get one number.  The schedule keeps
    # every object alive, so no id is reused while this table lives.
    by_object: dict[int, int] = {}
    table = []

    def number(region: Region) -> int:
        r = ids.get(region)
        if r is None:
            r = ids[region] = len(regions)
            regions.append(region)
        by_object[id(region)] = r
        return r

    none = ((), -1, None)
    known = by_object.get
    for program in programs:
        rows = []
        append = rows.append
        for step in program.steps:
            kind = type(step)
            if kind is Stage:  # the common step, quickly: one source, one destination
                w = known(id(step.dst))
                if w is None:
                    w = number(step.dst)
                r = known(id(step.src))
                if r is None:
                    r = number(step.src)
                append(((r,) if r != w else (), w, (r,)))
                continue
            if kind is not Consume:
                append(none)
                continue
            w = known(id(step.dst))
            if w is None:
                w = number(step.dst)
            order = []
            for region in step.srcs:
                r = known(id(region))
                if r is None:
                    r = number(region)
                order.append(r)
            if len(order) == 1:
                reads = () if order[0] == w else (order[0],)
            else:  # each region once; a read-modify-write counts as a write
                reads = tuple(r for r in dict.fromkeys(order) if r != w)
            if extra_reads is not None and extra_reads[len(table)][len(rows)]:
                more = (number(region) if region not in ids else ids[region]
                        for region in extra_reads[len(table)][len(rows)])
                reads = tuple(r for r in dict.fromkeys((*reads, *more)) if r != w)
            append((reads, w, order))
        table.append(rows)
    return table, regions, ids


def check_races_and_result(schedule: Schedule, spec: Spec, order: Order, extra_reads=None) -> None:
    """Steps 3 and 4 in one walk of the topological order.

    Races: per region, accesses in the topological order; each access must be ordered after
    the previous write, and each write after the reads since the previous write.  The
    caller of each rank, between its calls, writes every IN and OUT region of its rank that
    some program touches.  Result: the same walk, over call 0's program steps, runs the
    symbolic execution; its errors are raised only if there is no race (races first).
    ``extra_reads``: reads beyond the steps' sources (``_access_table``), or None."""
    table, regions, ids = _access_table(order.programs, extra_reads)
    found, failure, values, writer, orders = _walk(order, table, regions)
    if found:
        raise min(found, key=lambda item: (item[0], item[1].message))[1]
    if failure is not None:
        raise failure
    _check_outputs(schedule, spec, order, ids, values, writer)
    if spec.is_reduce:
        _check_agreement(schedule, spec, order, ids, orders, writer)


def _callers_regions(regions: list[Region], world: int) -> list[list[int]]:
    """Regions in a caller's care, per rank: its IN and OUT regions that some program touches
    (the table numbers every region any step touches, in either call)."""
    mine = [[] for _ in range(world)]
    for i, region in enumerate(regions):
        if region.space is not Space.STAGE:
            mine[region.rank].append(i)
    return mine


def _walk(order: Order, table, regions: list[Region]):
    """The walk: (races found, the first result failure, call 0's values, their writers, the
    orders they were formed in)."""
    nreg = len(regions)
    np_, n, snap = order.np, order.n, order.snap
    last_write: list = [None] * nreg
    reads_since: list = [None] * nreg  # None: no read since the last write
    mine = _callers_regions(regions, order.world)
    found = []
    # Result state (call 0): region id -> multiset of slots (a sorted tuple) or None (garbage),
    # and the order its value was formed in (``Orders``).
    values: list = [(Slot(r.rank, r.unit),) if r.space is Space.IN else None for r in regions]
    orders = Orders(regions)
    writer: list = [None] * nreg  # last call-0 writer
    failure = None

    def race(i, later, earlier, later_writes, earlier_writes):
        found.append(_race_message(order, regions[i], later, earlier, later_writes, earlier_writes))

    def written(i, node):
        """Region ``i`` written by ``node``: ordered after the last write and the reads since."""
        p, pos = node
        vc = snap[p][pos]
        lw = last_write[i]
        if lw is not None and not (lw[1] < pos if lw[0] == p else vc[lw[0]] >= lw[1]):
            race(i, node, lw, True, True)
        rs = reads_since[i]
        if rs is not None:
            for read in rs:
                if not (read[1] < pos if read[0] == p else vc[read[0]] >= read[1]):
                    race(i, node, read, True, False)
            reads_since[i] = None
        last_write[i] = node

    for node in order.sequence:
        p, pos = node
        if p >= np_:  # a caller: rewrites its rank's IN and OUT
            for i in mine[p - np_]:
                written(i, node)
            continue
        count = n[p]
        reads, w, sources = table[p][pos - count if pos >= count else pos]
        if w < 0:
            continue
        # Races, inlined: this runs for every access of every step in both calls.
        vc = snap[p][pos]
        for i in reads:
            lw = last_write[i]
            if lw is not None and not (lw[1] < pos if lw[0] == p else vc[lw[0]] >= lw[1]):
                race(i, node, lw, False, True)
            rs = reads_since[i]
            if rs is None:
                reads_since[i] = [node]
            else:
                rs.append(node)
        lw = last_write[w]  # written(w, node), inlined
        if lw is not None and not (lw[1] < pos if lw[0] == p else vc[lw[0]] >= lw[1]):
            race(w, node, lw, True, True)
        rs = reads_since[w]
        if rs is not None:
            for read in rs:
                if not (read[1] < pos if read[0] == p else vc[read[0]] >= read[1]):
                    race(w, node, read, True, False)
            reads_since[w] = None
        last_write[w] = node
        if pos < count and failure is None:  # the result: call 0, symbolically
            failure = _execute(order, node, sources, w, values, writer, regions)
            if failure is None:
                orders.formed(w, sources)
    return found, failure, values, writer, orders


def _execute(order: Order, node, sources, w: int, values: list, writer: list, regions) -> VerificationError | None:
    """One call-0 step of the symbolic execution: region ``w`` gets the copy or the reduction
    of ``sources``; the error of a read of garbage, else None."""
    if len(sources) == 1:
        src = sources[0]
        result = values[src]
        if result is None:
            return _garbage_read(order, node, regions[src], writer[src])
    else:
        got = [values[i] for i in sources]
        bad = next((k for k, value in enumerate(got) if value is None), None)
        if bad is not None:
            return _garbage_read(order, node, regions[sources[bad]], writer[sources[bad]])
        # Several sources: a reduce (step 1 rejects a copy of more than one).  A single
        # source is a copy, or a reduce of one value, which is already sorted.
        result = tuple(sorted((slot for value in got for slot in value), key=_slot_key))
    values[w] = result
    writer[w] = node
    return None


class Orders:
    """How call 0 formed each region's value, as far as its bits depend on it: an input
    slot, or a reduction of other values in the order its Consume lists them (a kernel
    combines a Consume's sources in that order and rounds once, where it stores).  Each
    distinct order is numbered once (hash-consed), so equal orders are equal numbers however
    deep (a ring's chain of R - 1 partial sums) and comparing two is one comparison."""

    def __init__(self, regions: list[Region]):
        self.forms: list = []  # number -> a Slot, or a tuple of the numbers it reduces
        self._numbers: dict = {}
        self.of: list = [self._number(Slot(r.rank, r.unit)) if r.space is Space.IN else None for r in regions]

    def _number(self, form) -> int:
        number = self._numbers.get(form)
        if number is None:
            number = self._numbers[form] = len(self.forms)
            self.forms.append(form)
        return number

    def formed(self, w: int, sources) -> None:
        """Region ``w`` written from ``sources`` (region ids): a copy keeps its source's order.
        Even two operands keep theirs: max and min return the second of two equal values, so
        max(+0, -0) is -0 and max(-0, +0) is +0.  The order is the op's and the dtype's
        worst case (an int32 sum would agree in any order): one schedule serves every op."""
        of = self.of
        of[w] = of[sources[0]] if len(sources) == 1 else self._number(tuple(of[i] for i in sources))

    def format(self, number: int, depth: int = 0) -> str:
        form = self.forms[number]
        if isinstance(form, Slot):
            return str(form)
        if depth >= 4:
            return "(...)"
        return "(" + " + ".join(self.format(n, depth + 1) for n in form) + ")"


def _check_agreement(schedule: Schedule, spec: Spec, order: Order, ids: dict, orders: Orders, writer: list) -> None:
    """5. Agreement: every holder of a reduced chunk (each rank's output that names it, each
    slice) formed it in the same order, so the holders agree bit for bit, as a replicated
    all-reduce's ranks must (a tensor-parallel model's ranks go on from the same values).
    The multiset check above cannot see this: (a + b) + c and a + (b + c) hold the same slots."""
    first: dict = {}  # (chunk, slice) -> (rank, unit, order number)
    for rank in range(spec.world_size):
        for unit, chunk in enumerate(spec.outputs[rank]):
            for s in range(schedule.slices):
                i = ids.get(Region(Space.OUT, rank, unit, s))
                if i is None:
                    continue  # never written: _check_outputs has refused it
                number = orders.of[i]
                seen = first.setdefault((chunk, s), (rank, unit, number))
                if seen[2] == number:
                    continue
                other_rank, other_unit, other = seen
                text = (f"rank {rank} out[{unit}] ({chunk}) slice {s} is reduced as {orders.format(number)}, but rank "
                        f"{other_rank} out[{other_unit}] holds it as {orders.format(other)}: the same sources in "
                        "another order, so the two may differ in their last bits")
                _, channel, index, _ = order.where(writer[i])
                call = order.fail.split(rank, channel, index, 0)[1]
                raise VerificationError(text, rank=rank, channel=channel, step=order.fail.index(rank, channel, index),
                                        call=call)


def _check_outputs(schedule: Schedule, spec: Spec, order: Order, ids: dict, values: list, writer: list) -> None:
    """Every output slice holds exactly what the spec names (after call 0)."""
    per_channel = schedule.options.slices
    for rank in range(spec.world_size):
        for unit, sources in enumerate(spec.sources[rank]):
            for s in range(schedule.slices):
                region = Region(Space.OUT, rank, unit, s)
                i = ids.get(region)
                problem = _output_problem(spec, None if i is None else values[i], sources)
                if problem is None:
                    continue
                chunk = spec.outputs[rank][unit]
                line = spec.output_line(rank, unit)
                named = f"{chunk}" + (f", line {line}" if line is not None else "")
                last = None if i is None else writer[i]
                text = f"rank {rank} out[{unit}] ({named}) slice {s} {problem}"
                if last is not None:
                    text += f" (last written by {order.short(last)}: {describe(order.step(last))})"
                _, channel, index, _ = order.where(last) if last is not None else (rank, s // per_channel, None, 0)
                call = 0 if index is None else order.fail.split(rank, channel, index, 0)[1]
                raise VerificationError(text, rank=rank, channel=channel, step=order.fail.index(rank, channel, index), call=call)


def _garbage_read(order: Order, node, region: Region, writer) -> VerificationError:
    why = "nothing writes it before" if writer is None else "it holds garbage"
    return order.error(node, f"reads {region.format()}, which holds no data in call 0 ({why})")


def _output_problem(spec: Spec, value, sources: tuple[Slot, ...]) -> str | None:
    if value is None:
        return "is never written (holds garbage)"
    if not spec.is_reduce:
        if len(value) == 1 and value[0] in sources:
            return None
        want = " or ".join(map(str, sources))
        return f"holds {_format_value(value)}, expected a copy of {want}"
    if value == tuple(sorted(sources, key=_slot_key)):  # values of reductions are kept sorted
        return None
    got, want = Counter(value), Counter(sources)
    if got == want:
        return None
    details = []
    for slot in sorted(got):
        if slot not in want:
            details.append(f"{slot} is not part of it")
        elif got[slot] > want[slot]:
            details.append(f"{slot} is counted {got[slot]} times")
    missing = sorted(slot for slot in want if got[slot] < want[slot])
    if missing:
        details.append("missing " + ", ".join(map(str, missing)))
    return f"holds {_format_value(value)}: " + "; ".join(details)
