"""The communication systems the decode step runs with (model.Comm / model.GroupComm).

One process per GPU (torchrun): ``none``, ``reference`` (every rank's partial sum gathered and
added in float32: independent of every all-reduce under test), ``nccl`` (``dist.all_reduce`` in
place; ``nccl-nomix`` is the same in a process with NCCL_GRAPH_MIXING_SUPPORT=0, and
``nccl-symm`` also writes its partial sums into NCCL symmetric windows, where NCCL runs its
symmetric-memory kernels),
``symm-one-shot`` / ``symm-two-shot`` (torch symmetric memory), ``purlin`` (a plain load on
ordinary tensors), ``purlin-heap`` (partial sums and outputs in the symmetric heap) and
``purlin-fused`` (``purlinc.torch.fused_add_rmsnorm_op``: the all-reduce, residual add and
RMSNorm in one kernel, from examples/fused/allreduce_add_rmsnorm.pln).

One process, every rank on one GPU (loopback): ``none``, ``reference``, ``purlin``,
``purlin-heap`` and ``purlin-fused`` as group calls, each rank on its own stream.

``Absent`` is raised where a system cannot run here (what is missing is its message): the
benchmark reports it as that system's row.
"""

from __future__ import annotations

import torch

from e2e import model

ROOT_EXAMPLES = __import__("pathlib").Path(__file__).resolve().parents[2] / "examples"
FUSED_PLN = ROOT_EXAMPLES / "fused" / "allreduce_add_rmsnorm.pln"


class Absent(RuntimeError):
    """This system cannot run here (the message says why)."""


def fused_available() -> str | None:
    """None when the fused epilogue op and its collective exist, else what is missing."""
    try:
        import purlinc.torch as pt
    except Exception as error:  # noqa: BLE001
        return f"purlinc.torch does not import ({type(error).__name__}: {error})"
    if not hasattr(pt, "fused_add_rmsnorm_op"):
        return "purlinc.torch has no fused_add_rmsnorm_op (the fused all-reduce + add + RMSNorm op)"
    if not FUSED_PLN.exists():
        return f"{FUSED_PLN.relative_to(ROOT_EXAMPLES.parent)} is missing"
    return None


# ---------------------------------------------------------------------------------------------
# one process per GPU


class Reference(model.Comm):
    def allreduce(self, x):
        import torch.distributed as dist

        world = dist.get_world_size()
        parts = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(parts, x)
        return parts.float().sum(0).to(x.dtype)


class Nccl(model.Comm):
    def allreduce(self, x):
        import torch.distributed as dist

        dist.all_reduce(x)
        return x


class NcclSymm(Nccl):
    """NCCL on partial sums written into symmetric windows: two flat buffers of the largest
    batch's size from a MemPool over NCCL's allocator, registered as windows once; every batch
    takes views of them (a pool registered before a later allocation would miss it)."""

    def __init__(self, device, elements: int):
        import torch.distributed as dist

        backend = dist.group.WORLD._get_backend(device)
        self.pool = torch.cuda.MemPool(backend.mem_allocator)
        with torch.cuda.use_mem_pool(self.pool):
            self.flat = {name: torch.empty(elements, dtype=torch.bfloat16, device=device) for name in ("attn", "mlp")}
        try:
            backend.register_mem_pool(self.pool, symm=True)
        except TypeError as error:
            raise Absent(f"register_mem_pool(pool, symm=True) unsupported by this torch: {error}") from error

    def buffer(self, name, shape, dtype, device):
        n = 1
        for d in shape:
            n *= d
        flat = self.flat[name]
        if dtype != flat.dtype or n > flat.numel():
            raise ValueError(f"nccl-symm {name} buffer: {n} {dtype} elements asked, {flat.numel()} bf16 made")
        return flat[:n].view(shape)


class SymmMem(model.Comm):
    """torch symmetric memory: partial sums in a symmetric buffer, one-shot or two-shot."""

    def __init__(self, how: str, group_name: str):
        import warnings

        import torch.distributed._symmetric_memory as symm_mem

        try:
            with warnings.catch_warnings():  # needed by older torch; deprecated (a no-op) in newer
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(group_name)
        except Exception:  # noqa: BLE001
            pass
        self.symm_mem, self.how, self.group = symm_mem, how, group_name
        self.outs: dict = {}
        op = getattr(torch.ops.symm_mem, f"{how}_all_reduce_out", None)
        if op is None:
            raise Absent(f"torch.ops.symm_mem.{how}_all_reduce_out is not in this torch")
        self.op = op

    def buffer(self, name, shape, dtype, device):
        t = self.symm_mem.empty(shape, dtype=dtype, device=device)
        self.symm_mem.rendezvous(t, self.group)
        self.outs[t.data_ptr()] = torch.empty_like(t)
        return t

    def allreduce(self, x):
        out = self.outs[x.data_ptr()]
        self.op(x, "sum", self.group, out)
        return out


