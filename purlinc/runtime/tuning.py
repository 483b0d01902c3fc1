"""Which schedule a plain call runs: a size-bucketed table, measured or modelled.

``load(path, comm)`` with no orchestration options loads one variant per size bucket and
each call runs the variant of the first bucket whose ``max_bytes`` covers the call's bytes:
count x itemsize x U, U the most chunks any rank's input or output holds (the largest buffer
of the call, as nccl-tests counts, and the same on every rank so that all pick one bucket).
Buckets come from:

1. a tuning table measured by ``benchmarks/bench.py`` on a machine and committed as
   ``purlinc/runtime/tuning.json`` ({"tables": {collective: {world_size: [bucket, ...]}}});
   used when the collective's name and world size are in it and its layouts are that
   standard collective's (``measured_for``); every row is checked when the table is read;
2. otherwise the cost model below (``epilogue_model`` for a collective with an epilogue), which
   encodes what the measurements showed on H200 NVLink: latency is dominated by signalling for
   small messages (one thread block up to 16 KiB, eight to 128 KiB, with the packed LL
   protocol where the schedule supports it), bandwidth needs many thread blocks (one block
   moves ~46 GB/s over NVLink, so 1 MiB wants ~16 and 16 MiB+ wants 32 or more).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path

from purlinc.atom.atoms import DEFAULT_ATOM
from purlinc.snac.algorithms import DEFAULT_ALGORITHM
from purlinc.snac.ir import Algorithm, LowerOptions
from purlinc.snac.packing import MAX_PACKED_SOURCES

TABLE_PATH = Path(__file__).with_name("tuning.json")


@dataclass(frozen=True, slots=True)
class Bucket:
    max_bytes: int | None  # None: no upper bound (the last bucket)
    algorithm: str = DEFAULT_ALGORITHM.value
    atom: str = DEFAULT_ATOM
    channels: int = 1
    slices: int = 1
    packed: bool = False

    def covers(self, nbytes: int) -> bool:
        return self.max_bytes is None or nbytes <= self.max_bytes

    def options(self, base: LowerOptions) -> dict:
        """The keyword arguments for LowerOptions that this bucket pins."""
        chosen = {"algorithm": Algorithm(self.algorithm), "channels": self.channels, "slices": self.slices}
        if "packed" in {f.name for f in fields(LowerOptions)}:
            chosen["packed"] = self.packed
        return chosen

    def to_json(self) -> dict:
        return {"max_bytes": self.max_bytes, "algorithm": self.algorithm, "atom": self.atom,
                "channels": self.channels, "slices": self.slices, "packed": self.packed}

    @classmethod
    def from_json(cls, data: dict) -> "Bucket":
        return cls(
            max_bytes=None if data.get("max_bytes") is None else int(data["max_bytes"]),
            algorithm=str(data.get("algorithm", DEFAULT_ALGORITHM.value)),
            atom=str(data.get("atom", DEFAULT_ATOM)),
            channels=int(data.get("channels") or 1),
            slices=int(data.get("slices") or 1),
            packed=bool(data.get("packed", False)),
        )


KIB, MIB = 1 << 10, 1 << 20


def model(*, is_reduce: bool, replicated_reduce: bool, world_size: int, packed_supported: bool) -> tuple[Bucket, ...]:
    """The cost model's buckets (used where no measured table applies)."""
    large_algorithm = DEFAULT_ALGORITHM.value
    if replicated_reduce and world_size > 2:
        # One-shot all-reduce sends every chunk to every peer: (R-1)*R chunks per rank against
        # two-shot's 2(R-1); at two ranks they move the same bytes and one-shot has one hop less.
        large_algorithm = Algorithm.TWO_SHOT.value
    return (
        Bucket(16 * KIB, channels=1, packed=packed_supported),
        Bucket(128 * KIB, channels=8, packed=packed_supported),
        Bucket(2 * MIB, channels=16),
        Bucket(None, algorithm=large_algorithm, channels=32),
    )


# An epilogue's buckets count rows of 2-byte elements (bf16, f16: what models serve in; a float32
# output's rows are twice the bytes, so each bucket holds half as many of them).
EPILOGUE_ITEMSIZE = 2


