"""The decode step of a Llama-3-8B-class transformer under tensor parallelism, in plain torch.

Shapes follow Llama-3-8B (hidden 4096, MLP 14336, 32 query and 8 KV heads of 128, bf16); the
weights are random (seeded), RoPE and the embedding/LM head are left out: what is measured is a
decoder layer's compute around its two all-reduces.  Megatron-style sharding over R ranks: the
QKV and gate/up projections are split by heads / columns (no communication), the output and
down projections by rows, so each produces a *partial* sum that one all-reduce completes:

    y = rmsnorm(h, ln1[0])
    per layer:  x = attention_partial(y)        -> h += allreduce(x); y = rmsnorm(h, ln2)
                x = mlp_partial(y)              -> h += allreduce(x); y = rmsnorm(h, next norm)

The ``->`` step is the epilogue every TP decoder runs after its all-reduce (``Comm.add_rmsnorm``:
composed from an all-reduce and torch ops, or one fused Purlin kernel).  ``h`` is the residual,
updated in place.  The KV cache has a fixed length; the step writes the new token's K and V
into its last slot, so every shape is static and the step can be one CUDA graph.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F


MLP_BLOCK = 128  # MLP columns drawn from one seed: shards are whole blocks, so any R gets the same model


@dataclass(frozen=True, slots=True)
class Config:
    hidden: int = 4096
    mlp: int = 14336
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    layers: int = 2
    kv_len: int = 1024
    eps: float = 1e-5

    def shard(self, world: int) -> "Shard":
        """This config's per-rank sizes over ``world`` ranks (ValueError where it does not divide)."""
        for what, n, unit in (("heads", self.heads, 1), ("kv_heads", self.kv_heads, 1), ("mlp", self.mlp, MLP_BLOCK)):
            if n % (world * unit):
                raise ValueError(f"tensor parallelism over {world} ranks needs {what} ({n}) divisible by "
                                 f"{world * unit}" + (f" ({world} ranks x blocks of {unit})" if unit > 1 else ""))
        if self.heads * self.head_dim != self.hidden:
            raise ValueError(f"heads x head_dim ({self.heads} x {self.head_dim}) must equal hidden ({self.hidden})")
        return Shard(self, world, self.heads // world, self.kv_heads // world, self.mlp // world)


@dataclass(frozen=True, slots=True)
class Shard:
    """One rank's share: its query and KV heads and its MLP columns."""

    config: Config
    world: int
    heads: int
    kv_heads: int
    mlp: int

    @property
    def qkv(self) -> int:
        """Columns of the rank's fused QKV projection."""
        return (self.heads + 2 * self.kv_heads) * self.config.head_dim

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.config
        return {"ln1": (c.hidden,), "wqkv": (c.hidden, self.qkv), "wo": (self.heads * c.head_dim, c.hidden),
                "ln2": (c.hidden,), "wgu": (c.hidden, 2 * self.mlp), "wd": (self.mlp, c.hidden)}

    def kv_shape(self, batch: int) -> tuple[int, ...]:
        c = self.config
        return (batch, self.kv_heads, c.kv_len, c.head_dim)


@dataclass
class Layer:
    ln1: torch.Tensor
    wqkv: torch.Tensor
    wo: torch.Tensor
    ln2: torch.Tensor
    wgu: torch.Tensor
    wd: torch.Tensor


@dataclass
class Weights:
    layers: list[Layer]
    final_norm: torch.Tensor

    def norm_after(self, i: int) -> torch.Tensor:
        """The norm the output of layer ``i``'s MLP feeds: the next layer's ln1, or the final one."""
        return self.layers[i + 1].ln1 if i + 1 < len(self.layers) else self.final_norm


def _normal(shape, seed: int, scale: float, device, dtype) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(device=device, dtype=dtype)


def _seed(base: int, layer: int, name: str, part: int) -> int:
    return (base * 1_000_003 + layer * 7919 + sum(map(ord, name)) * 131 + part) % (2**62)


def make_weights(shard: Shard, rank: int, *, seed: int = 0, device="cpu", dtype=torch.bfloat16) -> Weights:
    """Rank ``rank``'s shard of the model's weights.  Every unit of the split (a query or KV
    head's columns, a head's rows of the output projection, a block of MLP_BLOCK MLP columns)
    is drawn from its own seed, so the full model is the same for every world size and a shard
    is exactly its slice of it: a sharded step must equal the unsharded one."""
    c = shard.config
    layers = []
    for i in range(c.layers):
        def units(name: str, shape, first: int, count: int, scale: float, dim: int) -> torch.Tensor:
            return torch.cat([_normal(shape, _seed(seed, i, name, first + j), scale, device, dtype)
                              for j in range(count)], dim=dim)

        h, d, blocks = c.hidden, c.head_dim, shard.mlp // MLP_BLOCK
        wqkv = torch.cat([units("q", (h, d), rank * shard.heads, shard.heads, h ** -0.5, 1),
                          units("k", (h, d), rank * shard.kv_heads, shard.kv_heads, h ** -0.5, 1),
                          units("v", (h, d), rank * shard.kv_heads, shard.kv_heads, h ** -0.5, 1)], dim=1)
        wo = units("wo", (d, h), rank * shard.heads, shard.heads, h ** -0.5, 0)
        gate = units("gate", (h, MLP_BLOCK), rank * blocks, blocks, h ** -0.5, 1)
        up = units("up", (h, MLP_BLOCK), rank * blocks, blocks, h ** -0.5, 1)
        wd = units("wd", (MLP_BLOCK, h), rank * blocks, blocks, c.mlp ** -0.5, 0)
        layers.append(Layer(_norm_weight(c, seed, i, "ln1", device, dtype), wqkv, wo,
                            _norm_weight(c, seed, i, "ln2", device, dtype), torch.cat([gate, up], dim=1), wd))
    return Weights(layers, _norm_weight(c, seed, c.layers, "final", device, dtype))


def _norm_weight(c: Config, seed: int, layer: int, name: str, device, dtype) -> torch.Tensor:
    """An RMSNorm weight near one (replicated: the same on every rank)."""
    return (1.0 + 0.1 * _normal((c.hidden,), _seed(seed, layer, name, 0), 1.0, "cpu", torch.float32)).to(device, dtype)


def rmsnorm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, in float32, cast back (what the fused epilogue computes)."""
    x = h.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype) * weight


def attention_partial(shard: Shard, layer: Layer, kv: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor,
                      out: torch.Tensor) -> torch.Tensor:
    """This rank's heads of the attention of one new token over a full KV cache, projected to
    ``hidden``: a partial sum (into ``out``) the all-reduce completes."""
    c = shard.config
    batch = y.shape[0]
    qkv = y @ layer.wqkv
    q, k, v = qkv.split([shard.heads * c.head_dim, shard.kv_heads * c.head_dim, shard.kv_heads * c.head_dim], dim=1)
    k_cache, v_cache = kv
    k_cache[:, :, -1, :] = k.view(batch, shard.kv_heads, c.head_dim)  # the new token's slot (static shapes)
    v_cache[:, :, -1, :] = v.view(batch, shard.kv_heads, c.head_dim)
    # Grouped-query attention of one token: query head j uses KV head j // group, so the group's
    # query heads are the "query positions" of their KV head (no copy of the cache per query head).
    group = shard.heads // shard.kv_heads
    o = F.scaled_dot_product_attention(q.view(batch, shard.kv_heads, group, c.head_dim), k_cache, v_cache)
    return torch.matmul(o.reshape(batch, shard.heads * c.head_dim), layer.wo, out=out)


def mlp_partial(shard: Shard, layer: Layer, y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """This rank's MLP columns (SwiGLU), projected back: a partial sum into ``out``."""
    gate, up = (y @ layer.wgu).split([shard.mlp, shard.mlp], dim=1)
    return torch.matmul(F.silu(gate) * up, layer.wd, out=out)


@dataclass
class State:
    """One rank's decode state: the residual stream ``h`` [batch, hidden] and the KV caches."""

    h: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]]


