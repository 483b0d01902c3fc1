"""Packed (LL) blocks: fused packet sends and the receive loops of a consume group.

LL is a signal mechanism, so it is shared by every atom (``ll.cuh.j2``): a packed Stage
becomes ``purlin_ll_send`` (every thread writes 16-byte packets carrying the flag; no
barrier, no fence), and a consume group -- the packed Waits plus the Consumes right after
them that read packets -- becomes ``ll_batch`` blocks, receive loops in which every thread
polls its own packets and writes (or reduces) their data straight to OUT, then one ``ll_done``
barrier.  A batch that failed (a timeout) skips the batches after it, and ``ll_done`` returns.
"""

from __future__ import annotations

import purlinc.atom.codegen.limits as limits
from purlinc.atom.codegen.exprs import num, one_line, packets_expr, region_expr, signal_expr, slice_expr
from purlinc.errors import InternalError
from purlinc.frontend.ast import Operation
from purlinc.snac.ir import Program, Region


def _ll_sources(program: Program, c: int, kind: str, packed: dict, flags: dict, wait_of: dict) -> list[dict]:
    """The sources of consume ``c``: packets it polls, or plain regions."""
    step, rank = program.steps[c], program.rank
    srcs = []
    for position, region in enumerate(step.srcs if kind == "reduce" else step.srcs[:1]):
        stage = packed.get(region)
        if stage is None:
            # Numbers where a packet source has them (a plain source's are unused), so a loop
            # whose plain source sits elsewhere in another rank's consume has the same code.
            srcs.append({"expr": region_expr(region, rank), "packed": False, "position": position, "region": region,
                         "per_call": num(0), "k": num(0), "step": num(0), "index": signal_expr(0)})
            continue
        if region.rank != rank or stage.signal not in wait_of:
            raise InternalError(f"rank {rank} step {c} reads packed {region.format()} outside its consume group")
        stride, base = flags[stage.signal]  # the flag its sender wrote (Schedule.packet_flags)
        srcs.append({
            "expr": packets_expr(region), "packed": True, "position": position, "region": region,
            "per_call": num(stride), "k": num(base + stage.k),
            "step": num(wait_of[stage.signal]), "index": signal_expr(stage.signal.index),
        })
    if kind == "copy" and not srcs[0]["packed"]:
        raise InternalError(f"rank {rank} step {c}: a fused copy must read packets")
    return srcs


def ll_block(program: Program, group, packed: dict, per_call: dict, flags: dict) -> list[dict]:
    """A consume group: its packed waits vanish into the packet polls of its consumes, which
    run as fused loops (``ll_batches``), one ``ll_batch`` block each, then ``ll_done``.
    ``flags``: Schedule.packet_flags(), the flag each packet carries."""
    steps, rank = program.steps, program.rank
    wait_of = {steps[w].signal: w for w in group.waits}
    comments = []
    for w in group.waits:
        wait = steps[w]
        comments.append(f"step {w}: wait {wait.signal.format()} >= epoch*{per_call[wait.signal]} + {wait.k}: "
                        "each thread polls the flags of its own packets below (LL)")
    consumes = []
    for c in group.consumes:
        step = steps[c]
        kind = "reduce" if step.operation is Operation.REDUCE else "copy"
        srcs = _ll_sources(program, c, kind, packed, flags, wait_of)
        note = f" ({one_line(step.note)})" if step.note else ""
        what = ", ".join(r.format() for r in step.srcs)
        consumes.append({"kind": kind, "step": c, "dst": region_expr(step.dst, rank), "dst_region": step.dst,
                         "slice": slice_expr(step.dst.slice), "srcs": srcs,
                         "comment": f"step {c}: consume {step.operation.value} {what} -> {step.dst.format()} from the packets{note}"})
    batches = ll_batches(consumes)
    if len(batches) > 1:
        comments.append(f"consumes in {len(batches)} loops, one after the other (a loop takes consumes of one "
                        f"shape, at most {limits.LL_BATCH_SOURCES} sources, none reading what an earlier one of the loop writes)")
    blocks = []
    for n, batch in enumerate(batches):
        lines = [c["comment"] for c in batch["consumes"]]
        blocks.append({"kind": "ll_batch", "comments": (comments if n == 0 else []) + lines, "batch": batch})
    return blocks + [{"kind": "ll_done", "comments": []}]


