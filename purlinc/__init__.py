"""Purlin: GPU collectives compiled from a small spec language.

Pipeline: ``.pln -> ast -> spec -> snac -> cu -> cubin``.  The public entry points are
:func:`purlinc.compile` (no GPU needed) and :func:`purlinc.load` (runtime, needs GPUs).
"""

from purlinc.errors import PurlinError

__version__ = "0.1.0"

__all__ = ["PurlinError", "__version__"]
