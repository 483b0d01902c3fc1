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

import functools
import math

import torch

from purlinc.frontend.standard import ROOTED, SOURCES
from purlinc.runtime.errors import ArgumentError
from purlinc.runtime.validate import integer
from purlinc.torch import ops as _ops
from purlinc.torch.registry import Entry, entry

_DEFINITIONS: dict = {}


def _definition(kind: str):
    """The parsed AST of a standard collective (parsed once per process)."""
    hit = _DEFINITIONS.get(kind)
    if hit is None:
        from purlinc.frontend.parse import parse

        hit = _DEFINITIONS[kind] = parse(SOURCES[kind], f"<{kind}>")
    return hit


try:  # torch.distributed's Work, so a Work of ours is one wherever torch expects one (a backend's returns)
    from torch._C._distributed_c10d import Work as _C10dWork
except ImportError:  # a torch built without distributed support
    _C10dWork = object


class Work(_C10dWork):
    """What ``async_op=True`` returns, a ``torch.distributed.Work``: ``wait()`` makes the
    caller's current stream wait for the collective (the host does not block);
    ``is_completed()`` asks without waiting; ``synchronize()`` blocks the host;
    ``get_future()`` is a ``torch.futures.Future`` of the output tensors, completed (CUDA-aware,
    on the current stream) once the collective is."""

    def __init__(self, event=None, device=None, result=None):
        super().__init__()
        self._event, self._device, self._result = event, device, result or []

    def wait(self, timeout=None) -> bool:
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        return self._event is None or self._event.query()

    def is_success(self) -> bool:
        return self.is_completed()

    def synchronize(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def result(self) -> list:
        return list(self._result)

    def get_future(self) -> torch.futures.Future:
        if self._event is None:
            future = torch.futures.Future()
        else:  # a CUDA future: set_result records the current stream, which now waits for the collective
            future = torch.futures.Future(devices=[self._device])
            self.wait()
        future.set_result(list(self._result))
        return future


def _unseen_by_autograd(method):
    """A Group call runs under ``torch.no_grad()``: invisible to autograd, as torch.distributed's
    in-place calls are (a tensor it writes keeps its history, so its gradient flows as if the
    call had not happened), eagerly and compiled alike.  Eagerly the kernels write memory,
    which autograd never sees; traced, the custom op of a tensor that requires grad had no
    formula (torch's "no autograd formula was registered" at compile or backward time).  The
    differentiable forms are purlinc.torch.functional's."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with torch.no_grad():
            return method(self, *args, **kwargs)
    return call


# Inside a compiled graph a call is already ordered on the current stream: its Work is done.
_DONE = Work()


# purlinc.load's options a Group passes to every load: the schedule's.  Not params (each
# collective's own), capacity and dtype (the uneven all-to-all's: sized.configure) or
# gpus_per_node (a Group stands on one communicator).
GROUP_LOAD_OPTIONS = ("algorithm", "atom", "channels", "slices", "packed", "arch", "trace")


def _check_load_options(options: dict) -> None:
    """Names and the trace flag checked when the Group is made, not at its first collective."""
    from purlinc.runtime.options import LoadOptions

    unknown = sorted(set(options) - set(GROUP_LOAD_OPTIONS))
    if unknown:
        raise ArgumentError(f"Group: unknown load option(s) {', '.join(unknown)}; expected some of "
                            f"{', '.join(GROUP_LOAD_OPTIONS)}",
                            notes=("the uneven all-to-all's capacity: purlinc.torch.sized.configure(group, "
                                   "capacity=...)",))
    LoadOptions.of(**options)


class Group:
    """torch.distributed-shaped calls on one Purlin communicator (one rank's view).

    ``ranks`` are the global ranks of the group's members in group-rank order (a process
    group's, see :mod:`purlinc.torch.groups`; default: the communicator's ranks): ``src=`` and
    ``dst=`` name global ranks, as in torch.distributed, and ``group_src=`` / ``group_dst=``
    ranks of the group.  ``load_options`` go to ``purlinc.load`` (``algorithm=``, ``atom=``, ...;
    none: the tuned default).  ``loader(source, params)`` replaces ``purlinc.load`` (tests use a
    CPU stand-in).
    """

    def __init__(self, comm, *, ranks=None, loader=None, device=None, **load_options):
        _ops.require_communicator("Group", comm)
        _check_load_options(load_options)
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.ranks = list(range(self.world_size)) if ranks is None else _global_ranks(ranks, self.world_size)
        if len(self.ranks) != self.world_size:
            raise ArgumentError(f"Group: ranks={self.ranks} names {len(self.ranks)} ranks, expected "
                                f"{self.world_size} (the communicator's world size)")
        self.device = _ops.torch_device("Group", comm.device if device is None else device)
        # A loader of the caller's (a CPU stand-in) also loads the all-to-all with run-time
        # sizes (purlinc.torch.sized); the default one is purlinc.load with a capacity there.
        self.custom_loader = loader is not None
        if loader is None:
            import purlinc

            def loader(source, params):
                return purlinc.load(source, comm, params=params, **load_options)
        self._loader = loader
        self._entries: dict[tuple[str, int], Entry] = {}
        self._specs: dict[tuple[str, bool], object] = {}  # _spec's, by (collective, this rank is the root)
        self.closed = False
        self._side: torch.cuda.Stream | None = None
        self._sequence = _ops.sequence(comm, self.device)  # orders compiled calls (ops._keep_in_order)
        # Every (collective, root) entry now: they hold only shapes (loads come on first use),
        # and a compiled graph then finds its handle by a plain dict lookup, a constant.
        self._handles: dict[tuple[str, int], int] = {}
        for kind in SOURCES:
            for root in (range(self.world_size) if kind in ROOTED else (0,)):
                self._handles[(kind, root)] = self.entry(kind, root).handle
        _link_inverses(self)
        from purlinc.torch import sized

        sized.state_of(self)  # the uneven all-to-all's handle now (shapes only; loads on first use)

    def __repr__(self) -> str:
        # ints as plain ints (ops.shown): a closed group's refusal (_require_open) formats this while traced
        return (f"purlinc.torch.Group(rank {_ops.shown(self.rank)} of {_ops.shown(self.world_size)}, {self.device}, "
                f"global ranks {_ranks_shown(self.ranks)})")

    # ------------------------------------------------------------------------------- entries
    def entry(self, kind: str, root: int = 0) -> Entry:
        key = (kind, root if kind in ROOTED else 0)
        hit = self._entries.get(key)
        if hit is None:
            params = {"root": key[1]} if kind in ROOTED else None
            spec = self._spec(kind, key[1])
            hit = Entry(kind, spec, self.comm, self.device,
                        loader=lambda: self._loader(SOURCES[kind], params))
            _ops.define(kind)
            self._entries[key] = hit
        return hit

    def _spec(self, kind: str, root: int):
        """The checked spec an Entry reads this rank's shapes from.  A rooted standard collective's
        layout on this rank depends only on whether this rank is the root, so one check per role
        serves every root: a check per root (each over all R ranks) made a group's creation grow
        with R squared (12 s at R=512)."""
        from purlinc.frontend.check import check

        role = (kind, root == self.rank) if kind in ROOTED else (kind, True)
        hit = self._specs.get(role)
        if hit is None:
            params = {"root": root} if kind in ROOTED else None
            hit = self._specs[role] = check(_definition(kind), self.world_size, params)
        return hit

    def _seq(self, like):
        """The communicator's sequence tensor, as an active FakeTensorMode sees it (ops.traced;
        ``like``: a tensor of the call, whose device a stand-in takes where there is none)."""
        return _ops.traced(self._sequence, like)

    def _handle(self, kind: str, root: int = 0) -> int:
        self._require_open(kind)
        return self._handles[(kind, root)]

    def _require_open(self, where: str) -> None:
        """A closed group has no handles or states left: a call is refused by name (an uneven
        all-to-all would otherwise make and load a new state on this rank alone)."""
        if self.closed:
            _ops.fail(f"{where}: {self!r} was closed; expected an open group",
                      notes=("make a new Group, or call purlinc.torch.group_of(pg) again for a process group",))

    def _root(self, where: str, label: str, root, group_root=None) -> int:
        """The group rank of a root given as a global rank (``src``/``dst``) or a group rank
        (``group_src``/``group_dst``); group rank 0 when neither is given.  Refusals go through
        ``_ops.fail``: compiled with fullgraph=True, a raised ArgumentError reached the caller as
        dynamo's "Attempted to call a super() attribute", without the reason."""
        if root is not None and group_root is not None:
            _ops.fail(f"{where}: {label}={_ops.value_shown(root)} and group_{label}={_ops.value_shown(group_root)}; "
                      "expected one of them")
        root, group_root = (None if r is None else _rank_number(where, name, r)
                            for name, r in ((label, root), (f"group_{label}", group_root)))
        if group_root is None:
            if root is None:
                return 0
            # A loop of ==, not `root in self.ranks` / `.index(root)`: under torch.compile(dynamic=True)
            # dynamo reads the ints of this list as symbols, and `in` never compares a member with
            # them (pytorch/pytorch#153366): src=0 was "not a rank of this group", compiled only.
            for group_rank, member in enumerate(self.ranks):
                if member == root:
                    return group_rank
            _ops.fail(f"{where}: {label}={_ops.shown(root)} is not a rank of this group; expected one of its global "
                      f"ranks {_ranks_shown(self.ranks)}", notes=(f"group_{label}= takes a rank within the group",))
        if not 0 <= group_root < self.world_size:
            _ops.fail(f"{where}: group_{label}={_ops.shown(group_root)}, expected a rank in "
                      f"[0, {_ops.shown(self.world_size)})")
        return group_root

    def close(self) -> None:
        from purlinc.torch import sized

        self.closed = True
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
        """Each tensor's device, dtype and layout, by the caller's names, before anything is
        launched or recorded: eagerly and traced alike (traced, as a fake implementation, meta
        tensors pass the device check).  Traced, the op's fake sees only what reaches it: not
        the tensor a copy_ fills afterwards, nor a rooted call's tensor on the ranks that give
        no input, so a call would trace on some ranks and be refused on others."""
        fake = _ops.tracing()
        for label, t in named:
            _ops.check_tensor(where, label, t, e, op, fake=fake)
        _ops.same_device(where, named)  # traced, meta passes each check alone: not meta beside a real tensor

    @staticmethod
    def _bytes(where, named):
        """Copy collectives: each tensor as itself, or as a view of its bytes (ops.carrier)."""
        return [_ops.carrier(where, label, t, reduce=False) for label, t in named]

    # ------------------------------------------------------------------------------- reductions
    @_unseen_by_autograd
    def all_reduce(self, tensor, op="sum", async_op=False):
        where = "all_reduce"
        _ops.require_tensors(where, [("tensor", tensor)])
        op = _ops.normalize_op(op, where)
        handle = self._handle("allreduce")
        # strides included: a count R does not divide is padded below, and the padded copy would
        # hide them (refused as torch.distributed's NCCL backend does, padded or not)
        self._check(where, entry(handle), [("tensor", tensor)], op)
        n = tensor.numel()
        if n % self.world_size:  # the spec splits x into R chunks: pad to a multiple of R, as torch takes any size
            padded = tensor.new_zeros(-(-n // self.world_size) * self.world_size)
            padded[:n].copy_(tensor.reshape(-1))
            return self._then(lambda: self.all_reduce(padded, op), lambda: tensor.copy_(padded[:n].view(tensor.shape)),
                              [tensor, padded], async_op, [tensor])
        if _ops.tracing():
            tensor.copy_(torch.ops.purlin.allreduce_seq(tensor, self._seq(tensor), handle, op, -1).view(tensor.shape))
            return _DONE if async_op else None
        body = _ops.define("allreduce").eager_inplace
        return self._issue(lambda: body(tensor, handle, op), [tensor], async_op, [tensor])

    @_unseen_by_autograd
    def reduce_scatter_tensor(self, output, input, op="sum", async_op=False):
        return self._reduce_scatter("reduce_scatter_tensor", ("output", output), ("input", input), op, async_op)

    def _reduce_scatter(self, where, named_out, named_in, op, async_op):
        """reduce_scatter_tensor, its messages naming ``where``'s arguments (the list form's too)."""
        (out_label, output), (in_label, input) = named_out, named_in
        _ops.require_tensors(where, [named_out, named_in])
        op = _ops.normalize_op(op, where)
        handle = self._handle("reduce_scatter")
        self._same_dtype(where, output, input, out_label, in_label)
        _ops.require(input.numel() == self.world_size * output.numel(),
                 lambda: f"{where}: {in_label} has {_ops.shown(input.numel())} elements (shape "
                 f"{_ops.shape_shown(input)}), expected {_ops.shown(self.world_size * output.numel())} "
                 f"({_ops.shown(self.world_size)} ranks x the {_ops.shown(output.numel())} of {out_label})")
        self._check(where, entry(handle), [named_in, named_out], op)
        if _ops.tracing():
            y = torch.ops.purlin.reduce_scatter_seq(input, self._seq(input), handle, op, -1)
            output.copy_(y.view(output.shape))
            return _DONE if async_op else None
        body = _ops.define("reduce_scatter").eager_out
        return self._issue(lambda: body(input, output, handle, op), [input, output], async_op, [output])

    @_unseen_by_autograd
    def reduce(self, tensor, dst=None, op="sum", async_op=False, *, group_dst=None):
        _ops.require_tensors("reduce", [("tensor", tensor)])
        dst = self._root("reduce", "dst", dst, group_dst)
        op = _ops.normalize_op(op, "reduce")
        handle = self._handle("reduce", dst)
        self._check("reduce", entry(handle), [("tensor", tensor)], op)
        if _ops.tracing():
            y = torch.ops.purlin.reduce_seq(tensor, self._seq(tensor), handle, op, -1)
            if self.rank == dst:  # elsewhere y is empty and tensor keeps its value
                tensor.copy_(y.view(tensor.shape))
            return _DONE if async_op else None
        body = _ops.define("reduce").eager_inplace
        return self._issue(lambda: body(tensor, handle, op), [tensor], async_op, [tensor])

    @_unseen_by_autograd
    def reduce_scatter(self, output, input_list, op="sum", async_op=False):
        """``input_list[j]`` (one tensor per rank, each like ``output``) reduced over the ranks into rank j's ``output``."""
        where = "reduce_scatter"
        _ops.require_tensors(where, [("output", output)])
        self._list_like(where, "input_list", input_list, output)
        flat = torch.cat([t.reshape(-1) for t in input_list]).view(-1)
        return self._reduce_scatter(where, ("output", output), ("input_list", flat), op, async_op)

    @_unseen_by_autograd
    def barrier(self, async_op=False):
        """Every rank has reached it: a tiny all-reduce; on a GPU the host then waits for it."""
        token = torch.zeros(self.world_size, dtype=torch.int32, device=self.device)
        work = self.all_reduce(token, async_op=async_op)
        if work is None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return work

    # ------------------------------------------------------------------------------- copies
    @_unseen_by_autograd
    def all_gather_into_tensor(self, output_tensor, input_tensor, async_op=False):
        return self._all_gather("all_gather_into_tensor", ("output_tensor", output_tensor),
                                ("input_tensor", input_tensor), async_op)

    def _all_gather(self, where, named_out, named_in, async_op):
        """all_gather_into_tensor, its messages naming ``where``'s arguments (the list form's too)."""
        (out_label, output_tensor), (in_label, input_tensor) = named_out, named_in
        _ops.require_tensors(where, [named_out, named_in])
        handle = self._handle("allgather")
        output, input = self._bytes(where, [named_out, named_in])
        self._same_dtype(where, output_tensor, input_tensor, out_label, in_label)
        _ops.require(output_tensor.numel() == self.world_size * input_tensor.numel(),
                 lambda: f"{where}: {out_label} has {_ops.shown(output_tensor.numel())} elements (shape "
                 f"{_ops.shape_shown(output_tensor)}), expected {_ops.shown(self.world_size * input_tensor.numel())} "
                 f"({_ops.shown(self.world_size)} ranks x the {_ops.shown(input_tensor.numel())} of {in_label})")
        self._check(where, entry(handle), [(in_label, input), (out_label, output)])
        if _ops.tracing():
            output.copy_(torch.ops.purlin.allgather_seq(input, self._seq(input), handle, "sum", -1).view(output.shape))
            return _DONE if async_op else None
        body = _ops.define("allgather").eager_out
        return self._issue(lambda: body(input, output, handle, "sum"),
                           [input, output], async_op, [output_tensor])

    @_unseen_by_autograd
    def all_gather(self, tensor_list, tensor, async_op=False):
        """Rank j's ``tensor`` into ``tensor_list[j]`` on every rank."""
        where = "all_gather"
        _ops.require_tensors(where, [("tensor", tensor)])
        self._list_like(where, "tensor_list", tensor_list, tensor)
        flat = tensor.new_empty(self.world_size * tensor.numel())
        src = tensor.contiguous()
        return self._then(lambda: self._all_gather(where, ("tensor_list", flat), ("tensor", src), False),
                          lambda: self._split_into(where, flat, tensor_list),
                          [flat, src, *tensor_list], async_op, tensor_list)

    @_unseen_by_autograd
    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, async_op=False):
        """Slice j (along dim 0) of ``input`` to rank j; ``output`` holds every rank's slice for this rank.
        Split sizes (rows of each tensor's dim 0 per rank) may differ; equal slices when they are not given."""
        where = "all_to_all_single"
        _ops.require_tensors(where, [("output", output), ("input", input)])
        splits = self._splits(where, output, input, output_split_sizes, input_split_sizes)
        if splits is not None:
            return self._all_to_all_uneven(where, output, input, *splits, async_op)
        return self._all_to_all_equal(where, ("output", output), ("input", input), async_op)

    def _all_to_all_equal(self, where, named_out, named_in, async_op):
        """The all-to-all of equal slices of dim 0, its messages naming ``where``'s arguments."""
        (out_label, output), (in_label, input) = named_out, named_in
        handle = self._handle("alltoall")
        out, inp = self._bytes(where, [named_out, named_in])
        self._same_dtype(where, output, input, out_label, in_label)
        _ops.require(output.numel() == input.numel(),
                 lambda: f"{where}: {out_label} has {_ops.shown(output.numel())} elements, expected "
                 f"{_ops.shown(input.numel())} (as many as {in_label})")
        # a 0-d tensor is one row (as sized.host_splits counts it): it passed here, and the op then
        # refused it as "purlin::alltoall: x has 1 elements", in neither the caller's terms nor names
        rows = input.shape[0] if input.dim() else input.numel()
        _ops.require(rows % self.world_size == 0,
                 lambda: f"{where}: {in_label} has {_ops.shown(rows)} rows (dim 0), "
                 f"expected a multiple of {_ops.shown(self.world_size)} (one equal slice per rank)")
        self._check(where, entry(handle), [(in_label, inp), (out_label, out)])
        if _ops.tracing():
            out.copy_(torch.ops.purlin.alltoall_seq(inp, self._seq(inp), handle, "sum", -1).view(out.shape))
            return _DONE if async_op else None
        body = _ops.define("alltoall").eager_out
        return self._issue(lambda: body(inp, out, handle, "sum"), [inp, out], async_op, [output])

    @_unseen_by_autograd
    def all_to_all(self, output_tensor_list, input_tensor_list, async_op=False):
        """``input_tensor_list[j]`` to rank j, into its ``output_tensor_list[i]`` (i: this rank).  Sizes
        may differ eagerly (the all-to-all with run-time sizes, as all_to_all_single with split
        lists); traced, every tensor of both lists has one size (the equal all-to-all: split sizes
        are host values, which a graph cannot hold)."""
        where = "all_to_all"
        lists = (("output_tensor_list", output_tensor_list), ("input_tensor_list", input_tensor_list))
        for label, tensors in lists:
            if tensors is not None:
                _ops.require_list(where, label, tensors)
            if tensors is None or len(tensors) != self.world_size:
                _ops.fail(f"{where}: {label} holds {0 if tensors is None else len(tensors)} tensors, "
                          f"expected {_ops.shown(self.world_size)} (one per rank)")
            _ops.require_tensors(where, [(f"{label}[{i}]", t) for i, t in enumerate(tensors)])
        dtypes = {t.dtype for t in (*output_tensor_list, *input_tensor_list)}
        if len(dtypes) != 1:
            _ops.fail(f"{where}: the tensors have dtypes {', '.join(sorted(str(d) for d in dtypes))}, expected one")
        fake = _ops.tracing()
        for label, tensors in lists:  # by the caller's names, before the concatenations hide them
            for i, t in enumerate(tensors):
                _ops.check_device(where, f"{label}[{i}]", t, self.device, self.rank, self.world_size, fake=fake)
        flat_in = torch.cat([t.reshape(-1) for t in input_tensor_list])
        if fake:
            _one_size(where, lists)
            flat_out = flat_in.new_empty(flat_in.numel())

            def run():
                self._all_to_all_equal(where, ("output_tensor_list", flat_out), ("input_tensor_list", flat_in), False)
        else:
            flat_out = flat_in.new_empty(sum(t.numel() for t in output_tensor_list))
            sizes = [t.numel() for t in output_tensor_list], [t.numel() for t in input_tensor_list]

            def run():
                self._all_to_all_uneven(where, flat_out, flat_in, *sizes, False,
                                        labels=("output_tensor_list", "input_tensor_list"))
        return self._then(run, lambda: self._split_into(where, flat_out, output_tensor_list),
                          [flat_in, flat_out, *output_tensor_list], async_op, output_tensor_list)

    @_unseen_by_autograd
    def broadcast(self, tensor, src=None, async_op=False, *, group_src=None):
        _ops.require_tensors("broadcast", [("tensor", tensor)])
        src = self._root("broadcast", "src", src, group_src)
        handle = self._handle("broadcast", src)
        (t,) = self._bytes("broadcast", [("tensor", tensor)])
        self._check("broadcast", entry(handle), [("tensor", t)])
        if _ops.tracing():
            x = t if self.rank == src else t.new_empty(0)
            t.copy_(torch.ops.purlin.broadcast_seq(x, self._seq(x), handle, "sum", t.numel()).view(t.shape))
            return _DONE if async_op else None
        body = _ops.define("broadcast").eager_inplace
        return self._issue(lambda: body(t, handle, "sum"), [t], async_op, [tensor])

    @_unseen_by_autograd
    def gather(self, tensor, gather_list=None, dst=None, async_op=False, *, group_dst=None):
        where = "gather"
        _ops.require_tensors(where, [("tensor", tensor)])
        dst = self._root(where, "dst", dst, group_dst)
        self._lists(where, "gather_list", gather_list, tensor, self.rank == dst, "dst")
        handle = self._handle("gather", dst)
        (x,) = self._bytes(where, [("tensor", tensor)])
        self._check(where, entry(handle), [("tensor", x)])
        if _ops.tracing():
            y = torch.ops.purlin.gather_seq(x, self._seq(x), handle, "sum", -1)
            if self.rank == dst:
                self._split_into(where, y, gather_list)
            return _DONE if async_op else None
        body = _ops.define("gather").eager_out
        out = x.new_empty(self.world_size * x.numel() if self.rank == dst else 0)

        def run():
            body(x, out, handle, "sum")
            if self.rank == dst:
                self._split_into(where, out, gather_list)
        return self._issue(run, [x, out, *(gather_list or [])], async_op, gather_list or [])

    @_unseen_by_autograd
    def scatter(self, tensor, scatter_list=None, src=None, async_op=False, *, group_src=None):
        where = "scatter"
        _ops.require_tensors(where, [("tensor", tensor)])
        src = self._root(where, "src", src, group_src)
        self._lists(where, "scatter_list", scatter_list, tensor, self.rank == src, "src")
        handle = self._handle("scatter", src)
        (t,) = self._bytes(where, [("tensor", tensor)])
        self._check(where, entry(handle), [("tensor", t)])

        def source():
            if self.rank != src:
                return t.new_empty(0)
            return torch.cat([_ops.carrier(where, "scatter_list", s.contiguous(), reduce=False).reshape(-1)
                              for s in scatter_list])
        if _ops.tracing():
            t.copy_(torch.ops.purlin.scatter_seq(source(), self._seq(t), handle, "sum", t.numel()).view(t.shape))
            return _DONE if async_op else None
        body = _ops.define("scatter").eager_out
        # under async_op the concatenation is made on the side stream too
        return self._issue(lambda: body(source(), t, handle, "sum"), [t, *(scatter_list or [])], async_op, [tensor])

    # ------------------------------------------------------------------------------- helpers
    def _run(self, body, tensors, async_op: bool, result):
        """A call made of several steps (list forms, uneven all-to-all): in a compiled graph it is
        traced in place; otherwise issued like one collective."""
        if _ops.tracing():
            body()
            return _DONE if async_op else None
        return self._issue(body, tensors, async_op, result)

    def _then(self, first, then, tensors, async_op, result):
        def body():
            first()
            then()
        return self._run(body, tensors, async_op, result)

    @staticmethod
    def _split_into(where, flat, tensors) -> None:
        """Consecutive pieces of the 1-D ``flat`` into ``tensors`` (same dtype, any shape)."""
        if flat.dtype != tensors[0].dtype:
            flat = flat.view(tensors[0].dtype)  # a byte carrier back to the caller's dtype
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view(t.shape))
            offset += t.numel()

    def _splits(self, where, output, input, output_split_sizes, input_split_sizes):
        """``None`` for equal slices of dim 0 (no sizes given), else both lists as ints, each
        checked against its own tensor's rows (sized.host_splits).  Given lists take the
        all-to-all with run-time sizes even where they are equal here: another rank's may not
        be, and every rank must run the same collective."""
        from purlinc.torch import sized

        read = [None if sizes is None else _ops.split_sizes(where, label, sizes, self.world_size)
                for label, sizes in (("output_split_sizes", output_split_sizes),
                                     ("input_split_sizes", input_split_sizes))]  # once: a generator is spent by it
        if not any(read):
            return None
        self._refuse_traced_lists(where, "split size lists")  # first: host_splits' refusals raise, which dynamo cannot
        return tuple(sized.host_splits(where, label, sizes, tensor, t, self.world_size)
                     for label, sizes, tensor, t in (("output_split_sizes", read[0], "output", output),
                                                     ("input_split_sizes", read[1], "input", input)))

    def _refuse_traced_lists(self, where: str, what: str) -> None:
        """Host split lists cannot be graph values: refused while traced (torch.compile,
        FakeTensorMode, make_fx) by name, before anything is exchanged or recorded.  ``require``:
        dynamo reports the message (it cannot trace building an ArgumentError)."""
        _ops.require(not _ops.tracing(),
                     f"{where}: {what} while traced (torch.compile, FakeTensorMode, make_fx); expected all_to_all_vdev "
                     "there, with the split sizes in device tensors (host lists are not graph values)")

    def _all_to_all_uneven(self, where, output, input, out_splits, in_splits, async_op, *, labels=None):
        """Split sizes: the all-to-all with run-time sizes (purlinc.torch.sized), sizes copied to
        the GPU; a dtype Purlin lacks travels as the bytes of each row (ops.carrier).  ``labels``:
        the caller's names of the two lists (default: all_to_all_single's)."""
        from purlinc.torch import sized

        self._require_open(where)
        self._refuse_traced_lists(where, "split size lists")
        out, inp = (_rows_carrier(where, label, t) for label, t in (("output", output), ("input", input)))
        kwargs = {"where": where} if labels is None else {"where": where, "labels": labels}
        return self._run(lambda: sized.all_to_all_single(self, out, inp, out_splits, in_splits, **kwargs),
                         [input, output], async_op, [output])

    @_unseen_by_autograd
    def all_to_all_vdev(self, input, out, in_splits, out_splits, out_offsets=None, async_op=False):
        """All-to-all with split sizes on the GPU (rows of dim 0): ``in_splits`` read and
        ``out_splits`` (and ``out_offsets``) written by the kernel, no host synchronisation;
        like ``torch.distributed._symmetric_memory.all_to_all_vdev`` (purlinc.torch.sized)."""
        from purlinc.torch import sized

        self._require_open("all_to_all_vdev")
        named = [("input", input), ("out", out), ("in_splits", in_splits), ("out_splits", out_splits)]
        _ops.require_tensors("all_to_all_vdev", named + [("out_offsets", out_offsets)] * (out_offsets is not None))
        if _ops.tracing():  # the state and the ops exist already (Group.__init__, sized's import)
            # the tensors' checks by the caller's names before the op is recorded, as the other
            # calls make theirs: the fake's would name its own arguments, inside torch's error
            # (the meta tensors of shape inference pass the device check, as in the fakes)
            where, state = "all_to_all_vdev", self._sized_state
            sized._check(where, state, input, out, fake=True)
            sized._check_splits(where, state, input, [("in_splits", in_splits), ("out_splits", out_splits)])
            # out_offsets is written here, not by the op, so its fake does not see it: the eager
            # call's checks of it, made at trace time (a compiled call cast it, or wrote it over
            # out_splits where the two shared memory)
            sized.check_offsets("all_to_all_vdev", self._sized_state, input, out, in_splits, out_splits, out_offsets)
            # the ordered form: it "writes" the communicator's sequence tensor, as the other
            # collectives' NAME_seq ops do, so no compiler drops it or moves it past them
            torch.ops.purlin.alltoallv_seq(input, in_splits, out, out_splits, self._seq(input),
                                          self._sized_state.handle)
            if out_offsets is not None:
                out_offsets.copy_(torch.cumsum(out_splits, 0) - out_splits)
            return _DONE if async_op else None
        tensors = [input, out, in_splits, out_splits] + ([out_offsets] if out_offsets is not None else [])
        return self._issue(lambda: sized.all_to_all_vdev(self, input, out, in_splits, out_splits, out_offsets),
                           tensors, async_op, [out])

    def _split_table(self, in_splits) -> list[list[int]]:
        """Every rank's input split sizes, by rank: an all-gather of R int32 per rank (what a
        caller that does not know its output split sizes needs on the host to size its output)."""
        mine = torch.tensor(in_splits, dtype=torch.int32, device=self.device)
        table = mine.new_empty(self.world_size * self.world_size)
        self.all_gather_into_tensor(table, mine)
        return table.view(self.world_size, self.world_size).tolist()

    @staticmethod
    def _same_dtype(where, a, b, la, lb):
        _ops.require(a.dtype == b.dtype, f"{where}: {la} has dtype {str(a.dtype).removeprefix('torch.')}, expected "
                                     f"{str(b.dtype).removeprefix('torch.')} (the dtype of {lb})")

    def _list_like(self, where, label, tensors, tensor):
        if tensors is not None:
            _ops.require_list(where, label, tensors)
        if tensors is None or len(tensors) != self.world_size:
            got = "None" if tensors is None else f"{len(tensors)} tensors"
            _ops.fail(f"{where}: {label} must hold {_ops.shown(self.world_size)} tensors (one per rank), got {got}")
        _ops.require_tensors(where, [(f"{label}[{i}]", t) for i, t in enumerate(tensors)])
        for i, t in enumerate(tensors):
            if t.numel() != tensor.numel() or t.dtype != tensor.dtype or t.device != tensor.device:
                _ops.fail(f"{where}: {label}[{i}] is {str(t.dtype).removeprefix('torch.')} x {_ops.shown(t.numel())} "
                          f"on {t.device}, expected {str(tensor.dtype).removeprefix('torch.')} x "
                          f"{_ops.shown(tensor.numel())} on {tensor.device} (like tensor)")

    def _lists(self, where, label, tensors, tensor, is_root, root_label):
        if tensors is not None:
            _ops.require_list(where, label, tensors)
        if not is_root:
            if tensors:
                _ops.fail(f"{where}: {label} must be None or empty on ranks other than {root_label}; "
                          f"rank {_ops.shown(self.rank)} got {len(tensors)} tensors")
            return
        if tensors is None or len(tensors) != self.world_size:
            got = "None" if tensors is None else f"{len(tensors)} tensors"
            _ops.fail(f"{where}: {label} on the {root_label} rank must hold {_ops.shown(self.world_size)} tensors "
                      f"(one per rank), got {got}")
        self._list_like(where, label, tensors, tensor)


