"""Package data (the lark grammar, the Jinja templates), found the same way installed or not.

In a wheel, ``grammar/`` and ``templates/`` ship as the packages ``purlinc.grammar`` and
``purlinc.templates`` (pyproject's package-dir), folders inside ``purlinc/``.  In a source
tree (editable install, or ``PYTHONPATH=$PWD`` as on the GPU machines) they are the top-level
folders beside ``purlinc/``.

Always this copy's own folders, found from this file, not by importing the packages: where
another purlinc is installed (a wheel, or an editable install of another checkout), importlib
finds *its* ``purlinc.templates`` even when this tree's ``purlinc`` comes first on sys.path, and
a tree run with PYTHONPATH generated its kernels from the other copy's templates.
"""

from __future__ import annotations

import importlib.resources
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importlib.abc's name is deprecated from 3.12, importlib.resources.abc's new in 3.11
    from importlib.resources.abc import Traversable

_PACKAGE = Path(__file__).resolve().parent
_SOURCE_TREE = _PACKAGE.parent


@lru_cache(maxsize=None)
def _folder(package: str, folder: str) -> Traversable:
    for place in (_PACKAGE / folder, _SOURCE_TREE / folder):  # installed, then a source tree
        if place.is_dir():
            return place
    return importlib.resources.files(package)  # neither a folder: a zipped install


def grammar_dir() -> Traversable:
    return _folder("purlinc.grammar", "grammar")


def templates_dir() -> Traversable:
    return _folder("purlinc.templates", "templates")
