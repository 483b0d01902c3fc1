"""All-to-all with run-time sizes from torch (docs/TORCH.md, "Uneven all-to-all"):

    all_to_all_single(group, output, input, output_split_sizes, input_split_sizes)   host lists, as torch
    all_to_all_vdev(group, input, out, in_splits, out_splits, out_offsets=None)      sizes on the GPU

Both run ``SOURCE`` (``examples/sized/alltoallv.pln``), loaded on a group's communicator on
first use with a capacity per (source, destination) pair (``configure``).  Split sizes count
rows of dim 0, as torch's do.  The device form never synchronises with the host: the kernel
reads ``in_splits`` and writes ``out_splits`` (and ``out_offsets``, their exclusive prefix
sums), so a CUDA graph captured once replays with whatever splits the GPU holds, like
``torch.distributed._symmetric_memory.all_to_all_vdev``.

Custom ops (all taking a handle of :func:`handle`):

    purlin::alltoallv(Tensor x, Tensor in_splits, int handle) -> (Tensor out, Tensor out_splits)
    purlin::alltoallv_out(Tensor x, Tensor in_splits, Tensor(a!) out, Tensor(b!) out_splits, int handle) -> ()
    purlin::alltoallv_seq(Tensor x, Tensor in_splits, Tensor(a!) out, Tensor(b!) out_splits, Tensor(c!) seq,
                          int handle) -> ()
        alltoallv_out kept in program order by the communicator's sequence tensor (ops._keep_in_order):
        what a compiled ``all_to_all_vdev`` calls

The functional form's output has the capacity's shape, ``[R * capacity_rows, *x.shape[1:]]``
(its fake implementation says so without a GPU); rows past the received ones are not written.
The fake implementations check what the real ones check (``_check``, ``_check_splits``).
"""

from __future__ import annotations

import math
import threading
import weakref

import torch

from purlinc.runtime.errors import ArgumentError
from purlinc.torch.registry import new_handle

SOURCE = "collective alltoallv with sizes n[R][R] of x { in[r] = x[r][0..R]  out[r] = x[0..R][r]  copy }"
DEFAULT_CAPACITY = 1 << 20  # elements per (source, destination) pair: 8 MiB of staging per pair (widest dtype)
NAMESPACE = "purlin"


class SizedState:
    """One group's uneven all-to-all: its capacity, its loaded collective (on first use), a
    handle for the custom ops, and scratch device tensors for the host-list form."""

    def __init__(self, group, capacity: int, loader):
        self.group_ref = weakref.ref(group)
        self.rank, self.world_size, self.device = group.rank, group.world_size, group.device
        self.comm = group.comm
        self.capacity = capacity
        self._loader = loader
        self._collective = None
        self._scratch: dict = {}
        self.handle = new_handle(("alltoallv", self.world_size, self.rank, capacity, str(self.device)))
        with _LOCK:
            _STATES[self.handle] = self

    def collective(self, capturing: bool = False):
        if self._collective is None:
            if capturing:
                raise ArgumentError(f"purlin::alltoallv on rank {self.rank}: called inside a CUDA graph capture "
                                    "before its warm-up call: expected one call outside the capture first, got none",
                                    notes=("the first call loads the collective (every rank takes part)",))
            group = self.group_ref()
            if self._loader is not None:
                self._collective = self._loader(SOURCE, self.comm, self.capacity)
            elif group is not None and getattr(group, "custom_loader", False):
                self._collective = group._loader(SOURCE, None)  # the group's stand-in loads this one too
            else:
                self._collective = _load(SOURCE, self.comm, self.capacity)
        return self._collective

    def scratch(self, label: str, n: int, like):
        """A reused int64 device tensor (what a graph captured on it keeps reading)."""
        key = (label, n, str(like.device))
        hit = self._scratch.get(key)
        if hit is None:
            hit = self._scratch[key] = torch.zeros(n, dtype=torch.int64, device=like.device)
        return hit

    def close(self) -> None:
        with _LOCK:
            _STATES.pop(self.handle, None)
        if self._collective is not None:
            self._collective.close()
            self._collective = None


_LOCK = threading.Lock()
_STATES: dict[int, SizedState] = {}
_BY_GROUP: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _load(source, comm, capacity):
    import purlinc

    return purlinc.load(source, comm, capacity=capacity)


