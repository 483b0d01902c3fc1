"""``generate``: one (schedule, atom, dtype, op) -> one CUDA module with an entry per rank."""

from __future__ import annotations

from purlinc.atom.abi import KernelABI
from purlinc.atom.atoms import get_atom, parse_arch
import purlinc.atom.codegen.limits as limits
from purlinc.atom.codegen.blocks import program_blocks
from purlinc.atom.codegen.elems import elem_values
from purlinc.atom.codegen.exprs import num
from purlinc.atom.codegen.kernel import ATOM_BEGIN, ATOM_END, KernelSource
from purlinc.atom.codegen.names import kernel_base
from purlinc.atom.codegen.render import load_template, render
from purlinc.atom.codegen.tables import Body
import purlinc.atom.codegen.tables as tables
from purlinc.atom.epilogue import check_rows, module_values
from purlinc.atom.trace import trace_template_values
from purlinc.dtypes import DType, ReduceOp
from purlinc.errors import InternalError, PurlinError
from purlinc.frontend.ast import Operation
from purlinc.snac.ir import Consume, Schedule, Space, Stage
from purlinc.snac.packing import packed_stages
from purlinc.version import __version__


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
        # the collective named in the message, not a note: the pipeline adds its own ("while
        # generating NAME's DTYPE kernels"), and two notes said it twice
        raise PurlinError(f"{schedule.collective}: {dtype.value} cannot be reduced: fp8 is supported for copies only")
    return op


def _kernels(schedule: Schedule, base: str, packed: dict) -> list[dict]:
    """Every rank's entry: its name and its channel-relative program as blocks."""
    per_call, flags = schedule.per_call(), schedule.packet_flags()
    roles = {decl.signal: decl.role for decl in schedule.signals}
    kernels = []
    for rank, program in enumerate(schedule.programs):
        if (program.rank, program.channel) != (rank, 0):
            raise InternalError(f"schedule.programs[{rank}] is rank {program.rank} channel {program.channel}, "
                                f"expected rank {rank}'s channel-relative program")
        blocks = program_blocks(program, per_call, flags, roles, packed)
        # A program that starts by sending packets sets its round's epoch inside that send,
        # after issuing the data loads (block_ll_send.cu.j2): the call counter's load and the
        # data loads then overlap instead of adding up on every small call's critical path.
        if blocks and blocks[0]["kind"] == "ll_send":
            blocks[0] = {**blocks[0], "sets_epoch": True}
        kernels.append({"rank": num(rank), "steps": len(program.steps), "blocks": blocks})
    return kernels


def _ll_loops(module: tuple[Body, ...]) -> int:
    """Receive loops (purlin_ll_consume call sites) in a module, every body counted once."""
    return sum(1 for body in module for item in body.items if item.first["kind"] == "ll_batch")


def block_texts(kernels: list[dict]) -> list[list[tuple[dict, str]]]:
    """Every rank's blocks with their C text, numbers marked (``exprs.num``)."""
    return [[(block, render("block.cu.j2", block=block, kernel=kernel)) for block in kernel["blocks"]]
            for kernel in kernels]


def _bodies(kernels: list[dict], trace: bool) -> tuple[Body, ...]:
    """The module's bodies (tables.bodies).  A traced module shares bodies as an untraced one
    does (the same entries), but keeps one item per block: its marks are numbered by block
    (purlinc.atom.trace)."""
    return tables.bodies(block_texts(kernels), [kernel["steps"] for kernel in kernels], share=True, roll=not trace)


def body_size(body: Body) -> int:
    """What ``limits.MAX_BODY_SIZE`` bounds: the body's items, their sources and destinations."""
    return sum(1 + len(item.first.get("srcs") or ()) + len(item.first.get("dsts") or ()) for item in body.items)


def _check_body_size(schedule: Schedule, module: tuple[Body, ...]) -> None:
    """Refuse a module whose largest body NVRTC would take minutes over (limits.MAX_BODY_SIZE)."""
    largest = max(module, key=body_size, default=None)
    if largest is None or body_size(largest) <= limits.MAX_BODY_SIZE:
        return
    o = schedule.options
    raise PurlinError(f"{schedule.collective} for R={schedule.world_size} ({o.algorithm.value}, {o.slices} slice(s) "
                      f"per channel): its kernel body would hold {body_size(largest):,} blocks and operands, and a "
                      f"generated function holds at most {limits.MAX_BODY_SIZE:,} (NVRTC's time grows with the "
                      "square of a function's size: minutes past this)",
                      notes=("use fewer slices: each slice's steps are code of their own (the tuning table uses at most 4)",))


def bodies_of(schedule: Schedule, *, trace: bool = False) -> tuple[list[dict], tuple[Body, ...]]:
    """Every rank's blocks and the module's bodies, as ``generate`` makes them (for tests and tools)."""
    kernels = _kernels(schedule, "k", packed_stages(schedule))
    return kernels, _bodies(kernels, trace)


# Tables up to this size live in constant memory (64 KiB a module, less room for the compiler's
# own), read through the constant cache; larger ones (many ranks x many numbers that follow no
# stride) in global memory, read through L1.
CONSTANT_TABLE_BYTES = 48 << 10


