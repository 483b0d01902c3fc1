"""Block rewrites that keep the order of effects: copies of one source as one multi-destination
copy, and runs of like steps (units in arithmetic progression) as loops."""

from __future__ import annotations

import purlinc.atom.codegen.limits as limits
from purlinc.atom.codegen.exprs import num, region_expr
from purlinc.snac.ir import Region


def _fuse_host(out: list[dict], block: dict) -> int | None:
    """The index in ``out`` of the copy ``block`` can join (see ``fuse_copies``), or None."""
    at = len(out) - 1
    while at >= 0 and out[at]["kind"] in ("notify", "notify_one"):
        at -= 1
    host = out[at] if at >= 0 else None
    if (host is not None and host["kind"] in ("copy", "copy_multi") and not host.get("loop")
            and host["reads"] == block["reads"] and not (block["writes"] & (host["reads"] | host["writes"]))
            and len(host.get("dsts", (host["dst"],))) < limits.MAX_COPY_DSTS):
        return at
    return None


def fuse_copies(blocks: list[dict]) -> list[dict]:
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
        at = None
        if block["kind"] == "copy" and not block.get("loop") and len(block["reads"]) == 1:
            at = _fuse_host(out, block)
        if at is None:
            out.append(block)
            continue
        host = out[at]
        if host["kind"] == "copy":
            host = out[at] = {**host, "kind": "copy_multi", "dsts": [host["dst"]], "moved": 0}
        host["dsts"].append(block["dst"])
        host["comments"] = host["comments"] + block["comments"]
        host["writes"] = host["writes"] | block["writes"]
        host["moved"] += len(out) - 1 - at
    for block in out:
        if block["kind"] == "copy_multi":
            moved = block.pop("moved")
            hoisted = f"; later ones moved above the {moved} notify block(s) between them" if moved else ""
            block["comments"] = block["comments"] + [
                f"steps above: one copy to {len(block['dsts'])} destinations, the source read once{hoisted}"]
            del block["dst"], block["regions"]
    return out


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


def _unit(region: Region, delta: int) -> str:
    """Unit ``region.unit + delta * i`` of a run's step ``i``."""
    if delta == 0:
        return num(region.unit)
    return f"{num(region.unit)} + i" if delta == 1 else f"{num(region.unit)} + {delta} * i"


def runs(blocks: list[dict], rank: int) -> list[dict]:
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
        if end - i < limits.MIN_RUN:
            out.extend(blocks[i:end])
            i = end
            continue
        exprs = [region_expr(r, rank, _unit(r, d)) for r, d in zip(first, deltas)]
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