def epilogue_model(row_elements: int, *, large_algorithm: str, packed_supported: bool,
                   counted_per_row: int = 1) -> tuple[Bucket, ...]:
    """The buckets of a collective with an epilogue: its rows, not the all-reduce's bytes, set the
    channels, because a block computes the epilogue of whole rows.  Measured in loopback (local
    work, R=2, [rows x 4096] bf16, benchmarks/results/2026-12-02-h200x1-loopback-epilogue-
    channels.md): one row is fastest on LL's one block (4.6 us against 5.1 for the fused
    direct-push pass); up to four, LL on 8 blocks (4.6-4.7 against 5.1-5.3); beyond, LL's
    separate epilogue pass falls behind the fused pass (16 rows: 7.4 against 5.4 us) and the
    fused pass wants about a row per block (64 rows: 6.1 us on 64 blocks, 6.6 on 32, 8.6 on 16:
    the plain model's 16 channels).

    ``counted_per_row``: the rows a call's size counts for each row a rank computes.  A call is
    counted as its largest buffer (``tuned``: count x itemsize x U, U the most chunks a rank
    holds) while rows are its output's: an output of one chunk of an input of R (a reduce-scatter
    shape) counts R rows per row computed."""
    row = row_elements * EPILOGUE_ITEMSIZE * counted_per_row
    return (
        Bucket(row, channels=1, packed=packed_supported),
        Bucket(4 * row, channels=8, packed=packed_supported),
        Bucket(32 * row, channels=32),
        Bucket(max(2 * MIB, 64 * row), channels=64),
        Bucket(None, algorithm=large_algorithm, channels=64),
    )


@lru_cache(maxsize=None)
def _measured() -> dict[str, dict[str, tuple[Bucket, ...]]]:
    """The measured table, every row checked (``_checked_rows``); {} where there is none.  A
    table that is there but wrong is refused, naming the file and the row: read as it was, a
    "packed": "false" ran every size packed and an unknown algorithm fell back silently."""
    from purlinc.errors import PurlinError

    try:
        text = TABLE_PATH.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}  # no table: the cost model for every collective
    except (OSError, ValueError) as error:
        raise PurlinError(f"tuning table {TABLE_PATH} cannot be read: {getattr(error, 'strerror', None) or error}")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as error:  # RecursionError: nested past the parser's depth
        raise PurlinError(f"tuning table {TABLE_PATH} is not JSON: {error}") from None
    # Either {"tables": {...}, ...notes} or the harness's own file ({collective: {R: [...]}}).
    tables = data.get("tables", data) if isinstance(data, dict) else data
    if not isinstance(tables, dict):
        raise PurlinError(f"tuning table {TABLE_PATH}: expected {{collective: {{world size: [bucket, ...]}}}}, "
                          f"got {type(tables).__name__}")
    checked: dict[str, dict[str, tuple[Bucket, ...]]] = {}
    for name, by_size in tables.items():
        if not isinstance(by_size, dict):
            raise PurlinError(f"tuning table {TABLE_PATH}: {name}: expected {{world size: [bucket, ...]}}, "
                              f"got {type(by_size).__name__}")
        checked[name] = {size: _checked_rows(f"{name}.{size}", size, rows) for size, rows in by_size.items()}
    return checked


# What a table's row may hold: a bucket's fields, and what the harness notes beside them (the
# committed table's measured_us; benchmarks/benchlib/rows.tuning_table's own file's time_us, mode).
_ROW_FIELDS = frozenset({"max_bytes", "algorithm", "atom", "channels", "slices", "packed", "measured_us", "variant",
                         "time_us", "mode"})


