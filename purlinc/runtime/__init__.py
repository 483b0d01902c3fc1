"""The Purlin runtime: communicators, the symmetric heap, loading and calling collectives.

Importing this package needs neither a GPU nor torch; the driver is first touched when a
communicator is created.
"""

from purlinc.runtime.collective import Collective, GroupCollective
from purlinc.runtime.communicator import Communicator, LocalGroup
from purlinc.runtime.errors import ArgumentError, CudaError, MismatchError, PurlinTimeoutError
from purlinc.runtime.loader import load, load_flat, load_hierarchical, load_sized, load_tuned
from purlinc.runtime.options import LoadOptions

__all__ = [
    "ArgumentError", "Collective", "Communicator", "CudaError", "GroupCollective", "LoadOptions", "LocalGroup",
    "MismatchError", "PurlinTimeoutError", "load", "load_flat", "load_hierarchical", "load_sized", "load_tuned",
]