def make_state(shard: Shard, rank: int, batch: int, *, seed: int = 0, device="cpu", dtype=torch.bfloat16) -> State:
    """The same ``h`` on every rank (TP replicates activations); each rank's cache holds its heads."""
    c = shard.config
    h = _normal((batch, c.hidden), _seed(seed, 10_000, "h", 0), 1.0, device, dtype)
    kv = []
    for i in range(c.layers):
        parts = []
        for kind in ("kcache", "vcache"):
            heads = [_normal((batch, 1, c.kv_len, c.head_dim), _seed(seed, i, kind, rank * shard.kv_heads + j), 1.0,
                             device, dtype) for j in range(shard.kv_heads)]
            parts.append(torch.cat(heads, dim=1))
        kv.append((parts[0], parts[1]))
    return State(h, kv)


class Comm:
    """What the step asks of a communication system.  ``buffer(name, shape)``: where a partial
    sum is written (a system may need its own memory there: a symmetric heap, registered
    windows); ``allreduce(x)``: the sum over ranks (in place or a new tensor); ``add_rmsnorm``:
    ``h += allreduce(x); return rmsnorm(h) * weight`` (systems with a fused kernel override it)."""

    def buffer(self, name: str, shape, dtype, device) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    def allreduce(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def add_rmsnorm(self, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h.add_(self.allreduce(x))
        return rmsnorm(h, weight, eps)


class NoComm(Comm):
    """No communication (each rank keeps its partial sums): the step's compute alone."""

    def allreduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


@dataclass
class Buffers:
    """One rank's partial-sum buffers, made once through its Comm (the graph's static memory)."""

    attn: torch.Tensor
    mlp: torch.Tensor

    @classmethod
    def make(cls, shard: Shard, batch: int, comm: Comm, dtype, device) -> "Buffers":
        shape = (batch, shard.config.hidden)
        return cls(comm.buffer("attn", shape, dtype, device), comm.buffer("mlp", shape, dtype, device))


def decode_step(shard: Shard, weights: Weights, state: State, comm: Comm, buffers: Buffers) -> torch.Tensor:
    """One decode step of every layer on this rank; returns the final normed hidden states
    (``state.h`` holds the residual stream after it)."""
    eps = shard.config.eps
    y = rmsnorm(state.h, weights.layers[0].ln1, eps)
    for i, layer in enumerate(weights.layers):
        x = attention_partial(shard, layer, state.kv[i], y, buffers.attn)
        y = comm.add_rmsnorm(x, state.h, layer.ln2, eps)
        x = mlp_partial(shard, layer, y, buffers.mlp)
        y = comm.add_rmsnorm(x, state.h, weights.norm_after(i), eps)
    return y


# ---------------------------------------------------------------------------------------------
# every rank in one process (loopback on one GPU, or the CPU tests): the same step, phase by
# phase, each rank's compute on its own stream, the communication a group call


class GroupComm:
    """Every rank's communication from one process.  ``add_rmsnorm(xs, hs, weights, eps)``: for
    every rank r, ``hs[r] += sum(xs)``, and ``rmsnorm(hs[r]) * weights[r]`` returned.  ``streams``
    (one per rank, or None) is where each rank's work runs."""

    streams = None

    def buffer(self, rank: int, name: str, shape, dtype, device) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    def add_rmsnorm(self, xs, hs, weights, eps: float) -> list:
        raise NotImplementedError


class SumGroup(GroupComm):
    """The reference: partial sums added in float32 on the current stream (no library)."""

    def add_rmsnorm(self, xs, hs, weights, eps: float) -> list:
        total = xs[0].float()
        for x in xs[1:]:
            total = total + x.float()
        reduced = total.to(xs[0].dtype)
        ys = []
        for h, w in zip(hs, weights):
            h.add_(reduced)
            ys.append(rmsnorm(h, w, eps))
        return ys


class NoGroup(GroupComm):
    """No communication: each rank adds its own partial sum (the compute-only step)."""

    def add_rmsnorm(self, xs, hs, weights, eps: float) -> list:
        ys = []
        for r, (x, h, w) in enumerate(zip(xs, hs, weights)):
            with on_stream(self.streams, r):
                h.add_(x)
                ys.append(rmsnorm(h, w, eps))
        return ys


@contextlib.contextmanager
def on_stream(streams, rank: int):
    """Rank ``rank``'s stream for the block when there are streams (else the current one)."""
    if streams is None:
        yield
        return
    with torch.cuda.stream(streams[rank]):
        yield


def group_buffers(shard: Shard, batch: int, comm: GroupComm, dtype, device) -> list[Buffers]:
    shape = (batch, shard.config.hidden)
    return [Buffers(comm.buffer(r, "attn", shape, dtype, device), comm.buffer(r, "mlp", shape, dtype, device))
            for r in range(shard.world)]


def decode_step_group(shard: Shard, weights: list[Weights], states: list[State], comm: GroupComm,
                      buffers: list[Buffers]) -> list[torch.Tensor]:
    """``decode_step`` of every rank, phase by phase (each rank's compute on its stream)."""
    eps, ranks, streams = shard.config.eps, range(shard.world), comm.streams
    ys = []
    for r in ranks:
        with on_stream(streams, r):
            ys.append(rmsnorm(states[r].h, weights[r].layers[0].ln1, eps))
    hs = [s.h for s in states]
    for i in range(shard.config.layers):
        xs = []
        for r in ranks:
            with on_stream(streams, r):
                xs.append(attention_partial(shard, weights[r].layers[i], states[r].kv[i], ys[r], buffers[r].attn))
        ys = comm.add_rmsnorm(xs, hs, [w.layers[i].ln2 for w in weights], eps)
        xs = []
        for r in ranks:
            with on_stream(streams, r):
                xs.append(mlp_partial(shard, weights[r].layers[i], ys[r], buffers[r].mlp))
        ys = comm.add_rmsnorm(xs, hs, [w.norm_after(i) for w in weights], eps)
    return ys
