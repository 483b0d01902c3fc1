"""The Purlin runtime: communicators, the symmetric heap, loading and calling collectives.

Importing this package needs neither a GPU nor torch; the driver is first touched when a
communicator is created.
"""

from purlinc.runtime.collective import Collective, GroupCollective, load
from purlinc.runtime.communicator import Communicator, LocalGroup
from purlinc.runtime.errors import ArgumentError, CudaError, MismatchError, PurlinTimeoutError

__all__ = [
    "ArgumentError", "Collective", "Communicator", "CudaError", "GroupCollective", "LocalGroup",
    "MismatchError", "PurlinTimeoutError", "load",
]
