"""Size-based selection of the default schedule (purlinc.runtime.tuning): no GPU needed."""

import json

import pytest

from purlinc import pipeline
from purlinc.runtime import tuning


def _spec(name, world_size=4):
    source = pipeline.load_source(f"examples/{name}.pln")
    return pipeline.spec_stage(pipeline.parse_stage(source), world_size, None)


COMMITTED_TABLE = tuning.TABLE_PATH


@pytest.fixture(autouse=True)
def _no_measured_table(monkeypatch, tmp_path):
    monkeypatch.setattr(tuning, "TABLE_PATH", tmp_path / "absent.json")
    tuning._measured.cache_clear()
    yield
    tuning._measured.cache_clear()


def test_model_buckets_grow_channels_with_size_and_cover_everything():
    buckets = tuning.buckets_for(_spec("allgather"), packed_supported=True)
    assert buckets[-1].max_bytes is None
    bounds = [b.max_bytes for b in buckets[:-1]]
    assert bounds == sorted(bounds)
    channels = [b.channels for b in buckets]
    assert channels == sorted(channels) and channels[0] == 1 and channels[-1] >= 32
    assert buckets[0].packed and not buckets[-1].packed


def test_packed_buckets_only_when_supported():
    assert not any(b.packed for b in tuning.buckets_for(_spec("allgather"), packed_supported=False))


def test_two_shot_for_large_replicated_reductions_beyond_two_ranks():
    assert tuning.buckets_for(_spec("allreduce", 4), packed_supported=False)[-1].algorithm == "two-shot"
    assert tuning.buckets_for(_spec("allreduce", 2), packed_supported=False)[-1].algorithm == "direct-push"
    # reduce_scatter's outputs are not replicated: two-shot would be direct-push again.
    assert tuning.buckets_for(_spec("reduce_scatter", 4), packed_supported=False)[-1].algorithm == "direct-push"


def test_an_epilogue_sets_the_buckets_by_rows():
    """Fused all-reduce + RMSNorm over rows of 4096: LL on one block for a row, on 8 up to four,
    then the fused direct-push pass with about a row per block (32, then 64 channels)."""
    source = pipeline.load_source("examples/fused/allreduce_add_rmsnorm.pln")
    for world in (2, 8):
        spec = pipeline.spec_stage(pipeline.parse_stage(source), world, None)
        buckets = tuning.buckets_for(spec, packed_supported=True)
        row = 4096 * tuning.EPILOGUE_ITEMSIZE
        assert [(b.max_bytes, b.packed, b.channels) for b in buckets[:4]] == [
            (row, True, 1), (4 * row, True, 8), (32 * row, False, 32), (2 << 20, False, 64)]
        assert buckets[-1].max_bytes is None and buckets[-1].channels == 64
        assert buckets[-1].algorithm == ("two-shot" if world > 2 else "direct-push")
        assert [tuning.choose(buckets, rows * row) for rows in (1, 2, 16, 128, 1024)] == [0, 1, 2, 3, 4]
    assert not any(b.packed for b in tuning.buckets_for(spec, packed_supported=False))


@pytest.mark.parametrize("nbytes, expected", [(1, 0), (16 << 10, 0), ((16 << 10) + 1, 1), (1 << 30, 3)])
def test_choose_takes_the_first_bucket_that_covers(nbytes, expected):
    buckets = tuning.model(is_reduce=False, replicated_reduce=False, world_size=2, packed_supported=False)
    assert tuning.choose(buckets, nbytes) == expected


def test_measured_table_overrides_the_model_and_is_closed_at_the_top(monkeypatch, tmp_path):
    table = {"tables": {"allgather": {"4": [
        {"max_bytes": 4096, "algorithm": "direct-push", "atom": "ldst", "channels": 2, "slices": 1, "packed": True},
        {"max_bytes": 1 << 20, "algorithm": "direct-pull", "atom": "ldst", "channels": 16, "slices": 2},
    ]}}}
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(table))
    monkeypatch.setattr(tuning, "TABLE_PATH", path)
    tuning._measured.cache_clear()
    buckets = tuning.buckets_for(_spec("allgather", 4), packed_supported=False)
    assert [b.channels for b in buckets] == [2, 16, 16]
    assert buckets[-1].max_bytes is None and buckets[-1].algorithm == "direct-pull"
    assert not buckets[0].packed  # dropped: this build cannot pack
    # Another world size falls back to the model.
    assert tuning.buckets_for(_spec("allgather", 8), packed_supported=False)[0].channels == 1


def _with_table(monkeypatch, tmp_path, name, world_size="2"):
    table = {"tables": {name: {world_size: [
        {"max_bytes": 4096, "algorithm": "direct-pull", "atom": "ldst", "channels": 3, "slices": 1}]}}}
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(table))
    monkeypatch.setattr(tuning, "TABLE_PATH", path)
    tuning._measured.cache_clear()