def configure(group, *, capacity: int | None = None, loader=None) -> SizedState:
    """Set ``group``'s all-to-all capacity (elements per pair; before its first uneven call)
    and, for tests, a ``loader(source, comm, capacity)`` in place of ``purlinc.load``."""
    state = _BY_GROUP.get(group)
    if state is not None and state._collective is not None and capacity not in (None, state.capacity):
        raise ArgumentError(f"the uneven all-to-all of {group} is loaded with capacity {state.capacity}; "
                            f"configure(capacity=...) must come before its first call")
    if state is None or capacity is not None or loader is not None:
        if state is not None:
            state.close()
        cap = capacity if capacity is not None else DEFAULT_CAPACITY
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
            raise ArgumentError(f"capacity={cap!r}, expected a positive number of elements per (source, destination) pair")
        state = _BY_GROUP[group] = SizedState(group, cap, loader or (state._loader if state else None))
        group._sized_state = state  # what a compiled graph reads (an attribute: a constant to dynamo)
    return state


def state_of(group) -> SizedState:
    return _BY_GROUP.get(group) or configure(group)


def state(handle: int) -> SizedState:
    found = _STATES.get(handle)
    if found is None:
        raise ArgumentError(f"no uneven all-to-all has handle {handle}: expected one made by purlinc.torch.sized")
    return found


# ---------------------------------------------------------------------------------------------
# checks and the real call

def _rows(t) -> int:
    """Elements per row of dim 0 (split sizes count rows)."""
    return math.prod(t.shape[1:]) if t.dim() > 1 else 1


def _row_elements(where: str, x) -> int:
    """``_rows(x)`` of an input whose rows hold something: rows of no elements are refused (split
    sizes would count rows that carry nothing, and the capacity in rows has no answer)."""
    row = _rows(x)
    if row == 0:
        raise ArgumentError(f"{where}: input has rows of 0 elements (shape {tuple(x.shape)}); expected rows of at "
                            "least one element")
    return row


def _check(where: str, s: SizedState, x, out, *, fake: bool = False) -> int:
    """The data tensors, in the real and the fake implementations alike; ``fake``: meta tensors
    pass the device check (shape inference only)."""
    from purlinc.torch.ops import check_contiguous, check_device, dtype_of, require_tensors, supported_dtypes

    require_tensors(where, [("input", x), ("output", out)])
    for label, t in (("input", x), ("output", out)):
        check_device(where, label, t, s.device, s.rank, s.world_size, fake=fake)
        if dtype_of(t) is None:  # the registry's dtypes: what dtype_of accepts, so the message cannot drift
            raise ArgumentError(f"{where}: {label} has dtype {str(t.dtype).removeprefix('torch.')}, which Purlin does "
                                f"not support; expected one of {supported_dtypes()}",
                                notes=("all_to_all_single with split lists carries other fixed-size dtypes as bytes",))
        check_contiguous(where, label, t)
    if out.dtype != x.dtype:
        raise ArgumentError(f"{where}: output has dtype {str(out.dtype).removeprefix('torch.')}, expected "
                            f"{str(x.dtype).removeprefix('torch.')} (the dtype of input)")
    row = _row_elements(where, x)
    if x.dim() > 1 and out.dim() > 1 and tuple(out.shape[1:]) != tuple(x.shape[1:]):
        raise ArgumentError(f"{where}: output rows have shape {tuple(out.shape[1:])}, expected {tuple(x.shape[1:])} "
                            "(those of input)")
    if row > s.capacity:
        raise ArgumentError(f"{where}: a row of input has {row} elements, more than the capacity {s.capacity} "
                            "(elements per pair)", notes=("purlinc.torch.sized.configure(group, capacity=...)",))
    return row


def _check_apart(where: str, written, read, *, fake: bool) -> None:
    """Every tensor the call writes (``(label, tensor)``; None: not given) apart in memory from
    every other it reads or writes: the kernel reads input and in_splits while it writes out and
    out_splits (the same tensor as both was accepted)."""
    from purlinc.torch.ops import overlap

    written = [(label, t) for label, t in written if t is not None]
    others = written + [(label, t) for label, t in read if t is not None]
    for n, (label, t) in enumerate(written):
        for other, u in others[n + 1:]:
            if overlap(t, u, fake=fake):
                raise ArgumentError(f"{where}: {label} overlaps {other} in memory, expected a tensor of its own",
                                    notes=(f"the call writes {label} while it reads or writes {other}",))