def _checked_rows(where: str, size: str, rows) -> tuple[Bucket, ...]:
    """One world size's rows as Buckets: each field of its type and a name the registries
    know, ascending max_bytes, only the last row unbounded."""
    from purlinc.atom.atoms import lookup_atom
    from purlinc.errors import PurlinError
    from purlinc.snac.algorithms import get_algorithm
    from purlinc.snac.lower import check_counts

    def refuse(problem: str, row: int | None = None):
        at = where if row is None else f"{where}[{row}]"
        return PurlinError(f"tuning table {TABLE_PATH}: {at}: {problem}")

    if not (size.isascii() and size.isdigit() and int(size) >= 1):  # "٢" is a digit, never a world size
        raise refuse(f"the world size {size!r} is not a whole number >= 1")
    if not isinstance(rows, list) or not rows:
        raise refuse("expected a non-empty list of buckets")
    buckets, last = [], 0
    for n, row in enumerate(rows):
        if not isinstance(row, dict):
            raise refuse(f"expected a bucket (an object), got {type(row).__name__}", n)
        unknown = sorted(set(row) - _ROW_FIELDS)
        if unknown:
            raise refuse(f"unknown field(s) {', '.join(unknown)}; a bucket has {', '.join(sorted(_ROW_FIELDS))}", n)
        limit = row.get("max_bytes")
        if limit is None and n != len(rows) - 1:
            raise refuse("max_bytes is missing (unbounded) before the last bucket: the buckets after it would "
                         "never run", n)
        if limit is not None and (type(limit) is not int or limit <= last):
            raise refuse(f"max_bytes={limit!r}, expected a whole number of bytes above the bucket before's "
                         f"({last})", n)
        if type(row.get("packed", False)) is not bool:
            raise refuse(f"packed={row['packed']!r}, expected true or false", n)
        for count in ("channels", "slices"):
            if count in row and row[count] is None:  # read as 1 before, where 0 was refused
                raise refuse(f"{count}=null, expected a whole number >= 1 (or leave it out for 1)", n)
        try:
            algorithm = get_algorithm(row.get("algorithm", DEFAULT_ALGORITHM.value))
            atom = lookup_atom(row.get("atom", DEFAULT_ATOM))
            check_counts(row.get("channels", 1), row.get("slices", 1))
        except PurlinError as error:
            raise refuse(error.message, n) from None
        if row.get("packed") and not (algorithm.packed and atom.packed):
            # it could never run: the load replaced the whole bucket by the default, saying so at INFO only
            who = f"the {atom.name} atom" if not atom.packed else f"the {algorithm.name} algorithm"
            raise refuse(f"packed=true, but {who} runs no packed (LL) schedule", n)
        buckets.append(Bucket.from_json(row))
        last = limit or last
    if buckets[-1].max_bytes is not None:  # the table must cover every size
        buckets.append(Bucket.from_json({**buckets[-1].to_json(), "max_bytes": None}))
    return tuple(buckets)


def measured(name: str, world_size: int) -> tuple[Bucket, ...] | None:
    return _measured().get(name, {}).get(str(world_size))


def layout_shape(spec) -> tuple:
    """What a spec moves, whatever its chunks are called: its operation and every rank's
    layouts, each chunk numbered in the order it first appears."""
    numbers: dict = {}
    layouts = tuple(tuple(tuple(numbers.setdefault(chunk, len(numbers)) for chunk in row) for row in rows)
                    for rows in (spec.inputs, spec.outputs))
    return (spec.operation, spec.replicated, *layouts)


@lru_cache(maxsize=256)
def _standard_shape(name: str, world_size: int, params: tuple) -> tuple | None:
    from purlinc.errors import PurlinError
    from purlinc.frontend.check import check
    from purlinc.frontend.parse import parse
    from purlinc.frontend.standard import SOURCES

    if name not in SOURCES:
        return None
    try:  # the front end itself, not the pipeline's memos: a reference, not the user's load
        return layout_shape(check(parse(SOURCES[name], f"<standard {name}>"), world_size, dict(params)))
    except PurlinError:  # parameters the standard collective does not take
        return None


def measured_for(spec) -> tuple[Bucket, ...] | None:
    """The measured table of the standard collective ``spec`` is: its name, and the layouts
    that name stands for.  A user's collective that only shares the name (another shape, an
    epilogue, run-time sizes) was not measured and gets the model."""
    if spec.epilogue is not None or spec.sizes is not None:
        return None
    if _standard_shape(spec.name, spec.world_size, spec.params) != layout_shape(spec):
        return None
    return measured(spec.name, spec.world_size)


def buckets_for(spec, *, packed_supported: bool) -> tuple[Bucket, ...]:
    if spec.is_reduce and spec.most_sources > MAX_PACKED_SOURCES:
        packed_supported = False  # the lowering refuses packed stages past this many sources
    table = measured_for(spec)
    if table is not None:
        return tuple(b if packed_supported or not b.packed else Bucket.from_json({**b.to_json(), "packed": False})
                     for b in table)
    holders = Counter(chunk for outputs in spec.outputs for chunk in set(outputs))
    replicated = spec.is_reduce and any(n > 1 for n in holders.values())
    plain = model(is_reduce=spec.is_reduce, replicated_reduce=replicated, world_size=spec.world_size,
                  packed_supported=packed_supported)
    if spec.epilogue is None:
        return plain
    counted = max(max(len(ins), len(outs)) for ins, outs in zip(spec.inputs, spec.outputs))
    computed = max(len(outs) for outs in spec.outputs)  # the rank with the most rows sets the pace
    return epilogue_model(spec.epilogue.row, large_algorithm=plain[-1].algorithm, packed_supported=packed_supported,
                          counted_per_row=-(-counted // computed))


def choose(buckets: tuple[Bucket, ...], nbytes: int) -> int:
    """Index of the bucket a call of ``nbytes`` runs in."""
    for index, bucket in enumerate(buckets):
        if bucket.covers(nbytes):
            return index
    return len(buckets) - 1
