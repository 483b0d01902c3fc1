"""CUDA for a schedule's epilogue (``purlinc.frontend.epilogue``): one device function the
``Epilogue`` steps call on the whole rows of an output slice, and its kernel-argument slots.

Every decision is made here and passed to ``templates/epilogue.cuh.j2`` as plain text: the
statements become float32 C expressions with round-to-nearest intrinsics (no contraction
into FMAs, so each operation rounds as the NumPy meaning does), buffers are read as 16-byte
vectors of the output's elements, all loaded at once into registers (whole warps per row, in
one of two layouts the kernel picks per call: ``row_layouts``), and a row with an ``rmsnorm``
sums its squares over its threads (shuffles, then one barrier) before the values that need it
are stored (those that do not, a decoder's next residual, are stored before: ``_early_stores``).
Only the sum of squares (its order, and a fused multiply-add per element) and ``rsqrtf`` differ
from the NumPy oracle.  Conversions go a word or a pair at a time where elem.cuh has them
(bf16).  A reduce followed by the epilogue of its rows is one pass (``fuse_reduce``,
``templates/epilogue_fused.cuh.j2``): the reduced vectors go from the sources to the epilogue
in registers.
"""

from __future__ import annotations

from dataclasses import dataclass

from purlinc.atom.codegen.elems import pair_sum, vector_conversions
from purlinc.atom.rows import VECTOR_BYTES, row_problem
from purlinc.dtypes import DType, ReduceOp
from purlinc.errors import PurlinError
from purlinc.frontend import ast
from purlinc.frontend.ast import OperandKind
from purlinc.frontend.epilogue import OUT, Epilogue, _calls, _names

VECTORS_PER_THREAD = 2  # a row's 16-byte vectors per thread (loads in flight per buffer)
# ... where the fused reduce + epilogue takes more than FEW_SOURCES sources: one vector per thread.
# Its loads are all issued before any is used (so their latencies overlap), N sources for each of
# a thread's vectors; with 4 vectors at R=2, or 2 at R=3 and more, they no longer fit in the
# registers beside the operands' (ptxas spilled to local memory).
FEW_SOURCES = 2
# Sources x vectors a thread of a fused reduce loads at once (16 bytes, four registers each);
# more are loaded and combined vector by vector: 8 sources x 4 vectors (R=8, rows of 16,384
# bf16 over 512 threads) took 128 registers for them alone and spilled 400 bytes.
SOURCE_VECTORS = 16
_OPS = {ast.FloatOp.ADD: "__fadd_rn", ast.FloatOp.SUB: "__fsub_rn", ast.FloatOp.MUL: "__fmul_rn",
        ast.FloatOp.DIV: "__fdiv_rn"}


@dataclass(frozen=True, slots=True)
class Buffer:
    """A tensor the epilogue reads or writes, element by element of a row."""

    name: str  # "out" or the operand's name
    c_name: str  # the element's float in the generated code
    suffix: str  # elem.cuh conversions: purlin_<suffix>_to_acc / purlin_acc_to_<suffix>
    storage: str  # C type of one element
    pointer: str  # the buffer's base pointer expression
    row_only: bool  # a `row` operand: indexed by the column only
    read: bool
    written: bool


def _float_literal(value: float) -> str:
    import numpy as np

    return f"__int_as_float({int(np.float32(value).view(np.int32))})"  # exactly NumPy's float32 value


def check_rows(epilogue: Epilogue, dtype: DType) -> None:
    """What this dtype needs of the spec's rows (located at the ``rows(E)`` expression)."""
    problem = row_problem(epilogue.row, dtype)
    if problem is not None:
        raise PurlinError(problem, epilogue.row_span)


def slots(epilogue: Epilogue | None) -> int:
    """Kernel-argument words the epilogue's operands take (one each: a pointer or a float)."""
    return 0 if epilogue is None else len(epilogue.operands)


def _buffers(epilogue: Epilogue, dtype: DType) -> list[Buffer]:
    reads = {n.name for s in epilogue.statements for n in _names(s.value)}
    written = set(epilogue.writes)
    buffers = [Buffer(OUT, "v_out", dtype.info.c_suffix, dtype.info.c_storage, "e_out", False,
                      OUT in reads, OUT in written)]
    for operand in epilogue.operands:
        if operand.kind is OperandKind.SCALAR:
            continue
        own = operand.dtype or dtype
        suffix = own.info.c_suffix or own.info.short  # fp8 (no reduction helpers): this module's own, "e4m3"
        buffers.append(Buffer(operand.name, f"v_{operand.name}", suffix, own.info.c_storage,
                              f"e_{operand.name}", operand.kind is OperandKind.ROW,
                              operand.name in reads, operand.written))
    return buffers


def _expr(expr: ast.FExpr, names: dict[str, str], norm: str | None) -> str:
    if isinstance(expr, ast.FNumber):
        return _float_literal(expr.value)
    if isinstance(expr, ast.FName):
        return names[expr.name]
    if isinstance(expr, ast.FNeg):
        return f"(-{_expr(expr.operand, names, norm)})"
    if isinstance(expr, ast.FBinary):
        return f"{_OPS[expr.op]}({_expr(expr.left, names, norm)}, {_expr(expr.right, names, norm)})"
    # rmsnorm(V, W, EPS) = (V * inv) * W, inv computed once per row from the first pass
    value, weight = _expr(expr.args[0], names, norm), _expr(expr.args[1], names, norm)
    return f"__fmul_rn(__fmul_rn({value}, inv), {weight})"


