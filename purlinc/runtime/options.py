"""What a load may pin: one frozen record, built once from ``load()``'s keywords and passed
to the entry points (flat, tuned, hierarchical) instead of their keyword lists."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from typing import TYPE_CHECKING

from purlinc import settings

if TYPE_CHECKING:
    from purlinc.snac.ir import Algorithm


def _check_pins(algorithm, atom, channels, slices, packed) -> None:
    """The schedule pins' values, checked when given (a torch Group's options wait for its first
    collective otherwise): what each may be does not depend on the spec."""
    from purlinc.atom.atoms import lookup_atom
    from purlinc.pipeline.options import check_bool
    from purlinc.pipeline.stages import whole_number
    from purlinc.snac.algorithms import get_algorithm
    from purlinc.snac.lower import check_counts

    if algorithm is not None:
        get_algorithm(algorithm)  # an unknown name: a PurlinError listing the algorithms
    if atom is not None:
        lookup_atom(atom)
    # read as the pipeline reads them (a NumPy integer is one), then bounded
    check_counts(*(None if value is None else whole_number(name, value)
                   for name, value in (("channels", channels), ("slices", slices))))
    if packed is not None:
        check_bool("packed", packed)


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """``params`` binds the collective's parameters; ``algorithm``, ``atom``, ``channels``,
    ``slices`` and ``packed`` pin the schedule (None: not pinned); ``arch`` is the target (None:
    the device's, once known); ``trace`` builds kernels that stamp every block (None: the
    PURLIN_TRACE setting); ``capacity`` and ``dtype`` size a collective with run-time sizes."""

    params: tuple[tuple[str, int], ...] = ()
    algorithm: Algorithm | str | None = None
    atom: str | None = None
    channels: int | None = None
    slices: int | None = None
    packed: bool | None = None
    arch: str | None = None
    trace: bool | None = None
    capacity: int | None = None  # elements per chunk: collectives with run-time sizes only
    dtype: object = None  # the widest dtype their calls use (sizes their staging)

    @classmethod
    def of(cls, *, params: Mapping[str, int] | None = None, **pins) -> "LoadOptions":
        """From ``load()``'s keywords."""
        from purlinc.pipeline.options import check_bool
        from purlinc.pipeline.stages import _params_key  # names and integer values checked once, here

        if pins.get("trace") is not None:  # None defers to PURLIN_TRACE; bool("no") is True: a traced load
            check_bool("trace", pins["trace"])
        _check_pins(**{name: pins.get(name) for name in ("algorithm", "atom", "channels", "slices", "packed")})
        _check_target(pins.get("arch"), pins.get("capacity"), pins.get("dtype"))
        return cls(params=_params_key(params), **pins)

    @property
    def param_map(self) -> dict[str, int] | None:
        return dict(self.params) if self.params else None

    @property
    def pinned(self) -> bool:
        """Whether one schedule runs for every size (a traced load pins one too); otherwise the
        tuning table picks a schedule per call by message size."""
        pins = (self.algorithm, self.atom, self.channels, self.slices, self.packed)
        return bool(self.trace) or any(value is not None for value in pins)

    def orchestration(self) -> tuple[str, ...]:
        """The schedule options set to something (a hierarchical load takes none of them)."""
        pins = {"algorithm": self.algorithm, "atom": self.atom, "channels": self.channels,
                "slices": self.slices, "packed": self.packed}
        # Set means given (packed=False and channels=0 are pins too, not "unset"); trace=False
        # asks for what a hierarchical load does anyway.
        return tuple(name for name, value in pins.items() if value is not None) + (("trace",) if self.trace else ())

    def overrides(self) -> dict:
        """The LowerOptions overrides (None: the spec's default) the pipeline takes."""
        return {"algorithm": self.algorithm, "channels": self.channels, "slices": self.slices, "packed": self.packed}

    def with_arch(self, device: int) -> "LoadOptions":
        """``arch`` settled: the device's target unless given."""
        from purlinc.runtime import driver

        return replace(self, arch=self.arch or driver.arch_of(device))

    def on_device(self, device: int) -> "LoadOptions":
        """``arch`` and ``trace`` settled: the device's target, the PURLIN_TRACE setting."""
        from purlinc.runtime import driver

        return replace(self, arch=self.arch or driver.arch_of(device),
                       trace=settings.trace() if self.trace is None else bool(self.trace))


def _check_target(arch, capacity, dtype) -> None:
    """``arch``, ``capacity`` and ``dtype`` checked where given, as the pins are: each was stored
    as given and refused later (an arch at the compile, a capacity only by a sized load), or
    not at all by a load that does not read it."""
    from purlinc.atom.atoms import parse_arch
    from purlinc.dtypes import DType
    from purlinc.runtime.errors import ArgumentError
    from purlinc.runtime.validate import integer_or_none

    if arch is not None:
        if not isinstance(arch, str):
            raise ArgumentError(f"arch must be a target name such as 'sm_90', got {arch!r}")
        parse_arch(arch)
    if capacity is not None and (integer_or_none(capacity) or 0) < 1:  # as load_sized reads it
        raise ArgumentError(f"capacity must be a positive number of elements per chunk, got {capacity!r}")
    if dtype is not None:
        DType.parse(dtype)  # a DType, a name, a torch dtype
