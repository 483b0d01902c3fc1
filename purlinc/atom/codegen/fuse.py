"""A block rewrite that keeps the order of effects: copies of one source as one multi-destination
copy.  (Runs of like blocks become loops later, by shape: ``tables``.)"""

from __future__ import annotations

import purlinc.atom.codegen.limits as limits


def _fuse_host(out: list[dict], block: dict) -> int | None:
    """The index in ``out`` of the copy ``block`` can join (see ``fuse_copies``), or None."""
    at = len(out) - 1
    while at >= 0 and out[at]["kind"] in ("notify", "notify_one"):
        at -= 1
    host = out[at] if at >= 0 else None
    if (host is not None and host["kind"] in ("copy", "copy_multi")
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
    above those notifies) and it reads the same region and writes nothing that copy reads or
    writes.  Moving a data step above a notify is always sound:
    a notify waits for nothing, so the step still follows every wait it followed, and its
    writes now also happen before the notify's release, which only adds order.  The cost is
    that the notify goes out after the moved stores too; they are local and issued in the same
    loop as the remote ones, so the loop's time is that of the remote stores either way."""
    out: list[dict] = []
    for block in blocks:
        at = None
        if block["kind"] == "copy" and len(block["reads"]) == 1:
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
