"""Purlin as a torch.distributed backend: ``dist.init_process_group("cuda:purlin,cpu:gloo")``.

``import purlinc.torch`` registers the backend ``purlin`` (``dist.Backend.register_backend``).
Its process groups are :class:`PurlinProcessGroup`, a ``torch.distributed.ProcessGroup`` written
in Python, so unmodified torch.distributed code runs on it: ``dist.all_reduce``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``, ``broadcast``,
``reduce``, ``gather``, ``scatter``, ``barrier``, the list forms, and ``dist.new_group(backend=...)``.

What Purlin runs, and what it hands on:

- Purlin runs every call whose tensors are on the backend's device (CUDA), contiguous, one tensor
  per list (an all_gather's or reduce_scatter's list of tensors the size of the other side), with
  a dtype it moves (copies: any fixed-size dtype, as bytes; reductions: its reducible dtypes) and
  a reduction it has (SUM, AVG, PRODUCT, MIN, MAX).
- Everything else goes to the *fallback* of the tensor's device: the backend the string names
  for that device (``cpu:gloo``), else NCCL for CUDA and gloo for the CPU; point-to-point calls
  (send, recv) always.  Each kind of hand-over is said once in the log (``PURLIN_DEBUG=INFO``).

torch creates a Python process group for the first device of the backend string and uses it for
every device, so this group owns its fallbacks: each is made with the group (a collective of its
members, like the group itself) over its own key space in the group's store, and registered as
the group's backend for its device.  So the group has a name (torch keeps it in the backends),
and what torch builds on process groups works on it: ``_functional_collectives`` (eagerly they
reach this class, and Purlin; traced by ``torch.compile`` they reach the registered backends
through torch's dispatcher, so they run on the fallback), DeviceMesh, DTensor.  The Purlin
communicator comes on the first call (:mod:`purlinc.torch.groups`, over the group's
own store, cached per group).  Work objects are torch's (:class:`purlinc.torch.distributed.Work`).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from purlinc.log import get as _get_log
from purlinc.runtime.errors import ArgumentError
from purlinc.torch import groups
from purlinc.torch import ops as _ops

NAME = "purlin"
log = _get_log("torch")

# the fallback of a device when the backend string names none for it
DEFAULT_FALLBACKS = {"cuda": "nccl", "cpu": "gloo"}


class PurlinProcessGroup(dist.ProcessGroup):
    """One rank's view of a process group whose collectives run on Purlin (see the module)."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta, *, group_name: str = "",
                 device_type: str = "cuda", fallbacks: dict[str, str] | None = None):
        super().__init__(rank, size)
        self._store, self._timeout = store, timeout
        self.device_type = device_type
        self._fallback_names = dict(fallbacks or DEFAULT_FALLBACKS)
        self._fallbacks: dict[str, object] = {}
        self._told: set[tuple[str, str]] = set()
        for device in self._fallback_names:  # made now: torch keeps a group's name in its backends
            if device != "cuda" or torch.cuda.is_available():
                backend = self._fallbacks[device] = self._make_fallback(device)
                kind = getattr(dist.ProcessGroup.BackendType, self._fallback_names[device].upper())
                self._register_backend(torch.device(device), kind, backend)
        if group_name:
            self._set_group_name(group_name)

    def __repr__(self) -> str:
        return f"PurlinProcessGroup(rank {self.rank()} of {self.size()}, {self.device_type})"

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NAME

    def name(self) -> str:
        return NAME

    def purlin_group(self):
        """The Purlin Group of this process group (made on first use by every member, then cached)."""
        return groups.for_process_group(self)

    def shutdown(self) -> None:
        """What ``destroy_process_group`` calls: release the Purlin communicator made for this
        group and shut the fallbacks down."""
        groups.forget(self)
        for fallback in self._fallbacks.values():
            stop = getattr(fallback, "shutdown", None)
            if stop is not None:
                stop()
        self._fallbacks.clear()

    # ------------------------------------------------------------------------------ choosing
    def _purlin_takes(self, tensors, *, reduce_op=None, reduce=False) -> str | None:
        """``None`` when Purlin runs a call on ``tensors``, else why not (for the log)."""
        for t in tensors:
            if t.device.type != self.device_type:
                return f"a tensor on {t.device.type}"
            if not t.is_contiguous():
                return "a non-contiguous tensor"
            dtype = _ops.dtype_of(t)
            if reduce and (dtype is None or not dtype.reducible):
                return f"a reduction of {str(t.dtype).removeprefix('torch.')}"
            if not reduce and dtype is None and _ops._carrier_width(t.element_size()) is None:
                return f"dtype {str(t.dtype).removeprefix('torch.')}"
        if reduce_op is not None:
            try:
                op = _ops.normalize_op(reduce_op, "purlin backend")
            except ArgumentError:
                return f"op {getattr(reduce_op, 'op', reduce_op)}"
            if op == "avg" and any(not t.is_floating_point() for t in tensors):
                return "AVG of integers"
        return None

    def _fallback(self, call: str, tensors, why: str, device: str | None = None):
        """The fallback backend of these tensors' device (or of ``device``, for a call without
        tensors), made on first use; says so once per (call, why)."""
        device = device or (tensors[0].device.type if tensors else self.device_type)
        backend = self._fallbacks.get(device)
        if backend is None:
            backend = self._fallbacks[device] = self._make_fallback(device)
        if (call, why) not in self._told:
            self._told.add((call, why))
            log.info("process group %s: %s with %s goes to %s (Purlin does not take it)", self._label(), call, why,
                     self._fallback_names.get(device, "?"))
        return backend

    def _make_fallback(self, device: str):
        name = self._fallback_names.get(device)
        store = dist.PrefixStore(f"purlin-fallback/{device}/", self._store)
        if name == "gloo":
            return dist.ProcessGroupGloo(store, self.rank(), self.size(), self._timeout)
        if name == "nccl":
            if not hasattr(dist, "ProcessGroupNCCL"):  # a CPU build of torch: torch's AttributeError said nothing
                raise ArgumentError(f"purlin backend: the fallback for tensors on {device} is nccl, which this torch "
                                    "lacks (built without NCCL)",
                                    notes=("name another in the backend string, e.g. 'cuda:purlin,cpu:gloo', or use a "
                                           "torch built with CUDA",))
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self._timeout
            return dist.ProcessGroupNCCL(store, self.rank(), self.size(), options)
        raise ArgumentError(f"purlin backend: no fallback for tensors on {device} (got {name!r}); expected gloo "
                            f"or nccl", notes=("name it in the backend string, e.g. 'cuda:purlin,cpu:gloo'",))

    def _label(self) -> str:
        try:
            return self.group_name
        except RuntimeError:
            return f"@{id(self):x}"

    @staticmethod
    def _root(opts) -> int:
        return int(opts.rootRank)

    # ------------------------------------------------------------------------------ reductions
    def allreduce(self, tensors, opts):
        why = "several tensors" if len(tensors) != 1 else self._purlin_takes(tensors, reduce_op=opts.reduceOp,
                                                                              reduce=True)
        if why:
            return self._fallback("allreduce", tensors, why).allreduce(tensors, opts)
        return self.purlin_group().all_reduce(tensors[0], op=opts.reduceOp, async_op=True)

    def reduce(self, tensors, opts):
        why = "several tensors" if len(tensors) != 1 else self._purlin_takes(tensors, reduce_op=opts.reduceOp,
                                                                              reduce=True)
        if why:
            return self._fallback("reduce", tensors, why).reduce(tensors, opts)
        return self.purlin_group().reduce(tensors[0], op=opts.reduceOp, async_op=True, group_dst=self._root(opts))

    def _reduce_scatter_base(self, output, input, opts):
        why = self._purlin_takes([output, input], reduce_op=opts.reduceOp, reduce=True)
        if why:
            return self._fallback("reduce_scatter_tensor", [input], why)._reduce_scatter_base(output, input, opts)
        return self.purlin_group().reduce_scatter_tensor(output, input, op=opts.reduceOp, async_op=True)

    reduce_scatter_single = _reduce_scatter_base  # the name newer torch calls

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        flat = [t for ts in input_tensors for t in ts]
        why = "several tensors" if len(output_tensors) != 1 else (
            _unequal_sizes(flat, output_tensors[0])
            or self._purlin_takes([*output_tensors, *flat], reduce_op=opts.reduceOp, reduce=True))
        if why:
            return self._fallback("reduce_scatter", output_tensors, why).reduce_scatter(output_tensors, input_tensors,
                                                                                         opts)
        return self.purlin_group().reduce_scatter(output_tensors[0], input_tensors[0], op=opts.reduceOp,
                                                  async_op=True)

    # ------------------------------------------------------------------------------ copies
    def broadcast(self, tensors, opts):
        why = "several tensors" if len(tensors) != 1 else self._purlin_takes(tensors)
        if why:
            return self._fallback("broadcast", tensors, why).broadcast(tensors, opts)
        return self.purlin_group().broadcast(tensors[0], async_op=True, group_src=self._root(opts))

    def _allgather_base(self, output, input, opts):
        why = self._purlin_takes([output, input])
        if why:
            return self._fallback("all_gather_into_tensor", [input], why)._allgather_base(output, input, opts)
        return self.purlin_group().all_gather_into_tensor(output, input, async_op=True)

    all_gather_single = _allgather_base  # the name newer torch calls

    def allgather(self, output_tensors, input_tensors, opts):
        flat = [t for ts in output_tensors for t in ts]
        why = "several tensors" if len(input_tensors) != 1 else (
            _unequal_sizes(flat, input_tensors[0]) or self._purlin_takes([*input_tensors, *flat]))
        if why:
            return self._fallback("all_gather", input_tensors, why).allgather(output_tensors, input_tensors, opts)
        return self.purlin_group().all_gather(output_tensors[0], input_tensors[0], async_op=True)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):
        why = self._purlin_takes([output, input])
        if why:
            return self._fallback("all_to_all_single", [input], why).alltoall_base(
                output, input, output_split_sizes, input_split_sizes, opts)
        return self.purlin_group().all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                                     async_op=True)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):  # newer torch's name
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall(self, output_tensors, input_tensors, opts):
        why = self._purlin_takes([*output_tensors, *input_tensors])
        if why:
            return self._fallback("all_to_all", input_tensors, why).alltoall(output_tensors, input_tensors, opts)
        return self.purlin_group().all_to_all(output_tensors, input_tensors, async_op=True)

    def gather(self, output_tensors, input_tensors, opts):
        flat = [t for ts in output_tensors for t in ts]
        why = "several tensors" if len(input_tensors) != 1 else self._purlin_takes([*input_tensors, *flat])
        if why:
            return self._fallback("gather", input_tensors, why).gather(output_tensors, input_tensors, opts)
        return self.purlin_group().gather(input_tensors[0], output_tensors[0] if output_tensors else None,
                                          async_op=True, group_dst=self._root(opts))

    def scatter(self, output_tensors, input_tensors, opts):
        flat = [t for ts in input_tensors for t in ts]
        why = "several tensors" if len(output_tensors) != 1 else self._purlin_takes([*output_tensors, *flat])
        if why:
            return self._fallback("scatter", output_tensors, why).scatter(output_tensors, input_tensors, opts)
        return self.purlin_group().scatter(output_tensors[0], input_tensors[0] if input_tensors else None,
                                           async_op=True, group_src=self._root(opts))

    # ------------------------------------------------------------------------------ the rest
    def barrier(self, opts):
        if self.device_type == "cuda" and not torch.cuda.is_available():
            # no device for Purlin's all-reduce, nor for NCCL (a CPU build of torch has none: its
            # AttributeError was the barrier's result): the CPU fallback holds it, as on gloo
            return self._fallback("barrier", [], "no CUDA device", device="cpu").barrier(opts)
        self.purlin_group().barrier()  # blocks the host until every rank's all-reduce is done
        from purlinc.torch.distributed import Work

        return Work()

    def send(self, tensors, dst, tag=0):
        return self._fallback("send", tensors, "point-to-point").send(tensors, dst, tag)

    def recv(self, tensors, src, tag=0):
        return self._fallback("recv", tensors, "point-to-point").recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag=0):
        return self._fallback("recv", tensors, "point-to-point").recv_anysource(tensors, tag)

    def allreduce_coalesced(self, tensors, opts):
        return self._fallback("allreduce_coalesced", tensors, "coalesced tensors").allreduce_coalesced(tensors, opts)


