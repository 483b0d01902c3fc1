"""A channel program as blocks: the plain values a ``block_<kind>.cu.j2`` template formats.

Data steps become ``copy`` / ``reduce`` blocks (or ``ll_send`` for packed stages), runs of
Notifies and Waits become merged signal groups (one lane of warp 0 per signal), a packed
consume group becomes receive loops and a barrier (``ll.ll_block``), and a ``barrier`` goes between data
steps that touch the same region (threads split work differently from one step to the next).
The blocks are then fused (``fuse``, ``ll.fuse_sends``); ``tables`` makes runs of like blocks loops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import purlinc.atom.codegen.limits as limits
from purlinc.atom.codegen.exprs import num, one_line, packets_expr, region_expr, signal_expr, slice_expr
from purlinc.atom.codegen.fuse import fuse_copies
from purlinc.atom.codegen.ll import check_reorder, fuse_sends, ll_block
from purlinc.errors import InternalError
from purlinc.frontend.ast import Operation
from purlinc.atom.epilogue import epilogue_block, fuse_reduce
from purlinc.snac.ir import Consume, Epilogue, Notify, Program, Role, Stage, Wait
from purlinc.snac.packing import ll_groups


def data_block(index: int, step: Stage | Consume | Epilogue, rank: int, flags: dict) -> dict:
    """``flags``: Schedule.packet_flags(), the packet flags of packed stages."""
    if isinstance(step, Epilogue):  # its own module (purlinc.atom.epilogue) and template
        return epilogue_block(index, step, region_expr(step.region, rank), slice_expr(step.region.slice))
    srcs = (step.src,) if isinstance(step, Stage) else step.srcs
    regions = (*srcs, step.dst)
    if len({r.slice for r in regions}) != 1:
        raise InternalError(f"step {index} mixes slices: {', '.join(r.format() for r in regions)}")
    if isinstance(step, Stage) and step.packed:
        return _ll_send_block(index, step, rank, flags)
    if isinstance(step, Stage):
        kind, what = "copy", f"stage {step.src.format()} -> {step.dst.format()}"
    else:
        kind = "reduce" if step.operation is Operation.REDUCE else "copy"
        if kind == "copy":
            srcs = srcs[:1]  # replicated producers hold identical data: any one serves
        what = f"consume {step.operation.value} {', '.join(r.format() for r in step.srcs)} -> {step.dst.format()}"
    extra = [t for t in (one_line(step.note), f"line {step.line}" if getattr(step, "line", None) else "") if t]
    comment = f"step {index}: {what}" + (f" ({'; '.join(extra)})" if extra else "")
    return {
        "kind": kind,
        "comments": [comment],
        "dst": region_expr(step.dst, rank),
        "srcs": [region_expr(r, rank) for r in srcs],
        "slice": slice_expr(step.dst.slice),
        "regions": (step.dst, *srcs),
        "reads": frozenset(srcs),
        "writes": frozenset({step.dst}),
    }


def _ll_send_block(index: int, step: Stage, rank: int, flags: dict) -> dict:
    note = f" ({one_line(step.note)})" if step.note else ""
    stride, base = flags[step.signal]
    return {
        "kind": "ll_send",
        "comments": [f"step {index}: stage+notify {step.src.format()} -> {step.dst.format()}, "
                     f"{step.signal.format()} notify {step.k}: flag epoch*{stride} + {base + step.k} in every packet "
                     f"(LL){note}"],
        "dst": packets_expr(step.dst),
        "srcs": [region_expr(step.src, rank)],
        "slice": slice_expr(step.dst.slice),
        "per_call": num(stride),
        "k": num(base + step.k),
        "reads": frozenset({step.src}),
        "writes": frozenset({step.dst}),
    }


def _signal_entry(index: int, step: Notify | Wait, per_call: dict, position: int, last: bool) -> dict:
    if step.signal not in per_call:
        raise InternalError(f"step {index}: signal {step.signal.format()} is not declared")
    return {
        "label": "default" if last else f"case {position}",
        "owner": num(step.signal.owner),
        "index": signal_expr(step.signal.index),
        "per_call": num(per_call[step.signal]),
        "k": num(step.k),
        "step": num(index),
    }


def signal_block(kind: str, group: list[tuple[int, Notify | Wait]], per_call: dict, relaxed: bool = False) -> dict:
    comments = []
    for index, step in group:
        verb = "notify" if kind == "notify" else "wait"
        rel = "=" if kind == "notify" else ">="
        note = f" ({one_line(step.note)})" if step.note else ""
        comments.append(f"step {index}: {verb} {step.signal.format()} {rel} epoch*{per_call.get(step.signal, '?')} + {step.k}{note}")
    signals = [_signal_entry(i, s, per_call, n, n == len(group) - 1) for n, (i, s) in enumerate(group)]
    if relaxed:
        comments.append("ACK notifies: relaxed stores (the reads they announce have returned; see purlin_notify_relaxed)")
    # One signal: thread 0 alone, no lane dispatch.
    return {
        "kind": kind if len(group) > 1 else f"{kind}_one", "comments": comments, "signals": signals,
        "store": "purlin_notify_relaxed" if relaxed else "purlin_notify",
    }


@dataclass(slots=True)
class _Blocks:
    """The blocks of one program so far, and the regions touched since the last barrier."""

    program: Program
    per_call: dict
    flags: dict  # Schedule.packet_flags()
    roles: dict
    packed: dict
    groups: dict  # first wait index -> its LL consume group
    blocks: list = field(default_factory=list)
    reads: set = field(default_factory=set)
    writes: set = field(default_factory=set)

    def barrier_passed(self) -> None:
        self.reads.clear()
        self.writes.clear()

    def data(self, index: int) -> None:
        block = data_block(index, self.program.steps[index], self.program.rank, self.flags)
        if block["kind"] == "epilogue" and self._fuse_epilogue(block):
            return
        # isdisjoint, not a union: these sets grow over a run of copies with no barrier (a spec of
        # thousands of small chunks), and building reads | writes per step made that quadratic
        if not (block["reads"].isdisjoint(self.writes) and block["writes"].isdisjoint(self.reads)
                and block["writes"].isdisjoint(self.writes)):
            self.blocks.append({"kind": "barrier", "comments": [f"barrier: step {index} touches a region an earlier step just used"]})
            self.barrier_passed()
        self.reads.update(block["reads"])
        self.writes.update(block["writes"])
        self.blocks.append(block)

    def _fuse_epilogue(self, block: dict) -> bool:
        """Join an Epilogue to the reduce that wrote its region (``fuse_reduce``), when only
        notifies lie between them: the epilogue then runs before those notifies, which, as a
        data step moved above a notify (``fuse.fuse_copies``), only adds order."""
        at = len(self.blocks) - 1
        while at >= 0 and self.blocks[at]["kind"] in ("notify", "notify_one"):
            at -= 1
        fused = fuse_reduce(self.blocks[at], block) if at >= 0 else None
        if fused is not None:  # no barrier between them: each thread reads only what it computed
            self.blocks[at] = fused
        return fused is not None

    def waits(self, i: int) -> int:
        """The run of Waits at ``i`` (and the LL consume group it opens, if any); the next index."""
        steps, rank = self.program.steps, self.program.rank
        end = i
        while end < len(steps) and isinstance(steps[end], Wait):
            end += 1
        group = next((self.groups[w] for w in range(i, end) if w in self.groups), None)
        plain = [(w, steps[w]) for w in range(i, end) if group is None or w not in group.waits]
        for index, wait in plain:
            if wait.signal.owner != rank:
                raise InternalError(f"rank {rank} step {index} waits on {wait.signal.format()}, owned by another rank")
        for start in range(0, len(plain), limits.MAX_GROUP):
            self.blocks.append(signal_block("wait", plain[start:start + limits.MAX_GROUP], self.per_call))
        self.barrier_passed()  # a wait ends with a barrier
        if group is None:
            return end
        check_reorder(self.program, group)
        self.blocks.extend(ll_block(self.program, group, self.packed, self.per_call, self.flags))  # ends with a barrier
        self.barrier_passed()
        for c in range(end, group.end):
            if c not in group.consumes:
                self.data(c)
        return group.end

    def notifies(self, i: int) -> int:
        """The run of Notifies at ``i`` of one role (relaxed ACKs apart); the next index."""
        steps = self.program.steps
        relaxed = self.roles.get(steps[i].signal) is Role.ACK
        group = []
        while (i < len(steps) and isinstance(steps[i], Notify) and len(group) < limits.MAX_GROUP
               and (self.roles.get(steps[i].signal) is Role.ACK) == relaxed):
            group.append((i, steps[i]))
            i += 1
        self.blocks.append(signal_block("notify", group, self.per_call, relaxed))
        self.barrier_passed()  # a notify starts with a barrier
        return i


def program_blocks(program: Program, per_call: dict, flags: dict, roles: dict | None = None,
                   packed: dict | None = None) -> list[dict]:
    """A channel program as blocks: data steps, merged signal groups, and the barriers
    needed between data steps that touch the same region (threads split work differently
    from one step to the next).  ``per_call`` and ``flags``: Schedule.per_call() and
    Schedule.packet_flags()."""
    packed = packed or {}
    groups = {}
    if packed:
        found, problems = ll_groups(program, packed)
        if problems:
            index, message = problems[0]
            raise InternalError(f"rank {program.rank} channel {program.channel} step {index}: {message}")
        groups = {g.waits[0]: g for g in found}
    state = _Blocks(program, per_call, flags, roles or {}, packed, groups)
    i = 0
    while i < len(program.steps):
        step = program.steps[i]
        if isinstance(step, Wait):
            i = state.waits(i)
        elif isinstance(step, Notify):
            i = state.notifies(i)
        else:
            state.data(i)
            i += 1
    if state.reads or state.writes:
        # The next round reuses staging units and the counter update follows.
        state.blocks.append({"kind": "barrier", "comments": ["barrier: end of the round"]})
    return _mark_trailing_barriers(fuse_sends(fuse_copies(state.blocks)))


# Blocks whose code starts with a barrier every thread passes (a notify's __syncthreads, a
# wait's __syncthreads_or after the polls).
_BARRIER_FIRST = frozenset({"barrier", "notify", "notify_one", "wait", "wait_one"})


def _mark_trailing_barriers(blocks: list[dict]) -> list[dict]:
    """An epilogue's row sums are read after one barrier and may be written again by the next
    Epilogue step: it ends with a barrier of its own (``trailing_barrier``) unless the block
    after it starts with one (the round's last block is a barrier whenever it wrote anything)."""
    for at, block in enumerate(blocks):
        if block["kind"] in ("epilogue", "reduce_epilogue"):
            after = blocks[at + 1]["kind"] if at + 1 < len(blocks) else None
            block["trailing_barrier"] = after not in _BARRIER_FIRST
    return blocks
