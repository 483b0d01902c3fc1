"""Reading and writing a run's files: JSON (one row per line, strict: no NaN), Markdown,
tuning table, plots."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchlib.plots import plot
from benchlib.rows import finite_only, KEY_FIELDS, normalize, prepared, row_key, tuning_table, world_size_of
from benchlib.sizes import COLLECTIVES, INSITU, MODES, SYSTEMS
from benchlib.tables import markdown


# --------------------------------------------------------------------------- reading


class ResultsError(ValueError):
    """A results file that cannot be read as ``{"meta": {...}, "rows": [{...}, ...]}``; the
    message is one line naming the file and what is wrong."""


# Row fields the report sorts, matches or computes with: their JSON type when present.
ROW_TYPES = {"system": str, "variant": str, "collective": str, "mode": str, "dtype": str,
             "bytes": int, "count": int, "world_size": int, "calls_per_graph": int}
POSITIVE = ("world_size", "calls_per_graph")  # counts of ranks and calls: 0 or less is no run
# Every row bench.py writes names these, error rows too: a file whose rows do not is another
# tool's result (moe_dispatch, e2e, epilogue ...), which the report would collapse and rewrite.
REQUIRED = ("system", "variant", "collective")
# What every row that is no error row names besides: without a time it would be in no table,
# no best and no target, dropped without a word.
MEASURED = ("bytes", "mode", "time_us")
ROW_MODES = (*MODES, INSITU)
ROW_KINDS = {"checked": (bool, "a boolean"), "options": (dict, "an object"), "sms": (int, "an integer"),
             "algbw_gbps": ((int, float), "a number"), "busbw_gbps": ((int, float), "a number")}
META_OBJECTS = ("peaks", "purlin_footprint", "nccl_variants")  # meta fields the report reads as objects
SHAPE = 'a JSON object {"meta": {...}, "rows": [{...}, ...]} as benchmarks/bench.py writes it'


def _json_type(value) -> str:
    """How JSON names the type of ``value`` (what the error messages say was given)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    for kind, name in ((dict, "an object"), (list, "a list"), (str, "a string"), (int, "an integer"),
                       (float, "a number")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _is(value, kind: type) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool)  # JSON true is no integer


def _check_row(row, where: str) -> None:
    if not isinstance(row, dict):
        raise ResultsError(f"{where}: expected an object, got {_json_type(row)}")
    for key, kind in ROW_TYPES.items():
        value = row.get(key)
        if value is not None and not _is(value, kind):
            want = "an integer" if kind is int else "a string"
            raise ResultsError(f"{where}: {key} {value!r} should be {want} (or null), not {_json_type(value)}")
    for key in POSITIVE:
        if row.get(key) is not None and row[key] < 1:
            raise ResultsError(f"{where}: {key} {row[key]} should be at least 1")
    if row.get("bytes") is not None and row["bytes"] < 0:
        raise ResultsError(f"{where}: bytes {row['bytes']} should be at least 0")
    for key, (kind, want) in ROW_KINDS.items():
        value = row.get(key)
        if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
            raise ResultsError(f"{where}: {key} {value!r} should be {want} (or null), not {_json_type(value)}")
    missing = [key for key in REQUIRED if row.get(key) is None]
    if missing:
        raise ResultsError(f"{where}: no {' or '.join(missing)}: not a benchmarks/bench.py result (its rows "
                           f"name {', '.join(REQUIRED)})")
    if row["system"] not in SYSTEMS:  # the tables select rows by system: another would vanish
        raise ResultsError(f"{where}: unknown system {row['system']!r}; expected one of {', '.join(SYSTEMS)}")
    if row["collective"] not in COLLECTIVES:
        raise ResultsError(f"{where}: unknown collective {row['collective']!r}; expected one of {', '.join(COLLECTIVES)}")
    if row.get("mode") is not None and row["mode"] not in ROW_MODES:
        raise ResultsError(f"{where}: unknown mode {row['mode']!r}; expected one of {', '.join(ROW_MODES)}")
    if row.get("error") is None:  # only an error row (a failed load) may lack what it measured
        unnamed = [key for key in MEASURED if row.get(key) is None]
        if unnamed:
            raise ResultsError(f"{where}: no {' or '.join(unnamed)} in a row without an error; every measured "
                               f"row names its {', '.join(MEASURED)}")


def _check_meta(meta, where: str) -> None:
    if not isinstance(meta, dict):
        raise ResultsError(f"{where}: \"meta\" should be an object, not {_json_type(meta)}")
    ws = meta.get("world_size")
    if ws is not None and not (_is(ws, int) and ws >= 1):
        raise ResultsError(f"{where}: meta world_size {ws!r} should be a positive integer")
    for key in META_OBJECTS:
        value = meta.get(key)
        if value is not None and not isinstance(value, dict):
            raise ResultsError(f"{where}: meta {key} should be an object, not {_json_type(value)}")
    for method, m in (meta.get("peaks") or {}).items():
        points = m.get("points", []) if isinstance(m, dict) else []
        if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
            raise ResultsError(f"{where}: meta peaks {method!r} points should be a list of objects")
        for point in points:
            for key, kind, want in (("bytes", int, "an integer"), ("gbps", (int, float), "a number")):
                value = point.get(key)
                if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
                    raise ResultsError(f"{where}: meta peaks {method!r} point {key} {value!r} should be {want} "
                                       f"(or null), not {_json_type(value)}")


