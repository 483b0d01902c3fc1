"""Correctness: fresh random input, a reference computed in float32 from every rank's input
(each rank's made again from its seed: independent of every system under test), and the
comparison."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

import report
from benchlib.cases import Case
from benchlib.context import Ctx, allreduce_max, guarded, sync


def rank_input(ctx: Ctx, n: int, salt: int, rank: int):
    """The random bf16 input rank ``rank`` checks with (never zeros): a function of the seed, the
    salt and the rank only, so any rank can make every rank's (``reference``)."""
    g = torch.Generator(device=ctx.device)
    g.manual_seed((ctx.args.seed * 1_000_003 + salt * 7919 + rank * 104_729) % (2**63))
    return torch.randn(n, generator=g, device=ctx.device, dtype=torch.float32).to(torch.bfloat16)


def fresh_input(ctx: Ctx, n: int, salt: int):
    return rank_input(ctx, n, salt, ctx.rank)


def _fsum(rows):
    acc = rows[0].float()
    for r in rows[1:]:
        acc += r.float()
    return acc.to(rows[0].dtype)


def _abs_sum(rows):
    acc = rows[0].float().abs()
    for r in rows[1:]:
        acc += r.float().abs()
    return acc


@dataclass(frozen=True)
class Expected:
    """A rank's expected output: ``value`` (the output's dtype) and, for a reduction, the
    per-element ``bound`` on |got - value| (``reduction_bound``); None: copies are bit-exact."""

    value: object
    bound: object = None


def reduction_bound(addends: list):
    """Per element, how far a correct sum of ``addends`` (tensors of one dtype) may lie from the
    float32 sum rounded once: ``len(addends) * eps * sum(|addend|)`` plus the dtype's smallest
    normal.  A sum made of R addends in the dtype itself rounds at most R - 1 partial sums and the
    reference rounds once, each by at most eps / 2 of the magnitude summed so far, so R * eps
    covers any order with room to spare; an element missing an addend of its own size (left
    unreduced, zero, half written) is off by that addend, far beyond it."""
    info = torch.finfo(addends[0].dtype)
    return _abs_sum(addends) * (len(addends) * info.eps) + info.tiny


def _reduced(addends: list) -> Expected:
    return Expected(_fsum(addends), reduction_bound(addends))


def reference(ctx: Ctx, lay: report.Layout, salt: int) -> Expected | None:
    """This rank's expected output, computed locally in float32 from every rank's input made
    again here (``rank_input``: seeded by rank): no communication at all, so independent of
    every system under test, NCCL's collectives included."""
    allx = torch.cat([rank_input(ctx, lay.in_elems, salt, r) for r in range(ctx.world)])
    return expected_output(lay, allx, ctx.rank, ctx.world)


def expected_output(lay: report.Layout, allx, rank: int, R: int, root: int = 0) -> Expected | None:
    """``rank``'s output of ``lay.collective`` from every rank's input (``allx``: the R inputs
    end to end), summed in float32 where it reduces (with the bound ``compare`` allows); None
    where the rank has no output."""
    c = lay.count
    ins = allx.view(R, lay.in_elems)
    coll = lay.collective
    if coll == "allreduce":
        return _reduced(list(ins))
    if coll == "allgather":
        return Expected(allx)
    if coll == "reduce_scatter":
        return _reduced([ins[p].view(R, c)[rank] for p in range(R)])
    if coll == "alltoall":
        return Expected(ins.view(R, R, c)[:, rank, :].reshape(-1).clone())
    if coll == "broadcast":
        return Expected(ins[root].clone())
    if coll == "reduce":
        return _reduced(list(ins)) if rank == root else None
    if coll == "gather":
        return Expected(allx) if rank == root else None
    if coll == "scatter":
        return Expected(ins[root].view(R, c)[rank].clone())
    raise ValueError(coll)


def compare(out, want: Expected | None) -> tuple[bool, str]:
    """``out`` against ``want``: copies bit for bit; reductions element by element within
    ``want.bound`` (every element finite)."""
    if want is None:
        return True, "no output on this rank"
    ref = want.value
    if out is None or out.shape != ref.shape:
        return False, f"output shape {None if out is None else tuple(out.shape)} != {tuple(ref.shape)}"
    if want.bound is None:
        if torch.equal(out, ref):
            return True, "bit-exact"
        bad = int((out != ref).sum())
        return False, f"{bad} of {out.numel()} elements differ"
    o = out.float()
    if not bool(torch.isfinite(o).all()):
        bad = int((~torch.isfinite(o)).sum())
        return False, f"{bad} of {o.numel()} elements not finite (unwritten?)"
    ratio = (o - ref.float()).abs() / want.bound
    worst = float(ratio.max()) if ratio.numel() else 0.0
    if worst <= 1.0:
        return True, f"every element within its rounding bound (worst {worst:.2f} of it)"
    beyond = ratio > 1.0
    first = int(beyond.nonzero()[0, 0])
    return False, (f"{int(beyond.sum())} of {o.numel()} elements beyond their rounding bound "
                   f"(first at {first}: got {float(o[first]):.6g}, want {float(ref[first]):.6g})")


def check_case(ctx: Ctx, lay: report.Layout, case: Case, salt: int, graph) -> dict[str, tuple]:
    """Fresh random input, poisoned output, one call (and one graph replay where repeat-safe)."""
    x = fresh_input(ctx, lay.in_elems, salt)
    ref = reference(ctx, lay, salt)
    results = {}

    def eager():
        case.load(x)
        case.call()
        sync()
        if case.after:
            case.after()
        return compare(case.output(), ref)

    results["eager"] = _agree_check(ctx, *guarded(ctx, eager))
    if graph is not None and case.repeat_safe:
        def replay():
            case.load(x)
            graph.replay()
            sync()
            return compare(case.output(), ref)

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
