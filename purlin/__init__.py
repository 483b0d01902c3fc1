"""``import purlin; purlin.load(...)``: the runtime's public names, as an alias of purlinc's."""

from purlinc import PurlinError, __version__

__all__ = ["PurlinError", "__version__", "load", "Communicator", "LocalGroup", "PurlinTimeoutError",
           "Collective", "GroupCollective"]


def __getattr__(name: str):
    if name in __all__:
        from purlinc import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'purlin' has no attribute {name!r}")