def check_shape(doc, where: str) -> dict:
    """``doc`` if it has the shape the report reads (``rows`` a list of row objects whose key
    fields have their types; ``meta`` an object, optional); ResultsError otherwise.  A row's
    time is not checked here: a bad one makes an error row (benchlib.rows.timing_checked)."""
    if not isinstance(doc, dict):
        raise ResultsError(f"{where}: expected {SHAPE}, got {_json_type(doc)}")
    if not isinstance(doc.get("rows"), list):
        got = "no \"rows\"" if "rows" not in doc else f"\"rows\" {_json_type(doc['rows'])}"
        raise ResultsError(f"{where}: expected {SHAPE}, got {got}")
    _check_meta(doc.get("meta", {}), where)
    for i, row in enumerate(doc["rows"]):
        _check_row(row, f"{where}: row {i}")
    _check_world(doc, where)
    seen: dict[tuple, int] = {}
    for i, row in enumerate(doc["rows"]):
        key = row_key(normalize(row))
        if key in seen:  # a merge would keep one of them without a word
            named = ", ".join(f"{k} {v}" for k, v in zip(KEY_FIELDS, key))
            raise ResultsError(f"{where}: rows {seen[key]} and {i} have the same key ({named})")
        seen[key] = i
    return doc


def _check_world(doc: dict, where: str) -> None:
    """One world size per run: the rows' (where given) are the meta's."""
    ws = doc.get("meta", {}).get("world_size")
    for i, row in enumerate(doc["rows"]):
        if row.get("world_size") is None:
            continue
        if ws is None:
            ws = row["world_size"]
        elif row["world_size"] != ws:
            raise ResultsError(f"{where}: row {i}: world_size {row['world_size']} differs from the run's {ws}; "
                               "one results file is one world size")


def check_mergeable(docs: list[dict], paths: list) -> None:
    """Runs merged into one report share a world size (the tables, targets and tuning table
    are per world size) and GPUs (a speed-up is a ratio of two rows, which may come from
    different runs: NCCL on one machine against Purlin on another is no ratio); ResultsError
    naming both files otherwise.  A run that states none is taken as any."""
    known = [(world_size_of(doc), path) for doc, path in zip(docs, paths) if world_size_of(doc)]
    for ws, path in known[1:]:
        if ws != known[0][0]:
            raise ResultsError(f"{path}: world size {ws}, but {known[0][1]} has world size {known[0][0]}; "
                               "runs of different world sizes cannot be merged into one report")
    gpus = [(_gpus(doc), path) for doc, path in zip(docs, paths) if _gpus(doc)]
    for names, path in gpus[1:]:
        if names != gpus[0][0]:
            raise ResultsError(f"{path}: GPUs {', '.join(names)}, but {gpus[0][1]} ran on {', '.join(gpus[0][0])}; "
                               "runs on different GPUs cannot be merged into one report (their ratios would "
                               "compare machines)")


def _gpus(doc: dict) -> tuple[str, ...]:
    """The GPU names a run states (meta ``gpus``, one per rank), or () where it states none."""
    names = doc.get("meta", {}).get("gpus")
    return tuple(map(str, names)) if isinstance(names, list) else ()


def load_results(path: Path) -> dict:
    """The results document in ``path``, validated (``check_shape``): the one reader of a
    bench.py result for the report and the scripts (readme_table, results_history,
    target_ranges).  ResultsError (one line naming the file) when the file cannot be read, is
    empty, is not JSON, has another shape or is another tool's result."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        why = error.strerror if isinstance(error, OSError) and error.strerror else type(error).__name__
        raise ResultsError(f"{path}: cannot read the results file ({why})") from None
    if not text.strip():
        raise ResultsError(f"{path}: the results file is empty; expected {SHAPE}")
    try:
        doc = json.loads(text)  # NaN and Infinity are read (older files): their rows become error rows
    except json.JSONDecodeError as error:
        raise ResultsError(f"{path}: not JSON ({error.msg} at line {error.lineno} column {error.colno}); "
                           f"expected {SHAPE}") from None
    except RecursionError:
        raise ResultsError(f"{path}: JSON nested too deeply to read; expected {SHAPE}") from None
    return check_shape(doc, str(path))


def results_json(doc: dict, **dump_options) -> str:
    """A results document as strict JSON: rows normalised (a bad time is an error row), every
    other non-finite number null, so any JSON reader takes the file."""
    clean = {**doc, "rows": [normalize(r) for r in doc.get("rows", [])]}
    return json.dumps(finite_only(clean), allow_nan=False, default=str, **dump_options)


# --------------------------------------------------------------------------- writing


def write_all(doc: dict, results_dir: Path, stem: str, *, plots: bool = True) -> dict[str, Path]:
    """``<stem>.json``, ``<stem>.md``, ``<stem>-tuning.json`` and the PNGs."""
    results_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": results_dir / f"{stem}.json", "md": results_dir / f"{stem}.md",
             "tuning": results_dir / f"{stem}-tuning.json"}
    doc = prepared(doc)
    # Compact JSON: one row per line keeps the file small and diffable.  Strict (allow_nan
    # off): prepared() made bad times error rows and every other non-finite number None.
    rows = ",\n".join(json.dumps(r, separators=(",", ":"), default=str, allow_nan=False) for r in doc["rows"])
    meta = json.dumps(finite_only(doc["meta"]), separators=(",", ":"), default=str, allow_nan=False)
    _atomic_write(paths["json"], '{"meta":' + meta + ',\n"rows":[\n' + rows + "\n]}\n")
    _atomic_write(paths["md"], markdown(doc))
    _atomic_write(paths["tuning"], json.dumps(tuning_table(doc), indent=1, allow_nan=False))
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

