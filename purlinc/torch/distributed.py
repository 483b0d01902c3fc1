"""The eight standard collectives shaped like torch.distributed, bound to one communicator.

``Group(comm)`` holds them; each call keeps the caller's shapes (chunks are slices along
dim 0, as torch concatenates), takes ``op=`` as a string or a ``torch.distributed.ReduceOp``
(``avg`` included, for floating dtypes) and ``async_op=True`` for a :class:`Work`.

Eager calls run the op bodies directly (no dispatcher); inside ``torch.compile`` the same
calls become the functional custom ops of :mod:`purlinc.torch.ops` (ordered effects: the
compiler neither drops nor reorders them, so every rank's graph calls its collectives in
program order) followed by a copy into the caller's tensor.  A
collective with a root (broadcast, reduce, gather, scatter) is one loaded collective per
root.  A Group makes every (collective, root) entry up front -- shapes only, from the spec --
so a compiled graph finds its handle by a dict lookup (a constant), and the load itself
happens on the first real call.
"""

from __future__ import annotations

import torch

from purlinc.runtime.errors import ArgumentError
from purlinc.torch import ops as _ops
from purlinc.torch.registry import Entry, entry
from purlinc.torch.standard import ROOTED, SOURCES

_DEFINITIONS: dict = {}


def _definition(kind: str):
    """The parsed AST of a standard collective (parsed once per process)."""
    hit = _DEFINITIONS.get(kind)
    if hit is None:
        from purlinc.frontend.parse import parse

        hit = _DEFINITIONS[kind] = parse(SOURCES[kind], f"<{kind}>")
    return hit


def _torch_device(device) -> torch.device:
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _has_splits(output_split_sizes, input_split_sizes) -> bool:
    """Whether a call gives split lists.  Then it runs the all-to-all with run-time sizes,
    even where this rank's lists happen to be equal: another rank's may not be, and every
    rank must run the same collective (a rank cannot see the others' lists)."""
    return any(splits is not None and len(splits) for splits in (output_split_sizes, input_split_sizes))


