"""The benchmark's report layer (benchmarks/report.py) on synthetic rows: no GPU, no torch."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str, folder: Path = BENCH):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


report = _load("report")


def _lib(name: str):
    """A module of benchmarks/benchlib (``report`` put benchmarks/ on sys.path)."""
    return importlib.import_module(f"benchlib.{name}")
KiB, MiB, GiB = report.KiB, report.MiB, report.GiB


# --------------------------------------------------------------------------- synthetic data


def row(system, variant, coll, nbytes, mode, time_us, *, world=2, checked=True, error=None, sms=None, options=None):
    return {
        "system": system, "variant": variant, "collective": coll, "dtype": "bfloat16", "bytes": nbytes,
        "world_size": world, "mode": mode, "time_us": None if error else time_us,
        "algbw_gbps": None if error else report.algbw_gbps(nbytes, time_us),
        "busbw_gbps": None if error else report.busbw_gbps(coll, world, nbytes, time_us),
        "sms": sms, "checked": None if error else checked, "error": error, "options": options,
    }


PUSH1 = {"algorithm": "direct-push", "atom": "ldst", "channels": 1}
PUSH16 = {"algorithm": "direct-push", "atom": "ldst", "channels": 16}


def synthetic_doc(*, purlin_speedup=4.0, world=2) -> dict:
    rows = []
    for coll in report.COLLECTIVES:
        for nbytes in (KiB, 64 * KiB, MiB, 16 * MiB, 256 * MiB, GiB):
            for mode in ("eager", "graph"):
                nccl = (20.0 if mode == "eager" else 8.0) + nbytes / 300e3
                rows.append(row("nccl", "nccl", coll, nbytes, mode, nccl, world=world))
                small = nbytes <= MiB
                fast_small = nccl / purlin_speedup
                fast_large = nbytes / 380e3 + 3.0
                best_variant, best_opts = ("push-ldst-c1", PUSH1) if small else ("push-ldst-c16", PUSH16)
                best_t = fast_small if small else fast_large
                rows.append(row("purlin", best_variant, coll, nbytes, mode, best_t, world=world, sms=1 if small else 16,
                                options=best_opts))
                other = ("push-ldst-c16", PUSH16) if small else ("push-ldst-c1", PUSH1)
                rows.append(row("purlin", other[0], coll, nbytes, mode, best_t * 1.5, world=world,
                                sms=other[1]["channels"], options=other[1]))
                rows.append(row("purlin", "default", coll, nbytes, mode, best_t * 1.05, world=world,
                                sms=1 if small else 16))
                if coll == "allreduce":
                    rows.append(row("symm_mem", "one-shot", coll, nbytes, mode, nccl * 0.9, world=world))
                    rows.append(row("symm_mem", "two-shot", coll, nbytes, mode, nccl * 0.95, world=world))
    meta = {"date": "2026-11-30", "machine": "h200x2", "world_size": world,
            "peaks": {"ce_one_way": {"how": "test", "points": [{"bytes": GiB, "time_us": GiB / 397e3, "gbps": 397.0}]}}}
    return {"meta": meta, "rows": rows}


# --------------------------------------------------------------------------- sizes and layouts


def test_sizes():
    full = report.full_sizes()
    assert full[0] == KiB and full[-1] == GiB
    assert 2 * MiB in full and 8 * MiB in full and 4 * MiB in full and 16 * MiB in full
    assert len(full) == 13
    assert report.quick_sizes() == [KiB, 16 * KiB, 64 * KiB, MiB, 16 * MiB, 256 * MiB]
    assert report.select_sizes(quick=False, max_bytes=MiB)[-1] == MiB
    assert report.select_sizes(quick=True, explicit=[5 * KiB, KiB]) == [KiB, 5 * KiB]


@pytest.mark.parametrize("text,value", [("1K", KiB), ("64KiB", 64 * KiB), ("1M", MiB), ("1G", GiB),
                                        ("4096", 4096), ("256MiB", 256 * MiB), ("1.5K", 1536), ("0", 0)])
def test_parse_bytes(text, value):
    assert report.parse_bytes(text) == value


@pytest.mark.parametrize("text", ["12Q", "", "K", "nan", "inf", "-1K", "1e400", "abc"])
def test_parse_bytes_says_what_a_size_is(text):
    with pytest.raises(ValueError, match=f"^{re.escape(repr(text))} is not a size: expected a number of bytes"):
        report.parse_bytes(text)


def test_fmt_bytes():
    assert report.fmt_bytes(KiB) == "1 KiB"
    assert report.fmt_bytes(256 * MiB) == "256 MiB"
    assert report.fmt_bytes(1536) == "1.5 KiB"
    assert report.fmt_bytes(None) == "-"


@pytest.mark.parametrize("world", [2, 4, 8])
def test_layout_matches_nccl_byte_convention(world):
    nbytes = 64 * KiB
    cases = {
        "allreduce": (world, world), "alltoall": (world, world), "allgather": (1, world), "gather": (1, world),
        "reduce_scatter": (world, 1), "scatter": (world, 1), "broadcast": (1, 1), "reduce": (1, 1),
    }
    for coll, (cin, cout) in cases.items():
        lay = report.layout(coll, world, nbytes)
        assert lay.in_elems == cin * lay.count and lay.out_elems == cout * lay.count
        assert lay.bytes == nbytes, coll  # powers of two divide evenly: nothing is rounded away
        assert (lay.count * 2) % 16 == 0


def test_layout_rounds_to_16_byte_chunks():
    lay = report.layout("allgather", 3, 1000)
    assert lay.count % 8 == 0 and lay.bytes <= 1000
    tiny = report.layout("allreduce", 8, 16)
    assert tiny.count == 8  # never below one 16-byte vector per chunk


def test_busbw_factors():
    assert report.busbw_factor("allreduce", 2) == 1.0
    assert report.busbw_factor("allreduce", 8) == pytest.approx(1.75)
    for coll in ("allgather", "reduce_scatter", "alltoall", "gather", "scatter"):
        assert report.busbw_factor(coll, 4) == pytest.approx(0.75)
    assert report.busbw_factor("broadcast", 8) == 1.0 and report.busbw_factor("reduce", 8) == 1.0
    # 1 GiB in 3.3 ms: about 325 GB/s algorithm bandwidth
    assert report.algbw_gbps(GiB, 3300.0) == pytest.approx(GiB / 3300e3)
    assert report.busbw_gbps("allreduce", 8, GiB, 3300.0) == pytest.approx(1.75 * GiB / 3300e3)
    assert report.algbw_gbps(GiB, None) is None


def test_estimate_is_monotonic_and_bounded():
    small = report.estimate_case_s(KiB, reps=5, target_rep_us=5000)
    big = report.estimate_case_s(GiB, reps=5, target_rep_us=5000)
    assert 0 < small < big < 5
    total = report.estimate_run_s([("allreduce", KiB, 10), ("allreduce", GiB, 10)], reps=5, target_rep_us=5000,
                                  modes=2, loads=10)
    assert total == pytest.approx(20 + 10 * 2.0 + 10 * small + 10 * big)


# --------------------------------------------------------------------------- selection and tuning


def test_best_purlin_excludes_default_wrong_and_errors():
    rows = [
        row("purlin", "default", "allgather", KiB, "graph", 1.0),
        row("purlin", "a", "allgather", KiB, "graph", 2.0, checked=False),
        row("purlin", "b", "allgather", KiB, "graph", 0.0, error="boom"),
        row("purlin", "c", "allgather", KiB, "graph", 3.0),
        row("purlin", "d", "allgather", KiB, "graph", 2.5, checked=None),  # not checked: not trusted
    ]
    assert report.best_purlin(rows, "allgather", KiB, "graph")["variant"] == "c"
    assert report.best_purlin(rows, "allgather", 2 * KiB, "graph") is None


def test_tuning_table_merges_ranges():
    doc = synthetic_doc()
    table = report.tuning_table(doc)
    assert set(table) == set(report.COLLECTIVES)
    entries = table["allreduce"]["2"]
    assert [e["variant"] for e in entries] == ["push-ldst-c1", "push-ldst-c16"]
    assert entries[0]["max_bytes"] == MiB and entries[-1]["max_bytes"] is None
    assert entries[0]["algorithm"] == "direct-push" and entries[0]["channels"] == 1 and entries[0]["atom"] == "ldst"
    assert entries[1]["channels"] == 16
    json.dumps(table)  # plain JSON


def test_tuning_table_falls_back_to_eager():
    rows = [row("purlin", "x", "reduce", KiB, "eager", 5.0, options=PUSH1)]
    table = report.tuning_table({"meta": {"world_size": 4}, "rows": rows})
    assert table == {"reduce": {"4": [{"max_bytes": None, "variant": "x", **PUSH1, "time_us": 5.0, "mode": "eager"}]}}


def test_merge_later_wins():
    a = {"meta": {"run_id": "a"}, "rows": [row("nccl", "nccl", "allreduce", KiB, "graph", 9.0),
                                             row("nccl", "nccl", "allgather", KiB, "graph", 8.0)]}
    b = {"meta": {"run_id": "b"}, "rows": [row("nccl", "nccl", "allreduce", KiB, "graph", 7.0)]}
    merged = report.merge([a, b])
    times = {r["collective"]: r["time_us"] for r in merged["rows"]}
    assert times == {"allreduce": 7.0, "allgather": 8.0}
    assert merged["meta"]["merged_from"] == ["a", "b"]


# --------------------------------------------------------------------------- wire model


def test_wire_model_numbers():
    # 1 KiB all-reduce at R=2: 0.56 + 1.26 + 1024 bus bytes at 365 GB/s
    assert report.limit_us("allreduce", 2, KiB) == pytest.approx(0.56 + 1.26 + 1024 / 365e3)
    # all-gather moves half the output each way; broadcast runs one way at 396 GB/s
    assert report.limit_us("allgather", 2, 256 * MiB) == pytest.approx(1.82 + 128 * MiB / 365e3)
    assert report.limit_us("broadcast", 2, 256 * MiB) == pytest.approx(1.82 + 256 * MiB / 396e3)
    assert report.pct_of_limit("allreduce", 2, KiB, 2 * report.limit_us("allreduce", 2, KiB)) == pytest.approx(50.0)
    assert report.pct_of_limit("allreduce", 2, KiB, None) is None
    assert report.TWO_WAY == {"allreduce", "allgather", "reduce_scatter", "alltoall"}


def test_rows_get_limits_and_old_rows_are_normalised():
    r = report.prepared({"rows": [row("nccl", "nccl", "allreduce", KiB, "graph", 3.65)]})["rows"][0]
    assert r["variant"] == "default" and r["calls_per_graph"] is None
    assert r["limit_us"] == pytest.approx(report.limit_us("allreduce", 2, KiB), abs=1e-3)
    assert r["pct_of_limit"] == pytest.approx(100 * r["limit_us"] / 3.65, abs=0.1)


def nccl_rows(coll, nbytes, mode, default, nomix, symm, calls=20):
    out = []
    for variant, t in (("default", default), ("nomix", nomix), ("symm", symm)):
        if t is not None:
            out.append(row("nccl", variant, coll, nbytes, mode, t))
            out[-1]["calls_per_graph"] = calls if mode == "graph" else None
    return out


def test_best_nccl_is_the_fastest_correct_row_and_is_named():
    rows = nccl_rows("allgather", KiB, "graph", 9.4, 5.3, 2.8)
    assert report.best_nccl(rows, "allgather", KiB, "graph")["variant"] == "symm"
    rows[-1]["checked"] = False  # a wrong result is never the baseline
    assert report.best_nccl(rows, "allgather", KiB, "graph")["variant"] == "nomix"
    table = report.nccl_table(rows, "graph")
    assert table[0].startswith("| collective | size | default us | nomix us | symm us | best |")
    assert table[2].endswith("| nomix |")


def test_select_separates_calls_per_graph():
    rows = nccl_rows("allreduce", KiB, "graph", 9.6, 5.0, 3.0, calls=20) + \
        nccl_rows("allreduce", KiB, "graph", 16.0, 5.5, 3.1, calls=100) + \
        nccl_rows("allreduce", KiB, "eager", 20.0, 19.0, 18.0)
    assert report.graph_counts(rows) == [20, 100]
    assert report.views(rows) == [("graph", 20), ("graph", 100), ("eager", None)]
    assert {r["time_us"] for r in report.select(rows, "graph")} == {9.6, 5.0, 3.0}
    assert {r["time_us"] for r in report.select(rows, "graph", 100)} == {16.0, 5.5, 3.1}
    assert len(report.select(rows, "eager")) == 3
    merged = report.merge([{"rows": rows}, {"rows": nccl_rows("allreduce", KiB, "graph", 1.0, 1.0, 1.0, calls=100)}])
    assert sorted(r["time_us"] for r in report.select(merged["rows"], "graph", 100)) == [1.0, 1.0, 1.0]
    assert sorted(r["time_us"] for r in report.select(merged["rows"], "graph", 20)) == [3.0, 5.0, 9.6]


# --------------------------------------------------------------------------- targets


def good_doc(default_us: float, symm_us: float, *, sizes=(KiB, 16 * KiB, 64 * KiB, MiB)) -> dict:
    rows = []
    for coll in report.COLLECTIVES:
        for nbytes in sizes:
            rows += nccl_rows(coll, nbytes, "graph", 9.0, 5.0, symm_us + nbytes / 300e3)
            d = row("purlin", "default", coll, nbytes, "graph", default_us + nbytes / 380e3)
            d["calls_per_graph"] = 20
            rows.append(d)
    return {"meta": {"world_size": 2}, "rows": rows}


def _target(doc, prefix):
    return next(t for t in report.targets(doc) if t.name.startswith(prefix))


def test_small_target_against_best_nccl():
    met = _target(good_doc(2.0, 2.9), "graph, 1 KiB and 16 KiB")
    assert met.status == "met", met.lines
    missed = _target(good_doc(2.4, 2.9), "graph, 1 KiB and 16 KiB")  # 2.4 us > 2.3 for the big three
    assert missed.status == "missed"
    assert any(line.startswith("MISSED: allreduce 1 KiB: Purlin 2.40 us (<= 2.3)") and "nccl/symm" in line
               for line in missed.lines), missed.lines
    slower = _target(good_doc(2.2, 2.5), "graph, 1 KiB and 16 KiB")  # under 2.3 us, but only 1.14x symm
    assert slower.status == "missed" and any("1.14x best NCCL (nccl/symm" in line for line in slower.lines)


def test_medium_targets():
    doc = good_doc(2.0, 2.9)
    assert _target(doc, "graph, 64 KiB").status == "met"
    one_mib = _target(doc, "graph, 1 MiB")
    # Purlin 2.0 + 1 MiB / 380e3 = 4.76 us; symm 2.9 + 3.5 = 6.40 us, but nomix (5.0 us) is the
    # best NCCL row at 1 MiB: 1.05x, below 1.5x, and the line names nomix
    assert one_mib.status == "missed"
    assert any("1.05x best NCCL (nccl/nomix 5.00 us" in line for line in one_mib.lines), one_mib.lines


def test_wire_and_bandwidth_targets():
    rows = []
    for coll in report.COLLECTIVES:
        for nbytes in (16 * MiB, 256 * MiB):
            lim = report.limit_us(coll, 2, nbytes)
            rows += nccl_rows(coll, nbytes, "graph", 2 * lim, 1.5 * lim, None)
            d = row("purlin", "default", coll, nbytes, "graph", lim / 0.9)
            d["calls_per_graph"] = 20
            rows.append(d)
    doc = {"meta": {"world_size": 2}, "rows": rows}
    assert _target(doc, "graph, 16 MiB").status == "met"  # 90% of the limit
    bus = _target(doc, "graph, 256 MiB and 1 GiB: all-gather")
    # 90% of a 365 GB/s limit (plus the 1.8 us floor) is ~328 GB/s busbw: just under 330
    assert bus.status == "missed" and all("GB/s busbw" in line for line in bus.lines)
    assert _target(doc, "graph, 256 MiB and 1 GiB: all eight").status == "met"  # 1.35x nomix


def test_wrong_result_never_counts_as_met():
    doc = good_doc(1.0, 2.9)
    for r in doc["rows"]:
        if r["system"] == "purlin" and r["collective"] == "broadcast":
            r["checked"] = False
    t = _target(doc, "graph, 1 KiB and 16 KiB")
    assert t.status == "missed" and any("wrong result" in line for line in t.lines)


def test_eager_and_default_targets():
    doc = synthetic_doc(purlin_speedup=4.0)  # eager 1 KiB: (20 + 0.003) / 4 * 1.05 = 5.25 us
    assert _target(doc, "eager, 1 KiB").status == "met"
    assert _target(doc, "default within 10%").status == "met"
    assert _target(doc, "footprint").status == "report"


def test_targets_without_data():
    doc = {"meta": {}, "rows": [row("nccl", "nccl", "allreduce", KiB, "graph", 8.0)]}
    statuses = {t.name: t.status for t in report.targets(doc)}
    assert all(s in ("no data", "report") for s in statuses.values()), statuses


def test_partial_run_is_flagged():
    doc = synthetic_doc()
    doc["rows"] = [r for r in doc["rows"] if r["collective"] == "allreduce"]
    t = report.targets(doc)[0]
    assert any("partial run" in line for line in t.lines)


# --------------------------------------------------------------------------- times that are no timing


NAN, INF = float("nan"), float("inf")
BAD_TIMES = [NAN, INF, -INF, 0.0, -8.0, "8.0", True, [3.0]]


def timed(system, variant, time_us, *, coll="allreduce", nbytes=KiB, mode="graph", options=None):
    """A row whose time_us is exactly ``time_us`` (row() would compute bandwidth from it)."""
    r = row(system, variant, coll, nbytes, mode, 1.0, options=options)
    r.update(time_us=time_us, calls_per_graph=20 if mode == "graph" else None)
    return r


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as strict readers do."""
    def refuse(token):
        raise ValueError(f"not strict JSON: {token}")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("bad", BAD_TIMES, ids=repr)
