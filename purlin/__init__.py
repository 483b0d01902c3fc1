"""``import purlin; purlin.load(...)``: the runtime's public names, as an alias of purlinc's."""

import purlinc
from purlinc import PurlinError, __version__

__all__ = list(purlinc.__all__)  # one list: a name added to purlinc is here too


def __getattr__(name: str):
    if name in __all__:
        return getattr(purlinc, name)
    raise AttributeError(f"module 'purlin' has no attribute {name!r}")