class Purlin(model.Comm):
    """``purlinc.load("examples/allreduce.pln", comm)`` (size buckets); ``heap``: partial sums
    and outputs from ``comm.empty`` (the registered schedules in every mode)."""

    def __init__(self, comm, *, heap: bool):
        import purlinc

        self.comm, self.heap = comm, heap
        self.coll = purlinc.load(str(ROOT_EXAMPLES / "allreduce.pln"), comm)
        self.coll.warm("bfloat16", "sum")
        self.outs: dict = {}

    def buffer(self, name, shape, dtype, device):
        make = (lambda: self.comm.empty(shape, dtype)) if self.heap else (
            lambda: torch.empty(shape, dtype=dtype, device=device))
        t = make()
        self.outs[t.data_ptr()] = make()
        return t

    def allreduce(self, x):
        out = self.outs[x.data_ptr()]
        self.coll(x.view(-1), out=out.view(-1))
        return out


class PurlinFused(model.Comm):
    """The all-reduce, residual add and RMSNorm in one Purlin kernel (``purlin::fused_add_rmsnorm``)."""

    def __init__(self, comm, hidden: int):
        missing = fused_available()
        if missing:
            raise Absent(missing)
        import purlinc
        import purlinc.torch as pt

        self.coll = purlinc.load(str(FUSED_PLN), comm, params={"hidden": hidden})
        self.op = pt.fused_add_rmsnorm_op(self.coll)

    def allreduce(self, x):
        raise RuntimeError("purlin-fused runs the whole epilogue (add_rmsnorm), never a bare all-reduce")

    def add_rmsnorm(self, x, h, weight, eps):
        return self.op(x, h, weight, eps)


# ---------------------------------------------------------------------------------------------
# every rank in one process (loopback)


def _join(streams) -> None:
    """The current stream waits for every rank's stream (their work so far)."""
    current = torch.cuda.current_stream()
    for s in streams:
        current.wait_stream(s)


def _fork(streams) -> None:
    current = torch.cuda.current_stream()
    for s in streams:
        s.wait_stream(current)


class SumGroupOnStreams(model.SumGroup):
    """The reference, with ranks on streams: joined into the current stream, summed, forked."""

    def __init__(self, streams):
        self.streams = streams

    def add_rmsnorm(self, xs, hs, weights, eps):
        _join(self.streams)
        ys = super().add_rmsnorm(xs, hs, weights, eps)
        _fork(self.streams)
        return ys


class NoGroupOnStreams(model.NoGroup):
    def __init__(self, streams):
        self.streams = streams


class PurlinGroup(model.GroupComm):
    """A LocalGroup's collective as group calls, each rank on its stream; ``heap``: buffers
    from ``group.empty``; ``fused``: the fused epilogue collective (operands per rank)."""

    def __init__(self, group, streams, *, heap: bool = False, fused_hidden: int | None = None):
        import purlinc

        self.group, self.streams, self.heap = group, streams, heap
        self.outs: dict = {}
        self.fused = fused_hidden is not None
        if self.fused:
            missing = fused_available()
            if missing:
                raise Absent(missing)
            self.coll = purlinc.load(str(FUSED_PLN), group, params={"hidden": fused_hidden})
        else:
            self.coll = purlinc.load(str(ROOT_EXAMPLES / "allreduce.pln"), group)
        self.made: dict = {}

    def buffer(self, rank, name, shape, dtype, device):
        key = (name, tuple(shape))
        if key not in self.made:  # heap blocks are collective: every rank's at once
            if self.heap:
                self.made[key] = (self.group.empty(shape, dtype), self.group.empty(shape, dtype))
            else:
                world = len(self.streams)
                self.made[key] = ([torch.empty(shape, dtype=dtype, device=device) for _ in range(world)],
                                  [torch.empty(shape, dtype=dtype, device=device) for _ in range(world)])
        xs, outs = self.made[key]
        self.outs[xs[rank].data_ptr()] = outs[rank]
        return xs[rank]

    def add_rmsnorm(self, xs, hs, weights, eps):
        outs = [self.outs[x.data_ptr()] for x in xs]
        flat = [x.view(-1) for x in xs]
        if self.fused:
            self.coll(flat, [o.view(-1) for o in outs], streams=self.streams, residual=[h.view(-1) for h in hs],
                      weight=list(weights), eps=[eps] * len(xs))
            return outs
        self.coll(flat, [o.view(-1) for o in outs], streams=self.streams)
        ys = []
        for r, (h, out, w) in enumerate(zip(hs, outs, weights)):
            with model.on_stream(self.streams, r):
                h.add_(out)
                ys.append(model.rmsnorm(h, w, eps))
        return ys
