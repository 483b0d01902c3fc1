"""The Atom registry: which datapath mechanisms exist, and one record per atom carrying
everything about it (targets, template, whether it reduces, runs packed schedules, uses SMs).

A kernel atom supplies only ``purlin_copy`` and ``purlin_reduce<N>`` (its template); the
orchestration (rounds, slices, signals) is common to all of them and lives in
``kernel.cu.j2``.  A host-driven atom (``ce``, the copy engines) has no template: its
``planner`` turns a schedule into host-issued operations (``purlinc.atom.ce``).

The CLI's ``--atom`` choices, the runtime's checks, the tuning table and the code
generator all read these records; adding an atom is its record and its template.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from purlinc.errors import PurlinError
from purlinc.registry import Registry

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
# The first target of each suffix: arch-specific ("a") targets begin with Hopper, family ("f")
# targets with Blackwell; NVRTC refuses sm_80a or sm_90f, so they are refused here, by name.
SUFFIX_FROM = {"a": 90, "f": 100}


def parse_arch(text: str) -> Arch:
    match = _ARCH.match(str(text).strip())
    if match is None or int(match.group(1)) not in KNOWN_ARCHES:
        known = ", ".join(f"sm_{a}" for a in KNOWN_ARCHES)
        raise PurlinError(
            f"unknown target architecture {text!r}",
            notes=(f"expected sm_NN (optionally with an 'a' or 'f' suffix) with NN one of: {known}",),
        )
    number, suffix = int(match.group(1)), match.group(2)
    if suffix and number < SUFFIX_FROM[suffix]:
        kind = "arch-specific" if suffix == "a" else "family"
        raise PurlinError(
            f"unknown target architecture {text!r}: sm_{number} has no {kind} ('{suffix}') variant",
            notes=(f"the '{suffix}' suffix exists from sm_{SUFFIX_FROM[suffix]} on; use sm_{number}",),
        )
    return Arch(number, suffix)


@dataclass(frozen=True, slots=True)
class TmaRing:
    """The ``tma`` atom's shared-memory ring (see ``atom_tma.cuh.j2``).

    ``issuers`` threads (lane 0 of warps 0, 1, ...) each stream their share of a copy's tiles
    through ``stages`` tiles of ``tile_bytes``; a tile is refilled once at most ``pending``
    younger stores are still reading theirs, so ``stages - pending`` loads run ahead and
    ``pending + 1`` stores are under way while an issuer waits.  The ring is the launch's
    dynamic shared memory: ``ring_bytes`` is the module's ``KernelABI.shared_bytes``.
    """

    issuers: int
    stages: int
    pending: int
    tile_bytes: int
    min_bytes: int  # shorter copies take the ldst path (a bulk pipeline's fill and drain cost more)

    @property
    def ring_bytes(self) -> int:
        return self.issuers * self.stages * self.tile_bytes

    def template_values(self) -> dict:
        return {
            "tma_issuers": self.issuers,
            "tma_stages": self.stages,
            "tma_pending": self.pending,
            "tma_tile_bytes": self.tile_bytes,
            "tma_min_bytes": self.min_bytes,
            "tma_ring_bytes": self.ring_bytes,
        }


# A block may opt in to 227 KiB of shared memory on sm_90 / sm_100 / sm_103 / sm_110, 99 KiB on
# sm_120 / sm_121.  192 KiB (3 issuers x 4 tiles x 16 KiB) leaves room for static shared memory
# (the atom's barriers, anything the orchestration adds); the small parts get half of it.
# Every tile of the ring cycles through a load and a store, so a block moves at most
# ring_bytes / (load latency + store latency): with ~0.5-1 us for a local bulk load and ~1.5-3 us
# until a store to a peer over NVLink completes, 192 KiB give ~50-100 GB/s per block, and 8
# blocks can fill one direction of the link (~370-390 GB/s).  P = 2 of S = 4 favours the push
# (stores slower than loads: 3 stores under way per issuer while it waits) and still keeps 2
# loads ahead for a pull; a discrete-event model of one issuer reaches 87-100% of that bound
# for stores 1-5x slower than loads, 67-75% when loads are 2-3x slower.
TMA_RING = TmaRing(issuers=3, stages=4, pending=2, tile_bytes=16384, min_bytes=65536)
TMA_RING_SMALL = TmaRing(issuers=3, stages=4, pending=2, tile_bytes=8192, min_bytes=65536)
SMALL_SHARED_ARCHES = (120, 121)


def tma_ring(arch: Arch) -> TmaRing:
    return TMA_RING_SMALL if arch.major_minor in SMALL_SHARED_ARCHES else TMA_RING


@dataclass(frozen=True, slots=True)
class Atom:
    name: str
    description: str
    min_arch: int  # lowest sm_NN it runs on
    template: str | None  # under purlinc.templates; None: no kernels (driven from the host)
    reduces: bool  # can run reduce steps
    packed: bool  # can run packed (LL) schedules
    uses_sms: bool  # occupies thread blocks (one per channel)
    unroll: int = 0  # 16-byte vectors in flight per thread in the kernels' ldst copy loop
    shared_ring: bool = False  # streams through a shared-memory ring (``TmaRing``)
    # A host-driven atom's module: ``plan(schedule)`` (a PurlinError when the schedule cannot
    # run on it), ``init_image(plan, rank)`` (its signal pad's first contents) and
    # ``Runner(plan, rank, device, driver)`` (issues a call; the runtime passes its driver).
    host: str | None = None
    # Staging copies it can address (LowerOptions.stage_copies): kernels pick the copy from
    # the epoch on the device; a host-driven atom fixes its addresses when a call is issued
    # (and a CUDA graph replays them), so it has one.
    stage_copies: int = 2
    # Runs zero-copy (registered) schedules, whose steps read and write peers' caller buffers:
    # the runtime then loads a registered twin beside the staged schedule (runtime/zerocopy.py).
    registered: bool = True

    @property
    def generates_kernels(self) -> bool:
        return self.template is not None

    def supports(self, arch: Arch) -> bool:
        return arch.major_minor >= self.min_arch

    def template_values(self, arch: Arch) -> dict:
        """Target-dependent values the atom's template needs (beyond reduce / unroll)."""
        return tma_ring(arch).template_values() if self.shared_ring else {}

    def shared_bytes(self, arch: Arch) -> int:
        """Dynamic shared memory per block the atom's kernels must be launched with."""
        return tma_ring(arch).ring_bytes if self.shared_ring else 0

    def host_module(self):
        """The host-driven atom's module (see ``host``); None for kernel atoms."""
        if self.host is None:
            return None
        from importlib import import_module

        return import_module(self.host)

    def plan(self, schedule):
        """The host plan of a host-driven atom (None for kernel atoms); a PurlinError saying
        why when the schedule cannot run on it."""
        module = self.host_module()
        return None if module is None else module.plan(schedule)