@pytest.mark.parametrize("text, measured", [
    ("collective allreduce { in[r] = x[0..R]  out[r] = x[0..R]  reduce }", True),
    ("collective allreduce { in[r] = y[0..R]  out[r] = y[0..R]  reduce }", True),  # another chunk name
    ("collective allreduce { in[r] = x[0..R]  out[r] = x[r]  reduce }", False),  # a reduce-scatter's shape
    ("collective allreduce { in[r] = x[r]  out[r] = x[0..R]  copy }", False),  # an all-gather's
    ("collective allreduce(hidden = 64) with rows residual, row weight, scalar eps {\n"
     "  in[r] = x[0..R]  out[r] = x[0..R]  reduce\n"
     "  epilogue rows(hidden) { h = out + residual  residual = h  out = rmsnorm(h, weight, eps) } }", False),
])
def test_a_measured_table_serves_the_standard_collective_of_its_name_only(monkeypatch, tmp_path, text, measured):
    """A user's collective named like a standard one but of another shape (or with an
    epilogue) was not measured: it gets the model's buckets."""
    _with_table(monkeypatch, tmp_path, "allreduce")
    source = pipeline.load_source(text)
    spec = pipeline.spec_stage(pipeline.parse_stage(source), 2, None)
    buckets = tuning.buckets_for(spec, packed_supported=False)
    assert (buckets[0].channels == 3 and buckets[0].algorithm == "direct-pull") == measured, buckets


def test_bucket_json_round_trip():
    bucket = tuning.Bucket(1 << 20, "two-shot", "ldst", 32, 2, False)
    assert tuning.Bucket.from_json(bucket.to_json()) == bucket


def test_committed_table_is_valid():
    """The table shipped in the package parses, every bucket list is ordered, and every bucket
    lowers (and verifies) for its collective and world size."""
    from purlinc.snac.ir import LowerOptions

    tables = json.loads(COMMITTED_TABLE.read_text())["tables"]
    assert tables, "the committed tuning table is empty"
    for name, by_size in tables.items():
        for world_size, rows in by_size.items():
            buckets = [tuning.Bucket.from_json(row) for row in rows]
            bounds = [b.max_bytes for b in buckets if b.max_bytes is not None]
            assert bounds == sorted(bounds), (name, world_size)
            spec = _spec(name, int(world_size))
            for bucket in buckets:
                if bucket.atom == "ce":
                    continue
                options = LowerOptions(**bucket.options(LowerOptions()))
                pipeline.snac_stage(spec, options)


def test_selection_size_is_rank_independent():
    """A gather's root holds R chunks of output, the others one chunk of input: every rank
    must still pick the same bucket, so the size is count * itemsize * (most units on any rank)."""
    from purlinc.runtime.tuned import Tuned

    spec = _spec("gather", 4)
    units = max(max(len(i), len(o)) for i, o in zip(spec.inputs, spec.outputs))
    assert units == 4

    class _Fake:
        name, comm, rank = "gather", None, 0

    buckets = tuning.model(is_reduce=False, replicated_reduce=False, world_size=4, packed_supported=False)
    tuned = Tuned(buckets, [_Fake()] * len(buckets), units)
    # 8 KiB per chunk: 32 KiB on the root's output, whichever rank asks.
    assert tuned._chosen == {}
    tuned.variant_for(4096, 2)
    assert tuned._chosen[(4096, 2)] == tuning.choose(buckets, 4096 * 2 * 4) == 1


GOOD_ROW = {"max_bytes": 4096, "algorithm": "direct-push", "atom": "ldst", "channels": 2, "slices": 1, "packed": True}