def _global_ranks(ranks, world_size: int) -> list[int]:
    """``ranks=`` as distinct ints >= 0: int() would cut 0.5 to 0, and a repeated rank would
    make src= name two members."""
    try:
        given = list(ranks)  # once: a generator would be empty when the message lists it
    except TypeError:
        given = None
    try:
        values = None if given is None else [_rank_number("Group", "ranks", r) for r in given]
    except ArgumentError:
        values = None
    if values is None or min(values, default=0) < 0 or len(set(values)) != len(values):
        shown = ranks if given is None else given
        raise ArgumentError(f"Group: ranks={shown!r}, expected {world_size} distinct global ranks (ints >= 0)")
    return values


def _rank_number(where: str, label: str, value) -> int:
    """A root (``src``, ``group_dst``, ...) as an int, from any integer type (NumPy's, a 0-d
    integer tensor): a bool or a float is no rank (True and 1.0 would run as rank 1)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value  # the common case, and all that a compiled graph's constants need
    if _ops.may_be_integer(value):  # a float is refused without integer(), which a trace cannot take
        try:
            return integer(value)
        except TypeError:
            pass
    _ops.fail(f"{where}: {label}={_ops.value_shown(value)}, expected an int (a rank)")


def _one_size(where: str, lists) -> None:
    """Traced, the list form of all_to_all runs the equal all-to-all: every tensor of both lists
    (``(label, tensors)`` pairs) has one size, or the call is refused in the list form's terms."""
    n = lists[1][1][0].numel()
    same = True
    for _, tensors in lists:
        for t in tensors:
            if t.numel() != n:
                same = False

    def message():
        held = "; ".join(f"{label} holds tensors of {_numels_shown(tensors)} elements" for label, tensors in lists)
        return (f"{where}: {held}; while traced (torch.compile, FakeTensorMode, make_fx) expected one size for every "
                "tensor of both lists (unequal sizes are split sizes, host values a graph cannot hold: use "
                "all_to_all_vdev, with the split sizes in device tensors)")
    _ops.require(same, message)


def _ranks_shown(ranks) -> str:
    """A group's global ranks for a message, as a list prints them, of plain ints (ops.shape_shown
    says why: under dynamic=True dynamo reads them as symbols, which it cannot format)."""
    return _ops.ints_shown(list(ranks), "[]")


def _numels_shown(tensors) -> str:
    """The tensors' element counts for a message, as plain ints (ops.shape_shown says why)."""
    return _ops.ints_joined(t.numel() for t in tensors)


def _rows_carrier(where: str, label: str, t):
    """``t`` itself, or its bytes as a Purlin dtype (ops.carrier) shaped [rows, elements per row]."""
    c = _ops.carrier(where, label, t, reduce=False)
    if c is t:
        return t
    rows = t.shape[0] if t.dim() else 1
    return c.view(rows, c.numel() // rows if rows else (math.prod(t.shape[1:]) * t.element_size()) // c.element_size())


def _link_inverses(group: Group) -> None:
    for kind, inverse in _ops.INVERSES.items():
        group.entry(kind).inverse = group._handle(inverse)
