"""One measured thing per system and variant (``Case``): how to load fresh input, make one call,
and read the output, for NCCL, torch symmetric memory, Purlin and purlin/hierarchical."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

import purlin_api
import report
from benchlib.context import Ctx
from benchlib.plan import HIER


@dataclass
class Case:
    system: str
    variant: str
    load: Callable  # load(x): poison the output, then put this rank's input x in place
    call: Callable  # one collective call on the current stream
    output: Callable  # () -> the tensor to check on this rank, or None
    repeat_safe: bool  # repeated calls leave the same output (so a graph replay can be checked)
    sms: int | None = None
    sms_note: str = ""
    options: dict = field(default_factory=dict)
    after: Callable | None = None  # e.g. raise a device-side error the runtime recorded
    # () -> the tensor the collective reads on this rank (what an in-situ producer writes), or None
    input: Callable | None = None
    capture_env: dict = field(default_factory=dict)  # environment while its graphs are captured


def poison(t) -> None:
    if t is not None:
        t.fill_(float("nan"))


def nccl_sms() -> tuple[int | None, str]:
    lo, hi = os.environ.get("NCCL_MIN_NCHANNELS"), os.environ.get("NCCL_MAX_NCHANNELS")
    if lo and hi and lo == hi:
        return int(lo), "NCCL_MIN_NCHANNELS = NCCL_MAX_NCHANNELS (one CTA per channel)"
    if hi:
        return None, f"at most NCCL_MAX_NCHANNELS={hi} CTAs; NCCL picks per size"
    return None, "NCCL picks channels (one CTA each) per size; not exposed through torch"


def nccl_env() -> dict:
    return {k: os.environ[k] for k in ("NCCL_GRAPH_MIXING_SUPPORT", "NCCL_NVLS_ENABLE") if k in os.environ}


def nccl_case(ctx: Ctx, coll: str, lay: report.Layout, X, Y, variant: str = "default") -> Case:
    rank, root, R = ctx.rank, 0, ctx.world
    is_root = rank == root
    sms, note = nccl_sms()

    def load_out_of_place(x):
        poison(Y)
        X.copy_(x)

    def load_in_place(x):  # torch's all_reduce / reduce / broadcast work in place on Y
        poison(Y)
        if coll != "broadcast" or is_root:
            Y.copy_(x)

    out = lambda: Y  # noqa: E731
    if coll == "allreduce":
        call, load, safe = (lambda: dist.all_reduce(Y)), load_in_place, False
    elif coll == "allgather":
        call, load, safe = (lambda: dist.all_gather_into_tensor(Y, X)), load_out_of_place, True
    elif coll == "reduce_scatter":
        call, load, safe = (lambda: dist.reduce_scatter_tensor(Y, X)), load_out_of_place, True
    elif coll == "alltoall":
        call, load, safe = (lambda: dist.all_to_all_single(Y, X)), load_out_of_place, True
    elif coll == "broadcast":
        call, load, safe = (lambda: dist.broadcast(Y, src=root)), load_in_place, True
    elif coll == "reduce":
        call, load, safe = (lambda: dist.reduce(Y, dst=root)), load_in_place, False
        out = lambda: Y if is_root else None  # noqa: E731
    elif coll == "gather":
        glist = list(Y.chunk(R)) if is_root else None
        call, load, safe = (lambda: dist.gather(X, gather_list=glist, dst=root)), load_out_of_place, True
        out = lambda: Y if is_root else None  # noqa: E731
    elif coll == "scatter":
        slist = list(X.chunk(R)) if is_root else None
        call, load, safe = (lambda: dist.scatter(Y, scatter_list=slist, src=root)), load_out_of_place, True
    else:
        raise ValueError(coll)
    options = {"env": nccl_env()}
    if variant == "symm":
        options["symmetric_buffers"] = (ctx.meta.get("nccl_symm") or {}).get("method")
    held = Y if coll in ("allreduce", "broadcast", "reduce") else X  # in place: Y is the input
    return Case("nccl", variant, load, call, out, safe, sms, note, options,
                input=lambda: held if _has_input(coll, rank) else None)


def _has_input(coll: str, rank: int, root: int = 0) -> bool:
    """Whether ``rank`` passes input to ``coll`` (a rooted one-to-all: only the root)."""
    return coll not in ("broadcast", "scatter") or rank == root


def nccl_symm_case(ctx: Ctx, coll: str, lay: report.Layout) -> Case:
    """NCCL on buffers registered as symmetric windows (views at offset 0 of two big ones)."""
    SX, SY = ctx.nsymm
    if SX.numel() < lay.in_elems or SY.numel() < lay.out_elems:
        raise RuntimeError(f"NCCL symmetric buffers hold {SX.numel()}/{SY.numel()} elements, "
                           f"{lay.in_elems}/{lay.out_elems} needed")
    return nccl_case(ctx, coll, lay, SX[: lay.in_elems], SY[: lay.out_elems], variant="symm")


def symm_cases(ctx: Ctx, lay: report.Layout, Y) -> list[Case]:
    """torch symmetric memory one-shot and two-shot all-reduce (input in the symmetric buffer)."""
    S, _ = ctx.symm
    n = lay.in_elems
    if S.numel() < n:
        raise RuntimeError(f"symmetric buffer holds {S.numel()} elements, {n} needed")
    Sv = S[:n]
    ops = torch.ops.symm_mem
    g = ctx.group_name
    note = "torch symm_mem kernel grid not exposed"

    def load(x):
        poison(Y)
        Sv.copy_(x)

    cases = []
    if hasattr(ops, "one_shot_all_reduce_out"):
        cases.append(Case("symm_mem", "one-shot", load, lambda: ops.one_shot_all_reduce_out(Sv, "sum", g, Y),
                          lambda: Y, True, None, note, input=lambda: Sv))
    else:
        cases.append(Case("symm_mem", "one-shot", load, lambda: Y.copy_(ops.one_shot_all_reduce(Sv, "sum", g)),
                          lambda: Y, True, None, note + "; one_shot_all_reduce + copy (no _out op)", input=lambda: Sv))
    # two-shot reduces in the symmetric input as well, so repeated calls grow the values.
    if hasattr(ops, "two_shot_all_reduce_out"):
        cases.append(Case("symm_mem", "two-shot", load, lambda: ops.two_shot_all_reduce_out(Sv, "sum", g, Y),
                          lambda: Y, False, None, note, input=lambda: Sv))
    else:
        cases.append(Case("symm_mem", "two-shot", load, lambda: ops.two_shot_all_reduce_(Sv, "sum", g),
                          lambda: Sv, False, None, note + "; in place", input=lambda: Sv))
    return cases


def _purlin_io(coll: str, rank: int, X, Y):
    """(load, output) of a Purlin case, flat or hierarchical: fresh input into X, Y poisoned;
    the output is Y except on the non-roots of the rooted gathers."""

    def load(x):
        poison(Y)
        X.copy_(x)

    def output():
        return None if coll in ("reduce", "gather") and rank != 0 else Y

    return load, output


def purlin_case(ctx: Ctx, coll: str, variant: purlin_api.Variant, X, Y) -> Case:
    loaded = ctx.colls[(coll, variant.name)]
    reduce = coll in report.REDUCE_COLLECTIVES
    rank = ctx.rank
    load, output = _purlin_io(coll, rank, X, Y)

    call = purlin_api.bind_call(loaded, coll, X, Y, rank=rank, root=0, reduce=reduce)
    sms, note = purlin_api.grid_sms(loaded, variant.options, X, Y)
    options = dict(variant.options)
    env = {}
    if variant.graph_buffers is not None:
        options["graph_buffers"] = variant.graph_buffers
        env["PURLIN_GRAPH_BUFFERS"] = variant.graph_buffers
    return Case("purlin", variant.name, load, call, output, True, sms, note, options,
                after=lambda: purlin_api.check_errors(ctx.comm, loaded),
                input=lambda: X if _has_input(coll, rank) else None, capture_env=env)


def hier_variant(g: int) -> str:
    return f"g{g}"


def hier_case(ctx: Ctx, coll: str, g: int, lay: report.Layout, X, Y) -> Case:
    """purlin/hierarchical g<G>: the world as R/G nodes of G ranks, on ordinary torch buffers
    (the same X, Y as NCCL).  Every rank passes count= (a rank without input or output still
    takes part in the phases) and the same buffer conventions as the flat Purlin call."""
    loaded = ctx.hcolls[(coll, g)]
    reduce = coll in report.REDUCE_COLLECTIVES
    rank = ctx.rank
    load, output = _purlin_io(coll, rank, X, Y)

    call = purlin_api.bind_call(loaded, coll, X, Y, rank=rank, root=0, reduce=reduce, count=lay.count)
    options = {"gpus_per_node": g, "nodes": ctx.world // g}
    note = "Purlin kernels per intra phase + NCCL per inter phase; not summed"
    return Case(HIER, hier_variant(g), load, call, output, True, None, note, options,
                after=lambda: purlin_api.check_errors(None, loaded),
                input=lambda: X if _has_input(coll, rank) else None)
