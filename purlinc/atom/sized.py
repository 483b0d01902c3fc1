"""Kernels for schedules with run-time sizes (purlinc.snac.sized): SNAC schedule -> CUDA
source through ``templates/sized.cu.j2``, and the contract with the runtime that launches them.

Entry ``KernelABI.entry(rank)`` (``<kernel_base>_b<rank>``: one body per rank) takes one
``purlin_sized_args`` by value (all fields 8 bytes, no padding), in this order:

    capacity, in_len, out_len, unit_bytes, slot_bytes, region_bytes, copy_bytes, timeout_ns,  (u64)
    in, out, sizes, out_sizes, expected, counters, error, size_error,                       (pointers)
    stage[R], signals[R]                                                                    (pointers)

Sizes, the capacity and the buffer lengths count *units* of ``unit_bytes`` (an element, or
a row of elements: torch's split sizes count rows of dim 0).  ``sizes`` (int64, one per
input chunk, device memory) is read every call and ``out_sizes`` (int64, one per output
chunk) written every call: a CUDA graph captured once replays with whatever sizes the
device holds then.  ``expected`` (int64, one per output chunk, or null) holds the sizes the
caller expects to receive (torch's ``output_split_sizes``): where given, the output is laid
out by them and a chunk arriving with another size is not written
(``purlinc.frontend.evaluate.received_sizes``).  Staging per rank: ``stage_units`` slots
(both copies) laid out by ``purlinc.snac.sized.slot_layout`` for the load's capacity in
bytes, the second copy ``copy_bytes`` in; signal pads and counters as for every kernel
(purlinc.atom.abi).
Grid = channels, block = ``THREADS``.

``size_error`` is a host-mapped record of ``SIZE_ERROR_RECORD`` words, filled by the first
bad size of the rank (kind 1: a size outside 0..capacity; 2: an input chunk past the input
buffer; 3: an output chunk past the output buffer; 4: a chunk arriving with another size than
expected); the chunk is then moved as size 0, so nothing is written outside any buffer and no
wait is affected.
"""

from __future__ import annotations

import struct

from purlinc.atom.abi import SIZED_ARGS, SIZED_FIELDS, KernelABI
from purlinc.atom.atoms import get_atom, parse_arch
from purlinc.dtypes import DType
from purlinc.errors import PurlinError
from purlinc.frontend.evaluate import SIZE_ERROR_KINDS
from purlinc.snac.ir import Consume, Notify, Role, Schedule, Space, Stage, Wait
from purlinc.snac.sized import slot_layout
from purlinc.version import __version__

# size and bound count units of ``row`` elements (the call's row=; 0 from a kernel that did not say: 1)
SIZE_ERROR_RECORD = ("kind", "rank", "buffer", "position", "size", "bound", "epoch", "row")
SIZE_ERROR_BYTES = 8 * len(SIZE_ERROR_RECORD)
THREADS = 512


def slot_bytes(channels: int, capacity_bytes: int) -> int:
    """Bytes of one STAGE slot for chunks of up to ``capacity_bytes`` (``slot_layout``)."""
    return slot_layout(channels, capacity_bytes)[2]


def stage_bytes(abi: KernelABI, capacity_bytes: int) -> int:
    """Staging bytes per rank: every slot of both copies (``abi.stage_units`` counts both)."""
    return abi.stage_units * slot_bytes(abi.channels, capacity_bytes)


