"""The compiler pipeline, one pure stage after another:

    .pln text -> ast -> spec -> snac schedule -> CUDA source -> CUBIN

One path from source to kernel, for the CLI and the runtime alike:

    prepare(source, world_size=..., arch=..., atom=..., overrides=...)   -> Compiled
    Compiled.schedule                 lowered + verified (or read from the cache)
    Compiled.kernel(dtype, op)        generated + NVRTC-compiled, once per (dtype, op)
    compile(...)                      = prepare(...).kernel(dtype, op), as an Artifact

``Compiled`` is frozen: its inputs are fixed, its products are computed on first use and
kept (per (dtype, op) for kernels).  Caches hang off that one path (purlinc/atom/cache.py):

* in this process, ``prepare`` returns the same ``Compiled`` for the same inputs, and the
  frontend (parse + check) runs once per (source, world size, params), so the size buckets
  of a tuned ``load()`` share one parse and check;
* on disk, a *schedule* entry per Compiled (keyed on its inputs before any work: the .pln
  text, world size, params, options and overrides, atom, arch) and a *kernel* entry per
  (Compiled, dtype, op) holding the CUDA source and CUBIN.  A hit skips parsing, lowering,
  verification, generation and NVRTC.

Options are applied in one place, ``resolve_options``: the spec's defaults, replaced by a
full ``LowerOptions`` if given, then the overrides (field name -> value; algorithm names are
looked up in the algorithm registry).

Nothing here needs a GPU: the target architecture is an explicit argument.  Imports are
deferred to the stage that needs them (lark, jinja2, NumPy, cuda.bindings together cost
more than a cache hit), so a hit imports little besides hashlib and json.

The modules, each one concern of that path (every name is imported from here):

    source.py    SourceText, load_source
    stages.py    parse_stage, spec_stage, snac_stage; definition_of / spec_of (the frontend's memos)
    options.py   resolve_options and what it applies (defaults, overrides, the atom's defaults)
    stats.py     STATS: the counters tests assert on
    entries.py   the disk cache's keys and entries (CachedKernel, Kernel)
    compiled.py  Request, Compiled, prepare, forget
    artifact.py  compile -> Artifact
"""

from purlinc.pipeline.artifact import Artifact, compile
from purlinc.pipeline.compiled import ARCHES, DEFAULT_WORLD_SIZE, Compiled, Request, forget, prepare
from purlinc.pipeline import entries as _entries
from purlinc.pipeline.entries import CachedKernel, Kernel
from purlinc.pipeline.options import default_options, normalize_overrides, resolve_options, with_atom_defaults
from purlinc.pipeline.source import SourceText, load_source
from purlinc.pipeline.stages import definition_of, parse_stage, snac_stage, spec_of, spec_stage
from purlinc.pipeline.stats import STATS, Stats

_front_inputs = _entries._front_inputs  # tests read the key (bound here, not re-exported)

__all__ = [
    "ARCHES", "Artifact", "CachedKernel", "Compiled", "DEFAULT_WORLD_SIZE", "Kernel", "Request", "STATS",
    "SourceText", "Stats", "compile", "default_options", "definition_of", "forget", "load_source",
    "normalize_overrides", "parse_stage", "prepare", "resolve_options", "snac_stage", "spec_of", "spec_stage",
    "with_atom_defaults",
]
