"""docs/API.md lists the public Python API: every name in its tables imports (the
``purlinc.torch`` ones where torch is installed), so the page cannot drift from the code."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

API = Path(__file__).resolve().parent.parent / "docs" / "API.md"
NAME = re.compile(r"^\| `((?:purlinc|purlin)(?:\.\w+)+)` \|", re.MULTILINE)


def _names() -> list[str]:
    return NAME.findall(API.read_text(encoding="utf-8"))


def _resolve(dotted: str):
    """The object ``dotted`` names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name and module_name.startswith(error.name):  # not a module: try a shorter prefix
                continue
            raise
        for attribute in parts[cut:]:
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(dotted)


def test_the_page_lists_names():
    names = _names()
    assert len(names) > 40 and len(set(names)) == len(names), "a table row lost its name, or one is listed twice"


_NEEDS_TORCH = (["purlinc", "torch"], ["purlinc", "moe"])  # the modules that import torch


@pytest.mark.parametrize("dotted", _names())
def test_every_listed_name_imports(dotted):
    if dotted.split(".")[:2] in _NEEDS_TORCH and importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (the torch CPU tests import these)")
    assert _resolve(dotted) is not None


def test_the_listed_purlinc_torch_names_are_its_public_names():
    """purlinc.torch.__all__ lacked fused_add_rmsnorm_op and FusedAddRMSNorm, which the page and
    docs/TORCH.md document."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    import purlinc.torch

    listed = {name.split(".")[2] for name in _names() if name.startswith("purlinc.torch.")}
    assert listed <= set(purlinc.torch.__all__) | {"backend", "groups", "serving"}, \
        listed - set(purlinc.torch.__all__)


def test_the_resolver_fails_on_a_missing_name():
    with pytest.raises(AttributeError):
        _resolve("purlinc.runtime.no_such_thing")


def test_purlin_is_an_alias_of_every_public_purlinc_name():
    import purlin
    import purlinc

    assert purlin.__all__ == purlinc.__all__
    listed = {name.split(".", 1)[1] for name in _names() if name.count(".") == 1 and name.startswith("purlinc.")}
    assert listed == set(purlinc.__all__), "API.md's first table and purlinc.__all__ differ"
    for name in purlinc.__all__:
        assert getattr(purlin, name) is getattr(purlinc, name), name
