"""SNAC schedule -> CUDA source, through Jinja templates under ``purlinc.templates``.

Every decision is made here and handed to the templates as plain values: which blocks a
channel program becomes (data steps, merged Notify / Wait groups, hazard barriers), how a
Region is addressed, which element conversions a dtype needs.  The templates only format.

Channels are indexed, not enumerated: a rank's entry runs its channel-relative program
(``purlinc.snac.ir``) for channel ``blockIdx.x``, every slice offset by ``slice0 = blockIdx.x *
S`` and every signal index by ``sig0 = blockIdx.x * W`` (expressions ``SLICE0`` / ``SIG0``
below), so the source does not grow with the number of channels.

The orchestration (``kernel.cu.j2`` and its includes) calls only ``purlin_copy`` and
``purlin_reduce<N>``, which the atom's template defines; the atom's text sits between two
marker lines, so ``KernelSource.orchestration_source`` is the module without it.

Packed (LL) schedules (``purlinc.snac.packing``) add a small datapath shared by every atom,
``ll.cuh.j2``, because LL is a signal mechanism: a packed Stage becomes ``purlin_ll_send``
(every thread writes 16-byte packets carrying the flag; no barrier, no fence), and a consume
group -- the packed Waits plus the Consumes right after them that read packets -- becomes
one ``ll_recv`` block in which every thread polls its own packets and writes (or reduces)
their data straight to OUT, then one barrier.  Notifies of ACK signals are relaxed stores
(see ``purlin_notify_relaxed`` in the prelude); DATA notifies keep release semantics.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields, is_dataclass
from enum import Enum
from functools import lru_cache

import jinja2

import purlinc
from purlinc.atom.abi import KernelABI
from purlinc.atom.atoms import get_atom, parse_arch, templates_root
from purlinc.dtypes import DType, ReduceOp
from purlinc.errors import InternalError, PurlinError
from purlinc.frontend.ast import Operation
from purlinc.atom.epilogue import epilogue_block, module_values
from purlinc.snac.ir import Consume, Epilogue, Notify, Program, Region, Role, Schedule, Space, Stage, Wait
from purlinc.snac.packing import ll_groups, packed_stages
from purlinc.atom.trace import trace_template_values

THREADS = 512  # block size of every channel
# Packed (LL) schedules serve small messages, where a call is a few hundred packets per
# channel: fewer threads make every block barrier and the launch cheaper, and still give
# each thread only a few packets up to the sizes the tuner picks LL for.
THREADS_PACKED = 256
LDST_UNROLL_FALLBACK = 4  # the same loop inside other atoms (small pieces only)
LDST_UNROLL = 8  # 16-byte vectors in flight per thread in an ldst copy (64 KiB per 512-thread block: ~46 GB/s per block over NVLink was load-latency bound at 4)
MAX_GROUP = 32  # merged Notify / Wait groups use the lanes of warp 0

ATOM_BEGIN = "// ======== atom begin ========"
ATOM_END = "// ======== atom end ========"


@dataclass(frozen=True, slots=True)
class KernelSource:
    source: str
    filename: str  # e.g. purlin_allgather_1a2b3c4d.cu
    kernel_base: str  # purlin_<collective>_<hash8>; entries are f"{kernel_base}_r{rank}"
    abi: KernelABI
    atom: str
    arch: str
    dtype: DType
    op: ReduceOp | None
    atom_start: int  # the atom's text is source[atom_start:atom_end]
    atom_end: int
    # Traced kernels only (generate(trace=True)): per rank, per channel, the step indices of
    # each block in order; the kernel's trace marks are numbered after these blocks.
    trace_blocks: tuple = ()

    @property
    def atom_source(self) -> str:
        return self.source[self.atom_start:self.atom_end]

    @property
    def orchestration_source(self) -> str:
        """Everything but the atom, with the kernel name made neutral: what must not change
        when the same schedule is generated for another atom."""
        rest = self.source[: self.atom_start] + "<atom>" + self.source[self.atom_end:]
        return rest.replace(self.kernel_base, "<kernel>").replace(f"atom '{self.atom}'", "atom '<atom>'")


# ---- element types ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Elem:
    storage: str  # C type holding one element's bits
    acc: str  # accumulator type
    suffix: str  # purlin_<suffix>_to_acc / purlin_acc_to_<suffix> in elem.cuh
    ops: str  # "f" or "i": purlin_<op>_<ops>


_ELEMS = {
    DType.FLOAT32: _Elem("float", "float", "f32", "f"),
    DType.FLOAT16: _Elem("unsigned short", "float", "f16", "f"),
    DType.BFLOAT16: _Elem("unsigned short", "float", "bf16", "f"),
    DType.INT32: _Elem("int", "int", "i32", "i"),
    DType.FLOAT8_E4M3: _Elem("unsigned char", "", "", ""),
    DType.FLOAT8_E5M2: _Elem("unsigned char", "", "", ""),
}


def _elem_values(dtype: DType, op: ReduceOp | None) -> dict:
    elem = _ELEMS[dtype]
    if op is None:
        return {"storage": elem.storage, "reduce": False}
    return {
        "storage": elem.storage,
        "reduce": True,
        "acc": elem.acc,
        "to_acc": f"purlin_{elem.suffix}_to_acc",
        "from_acc": f"purlin_acc_to_{elem.suffix}",
        "combine": f"purlin_{op.value}_{elem.ops}",
    }


# ---- templates -------------------------------------------------------------------------

def _load_template(name: str) -> str:
    return (templates_root() / name).read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FunctionLoader(_load_template),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def _render(name: str, **values) -> str:
    try:
        return _environment().get_template(name).render(**values)
    except jinja2.TemplateSyntaxError as error:
        raise PurlinError(
            f"template {error.name or name}:{error.lineno}: {error.message}",
            notes=("the code generator's templates are broken: a bug in purlinc",),
        ) from None
    except jinja2.UndefinedError as error:
        raise PurlinError(
            f"template {name}: {error.message}",
            notes=("the code generator passed the template too little: a bug in purlinc",),
        ) from None


# ---- names -----------------------------------------------------------------------------

def _canonical(value):
    """A JSON-able, order-stable picture of IR values (frozensets sorted, enums by value)."""
    if is_dataclass(value):
        return {"@": type(value).__name__, **{f.name: _canonical(getattr(value, f.name)) for f in fields(value)}}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (frozenset, set)):
        return sorted(_canonical(v) for v in value)
    if isinstance(value, (tuple, list)):
        return [_canonical(v) for v in value]
    return value


def kernel_base(schedule: Schedule, atom: str, dtype: DType, op: ReduceOp | None) -> str:
    """``purlin_<collective>_<hash8>``, the hash over schedule, atom, dtype and op.

    Dataclass and enum reprs are deterministic; the options' frozenset is not (string
    hashing is salted per process), so the options enter through their stable ``key()``.
    """
    picture = repr((
        schedule.collective, schedule.world_size, schedule.operation, schedule.options.key(), schedule.slices,
        schedule.in_units, schedule.out_units, schedule.stage_units, schedule.signals, schedule.programs,
        schedule.channel_signals,
        atom, dtype.value, op.value if op else None,
        # only with an epilogue, so that every other kernel keeps its name
        *((schedule.epilogue.format(),) if schedule.epilogue is not None else ()),
    ))
    digest = hashlib.sha256(picture.encode()).hexdigest()[:8]
    return f"purlin_{schedule.collective}_{digest}"


# ---- schedule -> blocks ----------------------------------------------------------------

SLICE0 = "slice0"  # this block's first slice: blockIdx.x * slices per channel (rank.cu.j2)
SIG0 = "sig0"  # this block's first signal in every pad: blockIdx.x * channel_signals


def _slice_expr(s: int) -> str:
    """The concrete slice of channel-relative slice ``s``, as the kernel computes it."""
    return f"{SLICE0} + {s}"


def _signal_expr(index: int) -> str:
    return f"{SIG0} + {index}"


def _region_expr(region: Region, rank: int, unit: str | None = None) -> str:
    """The address of ``region`` for ``rank``'s kernel; ``unit`` overrides its unit with an
    expression (a loop over a run of steps, see ``_runs``)."""
    unit, s = region.unit if unit is None else unit, _slice_expr(region.slice)
    if region.space is Space.STAGE:
        return f"purlin_stage(args.stage[{region.rank}], {unit}, {s}, rd)"
    own, peers = ("args.in", "args.in_peer") if region.space is Space.IN else ("args.out", "args.out_peer")
    base = own if region.rank == rank else f"{peers}[{region.rank}]"
    return f"purlin_io({base}, {unit}, {s}, rd)"


def _packets_expr(region: Region) -> str:
    return f"purlin_stage_ll(args.stage[{region.rank}], {region.unit}, {_slice_expr(region.slice)}, rd)"


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _data_block(index: int, step: Stage | Consume | Epilogue, rank: int, per_call: dict) -> dict:
    if isinstance(step, Epilogue):
        return epilogue_block(index, step, _region_expr(step.region, rank), _slice_expr(step.region.slice))
    srcs = (step.src,) if isinstance(step, Stage) else step.srcs
    regions = (*srcs, step.dst)
    if len({r.slice for r in regions}) != 1:
        raise InternalError(f"step {index} mixes slices: {', '.join(r.format() for r in regions)}")
    if isinstance(step, Stage) and step.packed:
        note = f" ({_one_line(step.note)})" if step.note else ""
        return {
            "kind": "ll_send",
            "comments": [f"step {index}: stage+notify {step.src.format()} -> {step.dst.format()}, "
                         f"{step.signal.format()} = epoch*{per_call[step.signal]} + {step.k} in every packet (LL){note}"],
            "dst": _packets_expr(step.dst),
            "srcs": [_region_expr(step.src, rank)],
            "slice": _slice_expr(step.dst.slice),
            "per_call": per_call[step.signal],
            "k": step.k,
            "reads": frozenset({step.src}),
            "writes": frozenset({step.dst}),
        }
    if isinstance(step, Stage):
        kind, what = "copy", f"stage {step.src.format()} -> {step.dst.format()}"
    else:
        kind = "reduce" if step.operation is Operation.REDUCE else "copy"
        if kind == "copy":
            srcs = srcs[:1]  # replicated producers hold identical data: any one serves
        what = f"consume {step.operation.value} {', '.join(r.format() for r in step.srcs)} -> {step.dst.format()}"
    extra = [t for t in (_one_line(step.note), f"line {step.line}" if getattr(step, "line", None) else "") if t]
    comment = f"step {index}: {what}" + (f" ({'; '.join(extra)})" if extra else "")
    return {
        "kind": kind,
        "comments": [comment],
        "dst": _region_expr(step.dst, rank),
        "srcs": [_region_expr(r, rank) for r in srcs],
        "slice": _slice_expr(step.dst.slice),
        "loop": 0,
        "regions": (step.dst, *srcs),
        "reads": frozenset(srcs),
        "writes": frozenset({step.dst}),
    }


def _signal_entry(index: int, step: Notify | Wait, per_call: dict, position: int, last: bool) -> dict:
    if step.signal not in per_call:
        raise InternalError(f"step {index}: signal {step.signal.format()} is not declared")
    return {
        "label": "default" if last else f"case {position}",
        "owner": step.signal.owner,
        "index": _signal_expr(step.signal.index),
        "per_call": per_call[step.signal],
        "k": step.k,
        "step": index,
    }


def _signal_block(kind: str, group: list[tuple[int, Notify | Wait]], per_call: dict, relaxed: bool = False) -> dict:
    comments = []
    for index, step in group:
        verb = "notify" if kind == "notify" else "wait"
        rel = "=" if kind == "notify" else ">="
        note = f" ({_one_line(step.note)})" if step.note else ""
        comments.append(f"step {index}: {verb} {step.signal.format()} {rel} epoch*{per_call.get(step.signal, '?')} + {step.k}{note}")
    signals = [_signal_entry(i, s, per_call, n, n == len(group) - 1) for n, (i, s) in enumerate(group)]
    if relaxed:
        comments.append("ACK notifies: relaxed stores (the reads they announce have returned; see purlin_notify_relaxed)")
    # One signal: thread 0 alone, no lane dispatch.
    return {
        "kind": kind if len(group) > 1 else f"{kind}_one", "comments": comments, "signals": signals,
        "store": "purlin_notify_relaxed" if relaxed else "purlin_notify",
    }


def _ll_block(program: Program, group, packed: dict, per_call: dict) -> dict:
    """A consume group: its packed waits vanish into the packet polls of its consumes, which
    run as fused loops (``_ll_batches``)."""
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
        srcs = []
        for position, region in enumerate(step.srcs if kind == "reduce" else step.srcs[:1]):
            stage = packed.get(region)
            if stage is None:
                srcs.append({"expr": _region_expr(region, rank), "packed": False, "position": position, "region": region,
                             "step": 0, "index": "0"})
                continue
            if region.rank != rank or stage.signal not in wait_of:
                raise InternalError(f"rank {rank} step {c} reads packed {region.format()} outside its consume group")
            srcs.append({
                "expr": _packets_expr(region), "packed": True, "position": position, "region": region,
                "per_call": per_call[stage.signal], "k": stage.k,
                "step": wait_of[stage.signal], "index": _signal_expr(stage.signal.index),
            })
        if kind == "copy" and not srcs[0]["packed"]:
            raise InternalError(f"rank {rank} step {c}: a fused copy must read packets")
        note = f" ({_one_line(step.note)})" if step.note else ""
        what = ", ".join(r.format() for r in step.srcs)
        comments.append(f"step {c}: consume {step.operation.value} {what} -> {step.dst.format()} from the packets{note}")
        consumes.append({"kind": kind, "step": c, "dst": _region_expr(step.dst, rank), "dst_region": step.dst,
                         "slice": _slice_expr(step.dst.slice), "srcs": srcs})
    batches = _ll_batches(consumes)
    if len(batches) > 1:
        comments.append(f"consumes in {len(batches)} loops, one after the other (a loop takes consumes of one "
                        f"shape, at most {LL_BATCH_SOURCES} sources, none reading what an earlier one of the loop writes)")
    return {"kind": "ll_recv", "comments": comments, "batches": batches}


LL_BATCH_SOURCES = 8  # sources per receive loop (C consumes x N sources): 4 registers each per packet in flight
LL_SEND_SOURCES = 8  # distinct sources per fused send loop: 2 registers each per packet in flight
LL_IN_FLIGHT = 4  # packets per thread a send or receive loop keeps in flight (its unroll: this / sources)
# A module with at most this many receive loops (all ranks) inlines purlin_ll_consume: the
# loop's arguments then stay in registers instead of going through the stack.  Beyond it the
# loops share one out-of-line body per shape, which keeps NVRTC time flat (an 8-GPU
# all-reduce has 64 loops: 12 s inlined, 4 s shared, measured 2026-11-30).
LL_INLINE_LOOPS = 16


def _ll_unroll(sources: int) -> int:
    return max(1, LL_IN_FLIGHT // max(1, sources))


def _ll_batches(consumes: list[dict]) -> list[dict]:
    """The consumes of one group as receive loops (``purlin_ll_consume<C, N, REDUCE, PACKED>``).  A
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
                or (len(last["consumes"]) + 1) * shape[1] > LL_BATCH_SOURCES):
            last = {"reduce": shape[0], "sources": shape[1], "packed": packed, "consumes": []}
            batches.append(last)
            written, read = set(), set()
        last["consumes"].append(consume)
        written.add(consume["dst_region"])
        read |= regions
    return batches