def pack_sized_args(abi: KernelABI, *, capacity_bytes: int, capacity: int, unit_bytes: int, in_len: int,
                    out_len: int, timeout_ns: int, in_ptr: int, out_ptr: int, sizes_ptr: int, out_sizes_ptr: int,
                    counters_ptr: int, error_ptr: int, size_error_ptr: int, stage: list[int],
                    signals: list[int], expected_ptr: int = 0) -> bytes:
    """The ``purlin_sized_args`` struct as bytes, ready to be passed by value.  The staging
    layout comes from the load's ``capacity_bytes`` (fixed); ``capacity`` counts this call's
    units (``capacity * unit_bytes <= capacity_bytes``); ``expected_ptr`` 0: no expected sizes."""
    world = abi.world_size
    if len(stage) != world or len(signals) != world:
        raise ValueError(f"expected {world} staging and signal pointers, got {len(stage)} and {len(signals)}")
    if capacity * unit_bytes > capacity_bytes:
        raise ValueError(f"capacity {capacity} x {unit_bytes} bytes exceeds the staging's {capacity_bytes} bytes")
    _, region, slot = slot_layout(abi.channels, capacity_bytes)
    copy = abi.stage_units // 2 * slot
    return struct.pack(f"<{len(SIZED_FIELDS) + 2 * world}Q", capacity, in_len, out_len, unit_bytes, slot, region,
                       copy, timeout_ns, in_ptr, out_ptr, sizes_ptr, out_sizes_ptr, expected_ptr, counters_ptr, error_ptr,
                       size_error_ptr, *stage, *signals)


def describe_size_error(words, spec) -> str:
    """The size error record as a sentence naming the rank, the chunk, its source and
    destination ranks, the size and the bound."""
    record = dict(zip(SIZE_ERROR_RECORD, words))
    kind = SIZE_ERROR_KINDS[record["kind"] - 1]
    rank, position = record["rank"], record["position"]
    size, bound = _signed(record["size"]), _signed(record["bound"])
    sizes = spec.sizes
    if record["buffer"] == 0:
        chunk = spec.inputs[rank][position]
        to = sorted({r for r, layout in enumerate(spec.outputs) for c in layout if c == chunk})
        pair = (f"chunk {chunk} from rank {rank} to rank{'s' if len(to) != 1 else ''} {', '.join(map(str, to))}"
                if to else f"chunk {chunk} of rank {rank} (no output names it)")
        what = f"size {sizes.size_name(chunk)} = {size}"
    else:
        chunk = spec.outputs[rank][position]
        source = next(s.rank for s in spec.sources[rank][position])
        pair = f"chunk {chunk} from rank {source} to rank {rank}"
        what = f"size {size}"
    row = record["row"] or 1
    units = "element(s)" if row == 1 else f"row(s) of {row} elements"
    if row != 1:  # sizes count rows (row=): say so, or a capacity of 8 rows reads as 8 elements
        what += " rows"
    because = {
        "capacity": f"outside 0..{bound} (the capacity fixed at load{'' if row == 1 else f', in rows of {row} elements'})",
        "input": f"reaches past the end of rank {rank}'s input ({bound} {units} left there)",
        "output": f"reaches past the end of rank {rank}'s output ({bound} {units} left there)",
        "expected": f"differs from the {bound} rank {rank} expects (its expected sizes)",
    }[kind]
    moved = "not written" if kind == "expected" else "moved as size 0"
    return f"rank {rank}, call {record['epoch']}: {pair}: {what} {because}; it was {moved}"


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _step_values(index: int, step, rank: int, per_call: dict, roles: dict) -> dict:
    text = " ".join(str(step.note).split()) or type(step).__name__.lower()
    values = {"index": index, "text": text}
    if isinstance(step, Stage):
        return {**values, "kind": "stage", "src": step.src.unit, "peer": step.dst.rank, "unit": step.dst.unit}
    if isinstance(step, Consume):
        src = step.srcs[0]
        return {**values, "kind": "consume", "out": step.dst.unit, "stage": src.space is Space.STAGE, "unit": src.unit}
    signal = step.signal
    values.update(owner=signal.owner, index_=signal.index, per_call=per_call[signal], k=step.k)
    if isinstance(step, Notify):
        relaxed = roles.get(signal) is Role.ACK
        return {**values, "kind": "notify", "store": "purlin_notify_relaxed" if relaxed else "purlin_notify"}
    if isinstance(step, Wait):
        return {**values, "kind": "wait"}
    raise PurlinError(f"rank {rank} step {index}: {type(step).__name__} has no sized kernel form")


