"""Package data (the lark grammar, the Jinja templates), found the same way installed or not.

In a wheel, ``grammar/`` and ``templates/`` ship as the packages ``purlinc.grammar`` and
``purlinc.templates`` (pyproject's package-dir).  Run from a plain source tree
(``PYTHONPATH=$PWD``, as on the GPU machines) those packages do not exist, and the
top-level folders beside ``purlinc/`` are used instead.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importlib.abc's name is deprecated from 3.12, importlib.resources.abc's new in 3.11
    from importlib.resources.abc import Traversable

_SOURCE_TREE = Path(__file__).resolve().parent.parent


def _folder(package: str, folder: str) -> Traversable:
    try:
        return importlib.resources.files(package)
    except ModuleNotFoundError:
        return _SOURCE_TREE / folder


def grammar_dir() -> Traversable:
    return _folder("purlinc.grammar", "grammar")


def templates_dir() -> Traversable:
    return _folder("purlinc.templates", "templates")
