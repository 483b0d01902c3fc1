"""The frontend and lowering stages, each a pure function of the previous artifact plus
options, and this process's memos of the frontend's products (the AST and the checked spec
of a source), which every Compiled, size bucket and CLI stage of one source shares.

Imports are deferred to the stage that needs them (lark, NumPy and the verifier are not
imported by a cache hit)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING

from purlinc.errors import PurlinError
from purlinc.frontend.check import whole_number
from purlinc.pipeline.source import SourceText
from purlinc.pipeline.stats import STATS

if TYPE_CHECKING:
    from purlinc.frontend import ast
    from purlinc.frontend.spec import Spec
    from purlinc.snac.ir import LowerOptions, Schedule

_MEMO_LIMIT = 128  # Compiled objects and checked specs kept per process


def _expect(stage: str, what: str, value, kind: type, hint: str) -> None:
    """A stage's argument of the type it reads (each took a path, a dict or None as far as an
    AttributeError deep inside): the error names the stage, the argument and what to pass."""
    if not isinstance(value, kind):
        raise PurlinError(f"{stage}: {what} must be a {kind.__name__}, got {type(value).__name__}", notes=(hint,))


def parse_stage(source: SourceText) -> ast.CollectiveDef:
    from purlinc.frontend.parse import parse

    _expect("parse_stage", "source", source, SourceText, "pipeline.load_source(path or text) makes one")
    STATS.parses += 1
    return parse(source.text, source.filename)


def spec_stage(definition: ast.CollectiveDef, world_size: int, params: Mapping[str, int] | None) -> Spec:
    from purlinc.frontend.ast import CollectiveDef
    from purlinc.frontend.check import check

    _expect("spec_stage", "definition", definition, CollectiveDef, "pipeline.parse_stage(source) makes one")
    STATS.checks += 1
    return check(definition, world_size, params)


def snac_stage(spec: Spec, options: LowerOptions, *, verify: bool = True) -> Schedule:
    from purlinc.frontend.spec import Spec
    from purlinc.snac.ir import LowerOptions
    from purlinc.snac.lower import lower
    from purlinc.snac.verify import verify as verify_schedule

    _expect("snac_stage", "spec", spec, Spec, "pipeline.spec_stage(definition, world_size, params) makes one")
    _expect("snac_stage", "options", options, LowerOptions, "pipeline.resolve_options(spec, overrides={...}) makes one")
    STATS.lowerings += 1
    schedule = lower(spec, options)
    if verify:
        STATS.verifications += 1
        verify_schedule(schedule, spec)
    return schedule


def _params_key(params: Mapping[str, int] | None) -> tuple[tuple[str, int], ...]:
    if params is not None and not isinstance(params, Mapping):
        raise PurlinError(f"params must map parameter names to integers, e.g. {{'root': 1}}; "
                          f"got {type(params).__name__}")
    for name in params or {}:
        if not isinstance(name, str):
            raise PurlinError(f"parameter names are strings, got {name!r}")
    return tuple(sorted((k, whole_number(f"parameter {k}", v)) for k, v in (params or {}).items()))


_definitions: OrderedDict = OrderedDict()
_specs: OrderedDict = OrderedDict()
_frontend_lock = threading.Lock()


def _remember(memo: OrderedDict, key, value):
    memo[key] = value
    memo.move_to_end(key)
    while len(memo) > _MEMO_LIMIT:
        memo.popitem(last=False)
    return value


# Keys being made now -> the Future their first asker fills: a second thread asking for the
# same key waits for it (each made its own before, so a cold start parsed one file per thread)
# while threads asking for other keys go on (the lock is not held while one is made).
_making: dict = {}


def _once(memo: OrderedDict, key, make):
    """``memo[key]``, made by ``make()`` once per process however many threads ask at once."""
    from concurrent.futures import Future

    with _frontend_lock:
        hit = memo.get(key)
        if hit is not None:
            return hit
        pending = _making.get(key)
        first = pending is None
        if first:
            pending = _making[key] = Future()
    if not first:
        return pending.result()  # the maker's value, or its error
    try:
        value = make()
    except BaseException as error:
        with _frontend_lock:
            del _making[key]
        pending.set_exception(error)
        raise
    with _frontend_lock:
        _remember(memo, key, value)
        del _making[key]
    pending.set_result(value)
    return value


def definition_of(source: SourceText) -> ast.CollectiveDef:
    """The parsed file, once per (text, filename) per process (the AST is frozen)."""
    return _once(_definitions, ("ast", source.digest, source.filename), lambda: parse_stage(source))


def spec_of(source: SourceText, world_size: int, params: Mapping[str, int] | None) -> Spec:
    """The checked spec, once per (source, world size, params) per process (the Spec is
    frozen): every size bucket of a tuned load, and the CLI's stages, share it.  ``source``: a
    ``SourceText`` (``load_source`` makes one of a path or text)."""
    if not isinstance(source, SourceText):
        from purlinc.pipeline.source import load_source

        source = load_source(source)
    world_size = whole_number("the world size", world_size)
    key = ("spec", source.digest, source.filename, world_size, _params_key(params))
    return _once(_specs, key, lambda: spec_stage(definition_of(source), world_size, params))
