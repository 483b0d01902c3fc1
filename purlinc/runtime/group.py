"""The checks of a group call (a LocalGroup's, ``GroupCollective`` in runtime/collective.py),
every rank's before any rank launches: a launched rank waits for the others.  ``ranks`` is
every rank's Collective."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence

from purlinc.runtime import residency, zerocopy
from purlinc.runtime.errors import ArgumentError
from purlinc.runtime.validate import call_signature, disagreement


def prepare_group(name: str, ranks: Sequence, xs, outs, op, streams, count):
    """Validate a group call for every rank before any launch (a launched rank would wait for
    the others): one entry per rank in xs / outs / streams, and one count for all ranks."""
    world = len(ranks)
    xs, outs, streams = (per_rank(name, label, values, world)
                         for label, values in (("xs", xs), ("outs", outs), ("streams", streams)))
    prepared = _prepare_ranks(ranks, xs, outs, op, streams, count)
    # One process holds every rank's buffers: any disagreement is caught before any launch.
    problem = disagreement(name, [call_signature(name, p[0], bool(c.in_units or c.out_units))
                                  for c, p in zip(ranks, prepared)])
    if problem is not None:
        raise problem
    _check_streams(name, ranks, prepared)
    _check_apart(name, ranks, prepared)
    zerocopy.agree_group(ranks, prepared)  # heap buffers: every rank takes the same path
    return prepared


def _check_apart(name: str, ranks: Sequence, prepared) -> None:
    """Each rank's output apart in memory from every other rank's buffers (one process holds
    them all, and a loopback group shares one GPU): two ranks' kernels writing one buffer, or
    one writing what another reads, race.  Inputs may be shared: they are only read."""
    refuse_shared_writes(name, [_buffer_extents(rank, c, shape)
                                for rank, (c, (shape, _, _)) in enumerate(zip(ranks, prepared))])


def _buffer_extents(rank: int, c, shape) -> list[tuple[str, int, int, bool]]:
    """(label, start, end, written) of a rank's input and output."""
    bytes_per_unit = shape.count * shape.dtype.itemsize
    return [("x", shape.in_ptr, shape.in_ptr + c.in_units * bytes_per_unit, False),
            ("out", shape.out_ptr, shape.out_ptr + c.out_units * bytes_per_unit, True)]


def refuse_shared_writes(name: str, by_rank: Sequence[Sequence[tuple[str, int, int, bool]]]) -> None:
    """``by_rank[r]``: rank r's (label, start, end, written) extents.  A written extent of one
    rank may overlap nothing of another's; read extents may be shared (a weight every rank reads).
    The extents are swept in address order (every call of a group runs this: comparing all pairs
    took milliseconds at R=64); the conflict reported is the first in rank order, as a scan of
    every pair would find it."""
    extents = sorted((start, end, rank, i) for rank, theirs in enumerate(by_rank)
                     for i, (_, start, end, _) in enumerate(theirs) if start < end)
    conflicts, active = [], []
    for start, end, rank, i in extents:
        active = [a for a in active if a[1] > start]  # those still open here overlap this one
        for _, _, other, j in active:
            if other == rank:
                continue
            for (w, a), (o, b) in (((rank, i), (other, j)), ((other, j), (rank, i))):
                if by_rank[w][a][3]:
                    conflicts.append((w, a, o, b))
        active.append((start, end, rank, i))
    if conflicts:
        rank, i, other, j = min(conflicts)
        label, other_label, other_written = by_rank[rank][i][0], by_rank[other][j][0], by_rank[other][j][3]
        raise ArgumentError(f"{name}: rank {rank}'s {label} overlaps rank {other}'s {other_label} in memory, "
                            "expected a buffer of its own",
                            notes=(f"rank {rank}'s kernel writes its {label} while rank {other}'s "
                                   f"{'writes' if other_written else 'reads'} its {other_label}",))


def per_rank(name: str, label: str, values, world: int) -> list:
    """A group call's list of one entry per rank (None: None for each).  One array is refused:
    list(x) would make each row of a tensor one rank's buffer, so a tensor of R rows would run
    as R inputs."""
    if values is None:
        return [None] * world
    if any(hasattr(values, attr) for attr in ("shape", "__cuda_array_interface__", "__dlpack__")):
        raise ArgumentError(f"{name}: {label} is one array ({type(values).__name__}), expected a list of {world} "
                            "entries (one per rank)")
    # One stream for every rank (streams=torch.cuda.current_stream()) or one number gave list()'s
    # TypeError; a string or a mapping is iterable, and made a rank's buffer of each character or key
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise ArgumentError(f"{name}: {label} is one {type(values).__name__}, expected a list of {world} entries "
                            "(one per rank)")
    values = list(values)
    if len(values) != world:
        raise ArgumentError(f"{name}: {label} has {len(values)} entries, expected {world} (one per rank)")
    return values