@pytest.mark.parametrize("rows, problem", [
    ([{**GOOD_ROW, "packed": "false"}], r"allgather\.4\[0\]: packed='false', expected true or false"),
    ([{**GOOD_ROW, "algorithm": "direct-pusj"}], r"allgather\.4\[0\]: unknown algorithm 'direct-pusj'"),
    ([{**GOOD_ROW, "atom": "ldsx"}], r"allgather\.4\[0\]: unknown atom 'ldsx'"),
    ([{**GOOD_ROW, "max_bytes": 1 << 20}, GOOD_ROW], r"allgather\.4\[1\]: max_bytes=4096, expected a whole number of "
                                                      r"bytes above the bucket before's \(1048576\)"),
    ([{**GOOD_ROW, "max_bytes": None}, GOOD_ROW], r"allgather\.4\[0\]: max_bytes is missing \(unbounded\) before the "
                                                  r"last bucket"),
    ([{**GOOD_ROW, "max_bytes": "1KiB"}], r"allgather\.4\[0\]: max_bytes='1KiB', expected a whole number of bytes"),
    ([{**GOOD_ROW, "channels": 0}], r"allgather\.4\[0\]: channels and slices must be >= 1"),
    ([{**GOOD_ROW, "chanels": 2}], r"allgather\.4\[0\]: unknown field\(s\) chanels"),
    ([{**GOOD_ROW, "channels": None}], r"allgather\.4\[0\]: channels=null, expected a whole number >= 1"),
    ([{**GOOD_ROW, "slices": None}], r"allgather\.4\[0\]: slices=null, expected a whole number >= 1"),
    ([{**GOOD_ROW, "atom": "ce"}], r"allgather\.4\[0\]: packed=true, but the ce atom runs no packed \(LL\) schedule"),
    ([{**GOOD_ROW, "algorithm": "ring"}], r"allgather\.4\[0\]: packed=true, but the ring algorithm runs no packed"),
    ([3], r"allgather\.4\[0\]: expected a bucket \(an object\), got int"),
    ([], r"allgather\.4: expected a non-empty list of buckets"),
])
def test_a_bad_table_is_refused_naming_the_file_and_the_row(monkeypatch, tmp_path, rows, problem):
    """Read as it was, "packed": "false" ran every size packed, an unknown algorithm fell back to
    direct-push silently, and a middle row without max_bytes served every size after it."""
    from purlinc.errors import PurlinError

    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"tables": {"allgather": {"4": rows}}}))
    monkeypatch.setattr(tuning, "TABLE_PATH", path)
    tuning._measured.cache_clear()
    with pytest.raises(PurlinError, match=rf"tuning table {path}: {problem}"):
        tuning.buckets_for(_spec("allgather", 4), packed_supported=True)


@pytest.mark.parametrize("text, problem", [
    ("{", "is not JSON"),
    ("[1, 2]", "expected {collective: {world size"),
    ("[" * 100_000, "is not JSON"),  # nested past the parser's depth: a RecursionError escaped
    (json.dumps({"tables": {"allgather": {"\u0662": [GOOD_ROW]}}}), "the world size '\u0662' is not a whole number"),
])
def test_a_table_that_is_not_one_is_refused(monkeypatch, tmp_path, text, problem):
    from purlinc.errors import PurlinError

    path = tmp_path / "tuning.json"
    path.write_text(text)
    monkeypatch.setattr(tuning, "TABLE_PATH", path)
    tuning._measured.cache_clear()
    with pytest.raises(PurlinError, match=rf"tuning table {path}.*{problem}"):
        tuning.buckets_for(_spec("allgather", 4), packed_supported=True)


def test_the_committed_table_passes_the_loads_own_checks(monkeypatch):
    monkeypatch.setattr(tuning, "TABLE_PATH", COMMITTED_TABLE)
    tuning._measured.cache_clear()
    assert len(tuning._measured()) == 8


def test_an_epilogue_of_a_reduce_scatter_shape_counts_its_rows_not_its_input():
    """A call counts as its largest buffer (R chunks of input) while a rank computes one
    chunk's rows: without the factor, one row per rank at R=8 ran on 32 channels unpacked."""
    text = ("collective rs(hidden = 4096) with rows residual, row weight, scalar eps { in[r] = x[0..R] out[r] = x[r] "
            "reduce epilogue rows(hidden) { h = out + residual residual = h out = rmsnorm(h, weight, eps) } }")
    spec = pipeline.spec_stage(pipeline.parse_stage(pipeline.SourceText(text, "rs.pln")), 8, None)
    buckets = tuning.buckets_for(spec, packed_supported=True)
    one_row_per_rank = 4096 * 2 * 8  # bf16, as Tuned counts it: count x itemsize x U (U = 8)
    assert tuning.choose(buckets, one_row_per_rank) == 0 and buckets[0].packed


def test_the_benchmarks_own_table_passes_the_loads_checks(monkeypatch, tmp_path):
    """bench.py writes <stem>-tuning.json with rows.tuning_table; the load reads that shape too
    ({collective: {R: [...]}}), and its rows carry time_us and mode beside a bucket's fields."""
    import importlib
    import sys

    monkeypatch.syspath_prepend(str(COMMITTED_TABLE.parent.parent.parent / "benchmarks"))
    rows = importlib.import_module("benchlib.rows")
    doc = json.loads((COMMITTED_TABLE.parent.parent.parent / "benchmarks" / "results" /
                      "2026-12-01-h200x2-run21.json").read_text())
    table = rows.tuning_table(doc)
    assert table and all("time_us" in row and "mode" in row for by_size in table.values()
                         for entries in by_size.values() for row in entries)
    for shape in (table, {"tables": table}):
        path = tmp_path / "tuning.json"
        path.write_text(json.dumps(shape))
        monkeypatch.setattr(tuning, "TABLE_PATH", path)
        tuning._measured.cache_clear()
        assert tuning.buckets_for(_spec("allreduce", 2), packed_supported=True)
    sys.modules.pop("benchlib.rows", None)
