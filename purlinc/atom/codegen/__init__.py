"""SNAC schedule -> CUDA source, through Jinja templates under ``purlinc.templates``.

Every decision is made here and handed to the templates as plain values: which blocks a
channel program becomes (data steps, merged Notify / Wait groups, hazard barriers), how a
Region is addressed, which element conversions a dtype needs.  The templates only format.

The stages, one module each, in the order ``generate`` runs them:

    exprs     regions, slices and signals as C expressions (channel-indexed, numbers marked)
    blocks    a channel program -> blocks (data steps, signal groups, barriers)
    ll        packed (LL) blocks: fused packet sends, receive loops of a consume group
    fuse      multi-destination copies; runs of like steps as loops
    elems     each dtype's storage, accumulator and conversions
    render    the strict Jinja environment
    names     deterministic kernel names
    generate  the module: atom text, every rank's entry, the ABI (``kernel.KernelSource``)
    limits    the tunables (threads, unrolls, fusion bounds)

The orchestration (``kernel.cu.j2`` and its includes) calls only ``purlin_copy`` and
``purlin_reduce<N>``, which the atom's template defines; the atom's text sits between two
marker lines, so ``KernelSource.orchestration_source`` is the module without it.
"""

from purlinc.atom.codegen.generate import generate
from purlinc.atom.codegen.kernel import KernelSource

__all__ = ["KernelSource", "generate"]