def test_a_bad_time_is_an_error_row_never_the_best(bad):
    """The probe's rows: the NaN (inf, 0, negative, string...) variant first.  It is an error row
    that names what was given; the best and the tuning table are the real times' only."""
    rows = [timed("nccl", "default", 8.0), timed("purlin", "push-ldst-c16", bad, options=PUSH16),
            timed("purlin", "push-ldst-c1", 3.0, options=PUSH1), timed("purlin", "default", 3.1)]
    assert report.best_purlin(rows, "allreduce", KiB, "graph")["variant"] == "push-ldst-c1"  # raw rows too
    doc = {"meta": {"world_size": 2}, "rows": rows}
    prepared = report.prepared(doc)["rows"]
    bad_row = prepared[1]
    assert bad_row["time_us"] is None and bad_row["bad_time"] == repr(bad) and not report.ok(bad_row)
    assert bad_row["error"] == f"bad timing: time_us {bad!r} is not a finite positive number"
    assert report.bad_timings(prepared) == 1
    table = report.tuning_table(doc)
    assert table == {"allreduce": {"2": [{"max_bytes": None, "variant": "push-ldst-c1", **PUSH1, "time_us": 3.0,
                                          "mode": "graph"}]}}
    md = report.markdown(doc)
    cells = [l for l in md.splitlines() if l.startswith("|")]
    assert not any(word in l.lower() for l in cells for word in ("nan", "inf")), "a table shows a bad number"
    assert "- 1 row with a time that is not a finite positive number" in md
    assert "purlin/push-ldst-c16 allreduce (1 rows): bad timing: time_us" in md
    line = next(l for l in md.split("## allreduce, graph")[1].splitlines() if l.startswith("| 1 KiB"))
    assert "| push-ldst-c1 | 3.00 |" in line  # the best explicit variant is the real one