def _norm_dependent(epilogue: Epilogue, locals_: set[str]) -> set[str]:
    """Locals whose value needs the rmsnorm (directly or through another local)."""
    dependent: set[str] = set()
    for statement in epilogue.statements:
        if statement.target in locals_ and (any(True for _ in _calls(statement.value))
                                            or any(n.name in dependent for n in _names(statement.value))):
            dependent.add(statement.target)
    return dependent


def _first_pass_locals(epilogue: Epilogue, locals_: set[str]) -> list[str]:
    """The locals pass 1 computes (those that do not need the rmsnorm), in statement order."""
    dependent = _norm_dependent(epilogue, locals_)
    return [s.target for s in epilogue.statements if s.target in locals_ and s.target not in dependent]


def _early_stores(epilogue: Epilogue, locals_: set[str]) -> list[str]:
    """The buffers whose values do not need the rmsnorm (``residual = h``), in statement order:
    pass 1 stores them, so their stores overlap the row's sum of squares instead of queuing
    behind it with the others (a row's stores through one SM are a large part of the pass)."""
    dependent = _norm_dependent(epilogue, locals_)
    return [s.target for s in epilogue.statements if s.target not in locals_ and not any(True for _ in _calls(s.value))
            and not any(n.name in dependent for n in _names(s.value))]


def _lines(epilogue: Epilogue, names: dict[str, str], locals_: set[str], first_pass: bool,
           kept: frozenset[str] = frozenset(), early: frozenset[str] = frozenset()) -> list[str]:
    """C statements for one element.  Pass 1 (before the row's rmsnorm is known): the locals
    that do not need it and the ``early`` stores' values.  Pass 2: every local not ``kept``
    from pass 1 (those come from its registers), and the values to store (``w_<name>``) but the
    ``early`` ones."""
    skip = _norm_dependent(epilogue, locals_) if first_pass else set(kept) | set(early)
    lines = []
    for statement in epilogue.statements:
        target = statement.target
        if first_pass and ((target not in locals_ and target not in early) or target in skip):
            continue
        if not first_pass and target in skip:
            continue
        name = f"l_{target}" if target in locals_ else f"w_{target}"
        lines.append(f"const float {name} = {_expr(statement.value, names, None)};")
    return lines


def _mean_of_squares(total: str, row: int) -> str:
    """``total / row`` rounded once: a product with the exact reciprocal where ``row`` is a power
    of two (the same bits as the quotient, without a division on the row's critical path)."""
    if row & (row - 1) == 0:
        return f"__fmul_rn({total}, {_float_literal(1.0 / row)})"
    return f"__fdiv_rn({total}, {float(row)!r}f)"


