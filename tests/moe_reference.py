"""A plain torch mixture-of-experts exchange to check purlinc.moe against: one row per
(token, expert) pair, sorted by destination rank, moved with ``all_to_all_single`` and host
split lists (as torch.distributed users write it), the expert applied where the expert
lives, the result sent back and weighted on the token's rank.  Shared by the CPU and GPU tests.

``expert(e, rows)`` must be exact in the tokens' dtype for the comparison to be exact; the
tests use small integers, integer weights and experts that scale by small integers, so every
sum is exact in float32 and in bfloat16."""

from __future__ import annotations

import torch


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