def _check_splits(where: str, s: SizedState, x, named) -> None:
    """Split tensors (``(label, tensor)``; None: not given): int64, R entries, on x's device, contiguous.
    One check for the real and the fake implementations."""
    from purlinc.torch.ops import require_tensors

    named = [(label, t) for label, t in named if t is not None]
    require_tensors(where, named)
    for label, t in named:
        if t.dtype != torch.int64 or t.numel() != s.world_size or t.device != x.device:
            raise ArgumentError(f"{where}: {label} must be int64 with {s.world_size} entries on {x.device}, got "
                                f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)} on {t.device}")
        if not t.is_contiguous():  # the runtime reads them as one int64 array (an int64 view stays 8-byte aligned)
            raise ArgumentError(f"{where}: {label} must be contiguous, got strides {tuple(t.stride())}")


def _capturing(t) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def run(s: SizedState, x, splits, out, out_splits, row: int, expected=None) -> None:
    """Launch on the current stream (every argument checked by the caller); ``expected``: the
    rows the caller expects from each rank (an int64 device tensor), or None."""
    capturing = _capturing(x)
    coll = s.collective(capturing)
    if capturing:
        from purlinc.torch.ops import dtype_of

        warm = getattr(coll, "_variants", None)
        if warm is not None and dtype_of(x) not in warm:
            raise ArgumentError(f"purlin::alltoallv on rank {s.rank}: {dtype_of(x).value} reached a CUDA graph capture "
                                "before a warm-up call of that dtype: expected one call outside the capture first")
    coll(x, splits, out, out_splits, row=row, expected_sizes=expected)


def _on_device(values: list[int], like):
    """Host sizes as an int64 tensor on ``like``'s device, without waiting for the GPU: torch
    synchronizes the stream after a copy from pageable memory (every call waited for the work
    queued before it), not after a non-blocking one from pinned memory, whose block torch's
    pinned-memory cache keeps until the copy has run."""
    if not like.is_cuda:
        return torch.tensor(values, dtype=torch.int64, device=like.device)
    return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(like.device, non_blocking=True)


