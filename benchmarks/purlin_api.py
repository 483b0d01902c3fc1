"""Everything the benchmark knows about Purlin's runtime API, in one place.

The runtime is written alongside this harness; if its API moves, fix it here and nowhere
else.  Assumed API (torch.distributed initialised, the CUDA device set):

    comm = purlinc.Communicator.from_torch()
    coll = purlinc.load("examples/allgather.pln", comm, algorithm=None, atom=None,
                        channels=None, slices=None, params=None)
    coll(x, out=y, op="sum")          # torch tensors, the current stream, graph-capturable
    hier = purlinc.load("examples/allreduce.pln", None, gpus_per_node=G)   # purlin/hierarchical
    hier(x, y, op="sum", count=n)     # every rank passes count (some have no x or no out)

Buffer conventions per collective (``count`` = the .pln chunk): allgather in=count,
out=R*count; reduce_scatter in=R*count, out=count; allreduce and alltoall in=out=R*count;
broadcast root in=out=count, others x=None; reduce all in=count, root out=count, others
out=None; gather all in=count, root out=R*count, others out=None; scatter root
in=R*count, others x=None, all out=count.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
OPTION_KEYS = ("algorithm", "atom", "channels", "slices", "packed", "params")


@dataclass(frozen=True)
class Variant:
    name: str
    options: dict = field(default_factory=dict)  # OPTION_KEYS; missing = the runtime's choice
    only: tuple[str, ...] = ()  # collectives it applies to (empty = all)
    heap: bool = False  # buffers from comm.empty (the zero-copy path) instead of torch.empty
    # PURLIN_GRAPH_BUFFERS while its graphs are captured (None: the environment's); eager calls
    # are the default's either way
    graph_buffers: str | None = None

    def applies(self, collective: str) -> bool:
        return not self.only or collective in self.only


def _v(name: str, algorithm: str, atom: str, channels: int | None, slices: int | None = None,
       only: tuple[str, ...] = (), packed: bool | None = None) -> Variant:
    opts = {"algorithm": algorithm, "atom": atom, "channels": channels, "slices": slices, "packed": packed}
    return Variant(name, {k: v for k, v in opts.items() if v is not None}, only)


# ``default`` is the call a user makes with no options; ``zerocopy`` is the same call on buffers
# from the communicator's symmetric heap (comm.empty: the registered schedules, no staging);
# the rest pin algorithm/atom/channels.
VARIANTS = (
    Variant("default"),
    Variant("zerocopy", heap=True),
    # the default's load with captured calls staging (PURLIN_GRAPH_BUFFERS=stage): what graphs
    # on ordinary buffers cost before the runtime registered them
    Variant("graph-staged", graph_buffers="stage"),
    # ... and registering every captured call that has a registered twin, also where an LL-packed
    # schedule serves the size (PURLIN_GRAPH_BUFFERS=register): the other side of auto's choice
    Variant("graph-registered", graph_buffers="register"),
    _v("push-ldst-c1", "direct-push", "ldst", 1),
    _v("push-ldst-c4", "direct-push", "ldst", 4),
    _v("push-ldst-c16", "direct-push", "ldst", 16),
    _v("push-ldst-c32", "direct-push", "ldst", 32),
    _v("push-ldst-c64", "direct-push", "ldst", 64),
    _v("push-ldst-c128", "direct-push", "ldst", 128),
    _v("push-ldst-c64-s4", "direct-push", "ldst", 64, 4),
    # LL: the notify rides in every 16-byte packet (latency); not for other algorithms.
    _v("push-ll-c1", "direct-push", "ldst", 1, packed=True),
    _v("push-ll-c2", "direct-push", "ldst", 2, packed=True),
    _v("push-ll-c4", "direct-push", "ldst", 4, packed=True),
    _v("push-ll-c8", "direct-push", "ldst", 8, packed=True),
    _v("push-ll-c16", "direct-push", "ldst", 16, packed=True),
    _v("push-ldst-c16-s4", "direct-push", "ldst", 16, 4),
    _v("pull-ldst-c16", "direct-pull", "ldst", 16),
    _v("two-shot-ldst-c16", "two-shot", "ldst", 16, only=("allreduce",)),
    _v("two-shot-ldst-c32", "two-shot", "ldst", 32, only=("allreduce",)),
    _v("two-shot-ldst-c64", "two-shot", "ldst", 64, only=("allreduce",)),
    _v("ring-ldst-c16", "ring", "ldst", 16, only=("allreduce", "allgather", "reduce_scatter")),
    _v("push-tma-c8", "direct-push", "tma", 8),
    # The copy engines only move bytes: no reductions.
    _v("push-ce", "direct-push", "ce", None, only=("allgather", "alltoall", "broadcast", "gather", "scatter")),
    _v("push-ce-c4", "direct-push", "ce", 4, only=("allgather", "alltoall", "broadcast", "gather", "scatter")),
)
QUICK_VARIANTS = ("default", "zerocopy", "push-ldst-c1", "push-ldst-c16", "push-ldst-c64", "push-ll-c1",
                  "push-ll-c4", "push-ll-c8", "push-ll-c16", "two-shot-ldst-c32", "push-ce")


def load_key(variant: Variant) -> tuple:
    """Variants with the same options share one loaded collective (``zerocopy`` = ``default``)."""
    return tuple(sorted((k, str(v)) for k, v in variant.options.items()))


SPEC_FORM = "'NAME:algorithm=ring,atom=ldst,channels=8,slices=2,packed=true' (at least one option)"
SPEC_KEYS = tuple(k for k in OPTION_KEYS if k != "params")
TRUE, FALSE = ("1", "true", "yes"), ("0", "false", "no")


def _registry(kind: str):
    """The runtime's registry of ``kind`` ('algorithm' or 'atom'): the one list of names."""
    if kind == "algorithm":
        from purlinc.snac.algorithms import ALGORITHMS

        return ALGORITHMS
    from purlinc.atom.atoms import ATOMS

    return ATOMS


