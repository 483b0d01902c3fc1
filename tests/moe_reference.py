"""A plain torch mixture-of-experts exchange to check purlinc.moe against: one row per
(token, expert) pair, sorted by destination rank, moved with ``all_to_all_single`` and host
split lists (as torch.distributed users write it), the expert applied where the expert
lives, the result sent back and weighted on the token's rank.  Shared by the CPU and GPU tests.

``expert(e, rows)`` must be exact in the tokens' dtype for the comparison to be exact; the
tests use small integers, integer weights and experts that scale by small integers, so every
sum is exact in float32 and in bfloat16."""

from __future__ import annotations

import math
import threading

import torch

from rank_threads import on_threads


def reference_moe(a2a, world_size: int, x, topk_ids, topk_weights, expert, num_experts: int):
    """``a2a(output, input, output_split_sizes, input_split_sizes)``: this rank's
    all_to_all_single.  Returns [T, H] in x's dtype."""
    R, L = world_size, num_experts // world_size
    T, k = topk_ids.shape
    dev = x.device
    dest = torch.div(topk_ids.reshape(-1).to(torch.int64), L, rounding_mode="floor")
    order = torch.argsort(dest, stable=True)
    counts = torch.bincount(dest, minlength=R).to(torch.int64)
    incoming = torch.empty(R, dtype=torch.int64, device=dev)
    a2a(incoming, counts, [1] * R, [1] * R)
    send, recv = counts.tolist(), incoming.tolist()
    token = torch.arange(T, device=dev).repeat_interleave(k)[order]
    local = (topk_ids.reshape(-1).to(torch.int64)[order] - dest[order] * L).to(torch.int32)
    rows = torch.empty(sum(recv), x.shape[1], dtype=x.dtype, device=dev)
    a2a(rows, x[token].contiguous(), recv, send)
    experts = torch.empty(sum(recv), dtype=torch.int32, device=dev)
    a2a(experts, local.contiguous(), recv, send)
    y = torch.zeros_like(rows)
    for e in range(L):
        where = experts == e
        if bool(where.any()):
            y[where] = expert(e, rows[where])
    back = torch.empty(T * k, x.shape[1], dtype=x.dtype, device=dev)
    a2a(back, y, send, recv)
    weights = topk_weights.reshape(-1)[order].to(torch.float32)
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=dev)
    out.index_add_(0, token, back.to(torch.float32) * weights[:, None])
    return out.to(x.dtype)


def loopback_reference(a2a, streams, world_size: int, num_experts: int, inputs, device: int, expert,
                       record: list | None = None) -> list:
    """Every rank's :func:`reference_moe` in a loopback group: ``a2a[r]`` is rank r's loaded
    all-to-all with run-time sizes (host split lists made into size tensors), each rank on its
    own thread and ``streams[r]``, the ranks' calls issued in lock step.  Returns the results
    (on the GPU), each finished: its last kernels ran on rank r's stream, not the caller's.
    ``record``: a list per rank, given every call as (input, input splits, output, output
    splits, out_sizes, row) on the host, for :func:`exchange_problems`."""
    R = world_size
    barrier = threading.Barrier(R, timeout=60)

    def a2a_of(r):
        def call(out, inp, out_splits, in_splits):
            sizes = torch.tensor(in_splits, dtype=torch.int64, device=f"cuda:{device}")
            got = torch.empty(R, dtype=torch.int64, device=f"cuda:{device}")
            row = math.prod(inp.shape[1:])  # elements per split unit (a rank may send no rows)
            if inp.dtype == torch.int64:  # not a Purlin dtype: its bytes as int32 pairs
                inp, out, row = inp.view(torch.int32), out.view(torch.int32), 2 * row
            barrier.wait()  # every rank issues its call before any waits for the result
            with torch.cuda.stream(streams[r]):
                a2a[r](inp.reshape(-1).contiguous(), sizes, out.reshape(-1), got, row=row)
            barrier.wait()
            streams[r].synchronize()
            if record is not None:
                record[r].append((inp.reshape(-1).cpu(), list(in_splits), out.reshape(-1).cpu(), list(out_splits),
                                  got.cpu().tolist(), row))
        return call

    def body(r):
        with torch.cuda.stream(streams[r]):
            x, ids, w = (t.to(f"cuda:{device}") for t in inputs[r])
            want = reference_moe(a2a_of(r), R, x, ids, w, expert, num_experts)
        streams[r].synchronize()  # its weighted sum after the last exchange is queued on this stream
        return want
    return on_threads(R, body, barrier.abort, timeout=120)


def exchange_problems(record: list) -> list[str]:
    """What :func:`loopback_reference`'s recorded calls got wrong: for every call, each rank's
    out_sizes against its output splits, and each chunk it received against what its source
    sent it."""
    problems, R = [], len(record)
    for k in range(len(record[0])):
        for r in range(R):
            _, _, out, out_splits, got, row = record[r][k]
            if got != out_splits:
                problems.append(f"plain call {k} rank {r}: out_sizes {got}, expected {out_splits}")
            at = 0
            for s in range(R):
                inp, in_splits = record[s][k][0], record[s][k][1]
                start = sum(in_splits[:r]) * row
                sent, mine = inp[start:start + in_splits[r] * row], out[at:at + out_splits[s] * row]
                if not torch.equal(sent, mine):
                    bad = (sent != mine).nonzero().flatten()
                    problems.append(f"plain call {k} rank {r} from {s}: {len(bad)} of {len(sent)} elements wrong, "
                                    f"first at {bad[:4].tolist()} (row {row})")
                at += out_splits[s] * row
    return problems


def routing(generator, T: int, H: int, num_experts: int, top_k: int, dtype, device, skew: str = "random"):
    """Tokens (small integers), top-k expert ids (distinct per token) and integer weights.
    ``skew``: "random", "one" (every token's experts on the lowest ranks first: a hot rank),
    or "none" (T = 0 is the caller's)."""
    x = torch.randint(-2, 3, (T, H), generator=generator).to(dtype).to(device)
    if skew == "one":
        ids = torch.arange(top_k).repeat(T, 1)
    else:
        ids = torch.argsort(torch.rand(T, num_experts, generator=generator), dim=1)[:, :top_k]
    weights = torch.randint(1, 3, (T, top_k), generator=generator).to(torch.float32)
    return x, ids.to(device), weights.to(device)


def scale_expert(e: int, rows):
    """Expert e multiplies by (e % 4) + 1: exact in bfloat16 for the tests' small integers."""
    return rows * ((e % 4) + 1)