def _table_space(schedule: Schedule, module: tuple[Body, ...]) -> str:
    """Where the bodies' tables go: 4 bytes a number, a row per rank each."""
    size = 4 * schedule.world_size * sum(body.width for body in module)
    return "__constant__" if size <= CONSTANT_TABLE_BYTES else "__device__ const"


def _abi(schedule: Schedule, base: str, threads: int, shared_bytes: int, dtype: DType, packed: bool,
         module: tuple[Body, ...], epilogue: dict | None) -> KernelABI:
    return KernelABI(
        kernel_base=base,
        world_size=schedule.world_size,
        channels=schedule.channels,
        threads=threads,
        shared_bytes=shared_bytes,  # the tma atom's ring (dynamic shared memory)
        itemsize=dtype.itemsize,
        stage_units=schedule.staging_units,  # what the runtime allocates: every copy
        slices=schedule.slices,
        stage_copies=schedule.stage_copies,
        signal_pad=schedule.signal_pad_size(),
        stage_align=16 if packed else 1,
        lean=packed,
        in_units=tuple(schedule.in_units),
        out_units=tuple(schedule.out_units),
        needs_in_peers=_needs_peers(schedule, Space.IN),
        needs_out_peers=_needs_peers(schedule, Space.OUT),
        bodies=tuple(body.index for rank in range(schedule.world_size) for body in module if rank in body.ranks),
        epilogue_slots=epilogue["slots"] if epilogue else 0,
        row_bytes=epilogue["row_bytes"] if epilogue else 0,
    )


def _module_values(schedule: Schedule, spec, *, base: str, atom: str, dtype: DType, op: ReduceOp | None,
                   packed: bool, threads: int) -> dict:
    """The values of kernel.cu.j2 that describe the module, not its programs."""
    return dict(
        kernel_base=base,
        collective=schedule.collective,
        world_size=schedule.world_size,
        params_text="".join(f", {k}={v}" for k, v in getattr(spec, "params", ())),
        version=__version__,
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
        lean=packed,
        prelude=load_template("prelude.cuh").rstrip("\n"),
        elem_source=load_template("elem.cuh").rstrip("\n"),
        elem=elem_values(dtype, op),
        atom_begin=ATOM_BEGIN,
        atom_end=ATOM_END,
    )


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
    if schedule.sizes is not None:  # IN/OUT packed by run-time sizes: not this template's addressing
        from purlinc.atom.sized import generate as generate_sized

        return generate_sized(schedule, spec, atom=atom, arch=arch, dtype=dtype, op=op, trace=trace)
    if spec is not None and spec.epilogue is not None:
        # The spec's epilogue carries the source spans; a schedule read back from the cache
        # has the same epilogue without them, and its error would lose its location.
        check_rows(spec.epilogue, dtype)
    target = parse_arch(arch)
    atom_def = get_atom(atom, target)
    op = _check_types(schedule, dtype, op)
    base = kernel_base(schedule, atom, dtype, op, tuple(getattr(spec, "params", ())))
    packed = packed_stages(schedule)
    reduce = op is not None

    # The ldst loop's unroll is the atom's (its record says why each has its value).
    atom_values = {"reduce": reduce, "unroll": atom_def.unroll, **atom_def.template_values(target)}
    atom_text = render(atom_def.template, **atom_values).rstrip("\n")
    kernels = _kernels(schedule, base, packed)
    trace_values = trace_template_values(kernels, schedule.channels) if trace else None
    threads = limits.THREADS_PACKED if packed else limits.THREADS
    module = _bodies(kernels, trace)
    _check_body_size(schedule, module)
    fused = [len(item.first["srcs"]) for body in module for item in body.items if item.first["kind"] == "reduce_epilogue"]
    epilogue = module_values(schedule.epilogue, dtype, threads, fused_sources=max(fused, default=0),
                             op=op)  # None without one
    ll_source = render("ll.cuh.j2", reduce=reduce, in_flight=limits.LL_IN_FLIGHT,
                       consume_inline=_ll_loops(module) <= limits.LL_INLINE_LOOPS).rstrip("\n") if packed else ""
    values = _module_values(schedule, spec, base=base, atom=atom, dtype=dtype, op=op, packed=bool(packed), threads=threads)
    source = render("kernel.cu.j2", **values, ll_source=ll_source, atom_source=atom_text, bodies=module, trace=trace_values,
                    table_space=_table_space(schedule, module), epilogue=epilogue)
    start = source.index(ATOM_BEGIN)
    end = source.index(ATOM_END) + len(ATOM_END)
    abi = _abi(schedule, base, threads, atom_def.shared_bytes(target), dtype, bool(packed), module, epilogue)
    return KernelSource(
        source=source, filename=f"{base}.cu", kernel_base=base, abi=abi, atom=atom, arch=target.name,
        dtype=dtype, op=op, atom_start=start, atom_end=end,
        trace_blocks=trace_values["blocks"] if trace else (),
    )
