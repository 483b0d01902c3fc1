"""The standard collectives' sources (``purlinc.standard``), where purlinc.torch reads them."""

from purlinc.standard import ROOTED, SOURCES

__all__ = ["ROOTED", "SOURCES"]
