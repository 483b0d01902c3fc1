"""Rows, agreement and the report of the end-to-end decode benchmark (no GPU needed).

One row per (system, batch): ``step_us`` (the whole decode step, one CUDA graph replay: per
repeat the slowest rank's time, then the median of those per-repeat maxima; ``step_us_min`` /
``step_us_max``: their smallest and largest), ``comm_us`` (``step_us`` minus the no-communication step's), and
``comm_vs_best_nccl`` (``comm_us`` over the lowest NCCL setting's at that batch, ``best_nccl``: below
1 is less communication time than NCCL at its best), ``agrees`` (the final hidden states against the
reference system's, within ``TOLERANCE``) and ``error``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchlib.rows import BAD_TIME, finite_only
from benchlib.sizes import valid_time

# bf16 through every layer, partial sums added in different orders by different systems: the
# largest difference relative to the largest reference value.
TOLERANCE = 2e-2
NCCL = ("nccl", "nccl-nomix", "nccl-symm")


def row(system: str, batch: int, world: int, step_us: float | None, reps: list[float] | None, *,
        agree: tuple[bool, str] | None = None, error: str | None = None, **extra) -> dict:
    """A result row; one whose time (or any repeat's) is not a finite positive number is an
    error row (``timing_checked``)."""
    return timing_checked({
        "system": system, "batch": batch, "world_size": world, "step_us": step_us,
        "step_us_min": min(reps) if reps and all(map(valid_time, reps)) else None,
        "step_us_max": max(reps) if reps and all(map(valid_time, reps)) else None,
        "agrees": None if agree is None else agree[0], "agree_note": None if agree is None else agree[1],
        "error": error, **extra}, reps)


def timing_checked(r: dict, reps: list | None = None) -> dict:
    """``r`` as an error row when its ``step_us`` (or one of ``reps``) is there but is not a
    finite positive number: a NaN, infinite, zero or negative step is no measurement, so it is
    never a baseline, never the best NCCL and never compared.  ``bad_time`` keeps what was given."""
    given = [t for t in [r.get("step_us"), *(reps or [])] if t is not None]
    bad = [t for t in given if not valid_time(t)]
    if not bad:
        return r
    why = f"{BAD_TIME}: step time {bad[0]!r} is not a finite positive number"
    return {**r, "step_us": None, "step_us_min": None, "step_us_max": None, "comm_us": None,
            "comm_vs_best_nccl": None, "best_nccl": None, "bad_time": repr(bad[0]), "error": r.get("error") or why}


def bad_timings(rows: list[dict]) -> int:
    """How many rows had a step time that is not a finite positive number (error rows now)."""
    return sum(1 for r in rows if r.get("bad_time") is not None)


def median(values: list[float]) -> float:
    return statistics.median(values)


def agree(got, want, tolerance: float) -> tuple[bool, str]:
    """Whether ``got`` equals ``want`` within ``tolerance`` (max |difference| / max |want|)."""
    g, w = got.float(), want.float()
    bad = int((~g.isfinite()).sum())
    if bad:
        return False, f"{bad} of {g.numel()} values not finite"
    if g.shape != w.shape:
        return False, f"shape {tuple(g.shape)} != {tuple(w.shape)}"
    err = float((g - w).abs().max() / w.abs().max().clamp_min(1e-30))
    return err <= tolerance, f"max rel err {err:.1e}"


def reference_agrees(finals, what: str) -> tuple[bool, str]:
    """The reference row's own check: its outputs finite.  It was marked as agreeing
    unconditionally, so a reference gone NaN showed "yes" and blamed every other system."""
    for rank, final in enumerate(finals):
        bad = int((~final.float().isfinite()).sum())
        if bad:
            where = f"rank {rank}: " if len(finals) > 1 else ""  # one rank's own (torchrun) names no rank
            return False, f"the reference itself: {where}{bad} of {final.numel()} values not finite"
    return True, what


def _timed(r: dict) -> bool:
    return r.get("error") is None and valid_time(r.get("step_us"))


def add_comm_time(rows: list[dict]) -> None:
    """``comm_us`` and ``comm_vs_best_nccl`` on every row with a time, from the ``none`` row of
    its batch and the lowest NCCL ``comm_us`` of that batch.  Rows whose step time is not a
    finite positive number become error rows first (in place: rows read back from the NCCL
    child's file too), so none of them is a baseline or the best NCCL."""
    rows[:] = [timing_checked(r) for r in rows]
    for batch in {r["batch"] for r in rows}:
        here = [r for r in rows if r["batch"] == batch]
        bare = next((r["step_us"] for r in here if r["system"] == "none" and _timed(r)), None)
        for r in here:
            if r["system"] != "none" and _timed(r) and bare is not None:
                r["comm_us"] = r["step_us"] - bare
        nccl = [r for r in here if r["system"] in NCCL and r.get("comm_us") is not None
                and r.get("agrees") is not False]
        best = min(nccl, key=lambda r: r["comm_us"]) if nccl else None
        for r in here:
            # comm_us at or below zero (the step within the noise of the bare one) has no ratio
            if valid_time(r.get("comm_us")) and best is not None and valid_time(best["comm_us"]):
                # the ratio names the NCCL setting it is over (it may differ from batch to batch)
                r["comm_vs_best_nccl"], r["best_nccl"] = r["comm_us"] / best["comm_us"], best["system"]


def unchecked_batches(rows: list[dict]) -> list[int]:
    """The batches at which some system ran but nothing could be compared: the ``reference`` row
    is missing or failed.  A run with any is a failure (``run.write``): no agreement was shown."""
    out = []
    for batch in sorted({r["batch"] for r in rows}):
        here = [r for r in rows if r["batch"] == batch]
        ref = next((r for r in here if r["system"] == "reference"), None)
        ran = [r for r in here if r["system"] not in ("none", "reference") and r.get("error") is None]
        if ran and (ref is None or ref.get("error") is not None):
            out.append(batch)
    return out


def _num(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(rows: list[dict], meta: dict) -> str:
    where = (f"loopback: {meta.get('world_size')} ranks on one GPU, so no link speed in any number "
             "(correctness and the compute around the calls only)" if meta.get("loopback") else
             f"{meta.get('world_size')} ranks, one process per GPU (torchrun)")
    out = [f"# Decode step, Llama-3-8B-class, TP={meta.get('world_size')} ({meta.get('date', '?')})", "",
           f"{where}; {meta.get('layers')} layers, KV cache {meta.get('kv_len')} tokens, bf16, random weights; "
           "the whole step is one CUDA graph.",
           "'comm us' = step minus the step without communication ('none'); 'vs best NCCL' = comm us over the "
           "lowest NCCL setting's, named in brackets (nccl = default, nomix = NCCL_GRAPH_MIXING_SUPPORT=0, "
           "symm = symmetric windows); "
           "'agrees': final hidden states against the reference system's.", "",
           "| batch | system | step us | comm us | vs best NCCL | agrees |", "|---|---|---|---|---|---|"]
    rows = [timing_checked(r) for r in rows]
    for r in sorted(rows, key=lambda r: (r["batch"], _order(r["system"]))):
        if r.get("error"):
            out.append(f"| {r['batch']} | {r['system']} | - | - | - | {r['error'][:160]} |")
            continue
        ratio = r.get("comm_vs_best_nccl")
        vs = "-" if ratio is None else f"{ratio:.2f}x" + (f" ({r['best_nccl']})" if r.get("best_nccl") else "")
        agrees = "-" if r.get("agrees") is None else ("yes" if r["agrees"] else f"NO ({r.get('agree_note')})")
        out.append(f"| {r['batch']} | {r['system']} | {_num(r['step_us'])} | {_num(r.get('comm_us'))} | "
                   f"{vs} | {agrees} |")
    missing = unchecked_batches(rows)
    if missing:
        out += ["", f"NOT CHECKED: the reference failed or is missing at batch {', '.join(map(str, missing))}, so no "
                "system's output was compared there (the run's exit status is 1)."]
    bad = bad_timings(rows)
    if bad:
        out += ["", f"{bad} row{'' if bad == 1 else 's'} with a step time that is not a finite positive number "
                "(NaN, infinite, zero or negative): error rows, never a baseline or the best NCCL."]
    out.append("")
    return "\n".join(out)


SYSTEM_ORDER = ("none", "reference", "nccl", "nccl-nomix", "nccl-symm", "symm-one-shot", "symm-two-shot",
                "purlin", "purlin-heap", "purlin-fused")


def _order(system: str) -> int:
    return SYSTEM_ORDER.index(system) if system in SYSTEM_ORDER else len(SYSTEM_ORDER)


def write(rows: list[dict], meta: dict, out_dir: Path, stem: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{stem}.json", "md": out_dir / f"{stem}.md"}
    body = ",\n".join(strict_json(timing_checked(r), separators=(",", ":")) for r in rows)
    paths["json"].write_text('{"meta":' + strict_json(meta) + ',\n"rows":[\n' + body + "\n]}\n")
    paths["md"].write_text(markdown(rows, meta))
    return paths


def strict_json(value, **options) -> str:
    """JSON any reader takes: no NaN or Infinity (those numbers say nothing: null)."""
    return json.dumps(finite_only(value), default=str, allow_nan=False, **options)