def _registry_names(kind: str) -> tuple[str, ...]:
    return _registry(kind).names()


def _check_packing(opts: dict, where: str) -> None:
    """packed=true needs an algorithm and an atom whose records say they carry packed (LL)
    stages (the runtime's defaults where the spec names none)."""
    if not opts.get("packed"):
        return
    from purlinc.atom.atoms import DEFAULT_ATOM
    from purlinc.snac.algorithms import DEFAULT_ALGORITHM

    for kind, default in (("algorithm", DEFAULT_ALGORITHM.value), ("atom", DEFAULT_ATOM)):
        name = opts.get(kind, default)
        if not _registry(kind).get(name).packed:
            able = [r.name for r in _registry(kind).records() if r.packed]
            raise ValueError(f"{where}: packed=true needs an {kind} that packs ({', '.join(able)}), not {name!r}")


def _spec_value(key: str, value: str, where: str):
    """One --variant-spec option's value, checked; ValueError saying what it takes."""
    if key in ("channels", "slices"):
        if not (value.isascii() and value.isdigit() and int(value) >= 1):
            raise ValueError(f"{where}: {key} {value!r} should be a positive integer")
        return int(value)
    if key == "packed":
        if value.lower() not in TRUE + FALSE:
            raise ValueError(f"{where}: packed {value!r} should be one of {', '.join(TRUE + FALSE)}")
        return value.lower() in TRUE
    known = _registry_names(key)
    if value not in known:
        raise ValueError(f"{where}: unknown {key} {value!r}; choose from {', '.join(known)}")
    return value


def parse_variant(text: str) -> Variant:
    """'name:algorithm=ring,atom=ldst,channels=8[,slices=2]' -> Variant (for --variant-spec);
    ValueError naming what is wrong: no name, no options (a spec that pins nothing would run
    as the default under another name), an unknown option, algorithm or atom, a bad number."""
    where = f"--variant-spec {text!r}"
    name, colon, rest = text.partition(":")
    if not colon or not name.strip():
        raise ValueError(f"{where}: expected {SPEC_FORM}")
    opts: dict = {}
    for item in (i.strip() for i in rest.split(",")):
        if not item:
            continue
        key, eq, value = (part.strip() for part in item.partition("="))
        if key not in SPEC_KEYS:
            raise ValueError(f"{where}: unknown option {key!r}; options: {', '.join(SPEC_KEYS)}")
        if not eq or not value:
            raise ValueError(f"{where}: option {key!r} has no value; expected {key}=VALUE")
        if key in opts:
            raise ValueError(f"{where}: option {key!r} given twice")
        opts[key] = _spec_value(key, value, where)
    if not opts:
        raise ValueError(f"{where}: no options; expected {SPEC_FORM}")
    _check_packing(opts, where)
    return Variant(name.strip(), opts)


def version() -> str | None:
    import purlinc

    return getattr(purlinc, "__version__", None)


def stage_bytes() -> int:
    """Staging space each loaded collective takes from the heap (the runtime's default)."""
    try:
        from purlinc import settings

        return int(settings.stage_bytes())
    except Exception:  # noqa: BLE001
        return 64 << 20


def heap_bytes_for(loads: int) -> int | None:
    """The first heap segment: None (the runtime's PURLIN_HEAP_MB) when the heap grows on demand;
    older runtimes without growth get one that holds every variant the benchmark loads."""
    import os

    if os.environ.get("PURLIN_HEAP_MB") or heap_grows():
        return None
    return max(512 << 20, loads * stage_bytes() + 32 * stage_bytes() + (256 << 20))