def _ll_loops(kernels: list[dict]) -> int:
    """Receive loops (purlin_ll_consume calls) in a module, every rank's entry counted."""
    return sum(len(block["batches"]) for kernel in kernels for block in kernel["blocks"] if block["kind"] == "ll_recv")


def _fuse_sends(blocks: list[dict]) -> list[dict]:
    """Adjacent packed stages (no barrier between them) as one loop: every thread loads the
    data of all its packets -- each distinct source once -- before it stores any, so no
    message's load waits behind another's store.  A stage that reads what the loop writes,
    or would take it past ``LL_SEND_SOURCES`` sources, starts a new loop."""
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
        (src,), (dst,) = block["reads"], block["writes"]
        if last is not None:
            known = src in last["source_of"]
            if (src in last["writes"] or dst in last["reads"] or dst in last["writes"]
                    or (not known and len(last["sources"]) == LL_SEND_SOURCES)):
                last = None
        if last is None:
            last = {"kind": "ll_sends", "comments": [], "sources": [], "messages": [], "copies": [],
                    "source_of": {}, "reads": set(), "writes": set()}
            out.append(last)
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
            block["kind"] = "ll_send"
            block["unroll"] = _ll_unroll(len(block["sources"]))
            block["sets_epoch"] = False  # generate() sets it on a program's first block
            block["reads"], block["writes"] = frozenset(block["reads"]), frozenset(block["writes"])
            del block["source_of"]
            if len(block["messages"]) + len(block["copies"]) > 1:
                copies = f" and {len(block['copies'])} local cop{'y' if len(block['copies']) == 1 else 'ies'}" \
                    if block["copies"] else ""
                messages = len(block["messages"])
                block["comments"].append(f"steps above: one loop, {messages} message{'s' if messages != 1 else ''}{copies} from "
                                         f"{len(block['sources'])} source(s), every load before the first store")
    return out