class Work:
    """What ``async_op=True`` returns, as torch.distributed's Work: ``wait()`` makes the
    caller's current stream wait for the collective (the host does not block);
    ``is_completed()`` asks without waiting; ``synchronize()`` blocks the host."""

    def __init__(self, event=None, device=None, result=None):
        self._event, self._device, self._result = event, device, result or []

    def wait(self, timeout=None) -> bool:
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        return self._event is None or self._event.query()

    def synchronize(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def result(self) -> list:
        return list(self._result)


# Inside a compiled graph a call is already ordered on the current stream: its Work is done.
_DONE = Work()


class Group:
    """torch.distributed-shaped calls on one Purlin communicator (one rank's view).

    ``load_options`` go to ``purlinc.load`` (``algorithm=``, ``atom=``, ...; none: the tuned
    default).  ``loader(source, params)`` replaces ``purlinc.load`` (tests use a CPU stand-in).
    """

    def __init__(self, comm, *, loader=None, device=None, **load_options):
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.device = _torch_device(comm.device if device is None else device)
        if loader is None:
            import purlinc

            def loader(source, params):
                return purlinc.load(source, comm, params=params, **load_options)
        self._loader = loader
        self._entries: dict[tuple[str, int], Entry] = {}
        self._side: torch.cuda.Stream | None = None
        self._seq = _ops.sequence(comm, self.device)  # orders compiled calls (ops._keep_in_order)
        # Every (collective, root) entry now: they hold only shapes (loads come on first use),
        # and a compiled graph then finds its handle by a plain dict lookup, a constant.
        self._handles: dict[tuple[str, int], int] = {}
        for kind in SOURCES:
            for root in (range(self.world_size) if kind in ROOTED else (0,)):
                self._handles[(kind, root)] = self.entry(kind, root).handle

    def __repr__(self) -> str:
        return f"purlinc.torch.Group(rank {self.rank} of {self.world_size}, {self.device})"

    # ------------------------------------------------------------------------------- entries
    def entry(self, kind: str, root: int = 0) -> Entry:
        key = (kind, root if kind in ROOTED else 0)
        hit = self._entries.get(key)
        if hit is None:
            from purlinc.frontend.check import check

            params = {"root": key[1]} if kind in ROOTED else None
            spec = check(_definition(kind), self.world_size, params)
            hit = Entry(kind, spec, self.comm, self.device,
                        loader=lambda: self._loader(SOURCES[kind], params))
            _ops.define(kind)
            self._entries[key] = hit
        return hit

    def _handle(self, kind: str, root: int = 0) -> int:
        return self._handles[(kind, root)]

    def _root(self, where: str, label: str, root: int) -> int:
        if not isinstance(root, int) or not 0 <= root < self.world_size:
            raise ArgumentError(f"{where}: {label}={root!r}, expected a rank in [0, {self.world_size})")
        return root

    def close(self) -> None:
        from purlinc.torch import sized

        state = sized._BY_GROUP.pop(self, None)
        if state is not None:
            state.close()
        for e in self._entries.values():
            e.close()
        self._entries.clear()
        self._handles.clear()

    # ------------------------------------------------------------------------------- launching
    def _issue(self, body, tensors, async_op: bool, result=()):
        """Run ``body`` now (sync), or on a side stream that waits for the current one (async)."""
        if not async_op:
            body()
            return None
        if self.device.type != "cuda":
            body()
            return Work(result=list(result))
        current = torch.cuda.current_stream(self.device)
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side = self._side
        side.wait_stream(current)
        with torch.cuda.stream(side):
            body()
        for t in tensors:  # the caching allocator must not reuse them before the side stream is done
            if t.numel():
                t.record_stream(side)
        event = torch.cuda.Event()
        event.record(side)
        return Work(event, self.device, list(result))

    def _check(self, where, e, named, op=None):
        for label, t in named:
            if not isinstance(t, torch.Tensor):
                raise ArgumentError(f"{where}: {label} must be a torch.Tensor, got {type(t).__name__}")
            _ops.check_tensor(where, label, t, e, op)

    # ------------------------------------------------------------------------------- calls
    def all_reduce(self, tensor, op="sum", async_op=False):
        op = _ops.normalize_op(op, "all_reduce")
        handle = self._handle("allreduce")
        if _compiling():
            tensor.copy_(torch.ops.purlin.allreduce_seq(tensor, self._seq, handle, op, -1).view(tensor.shape))
            return _DONE if async_op else None
        e = entry(handle)
        self._check("all_reduce", e, [("tensor", tensor)], op)
        body = _ops.define("allreduce").eager_inplace
        return self._issue(lambda: body(tensor, handle, op), [tensor], async_op, [tensor])

    def all_gather_into_tensor(self, output_tensor, input_tensor, async_op=False):
        handle = self._handle("allgather")
        if _compiling():
            output_tensor.copy_(torch.ops.purlin.allgather_seq(input_tensor, self._seq, handle, "sum", -1).view(output_tensor.shape))
            return _DONE if async_op else None
        e = entry(handle)
        where = "all_gather_into_tensor"
        self._check(where, e, [("input_tensor", input_tensor), ("output_tensor", output_tensor)])
        self._same_dtype(where, output_tensor, input_tensor, "output_tensor", "input_tensor")
        if output_tensor.numel() != self.world_size * input_tensor.numel():
            raise ArgumentError(
                f"{where}: output_tensor has {output_tensor.numel()} elements (shape {tuple(output_tensor.shape)}), "
                f"expected {self.world_size * input_tensor.numel()} ({self.world_size} ranks x the "
                f"{input_tensor.numel()} of input_tensor)")
        body = _ops.define("allgather").eager_out
        return self._issue(lambda: body(input_tensor, output_tensor, handle, "sum"),
                           [input_tensor, output_tensor], async_op, [output_tensor])

    def reduce_scatter_tensor(self, output, input, op="sum", async_op=False):
        op = _ops.normalize_op(op, "reduce_scatter_tensor")
        handle = self._handle("reduce_scatter")
        if _compiling():
            output.copy_(torch.ops.purlin.reduce_scatter_seq(input, self._seq, handle, op, -1).view(output.shape))
            return _DONE if async_op else None
        e = entry(handle)
        where = "reduce_scatter_tensor"
        self._check(where, e, [("input", input), ("output", output)], op)
        self._same_dtype(where, output, input, "output", "input")
        if input.numel() != self.world_size * output.numel():
            raise ArgumentError(
                f"{where}: input has {input.numel()} elements (shape {tuple(input.shape)}), expected "
                f"{self.world_size * output.numel()} ({self.world_size} ranks x the {output.numel()} of output)")
        body = _ops.define("reduce_scatter").eager_out
        return self._issue(lambda: body(input, output, handle, op), [input, output], async_op, [output])

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, async_op=False):
        where = "all_to_all_single"
        if _has_splits(output_split_sizes, input_split_sizes):
            # Split sizes: the all-to-all with run-time sizes (purlinc.torch.sized).
            from purlinc.torch import sized

            if _compiling():
                raise ArgumentError(f"{where}: split size lists under torch.compile: expected all_to_all_vdev "
                                    "(sizes on the GPU), got host lists")
            return self._issue(lambda: sized.all_to_all_single(self, output, input, output_split_sizes,
                                                               input_split_sizes), [input, output], async_op, [output])
        handle = self._handle("alltoall")
        if _compiling():
            output.copy_(torch.ops.purlin.alltoall_seq(input, self._seq, handle, "sum", -1).view(output.shape))
            return _DONE if async_op else None
        e = entry(handle)
        self._check(where, e, [("input", input), ("output", output)])
        self._same_dtype(where, output, input, "output", "input")
        if output.numel() != input.numel():
            raise ArgumentError(f"{where}: output has {output.numel()} elements, expected {input.numel()} "
                                f"(as many as input)")
        if input.dim() and input.shape[0] % self.world_size:
            raise ArgumentError(f"{where}: input has {input.shape[0]} rows (dim 0), expected a multiple of "
                                f"{self.world_size} (one equal slice per rank)")
        body = _ops.define("alltoall").eager_out
        return self._issue(lambda: body(input, output, handle, "sum"), [input, output], async_op, [output])

    def all_to_all_vdev(self, input, out, in_splits, out_splits, out_offsets=None, async_op=False):
        """All-to-all with split sizes on the GPU (rows of dim 0): ``in_splits`` read and
        ``out_splits`` (and ``out_offsets``) written by the kernel, no host synchronisation;
        like ``torch.distributed._symmetric_memory.all_to_all_vdev`` (purlinc.torch.sized)."""
        from purlinc.torch import sized

        if _compiling():
            handle = sized.state_of(self).handle
            sized.define()[1](input, in_splits, out, out_splits, handle)
            if out_offsets is not None:
                out_offsets.copy_(torch.cumsum(out_splits, 0) - out_splits)
            return _DONE if async_op else None
        tensors = [input, out, in_splits, out_splits] + ([out_offsets] if out_offsets is not None else [])
        return self._issue(lambda: sized.all_to_all_vdev(self, input, out, in_splits, out_splits, out_offsets),
                           tensors, async_op, [out])

    def broadcast(self, tensor, src=0, async_op=False):
        src = self._root("broadcast", "src", src)
        handle = self._handle("broadcast", src)
        if _compiling():
            x = tensor if self.rank == src else tensor.new_empty(0)
            tensor.copy_(torch.ops.purlin.broadcast_seq(x, self._seq, handle, "sum", tensor.numel()).view(tensor.shape))
            return _DONE if async_op else None
        self._check("broadcast", entry(handle), [("tensor", tensor)])
        body = _ops.define("broadcast").eager_inplace
        return self._issue(lambda: body(tensor, handle, "sum"), [tensor], async_op, [tensor])

    def reduce(self, tensor, dst=0, op="sum", async_op=False):
        dst = self._root("reduce", "dst", dst)
        op = _ops.normalize_op(op, "reduce")
        handle = self._handle("reduce", dst)
        if _compiling():
            y = torch.ops.purlin.reduce_seq(tensor, self._seq, handle, op, -1)
            if self.rank == dst:  # elsewhere y is empty and tensor keeps its value
                tensor.copy_(y.view(tensor.shape))
            return _DONE if async_op else None
        self._check("reduce", entry(handle), [("tensor", tensor)], op)
        body = _ops.define("reduce").eager_inplace
        return self._issue(lambda: body(tensor, handle, op), [tensor], async_op, [tensor])

    def gather(self, tensor, gather_list=None, dst=0, async_op=False):
        where = "gather"
        dst = self._root(where, "dst", dst)
        self._lists(where, "gather_list", gather_list, tensor, self.rank == dst, "dst")
        handle = self._handle("gather", dst)
        if _compiling():
            y = torch.ops.purlin.gather_seq(tensor, self._seq, handle, "sum", -1)
            if self.rank == dst:
                for i, g in enumerate(gather_list):
                    g.copy_(y[i * tensor.numel():(i + 1) * tensor.numel()].view(g.shape))
            return _DONE if async_op else None
        self._check(where, entry(handle), [("tensor", tensor)])
        body = _ops.define("gather").eager_out
        out = tensor.new_empty(self.world_size * tensor.numel() if self.rank == dst else 0)

        def run():
            body(tensor, out, handle, "sum")
            if self.rank == dst:
                n = tensor.numel()
                for i, g in enumerate(gather_list):
                    g.copy_(out[i * n:(i + 1) * n].view(g.shape))
        return self._issue(run, [tensor, out, *(gather_list or [])], async_op, gather_list or [])

    def scatter(self, tensor, scatter_list=None, src=0, async_op=False):
        where = "scatter"
        src = self._root(where, "src", src)
        self._lists(where, "scatter_list", scatter_list, tensor, self.rank == src, "src")
        handle = self._handle("scatter", src)
        if _compiling():
            x = torch.cat([s.reshape(-1) for s in scatter_list]) if self.rank == src else tensor.new_empty(0)
            tensor.copy_(torch.ops.purlin.scatter_seq(x, self._seq, handle, "sum", tensor.numel()).view(tensor.shape))
            return _DONE if async_op else None
        self._check(where, entry(handle), [("tensor", tensor)])
        body = _ops.define("scatter").eager_out

        def run():  # under async_op the concatenation is made on the side stream too
            x = torch.cat([s.reshape(-1) for s in scatter_list]) if self.rank == src else tensor.new_empty(0)
            body(x, tensor, handle, "sum")
        return self._issue(run, [tensor, *(scatter_list or [])], async_op, [tensor])

    # ------------------------------------------------------------------------------- helpers
    @staticmethod
    def _same_dtype(where, a, b, la, lb):
        if a.dtype != b.dtype:
            raise ArgumentError(f"{where}: {la} has dtype {str(a.dtype).removeprefix('torch.')}, expected "
                                f"{str(b.dtype).removeprefix('torch.')} (the dtype of {lb})")

    def _lists(self, where, label, tensors, tensor, is_root, root_label):
        if not is_root:
            if tensors:
                raise ArgumentError(f"{where}: {label} must be None or empty on ranks other than {root_label}; "
                                    f"rank {self.rank} got {len(tensors)} tensors")
            return
        if tensors is None or len(tensors) != self.world_size:
            got = "None" if tensors is None else f"{len(tensors)} tensors"
            raise ArgumentError(f"{where}: {label} on the {root_label} rank must hold {self.world_size} tensors "
                                f"(one per rank), got {got}")
        for i, t in enumerate(tensors):
            if t.numel() != tensor.numel() or t.dtype != tensor.dtype or t.device != tensor.device:
                raise ArgumentError(
                    f"{where}: {label}[{i}] is {str(t.dtype).removeprefix('torch.')} x {t.numel()} on {t.device}, "
                    f"expected {str(tensor.dtype).removeprefix('torch.')} x {tensor.numel()} on {tensor.device} "
                    f"(like tensor)")