def _prepare_ranks(ranks: Sequence, xs, outs, op, streams, count) -> list:
    """Every rank's prepared call.  A rank the spec gives no chunks passes no buffers, yet its
    program may carry the others' data (a ring relays through it): it runs the count and dtype
    of the ranks that have chunks, which one process holding every rank's buffers knows (under
    torchrun such a rank passes ``count=`` and ``dtype=`` itself)."""
    chunked = [i for i, c in enumerate(ranks) if c.in_units or c.out_units]
    prepared: list = [None] * len(ranks)
    for i in chunked:
        prepared[i] = ranks[i].prepare_call(xs[i], outs[i], op, streams[i], count)
    shapes = [prepared[i][0] for i in chunked]
    shown = next((s for s in shapes if s.count), shapes[0] if shapes else None)  # an empty call: count 0
    for i, c in enumerate(ranks):
        if prepared[i] is None:
            prepared[i] = c.prepare_call(xs[i], outs[i], op, streams[i], count if shown is None else shown.count,
                                         None if shown is None else shown.dtype)
    return prepared


def group_operand_words(name: str, ranks: Sequence, prepared, operands: dict) -> list[tuple[int, ...]]:
    """Every rank's epilogue words, all checked before any launch (``()`` each where the
    collective has no epilogue and no operands were given)."""
    world = len(ranks)
    if not operands and all(getattr(c, "epilogue", None) is None for c in ranks):
        return [()] * world
    by_rank: list[dict] = [{} for _ in range(world)]
    for key, value in operands.items():
        if isinstance(value, (list, tuple)):
            if len(value) != world:
                raise ArgumentError(f"{name}: operand {key!r} has {len(value)} entries, expected {world} (one per rank)")
            for rank, v in enumerate(value):
                by_rank[rank][key] = v
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            for rank in range(world):
                by_rank[rank][key] = value  # one number for every rank
        else:
            raise ArgumentError(f"{name}: operand {key!r}: expected a list of one value per rank, "
                                f"got {type(value).__name__}")
    words = [c.operand_words(shape, ops) for c, (shape, _, _), ops in zip(ranks, prepared, by_rank)]
    refuse_shared_writes(name, [_buffer_extents(rank, c, shape) + _operand_extents(c, ops)
                                for rank, (c, (shape, _, _), ops) in enumerate(zip(ranks, prepared, by_rank))])
    return words


def _operand_extents(c, operands: dict) -> list[tuple[str, int, int, bool]]:
    """(label, start, end, written) of a rank's tensor operands (already checked by its
    ``operand_words``): two ranks' residuals in one buffer race as two outputs do."""
    from purlinc.frontend.ast import OperandKind
    from purlinc.runtime.interop import describe

    epilogue = getattr(c, "epilogue", None)
    if epilogue is None:
        return []
    extents = []
    for operand in epilogue.operands:
        if operand.kind is OperandKind.SCALAR:
            continue
        info = describe(operands[operand.name])
        extents.append((f"operand {operand.name!r}", info.ptr, info.ptr + info.nbytes, operand.written))
    return extents


def check_residency(name: str, ranks: Sequence, prepared, known: set) -> None:
    """Refuse, before any launch, a group call whose ranks that share a GPU need more resident
    blocks than it holds (``residency.check``); the ranks' kernels are loaded (``prime``).
    ``known``: the launches already found to fit, so a repeated call costs a set lookup."""
    from purlinc.runtime import driver

    launches = tuple(b for b in (c.blocks(p[0], p[1]) for c, p in zip(ranks, prepared)) if b is not None)
    if launches in known:
        return
    residency.check(name, launches, driver.sm_count)
    known.add(launches)


def _check_streams(name: str, ranks, prepared) -> None:
    """Ranks that share a GPU (a loopback group) wait for each other's kernels: on one
    stream the second would only start once the first gave up waiting."""
    seen: dict[tuple[int, int], int] = {}
    for collective, (shape, handle, _) in zip(ranks, prepared):
        if shape.count == 0:  # nothing is launched
            continue
        other = seen.setdefault((collective.device, handle), collective.rank)
        if other != collective.rank:
            raise ArgumentError(
                f"{name}: ranks {other} and {collective.rank} share cuda:{collective.device} and would run "
                f"on one stream ({handle:#x}), so each would wait for the other forever: pass streams= with "
                "one stream per rank")