def _kernel_values(schedule: Schedule, abi: KernelABI) -> list[dict]:
    per_call = schedule.per_call()
    roles = {decl.signal: decl.role for decl in schedule.signals}
    kernels = []
    for rank, program in enumerate(schedule.programs):
        sources = {s.dst.unit: s.srcs[0] for s in program.steps if isinstance(s, Consume)}
        out_sources = [{"stage": sources[m].space is Space.STAGE, "unit": sources[m].unit}
                       for m in range(schedule.out_units[rank])]
        note = ", ".join(f"{m}: {'stage' if s['stage'] else 'in'}[{s['unit']}]" for m, s in enumerate(out_sources))
        kernels.append({
            "rank": rank, "entry": abi.entry(rank), "out_sources": out_sources, "out_note": note or "(none)",
            "steps": [_step_values(i, s, rank, per_call, roles) for i, s in enumerate(program.steps)],
        })
    return kernels


def check_atom(atom: str) -> None:
    """Run-time sizes run on the ldst atom only: refused by name (before anything is lowered, by
    the loader, as well as here)."""
    if atom != "ldst":
        why = ("the copy engines take sizes from the host, which would need a synchronisation" if atom == "ce" else
               "the sized kernels are generated for ldst only: their copy loops take bounds read on the device")
        raise PurlinError(f"run-time sizes run on the 'ldst' atom only, not '{atom}'",
                          notes=(why, 'use the ldst atom (--atom ldst, or atom="ldst")'))


def generate(schedule: Schedule, spec, *, atom: str, arch: str, dtype: DType, op=None, trace: bool = False):
    """The CUDA module of a sized schedule for one dtype (copies only): one entry per rank."""
    from purlinc.atom.codegen.elems import elem_values
    from purlinc.atom.codegen.kernel import ATOM_BEGIN, ATOM_END, KernelSource
    from purlinc.atom.codegen.names import kernel_base
    from purlinc.atom.codegen.render import load_template, render

    if schedule.sizes is None:
        raise PurlinError(f"{schedule.collective} has no run-time sizes: use purlinc.atom.codegen.generate")
    check_atom(atom)
    if trace:
        raise PurlinError("tracing is not available for collectives with run-time sizes")
    target = parse_arch(arch)
    atom_def = get_atom(atom, target)
    base = kernel_base(schedule, atom, dtype, None, tuple(getattr(spec, "params", ())))
    abi = KernelABI(
        kernel_base=base, world_size=schedule.world_size, channels=schedule.channels, threads=THREADS,
        shared_bytes=0, itemsize=dtype.itemsize, stage_units=schedule.staging_units, slices=schedule.slices,
        stage_copies=schedule.stage_copies, signal_pad=schedule.signal_pad_size(), stage_align=16,
        in_units=tuple(schedule.in_units), out_units=tuple(schedule.out_units),
        needs_in_peers=False, needs_out_peers=False, args=SIZED_ARGS,
    )
    kernels = _kernel_values(schedule, abi)  # entry names from the ABI the runtime looks them up by
    atom_text = render(atom_def.template, reduce=False, unroll=atom_def.unroll, **atom_def.template_values(target)).rstrip("\n")
    source = render(
        "sized.cu.j2", kernel_base=base, collective=schedule.collective, world_size=schedule.world_size,
        params_text="".join(f", {k}={v}" for k, v in getattr(spec, "params", ())), sizes=schedule.sizes.format(),
        version=__version__, options_key=schedule.options.key(), stage_units=schedule.stage_units,
        signal_pad=schedule.signal_pad_size(), atom=atom, dtype=dtype.value, channels=schedule.channels,
        threads=THREADS, channel_signals=schedule.channel_signals, itemsize=dtype.itemsize,
        header_bytes=slot_layout(schedule.channels, 0)[0], prelude=load_template("prelude.cuh").rstrip("\n"),
        elem=elem_values(dtype, None), atom_begin=ATOM_BEGIN, atom_end=ATOM_END, atom_source=atom_text,
        kernels=kernels,
    )
    start, end = source.index(ATOM_BEGIN), source.index(ATOM_END) + len(ATOM_END)
    return KernelSource(source=source, filename=f"{base}.cu", kernel_base=base, abi=abi, atom=atom,
                        arch=target.name, dtype=dtype, op=None, atom_start=start, atom_end=end)