MAX_COPY_DSTS = 8  # destinations of one multi-destination copy (a pointer each, by value)


def _fuse_copies(blocks: list[dict]) -> list[dict]:
    """Plain copies of one source region as one copy to several destinations
    (``purlin_copy_multi<N>``): every vector is loaded once and stored N times.  An
    all-gather or broadcast stages its input to every peer and then copies it to its own
    output; fused, the input is read once, and the local stores ride along with the remote
    ones (which bound the loop) instead of taking a pass of their own after them.

    A copy joins the last copy before it when only notifies lie between them (it moves
    above those notifies) and it reads the same region, is one step (not a run), and writes
    nothing that copy reads or writes.  Moving a data step above a notify is always sound:
    a notify waits for nothing, so the step still follows every wait it followed, and its
    writes now also happen before the notify's release, which only adds order.  The cost is
    that the notify goes out after the moved stores too; they are local and issued in the same
    loop as the remote ones, so the loop's time is that of the remote stores either way."""
    out: list[dict] = []
    for block in blocks:
        if block["kind"] == "copy" and not block.get("loop") and len(block["reads"]) == 1:
            at = len(out) - 1
            while at >= 0 and out[at]["kind"] in ("notify", "notify_one"):
                at -= 1
            host = out[at] if at >= 0 else None
            if (host is not None and host["kind"] in ("copy", "copy_multi") and not host.get("loop")
                    and host["reads"] == block["reads"] and not (block["writes"] & (host["reads"] | host["writes"]))
                    and len(host.get("dsts", (host["dst"],))) < MAX_COPY_DSTS):
                if host["kind"] == "copy":
                    host = out[at] = {**host, "kind": "copy_multi", "dsts": [host["dst"]], "moved": 0}
                moved = len(out) - 1 - at
                host["dsts"].append(block["dst"])
                host["comments"] = host["comments"] + block["comments"]
                host["writes"] = host["writes"] | block["writes"]
                host["moved"] += moved
                continue
        out.append(block)
    for block in out:
        if block["kind"] == "copy_multi":
            moved = block.pop("moved")
            hoisted = f"; later ones moved above the {moved} notify block(s) between them" if moved else ""
            block["comments"] = block["comments"] + [
                f"steps above: one copy to {len(block['dsts'])} destinations, the source read once{hoisted}"]
            del block["dst"], block["regions"]
    return out


