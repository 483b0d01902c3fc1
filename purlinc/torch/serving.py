"""A serving stack's custom all-reduce, on Purlin: the shape of vLLM's ``CustomAllreduce``.

    ar = PurlinAllReduce(group)                 # a torch ProcessGroup (the TP group) or a purlinc.torch.Group
    if ar.should_custom_ar(x):                  # this tensor goes through Purlin
        y = ar.custom_all_reduce(x)             # out of place, on the current stream
    with ar.capture():                          # around the CUDA-graph capture of the model
        ...                                     # (warm-up runs, then the captures)

A serving stack that already has this seam (``should_custom_ar``, ``custom_all_reduce``, a
``capture()`` context, ``close()``, ``disabled``) can hold this object in its place.  Purlin's
own rule for graphs applies: a call of a dtype and size bucket must run once outside a capture
before a capture reaches it.  The warm-up run that serving stacks make before capturing each
batch size does exactly that, so, unlike vLLM's, the warm-up calls here run the real all-reduce
(they compile and load the kernel the capture will record) instead of returning an empty tensor.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from purlinc.runtime.errors import ArgumentError
from purlinc.torch import functional
from purlinc.torch import ops as _ops

DEFAULT_MAX_BYTES = 8 << 20  # vLLM's default bound for its custom all-reduce


class PurlinAllReduce:
    """Out-of-place all-reduce (sum) for tensors up to ``max_bytes`` on one group's device."""

    def __init__(self, group=None, *, max_bytes: int = DEFAULT_MAX_BYTES):
        from purlinc.torch import group_of

        self.group = group_of(group)
        self.max_bytes = _max_bytes(max_bytes)
        self.disabled = False
        self._capturing = False

    def __repr__(self) -> str:
        return f"PurlinAllReduce({self.group!r}, max_bytes={self.max_bytes}{', disabled' if self.disabled else ''})"

    def should_custom_ar(self, inp: torch.Tensor) -> bool:
        """Whether ``custom_all_reduce(inp)`` takes this tensor: the group's device, a dtype Purlin
        reduces, contiguous, a multiple of 16 bytes, under ``max_bytes``."""
        _ops.require_tensors("PurlinAllReduce.should_custom_ar", [("inp", inp)])
        # ops.is_lazy_view, not inp.is_neg(): dynamo cannot trace that (a graph break under fullgraph=True)
        if self.disabled or inp.device != self.group.device or not inp.is_contiguous() or _ops.is_lazy_view(inp):
            return False
        dtype = _ops.dtype_of(inp)
        nbytes = inp.numel() * inp.element_size()
        return dtype is not None and dtype.reducible and nbytes % 16 == 0 and 0 < nbytes <= self.max_bytes

    def custom_all_reduce(self, inp: torch.Tensor) -> torch.Tensor | None:
        """The sum over the group's ranks of ``inp`` as a new tensor, or None when
        ``should_custom_ar(inp)`` is False (the caller then uses its other all-reduce)."""
        if not self.should_custom_ar(inp):
            return None
        return functional.all_reduce(inp, group=self.group)

    def all_reduce(self, inp: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The all-reduce itself, for any size Purlin takes (``out``: where to put it)."""
        if out is None:
            return functional.all_reduce(inp, group=self.group)
        _like("all_reduce", out, inp)
        out.copy_(inp)
        self.group.all_reduce(out)
        return out

    @property
    def capturing(self) -> bool:
        return self._capturing

    @contextmanager
    def capture(self):
        """Around a serving stack's CUDA-graph captures (and their warm-up runs).  Purlin needs no
        buffer registration afterwards: a captured call records the kernel and the buffers it was
        given, and its replays read and write those."""
        self._capturing = True
        try:
            yield self
        finally:
            self._capturing = False

    def close(self) -> None:
        self.disabled = True


def _max_bytes(value) -> int:
    """``max_bytes=`` as a whole number of bytes >= 0: int() read "8" as 8 and cut 1.5 to 1."""
    from purlinc.runtime.errors import ArgumentError
    from purlinc.runtime.validate import integer

    try:
        n = integer(value)
    except TypeError:
        n = -1
    if n < 0:
        raise ArgumentError(f"PurlinAllReduce: max_bytes={value!r}, expected a whole number of bytes >= 0")
    return n


def _like(where: str, out, inp) -> None:
    """``out`` a contiguous tensor of ``inp``'s shape, dtype and device: copy_ would broadcast a
    smaller ``inp`` into it, or cast it, and the call would reduce other data than it was given."""
    _ops.require_tensors(where, [("out", out), ("inp", inp)])
    if (out.shape, out.dtype, out.device) != (inp.shape, inp.dtype, inp.device) or not out.is_contiguous():
        def text(t):
            return f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"
        actual = text(out) + ("" if out.is_contiguous() else f" of strides {tuple(out.stride())}")
        actual += "" if out.device == inp.device else f" on {out.device}"
        raise ArgumentError(f"{where}: out is {actual}, expected {text(inp)}, contiguous (like inp)")

