"""One registry per kind of thing (atoms, algorithms, dtypes): a record per entry, looked up
by name, with one error for a name that is not there.

Each kind keeps its records next to the code they describe (``purlinc.atom.atoms``,
``purlinc.snac.algorithms``, ``purlinc.dtypes``); this module is only the lookup, so the
CLI's choices, the runtime's checks and the code generator all read the same records.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Generic, TypeVar

from purlinc.errors import PurlinError

T = TypeVar("T")


class UnknownNameError(PurlinError, ValueError):
    """A name (of an atom, algorithm, dtype, ...) that its registry does not hold.

    A ValueError too, so option parsing that catches ValueError (argparse types, older
    callers) still sees it as a bad value."""


class Registry(Generic[T]):
    """Records of one kind, in registration order, by canonical name (and aliases)."""

    def __init__(self, kind: str, records: Iterable[T], *, name: Callable[[T], str] = lambda r: r.name,
                 aliases: Mapping[str, str] | None = None):
        self.kind = kind
        self._records: dict[str, T] = {}
        for record in records:
            key = name(record)
            if key in self._records:
                raise ValueError(f"{kind} {key!r} registered twice")
            self._records[key] = record
        self._aliases = dict(aliases or {})
        missing = sorted(set(self._aliases.values()) - set(self._records))
        if missing:
            raise ValueError(f"{kind} aliases point at unknown names: {missing}")

    def get(self, name: str) -> T:
        """The record called ``name`` (or an alias of it); UnknownNameError listing the names otherwise."""
        key = str(getattr(name, "value", name))
        record = self._records.get(key)
        if record is None:
            canonical = self._aliases.get(key) or self._aliases.get(key.lower())
            record = self._records.get(canonical) if canonical else None
        if record is None:
            raise UnknownNameError(f"unknown {self.kind} {str(name)!r}", notes=(f"expected one of: {', '.join(self)}",))
        return record

    __getitem__ = get  # registry[name], as for the dicts the registries replaced

    def items(self) -> tuple[tuple[str, T], ...]:
        return tuple(self._records.items())

    def names(self) -> tuple[str, ...]:
        return tuple(self._records)

    def records(self) -> tuple[T, ...]:
        return tuple(self._records.values())

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __contains__(self, name: object) -> bool:
        return name in self._records

    def __len__(self) -> int:
        return len(self._records)