@pytest.mark.parametrize("bad", [NAN, INF, 0.0, -8.0, "8.0"], ids=repr)
def test_a_bad_nccl_time_is_never_the_baseline_and_meets_no_target(bad):
    rows = [timed("nccl", "nomix", bad), timed("nccl", "default", 8.0), timed("purlin", "default", 2.0)]
    assert report.best_nccl(report.prepared({"rows": rows})["rows"], "allreduce", KiB, "graph")["variant"] == "default"
    assert report.best_nccl(rows, "allreduce", KiB, "graph")["variant"] == "default"
    alone = [timed("nccl", "default", bad), timed("purlin", "default", 2.0)]  # no real NCCL time at all
    small = _target({"meta": {"world_size": 2}, "rows": alone}, "graph, 1 KiB and 16 KiB")
    assert small.status == "missed" and small.points[0][2]["x best NCCL"] is None
    assert "nanx" not in report.markdown({"rows": alone}) and "infx" not in report.markdown({"rows": alone})


@pytest.mark.parametrize("bad", [NAN, INF, 0.0, -1.0], ids=repr)
def test_default_vs_best_is_judged_on_real_times(bad):
    """default 3.5 us against the best real variant's 3.0 is more than 10% off, whatever bad
    row comes first (a NaN best made every comparison false: 'met')."""
    rows = [timed("purlin", "push-ldst-c16", bad, options=PUSH16), timed("purlin", "push-ldst-c1", 3.0, options=PUSH1),
            timed("purlin", "default", 3.5)]
    target = _target({"meta": {"world_size": 2}, "rows": rows}, "default within 10%")
    assert target.status == "missed" and target.lines[0] == "allreduce 1 KiB graph: default 3.50 us vs push-ldst-c1 3.00 us"


def test_a_bad_purlin_default_misses_its_targets():
    rows = [timed("nccl", "default", 8.0), timed("purlin", "default", NAN),
            timed("purlin", "push-ldst-c1", 3.0, options=PUSH1)]
    doc = {"meta": {"world_size": 2}, "rows": rows}
    assert _target(doc, "graph, 1 KiB and 16 KiB").status == "missed"
    assert _target(doc, "default within 10%").status == "missed"


def test_ratio_and_ok_need_real_times():
    assert report.ratio(8.0, 2.0) == 4.0
    for a, b in ((NAN, 2.0), (8.0, NAN), (INF, 2.0), (8.0, 0.0), (-8.0, 2.0), (None, 2.0), ("8", 2.0)):
        assert report.ratio(a, b) is None, (a, b)
    assert report.ok(timed("nccl", "default", 8.0)) and not report.ok(timed("nccl", "default", NAN))
    assert report.algbw_gbps(KiB, NAN) is None and report.pct_of_limit("allreduce", 2, KiB, INF) is None


def test_bad_numbers_never_reach_the_files(tmp_path):
    """Strict JSON out: the bad time becomes null beside its error; other NaNs (a bandwidth, a
    peak) null too; the tuning table holds no bad row."""
    rows = [timed("nccl", "default", 8.0), timed("purlin", "push-ldst-c16", NAN, options=PUSH16),
            timed("purlin", "push-ldst-c1", 3.0, options=PUSH1)]
    rows[0]["busbw_gbps"] = NAN
    doc = {"meta": {"world_size": 2, "peaks": {"ce": {"points": [{"bytes": GiB, "gbps": NAN}]}}}, "rows": rows}
    paths = report.write_all(doc, tmp_path, "run", plots=False)
    written = strict_json(paths["json"].read_text())
    assert written["rows"][1]["time_us"] is None and written["rows"][1]["bad_time"] == "nan"
    assert written["rows"][0]["busbw_gbps"] is None and written["meta"]["peaks"]["ce"]["points"][0]["gbps"] is None
    assert strict_json(paths["tuning"].read_text())["allreduce"]["2"][0]["variant"] == "push-ldst-c1"
    assert strict_json(report.results_json(doc))["rows"][1]["error"].startswith("bad timing")
    again = report.prepared(report.load_results(paths["json"]))["rows"]  # re-read: still counted
    assert report.bad_timings(again) == 1 and report.best_purlin(again, "allreduce", KiB, "graph")["time_us"] == 3.0


def test_report_cli_says_how_many_rows_had_bad_times(tmp_path, capsys):
    src = tmp_path / "in.json"
    src.write_text(json.dumps({"meta": {"world_size": 2}, "rows": [
        timed("nccl", "default", 8.0), timed("purlin", "push-ldst-c16", 0.0, options=PUSH16),
        timed("purlin", "default", -1.0), timed("purlin", "push-ldst-c1", 3.0, options=PUSH1)]}))
    assert report.main([str(src), "--out-dir", str(tmp_path), "--stem", "x", "--no-plots"]) == 0
    captured = capsys.readouterr()
    assert "- 2 rows with a time that is not a finite positive number" in captured.out
    assert captured.err.strip().startswith("report.py: 2 rows with a time that is not a finite positive number")
    assert "-8.00x" not in captured.out and "ZeroDivision" not in captured.err


