"""The runtime's front door: ``purlinc.load`` and the four things it can build, each with its
own entry point taking a frozen :class:`~purlinc.runtime.options.LoadOptions`:

- ``load_flat``: one pinned schedule for every call (``collective.py`` runs it);
- ``load_tuned``: one schedule per message-size bucket, chosen per call (``tuned.py``,
  ``tuning.py``);
- ``load_hierarchical``: a plan of Purlin phases inside nodes and NCCL between them
  (``hierarchical.py``, docs/HIERARCHY.md);
- ``load_sized``: a collective with run-time sizes (``with sizes ...``), staged for a capacity
  (``sized.py``).

``load`` names which one from its arguments: ``gpus_per_node`` asks for a plan; a spec with
run-time sizes (or a capacity) the sized form; any orchestration option (or tracing) pins a
schedule; otherwise the tuned buckets.  Everything
below this module (placement, collective, tuned, hierarchical, zerocopy) imports nothing from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from purlinc.errors import PurlinError
from purlinc.pipeline import Compiled
from purlinc.runtime import communicator, hierarchical, tuned
from purlinc.runtime import sized as sized_runtime
from purlinc.runtime.collective import prepare_options
from purlinc.runtime.errors import ArgumentError
from purlinc.runtime.options import LoadOptions
from purlinc.runtime.placement import load_compiled
from purlinc.snac.ir import Algorithm


def _members(comm) -> list:
    """The Communicators a load places the collective on (one, or a LocalGroup's)."""
    if isinstance(comm, communicator.LocalGroup):
        members = list(comm.comms)
    elif isinstance(comm, communicator.Communicator):
        members = [comm]
    else:
        raise ArgumentError(f"load: comm must be a Communicator or a LocalGroup, got {type(comm).__name__}",
                            notes=("a hierarchical plan takes None with gpus_per_node=G",) if comm is None else ())
    for c in members:  # close() freed its heap: a load would take space in it and zero that memory
        if getattr(c, "closed", False):
            raise ArgumentError(f"load: the communicator of rank {c.rank} is closed; expected an open one",
                                notes=("create a new Communicator or LocalGroup, then load again",))
    return members


def load_flat(path_or_source: str | Path, comm, options: LoadOptions = LoadOptions()):
    """One schedule, the one ``options`` pins (the spec's defaults where it pins nothing), for
    every call: a Collective (a GroupCollective for a LocalGroup)."""
    comms = _members(comm)
    options = options.on_device(comms[0].device)
    return load_compiled(prepare_options(path_or_source, comms[0].world_size, options), comm, comms)


def load_tuned(path_or_source: str | Path, comm, options: LoadOptions = LoadOptions()):
    """A schedule per message-size bucket (``purlinc.runtime.tuning``), chosen per call: a
    Tuned (a TunedGroup for a LocalGroup).  ``options`` gives the params and target only: the
    table pins each bucket's schedule, so a pin (or a trace, which pins one) is refused, as
    are the sizes of a collective with run-time sizes."""
    pinned = options.orchestration()
    if pinned or options.capacity is not None or options.dtype is not None:
        given = [*pinned, *(name for name in ("capacity", "dtype") if getattr(options, name) is not None)]
        raise PurlinError(f"load_tuned takes params and arch only; {', '.join(given)} given",
                          notes=("a pinned schedule: load_flat (or load(..., channels=...)); run-time sizes: "
                                 "load_sized",))
    comms = _members(comm)
    return tuned.load_tuned(path_or_source, comm, comms, options.on_device(comms[0].device))


def load_hierarchical(path_or_source: str | Path, gpus_per_node: int | None = None,
                      options: LoadOptions = LoadOptions()):
    """Under torchrun: Purlin inside nodes of ``gpus_per_node`` ranks (default LOCAL_WORLD_SIZE),
    NCCL between them, over the whole torch.distributed world.  ``options`` gives the params
    and target; the plan fixes the schedules, so it pins none."""
    from purlinc import pipeline

    pinned = options.orchestration()
    if pinned:
        raise PurlinError(f"a hierarchical load takes no orchestration options, got {', '.join(pinned)}")
    definition = pipeline.definition_of(pipeline.load_source(path_or_source))
    if definition.epilogue is not None:
        raise PurlinError(f"{definition.name}: a hierarchical collective (gpus_per_node=) cannot apply an "
                          "epilogue yet", definition.epilogue.keyword_span,
                          ("load it on one node's communicator (a flat collective) instead",))
    return hierarchical.load_hierarchical(path_or_source, gpus_per_node, options)


def load_sized(path_or_source: str | Path, comm, options: LoadOptions = LoadOptions()):
    """A collective with run-time sizes: its calls are ``coll(x, sizes, out, out_sizes)``,
    staged for ``options.capacity`` elements per chunk (``dtype``: the widest the calls use)."""
    if options.trace:  # asked for by this call (not the PURLIN_TRACE setting, which None defers to)
        raise PurlinError("trace=True: tracing is not available for collectives with run-time sizes")
    if options.atom is not None:  # before the lowering, whose checks speak of another atom's options
        from purlinc.atom.sized import check_atom

        check_atom(options.atom)
    comms = _members(comm)
    options = options.with_arch(comms[0].device)
    # Sized kernels are never traced (their generator refuses it): the PURLIN_TRACE setting is not theirs.
    compiled = _prepare_sized(path_or_source, comms[0].world_size, replace(options, trace=None))
    return sized_runtime.load_sized(compiled, comm, comms, capacity=options.capacity, dtype=options.dtype)


def _has_sizes(path_or_source, world_size: int, params) -> bool:
    from purlinc import pipeline

    return pipeline.spec_of(pipeline.load_source(path_or_source), world_size, params).sizes is not None


def _prepare_sized(path_or_source, world_size: int, options: LoadOptions) -> Compiled:
    """The Compiled of a collective with run-time sizes; refuses a capacity without sizes and
    sizes without a capacity, before anything is allocated."""
    compiled = prepare_options(path_or_source, world_size, options)
    if compiled.spec.sizes is None:
        raise PurlinError(f"{compiled.name} has no run-time sizes: capacity= and dtype= are for collectives "
                          "declared 'with sizes ...'")
    if options.capacity is None:
        raise PurlinError(f"{compiled.name} has run-time sizes ({compiled.spec.sizes.format()}): load it with "
                          "capacity=C, the most elements any one chunk may have")
    return compiled


def load(
    path_or_source: str | Path,
    comm,
    *,
    params: Mapping[str, int] | None = None,
    algorithm: Algorithm | str | None = None,
    atom: str | None = None,
    channels: int | None = None,
    slices: int | None = None,
    packed: bool | None = None,
    arch: str | None = None,
    trace: bool | None = None,
    gpus_per_node: int | None = None,
    capacity: int | None = None,
    dtype=None,
):
    """Load a collective on ``comm`` (a Communicator, or a LocalGroup for a group callable).

    ``capacity`` (elements per chunk) is required by, and only taken by, collectives with
    run-time sizes (``with sizes ...``); their calls are ``coll(x, sizes, out, out_sizes)``
    (``load_sized``; ``dtype``: the widest dtype the calls use, for staging).

    ``gpus_per_node=G`` (comm None, under torchrun): a hierarchical collective over the whole
    torch.distributed world, Purlin inside nodes of G ranks and NCCL between them
    (``load_hierarchical``, docs/HIERARCHY.md).

    ``trace`` (default: the PURLIN_TRACE setting): build kernels that stamp every block, read by
    ``coll.trace()``; a traced load pins one schedule (the default options unless given).

    With no orchestration option (algorithm, atom, channels, slices, packed), the result
    picks a schedule per call by message size (``load_tuned``); with any of them, exactly
    that schedule runs for every size (``load_flat``).
    """
    options = LoadOptions.of(params=params, algorithm=algorithm, atom=atom, channels=channels, slices=slices,
                             packed=packed, arch=arch, trace=trace, capacity=capacity, dtype=dtype)
    if gpus_per_node is not None:
        # The refusal names every argument at fault (comm, trace, a schedule pin, capacity, dtype),
        # each with why it does not apply.
        why = {"comm": "it builds a communicator per node", "trace": "hierarchical collectives are not traced",
               "pins": "the plan fixes each intra-node phase's schedule",
               "sizes": "a hierarchical plan moves fixed-size chunks"}
        given = [("comm", f"comm=<{type(comm).__name__}>")] if comm is not None else []
        given += [("trace", "trace=True")] if options.trace else []
        given += [("pins", f"{name}={getattr(options, name)!r}") for name in options.orchestration() if name != "trace"]
        given += [("sizes", f"{name}={value!r}") for name, value in (("capacity", capacity), ("dtype", dtype))
                  if value is not None]
        if given:
            raise ArgumentError("load(..., gpus_per_node=G) takes comm=None, no trace, no orchestration options and "
                                f"no capacity or dtype; got {', '.join(text for _, text in given)}",
                                notes=tuple(f"{text}: {why[kind]}" for kind, text in given))
        return load_hierarchical(path_or_source, gpus_per_node, options)
    comms = _members(comm)
    options = options.with_arch(comms[0].device)
    if capacity is not None or dtype is not None or _has_sizes(path_or_source, comms[0].world_size, options.param_map):
        return load_sized(path_or_source, comm, options)
    options = options.on_device(comms[0].device)
    if options.pinned:
        return load_flat(path_or_source, comm, options)
    return load_tuned(path_or_source, comm, options)
