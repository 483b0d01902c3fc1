"""What a run measures: the systems, variants, sizes and views (``Plan``), and its time estimate.
No GPU, no torch."""

from __future__ import annotations

import os
from dataclasses import dataclass

import purlin_api
import report


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


def make_plan(args) -> Plan:
    colls = [c.strip() for c in args.collectives.split(",") if c.strip()]
    bad = [c for c in colls if c not in report.COLLECTIVES]
    if bad:
        raise SystemExit(f"unknown collectives {bad}; choose from {report.COLLECTIVES}")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        raise SystemExit(f"unknown systems {bad}; choose from {SYSTEMS}")
    by_name = {v.name: v for v in purlin_api.VARIANTS}
    if args.variants:
        names = [n.strip() for n in args.variants.split(",") if n.strip()]
    else:
        names = list(purlin_api.QUICK_VARIANTS if args.quick else by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {list(by_name)} (or use --variant-spec)")
    variants = [by_name[n] for n in names] + [purlin_api.parse_variant(s) for s in args.variant_spec]
    explicit = [report.parse_bytes(s) for s in args.sizes.split(",")] if args.sizes else None
    sizes = report.select_sizes(quick=args.quick, min_bytes=args.min_bytes, max_bytes=args.max_bytes,
                                explicit=explicit)
    modes = [m.strip() for m in args.modes.split(",") if m.strip() in report.MODES + (report.INSITU,)]
    world = args.world_size or int(os.environ.get("WORLD_SIZE", "2"))
    return Plan(colls, systems, variants, sizes, modes, tuple(args.nccl_list), tuple(args.calls_list),
                args.many_calls_max_bytes, hier_gpus_per_node(args.hier_gpus_per_node, world))


def hier_gpus_per_node(text: str, world: int) -> tuple[int, ...]:
    """'R,1' -> (R, 1) for this world, duplicates dropped; a G that does not divide R stays
    (its load fails with the TopologyError, recorded as the variant's error row)."""
    out: list[int] = []
    for token in filter(None, (t.strip() for t in text.split(","))):
        g = world if token.upper() == "R" else int(token)
        if g < 1:
            raise SystemExit(f"--hier-gpus-per-node: {token!r} is not a positive number of GPUs")
        if g not in out:
            out.append(g)
    return tuple(out)


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
