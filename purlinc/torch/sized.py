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
(its fake implementation says so without a GPU); rows past the received ones are zeros (the
out forms leave them as they were).
The fake implementations check what the real ones check (``_check``, ``_check_splits``).
"""

from __future__ import annotations

import math
import threading
import weakref

import torch

from purlinc.runtime.errors import ArgumentError
from purlinc.torch.ops import (
    check_contiguous, check_device, dtype_of, fail, ints_shown, overlap, require_tensors,
    require_unregistered, reserve, same_device, shape_shown, shown, split_sizes, supported_dtypes,
)
from purlinc.torch.registry import new_handle

SOURCE = "collective alltoallv with sizes n[R][R] of x { in[r] = x[r][0..R]  out[r] = x[0..R][r]  copy }"
DEFAULT_CAPACITY = 1 << 20  # elements per (source, destination) pair: 8 MiB of staging per pair (widest dtype)
NAMESPACE = "purlin"
OPS = ("alltoallv", "alltoallv_out", "alltoallv_seq")
for _op in OPS:  # up front: a user's collective may not take these names (ops.define refuses, naming us)
    reserve(_op, "purlinc.torch.sized's uneven all-to-all (all_to_all_vdev; all_to_all_single with split lists)")


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
    """Set ``group``'s all-to-all capacity (elements per pair) and, for tests, a
    ``loader(source, comm, capacity)`` in place of ``purlinc.load``.  What is given and differs
    from the group's state makes a new state (a new handle), before its first uneven call only;
    after it, a change is refused (the loaded collective is staged for its capacity, and
    another state would load again: a collective) and the same values leave the state as it is.

    ``group`` is a purlinc.torch.Group: for a torch ProcessGroup, the one ``group_of(pg)`` names
    (the Group its calls run on).  Anything else is refused by name: a ProcessGroup's missing
    world_size was an AttributeError.  (This module cannot call group_of itself: the groups
    module imports the Group calls, which import this one.)"""
    _require_group(group)
    state = _BY_GROUP.get(group)
    if capacity is not None:
        capacity = _check_capacity_value(capacity)
    if state is not None:
        changes = [f"{label}={value!r} (it has {current!r})" for label, value, current in
                   (("capacity", capacity, state.capacity), ("loader", loader, state._loader))
                   if value is not None and value != current]
        if not changes:
            return state
        if state._collective is not None:
            raise ArgumentError(f"sized.configure: {', '.join(changes)} after the first uneven all-to-all of {group}, "
                                f"which loaded it with capacity {state.capacity}; expected configure(...) before "
                                "that call (or the same values, which change nothing)")
        state.close()
    cap = capacity if capacity is not None else state.capacity if state is not None else DEFAULT_CAPACITY
    state = _BY_GROUP[group] = SizedState(group, cap, loader or (state._loader if state else None))
    group._sized_state = state  # what a compiled graph reads (an attribute: a constant to dynamo)
    return state


def _require_group(group) -> None:
    """``group`` a purlinc.torch.Group (what the uneven calls hold a state for), told by what
    a state reads of it; a ProcessGroup or anything else refused, saying how to get one."""
    if not all(hasattr(group, attr) for attr in ("rank", "world_size", "device", "comm")):
        raise ArgumentError(f"sized.configure: group={group!r}, expected a purlinc.torch.Group",
                            notes=("for a torch ProcessGroup (dist.group.WORLD, new_group's, the purlin backend's): "
                                   "sized.configure(purlinc.torch.group_of(pg), capacity=...), on every member",))


def _check_capacity_value(capacity) -> int:
    """``capacity`` as an int: any integer type but a bool (a NumPy one too, as load takes it)."""
    from purlinc.runtime.validate import integer

    try:
        value = integer(capacity)
    except TypeError:
        value = 0
    if value < 1:
        raise ArgumentError(f"sized.configure: capacity={capacity!r}, expected a positive number of elements per "
                            "(source, destination) pair")
    return value


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


def _row_elements(where: str, x, label: str = "input") -> int:
    """``_rows(x)`` of a tensor whose rows hold something: rows of no elements are refused (split
    sizes would count rows that carry nothing, and the capacity in rows has no answer)."""
    row = _rows(x)
    if row == 0:
        fail(f"{where}: {label} has rows of 0 elements (shape {shape_shown(x)}); expected rows of at least one "
             "element")
    return row


def _check_data(where: str, s: SizedState, x, out, *, fake: bool = False) -> None:
    """The data tensors' kind, device, dtype and layout, in every form alike; ``fake``: meta
    tensors pass the device check (shape inference only).  ``fail``: a traced all_to_all_vdev
    checks these before it records the op, under dynamo too."""
    require_tensors(where, [("input", x), ("output", out)])
    for label, t in (("input", x), ("output", out)):
        check_device(where, label, t, s.device, s.rank, s.world_size, fake=fake)
        if dtype_of(t) is None:  # the registry's dtypes: what dtype_of accepts, so the message cannot drift
            fail(f"{where}: {label} has dtype {str(t.dtype).removeprefix('torch.')}, which Purlin does not support; "
                 f"expected one of {supported_dtypes()}",
                 notes=("all_to_all_single with split lists carries other fixed-size dtypes as bytes",))
        check_contiguous(where, label, t)
    same_device(where, (("input", x), ("output", out)))
    if out.dtype != x.dtype:
        fail(f"{where}: output has dtype {str(out.dtype).removeprefix('torch.')}, expected "
             f"{str(x.dtype).removeprefix('torch.')} (the dtype of input)")


def _row_within_capacity(where: str, s: SizedState, label: str, row: int) -> None:
    if row > s.capacity:
        fail(f"{where}: a row of {label} has {shown(row)} elements, more than the capacity {shown(s.capacity)} "
             "(elements per pair)", notes=("purlinc.torch.sized.configure(group, capacity=...)",))


def _check(where: str, s: SizedState, x, out, *, fake: bool = False) -> int:
    """The device form's tensors (split sizes on the GPU count rows of one shape, input's), in
    the real and the fake implementations alike: ``_check_data``, then the rows."""
    _check_data(where, s, x, out, fake=fake)
    for label, t in (("input", x), ("output", out)):
        if t.dim() == 0:  # as the equal all-to-all refuses one: split sizes count rows of a dim 0 it lacks
            fail(f"{where}: {label} is 0-d (a scalar); expected a tensor of at least one dimension (split sizes "
                 "count rows of dim 0)")
    row = _row_elements(where, x)
    # 1-D against 2-D too: rows of 2 elements into a flat out were read back as rows of one
    if tuple(out.shape[1:]) != tuple(x.shape[1:]):
        fail(f"{where}: output rows have shape {ints_shown(out.shape[1:])}, expected {ints_shown(x.shape[1:])} "
             "(those of input)")
    _row_within_capacity(where, s, "input", row)
    return row


def _check_apart(where: str, written, read, *, fake: bool) -> None:
    """Every tensor the call writes (``(label, tensor)``; None: not given) apart in memory from
    every other it reads or writes: the kernel reads input and in_splits while it writes out and
    out_splits (the same tensor as both was accepted)."""
    written = [(label, t) for label, t in written if t is not None]
    others = written + [(label, t) for label, t in read if t is not None]
    for n, (label, t) in enumerate(written):
        for other, u in others[n + 1:]:
            if overlap(t, u, fake=fake):
                raise ArgumentError(f"{where}: {label} overlaps {other} in memory, expected a tensor of its own",
                                    notes=(f"the call writes {label} while it reads or writes {other}",))


def _check_splits(where: str, s: SizedState, x, named) -> None:
    """Split tensors (``(label, tensor)``; None: not given): int64, R entries, on x's device, contiguous.
    One check for the real and the fake implementations, and for a traced call (``fail``: an
    ArgumentError, under dynamo the RuntimeError it can trace)."""
    named = [(label, t) for label, t in named if t is not None]
    require_tensors(where, named)
    for label, t in named:  # 1-D: a [1, R] tensor has R entries, but is no list of R sizes
        if t.dtype != torch.int64 or t.dim() != 1 or t.numel() != s.world_size or t.device != x.device:
            fail(f"{where}: {label} must be 1-D int64 with {shown(s.world_size)} entries on {x.device}, got "
                 f"{str(t.dtype).removeprefix('torch.')} {shape_shown(t)} on {t.device}")
        if not t.is_contiguous():  # the runtime reads them as one int64 array (an int64 view stays 8-byte aligned)
            fail(f"{where}: {label} must be contiguous, got strides {ints_shown(t.stride())}")


def _capturing(t) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def run(s: SizedState, x, splits, out, out_splits, row: int, expected=None) -> None:
    """Launch on the current stream (every argument checked by the caller); ``expected``: the
    rows the caller expects from each rank (an int64 device tensor), or None."""
    capturing = _capturing(x)
    coll = s.collective(capturing)
    if capturing:
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


def host_splits(where: str, label: str, sizes, tensor: str, t, world_size: int) -> list[int]:
    """One host split list as torch takes it: rows of ``t``'s own dim 0 per rank (``tensor``
    names t), R integers >= 0 summing to its rows; None or empty: equal slices, so t's rows
    must divide by R.  Checked before anything is exchanged, by every form that takes lists,
    so each rank is refused for its own list."""
    R = world_size
    rows = t.shape[0] if t.dim() else t.numel()
    given = None if sizes is None else split_sizes(where, label, sizes, R)
    if not given:
        if rows % R:
            raise ArgumentError(f"{where}: {tensor} has {rows} rows (dim 0) and no {label}; expected a multiple of "
                                f"{R} (one equal slice per rank)")
        return [rows // R] * R
    if len(given) != R or min(given) < 0 or sum(given) != rows:
        raise ArgumentError(f"{where}: {label}={given}, expected {R} sizes >= 0 summing to the {rows} rows (dim 0) "
                            f"of {tensor}")
    return given


def check_capacity(where: str, s: SizedState, label: str, splits: list[int], row: int, *, sending: bool) -> None:
    """Each pair's rows (of ``row`` elements) within the capacity, naming the pair: what this rank
    sends (``sending``) or expects to receive.  Before anything is exchanged, as host_splits."""
    for peer, v in enumerate(splits):
        if v * row > s.capacity:
            pair = f"rank {s.rank} to rank {peer}" if sending else f"rank {peer} to rank {s.rank}"
            raise ArgumentError(f"{where}: {label}[{peer}] = {v} rows ({v * row} elements, {pair}) exceeds the "
                                f"capacity of {s.capacity // row} rows ({s.capacity} elements per pair)",
                                notes=("purlinc.torch.sized.configure(group, capacity=...) before the first call",))


def all_to_all_single(group, output, input, output_split_sizes=None, input_split_sizes=None, *,
                      where: str = "all_to_all_single", labels=("output_split_sizes", "input_split_sizes")):
    """``torch.distributed.all_to_all_single`` with host split lists: each counts rows of its own
    tensor's dim 0, as torch's do (``output`` may hold rows of another shape than ``input``:
    only the elements a pair moves must agree).  Checked on the host against the tensors and
    the capacity, then run through the device form, which also checks ``output_split_sizes``
    against what the peers send: ``output`` is laid out by them, and rows from a peer that
    sends another count than expected are not written but raised as a ``SizeError`` by the
    next call (or ``state_of(group).collective().check()``).  ``where`` and ``labels`` (the
    two lists') name the caller's call and arguments in a refusal (the list form's)."""
    s = state_of(group)
    R = s.world_size
    _check_data(where, s, input, output)

    if overlap(output, input, fake=False):  # in place: read from a copy, as the equal form does (the kernel
        input = input.clone()               # reads input while it writes output)
    in_row, out_row = _row_elements(where, input), _row_elements(where, output, "output")
    _row_within_capacity(where, s, "input", in_row)
    _row_within_capacity(where, s, "output", out_row)
    ins = host_splits(where, labels[1], input_split_sizes, "input", input, R)
    check_capacity(where, s, labels[1], ins, in_row, sending=True)
    outs = host_splits(where, labels[0], output_split_sizes, "output", output, R)
    check_capacity(where, s, labels[0], outs, out_row, sending=False)
    me = s.rank
    if ins[me] * in_row != outs[me] * out_row:  # what this rank sends itself is known here: no need to wait
        raise ArgumentError(f"{where}: {labels[1]}[{me}] = {ins[me]} rows of {in_row} element(s) go to this rank "
                            f"itself, but {labels[0]}[{me}] = {outs[me]} rows of {out_row} expect "
                            f"{outs[me] * out_row} elements", notes=("the rows rank r sends itself are the rows it "
                                                                     "receives from itself",))
    if _capturing(input):
        raise ArgumentError(f"{where}: split lists given while a CUDA graph is captured; a capture cannot copy host "
                            "lists to the GPU", notes=("use all_to_all_vdev with the splits in device tensors (a "
                                                       "replay then sends whatever splits they hold)",))
    # The kernel counts sizes in units of one length: input's rows where output's are alike (so a
    # SizeError names rows), else the largest length that divides both, each list scaled to it.
    unit = math.gcd(in_row, out_row)
    # Fresh tensors per call: a kernel launched earlier may not have read the last ones yet.
    sizes = _on_device([v * (in_row // unit) for v in ins], input)
    expected = _on_device([v * (out_row // unit) for v in outs], input)
    received = s.scratch("received", R, input)  # written by the kernel, never read here
    run(s, input, sizes, output, received, unit, expected)
    return output


def check_offsets(where: str, s: SizedState, x, out, in_splits, out_splits, out_offsets) -> None:
    """What ``all_to_all_vdev`` checks of ``out_offsets``, for a traced call (the op's fake
    checks the rest): a split tensor like the others, and not one of the call's other tensors.
    Dynamo cannot trace a comparison of storages, so a view that overlaps another tensor only
    in part is refused by the eager call alone."""
    if out_offsets is None:
        return
    _check_splits(where, s, x, [("out_offsets", out_offsets)])
    for label, other in (("out_splits", out_splits), ("out", out), ("in_splits", in_splits), ("input", x)):
        if other is out_offsets:
            fail(f"{where}: {label} overlaps out_offsets in memory, expected a tensor of its own",
                 (f"the call writes out_offsets while it reads or writes {label}",))


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
        # zeros, not empty: rows past the received ones are the op's output too, and a functional
        # op's output is a value (AOT and inductor may compute it twice and compare or reuse it)
        out = x.new_zeros((s.world_size * capacity_rows(s, x), *x.shape[1:]))
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

    for op in OPS:
        require_unregistered(op, "purlinc.torch.sized")
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