def all_to_all_single(group, output, input, output_split_sizes=None, input_split_sizes=None):
    """``torch.distributed.all_to_all_single`` with host split lists (rows of dim 0): checked
    on the host against the tensors and the capacity, then run through the device form, which
    also checks ``output_split_sizes`` against what the peers send: ``output`` is laid out by
    them, and rows from a peer that sends another count than expected are not written but
    raised as a ``SizeError`` by the next call (or ``state_of(group).collective().check()``)."""
    from purlinc.torch.ops import split_sizes

    where = "all_to_all_single"
    s = state_of(group)
    R = s.world_size
    row = _check(where, s, input, output)
    _check_apart(where, [("output", output)], [("input", input)], fake=False)  # as the device form does
    splits = {}
    for label, given, t in (("input_split_sizes", input_split_sizes, input), ("output_split_sizes", output_split_sizes, output)):
        rows = t.shape[0] if t.dim() else t.numel()
        given = None if given is None else split_sizes(where, label, given, R)
        if not given:
            if rows % R:
                raise ArgumentError(f"{where}: {label} not given, so {rows} rows must split evenly over {R} ranks")
            given = [rows // R] * R
        if len(given) != R or any(v < 0 for v in given) or sum(given) != rows:
            raise ArgumentError(f"{where}: {label}={given}, expected {R} sizes >= 0 summing to the {rows} rows of "
                                f"{label.split('_')[0]}")
        big = [(peer, v) for peer, v in enumerate(given) if v * row > s.capacity]
        if big:
            peer, v = big[0]
            pair = f"rank {s.rank} to rank {peer}" if label.startswith("input") else f"rank {peer} to rank {s.rank}"
            raise ArgumentError(f"{where}: {label}[{peer}] = {v} rows ({v * row} elements, {pair}) exceeds the "
                                f"capacity of {s.capacity // row} rows ({s.capacity} elements per pair)",
                                notes=("purlinc.torch.sized.configure(group, capacity=...) before the first call",))
        splits[label] = given
    if _capturing(input):
        raise ArgumentError(f"{where}: split lists given while a CUDA graph is captured; a capture cannot copy host "
                            "lists to the GPU", notes=("use all_to_all_vdev with the splits in device tensors (a "
                                                       "replay then sends whatever splits they hold)",))
    # Fresh tensors per call: a kernel launched earlier may not have read the last ones yet.
    sizes = _on_device(splits["input_split_sizes"], input)
    expected = _on_device(splits["output_split_sizes"], input)
    received = s.scratch("received", R, input)  # written by the kernel, never read here
    run(s, input, sizes, output, received, row, expected)
    return output


def all_to_all_vdev(group, input, out, in_splits, out_splits, out_offsets=None):
    """Sizes on the GPU: ``in_splits`` (int64 [R], rows to each rank) is read by the kernel,
    ``out_splits`` (int64 [R], rows from each rank) written by it, and ``out_offsets`` (if
    given) set to their exclusive prefix sums, all on the current stream; ``out`` receives the
    rows packed by source.  Nothing here reads a size on the host."""
    where = "all_to_all_vdev"
    s = state_of(group)
    row = _check(where, s, input, out)
    _check_splits(where, s, input, [("in_splits", in_splits), ("out_splits", out_splits), ("out_offsets", out_offsets)])
    _check_apart(where, [("out", out), ("out_splits", out_splits), ("out_offsets", out_offsets)],
                 [("input", input), ("in_splits", in_splits)], fake=False)
    run(s, input, in_splits, out, out_splits, row)
    if out_offsets is not None:
        torch.cumsum(out_splits, 0, out=out_offsets)
        out_offsets.sub_(out_splits)
    return out


# ---------------------------------------------------------------------------------------------
# custom ops

_DEFINED: list = []


def capacity_rows(s: SizedState, x, where: str = "purlin::alltoallv") -> int:
    """Rows of ``x``'s shape that the capacity holds per pair."""
    return s.capacity // _row_elements(where, x)


def define():
    """``purlin::alltoallv``, ``purlin::alltoallv_out`` and ``purlin::alltoallv_seq`` (defined once
    per process); returns the first two."""
    if _DEFINED:
        return _DEFINED[0]

    def functional(x, in_splits, handle):
        s = state(handle)
        out = x.new_empty((s.world_size * capacity_rows(s, x), *x.shape[1:]))
        out_splits = in_splits.new_empty(s.world_size)
        all_to_all_vdev(s.group_ref(), x, out, in_splits, out_splits)
        return out, out_splits

    def functional_fake(x, in_splits, handle):
        s = state(handle)
        _check("purlin::alltoallv", s, x, x, fake=True)
        _check_splits("purlin::alltoallv", s, x, [("in_splits", in_splits)])
        return x.new_empty((s.world_size * capacity_rows(s, x), *x.shape[1:])), in_splits.new_empty(s.world_size)

    def out_form(x, in_splits, out, out_splits, handle):
        all_to_all_vdev(state(handle).group_ref(), x, out, in_splits, out_splits)

    def check_out_form(where, x, in_splits, out, out_splits, handle):
        s = state(handle)
        _check(where, s, x, out, fake=True)
        _check_splits(where, s, x, [("in_splits", in_splits), ("out_splits", out_splits)])
        _check_apart(where, [("out", out), ("out_splits", out_splits)], [("input", x), ("in_splits", in_splits)],
                     fake=True)

    def out_fake(x, in_splits, out, out_splits, handle):
        check_out_form("purlin::alltoallv_out", x, in_splits, out, out_splits, handle)

    def sequenced(x, in_splits, out, out_splits, seq, handle):  # seq is only "written": the order is the point
        out_form(x, in_splits, out, out_splits, handle)

    def sequenced_fake(x, in_splits, out, out_splits, seq, handle):
        check_out_form("purlin::alltoallv_seq", x, in_splits, out, out_splits, handle)

    ops = []
    for suffix, fn, fake, schema, mutates in (
        ("", functional, functional_fake, "(Tensor x, Tensor in_splits, int handle) -> (Tensor, Tensor)", ()),
        ("_out", out_form, out_fake,
         "(Tensor x, Tensor in_splits, Tensor(a!) out, Tensor(b!) out_splits, int handle) -> ()", ("out", "out_splits")),
        ("_seq", sequenced, sequenced_fake,
         "(Tensor x, Tensor in_splits, Tensor(a!) out, Tensor(b!) out_splits, Tensor(c!) seq, int handle) -> ()",
         ("out", "out_splits", "seq")),
    ):
        custom = torch.library.custom_op(f"{NAMESPACE}::alltoallv{suffix}", fn, mutates_args=mutates, schema=schema)
        custom.register_fake(fake)
        overload = getattr(torch.ops.purlin, "alltoallv" + suffix).default
        torch.fx.node.has_side_effect(overload)  # a collective: every rank must make the call
        ops.append(overload)
    _DEFINED.append(tuple(ops[:2]))  # (the _seq op is reached as torch.ops.purlin.alltoallv_seq)
    return _DEFINED[0]


define()  # registered on import, outside any trace (a custom op cannot be made while dynamo traces)