def heap_grows() -> bool:
    try:
        from purlinc.runtime.heap import SymmetricHeap

        return hasattr(SymmetricHeap, "alloc_user")
    except Exception:  # noqa: BLE001
        return False


def empty(comm, numel: int, dtype):
    """A tensor in the communicator's symmetric heap (a collective: every rank calls it)."""
    return comm.empty((numel,), dtype)


def communicator(heap_bytes: int | None = None):
    import purlinc

    if heap_bytes is None:
        return purlinc.Communicator.from_torch()
    return purlinc.Communicator.from_torch(heap_bytes=heap_bytes)


def pln_path(collective: str) -> Path:
    return EXAMPLES / f"{collective}.pln"


def load(comm, collective: str, options: dict):
    import purlinc

    kwargs = {k: options.get(k) for k in OPTION_KEYS}
    coll = purlinc.load(str(pln_path(collective)), comm, **kwargs)
    # Compile and load the bf16 kernel now (a collective), not inside the first timed call.
    warm = getattr(coll, "warm", None)
    if callable(warm):
        warm("bfloat16", "sum")
    return coll


def bind_call(coll, collective: str, x, y, *, rank: int, root: int = 0, reduce: bool, count: int | None = None):
    """A no-argument callable making one call with the buffer conventions above (``x``/``y``:
    this rank's full buffers; ``count``, elements per chunk, passed only when given, as
    hierarchical calls need it).  The conventions are resolved once, so a timed loop pays only
    the collective's own call, as the NCCL cases' bound calls do."""
    is_root = rank == root
    if collective == "broadcast" or collective == "scatter":
        x = x if is_root else None
    if collective in ("reduce", "gather"):
        y = y if is_root else None
    kwargs = {} if count is None else {"count": count}
    if reduce:
        kwargs["op"] = "sum"
    return functools.partial(coll, x, out=y, **kwargs)


def call(coll, collective: str, x, y, *, rank: int, root: int = 0, reduce: bool, count: int | None = None) -> None:
    """One call with the buffer conventions above (``bind_call``)."""
    bind_call(coll, collective, x, y, rank=rank, root=root, reduce=reduce, count=count)()


def load_hierarchical(collective: str, gpus_per_node: int):
    """``collective`` as a hierarchical collective over the torch.distributed world in nodes of
    ``gpus_per_node`` ranks (a collective: every rank, same order), its bf16 kernels loaded."""
    import purlinc

    coll = purlinc.load(str(pln_path(collective)), None, gpus_per_node=gpus_per_node)
    warm = getattr(coll, "warm", None)
    if callable(warm):
        warm("bfloat16", "sum")
    return coll


def free_scratch(coll) -> None:
    """Drop a hierarchical collective's per-size scratch buffers (no captured graph may remain)."""
    fn = getattr(coll, "free_scratch", None)
    if callable(fn):
        fn()


def grid_sms(coll, options: dict, x=None, y=None) -> tuple[int | None, str]:
    """SMs a call occupies: the kernel grid (channels) from the loaded collective's ABI; 0 for ce."""
    if hasattr(coll, "sms_for") and (x is not None or y is not None):
        # A plain load picks a schedule per size bucket: ask it which one this size runs.
        first = coll.variants[0]
        if x is not None and first.in_units and x.numel() % first.in_units == 0:
            count, itemsize = x.numel() // first.in_units, x.element_size()
        else:
            count, itemsize = y.numel() // max(first.out_units, 1), y.element_size()
        return coll.sms_for(count, itemsize), "the size bucket's channels (tuned default)"
    if options.get("atom") == "ce":
        return 0, "copy engines only"
    if getattr(getattr(coll, "compiled", None), "atom", None) == "ce":
        return 0, "copy engines only"
    for path in ("compiled.options.channels", "compiled.schedule.options.channels", "abi.channels",
                 "channels", "grid"):
        obj = coll
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        if isinstance(obj, (tuple, list)):
            obj = obj[0]
        if isinstance(obj, int):
            return obj, f"from coll.{path}"
    atom = getattr(coll, "atom", None)
    if atom == "ce":
        return 0, "copy engines only"
    if options.get("channels") is not None:
        return int(options["channels"]), "requested channels (ABI not exposed)"
    return None, "grid not exposed by the loaded collective"


