"""Latency and bandwidth plots (PNG, matplotlib when present)."""

from __future__ import annotations

import math
from pathlib import Path

from benchlib.rows import best_nccl, best_of, best_purlin, collectives_of, graph_counts, ok, one, prepared, select, sizes_of, world_size_of
from benchlib.sizes import HIER, busbw_gbps, fmt_bytes, limit_us
from benchlib.tables import _view_name, hier_variants
from benchlib.targets import _default


# --------------------------------------------------------------------------- plots


def plot(doc: dict, out_dir: Path, stem: str) -> list[Path]:
    """Three PNGs: graph latency, eager latency, graph busbw; one panel per collective."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    doc = prepared(doc)
    rows = doc["rows"]
    colls = collectives_of(rows)
    if not colls:
        return []
    files = []
    for mode, metric, label in (("graph", "time_us", "time per call (us)"),
                                ("eager", "time_us", "time per call (us)"),
                                ("graph", "busbw_gbps", "bus bandwidth (GB/s)")):
        sub = select(rows, mode)
        if not sub:
            continue
        ncols = min(4, len(colls))
        nrows = math.ceil(len(colls) / ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False)
        for ax, coll in zip(axes.flat, colls):
            for name, series in _series(sub, coll, mode, metric).items():
                if series:
                    xs, ys = zip(*series)
                    style = dict(linestyle="--", color="gray") if name == "wire limit" else {}
                    ax.plot(xs, ys, marker="o", markersize=3, label=name, **style)
            ax.set_xscale("log", base=2)
            ticks = sizes_of(rows, coll)
            if len(ticks) > 7:  # keep the labels readable: every other size
                ticks = ticks[::2]
            ax.set_xticks(ticks, [fmt_bytes(t).replace(" ", "") for t in ticks], rotation=45, fontsize=7)
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_title(coll)
            ax.set_xlabel("bytes")
            ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6)
        for ax in list(axes.flat)[len(colls):]:
            ax.axis("off")
        what = "latency" if metric == "time_us" else "busbw"
        calls = graph_counts(rows)[0] if mode == "graph" and graph_counts(rows) else None
        fig.suptitle(f"{doc.get('meta', {}).get('machine', '')} R={world_size_of(doc)}: {what}, "
                     f"{_view_name(mode, calls)}")
        fig.tight_layout()
        path = out_dir / f"{stem}-{what}-{mode}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


def _series(rows: list[dict], coll: str, mode: str, metric: str) -> dict[str, list[tuple[int, float]]]:
    names = ("nccl default", "nccl best", "purlin default", "purlin zero-copy", "purlin best", "symm_mem best",
             "wire limit")
    out: dict[str, list[tuple[int, float]]] = {k: [] for k in names}
    for nbytes in sizes_of(rows, coll):
        picks = {
            "nccl default": one(rows, system="nccl", variant="default", collective=coll, bytes=nbytes, mode=mode),
            "nccl best": best_nccl(rows, coll, nbytes, mode),
            "purlin default": _default(rows, coll, nbytes, mode),
            "purlin zero-copy": one(rows, system="purlin", variant="zerocopy", collective=coll, bytes=nbytes, mode=mode),
            "purlin best": best_purlin(rows, coll, nbytes, mode),
            "symm_mem best": best_of(rows, "symm_mem", coll, nbytes, mode),
        }
        for v in hier_variants(rows):
            picks[f"hierarchical {v}"] = one(rows, system=HIER, variant=v, collective=coll, bytes=nbytes, mode=mode)
        for name, row in picks.items():
            if row is not None and ok(row) and row.get(metric):
                out.setdefault(name, []).append((nbytes, row[metric]))
        world = next((r.get("world_size") for r in rows if r.get("world_size")), 2)
        lim = limit_us(coll, world, nbytes)
        out["wire limit"].append((nbytes, lim if metric == "time_us" else busbw_gbps(coll, world, nbytes, lim)))
    return {k: v for k, v in out.items() if v}


