"""The algorithm registry: one record per orchestration algorithm, with its lowering
function, when it applies to a spec, and which options it honours.

The CLI's ``--algorithm`` choices, the runtime's checks (``load(..., algorithm=...)``, the
tuning table) and ``purlinc check``'s list of schedules to verify read these records.
Lowering functions are named by ``module:function`` and imported on first use, so this
module stays cheap to import (the CLI and a compile-cache hit read it without lowering).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from purlinc.registry import Registry
from purlinc.snac.ir import Algorithm


def _always(spec) -> bool:
    return True


def _replicated_reduction(spec) -> bool:
    """Two-shot reduces each chunk at one owner and all-gathers it: worth it only for a
    reduction whose outputs hold some chunk on more than one rank."""
    if not spec.is_reduce:
        return False
    from purlinc.snac.kit import needs_of

    return any(len(need.ranks) > 1 for need in needs_of(spec))


@dataclass(frozen=True, slots=True)
class AlgorithmInfo:
    algorithm: Algorithm
    description: str
    lowering: str  # "module:function" taking (Spec, LowerOptions) -> Schedule
    applies: Callable[[object], bool]  # spec -> bool: whether ``purlinc check`` (and tuning) consider it
    packed: bool  # supports packed (LL) stages
    uses_slots: bool  # honours LowerOptions.slots (forwards through staging); the others give every message a unit
    stage_copies: int = 1  # most staging copies by epoch parity it lowers to (LowerOptions.stage_copies)
    sized: bool = False  # lowers specs with run-time sizes (``with sizes``: purlinc.snac.sized)
    # With registered outputs, a replicated reduction's peers write a rank's output directly (its
    # last phase forwards reduced chunks there): no epilogue can run on it (purlinc.snac.epilogue)
    peers_write_registered_out: bool = False

    def writes_peers_registered_out(self, spec) -> bool:
        """Whether, with registered outputs, ``spec``'s schedule has peers write a rank's output:
        only where a reduced chunk goes to several ranks (a reduce-scatter's each rank computes)."""
        return self.peers_write_registered_out and _replicated_reduction(spec)

    @property
    def name(self) -> str:
        return self.algorithm.value

    def lower_function(self):
        from importlib import import_module

        module, _, function = self.lowering.partition(":")
        return getattr(import_module(module), function)


ALGORITHMS: Registry[AlgorithmInfo] = Registry("algorithm", (
    AlgorithmInfo(Algorithm.DIRECT_PUSH, "one-shot: producers write into consumers' memory (or staging)",
                  "purlinc.snac.direct:direct_push", _always, packed=True, uses_slots=False, stage_copies=2,
                  sized=True),
    AlgorithmInfo(Algorithm.DIRECT_PULL, "one-shot: consumers read producers' memory",
                  "purlinc.snac.direct:direct_pull", _always, packed=False, uses_slots=False),
    AlgorithmInfo(Algorithm.TWO_SHOT, "reduce-scatter to an owner, then all-gather from it",
                  "purlinc.snac.two_shot:two_shot", _replicated_reduction, packed=False, uses_slots=False,
                  peers_write_registered_out=True),
    AlgorithmInfo(Algorithm.RING, "neighbour to neighbour, around the ranks",
                  "purlinc.snac.ring:ring", _always, packed=False, uses_slots=True, peers_write_registered_out=True),
))
DEFAULT_ALGORITHM = Algorithm.DIRECT_PUSH


def get_algorithm(name: str | Algorithm) -> AlgorithmInfo:
    """The record of ``name`` (or of an Algorithm); UnknownNameError listing the names otherwise."""
    return ALGORITHMS.get(name.value if isinstance(name, Algorithm) else name)


def slotted_names() -> str:
    """The algorithms that honour ``slots``, for a message refusing it elsewhere."""
    return ", ".join(record.name for record in ALGORITHMS.records() if record.uses_slots)


def applicable(spec) -> tuple[Algorithm, ...]:
    """The algorithms that apply to ``spec``, in registry order (a spec with run-time sizes:
    those whose record lowers them)."""
    sized = spec.sizes is not None
    return tuple(record.algorithm for record in ALGORITHMS.records()
                 if record.applies(spec) and (record.sized or not sized))
