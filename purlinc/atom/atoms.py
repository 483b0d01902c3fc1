"""The Atom registry: which datapath mechanisms exist and which targets each supports.

An atom supplies only ``purlin_copy`` and ``purlin_reduce<N>`` (its template); the
orchestration (rounds, slices, signals) is common to all of them and lives in
``kernel.cu.j2``.  ``ce`` (copy engines) runs without kernels and is the runtime's business.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

from purlinc.errors import PurlinError

@lru_cache(maxsize=1)
def templates_root():
    """The templates: package data ``purlinc.templates`` when installed; the repository's
    ``templates/`` when the project runs from its source tree (PYTHONPATH, no install)."""
    try:
        return resources.files("purlinc.templates")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "templates"


_ARCH = re.compile(r"^sm_(\d{2,3})([af]?)$")


@dataclass(frozen=True, slots=True)
class Arch:
    """A compile target such as ``sm_90`` or ``sm_90a`` (arch-specific features)."""

    major_minor: int  # 80, 90, 100, ...
    suffix: str  # "", "a" or "f"

    @property
    def name(self) -> str:
        return f"sm_{self.major_minor}{self.suffix}"


# Targets the generated code is written and tested for (NVRTC knows more).
KNOWN_ARCHES = (80, 86, 87, 89, 90, 100, 103, 110, 120, 121)


def parse_arch(text: str) -> Arch:
    match = _ARCH.match(str(text).strip())
    if match is None or int(match.group(1)) not in KNOWN_ARCHES:
        known = ", ".join(f"sm_{a}" for a in KNOWN_ARCHES)
        raise PurlinError(
            f"unknown target architecture {text!r}",
            notes=(f"expected sm_NN (optionally with an 'a' or 'f' suffix) with NN one of: {known}",),
        )
    return Arch(int(match.group(1)), match.group(2))


@dataclass(frozen=True, slots=True)
class Atom:
    name: str
    template: str  # under purlinc.templates
    min_arch: int  # lowest sm_NN it compiles for
    description: str

    def supports(self, arch: Arch) -> bool:
        return arch.major_minor >= self.min_arch


ATOMS: dict[str, Atom] = {
    "ldst": Atom("ldst", "atom_ldst.cuh.j2", 80, "SM loads and stores over peer pointers, 16-byte vectors"),
    "tma": Atom("tma", "atom_tma.cuh.j2", 90, "bulk asynchronous copies (cp.async.bulk) through shared memory"),
}


def get_atom(name: str, arch: str | Arch) -> Atom:
    """The atom called ``name``, checked against the target; a PurlinError otherwise."""
    target = arch if isinstance(arch, Arch) else parse_arch(arch)
    atom = ATOMS.get(name)
    if atom is None:
        raise PurlinError(f"unknown atom {name!r}", notes=(f"available atoms: {', '.join(ATOMS)}",))
    if not atom.supports(target):
        raise PurlinError(
            f"atom {name!r} needs sm_{atom.min_arch} or newer, not {target.name}",
            notes=(f"atoms for {target.name}: {', '.join(applicable_atoms(target))}",),
        )
    return atom


def applicable_atoms(arch: str | Arch) -> tuple[str, ...]:
    target = arch if isinstance(arch, Arch) else parse_arch(arch)
    return tuple(name for name, atom in ATOMS.items() if atom.supports(target))
