"""What the code generator returns: the module's source and what a loader needs to know."""

from __future__ import annotations

from dataclasses import dataclass

from purlinc.atom.abi import KernelABI
from purlinc.dtypes import DType, ReduceOp

ATOM_BEGIN = "// ======== atom begin ========"
ATOM_END = "// ======== atom end ========"


@dataclass(frozen=True, slots=True)
class KernelSource:
    source: str
    filename: str  # e.g. purlin_allgather_1a2b3c4d.cu
    kernel_base: str  # purlin_<collective>_<hash8>; entries are abi.entry(rank), f"{kernel_base}_b<body>"
    abi: KernelABI
    atom: str
    arch: str
    dtype: DType
    op: ReduceOp | None
    atom_start: int  # the atom's text is source[atom_start:atom_end]
    atom_end: int
    # Traced kernels only (generate(trace=True)): per rank, per channel, the step indices of
    # each block in order; the kernel's trace marks are numbered after these blocks.
    trace_blocks: tuple = ()

    @property
    def atom_source(self) -> str:
        return self.source[self.atom_start:self.atom_end]

    @property
    def orchestration_source(self) -> str:
        """Everything but the atom, with the kernel name made neutral: what must not change
        when the same schedule is generated for another atom."""
        rest = self.source[: self.atom_start] + "<atom>" + self.source[self.atom_end:]
        return rest.replace(self.kernel_base, "<kernel>").replace(f"atom '{self.atom}'", "atom '<atom>'")