def row_layout(row_vectors: int, threads: int, sources: int = 1, per_thread: int = VECTORS_PER_THREAD) -> dict:
    """How a block spreads rows over its threads: about ``per_thread`` vectors each (so each
    thread has that many loads per buffer in flight; one where a fused reduce reads more than
    ``FEW_SOURCES`` sources), whole warps per row, and as many rows at once as the block holds."""
    tpr = -(-row_vectors // (per_thread if sources <= FEW_SOURCES else 1))
    tpr = min(threads, max(32, -(-tpr // 32) * 32))
    return {"tpr": tpr, "per_thread": -(-row_vectors // tpr), "groups": threads // tpr}


def row_layouts(row_vectors: int, threads: int, sources: int = 1) -> dict:
    """The two layouts a kernel chooses between per call (``purlin_epi_use_few``): ``many``
    (``row_layout``: several rows at once) and ``few`` (one vector per thread: a row's work
    over more warps, for blocks with few rows: a decode step's one row per block).  The same
    layout twice where one vector per thread is already ``many``."""
    return {"many": row_layout(row_vectors, threads, sources), "few": row_layout(row_vectors, threads, sources, 1)}


def template_values(epilogue: Epilogue, dtype: DType, threads: int, sources: int = 1) -> dict:
    """Everything ``epilogue.cuh.j2`` renders, as plain values (``threads``: the block size;
    ``sources``: the most sources a fused reduce of the module reads)."""
    check_rows(epilogue, dtype)
    buffers = _buffers(epilogue, dtype)
    names = {b.name: b.c_name for b in buffers}
    for operand in epilogue.operands:
        if operand.kind is OperandKind.SCALAR:
            names[operand.name] = f"s_{operand.name}"
    locals_ = {s.target for s in epilogue.statements if s.target not in names}
    names.update({name: f"l_{name}" for name in locals_})
    norm = epilogue.norm
    stores = [{**vars_(b), "c_name": f"w_{b.name}"} for b in buffers if b.written]
    params = [("char*", "e_out")]
    for slot, operand in enumerate(epilogue.operands):
        params.append(("float", f"s_{operand.name}") if operand.kind is OperandKind.SCALAR
                      else ("char*", f"e_{operand.name}"))
    values = {
        "text": [s.format() for s in epilogue.statements],
        "row": epilogue.row,
        "vec": VECTOR_BYTES // dtype.itemsize,
        "row_vectors": epilogue.row * dtype.itemsize // VECTOR_BYTES,
        "source_vectors": SOURCE_VECTORS,
        **row_layouts(epilogue.row * dtype.itemsize // VECTOR_BYTES, threads, sources),
        "itemsize": dtype.itemsize,
        "buffers": [vars_(b) for b in buffers],
        "norm": None,
        "pass2": _lines(epilogue, names, locals_, first_pass=False),
        "params": ", ".join(f"{t} {n}" for t, n in params),
        "param_names": ", ".join(n for _, n in params),
        "out_written": OUT in epilogue.writes,
        "out_storage": dtype.info.c_storage,
        "call_args": ", ".join(["args.out", *(
            f"__uint_as_float((unsigned)args.epi[{slot}])" if o.kind is OperandKind.SCALAR
            else f"(char*)args.epi[{slot}]" for slot, o in enumerate(epilogue.operands))]),
        "late_stores": stores,  # stored after the row's norm (all, without one)
        "fp8": any(b.suffix == "e4m3" for b in buffers),
    }
    if norm is not None:
        # Pass 1's locals stay in registers for pass 2 (a float per element each): recomputing
        # them, with their operands' conversions, cost more issue slots than the registers.
        kept = _first_pass_locals(epilogue, locals_)
        early = frozenset(_early_stores(epilogue, locals_))
        values["pass2"] = _lines(epilogue, names, locals_, first_pass=False, kept=frozenset(kept), early=early)
        values["late_stores"] = [b for b in stores if b["name"] not in early]
        values["norm"] = {
            "kept": [f"l_{name}" for name in kept],
            "early_stores": [b for b in stores if b["name"] in early],  # stored in pass 1
            "pass1": _lines(epilogue, names, locals_, first_pass=True, early=early),
            "value": _expr(norm.args[0], names, None),
            "eps": _expr(norm.args[2], names, None),
            "mean": _mean_of_squares("total", epilogue.row),
        }
    return values


def module_values(epilogue: Epilogue | None, dtype: DType, threads: int, *, fused_sources: int = 0,
                  op: ReduceOp | None = None) -> dict | None:
    """What kernel.cu.j2 needs for a module's epilogue (None without one): its device
    function's source, the reduce + epilogue function when blocks of the module fuse a reduce
    and the epilogue of its region (``fused_sources``: the most sources such a reduce reads; the
    function goes after the atom, whose reduce it needs; ``op``: the reduce's, for its two-source
    form), its argument slots and the row's bytes (the slices' alignment)."""
    if epilogue is None:
        return None
    from purlinc.atom.codegen.render import render  # the one Jinja environment

    values = template_values(epilogue, dtype, threads, max(fused_sources, 1))
    return {"source": render("epilogue.cuh.j2", e=values).rstrip("\n"),
            "fused_source": render("epilogue_fused.cuh.j2", e=values, pair_sum=pair_sum(dtype, op)).rstrip("\n")
            if fused_sources else "",
            "slots": slots(epilogue), "row_bytes": epilogue.row * dtype.itemsize}


def fuse_reduce(reduce: dict, epilogue: dict) -> dict | None:
    """The block of a reduce and the Epilogue step right after it, on the region the reduce
    wrote, as one pass (``purlin_reduce_epilogue``), or None when they do not pair.  Sound
    because the epilogue is the last step touching its region (``snac.epilogue``): nothing
    reads the reduced rows between the two, and each thread reads only what it computed."""
    if reduce.get("kind") != "reduce" or reduce["writes"] != epilogue["reads"] or reduce["dst"] != epilogue["dst"]:
        return None
    return {**reduce, "kind": "reduce_epilogue", "comments": reduce["comments"] + epilogue["comments"] + [
        "steps above: one pass, the reduced rows kept in registers for the epilogue"]}


def epilogue_block(index: int, step, dst: str, slice_expr: str, call_args: str = "") -> dict:
    """The kernel block of an ``Epilogue`` step: it reads and writes its region (so a barrier
    separates it from the consume that wrote the region)."""
    note = f" ({step.note})" if step.note else ""
    line = f", line {step.line}" if step.line is not None else ""
    return {"kind": "epilogue", "comments": [f"step {index}: epilogue on {step.region.format()}{note}{line}"],
            "dst": dst, "slice": slice_expr, "reads": frozenset({step.region}), "writes": frozenset({step.region})}


def vars_(buffer: Buffer) -> dict:
    return {"name": buffer.name, "c_name": buffer.c_name, "suffix": buffer.suffix, "storage": buffer.storage,
            "pointer": buffer.pointer, "row_only": buffer.row_only, "read": buffer.read, "written": buffer.written,
            "to_acc_n": vector_conversions(buffer.suffix).to_acc_n,
            "from_acc_n": vector_conversions(buffer.suffix).from_acc_n}
