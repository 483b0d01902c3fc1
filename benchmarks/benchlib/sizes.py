"""Sizes, buffer layouts, bandwidth conventions, the run-time estimate and the wire model
(``limit_us``): what a benchmark row's numbers mean.  No GPU, no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass


KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

COLLECTIVES = (
    "allreduce", "allgather", "reduce_scatter", "alltoall",
    "broadcast", "reduce", "gather", "scatter",
)
REDUCE_COLLECTIVES = frozenset({"allreduce", "reduce_scatter", "reduce"})
ROOTED = frozenset({"broadcast", "reduce", "gather", "scatter"})
# The collectives whose large-message target asks for >= 1.1x NCCL and >= 90 % of peak.
BANDWIDTH_BOUND = ("allgather", "reduce_scatter", "alltoall")
MODES = ("eager", "graph")
# In-situ rows (benchlib/insitu.py): the time a call adds between a producer and a consumer
# kernel in a graph; a view of their own, outside the back-to-back tables and targets.
INSITU = "insitu"
HIER = "purlin/hierarchical"  # Purlin inside nodes of G ranks, NCCL between them; variants g<G>
SYSTEMS = ("nccl", "symm_mem", "purlin", HIER)

# Alignment: every chunk a multiple of 16 bytes (the ldst atom moves 16-byte vectors).
ALIGN_BYTES = 16


# --------------------------------------------------------------------------- sizes


def quick_sizes() -> list[int]:
    return [1 * KiB, 16 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 256 * MiB]


def full_sizes() -> list[int]:
    """1 KiB .. 1 GiB by powers of 4, plus the powers of 2 between 1 and 16 MiB."""
    sizes = {KiB * 4**k for k in range(11)}  # 1 KiB .. 1 GiB
    sizes |= {2 * MiB, 8 * MiB}
    return sorted(sizes)


def select_sizes(*, quick: bool, min_bytes: int = 0, max_bytes: int | None = None,
                 explicit: list[int] | None = None) -> list[int]:
    sizes = explicit if explicit else (quick_sizes() if quick else full_sizes())
    return sorted(s for s in set(sizes) if s >= min_bytes and (max_bytes is None or s <= max_bytes))


def parse_bytes(text: str) -> int:
    """'64K', '1MiB', '1G', '4096' -> bytes (binary units); ValueError saying what was given
    and what a size looks like otherwise (negative, not finite or not a number)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": KiB, "M": MiB, "G": GiB}.get(t[-1:], 1)
    number = t[:-1] if scale != 1 else t
    try:
        value = float(number) * scale
    except ValueError:
        value = math.nan
    # float() also reads 'nan', 'inf' and '-1': none of them is a number of bytes
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{text!r} is not a size: expected a number of bytes >= 0 with an optional "
                         "K, M or G suffix (e.g. 4096, 64K, 1MiB)")
    return int(value)


def parse_cpu_list(text: str) -> list[int]:
    """A kernel CPU list ('0-3,8,10-11', as sysfs writes it) -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# --------------------------------------------------------------------------- layouts


@dataclass(frozen=True, slots=True)
class Layout:
    """Element counts of one call, as Purlin's .pln specs and NCCL both see them."""

    collective: str
    world_size: int
    count: int  # elements per chunk (the .pln ``count``)
    in_elems: int  # one rank's input (the root's, for rooted collectives)
    out_elems: int  # one rank's output (the root's, for gather)
    itemsize: int

    @property
    def bytes(self) -> int:
        """nccl-tests' size: the larger of one rank's input and output."""
        return max(self.in_elems, self.out_elems) * self.itemsize


def layout(collective: str, world_size: int, nbytes: int, itemsize: int = 2) -> Layout:
    """Map the benchmark's ``bytes`` to the chunk count, rounding down to 16-byte chunks (at
    least one: a size below one chunk per rank is measured as one chunk per rank).

    allreduce / alltoall: in = out = R*count; allgather / gather: in = count, out = R*count;
    reduce_scatter / scatter: in = R*count, out = count; broadcast / reduce: in = out = count.
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}")
    r = world_size
    per_chunk = ALIGN_BYTES // itemsize
    chunks = 1 if collective in ("broadcast", "reduce") else r
    count = max(per_chunk, (nbytes // (itemsize * chunks)) // per_chunk * per_chunk)
    in_chunks, out_chunks = {
        "allreduce": (r, r), "alltoall": (r, r),
        "allgather": (1, r), "gather": (1, r),
        "reduce_scatter": (r, 1), "scatter": (r, 1),
        "broadcast": (1, 1), "reduce": (1, 1),
    }[collective]
    return Layout(collective, r, count, in_chunks * count, out_chunks * count, itemsize)


def busbw_factor(collective: str, world_size: int) -> float:
    """nccl-tests' doc/PERFORMANCE.md (gather/scatter as in its gather.cu / scatter.cu)."""
    r = world_size
    if collective == "allreduce":
        return 2 * (r - 1) / r
    if collective in ("broadcast", "reduce"):
        return 1.0
    return (r - 1) / r  # allgather, reduce_scatter, alltoall, gather, scatter


