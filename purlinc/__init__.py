"""Purlin: GPU collectives compiled from a small spec language.

Pipeline: ``.pln -> ast -> spec -> snac -> cu -> cubin``.  The public entry points are
:func:`purlinc.pipeline.compile` (no GPU needed) and :func:`purlinc.load` (runtime, needs GPUs);
docs/API.md lists the rest.
"""

from purlinc.errors import PurlinError
from purlinc.version import __version__

# The runtime is imported on first use, so ``import purlinc`` needs no GPU, driver or torch.
_RUNTIME = ("load", "Communicator", "LocalGroup", "PurlinTimeoutError", "MismatchError", "Collective", "GroupCollective")

__all__ = ["PurlinError", "__version__", *_RUNTIME]  # docs/API.md's first table; ``purlin`` aliases it


def __getattr__(name: str):
    if name in _RUNTIME:
        from purlinc import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'purlinc' has no attribute {name!r}")