def ll_unroll(sources: int) -> int:
    return max(1, limits.LL_IN_FLIGHT // max(1, sources))


def ll_batches(consumes: list[dict]) -> list[dict]:
    """The consumes of one group as receive loops (``purlin_ll_consume<C, N, REDUCE>``, the packed mask an argument).  A
    loop issues every load of a packet index before it writes anything, so a consume that
    reads (or writes) what an earlier consume of the same loop writes starts a new loop; so
    does one of another shape -- kind, source count, which sources are packets (a template
    argument: one instantiation serves every loop of that shape) -- or one that would take
    the loop past ``LL_BATCH_SOURCES`` sources."""
    batches: list[dict] = []
    written: set[Region] = set()
    read: set[Region] = set()
    for consume in consumes:
        regions = {s["region"] for s in consume["srcs"]}
        packed = sum(1 << j for j, s in enumerate(consume["srcs"]) if s["packed"])
        shape = (consume["kind"] == "reduce", len(consume["srcs"]), packed)
        last = batches[-1] if batches else None
        if (last is None or (last["reduce"], last["sources"], last["packed"]) != shape
                or (regions | {consume["dst_region"]}) & written or consume["dst_region"] in read
                or (len(last["consumes"]) + 1) * shape[1] > limits.LL_BATCH_SOURCES):
            # The mask's 32 bits as the table's signed int: the loop's `unsigned` parameter
            # takes them back (R=32: 0xfffffffe).
            mask = packed - (1 << 32) if packed >= 1 << 31 else packed
            last = {"reduce": shape[0], "sources": shape[1], "packed": packed, "mask": num(mask), "consumes": []}
            batches.append(last)
            written, read = set(), set()
        last["consumes"].append(consume)
        written.add(consume["dst_region"])
        read |= regions
    return batches


def check_reorder(program: Program, group) -> None:
    """The group's packed consumes run first: no plain consume before one of them may conflict."""
    steps = program.steps
    fused = set(group.consumes)
    for p in range(group.consumes[0], group.end):
        if p in fused:
            continue
        plain = steps[p]
        for f in (c for c in group.consumes if c > p):
            later = steps[f]
            if plain.dst in (*later.srcs, later.dst) or later.dst in plain.srcs:
                raise InternalError(f"rank {program.rank} step {f} reads packets but conflicts with step {p} before it")


def _joins_send(block: dict, group: dict) -> bool:
    """Whether a copy block (straight after a send loop, no barrier between) can be written by
    that loop: one step, reading a source the loop loads, writing nothing the loop reads or
    writes."""
    if len(block["reads"]) != 1 or len(block["writes"]) != 1:
        return False
    (src,), (dst,) = block["reads"], block["writes"]
    return src in group["source_of"] and dst not in group["reads"] and dst not in group["writes"]


def _send_group(out: list[dict], last: dict | None, block: dict) -> dict:
    """The send loop ``block`` (a packed stage) joins: ``last``, or a new one appended to ``out``."""
    (src,), (dst,) = block["reads"], block["writes"]
    if last is not None:
        known = src in last["source_of"]
        if (src in last["writes"] or dst in last["reads"] or dst in last["writes"]
                or (not known and len(last["sources"]) == limits.LL_SEND_SOURCES)
                or len(last["messages"]) == limits.LL_SEND_MESSAGES):
            last = None
    if last is None:
        last = {"kind": "ll_sends", "comments": [], "sources": [], "messages": [], "copies": [],
                "source_of": {}, "reads": set(), "writes": set()}
        out.append(last)
    return last


def _finish_send(block: dict) -> None:
    block["kind"] = "ll_send"
    block["unroll"] = ll_unroll(len(block["sources"]))
    block["sets_epoch"] = False  # generate() sets it on a program's first block
    block["reads"], block["writes"] = frozenset(block["reads"]), frozenset(block["writes"])
    del block["source_of"]
    if len(block["messages"]) + len(block["copies"]) > 1:
        copies = f" and {len(block['copies'])} local cop{'y' if len(block['copies']) == 1 else 'ies'}" \
            if block["copies"] else ""
        messages = len(block["messages"])
        block["comments"].append(f"steps above: one loop, {messages} message{'s' if messages != 1 else ''}{copies} from "
                                 f"{len(block['sources'])} source(s), every load before the first store")


def fuse_sends(blocks: list[dict]) -> list[dict]:
    """Adjacent packed stages (no barrier between them) as one loop: every thread loads the
    data of all its packets -- each distinct source once -- before it stores any, so no
    message's load waits behind another's store.  A stage that reads what the loop writes,
    or would take it past ``LL_SEND_SOURCES`` sources or ``LL_SEND_MESSAGES`` messages,
    starts a new loop."""
    out: list[dict] = []
    for block in blocks:
        last = out[-1] if out and out[-1]["kind"] == "ll_sends" else None
        if block["kind"] == "copy" and last is not None and _joins_send(block, last):
            # A local copy of a source the loop already holds in registers (an all-gather's own
            # chunk): written from those registers in the same loop, instead of loading the
            # source again in a copy of its own after it.
            (src,), (dst,) = block["reads"], block["writes"]
            last["copies"].append({"dst": block["dst"], "source": last["source_of"][src]})
            last["comments"] += block["comments"]
            last["writes"].add(dst)
            continue
        if block["kind"] != "ll_send":
            out.append(block)
            continue
        last = _send_group(out, last, block)
        (src,), (dst,) = block["reads"], block["writes"]
        if src not in last["source_of"]:
            last["source_of"][src] = len(last["sources"])
            last["sources"].append({"expr": block["srcs"][0], "slice": block["slice"]})
        last["messages"].append({"dst": block["dst"], "source": last["source_of"][src],
                                 "per_call": block["per_call"], "k": block["k"]})
        last["comments"] += block["comments"]
        last["reads"].add(src)
        last["writes"].add(dst)
    for block in out:
        if block["kind"] == "ll_sends":
            _finish_send(block)
    return out
