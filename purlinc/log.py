"""The run-time log: Python's ``logging``, logger ``"purlin"`` (and children such as
``"purlin.torch"``), what ``NCCL_DEBUG`` is to NCCL.

``PURLIN_DEBUG=INFO`` (or ``DEBUG``, ``TRACE``, or ``1`` for DEBUG; see :mod:`purlinc.settings`)
sets the logger's level and gives it one stderr handler, so the log appears with no code
change; without it nothing is configured here (no ``basicConfig``, no handler, the level left
to the application), and an application can still configure ``logging.getLogger("purlin")``
as it likes.  Every message costs nothing when its level is off: callers guard anything beyond
a constant string with ``log.isEnabledFor(level)``.
"""

from __future__ import annotations

import logging

from purlinc import settings

TRACE = 5  # finer than DEBUG: per-call detail
logging.addLevelName(TRACE, "TRACE")

log = logging.getLogger("purlin")


def _configure() -> None:
    level = settings.log_level()
    if level is None or getattr(log, "_purlin_configured", False):
        return
    log.setLevel(TRACE if level == "TRACE" else getattr(logging, level))
    handler = logging.StreamHandler()  # stderr
    handler.setFormatter(logging.Formatter("purlin %(levelname)s [pid %(process)d] %(name)s: %(message)s"))
    log.addHandler(handler)
    log.propagate = False  # one line per message even where the application logs to stderr too
    log._purlin_configured = True


def get(name: str | None = None) -> logging.Logger:
    """``purlin`` or a child logger (``purlin.<name>``)."""
    return log.getChild(name) if name else log


_configure()