def _unequal_sizes(tensors, like) -> str | None:
    """Why Purlin does not take a list form whose tensors differ in size from ``like`` (the
    all-gather's input, the reduce-scatter's output), or None.  NCCL runs such lists (as
    broadcasts or reduces), so they go to the fallback: Purlin's list forms, one equal chunk
    per rank, refused them with an ArgumentError where an NCCL group ran them."""
    for t in tensors:
        if t.numel() != like.numel():
            return "tensors of unequal sizes"
    return None


groups.releases_itself(PurlinProcessGroup)  # its shutdown forgets what Purlin made for it


def create(device_type: str = "cuda", fallbacks: dict[str, str] | None = None):
    """The creator function ``register_backend`` takes (torch's extended API: it names the group)."""
    def creator(options, backend_options=None):
        return PurlinProcessGroup(options.store, options.group_rank, options.group_size, options.timeout,
                                  group_name=options.group_id, device_type=device_type,
                                  fallbacks=fallbacks or DEFAULT_FALLBACKS)
    return creator


def register(name: str = NAME, *, device_type: str = "cuda", fallbacks: dict[str, str] | None = None) -> str:
    """Register the backend ``name`` (done for ``purlin`` on ``import purlinc.torch``); returns the name.

    ``device_type``: the device whose tensors Purlin runs (tests use ``"cpu"`` with a stand-in);
    ``fallbacks``: device type -> the torch backend that takes what Purlin does not (default NCCL for
    CUDA, gloo for the CPU).  Registering a name twice is refused by torch, so an existing one is kept."""
    if hasattr(dist.Backend, name.upper()):
        return name
    dist.Backend.register_backend(name, create(device_type, fallbacks), extended_api=True, devices=["cuda", "cpu"])
    return name
