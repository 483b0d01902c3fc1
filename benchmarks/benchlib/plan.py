"""What a run measures: the systems, variants, sizes and views (``Plan``), and its time estimate.
No GPU, no torch."""

from __future__ import annotations

import os
from dataclasses import dataclass

import purlin_api
import report
from benchlib import argtypes


HIER = "purlin/hierarchical"  # Purlin inside nodes of G ranks, NCCL between them (docs/HIERARCHY.md)
SYSTEMS = ("nccl", "symm_mem", "purlin", HIER)
NCCL_VARIANTS = ("default", "nomix", "symm")
# The collectives NCCL 2.28 has symmetric kernels for (all-to-all runs its ordinary kernels on
# the registered buffers; measured too, the row says which method registered them).
NCCL_SYMM_COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "alltoall")


@dataclass(frozen=True)
class Plan:
    collectives: list[str]
    systems: list[str]
    variants: list[purlin_api.Variant]
    sizes: list[int]
    modes: list[str]
    nccl: tuple[str, ...] = ("default",)
    calls: tuple[int, ...] = (20, 100)
    many_calls_max_bytes: int | None = None  # graphs beyond the first calls value only up to here
    hier: tuple[int, ...] = ()  # gpus_per_node of the purlin/hierarchical variants (g<G>)

    def views(self, nbytes: int | None = None) -> list[tuple[str, int | None]]:
        """(mode, calls per graph) of the rows every case of size ``nbytes`` gets (the same
        for every system: the bound is on the size, never on a system's speed)."""
        out = [("eager", None)] if "eager" in self.modes else []
        counts = [c for i, c in enumerate(self.calls)
                  if i == 0 or nbytes is None or self.many_calls_max_bytes is None or nbytes <= self.many_calls_max_bytes]
        for mode in ("graph", report.INSITU):
            if mode in self.modes:
                out += [(mode, c) for c in counts]
        return out

    def cases(self, collective: str) -> int:
        n = 0
        if "nccl" in self.systems:
            n += sum(1 for v in self.nccl if v != "symm" or collective in NCCL_SYMM_COLLECTIVES)
        if "symm_mem" in self.systems and collective == "allreduce":
            n += 2
        if "purlin" in self.systems:
            n += sum(1 for v in self.variants if v.applies(collective))
        if HIER in self.systems:
            n += len(self.hier)
        return n

    def hier_loads(self) -> int:
        return len(self.collectives) * len(self.hier) if HIER in self.systems else 0

    def loads(self) -> int:
        if "purlin" not in self.systems:
            return 0
        keys = {(c, purlin_api.load_key(v)) for c in self.collectives for v in self.variants if v.applies(c)}
        return len(keys)


class PlanError(ValueError):
    """A plan the options cannot make (unknown names, nothing to measure); the message names
    the option, what it was given and what it takes (bench.py's parser.error shows it)."""


MODES = report.MODES + (report.INSITU,)


def _names(text: str, known, what: str, option: str) -> list[str]:
    try:
        return argtypes.names(text, known, what)
    except ValueError as error:
        raise PlanError(f"{option}: {error}") from None


def plan_world(args) -> int:
    """The world the plan is for: --world-size, else torchrun's WORLD_SIZE, else 2."""
    if args.world_size:
        return args.world_size
    text = os.environ.get("WORLD_SIZE", "2")
    if not (text.isascii() and text.isdigit() and int(text) >= 1):
        raise PlanError(f"the environment's WORLD_SIZE {text!r} is not a positive number of ranks")
    return int(text)


def _variants(args) -> list[purlin_api.Variant]:
    by_name = {v.name: v for v in purlin_api.VARIANTS}
    if args.variants:
        names = _names(args.variants, list(by_name), "Purlin variants", "--variants")
    else:
        names = list(purlin_api.QUICK_VARIANTS if args.quick else by_name)
    extra = []
    for text in args.variant_spec:
        try:
            extra.append(purlin_api.parse_variant(text))
        except ValueError as error:
            raise PlanError(str(error)) from None
    clash = [v.name for v in extra if v.name in names or [e.name for e in extra].count(v.name) > 1]
    if clash:
        raise PlanError(f"--variant-spec: the name {clash[0]!r} is taken (a variant's rows are keyed by name); "
                        "give each spec a name of its own")
    return [by_name[n] for n in names] + extra


def _sizes(args) -> list[int]:
    explicit = args.sizes if args.sizes else None  # bytes already (argtypes.byte_size_list)
    sizes = report.select_sizes(quick=args.quick, min_bytes=args.min_bytes, max_bytes=args.max_bytes,
                                explicit=explicit)
    if not sizes:
        given = [f"--min-bytes {report.fmt_bytes(args.min_bytes)}"]
        if args.max_bytes is not None:
            given.append(f"--max-bytes {report.fmt_bytes(args.max_bytes)}")
        source = "--sizes" if explicit else ("the --quick sizes" if args.quick else "the default sizes")
        raise PlanError(f"no sizes to measure: none of {source} lies within {' and '.join(given)}")
    return sizes