@pytest.mark.parametrize("text,says", [
    ("", "the results file is empty"),
    ("   \n", "the results file is empty"),
    ("{not json", "not JSON (Expecting property name enclosed in double quotes at line 1 column 2)"),
    ("[]", "got a list"),
    ("{}", 'got no "rows"'),
    ('{"rows": {}}', 'got "rows" an object'),
    ('{"rows": [], "meta": []}', '"meta" should be an object, not a list'),
    ('{"rows": [1]}', "row 0: expected an object, got an integer"),
    ('{"rows": [{"bytes": "1K"}]}', "row 0: bytes '1K' should be an integer (or null), not a string"),
    ('{"rows": [{"collective": 3}]}', "row 0: collective 3 should be a string (or null), not an integer"),
    ('{"rows": [{"world_size": 0}]}', "row 0: world_size 0 should be at least 1"),
    ('{"rows": [{"bytes": true}]}', "row 0: bytes True should be an integer (or null), not a boolean"),
    ('{"rows": [], "meta": {"world_size": "2"}}', "meta world_size '2' should be a positive integer"),
    ('{"rows": [], "meta": {"peaks": {"ce": {"points": 3}}}}', "meta peaks 'ce' points should be a list of objects"),
    # rows the tables would leave out without a word: a system they do not select, no time
    ('{"rows": [{"system": "mscclpp", "variant": "default", "collective": "allreduce", "bytes": 1024, '
     '"mode": "graph", "time_us": 5.0}]}', "row 0: unknown system 'mscclpp'; expected one of nccl, symm_mem, purlin"),
    ('{"rows": [{"system": "nccl", "variant": "default", "collective": "allreduce", "bytes": 1024, '
     '"mode": "graph", "median_us": 5.0}]}', "row 0: no time_us in a row without an error"),
])
def test_report_cli_rejects_a_file_it_cannot_read(tmp_path, capsys, text, says):
    """One line on stderr naming the file and what is wrong, exit status 2, no traceback."""
    src = tmp_path / "in.json"
    src.write_text(text)
    assert report.main([str(src), "--out-dir", str(tmp_path / "out"), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"report.py: error: {src}: ") and says in err, err
    assert not (tmp_path / "out").exists()


def test_report_cli_rejects_a_missing_file(tmp_path, capsys):
    assert report.main([str(tmp_path / "absent.json")]) == 2
    assert capsys.readouterr().err == (f"report.py: error: {tmp_path / 'absent.json'}: cannot read the results "
                                       "file (No such file or directory)\n")


def test_every_stored_results_file_reads():
    """The shape check accepts what bench.py has written (benchmarks/results) and refuses the
    other tools' results there (e2e, moe_dispatch, epilogue: rows without a collective)."""
    files = sorted((BENCH / "results").glob("*.json"))
    docs = [f for f in files if not f.name.endswith("-tuning.json") and '"rows"' in f.read_text()[:200000]]
    read = 0
    for f in docs:
        doc = json.loads(f.read_text())
        if isinstance(doc, dict) and isinstance(doc.get("rows"), list) and doc["rows"] \
                and isinstance(doc["rows"][0], dict):
            if {"system", "variant", "collective"} <= set(doc["rows"][0]):
                report.load_results(f)
                read += 1
            else:
                with pytest.raises(report.ResultsError, match="not a benchmarks/bench.py result"):
                    report.load_results(f)
    assert read >= 3  # run21 and the two in-situ runs


# --------------------------------------------------------------------------- markdown, files, plots


def test_markdown_contents():
    doc = synthetic_doc()
    doc["rows"].append(row("purlin", "push-tma-c8", "allgather", KiB, "graph", 1.0, error="load: NVRTC failed\nlong"))
    doc["rows"].append(row("purlin", "push-ce", "allgather", KiB, "graph", 1.0, checked=False))
    doc["rows"][-1]["check_note"] = "3 of 512 elements differ"
    md = report.markdown(doc)
    assert md.startswith("# Collective benchmark: h200x2, 2026-11-30, R=2")
    for coll in report.COLLECTIVES:
        assert f"## {coll}, graph" in md and f"## {coll}, eager" in md
    assert "symm_mem best us" in md  # allreduce table only
    assert "## CORRECTNESS FAILURES" in md and "3 of 512 elements differ" in md
    assert "## Errors" in md and "push-tma-c8" in md
    assert md.rstrip().splitlines()[-1].startswith("    - ")  # the targets come last
    assert "## Targets" in md and "**MET**" in md
    table = md.split("## allreduce, graph")[1].split("##")[0]
    assert "| best NCCL |" in table and "| limit us |" in table
    line_1k = next(l for l in table.splitlines() if l.startswith("| 1 KiB"))
    assert "push-ldst-c1" in line_1k and "4.00x" in line_1k  # best variant vs the best NCCL at 1 KiB
    assert "| default |" in line_1k  # the best NCCL row is named


def test_write_all_and_cli(tmp_path):
    doc = synthetic_doc()
    src = tmp_path / "in.json"
    src.write_text(json.dumps(doc))
    assert report.main([str(src), "--out-dir", str(tmp_path / "out"), "--stem", "x", "--no-plots"]) == 0
    out = tmp_path / "out"
    assert json.loads((out / "x.json").read_text())["rows"]
    assert (out / "x.md").read_text().startswith("# Collective benchmark")
    written = json.loads((out / "x.json").read_text())
    assert all("limit_us" in r for r in written["rows"])
    assert len((out / "x.json").read_text().splitlines()) == len(written["rows"]) + 3  # compact: a row a line
    tuning = json.loads((out / "x-tuning.json").read_text())
    assert "allreduce" in tuning
    assert not list(out.glob("*.png"))


def test_plots(tmp_path):
    pytest.importorskip("matplotlib")
    files = report.plot(synthetic_doc(), tmp_path, "run")
    assert 1 <= len(files) <= 6
    for f in files:
        assert f.exists() and f.stat().st_size > 1000


def test_dry_run_plan_without_torch(capsys):
    """bench.py --dry-run needs neither torch nor a GPU."""
    bench = _load("bench")
    assert bench.main(["--dry-run", "--world-size", "4", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "R=4" in out and "estimated wall time" in out and "allreduce" in out
    assert bench.torch is None  # torch was never imported by the dry run
    plan = bench.make_plan(bench.parse_args(["--collectives", "allreduce,gather", "--systems", "nccl,purlin",
                                             "--variants", "default,push-ce", "--max-bytes", "1M"]))
    assert plan.collectives == ["allreduce", "gather"] and plan.sizes[-1] == MiB
    assert [v.name for v in plan.variants] == ["default", "push-ce"]
    # NCCL default + nomix everywhere, symm where NCCL has symmetric kernels; ce moves bytes only
    assert plan.cases("allreduce") == 4 and plan.cases("gather") == 4
    assert plan.views(KiB) == [("eager", None), ("graph", 20), ("graph", 100)]
    assert plan.views(256 * MiB) == [("eager", None), ("graph", 20)]  # 100-call graphs up to 16 MiB
    quick = bench.make_plan(bench.parse_args(["--quick"]))
    assert quick.views(2 * MiB) == [("eager", None), ("graph", 20)] and quick.sizes[1] == 16 * KiB
    assert "zerocopy" in [v.name for v in quick.variants]
    # zerocopy runs on the default's loaded collective: no load of its own
    assert quick.loads() == bench.make_plan(bench.parse_args(["--quick", "--variants",
        ",".join(v.name for v in quick.variants if v.name != "zerocopy")])).loads()


def test_variant_spec():
    api = _load("purlin_api")
    v = api.parse_variant("ring8:algorithm=ring,atom=ldst,channels=8,slices=2")
    assert v.name == "ring8" and v.options == {"algorithm": "ring", "atom": "ldst", "channels": 8, "slices": 2}
    assert api.parse_variant("ll: packed = yes , channels=4").options == {"packed": True, "channels": 4}
    with pytest.raises(ValueError):
        api.parse_variant("bad:colour=blue")


@pytest.mark.parametrize("spec,says", [
    ("garbage", "expected 'NAME:algorithm=ring"),  # was: silently the default variant
    (":atom=ldst", "expected 'NAME:algorithm=ring"),
    ("x:", "no options"),
    ("x:algorithm=nope", "unknown algorithm 'nope'; choose from direct-push, direct-pull, two-shot, ring"),
    ("x:atom=foo", "unknown atom 'foo'; choose from ldst, tma, ce"),
    ("x:channels=0", "channels '0' should be a positive integer"),
    ("x:slices=two", "slices 'two' should be a positive integer"),
    ("x:packed=maybe", "packed 'maybe' should be one of 1, true, yes, 0, false, no"),
    ("x:channels", "option 'channels' has no value"),
    ("x:channels=2,channels=4", "option 'channels' given twice"),
    ("x:params=a", "unknown option 'params'"),
    ("x:atom=ce,packed=true", "packed=true needs an atom that packs (ldst, tma), not 'ce'"),
    ("x:algorithm=ring,packed=1", "packed=true needs an algorithm that packs (direct-push), not 'ring'"),
])
def test_variant_spec_errors_name_what_is_wrong(spec, says):
    """The names come from the runtime's registries (purlinc.snac.algorithms, purlinc.atom.atoms)."""
    api = _load("purlin_api")
    with pytest.raises(ValueError) as error:
        api.parse_variant(spec)
    assert str(error.value) == f"--variant-spec {spec!r}: " + str(error.value).split(": ", 1)[1]
    assert says in str(error.value)
    names = [v.name for v in api.VARIANTS]
    assert names[0] == "default" and len(set(names)) == len(names)
    assert set(api.QUICK_VARIANTS) <= set(names)


# --------------------------------------------------------------------------- purlin/hierarchical


def hier_doc() -> dict:
    """synthetic_doc plus purlin/hierarchical rows: g2 everywhere, g1 too except gather (whose
    load 'failed'), one wrong g1 row, and hierarchical rows far faster than every Purlin one."""
    doc = synthetic_doc()
    rows = doc["rows"]
    for coll in report.COLLECTIVES:
        for g in (2, 1):
            if g == 1 and coll == "gather":
                rows.append({"system": report.HIER, "variant": "g1", "collective": coll, "dtype": "bfloat16",
                             "bytes": None, "world_size": 2, "mode": None, "time_us": None, "checked": None,
                             "options": {"gpus_per_node": 1}, "error": "load: TopologyError: no plan", "phase": "load"})
                continue
            for nbytes in (KiB, 64 * KiB, MiB, 16 * MiB, 256 * MiB, GiB):
                for mode in ("eager", "graph"):
                    wrong = g == 1 and coll == "alltoall" and nbytes == MiB and mode == "graph"
                    rows.append(row(report.HIER, f"g{g}", coll, nbytes, mode, 0.01 * g, checked=not wrong,
                                    options={"gpus_per_node": g, "nodes": 2 // g}))
    return doc


def test_hierarchical_rows_stay_out_of_purlin_choices():
    doc = hier_doc()
    rows = report.prepared(doc)["rows"]
    best = report.best_purlin(rows, "allreduce", KiB, "graph")
    assert best["system"] == "purlin" and best["variant"] == "push-ldst-c1"
    assert report.tuning_table(doc) == report.tuning_table(synthetic_doc())
    assert [(t.name, t.status, t.lines) for t in report.targets(doc)] == \
        [(t.name, t.status, t.lines) for t in report.targets(synthetic_doc())]
    assert report.hier_variants(rows) == ["g2", "g1"]
    assert report.hier_load_errors(rows) == {("gather", "g1"): "load: TopologyError: no plan"}


def test_hierarchical_table_and_markdown():
    doc = hier_doc()
    rows = report.prepared(doc)["rows"]
    table = report.hierarchical_table(report.select(rows, "graph"), "graph", report.hier_load_errors(rows))
    assert table[0] == ("| collective | size | NCCL default us | best NCCL | best NCCL us | Purlin default us | "
                        "g2 (1x2) us | g2 vs best NCCL | g1 (2x1) us | g1 vs best NCCL | limit us | checked |")
    line = next(l for l in table if l.startswith("| allreduce | 1 KiB |"))
    nccl = 8.0 + KiB / 300e3
    assert f"| {report._num(0.02)} | {report._fmt_ratio(nccl / 0.02)} | {report._num(0.01)} |" in line
    assert line.endswith(f"| {report._num(report.limit_us('allreduce', 2, KiB))} | yes |")
    gather = next(l for l in table if l.startswith("| gather | 1 KiB |"))
    assert "| no load | - |" in gather and gather.endswith("| yes |")
    wrong = next(l for l in table if l.startswith("| alltoall | 1 MiB |"))
    assert " WRONG " in wrong and wrong.endswith("| FAIL |")
    assert len(table) == 2 + 8 * 6
    md = report.markdown(doc)
    assert "## purlin/hierarchical beside NCCL, graph, 20 calls per graph" not in md  # no calls_per_graph here
    assert "## purlin/hierarchical beside NCCL, graph" in md and "## purlin/hierarchical beside NCCL, eager" in md
    assert "purlin/hierarchical/g1 alltoall 1 MiB graph" in md  # listed under CORRECTNESS FAILURES
    assert "- purlin/hierarchical/g1 gather (1 rows): load: TopologyError: no plan" in md
    # Without hierarchical rows the report has no such section.
    assert "purlin/hierarchical" not in report.markdown(synthetic_doc())
    assert report.hierarchical_table(report.select(report.prepared(synthetic_doc())["rows"], "graph"), "graph") == []


def test_hierarchical_series_in_plots():
    rows = report.select(report.prepared(hier_doc())["rows"], "graph")
    series = report._series(rows, "allreduce", "graph", "time_us")
    assert series["hierarchical g2"][0] == (KiB, 0.02) and "hierarchical g1" in series
    assert all(n != MiB for n, _ in report._series(rows, "alltoall", "graph", "time_us")["hierarchical g1"])


def test_hierarchical_plan_and_flags():
    bench = _load("bench")
    args = bench.parse_args(["--quick", "--world-size", "4", "--collectives", "allreduce,gather",
                             "--systems", "nccl,purlin/hierarchical", "--nccl-variants", "default"])
    plan = bench.make_plan(args)
    assert plan.hier == (4, 1) and plan.hier_loads() == 4
    assert plan.cases("allreduce") == 1 + 2 and plan.cases("gather") == 1 + 2 and plan.loads() == 0
    assert "purlin/hierarchical" in bench.SYSTEMS and bench.make_plan(bench.parse_args(["--quick"])).hier == (2, 1)
    assert bench.hier_gpus_per_node("2,R,2, 1", 8) == (2, 8, 1)
    assert bench.hier_gpus_per_node("R,1", 1) == (1,)
    assert bench.hier_gpus_per_node("3", 4) == (3,)  # kept: its load records the TopologyError
    with pytest.raises(bench.PlanError, match="not a positive number"):
        bench.hier_gpus_per_node("0", 2)
    off = bench.make_plan(bench.parse_args(["--quick", "--systems", "nccl,symm_mem,purlin"]))
    assert off.hier_loads() == 0 and off.cases("allreduce") == bench.make_plan(bench.parse_args(
        ["--quick", "--systems", "nccl,symm_mem,purlin", "--hier-gpus-per-node", "1"])).cases("allreduce")
    text = bench.describe_plan(plan, args, 4)
    assert "purlin/hierarchical: gpus_per_node 4, 1 (1 x 4, 4 x 1 nodes x GPUs), 4 loads" in text
    assert "not a divisor" in bench.describe_plan(bench.make_plan(bench.parse_args(
        ["--world-size", "4", "--hier-gpus-per-node", "3"])), args, 4)


def test_hierarchical_case_buffer_conventions():
    """hier_case calls the loaded collective with the flat call's conventions plus count=, on
    every rank; the output it checks is None where the rank has none."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    cases = _lib("cases")
    for coll in report.COLLECTIVES:
        lay = report.layout(coll, 2, 4 * KiB)
        for rank in (0, 1):
            calls = []

            def fake(x=None, out=None, op="sum", *, count=None, dtype=None):
                calls.append((x, out, op, count, dtype))
                return out

            fake.check = lambda: calls.append("check")
            ctx = SimpleNamespace(rank=rank, world=2, hcolls={(coll, 1): fake})
            X, Y = torch.ones(lay.in_elems), torch.zeros(lay.out_elems)
            case = cases.hier_case(ctx, coll, 1, lay, X, Y)
            assert (case.system, case.variant, case.options) == ("purlin/hierarchical", "g1",
                                                                 {"gpus_per_node": 1, "nodes": 2})
            assert case.repeat_safe
            fresh = torch.arange(lay.in_elems, dtype=torch.float32)
            case.load(fresh)
            assert torch.equal(X, fresh) and bool(torch.isnan(Y).all())  # fresh input, poisoned output
            case.call()
            case.after()
            (x, out, op, count, dtype), check = calls
            assert check == "check" and count == lay.count and dtype is None
            assert (x is None) == (rank != 0 and coll in ("broadcast", "scatter"))
            assert (out is None) == (rank != 0 and coll in ("reduce", "gather"))
            assert x is None or x is X
            assert out is None or out is Y
            assert op == "sum"
            assert (case.output() is None) == (rank != 0 and coll in ("reduce", "gather"))


def test_hierarchical_precompile_jobs(tmp_path, monkeypatch):
    """The precompile compiles the intra-phase sources a hierarchical load uses (the runtime's
    own intra_sources, NVRTC, no GPU); a second run finds them all in the cache."""
    api = _load("purlin_api")
    jobs = api.hier_precompile_jobs(["allreduce", "gather"], (2, 1, 3), 2)
    assert [(j["collective"], j["variant"], j["gpus_per_node"]) for j in jobs] == [
        ("allreduce", "hierarchical-g2", 2), ("allreduce", "hierarchical-g1", 1),
        ("gather", "hierarchical-g2", 2), ("gather", "hierarchical-g1", 1)]  # 3 does not divide R=2
    monkeypatch.setenv("PURLIN_CACHE_DIR", str(tmp_path))
    assert api.precompile_one(jobs[0], "sm_90") == "allreduce/hierarchical-g2: ok (2 phase sources)"
    # gather over 2 nodes x 1 GPU: only the root's node has an intra phase with work
    assert api.precompile_one(jobs[3], "sm_90") == "gather/hierarchical-g1: ok (1 phase sources)"
    cached = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert cached
    api.precompile_one(jobs[0], "sm_90")
    api.precompile_one(jobs[3], "sm_90")
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == cached


def test_graph_replays_amortise_host_lag():
    """A timed graph repeat replays a short graph many times back to back (so the ranks'
    host lag between repeats is spread over every replay), a long one once; the count depends
    only on values every rank agrees on (the slowest rank's replay time, the target)."""
    pytest.importorskip("torch")
    timing = _lib("timing")
    assert timing.graph_replays(40.0, 3000.0) == 75  # 20 calls of 2 us per replay
    assert timing.graph_replays(180.0, 3000.0) == 16  # 100 calls of 1.8 us
    assert timing.graph_replays(10.0, 3000.0) == 100  # capped
    assert timing.graph_replays(16000.0, 3000.0) == 1  # a 256 MiB graph is long enough alone
    assert timing.graph_replays(0.0, 3000.0) == 100  # a zero time cannot divide by zero


def test_eager_iters_fill_a_repeat():
    """An eager repeat holds about target_rep_us of back-to-back calls, by the slowest rank's
    measured per-call time (so every rank makes the same number of calls), 2 to 1,000."""
    pytest.importorskip("torch")
    timing = _lib("timing")
    assert timing.eager_iters(6.0, 3000.0) == 500  # a 1 KiB call issuing in 6 us
    assert timing.eager_iters(40.0, 3000.0) == 75  # an NCCL eager call
    assert timing.eager_iters(1.0, 3000.0) == 1000  # capped
    assert timing.eager_iters(800.0, 3000.0) == 3  # a 256 MiB call
    assert timing.eager_iters(5000.0, 3000.0) == 2  # never fewer than two
    assert timing.eager_iters(0.0, 3000.0) == 1000  # a zero time cannot divide by zero


def test_cpu_list_parsing():
    assert report.parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert report.parse_cpu_list("5") == [5]
    assert report.parse_cpu_list("") == []


def test_cpu_cores_split_physical_cores(monkeypatch):
    """--cpu-affinity cores: no two local ranks share a physical core or its SMT sibling, and
    each gets an equal share; without topology every CPU counts as a core."""
    pytest.importorskip("torch")
    bench = _load("bench")
    siblings = {c: f"{c % 8},{c % 8 + 8}" for c in range(16)}  # 8 cores, siblings c and c+8

    def fake_read(path):
        cpu = int(str(path).split("/cpu/cpu")[1].split("/")[0])
        return siblings[cpu]

    monkeypatch.setattr(bench.Path, "read_text", lambda self: fake_read(self))
    cpus = list(range(16))
    r0, r1 = (bench.cpu_cores_for(r, 2, cpus) for r in (0, 1))
    assert r0 == [0, 2, 4, 6, 8, 10, 12, 14] and r1 == [1, 3, 5, 7, 9, 11, 13, 15]
    assert not set(r0) & set(r1)
    assert bench.cpu_cores_for(0, 16, cpus) == cpus  # fewer cores than ranks: every rank keeps all

    def unreadable(self):
        raise OSError("no sysfs")

    monkeypatch.setattr(bench.Path, "read_text", unreadable)
    assert bench.cpu_cores_for(1, 2, [0, 1, 2, 3]) == [1, 3]


def test_calls_us_times_back_to_back_calls(monkeypatch):
    """calls_us: ``warm`` untimed calls and a sync, then ``calls`` calls between one event
    pair, per call in us (CUDA events replaced by a clock that advances 7 ms per timed call)."""
    pytest.importorskip("torch")
    timing = _lib("timing")
    log = []

    class Event:
        def record(self):
            log.append(("record", len([e for e in log if e == "call"])))

        def synchronize(self):
            pass

        def elapsed_time(self, end):  # ms between the two records: 7 ms per call in between
            starts = [n for kind, n in (e for e in log if e != "call" and e != "sync")]
            return 7.0 * (starts[-1] - starts[-2])

    monkeypatch.setattr(timing, "_events", lambda: (Event(), Event()))
    monkeypatch.setattr(timing, "sync", lambda: log.append("sync"))
    case = type("Case", (), {"call": lambda self: log.append("call"), "after": None})()
    assert timing.calls_us(case.call, 4, warm=3) == pytest.approx(7000.0)
    assert log[:4] == ["call"] * 3 + ["sync"]
    assert log.count("call") == 7


def test_target_ranges_over_runs():
    """scripts/target_ranges.py: each target's runs met, and every point's range over runs, from
    the same checks as the per-run report (Target.points beside Target.lines)."""
    ranges = _load("target_ranges", BENCH.parent / "scripts")
    fast, slow = good_doc(2.0, 2.9), good_doc(2.4, 2.9)  # 2.4 us misses the 2.3 us bound
    small = _target(fast, "graph, 1 KiB and 16 KiB")
    assert [p[0] for p in small.points][:2] == ["allreduce 1 KiB", "allreduce 16 KiB"]
    assert small.points[0][1] is True and small.points[0][2]["us"] == pytest.approx(2.0 + KiB / 380e3)
    text = ranges.ranges([fast, slow])
    section = text.split("## graph, 1 KiB and 16 KiB")[1].split("## ")[0]
    assert "Met in 1 of 2 runs." in section
    line = next(x for x in section.splitlines() if x.startswith("| allreduce 1 KiB |"))
    assert line.startswith("| allreduce 1 KiB | 1 of 2 | 2.00-2.40 |"), line
    assert "## graph, 64 KiB" in text and "footprint" not in text  # reports are not targets


# --------------------------------------------------------------------------- in situ


def insitu_rows(calls=20, wrong=None):
    """In-situ rows: NCCL symm adds 4.2 us at 1 KiB, Purlin default 3.0, the staged graph 5.5."""
    out = []
    for nbytes in (KiB, MiB):
        for system, variant, added in (("nccl", "symm", 4.2), ("purlin", "default", 3.0),
                                       ("purlin", "graph-staged", 5.5)):
            r = row(system, variant, "allreduce", nbytes, "insitu", added * (1 if nbytes == KiB else 4))
            r.update(calls_per_graph=calls, step_us=9.0 + added, base_us=9.0, algbw_gbps=None, busbw_gbps=None)
            if wrong == (variant, nbytes):
                r["checked"] = False
            out.append(r)
    return out


def test_insitu_view_is_asked_for_and_kept_apart():
    bench = _load("bench")
    plan = bench.make_plan(bench.parse_args(["--modes", "graph,insitu", "--calls-per-graph", "20,100",
                                             "--many-calls-max-bytes", "1M"]))
    assert plan.views(KiB) == [("graph", 20), ("graph", 100), ("insitu", 20), ("insitu", 100)]
    assert plan.views(16 * MiB) == [("graph", 20), ("insitu", 20)]
    assert bench.make_plan(bench.parse_args([])).views(KiB) == [("eager", None), ("graph", 20), ("graph", 100)]
    # graph-staged is the default's load captured with PURLIN_GRAPH_BUFFERS=stage: no load of its own
    api = _load("purlin_api")
    staged = next(v for v in api.VARIANTS if v.name == "graph-staged")
    assert staged.graph_buffers == "stage" and api.load_key(staged) == api.load_key(api.VARIANTS[0])
    # in-situ rows never enter the back-to-back views, the best-variant choice or the targets
    doc = synthetic_doc()
    doc["rows"] += insitu_rows()
    rows = report.prepared(doc)["rows"]
    assert ("insitu", 20) not in report.views(rows)
    assert report.best_purlin(rows, "allreduce", KiB, "insitu") is None  # default/graph-staged: choices
    assert report.tuning_table(doc) == report.tuning_table(synthetic_doc())


def test_insitu_table_and_markdown():
    rows = report.prepared({"rows": insitu_rows()})["rows"]
    assert report.insitu_counts(rows) == [20]
    table = report.insitu_table(rows, 20)
    assert table[0] == ("| collective | size | without us | nccl/symm adds us | purlin/default adds us | "
                        "purlin/graph-staged adds us | checked |")
    assert table[2] == "| allreduce | 1 KiB | 9.00 | 4.20 | 3.00 | 5.50 | yes |"
    assert report.insitu_table(rows, 100) == []
    wrong = report.insitu_table(report.prepared({"rows": insitu_rows(wrong=("default", MiB))})["rows"], 20)
    assert wrong[3].endswith("| 12.0 WRONG | 22.0 | FAIL |")
    doc = synthetic_doc()
    doc["rows"] += insitu_rows()
    md = report.markdown(doc)
    assert "## In situ: what a call adds between a producer and a consumer kernel (20 steps per graph)" in md
    assert "Loopback rows (one GPU) say nothing about link speed." in md
    assert "## In situ" not in report.markdown(synthetic_doc())


def test_loopback_rows_are_never_a_tuned_choice():
    loop = row("purlin", "push-ldst-c1@loopback", "allreduce", KiB, "graph", 0.01, options=PUSH1)
    loop["loopback"] = True
    doc = synthetic_doc()
    doc["rows"].append(loop)
    assert report.best_purlin(report.prepared(doc)["rows"], "allreduce", KiB, "graph")["variant"] != loop["variant"]


def test_insitu_loopback_arguments_without_torch(capsys):
    tool = _load("insitu_loopback")
    args = tool.parse_args(["--ranks", "4", "--sizes", "1K,1M", "--variants", "default,graph-staged,push-ll-c1"])
    assert args.ranks == 4 and args.size_list == [KiB, MiB]
    assert [v.name for v in args.variant_list] == ["default", "graph-staged", "push-ll-c1"]
    with pytest.raises(SystemExit) as stop:
        tool.parse_args(["--collectives", "allreduce,allthings"])
    assert stop.value.code == 2 and "--collectives: unknown collectives 'allthings'" in capsys.readouterr().err


def test_insitu_kernels_write_the_input_and_read_the_output():
    """The producer writes the tensor the collective reads (a scratch one on a rank without
    input), from its source; the consumer reads the output (a scratch one where there is none)."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    insitu = _lib("insitu")
    lay = report.layout("allreduce", 2, 4 * KiB)
    X, Y = torch.zeros(lay.in_elems, dtype=torch.bfloat16), torch.zeros(lay.out_elems, dtype=torch.bfloat16)
    case = SimpleNamespace(input=lambda: X, output=lambda: Y)
    kernels = insitu.around(case, lay, "cpu")
    kernels.source.copy_(torch.arange(lay.in_elems, dtype=torch.bfloat16))
    kernels.produce()
    assert torch.equal(X, kernels.source)
    Y.fill_(2.0)
    assert bool((kernels.consume() == 3.0).all())
    before = X.clone()
    bare = SimpleNamespace(input=lambda: None, output=lambda: None)  # a rank with neither
    kernels = insitu.around(bare, lay, "cpu")
    kernels.source.fill_(7.0)
    assert bool((kernels.produce() == 7.0).all()) and kernels.consume().numel() == lay.out_elems
    assert torch.equal(X, before)  # scratch tensors: nothing the collective owns is touched


def test_staging_writes_count_the_copies_a_registered_twin_leaves_out():
    """insitu_loopback's ``staging_writes``: the staged all-reduce writes slices into staging
    every call (R=2: its input's two halves; R=4: more), its registered twin writes none."""
    pytest.importorskip("torch")
    from purlinc import pipeline
    from purlinc.runtime.zerocopy import twin_compiled

    loopback = _lib("loopback")
    for world, staged_writes in ((2, 2), (4, 12)):
        staged = pipeline.prepare(str(BENCH.parent / "examples" / "allreduce.pln"), world_size=world)
        assert loopback.staging_writes(staged.schedule) == staged_writes
        assert loopback.staging_writes(twin_compiled(staged).schedule) == 0


@pytest.mark.parametrize("script", ["bench.py", "ll_sweep.py", "loopback_slices.py", "epilogue_overhead.py",
                                    "host_path.py", "trace_overhead.py", "compile_times.py",
                                    "moe_dispatch.py", "insitu_loopback.py", "e2e/run.py"])
def test_every_benchmark_script_starts(script):
    """Each script's imports resolve from a plain checkout (``--help`` runs them, then stops)."""
    pytest.importorskip("torch")
    import subprocess

    done = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True,
                          timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(BENCH.parent)})
    assert done.returncode == 0 and "usage" in done.stdout, done.stderr[-2000:]


def test_an_in_situ_time_at_or_below_zero_is_a_measurement_not_an_error():
    """An in-situ row's time is a difference of two steps: noise may put it at or below zero,
    which says the call added nothing measurable; only a non-finite one is no timing."""
    from benchlib import rows

    base = {"system": "purlin", "variant": "default", "collective": "allreduce", "nbytes": 1024, "mode": "insitu",
            "calls_per_graph": 20, "checked": True, "error": None}
    for t in (-0.4, 0.0, 1.5):
        row = rows.normalize({**base, "time_us": t})
        assert row["time_us"] == t and rows.ok(row), row
    bad = rows.normalize({**base, "time_us": float("nan")})
    assert bad["time_us"] is None and not rows.ok(bad) and "is not a finite number" in bad["error"]
    graph = rows.normalize({**base, "mode": "graph", "time_us": 0.0})
    assert graph["time_us"] is None and "is not a finite positive number" in graph["error"]


# --------------------------------------------------------------------------- only bench.py results


SCRIPTS = BENCH.parent / "scripts"


def _bench_file(tmp_path, name="run.json", *, world=2, rows=None) -> Path:
    path = tmp_path / name
    doc = {"meta": {"world_size": world}, "rows": rows if rows is not None else [
        row("nccl", "default", "allreduce", KiB, "graph", 8.0, world=world),
        row("purlin", "default", "allreduce", KiB, "graph", 3.0, world=world)]}
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("name", ["2026-12-02-h200x1-loopback-moe.json", "2026-12-02-h200x1-loopback-e2e-r4.json",
                                  "2026-12-02-h200x1-loopback-epilogue.json"])
def test_report_refuses_another_tools_result_and_leaves_it_alone(tmp_path, capsys, name):
    src = tmp_path / name
    src.write_text((BENCH / "results" / name).read_text())
    before = src.read_text()
    assert report.main([str(src), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"report.py: error: {src}: row 0: no ") \
        and "not a benchmarks/bench.py result" in err, err
    assert src.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_two_rows_with_one_key_are_an_error_naming_the_key(tmp_path, capsys):
    twice = row("nccl", "default", "allreduce", KiB, "graph", 8.0)
    src = _bench_file(tmp_path, rows=[twice, dict(twice, time_us=9.0)])
    assert report.main([str(src), "--no-plots"]) == 2
    assert capsys.readouterr().err == (f"report.py: error: {src}: rows 0 and 1 have the same key (system nccl, "
                                       "variant default, collective allreduce, bytes 1024, mode graph, "
                                       "calls_per_graph None)\n")


def test_merging_runs_of_different_world_sizes_is_refused(tmp_path, capsys):
    two, four = _bench_file(tmp_path, "r2.json"), _bench_file(tmp_path, "r4.json", world=4)
    assert report.main([str(two), str(four), "--out-dir", str(tmp_path / "out"), "--no-plots"]) == 2
    assert capsys.readouterr().err == (f"report.py: error: {four}: world size 4, but {two} has world size 2; runs "
                                       "of different world sizes cannot be merged into one report\n")
    assert not (tmp_path / "out").exists()
    assert report.main([str(two), str(_bench_file(tmp_path, "again.json")), "--out-dir", str(tmp_path / "out"),
                        "--no-plots"]) == 0


def test_merging_runs_on_different_gpus_is_refused(tmp_path, capsys):
    """Split runs merge; an H100 run and an H200 run do not: the report's ratios would put one
    machine's NCCL against the other's Purlin."""
    def on(name, gpu):
        path = _bench_file(tmp_path, name)
        doc = json.loads(path.read_text())
        path.write_text(json.dumps({**doc, "meta": {**doc["meta"], "gpus": [gpu, gpu]}}))
        return path

    h200, h100 = on("h200.json", "NVIDIA H200"), on("h100.json", "NVIDIA H100 80GB HBM3")
    assert report.main([str(h200), str(h100), "--out-dir", str(tmp_path / "out"), "--no-plots"]) == 2
    assert capsys.readouterr().err == (f"report.py: error: {h100}: GPUs NVIDIA H100 80GB HBM3, NVIDIA H100 80GB HBM3, "
                                       f"but {h200} ran on NVIDIA H200, NVIDIA H200; runs on different GPUs cannot be "
                                       "merged into one report (their ratios would compare machines)\n")
    assert not (tmp_path / "out").exists()
    for other in (on("h200-again.json", "NVIDIA H200"), _bench_file(tmp_path, "unstated.json")):
        assert report.main([str(h200), str(other), "--out-dir", str(tmp_path / "out"), "--no-plots"]) == 0


@pytest.mark.parametrize("change,says", [
    (lambda d: d["rows"][0].update(variant=None), "row 0: no variant: not a benchmarks/bench.py result"),
    (lambda d: d["rows"][1].update(world_size=4), "row 1: world_size 4 differs from the run's 2"),
    (lambda d: d["meta"].update(purlin_footprint="x"), "meta purlin_footprint should be an object, not a string"),
    (lambda d: d["meta"].update(peaks={"ce": {"points": [{"bytes": "1K", "gbps": 3.0}]}}),
     "meta peaks 'ce' point bytes '1K' should be an integer (or null), not a string"),
    (lambda d: d["rows"][0].update(checked="no"), "row 0: checked 'no' should be a boolean (or null)"),
    (lambda d: d["rows"][0].update(options="x"), "row 0: options 'x' should be an object (or null)"),
    (lambda d: d["rows"][0].update(busbw_gbps="x"), "row 0: busbw_gbps 'x' should be a number (or null)"),
])
def test_report_rejects_bad_fields_in_one_line(tmp_path, capsys, change, says):
    src = _bench_file(tmp_path)
    doc = json.loads(src.read_text())
    change(doc)
    src.write_text(json.dumps(doc))
    assert report.main([str(src), "--out-dir", str(tmp_path / "out"), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"report.py: error: {src}: ") and says in err, err


def test_report_rejects_deeply_nested_json(tmp_path, capsys):
    src = tmp_path / "deep.json"
    src.write_text("[" * 100000 + "]" * 100000)
    assert report.main([str(src), "--no-plots"]) == 2
    assert capsys.readouterr().err.startswith(f"report.py: error: {src}: JSON nested too deeply to read")


def test_report_rejects_a_bad_out_dir_or_stem(tmp_path, capsys):
    src, afile = _bench_file(tmp_path), tmp_path / "afile"
    afile.write_text("")
    assert report.main([str(src), "--out-dir", str(afile), "--no-plots"]) == 2
    assert capsys.readouterr().err == f"report.py: error: {afile}: --out-dir is a file, not a folder\n"
    assert report.main([str(src), "--out-dir", str(tmp_path), "--stem", "a/b", "--no-plots"]) == 2
    assert capsys.readouterr().err == "report.py: error: --stem 'a/b': should be a file name stem, without a folder\n"


@pytest.mark.parametrize("script", ["target_ranges", "results_history", "readme_table"])
@pytest.mark.parametrize("text,says", [
    ("", "the results file is empty"),
    ('{"meta": {}, "rows": [', "not JSON"),
    ("[]", "got a list"),
    ('{"meta": {}}', 'got no "rows"'),
    ('{"meta": {}, "rows": null}', 'got "rows" null'),
    (None, "cannot read the results file"),
])
def test_scripts_reject_a_file_they_cannot_read_in_one_line(tmp_path, capsys, script, text, says):
    """The scripts read results through benchlib.files.load_results: one line, exit 2."""
    module = _load(script, SCRIPTS)
    src = tmp_path / "in.json"
    if text is not None:
        src.write_text(text)
    assert module.main([str(src)]) == 2
    err = capsys.readouterr().err
    assert err == f"{script}.py: error: {src}: " + err.split(f"{src}: ", 1)[1] and says in err and err.count("\n") == 1


@pytest.mark.parametrize("script", ["target_ranges", "results_history", "readme_table"])
def test_scripts_have_help(capsys, script):
    with pytest.raises(SystemExit) as stop:
        _load(script, SCRIPTS).main(["--help"])
    assert stop.value.code == 0 and capsys.readouterr().out.startswith(f"usage: {script}.py")


def test_results_history_skips_unchecked_rows_and_refuses_other_files(tmp_path, monkeypatch, capsys):
    history = _load("results_history", SCRIPTS)
    monkeypatch.setattr(history, "HISTORY", tmp_path / "history.csv")
    monkeypatch.setattr(history, "RUNS", tmp_path / "runs.csv")
    rows = [row("nccl", "default", "allreduce", KiB, "graph", 8.0),
            row("purlin", "default", "allreduce", KiB, "graph", 0.5, checked=False),
            row("purlin", "default", "allreduce", MiB, "graph", 30.0)]
    src = _bench_file(tmp_path, "2026-12-09-h200x2.json", rows=rows)
    assert history.main([str(src)]) == 0
    kept = (tmp_path / "history.csv").read_text().splitlines()[1:]
    assert [line.split(",")[5:7] + [line.split(",")[2]] for line in kept] == [
        ["nccl", "default", "1024"], ["purlin", "default", "1048576"]]
    e2e = BENCH / "results" / "2026-12-02-h200x1-loopback-e2e-r4.json"
    assert history.main([str(e2e)]) == 2
    assert "not a benchmarks/bench.py result" in capsys.readouterr().err
    assert len((tmp_path / "runs.csv").read_text().splitlines()) == 2  # header and the one bench run


def _summary(tmp_path, steps: str, monkeypatch):
    gpu = _load("gpu_summary", SCRIPTS)
    monkeypatch.setattr(gpu, "sh", lambda cmd: "")
    monkeypatch.setattr(gpu, "versions", lambda: {})
    (tmp_path / "steps.tsv").write_text(steps)
    assert gpu.cli([str(tmp_path)]) == 0
    return json.loads((tmp_path / "summary.json").read_text()), (tmp_path / "summary.md").read_text()


def test_gpu_summary_skips_and_lists_bad_steps_lines(tmp_path, monkeypatch, capsys):
    summary, md = _summary(tmp_path, "zz_a\t0\t12\n\nzz_b\t1\t2.5\nzz_c\t0\nzz_d\tx\t3\n", monkeypatch)
    assert [(s["name"], s["rc"], s["seconds"]) for s in summary["steps"]] == [("zz_a", 0, 12), ("zz_b", 1, 2.5)]
    assert [line.split(": ", 1)[0].rsplit(" ", 2)[1:] for line in summary["bad_steps_lines"]] == [
        ["line", "4"], ["line", "5"]]
    assert "2 columns, expected 3" in md and "Lines of steps.tsv skipped:" in md


def test_gpu_summary_reports_an_unreadable_junit_file(tmp_path, monkeypatch, capsys):
    name = f"zz_gpu_summary_{tmp_path.name}"
    xml = Path(f"/tmp/purlin_{name}.xml")
    xml.write_text('<testsuite tests="3"')
    try:
        summary, md = _summary(tmp_path, f"{name}\t0\t3\n", monkeypatch)
    finally:
        xml.unlink()
    assert summary["steps"][0]["junit"]["unreadable"].startswith("ParseError")
    assert f"| {name} | 0 | 3 | JUnit XML unreadable (ParseError" in md


def test_gpu_summary_without_a_folder_says_so(monkeypatch, capsys):
    monkeypatch.delenv("OUT", raising=False)
    assert _load("gpu_summary", SCRIPTS).cli([]) == 2
    assert capsys.readouterr().err == "gpu_summary.py: error: no output folder: give it as the argument or set $OUT\n"
