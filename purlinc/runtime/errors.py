"""The runtime's exceptions.  User mistakes are PurlinErrors (rendered like diagnostics);
driver failures are CudaErrors; a device-side wait that ran out is a PurlinTimeoutError."""

from __future__ import annotations

from purlinc.errors import PurlinError


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message holds the CUresult's name and explanation."""

    def __init__(self, message: str, result=None):
        super().__init__(message)
        self.result = result


class ArgumentError(PurlinError, ValueError):
    """A call's arguments are wrong (dtype, size, device, alignment, ...); nothing was launched."""


class MismatchError(PurlinError):
    """The ranks of a communicator disagree (different collective, options, heap layout, ...)."""


class PurlinTimeoutError(PurlinError, TimeoutError):
    """A device-side wait ran past PURLIN_WAIT_TIMEOUT_S: a peer never arrived."""

    def __init__(self, message: str, span=None, notes=(), *, record: dict[str, int] | None = None):
        super().__init__(message, span, notes)
        self.record = dict(record or {})


def issued_by_one_thread(comm) -> tuple[str, ...]:
    """The extra note of a timeout where one host thread issues every rank (a LocalGroup)."""
    if getattr(comm, "local_group", None) is None:
        return ()
    return ("one thread issues every rank here: a peer's launch may have waited behind this call "
            "(CUDA loads a kernel at its first launch and waits for running kernels): run every "
            "kernel of the step once before the first collective call (warm it up)",)


class HeapExhaustedError(ArgumentError):
    """The symmetric heap cannot hold a request (``requested`` vs ``available`` bytes)."""

    def __init__(self, message: str, span=None, notes=(), *, requested: int = 0, available: int = 0):
        super().__init__(message, span, notes)
        self.requested = requested
        self.available = available


class FreedBufferError(ArgumentError):
    """A call named heap memory that is no longer a live block (freed, or Purlin's own)."""


class ResidencyError(ArgumentError):
    """Ranks that share a GPU need more resident blocks than it holds (``needed`` vs ``limit``
    on ``device``); nothing was launched."""

    def __init__(self, message: str, span=None, notes=(), *, device: int = 0, needed: int = 0, limit: int = 0):
        super().__init__(message, span, notes)
        self.device = device
        self.needed = needed
        self.limit = limit