# The ldst loop's unroll: 8 in the ldst atom (64 KiB per 512-thread block in flight: ~46 GB/s
# per block over NVLink was load-latency bound at 4); the tma atom's ldst fallback only carries
# heads, tails and small copies and keeps 4, so the inlined copy stays free of spills.
ATOMS: Registry[Atom] = Registry("atom", (
    Atom("ldst", "SM loads and stores over peer pointers, 16-byte vectors", 80, "atom_ldst.cuh.j2",
         reduces=True, packed=True, uses_sms=True, unroll=8),
    Atom("tma", "bulk asynchronous copies (cp.async.bulk) through a shared-memory ring", 90, "atom_tma.cuh.j2",
         reduces=True, packed=True, uses_sms=True, unroll=4, shared_ring=True),
    Atom("ce", "the copy engines: stream-ordered copies and stream memory operations, no SMs", 80, None,
         reduces=False, packed=False, uses_sms=False, host="purlinc.atom.ce", stage_copies=1,
         registered=False),
))
DEFAULT_ATOM = "ldst"


def lookup_atom(name: str) -> Atom:
    """The record called ``name`` (any atom); UnknownNameError listing the atoms otherwise."""
    return ATOMS.get(name)


def get_atom(name: str, arch: str | Arch, *, kernels: bool = True) -> Atom:
    """The atom called ``name``, checked against the target (and, with ``kernels``, that it
    has kernels to generate: what the code generator asks for); a PurlinError otherwise."""
    target = arch if isinstance(arch, Arch) else parse_arch(arch)
    atom = lookup_atom(name)
    if kernels and not atom.generates_kernels:
        raise PurlinError(
            f"atom {name!r} runs without kernels ({atom.description}): there is no CUDA to generate",
            notes=(f"atoms with kernels for {target.name}: {', '.join(applicable_atoms(target))}",),
        )
    if not atom.supports(target):
        raise PurlinError(
            f"atom {name!r} needs sm_{atom.min_arch} or newer, not {target.name}",
            notes=(f"atoms for {target.name}: {', '.join(applicable_atoms(target, kernels=kernels))}",),
        )
    return atom


def applicable_atoms(arch: str | Arch, *, kernels: bool = True) -> tuple[str, ...]:
    """The atoms that run on ``arch``: those with kernels (what codegen and NVRTC serve, and
    ``purlinc compile --atom`` offers), or with ``kernels=False`` every atom."""
    target = arch if isinstance(arch, Arch) else parse_arch(arch)
    return tuple(a.name for a in ATOMS.records() if a.supports(target) and (a.generates_kernels or not kernels))


def kernel_atoms() -> tuple[str, ...]:
    """Every atom with kernels, on any target (the CLI's ``--atom`` choices)."""
    return tuple(a.name for a in ATOMS.records() if a.generates_kernels)
