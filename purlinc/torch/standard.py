"""The standard collectives' sources (``purlinc.frontend.standard``), where purlinc.torch reads them."""

from purlinc.frontend.standard import ROOTED, SOURCES

__all__ = ["ROOTED", "SOURCES"]
