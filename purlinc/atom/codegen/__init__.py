"""SNAC schedule -> CUDA source, through Jinja templates under ``purlinc.templates``.

Every decision is made here and handed to the templates as plain values: which blocks a
channel program becomes (data steps, merged Notify / Wait groups, hazard barriers), how a
Region is addressed, which element conversions a dtype needs.  The templates only format.

The stages, one module each, in the order ``generate`` runs them:

    exprs     regions, slices and signals as C expressions (channel-indexed, numbers marked)
    blocks    a channel program -> blocks (data steps, signal groups, barriers)
    ll        packed (LL) blocks: fused packet sends, receive loops of a consume group
    fuse      multi-destination copies
    tables    ranks, and runs of blocks, that differ only in numbers: one body, loops, tables
    elems     each dtype's storage, accumulator and conversions
    render    the strict Jinja environment
    names     deterministic kernel names
    generate  the module: atom text, its bodies and entries, the ABI (``kernel.KernelSource``)
    limits    the tunables (threads, unrolls, fusion bounds)

A new block kind is a ``templates/block_<kind>.cu.j2`` and the code that makes its dict
(``blocks``); every number its text takes from the schedule goes through ``exprs.num``, so
``tables`` can share and roll it.

The orchestration (``kernel.cu.j2`` and its includes) calls only ``purlin_copy`` and
``purlin_reduce<N>``, which the atom's template defines; the atom's text sits between two
marker lines, so ``KernelSource.orchestration_source`` is the module without it.
"""

from purlinc.atom.codegen.generate import generate
from purlinc.atom.codegen.kernel import KernelSource

__all__ = ["KernelSource", "generate"]
