"""Writing a run's files: JSON (one row per line), Markdown, tuning table, plots."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchlib.plots import plot
from benchlib.rows import prepared, tuning_table
from benchlib.tables import markdown


# --------------------------------------------------------------------------- writing


def write_all(doc: dict, results_dir: Path, stem: str, *, plots: bool = True) -> dict[str, Path]:
    """``<stem>.json``, ``<stem>.md``, ``<stem>-tuning.json`` and the PNGs."""
    results_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": results_dir / f"{stem}.json", "md": results_dir / f"{stem}.md",
             "tuning": results_dir / f"{stem}-tuning.json"}
    doc = prepared(doc)
    # Compact JSON: one row per line keeps the file small and diffable.
    rows = ",\n".join(json.dumps(r, separators=(",", ":"), default=str) for r in doc["rows"])
    meta = json.dumps(doc["meta"], separators=(",", ":"), default=str)
    _atomic_write(paths["json"], '{"meta":' + meta + ',\n"rows":[\n' + rows + "\n]}\n")
    _atomic_write(paths["md"], markdown(doc))
    _atomic_write(paths["tuning"], json.dumps(tuning_table(doc), indent=1))
    if plots:
        for i, p in enumerate(plot(doc, results_dir, stem)):
            paths[f"png{i}"] = p
    return paths


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def median(values: list[float]) -> float:
    return statistics.median(values)