def device_bytes(comm) -> dict:
    """The communicator's own accounting of device memory, where it offers one."""
    out = {}
    for name in ("heap_bytes", "heap_size", "nbytes", "device_bytes"):
        v = getattr(comm, name, None)
        if isinstance(v, int):
            out[f"comm.{name}"] = v
    heap = getattr(comm, "heap", None)
    if heap is not None:
        out["heap_reserved"] = int(heap.size)
        out["heap_segments"] = len(getattr(heap, "segments", ()) or ()) or 1
    return out


def check_errors(comm, coll) -> None:
    """Raise if the runtime recorded a device-side error (a timed-out wait) since the last check."""
    fn = getattr(coll, "check", None)  # Collective.check(): raises PurlinTimeoutError, no sync
    if callable(fn):
        fn()


def raw_peer_copy(comm):
    """A raw SM copy into a peer's memory, if the runtime exposes one: fn(dst_rank, src, nbytes)."""
    for name in ("peer_copy", "copy_to_peer", "raw_copy"):
        fn = getattr(comm, name, None)
        if callable(fn):
            return name, fn
    return None


def precompile_jobs(collectives, variants, world_size: int) -> list[dict]:
    """Keyword arguments for ``purlinc.compile`` that warm the on-disk cache before loading.

    Best effort: it helps only if the runtime's load compiles with the same key (sm_90,
    this R, bf16, sum); a miss costs nothing but the time spent here.
    """
    jobs = []
    for coll in collectives:
        for v in variants:
            if not v.applies(coll):
                continue
            jobs.append({"collective": coll, "variant": v.name, "world_size": world_size,
                         "options": dict(v.options)})
    return jobs


def hier_precompile_jobs(collectives, gpus_per_node, world_size: int) -> list[dict]:
    """Jobs warming the kernels of every intra phase of the hierarchical plans (bf16, sum)."""
    return [{"collective": coll, "variant": f"hierarchical-g{g}", "world_size": world_size, "gpus_per_node": g,
             "options": {}} for coll in collectives for g in gpus_per_node if world_size % g == 0]


def _precompile_hier(job: dict, arch: str) -> str:
    """Each node's intra-phase sources exactly as the hierarchical load makes them (same text,
    same pinned algorithm), so the cache keys are the ones its first call looks up."""
    from purlinc.dtypes import DType, ReduceOp
    from purlinc.runtime.collective import prepare
    from purlinc.runtime.hierarchical import intra_sources, plan_for

    plan = plan_for(str(pln_path(job["collective"])), job["world_size"], job["gpus_per_node"])
    sources = {src for node in range(plan.topology.nodes) for src in intra_sources(plan, node).values()}
    for source in sorted(sources):
        compiled = prepare(source, job["gpus_per_node"], arch=arch, algorithm="direct-push")
        if compiled.plan is None:
            is_reduce = compiled.schedule.operation.value == "reduce"
            compiled.kernel(DType.BFLOAT16, ReduceOp.SUM if is_reduce else None)
    return f"{job['collective']}/{job['variant']}: ok ({len(sources)} phase sources)"


def precompile_one(job: dict, arch: str) -> str:
    """Run in a worker process; returns a short status string.

    Goes through the runtime's own ``prepare`` + ``Compiled.kernel`` (what ``load`` and the
    first call do), so the cache key is the one the runtime will look up.
    """
    if job.get("gpus_per_node"):
        return _precompile_hier(job, arch)
    opts = job["options"]
    try:
        from purlinc.dtypes import DType, ReduceOp
        from purlinc.runtime.collective import prepare
    except ImportError:
        prepare = None
    if prepare is not None:
        compiled = prepare(str(pln_path(job["collective"])), job["world_size"], arch=arch,
                           **{k: opts.get(k) for k in ("algorithm", "atom", "channels", "slices", "packed")})
        if compiled.plan is None:  # a kernel atom (a host-driven one, ce, has no kernels)
            is_reduce = compiled.schedule.operation.value == "reduce"
            compiled.kernel(DType.BFLOAT16, ReduceOp.SUM if is_reduce else None)
        return f"{job['collective']}/{job['variant']}: ok"
    import purlinc.pipeline as pipeline
    from purlinc.snac.ir import Algorithm, LowerOptions

    lower = None
    if opts.get("channels") or opts.get("slices") or opts.get("algorithm"):
        kw = {}
        if opts.get("algorithm"):
            kw["algorithm"] = Algorithm(opts["algorithm"])
        if opts.get("channels"):
            kw["channels"] = int(opts["channels"])
        if opts.get("slices"):
            kw["slices"] = int(opts["slices"])
        lower = LowerOptions(**kw)
    pipeline.compile(str(pln_path(job["collective"])), world_size=job["world_size"], arch=arch,
                     options=lower, atom=opts.get("atom", "ldst"), dtype="bfloat16", op="sum")
    return f"{job['collective']}/{job['variant']}: ok"