def _joins_send(block: dict, group: dict) -> bool:
    """Whether a copy block (straight after a send loop, no barrier between) can be written by
    that loop: one step (not a run), reading a source the loop loads, writing nothing the loop
    reads or writes."""
    if block.get("loop") or len(block["reads"]) != 1 or len(block["writes"]) != 1:
        return False
    (src,), (dst,) = block["reads"], block["writes"]
    return src in group["source_of"] and dst not in group["reads"] and dst not in group["writes"]


def _program_blocks(program: Program, per_call: dict, roles: dict | None = None, packed: dict | None = None) -> list[dict]:
    """A channel program as blocks: data steps, merged signal groups, and the barriers
    needed between data steps that touch the same region (threads split work differently
    from one step to the next)."""
    roles = roles or {}
    packed = packed or {}
    blocks: list[dict] = []
    reads: set[Region] = set()  # since the last barrier
    writes: set[Region] = set()
    steps = program.steps
    groups = {}
    if packed:
        found, problems = ll_groups(program, packed)
        if problems:
            index, message = problems[0]
            raise InternalError(f"rank {program.rank} channel {program.channel} step {index}: {message}")
        groups = {g.waits[0]: g for g in found}

    def data(index: int) -> None:
        block = _data_block(index, steps[index], program.rank, per_call)
        if block["reads"] & writes or block["writes"] & (reads | writes):
            blocks.append({"kind": "barrier", "comments": [f"barrier: step {index} touches a region an earlier step just used"]})
            reads.clear()
            writes.clear()
        reads.update(block["reads"])
        writes.update(block["writes"])
        blocks.append(block)

    i = 0
    while i < len(steps):
        step = steps[i]
        if isinstance(step, Wait):
            end = i
            while end < len(steps) and isinstance(steps[end], Wait):
                end += 1
            group = next((groups[w] for w in range(i, end) if w in groups), None)
            plain = [(w, steps[w]) for w in range(i, end) if group is None or w not in group.waits]
            for index, wait in plain:
                if wait.signal.owner != program.rank:
                    raise InternalError(f"rank {program.rank} step {index} waits on {wait.signal.format()}, owned by another rank")
            for start in range(0, len(plain), MAX_GROUP):
                blocks.append(_signal_block("wait", plain[start:start + MAX_GROUP], per_call))
            reads.clear()  # a wait ends with a barrier
            writes.clear()
            i = end
            if group is not None:
                _check_reorder(program, group)
                blocks.append(_ll_block(program, group, packed, per_call))  # ends with a barrier
                reads.clear()
                writes.clear()
                for c in range(end, group.end):
                    if c not in group.consumes:
                        data(c)
                i = group.end
            continue
        if isinstance(step, Notify):
            relaxed = roles.get(step.signal) is Role.ACK
            group = []
            while (i < len(steps) and isinstance(steps[i], Notify) and len(group) < MAX_GROUP
                   and (roles.get(steps[i].signal) is Role.ACK) == relaxed):
                group.append((i, steps[i]))
                i += 1
            blocks.append(_signal_block("notify", group, per_call, relaxed))
            reads.clear()  # a notify starts with a barrier
            writes.clear()
            continue
        data(i)
        i += 1
    if reads or writes:
        # The next round reuses staging units and the counter update follows.
        blocks.append({"kind": "barrier", "comments": ["barrier: end of the round"]})
    return _runs(_fuse_sends(_fuse_copies(blocks)), program.rank)


