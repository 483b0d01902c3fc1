"""Correctness: fresh random input, a reference computed in float32 from every rank's input
(independent of every system under test), and the comparison."""

from __future__ import annotations

import torch
import torch.distributed as dist

import report
from benchlib.cases import Case
from benchlib.context import CHECK_RTOL, Ctx, allreduce_max, guarded, sync


def fresh_input(ctx: Ctx, n: int, salt: int):
    g = torch.Generator(device=ctx.device)
    g.manual_seed((ctx.args.seed * 1_000_003 + salt * 7919 + ctx.rank * 104_729) % (2**63))
    return torch.randn(n, generator=g, device=ctx.device, dtype=torch.float32).to(torch.bfloat16)


def _fsum(rows):
    acc = rows[0].float()
    for r in rows[1:]:
        acc += r.float()
    return acc.to(torch.bfloat16)


def reference(ctx: Ctx, lay: report.Layout, x):
    """This rank's expected output, from every rank's input (gathered by NCCL) computed locally
    in float32: independent of every system under test, NCCL's collective included."""
    allx = torch.empty(ctx.world * lay.in_elems, dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(allx, x)
    return expected_output(lay, allx, ctx.rank, ctx.world)


def expected_output(lay: report.Layout, allx, rank: int, R: int, root: int = 0):
    """``rank``'s output of ``lay.collective`` from every rank's input (``allx``: the R inputs
    end to end), summed in float32 where it reduces; None where the rank has no output."""
    c = lay.count
    ins = allx.view(R, lay.in_elems)
    coll = lay.collective
    if coll == "allreduce":
        return _fsum(list(ins))
    if coll == "allgather":
        return allx
    if coll == "reduce_scatter":
        return _fsum([ins[p].view(R, c)[rank] for p in range(R)])
    if coll == "alltoall":
        return ins.view(R, R, c)[:, rank, :].reshape(-1).clone()
    if coll == "broadcast":
        return ins[root].clone()
    if coll == "reduce":
        return _fsum(list(ins)) if rank == root else None
    if coll == "gather":
        return allx if rank == root else None
    if coll == "scatter":
        return ins[root].view(R, c)[rank].clone()
    raise ValueError(coll)


def compare(out, ref, reduce: bool) -> tuple[bool, str]:
    if ref is None:
        return True, "no output on this rank"
    if out is None or out.shape != ref.shape:
        return False, f"output shape {None if out is None else tuple(out.shape)} != {tuple(ref.shape)}"
    if reduce:
        o, r = out.float(), ref.float()
        if not bool(torch.isfinite(o).all()):
            bad = int((~torch.isfinite(o)).sum())
            return False, f"{bad} of {o.numel()} elements not finite (unwritten?)"
        err = float((o - r).norm() / r.norm().clamp_min(1e-30))
        return err <= CHECK_RTOL, f"rel L2 error {err:.2e}"
    if torch.equal(out, ref):
        return True, "bit-exact"
    bad = int((out != ref).sum())
    return False, f"{bad} of {out.numel()} elements differ"


def check_case(ctx: Ctx, lay: report.Layout, case: Case, salt: int, graph) -> dict[str, tuple]:
    """Fresh random input, poisoned output, one call (and one graph replay where repeat-safe)."""
    reduce = lay.collective in report.REDUCE_COLLECTIVES
    x = fresh_input(ctx, lay.in_elems, salt)
    ref = reference(ctx, lay, x)
    results = {}

    def eager():
        case.load(x)
        case.call()
        sync()
        if case.after:
            case.after()
        return compare(case.output(), ref, reduce)

    results["eager"] = _agree_check(ctx, *guarded(ctx, eager))
    if graph is not None and case.repeat_safe:
        def replay():
            case.load(x)
            graph.replay()
            sync()
            return compare(case.output(), ref, reduce)

        results["graph"] = _agree_check(ctx, *guarded(ctx, replay))
    elif graph is not None:
        ok_, note = results["eager"]
        results["graph"] = (ok_, f"eager check ({note}); calls not repeat-safe, graph replay not checked")
    return results


def _agree_check(ctx: Ctx, ran: bool, value, err) -> tuple[bool | None, str]:
    if not ran:
        return None, f"check could not run: {err}"
    good, note = value
    flags = allreduce_max(ctx, [0.0 if good else 1.0])
    if not flags[0]:
        return True, note
    notes = [None] * ctx.world
    dist.all_gather_object(notes, None if good else note)
    return False, "; ".join(f"rank {r}: {n}" for r, n in enumerate(notes) if n)