def finite_positive(x) -> bool:
    """A real number (not a bool, not a string), finite and above zero."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def valid_time(time_us) -> bool:
    """A measured time: a finite number above zero.  Anything else (None, NaN, inf, 0, a
    negative, a string) is no timing: its row is an error row, never a best or a target."""
    return finite_positive(time_us)


def algbw_gbps(nbytes: int, time_us: float | None) -> float | None:
    if not valid_time(time_us):
        return None
    return nbytes / (time_us * 1e3)  # bytes / (us * 1e-6) / 1e9


def busbw_gbps(collective: str, world_size: int, nbytes: int, time_us: float | None) -> float | None:
    alg = algbw_gbps(nbytes, time_us)
    return None if alg is None else alg * busbw_factor(collective, world_size)


# --------------------------------------------------------------------------- run-time estimate


def estimate_case_s(nbytes: int, *, reps: int, target_rep_us: float, modes: int = 2) -> float:
    """A rough wall-clock cost of one (system, variant, size) case: both modes + the check.

    Model: a call costs 15 us + bytes / 150 GB/s; iterations per repeat are chosen to fill
    ``target_rep_us`` (2..100 here; the bench's eager loops and graph replays fill it by measured
    times, benchlib.timing.eager_iters and graph_replays); fixed overheads (barriers, graph capture,
    the check's reference) about 40 ms per case.  Runs 18-21 (--quick) took 155-185 s against
    this model's 264 s.
    """
    call_us = 15.0 + nbytes / 150e3
    iters = min(100, max(2, int(target_rep_us / call_us)))
    calls = 4 + reps * iters + (iters + 1)  # warm-up + repeats + graph capture/warm replay
    check_us = 3 * call_us + 2 * nbytes / 100e3
    return 0.04 + (modes * calls * call_us + check_us) * 1e-6


def estimate_run_s(plan: list[tuple[str, int, int]], *, reps: int, target_rep_us: float,
                   modes: int, loads: int, load_s: float = 2.0, startup_s: float = 20.0) -> float:
    """``plan``: (collective, bytes, cases) triples."""
    cases = sum(estimate_case_s(b, reps=reps, target_rep_us=target_rep_us, modes=modes) * n
                for _, b, n in plan)
    return startup_s + loads * load_s + cases


# --------------------------------------------------------------------------- the wire model

LAUNCH_US = 0.56  # an empty kernel inside a CUDA graph (H200)
SIGNAL_US = 1.26  # one release store -> acquire poll across NVLink
TWO_WAY_GBPS = 365.0  # each way, with both directions busy (730 GB/s together)
ONE_WAY_GBPS = 396.0  # one direction alone (copy-engine peak at 1 GiB)
TWO_WAY = frozenset({"allreduce", "allgather", "reduce_scatter", "alltoall"})


def wire_bytes(collective: str, world_size: int, nbytes: int) -> float:
    """Bytes the busiest link direction of one rank must carry (nccl-tests' bus bytes)."""
    return busbw_factor(collective, world_size) * nbytes


def limit_us(collective: str, world_size: int, nbytes: int) -> float:
    gbps = TWO_WAY_GBPS if collective in TWO_WAY else ONE_WAY_GBPS
    return LAUNCH_US + SIGNAL_US + wire_bytes(collective, world_size, nbytes) / (gbps * 1e3)


def pct_of_limit(collective: str, world_size: int, nbytes: int, time_us: float | None) -> float | None:
    """100 = at the wire limit; lower is slower."""
    if not valid_time(time_us):
        return None
    return 100.0 * limit_us(collective, world_size, nbytes) / time_us