def make_plan(args) -> Plan:
    """The plan of ``args`` (bench.py's parsed options); PlanError when they make none."""
    colls = _names(args.collectives, report.COLLECTIVES, "collectives", "--collectives")
    systems = _names(args.systems, SYSTEMS, "systems", "--systems")
    variants = _variants(args)
    modes = _names(args.modes, MODES, "modes", "--modes")
    hier = hier_gpus_per_node(args.hier_gpus_per_node, plan_world(args))
    if HIER in systems and not hier:
        raise PlanError(f"--hier-gpus-per-node: no GPUs-per-node values for {HIER} ({args.hier_gpus_per_node!r})")
    return Plan(colls, systems, variants, _sizes(args), modes, tuple(args.nccl_list), tuple(args.calls_list),
                args.many_calls_max_bytes, hier)


def hier_gpus_per_node(text: str, world: int) -> tuple[int, ...]:
    """'R,1' -> (R, 1) for this world, duplicates dropped.  A G above R is no node of this
    world (PlanError); a G that does not divide R stays (its load fails with the runtime's
    TopologyError, recorded as the variant's error row: the runtime owns that rule)."""
    out: list[int] = []
    for token in filter(None, (t.strip() for t in text.split(","))):
        if token.upper() == "R":
            g = world
        elif token.isascii() and token.lstrip("+-").isdigit():
            g = int(token)
        else:
            raise PlanError(f"--hier-gpus-per-node: {token!r} is not a number of GPUs (an integer, or R for the world)")
        if g < 1:
            raise PlanError(f"--hier-gpus-per-node: {token!r} is not a positive number of GPUs")
        if g > world:
            raise PlanError(f"--hier-gpus-per-node: {g} GPUs per node is more than the world's {world} ranks")
        if g not in out:
            out.append(g)
    return tuple(out)


def measured_sizes(sizes, coll: str, world: int) -> list[int]:
    """The sizes of ``sizes`` that measure a call of their own for ``coll`` over ``world`` ranks,
    in order: ``report.layout`` rounds a size to whole 16-byte chunks (at least one), so two
    sizes can make one call (1000 and 1001 B are both 992 B at R=2, 3 and 5 B both 32 B).
    Measured twice, that call would cost its time twice and write two rows with one key, which
    the report refuses to read."""
    seen: set[int] = set()
    out = []
    for nbytes in sizes:
        measured = report.layout(coll, world, nbytes).bytes
        if measured not in seen:
            seen.add(measured)
            out.append(nbytes)
    return out


def estimate_s(plan: Plan, args) -> float:
    est = report.estimate_run_s([], reps=args.reps, target_rep_us=args.target_rep_us, modes=1,
                                loads=plan.loads() + plan.hier_loads())
    for s in plan.sizes:
        triples = [(c, s, plan.cases(c)) for c in plan.collectives]
        est += report.estimate_run_s(triples, reps=args.reps, target_rep_us=args.target_rep_us,
                                     modes=len(plan.views(s)), loads=0, startup_s=0.0)
    if "nccl" in plan.systems and set(plan.nccl) - {"default"}:
        est += 25.0  # the NCCL child's start-up (torch import, communicator)
    return est


def describe_plan(plan: Plan, args, world: int) -> str:
    est = estimate_s(plan, args)
    lines = [
        f"plan: R={world}, {len(plan.collectives)} collectives x {len(plan.sizes)} sizes "
        f"({report.fmt_bytes(plan.sizes[0]) if plan.sizes else '-'} .. "
        f"{report.fmt_bytes(plan.sizes[-1]) if plan.sizes else '-'}), modes {','.join(plan.modes)}",
        f"  systems: {', '.join(plan.systems)}; NCCL variants: {', '.join(plan.nccl)}; "
        f"Purlin variants: {', '.join(v.name for v in plan.variants)}; calls per graph: "
        f"{', '.join(str(c) for c in plan.calls)}",
        f"  cases: {sum(plan.cases(c) for c in plan.collectives) * len(plan.sizes)}; Purlin loads: {plan.loads()}"
        + (f"; {HIER}: gpus_per_node {', '.join(str(g) for g in plan.hier)} "
           f"({', '.join(f'{world // g} x {g}' if world % g == 0 else f'{g} (not a divisor of R)' for g in plan.hier)}"
           f" nodes x GPUs), {plan.hier_loads()} loads" if HIER in plan.systems and plan.hier else ""),
        f"  estimated wall time: {est:.0f} s (model in report.estimate_case_s; first-run NVRTC compiles "
        f"counted at 2 s per load); budget {args.budget_s:.0f} s, hard guard {args.timeout_s:.0f} s",
    ]
    return "\n".join(lines)