MIN_RUN = 3  # shorter runs of like steps stay straight-line code


def _step_of_run(first: tuple[Region, ...], block: dict, count: int, deltas: list[int] | None) -> list[int] | None:
    """The unit strides that make ``block`` the ``count``-th step of a run starting with
    ``first`` (None when it does not continue the run)."""
    regions = block.get("regions")
    if regions is None or len(regions) != len(first):
        return None
    strides = []
    for a, b in zip(first, regions):
        if (a.space, a.rank, a.slice) != (b.space, b.rank, b.slice) or (b.unit - a.unit) % count:
            return None
        strides.append((b.unit - a.unit) // count)
    return strides if deltas is None or strides == deltas else None


def _runs(blocks: list[dict], rank: int) -> list[dict]:
    """Consecutive copy (or reduce) blocks whose regions differ only by units in arithmetic
    progression become one loop over ``i``: the code grows with the structure of a program,
    not with its number of steps.  Only blocks that followed each other with no barrier are
    merged, so the loop runs exactly the steps, in order, that it replaces; every step keeps
    its comment."""
    out: list[dict] = []
    i = 0
    while i < len(blocks):
        block = blocks[i]
        if block["kind"] not in ("copy", "reduce"):
            out.append(block)
            i += 1
            continue
        first, deltas, end = block["regions"], None, i + 1
        while end < len(blocks) and blocks[end]["kind"] == block["kind"]:
            strides = _step_of_run(first, blocks[end], end - i, deltas)
            if strides is None:
                break
            deltas, end = strides, end + 1
        if end - i < MIN_RUN:
            out.extend(blocks[i:end])
            i = end
            continue

        def unit(region: Region, delta: int) -> str:
            return str(region.unit) if delta == 0 else f"{region.unit} + {delta} * i" if delta != 1 else f"{region.unit} + i"

        dst, *srcs = first
        exprs = [_region_expr(r, rank, unit(r, d)) for r, d in zip(first, deltas)]
        out.append({
            **block,
            "comments": [c for b in blocks[i:end] for c in b["comments"]]
                        + [f"steps above: one loop, i = 0..{end - i - 1} (units advance by {', '.join(map(str, deltas))})"],
            "dst": exprs[0],
            "srcs": exprs[1:],
            "loop": end - i,
        })
        i = end
    return out


def _check_reorder(program: Program, group) -> None:
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


def _needs_peers(schedule: Schedule, space: Space) -> bool:
    for program in schedule.programs:
        for step in program.steps:
            if isinstance(step, Stage):
                regions = (step.src, step.dst)
            elif isinstance(step, Consume):
                regions = (*step.srcs, step.dst)
            else:
                continue
            if any(r.space is space and r.rank != program.rank for r in regions):
                return True
    return False


def _check_types(schedule: Schedule, dtype: DType, op: ReduceOp | None) -> ReduceOp | None:
    if schedule.operation is not Operation.REDUCE:
        return None  # a copy collective ignores the operator
    if op is None:
        raise PurlinError(f"{schedule.collective} is a reduction: give an operator (sum, prod, max or min)")
    if not dtype.reducible:
        raise PurlinError(
            f"{dtype.value} cannot be reduced: fp8 is supported for copies only",
            notes=(f"while generating {schedule.collective}",),
        )
    return op


def generate(
    schedule: Schedule,
    spec,
    *,
    atom: str,
    arch: str,
    dtype: DType,
    op: ReduceOp | None,
    trace: bool = False,
) -> KernelSource:
    """The CUDA module of one (schedule, atom, dtype, op): one entry per rank.

    ``trace``: also record a %globaltimer / clock64 stamp after every block (purlinc.runtime.trace);
    off, the source is exactly the untraced one."""
    target = parse_arch(arch)
    atom_def = get_atom(atom, target)
    op = _check_types(schedule, dtype, op)
    base = kernel_base(schedule, atom, dtype, op)
    per_call = schedule.per_call()
    roles = {decl.signal: decl.role for decl in schedule.signals}
    packed = packed_stages(schedule)
    reduce = op is not None
    epilogue = module_values(schedule.epilogue, dtype)

    # The tma atom moves bulk data through its shared-memory ring (atoms.TmaRing); its ldst
    # fallback only carries heads, tails and small copies, and keeps the lighter unroll so the
    # inlined copy stays free of spills on every target.
    unroll = LDST_UNROLL if atom == "ldst" else LDST_UNROLL_FALLBACK
    atom_values = {"reduce": reduce, "unroll": unroll, **atom_def.template_values(target)}
    atom_text = _render(atom_def.template, **atom_values).rstrip("\n")
    kernels = []
    for rank, program in enumerate(schedule.programs):
        if (program.rank, program.channel) != (rank, 0):
            raise InternalError(f"schedule.programs[{rank}] is rank {program.rank} channel {program.channel}, "
                                f"expected rank {rank}'s channel-relative program")
        blocks = _program_blocks(program, per_call, roles, packed)
        # A program that starts by sending packets sets its round's epoch inside that send,
        # after issuing the data loads (block_ll_send.cu.j2): the call counter's load and the
        # data loads then overlap instead of adding up on every small call's critical path.
        if blocks and blocks[0]["kind"] == "ll_send":
            blocks[0] = {**blocks[0], "sets_epoch": True}
        kernels.append({"rank": rank, "entry": f"{base}_r{rank}", "steps": len(program.steps), "blocks": blocks})
    trace_values = trace_template_values(kernels, schedule.channels) if trace else None

    params_text = "".join(f", {k}={v}" for k, v in getattr(spec, "params", ()))
    threads = THREADS_PACKED if packed else THREADS
    source = _render(
        "kernel.cu.j2",
        kernel_base=base,
        collective=schedule.collective,
        world_size=schedule.world_size,
        params_text=params_text,
        version=purlinc.__version__,
        options_key=schedule.options.key(),
        slices=schedule.slices,
        channels=schedule.channels,
        channel_slices=schedule.options.slices,
        channel_signals=schedule.channel_signals,
        stage_units=schedule.stage_units,
        stage_copies=schedule.stage_copies,
        signal_pad=schedule.signal_pad_size(),
        atom=atom,
        dtype=dtype.value,
        op=op.value if op else "",
        threads=threads,
        itemsize=dtype.itemsize,
        stage_align=16 if packed else 1,
        ll_source=_render("ll.cuh.j2", reduce=reduce, in_flight=LL_IN_FLIGHT, consume_inline=_ll_loops(kernels) <= LL_INLINE_LOOPS
                          ).rstrip("\n") if packed else "",
        lean=bool(packed),
        prelude=_load_template("prelude.cuh").rstrip("\n"),
        elem_source=_load_template("elem.cuh").rstrip("\n"),
        elem=_elem_values(dtype, op),
        atom_begin=ATOM_BEGIN,
        atom_end=ATOM_END,
        atom_source=atom_text,
        kernels=kernels,
        trace=trace_values,
        epilogue=epilogue,
    )
    start = source.index(ATOM_BEGIN)
    end = source.index(ATOM_END) + len(ATOM_END)
    abi = KernelABI(
        kernel_base=base,
        world_size=schedule.world_size,
        channels=schedule.channels,
        threads=threads,
        shared_bytes=atom_def.shared_bytes(target),  # the tma atom's ring (dynamic shared memory)
        itemsize=dtype.itemsize,
        stage_units=schedule.staging_units,  # what the runtime allocates: every copy
        slices=schedule.slices,
        stage_copies=schedule.stage_copies,
        signal_pad=schedule.signal_pad_size(),
        stage_align=16 if packed else 1,
        lean=bool(packed),
        in_units=tuple(schedule.in_units),
        out_units=tuple(schedule.out_units),
        needs_in_peers=_needs_peers(schedule, Space.IN),
        needs_out_peers=_needs_peers(schedule, Space.OUT),
        epilogue_slots=epilogue["slots"] if epilogue else 0,
        row_bytes=epilogue["row_bytes"] if epilogue else 0,
    )
    return KernelSource(
        source=source, filename=f"{base}.cu", kernel_base=base, abi=abi, atom=atom, arch=target.name,
        dtype=dtype, op=op, atom_start=start, atom_end=end,
        trace_blocks=trace_values["blocks"] if trace else (),
    )
